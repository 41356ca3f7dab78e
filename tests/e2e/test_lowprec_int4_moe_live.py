"""INT4 MoE experts end to end on CPU (lowprec/experts_int4.py): an engine server started with
`--quantization int4` on a tiny Qwen3-MoE re-packs its experts on every update over every
transport and passes `--check-weight-update-equal` within INT4's bound; a two-step
`milepost train --precision int4` on the tiny MoE runs with the trainer's fake-quant experts
matching what the engines serve (train/rollout log-prob gap ~0; opt-in: ~15 s)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.lowprec_runs import two_step_gaps
from milepost.testing.server_process import ServerProcess
from milepost.testing.transports import TRANSPORT_KINDS, make_transport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import TensorTransport
from milepost.weights.verify import WeightMismatchError, verify

BUCKET_BYTES = 24_000  # small: one expert's gate and up land in different buckets
EXPERT = "model.layers.1.mlp.experts.6.down_proj.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("i4moe")
    a = make_tiny_checkpoint(root / "a", "qwen3_moe", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3_moe", seed=1, with_tokenizer=False)
    with ServerProcess(a, "--max-total-tokens", "1024", "--page-size", "4", "--quantization", "int4") as srv:
        yield srv.url, list(load_file(b / "model.safetensors").items())



@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_every_transport_repacks_experts_and_passes_the_check(setup, kind: str, tmp_path: Path) -> None:
    url, named = setup
    quantized = httpx.get(f"{url}/weights_quantized").json()
    assert quantized["format"] == "int4" and EXPERT in quantized["names"]
    sync = WeightSync(make_transport(kind, url, tmp_path / "store"), BUCKET_BYTES, check_equal_once=True,
                      check_weight_update=True)
    try:
        assert sync.update(iter(named), f"{kind}-1").verified
        assert sync.update(iter([(n, t * 1.5) for n, t in named]), f"{kind}-2").verified
    finally:
        sync.close()
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    assert r.json()["meta_info"]["routed_experts"]


def test_expert_values_off_the_bound_fail_the_check(setup) -> None:
    url, named = setup
    with TensorTransport([url], timeout_s=30) as transport:
        WeightSync(transport, BUCKET_BYTES).update(iter(named), "whole")
    assert verify(named, [url]) == len(named)
    off = [(n, t * 1.6 if n == EXPERT else t) for n, t in named]  # past half a step of its groups
    with pytest.raises(WeightMismatchError, match=f"{EXPERT} \\(error .*x the int4 bound"):
        verify(off, [url])


@pytest.mark.optin  # ~15 s on 2 idle cores (40 s on busy ones): run with -m optin
def test_train_int4_on_a_tiny_moe(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=5)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gaps = two_step_gaps(tmp_path / "moe", tmp_path / "prompts.jsonl", tmp_path / "run",
                         "--precision", "int4")
    # The engines' experts are the trainer's fake-quant experts: the gap is float32 summation
    # order (4e-7 measured). With the trainer's experts left unquantized (INT4 engines only) this
    # run measured 0.067 and 0.061 (2026-12-05, by hand): the bound tells the two apart.
    assert max(gaps) < 1e-4, gaps

"""LoRA on a real `milepost serve` process: SGLang's adapter endpoints and `lora_path`, bad input.

One server with --enable-lora: load two adapters over HTTP, generate with each and with none in
one batch request, refuse an unknown adapter and a bad one with 400s naming them while the others
keep being served, unload one, and update an adapter's tensors through /update_weights_from_tensor
(the path a colocated LoRA run takes) with /weights_checksum covering them.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from milepost.lora.peft_format import write_peft_adapter
from milepost.lora.settings import LoraSettings
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.codec import serialize_named_tensors
from milepost.weights.verify import tensor_digest


def adapter(base: Path, out: Path, settings: LoraSettings, seed: int) -> Path:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in load_file(str(base / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in settings.target_modules:
            tensors[f"{module}.lora_A.weight"] = torch.randn(settings.rank, w.shape[1], generator=g) * 0.3
            tensors[f"{module}.lora_B.weight"] = torch.randn(w.shape[0], settings.rank, generator=g) * 0.3
    write_peft_adapter(tensors.items(), settings, base, out)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_checkpoint(root / "base", "qwen3", with_tokenizer=False)
    dirs = {"a": adapter(base, root / "a", LoraSettings(4, 8.0), 1),
            "b": adapter(base, root / "b", LoraSettings(2, 4.0, "q_proj,v_proj"), 2),
            "wide": adapter(base, root / "wide", LoraSettings(8, 8.0), 3)}
    with ServerProcess(base, "--enable-lora", "--max-lora-rank", "4", "--max-total-tokens", "4096",
                       "--lora-paths", f"a={dirs['a']}") as srv:
        yield srv, dirs


def generate(url: str, lora: object) -> httpx.Response:
    body = {"input_ids": [[5, 9, 33, 71, 12], [5, 9, 33, 71, 12], [5, 9, 33, 71, 12]],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True, "lora_path": lora}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_adapters_over_http(server) -> None:
    srv, dirs = server
    url = srv.url
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "b", "lora_path": str(dirs["b"])})
    assert r.status_code == 200 and r.json() == {
        "success": True, "error_message": None, "loaded_adapters": {"a": str(dirs["a"]), "b": str(dirs["b"])}}
    out = generate(url, ["a", None, "b"])
    assert out.status_code == 200, out.text
    lps = [[e[0] for e in o["meta_info"]["output_token_logprobs"]] for o in out.json()]
    assert lps[0] != lps[1] and lps[2] != lps[1]  # each adapter changes the answer's log-probs
    base_alone = generate(url, None).json()[0]["meta_info"]["output_token_logprobs"]
    # The base row is not touched by its neighbours' adapters (batch shape changes rounding only).
    assert [e[0] for e in base_alone] == pytest.approx(lps[1], abs=1e-5)

    # Bad input: 400 naming the adapter; the engine keeps serving the others.
    bad = generate(url, "nope")
    assert bad.status_code == 400 and "adapter 'nope' is not loaded" in bad.text and "'a', 'b'" in bad.text
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(dirs["wide"])})
    assert r.status_code == 400 and "rank 8, more than --max-lora-rank 4" in r.json()["error_message"]
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(dirs["a"] / "missing")})
    assert r.status_code == 400 and "not a PEFT LoRA adapter directory" in r.json()["error_message"]
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 400 and "'nope' is not loaded" in r.json()["error_message"]
    assert generate(url, "a").status_code == 200

    # A weight update writes adapter tensors by "<adapter>/<name>"; the checksum covers them.
    name = "b/model.layers.0.self_attn.q_proj.lora_B.weight"
    new = torch.full((4 * 16, 2), 0.01)
    r = httpx.post(f"{url}/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors([(name, new)])], "weight_version": "7"})
    assert r.status_code == 200, r.text
    sums = httpx.get(f"{url}/weights_checksum", timeout=60).json()
    assert sums["weight_version"] == "7" and sums["checksums"][name] == tensor_digest(new)
    # Tokens sampled with the updated adapter carry the update's version, as any weight update's.
    after = generate(url, ["b", None, "b"]).json()
    assert all(v == "7" for o in after for v in o["meta_info"]["output_token_weight_versions"])
    assert [e[0] for e in after[0]["meta_info"]["output_token_logprobs"]] != lps[2]  # the new B is in use
    r = httpx.post(f"{url}/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors([("zz/model.layers.0.self_attn.q_proj.lora_B.weight", new)])]})
    assert r.status_code == 400 and "'zz' is not loaded" in r.text

    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": str(dirs["a"])}
    assert generate(url, "b").status_code == 400
    assert generate(url, ["a", None, "a"]).status_code == 200

"""The engine's batched LoRA paths (segment and stacked, on CPU) against merged-weights models, and its refusals.

Requests with two different adapters and none run in the same batches (prefill chunks of 8,
decodes mixed in); each one's prompt and output log-probs must equal those of an engine serving
the merged checkpoint (W + B A * alpha / r) within 1e-5 (fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lora.peft_format import write_peft_adapter
from milepost.lora.routes import SEP
from milepost.lora.serving import AdapterError
from milepost.lora.settings import LoraSettings
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.engine.weight_fp8 import FP8, Fp8Linear
from milepost.engine.weight_update import WeightLoader
from milepost.testing.lora_adapters import dequantized_checkpoint, merged_checkpoint, random_adapter

ADAPTERS = {  # name: (settings, seed)
    "math": (LoraSettings(4, 8.0, "all-linear"), 1),
    "chat": (LoraSettings(2, 3.0, "q_proj,v_proj,down_proj"), 2),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora_engine")
    base = make_tiny_checkpoint(root / "base", "qwen3", with_tokenizer=False)
    dirs, merged = {}, {}
    for name, (settings, seed) in ADAPTERS.items():
        tensors = random_adapter(base, settings, seed)
        dirs[name] = root / f"adapter_{name}"
        write_peft_adapter(tensors.items(), settings, base, dirs[name])
        merged[name] = merged_checkpoint(base, root / f"merged_{name}", settings, tensors)
    return {"base": base, "dirs": dirs, "merged": merged, "root": root}


def make_engine(path: Path, **flags: object) -> Engine:
    settings = {"device": "cpu", "dtype": "float32", "page_size": 4, "chunked_prefill_size": 8,
                "max_total_tokens": 1024} | flags
    return build_engine(ServerArgs(model_path=path, **settings).resolved())[0]


def run(engine: Engine, jobs: list[tuple[str, list[int], str | None]], n: int = 6) -> dict[str, RequestOutput]:
    """Submit every job at once (one batch), step to the end; each rid's outputs merged."""
    outs: dict[str, list[RequestOutput]] = {}
    for rid, prompt, lora in jobs:
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        engine.submit(Request(rid=rid, prompt_ids=prompt, params=params, stop_ids=frozenset(),
                              on_output=lambda o, rid=rid: outs.setdefault(rid, []).append(o),
                              return_logprob=True, logprob_start_len=0, lora_name=lora))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    return {rid: o for rid, o in outs.items()}


def flat(outputs: list[RequestOutput]) -> tuple[list[int], list[float]]:
    ids = [t for o in outputs for t in o.new_token_ids]
    lps = [x for x in outputs[-1].input_logprobs[1:]] + [lp for o in outputs for lp in o.new_logprobs]
    return ids, lps


PROMPTS = [[5, 9, 33, 71, 12, 4, 90, 11, 3, 8, 15], [7, 7, 21, 300, 5], [44, 45, 46, 47, 48, 49, 50, 51, 52]]


@pytest.mark.parametrize("kernel", ["segment", "stacked"])
def test_mixed_batch_equals_merged_models(setup: dict, kernel: str) -> None:
    specs = ",".join(f"{n}={d}" for n, d in setup["dirs"].items())
    engine = make_engine(setup["base"], enable_lora=True, max_lora_rank=4, lora_paths=specs)
    assert engine.runner.lora.kernel == "segment"  # the CPU default; the GPU's is 'stacked'
    engine.runner.lora.kernel = kernel
    jobs = [(f"{lora or 'base'}-{i}", p, lora) for i, p in enumerate(PROMPTS) for lora in ("math", None, "chat")]
    got = run(engine, jobs)
    for lora, path in [("math", setup["merged"]["math"]), ("chat", setup["merged"]["chat"]), (None, setup["base"])]:
        ref = run(make_engine(path), [(f"ref-{i}", p, None) for i, p in enumerate(PROMPTS)])
        for i in range(len(PROMPTS)):
            ids, lps = flat(got[f"{lora or 'base'}-{i}"])
            ref_ids, ref_lps = flat(ref[f"ref-{i}"])
            assert ids == ref_ids, (lora, i)
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), rtol=0, atol=1e-5)
    # The adapters do change the model (the test could not pass with LoRA ignored).
    math0, base0 = flat(got["math-0"])[1], flat(got["base-0"])[1]
    assert max(abs(a - b) for a, b in zip(math0, base0)) > 1e-2


def assert_same(got: dict[str, list[RequestOutput]], ref: dict[str, list[RequestOutput]], pairs: dict[str, str]) -> None:
    for rid, ref_rid in pairs.items():
        ids, lps = flat(got[rid])
        ref_ids, ref_lps = flat(ref[ref_rid])
        assert ids == ref_ids, rid
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), rtol=0, atol=1e-5)


def test_fp8_base_with_adapters_equals_dequantized_merged_model(setup: dict) -> None:
    """`--quantization fp8 --enable-lora`: the base's projections in fp8 rows, the adapters in
    the model dtype. Each request equals an engine serving the merged model (dequantized fp8 base
    + B A * scaling) within 1e-5 (fp32), and an adapter update through the weight loader (the
    path every update endpoint takes) reaches the next forward, still on the fp8 base."""
    root, settings = setup["root"], ADAPTERS["math"][0]
    deq = dequantized_checkpoint(setup["base"], root / "fp8_dequantized")
    engine = make_engine(setup["base"], quantization="fp8", enable_lora=True, max_lora_rank=4,
                         lora_paths=f"math={setup['dirs']['math']}")
    q_proj = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(q_proj, Fp8Linear) and q_proj.weight.dtype == FP8
    jobs = [(f"{lora or 'base'}-{i}", p, lora) for i, p in enumerate(PROMPTS) for lora in ("math", None)]
    refs = [(f"ref-{i}", p, None) for i, p in enumerate(PROMPTS)]
    got = run(engine, jobs)
    first = merged_checkpoint(deq, root / "fp8_merged_1", settings, random_adapter(setup["base"], settings, 1))
    assert_same(got, run(make_engine(first), refs), {f"math-{i}": f"ref-{i}" for i in range(len(PROMPTS))})
    assert_same(got, run(make_engine(deq), refs), {f"base-{i}": f"ref-{i}" for i in range(len(PROMPTS))})

    new = random_adapter(setup["base"], settings, 7)
    written = WeightLoader(engine.runner.model).from_named((f"math{SEP}{n}", t) for n, t in new.items())
    assert written == len(new) and q_proj.weight.dtype == FP8
    after = run(engine, jobs)
    second = merged_checkpoint(deq, root / "fp8_merged_7", settings, new)
    assert_same(after, run(make_engine(second), refs), {f"math-{i}": f"ref-{i}" for i in range(len(PROMPTS))})
    assert flat(after["math-0"])[1] != flat(got["math-0"])[1]  # the update is what serves now


def test_bad_adapters_refused_and_weights_addressable(setup: dict) -> None:
    engine = make_engine(setup["base"], enable_lora=True, max_lora_rank=2, max_loras_per_batch=2,
                         lora_target_modules="q_proj,v_proj,down_proj")
    pool = engine.runner.lora
    with pytest.raises(AdapterError, match="rank 4, more than --max-lora-rank 2"):
        pool.load("math", setup["dirs"]["math"])
    pool.load("chat", setup["dirs"]["chat"])
    with pytest.raises(AdapterError, match="'chat' is already loaded"):
        pool.load("chat", setup["dirs"]["chat"])
    other = make_tiny_checkpoint(setup["root"] / "wide", "qwen3", with_tokenizer=False, hidden_size=32)
    wrong = random_adapter(other, ADAPTERS["chat"][0], 3)
    write_peft_adapter(wrong.items(), ADAPTERS["chat"][0], other, setup["root"] / "wrong_base")
    with pytest.raises(AdapterError, match="does not fit this model: .*expected"):
        pool.load("wrong", setup["root"] / "wrong_base")
    with pytest.raises(AdapterError, match="not a PEFT LoRA adapter directory"):
        pool.load("none", setup["root"])
    assert sorted(pool.loaded) == ["chat"]  # refused loads changed nothing
    with pytest.raises(AdapterError, match="adapter 'nope' is not loaded; loaded: \\['chat'\\]"):
        pool.slot_of("nope")
    # Weight updates and checksums address adapter tensors as <adapter>/<tensor>.
    model = engine.runner.model
    name = f"chat{SEP}model.layers.1.self_attn.v_proj.lora_B.weight"
    assert name in model.hf_weight_names()
    view = model.weight_view(name)
    assert view.shape == (2 * 16, 2) and view.abs().sum() > 0
    # A view, not a copy: what an update writes there is what the next forward uses.
    assert view.untyped_storage().data_ptr() == pool.B["model.layers.1.self_attn.v_proj"].untyped_storage().data_ptr()
    with pytest.raises(KeyError, match="'math' is not loaded"):
        model.weight_view(f"math{SEP}model.layers.1.self_attn.v_proj.lora_B.weight")
    # A request naming an adapter that went away is aborted, naming it; the base still serves.
    pool.unload("chat")
    out = run(engine, [("gone", PROMPTS[0], "chat"), ("fine", PROMPTS[0], None)])
    assert out["gone"][-1].finish_reason == {"type": "abort", "message": "LoRA adapter 'chat' is not loaded"}
    assert len(flat(out["fine"])[0]) == 6


def test_adapters_that_do_not_fit_are_refused_naming_them(setup: dict) -> None:
    """The issue's bad input at load: unknown target modules, targets the engine does not serve, a
    rank that does not match the tensors, an adapter for another base (more layers), a config or
    weights file that cannot be read. Each is an AdapterError naming the adapter; the adapter
    already loaded keeps serving."""
    import json

    root = setup["root"] / "unfit"
    engine = make_engine(setup["base"], enable_lora=True, max_lora_rank=2,
                         lora_target_modules="q_proj,v_proj,down_proj", lora_paths=f"chat={setup['dirs']['chat']}")
    pool = engine.runner.lora

    def write(name: str, settings: LoraSettings, tensors: dict[str, torch.Tensor], **config: object) -> Path:
        write_peft_adapter(tensors.items(), settings, setup["base"], root / name)
        if config:
            path = root / name / "adapter_config.json"
            path.write_text(json.dumps(json.loads(path.read_text()) | config))
        return root / name

    small = LoraSettings(2, 4.0, "q_proj,v_proj")
    fits = random_adapter(setup["base"], small, 5)
    more_layers = make_tiny_checkpoint(root / "deeper", "qwen3", with_tokenizer=False, num_hidden_layers=3)
    cases = {
        "head": (write("head", small, fits, target_modules=["q_proj", "lm_head"]),
                 r"adapter 'head': lora_path .*target_modules.*unknown module\(s\) \['lm_head'\]"),
        "o": (write("o", LoraSettings(2, 4.0, "q_proj,o_proj"),
                    random_adapter(setup["base"], LoraSettings(2, 4.0, "q_proj,o_proj"), 6)),
              r"adapter 'o' targets \['o_proj'\], which this engine does not serve"),
        "r": (write("r", small, random_adapter(setup["base"], LoraSettings(1, 4.0, "q_proj,v_proj"), 7)),
              r"adapter 'r' does not fit this model: .*lora_A \[1, \d+\].*expected \[2, \d+\].*\(rank 2 on"),
        "deep": (write("deep", small, random_adapter(more_layers, small, 8)),
                 r"adapter 'deep' does not fit this model: tensors \['model.layers.2.*an adapter for another base"),
        "norank": (write("norank", small, fits, r=None),
                   r"adapter 'norank': lora_path .*rank must be a positive integer"),
    }
    (root / "noalpha").mkdir()
    (root / "noalpha" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (root / "noalpha" / "adapter_model.safetensors").write_bytes(b"")
    cases["noalpha"] = (root / "noalpha", r"adapter 'noalpha': lora_path .*has no \['lora_alpha'\]")
    broken = write("broken", small, fits)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases["broken"] = (broken, r"adapter 'broken': lora_path .*not a readable safetensors file")
    garbled = write("garbled", small, fits)
    (garbled / "adapter_config.json").write_text("{r: 2")
    cases["garbled"] = (garbled, r"adapter 'garbled': lora_path .*garbled: adapter_config.json is not valid JSON")
    for name, (path, message) in cases.items():
        with pytest.raises(AdapterError, match=message):
            pool.load(name, path)
    assert sorted(pool.loaded) == ["chat"]  # nothing of the refused ones stays
    assert pool.scaling.count_nonzero() == 1
    pool.load("fits", write("fits", small, fits))  # the same files, well-formed, do load
    out = run(engine, [("chat", PROMPTS[0], "chat"), ("fits", PROMPTS[0], "fits"), ("base", PROMPTS[0], None)])
    assert all(len(flat(out[rid])[0]) == 6 for rid in ("chat", "fits", "base"))


def test_graph_rows_weight_each_decode_row_by_its_adapter(setup: dict) -> None:
    """The decode CUDA graphs read per-row adapter weights from one static buffer (stacked path):
    each row gets its adapter's scaling in its slot's column, padding rows and base rows zeros."""
    specs = ",".join(f"{n}={d}" for n, d in setup["dirs"].items())
    engine = make_engine(setup["base"], enable_lora=True, max_lora_rank=4, max_loras_per_batch=3, lora_paths=specs)
    pool = engine.runner.lora
    with pytest.raises(ValueError, match="cannot run in CUDA graphs"):
        pool.prepare_graphs(8)
    pool.kernel = "stacked"
    pool.prepare_graphs(8)
    pool.capturing(8)
    math, chat = pool.slot_of("math"), pool.slot_of("chat")
    pool.set_graph_batch([chat, 0, math])
    expected = torch.zeros(8, 3)
    expected[0, chat - 1] = ADAPTERS["chat"][0].scaling
    expected[2, math - 1] = ADAPTERS["math"][0].scaling
    torch.testing.assert_close(pool._weights, expected, rtol=0, atol=0)  # the captured view sees it

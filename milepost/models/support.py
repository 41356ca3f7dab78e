"""What runs how: each architecture's path (native or transformers fallback), features and tests.

Plain data, no torch import, so config checks and `milepost models` stay fast. The registry
(registry.py) is what actually decides at load time (a native architecture whose config uses
something its definition lacks still falls back); tests/unit/test_models_support.py keeps the two
in agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

NATIVE = "native"
FALLBACK = "transformers"


@dataclass(frozen=True)
class Arch:
    name: str  # config.json "architectures"[0]
    path: str  # NATIVE or FALLBACK
    moe: bool
    notes: str
    tests: tuple[str, ...]

    @property
    def r3(self) -> str:
        if not self.moe:
            return "n/a (dense)"
        if self.path != NATIVE:
            return "no (refused)"
        return "yes" if self.name in _R3_TESTED else "yes (untested in a run)"

    @property
    def true_on_policy(self) -> str:
        """--true-on-policy profiles (milepost/onpolicy/profiles.py, docs/true_on_policy.md)."""
        from milepost.onpolicy.profiles import ARCHITECTURES

        return "yes (CPU; CUDA bf16 untested)" if self.name in ARCHITECTURES else "no (refused)"

    @property
    def fp8(self) -> str:
        if self.path != NATIVE:
            return "no (refused)"
        return "yes" if self.name in _FP8_TESTED else "yes (untested)"


_U, _E = "tests/unit/", "tests/e2e/"
_FP8_TESTED = ("Qwen3ForCausalLM",)
# A served model's routing replayed by the trainer: tests/e2e/test_routing_replay.py (Qwen3-MoE),
# tests/e2e/test_routing_replay_families.py (gpt-oss, DeepSeek-V3).
_R3_TESTED = ("Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM")  # tests/unit/test_weight_fp8.py, tests/e2e/test_weight_fp8_engine.py
_FB = (_U + "test_models_fallback.py",)
ARCHS: tuple[Arch, ...] = (
    Arch("LlamaForCausalLM", NATIVE, False, "RoPE default, linear, llama3 or YaRN (all native families); attention/MLP bias; tied head",
         (_U + "test_models.py", _E + "test_engine_parity.py", _E + "test_smollm2.py")),
    Arch("MistralForCausalLM", NATIVE, False, "sliding window on every layer (torch attention for it)",
         (_U + "test_models_native_families.py",)),
    Arch("Qwen2ForCausalLM", NATIVE, False, "Qwen2 / Qwen2.5: q/k/v bias; sliding layers per layer_types",
         (_U + "test_models_native_families.py", *_FB)),
    Arch("Qwen3ForCausalLM", NATIVE, False, "q/k norm; sliding layers per layer_types",
         (_U + "test_models.py", _U + "test_models_native_families.py", _E + "test_engine_parity.py")),
    Arch("Qwen3MoeForCausalLM", NATIVE, True, "routed experts recorded (R3); sliding window",
         (_U + "test_models.py", _U + "test_models_native_families.py", _E + "test_engine_moe.py")),
    Arch("DeepseekV3ForCausalLM", NATIVE, True, "MLA with a latent paged KV cache (no V pool); grouped "
         "sigmoid routing + shared experts; YaRN with mscale",
         (_U + "test_models_deepseek.py", _E + "test_routing_replay_families.py")),
    Arch("Gemma2ForCausalLM", NATIVE, False, "sliding/global layers, attention + final soft-capping "
         "(torch attention for them), sandwich norms", (_U + "test_models_native_families.py", *_FB)),
    Arch("Gemma3ForCausalLM", NATIVE, False, "text model: sliding/global layers with a RoPE base each "
         "(default or linear), q/k norms", (_U + "test_models_native_families.py", *_FB)),
    Arch("GptOssForCausalLM", NATIVE, True, "attention sinks (torch attention for them), sliding layers, "
         "clamped-SwiGLU experts with biases, YaRN; bf16/fp32 weights only (MXFP4 checkpoints not loaded)",
         (_U + "test_models_native_families.py", _E + "test_routing_replay_families.py", *_FB,
          _E + "test_fallback_engine.py")),
    Arch("Phi3ForCausalLM", FALLBACK, False, "fused qkv / gate_up projections; sliding window",
         (*_FB, _E + "test_fallback_engine.py", _E + "test_fallback_train.py")),
    Arch("GPTNeoXForCausalLM", FALLBACK, False, "partial rotary, parallel residual",
         (*_FB, _E + "test_fallback_engine.py")),
    Arch("Olmo2ForCausalLM", FALLBACK, False, "post-norms, q/k norm; `milepost train` end to end",
         (*_FB, _E + "test_fallback_engine.py", _E + "test_fallback_train_loop.py")),
    Arch("CohereForCausalLM", FALLBACK, False, "scaled logits", _FB),
)
BY_NAME = {a.name: a for a in ARCHS}
NOT_YET = "not in milepost yet"  # LoRA: no architecture has it in this table today


def lookup(architecture: str) -> Arch:
    """The row of `architecture`; an untested causal LM is a fallback row without tests."""
    return BY_NAME.get(architecture) or Arch(
        architecture, FALLBACK, False, "untested: any transformers causal LM whose attention goes "
        "through its attention interface, full or sliding layers only", ())


def has_native_routing(architecture: str) -> bool:
    """True when the native path records and replays expert routing (R3) for this architecture."""
    a = BY_NAME.get(architecture)
    return a is not None and a.path == NATIVE and a.moe


def markdown_table() -> str:
    """The README / docs table (what `milepost models --markdown` prints)."""
    head = ("| architecture | path | R3 | fp8 (engine) | true on-policy | LoRA | notes | tests |\n"
            "|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {a.name} | {a.path} | {a.r3} | {a.fp8} | {a.true_on_policy} | {NOT_YET} | {a.notes} | "
            f"{', '.join(f'`{t}`' for t in a.tests)} |" for a in ARCHS]
    return head + "\n".join(rows) + "\n"

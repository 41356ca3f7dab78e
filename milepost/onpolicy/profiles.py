"""The profiles `--true-on-policy` is checked for, and the refusals of everything else.

A profile is (architecture, device, dtype) for which tests show bitwise-equal log-probs between
engine and trainer (tests/unit/test_true_on_policy.py on CPU; tests/gpu/test_true_on_policy.py,
not yet run, on CUDA). Outside them the flag is refused at start, with the reason.
"""

from __future__ import annotations

# Dense native architectures whose layers are all plain causal attention + RMSNorm + SwiGLU.
ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
# device -> dtypes with a profile. CUDA: written and tested by tests/gpu (not run yet, docs say so).
DEVICE_DTYPES: dict[str, tuple[str, ...]] = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16",)}


def profile_refusals(
    architecture: str | None, *, moe: bool, device: str, dtype: str,
    quantization: str | None = None, engine_backend: str = "embedded", lora: bool = False,
) -> list[str]:
    """Why `--true-on-policy` cannot hold for this run (empty: a profile covers it)."""
    p: list[str] = []
    flag = "--true-on-policy"
    if moe:
        p.append(f"{flag} with a MoE model ({architecture}): expert routing is not batch-invariant in "
                 f"the engine; profiles exist for dense {', '.join(ARCHITECTURES)}")
    elif architecture is not None and architecture not in ARCHITECTURES:
        p.append(f"{flag}: no profile for {architecture}; profiles exist for {', '.join(ARCHITECTURES)}")
    if quantization:
        p.append(f"{flag} with {quantization} serving: the engine's quantized weights cannot give the "
                 "trainer's log-probs; drop --engine-quantization")
    if engine_backend != "embedded":
        p.append(f"{flag} with --engine-backend {engine_backend}: only milepost's embedded engine "
                 "re-scores with the trainer's computation; use --engine-backend embedded")
    if lora:
        p.append(f"{flag} with LoRA: the engine's batched adapter path has no profile; drop one of them")
    if device not in DEVICE_DTYPES:
        p.append(f"{flag}: no profile for device {device!r}; profiles: {DEVICE_DTYPES}")
    elif dtype not in DEVICE_DTYPES[device]:
        p.append(f"{flag}: no profile for dtype {dtype} on {device} (profiles there: "
                 f"{', '.join(DEVICE_DTYPES[device])}); use --dtype {DEVICE_DTYPES[device][0]}")
    return p

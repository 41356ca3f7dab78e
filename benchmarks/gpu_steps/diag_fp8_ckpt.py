"""Diagnostic: an FP8 blockwise checkpoint served as stored vs the bf16 source quantized on load
(tests/gpu/test_lowprec_fp8_checkpoint_cuda.py's pair): which parameters, buffers or module flags
differ, and where the logits part."""
import logging
import sys
import tempfile
from pathlib import Path

import torch

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import convert_checkpoint
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.testing.checkpoints import make_tiny_checkpoint

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
BF16_SRC = "--bf16-src" in sys.argv
tmp = Path(tempfile.mkdtemp())
src = make_tiny_checkpoint(tmp / "bf16", "qwen3", seed=3, with_tokenizer=False, hidden_size=256,
                           intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
if BF16_SRC:
    from safetensors.torch import load_file, save_file
    shard = src / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(shard).items()}, shard, metadata={"format": "pt"})
convert_checkpoint(src, tmp / "fp8", Contract("fp8_block", "fp8_block"))


def engine(path, **kw):
    return build_engine(ServerArgs(model_path=path, device=DEV, dtype=DTYPE, page_size=16,
                                   max_total_tokens=4096, **kw).resolved())[0]


a, b = engine(tmp / "fp8"), engine(src, quantization="fp8_block")
ma, mb = a.runner.model, b.runner.model
sa, sb = dict(ma.state_dict(keep_vars=True)), dict(mb.state_dict(keep_vars=True))
print("keys only in stored:", sorted(set(sa) - set(sb))[:20], "only in on-load:", sorted(set(sb) - set(sa))[:20])
for k in sorted(set(sa) & set(sb)):
    x, y = sa[k].detach(), sb[k].detach()
    if x.dtype != y.dtype or x.shape != y.shape:
        print("DIFF dtype/shape", k, x.dtype, tuple(x.shape), y.dtype, tuple(y.shape))
    elif not torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                         y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y):
        d = (x.float() - y.float()).abs().max().item()
        print("DIFF values", k, x.dtype, tuple(x.shape), f"max {d:.3g}")
mods_a = {n: m for n, m in ma.named_modules() if isinstance(m, QuantizedLinear)}
mods_b = {n: m for n, m in mb.named_modules() if isinstance(m, QuantizedLinear)}
print("quantized linears", len(mods_a), len(mods_b))
for n in sorted(set(mods_a) | set(mods_b)):
    p, q = mods_a.get(n), mods_b.get(n)
    fa = None if p is None else (p.native, p.qstatic, p.qformat, [(r, rr) for r, rr, _ in p.qparts])
    fb = None if q is None else (q.native, q.qstatic, q.qformat, [(r, rr) for r, rr, _ in q.qparts])
    if fa != fb:
        print("DIFF module", n, fa, fb)
seq = list(range(5, 60))
with torch.no_grad():
    from milepost.models.attention import VarlenCausalAttention
    from milepost.models.base import ForwardContext
    x = torch.tensor(seq, device=DEV)
    pos = torch.arange(len(seq), device=DEV)
    outs = []
    for m in (ma, mb):
        ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, len(seq)])))
        outs.append(m.compute_logits(m.forward(x, pos, ctx)).float())
    print("full logits max diff", (outs[0] - outs[1]).abs().max().item(), "max |logit|", outs[1].abs().max().item())
a.close(); b.close()

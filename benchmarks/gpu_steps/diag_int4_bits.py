"""Diagnostic: where do the fused INT4 MoE kernels part from the bf16 kernels on dequantized weights?
Per GEMM (gate_up, down) and config variant (block_m, block_n, stages, swap_ab): bitwise equal or not."""
import itertools
import torch
from milepost.kernels import fused_moe as fm, fused_moe_int4 as f4
from milepost.lowprec.experts_int4 import _pack
from milepost.models.qwen3_moe import StackedExperts
from milepost.testing.moe_reference import routed_inputs

E, H, I, K = 128, 2048, 768, 8
torch.manual_seed(1)
with torch.no_grad():
    mod = StackedExperts(E, H, I).cuda().bfloat16()
    mod.w13.normal_(0, 0.02); mod.w2.normal_(0, 0.02)
    _pack(mod)
    w13, w2 = mod.expert_weights()
print("torch", torch.__version__, torch.cuda.get_device_name())
with torch.inference_mode():
    for tokens in (4, 100, 256):
        x, ids, w = routed_inputs(tokens, H, E, K, seed=tokens)
        for bm, bn, st, nw, swap in itertools.product((16, 32, 64), (32, 64), (3, 4), (4,), (False, True)):
            g = fm.GemmConfig(bn, 128, nw, st, 8, swap)
            routing = fm.align(ids.contiguous(), E, bm, True)
            a4 = f4.gate_up(x, mod.w13, mod.w13_scale, routing, K, bm, g)
            ab = fm.gate_up(x, w13, routing, K, bm, g)
            n_pairs = tokens * K
            y4 = f4.down(ab, mod.w2, mod.w2_scale, routing, w.contiguous(), bm, g)
            yb = fm.down(ab, w2, routing, w.contiguous(), bm, g)
            tot = int(routing[2].item())
            a4, ab = a4[:tot], ab[:tot]
            d_gu = (a4.float() - ab.float()).abs().max().item()
            d_dn = (y4.float() - yb.float()).abs().max().item()
            print(f"T={tokens:4d} m{bm} n{bn} s{st} w{nw} swap={int(swap)}: gate_up bitwise "
                  f"{torch.equal(a4, ab)} (max {d_gu:.2e})  down bitwise {torch.equal(y4, yb)} (max {d_dn:.2e})",
                  flush=True)

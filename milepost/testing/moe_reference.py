"""The reference the fused-MoE GPU tests hold every expert kernel to (bf16, FP8 and INT4 experts):
an fp32 loop over the experts a batch routed to, and a seeded routing of random tokens."""

from __future__ import annotations

import torch


def expert_loop(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts in fp32, one expert at a time: x [T, H], ids / w [T, K] (expert ids and routing
    weights), w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] -> [T, H] float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        tok = pairs // ids.shape[1]
        g, u = (x[tok].float() @ w13[e].float().T).chunk(2, dim=-1)
        out.index_add_(0, tok, ((torch.nn.functional.silu(g) * u) @ w2[e].float().T)
                       * w.reshape(-1)[pairs].float()[:, None])
    return out


def routed_inputs(tokens: int, hidden: int, experts: int, top_k: int, seed: int = 0,
                  device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 tokens [T, H], their top-k expert ids [T, K] and renormalized bf16 weights [T, K]."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()
    probs = torch.softmax(torch.randn(tokens, experts, device=device, generator=g), -1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).bfloat16()

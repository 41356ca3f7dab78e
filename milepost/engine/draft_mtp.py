"""The target's own multi-token-prediction layer as the draft (SGLang's NEXTN / EAGLE on MTP layers).

The MTP layer at position p reads the target's final hidden state at p and the token at p + 1, and
predicts the token at p + 2 (models/mtp.py). So the drafter keeps, per request, the target's
hidden states of the positions its MTP cache still lacks (`observe`, after every target forward;
after a verify only the accepted positions' rows stay; after a prefill chunk the positions whose
next token is known are run at once), and a proposal first catches the MTP cache up over them: the last of those rows (the hidden state before the last token, with the last
token) gives the first proposal. Each further proposal feeds the MTP's own output state and the
previous proposal back into the same layer (one MTP layer chained k times, as SGLang does).

The MTP cache is one latent layer in pools of the target's block ids: the target's allocator,
preemption and prefix cache serve it too (a partly shared block is copied with the target's, see
ModelRunner.shadow_pools). A request's MTP cache is valid for its first `draft_computed`
positions. Positions a request takes from the prefix cache are taken as the MTP cache holds them
(written by the request that computed them; the last few positions of a finished request never
were): stale entries lower acceptance only. The rejection-sampling rule keeps outputs exact
whatever the draft proposes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from milepost.engine.draft_model import Proposal, draw, prepare_draft_batch, to_device
from milepost.engine.forward_batch import token_slice
from milepost.engine.request import Request
from milepost.engine.scheduler import Chunk
from milepost.models.attention import PagedKVCache
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.masked_attention import VariantPagedAttention
from milepost.models.triton_attention import AttentionBackendName, make_paged_attention


class _Stash:
    """The target's hidden states [n, H] of positions start .. start + n - 1 (the MTP's input)."""

    __slots__ = ("rows", "start")

    def __init__(self, start: int, rows: torch.Tensor) -> None:
        self.start = start
        self.rows = rows

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class MtpDrafter:
    def __init__(self, target: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, attention_backend: AttentionBackendName = "auto",
                 catch_up_tokens: int = 2048) -> None:
        """target: a model with MTP layers (`mtp_forward`); catch_up_tokens bounds one MTP
        catch-up forward, and how many hidden rows a request keeps before catching up early."""
        if not getattr(target, "num_mtp_layers", 0):
            raise ValueError("--speculative-algorithm NEXTN needs the native model of a checkpoint with "
                             "multi-token-prediction layers (num_nextn_predict_layers and their "
                             f"weights); {type(target).__name__} has none")
        self.target = target  # not `model`: memory.py frees a separate draft's weights by that name
        self.device = device
        self.block_size = block_size
        self.catch_up_tokens = catch_up_tokens
        self.kv = PagedKVCache(1, num_blocks, block_size, 1, target.head_dim, kv_dtype, device,
                               values=getattr(target, "kv_values", True))
        self.attention = VariantPagedAttention(make_paged_attention(self.kv, attention_backend), self.kv)
        self.fast_path = self.attention.base.__class__.__name__ == "TritonPagedAttention"
        # Dropped with the request (finished, aborted): no bookkeeping on the engine's side.
        self._stash: weakref.WeakKeyDictionary[Request, _Stash] = weakref.WeakKeyDictionary()

    # ---- the target's hidden states ------------------------------------------------------------
    def observe(self, chunks: Sequence[Chunk], hidden: torch.Tensor, starts: Sequence[int],
                eligible: Callable[[Request], bool]) -> None:
        """Keep each chunk's rows of the target's final hidden states [T, H] (chunk i's rows begin at
        starts[i]). Requests that never propose (eligible False) keep none."""
        with self._mode():  # the rows stay the kind of tensor the forwards make (inference on CUDA)
            self._observe(chunks, hidden, starts, eligible)

    def _observe(self, chunks: Sequence[Chunk], hidden: torch.Tensor, starts: Sequence[int],
                 eligible: Callable[[Request], bool]) -> None:
        long: list[Request] = []
        for c, a in zip(chunks, starts):
            req = c.req
            if not eligible(req):
                self._stash.pop(req, None)
                continue
            rows = hidden[a : a + c.length].clone()
            st = self._stash.get(req)
            if st is not None and st.start == req.draft_computed and st.start <= c.start <= st.end:
                st.rows = torch.cat([st.rows[: c.start - st.start], rows])  # a recompute overwrites
            else:
                # First rows, or after a preemption / a prefix-cache hit: positions before c.start
                # have no hidden state here, their MTP cache is taken as it is.
                req.draft_computed = c.start
                st = self._stash[req] = _Stash(c.start, rows)
            # After a prefill chunk (as SGLang's draft extend does), and whenever the rows pile up:
            # the MTP cache of the positions whose next token is known is written now, so a
            # request admitted next step on this prompt's cached blocks finds it filled.
            if (c.length > 1 and not c.verify) or st.rows.shape[0] > self.catch_up_tokens:
                long.append(req)
        if long:
            self._extend(long, keep_last=True)

    def after_verify(self, req: Request, start_len: int, k: int, accepted: int) -> None:
        """A verify that started at total_len start_len accepted `accepted` of k proposals: the
        target's states through position start_len - 1 + accepted are valid, the rest are dropped."""
        st = self._stash.get(req)
        if st is not None:
            st.rows = st.rows[: max(0, start_len + accepted - st.start)]

    # ---- proposals -----------------------------------------------------------------------------
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        """k_i tokens for each request (its blocks cover total_len + k_i - 1 positions); a request
        whose hidden states do not reach its last token (never the case in a decode) gets none."""
        with self._mode():
            return self._propose(reqs, ks)

    def _mode(self):
        return torch.inference_mode() if self.fast_path else torch.no_grad()

    def _propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = [i for i, r in enumerate(reqs) if self._ready(r)]
        if live:
            # Step 0: the MTP cache through the position before the last token; its last row
            # (the target's state there, with the last token) proposes the first token.
            state, logits = self._extend([reqs[i] for i in live], keep_last=False)
            draw(logits, live, reqs, tokens, probs)
            for j in range(1, max(ks[i] for i in live)):
                keep = [n for n, i in enumerate(live) if ks[i] > j]
                live, state = [live[n] for n in keep], state[keep]
                if not live:
                    break
                # (draft=: build_flat reads the proposals past the sequence; the ids are passed apart)
                chunks = [Chunk(reqs[i], reqs[i].total_len - 2 + j, 1, draft=tokens[i]) for i in live]
                state = self._forward(chunks, [tokens[i][-1] for i in live], state)
                draw(self.target.compute_logits(state).float(), live, reqs, tokens, probs)
        return [(t, None if r.params.greedy or not t else torch.stack(p))
                for t, p, r in zip(tokens, probs, reqs)]

    def _ready(self, req: Request) -> bool:
        st = self._stash.get(req)
        return (st is not None and st.start == req.draft_computed and st.rows.shape[0] > 0
                and st.end == req.total_len - 1)

    def _extend(self, reqs: list[Request], keep_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the MTP layer over each request's stashed positions whose next token is known
        (keep_last: all but the last stashed row). Returns the MTP states [len(reqs), H] at each
        request's last computed position and their logits [len(reqs), V] (empty if keep_last)."""
        last: list[torch.Tensor] = []
        batch: list[tuple[Chunk, list[int], torch.Tensor]] = []
        size = 0

        def run() -> None:
            chunks = [b[0] for b in batch]
            out = self._forward(chunks, [t for b in batch for t in b[1]], torch.cat([b[2] for b in batch]))
            ends = torch.tensor(chunks_ends(chunks), device=out.device)
            last.append(out.index_select(0, ends))

        for r in reqs:
            st = self._stash[r]
            n = min(st.end - (1 if keep_last else 0), r.total_len - 1) - st.start
            if n <= 0:
                continue
            if batch and size + n > self.catch_up_tokens:
                run()
                batch, size = [], 0
            batch.append((Chunk(r, st.start, n), token_slice(r, st.start + 1, st.start + 1 + n),
                          st.rows[:n]))
            size += n
            st.rows, st.start = st.rows[n:], st.start + n
            r.draft_computed = st.start
        if batch:
            run()
        if keep_last or not last:
            return torch.empty(0), torch.empty(0)
        state = torch.cat(last) if len(last) > 1 else last[0]
        return state, self.target.compute_logits(state).float()

    def _forward(self, chunks: list[Chunk], ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over chunks whose input ids are `ids` (tokens p + 1) and states `hidden`."""
        flat = prepare_draft_batch(self.attention, chunks, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        return self.target.mtp_forward(input_ids, hidden, to_device(flat.positions, self.device),
                                       ForwardContext(attention=self.attention))


def chunks_ends(chunks: Sequence[Chunk]) -> list[int]:
    """Row of each chunk's last position in a flat batch of the chunks."""
    out, end = [], 0
    for c in chunks:
        end += c.length
        out.append(end - 1)
    return out

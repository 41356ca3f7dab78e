"""Speculative verify steps as one-token rows (forward_batch.one_token_rows), the layout the
decode CUDA graphs replay them in: same tokens, positions and slots as the verify chunk, and the
same logits as its eager forward (tested here on the torch reference attention; on CUDA the graph
path itself in tests/gpu/test_speculative_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.forward_batch import build_flat, one_token_rows, scores_prompt
from milepost.engine.request import Request
from milepost.engine.runner import ModelRunner
from milepost.engine.sampling import SamplingParams
from milepost.engine.scheduler import Chunk
from milepost.models.attention import PagedBatch, PagedKVCache
from milepost.models.base import ForwardContext
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint

BS = 4


def _req(rid: str, prompt: list[int], out: list[int], blocks: list[int]) -> Request:
    r = Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=32),
                on_output=lambda o: None, stop_ids=frozenset())
    r.output_ids = list(out)
    r.blocks = list(blocks)
    return r


def _step() -> list[Chunk]:
    a = _req("a", [5, 6, 7, 8, 9, 10], [11, 12], [3, 0, 6])  # verify: last token + 3 proposals
    b = _req("b", [20, 21, 22], [23], [1, 4])  # a plain decode in the same step
    return [Chunk(a, 7, 4, draft=[40, 41, 42], verify=True), Chunk(b, 3, 1)]


def test_rows_carry_the_chunks_tokens_positions_and_slots() -> None:
    chunks = _step()
    rows, wanted = one_token_rows(chunks)
    assert [r.length for r in rows] == [1] * 5
    flat, per_row = build_flat(chunks, BS), build_flat(rows, BS)
    assert per_row.input_ids.tolist() == flat.input_ids.tolist() == [12, 40, 41, 42, 23]
    assert per_row.positions.tolist() == flat.positions.tolist()
    assert per_row.slots.tolist() == flat.slots.tolist()
    assert per_row.seq_lens.tolist() == [8, 9, 10, 11, 4]  # each row sees the positions before it
    assert wanted == flat.sample_rows == [0, 1, 2, 3, 4]
    # A chunk that does not sample (a catch-up stopping short) returns no rows; one that does, its last.
    c = _req("c", [1, 2, 3, 4, 5], [], [2, 5])
    _, wanted = one_token_rows([Chunk(c, 0, 3), Chunk(c, 2, 3)])
    assert wanted == [5]


def test_prompt_logprob_chunks_are_flagged() -> None:
    chunks = _step()
    assert not scores_prompt(chunks)
    c = _req("c", [1, 2, 3, 4, 5], [], [2, 5])
    c.logprob_start_len = 0
    assert scores_prompt([Chunk(c, 0, 5)])


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    torch.set_num_threads(1)
    path: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", with_tokenizer=False)
    model = load_model(path, torch.float32, "cpu")
    kv = PagedKVCache(model.num_layers, 8, BS, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    return ModelRunner(model, kv, torch.device("cpu"))


def test_one_token_rows_give_the_verify_chunks_logits(runner: ModelRunner) -> None:
    chunks = _step()
    a, b = chunks[0].req, chunks[1].req
    runner.forward([Chunk(a, 0, 7), Chunk(b, 0, 3)])  # the cached prefixes
    eager = runner.forward(chunks)  # verify through the prefill path (query lengths 4 and 1)
    rows, wanted = one_token_rows(chunks)
    # What a decode graph computes for those rows: an all-decode batch (each row attends to the
    # KV its layer stored for every row before attending).
    flat = build_flat(rows, BS)
    t = torch.from_numpy
    runner.attention.prepare(PagedBatch(
        query_start_loc=t(flat.query_start_loc), seq_lens=t(flat.seq_lens),
        block_tables=t(flat.block_tables), slot_mapping=t(flat.slots),
        query_lens_cpu=flat.query_lens, seq_lens_cpu=flat.seq_lens.tolist()))
    with torch.no_grad():
        hidden = runner.model.forward(t(flat.input_ids), t(flat.positions),
                                      ForwardContext(attention=runner.attention))
        per_row = runner.model.compute_logits(hidden)[torch.tensor(wanted)]
    assert eager.shape == per_row.shape == (5, runner.model.vocab_size)
    torch.testing.assert_close(per_row, eager, rtol=1e-5, atol=1e-5)


def test_graphs_cover_verify_rows_by_default(tmp_path: Path) -> None:
    import json

    from milepost.engine.server_args import ServerArgs

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "max_position_embeddings": 128}))
    plain = ServerArgs(model_path=tmp_path, max_running_requests=64)
    assert plain.decode_graph_rows() == 64
    ngram = ServerArgs(model_path=tmp_path, max_running_requests=64, speculative_algorithm="NGRAM",
                       speculative_num_draft_tokens=5)
    assert ngram.decode_graph_rows() == 320  # k + 1 rows a request
    draft = ServerArgs(model_path=tmp_path, max_running_requests=64, speculative_algorithm="STANDALONE",
                       speculative_draft_model_path=tmp_path)
    assert draft.decode_graph_rows() == 256  # the default 4 tokens verified
    given = ServerArgs(model_path=tmp_path, max_running_requests=64, speculative_algorithm="NGRAM",
                       cuda_graph_max_bs=96)
    assert given.decode_graph_rows() == 96

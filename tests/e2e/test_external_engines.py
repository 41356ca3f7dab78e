"""`milepost train --engine-backend external`: servers the user started, behind sglang-router.

SGLang cannot be installed on these machines, so the "external" servers are `milepost serve`
processes this test starts itself, as a user would start SGLang; the run must pass the
conformance check, roll out through the router and push its weights to them. Servers that break
the protocol or serve another tokenizer are refused before any trainer rank starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from milepost.config import TABLE_OF
from milepost.launch.external import check_external_engines
from milepost.launch.process import ComponentStartError
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

RUN_TIMEOUT_S = 300  # a 1-step tiny run: about a minute at load 7 on 2 cores
REWARDS = "def parity(sample):\n    return float(sum(sample.response_ids) % 2)\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("external")
    make_tiny_checkpoint(root / "qwen3", "qwen3", seed=3)
    (root / "rewards").mkdir()
    (root / "rewards" / "e2e_external_rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4),
                                                                              (5, 6), (7, 8)]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def train(work: Path, name: str, **settings: object) -> subprocess.CompletedProcess:
    values = {"hf_checkpoint": str(work / "qwen3"), "prompt_data": str(work / "prompts.jsonl"),
              "num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
              "rollout_max_response_len": 8, "lr": 1e-3, "seed": 7,
              "reward_fn": "e2e_external_rewards:parity", "engine_backend": "external",
              **settings}
    tables: dict[str, list[str]] = {}
    for key, v in values.items():
        text = str(v).lower() if isinstance(v, bool) else json.dumps(v)
        tables.setdefault(TABLE_OF[key], []).append(f"{key} = {text}")
    recipe = work / f"{name}.toml"
    recipe.write_text("".join(f"[{t}]\n" + "\n".join(ls) + "\n\n" for t, ls in tables.items()))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(work / "rewards"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "milepost", "train", str(recipe), "--run-dir", str(work / name)],
        check=False, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_a_run_trains_against_external_servers_behind_the_router(work: Path) -> None:
    with ServerProcess(work / "qwen3", "--max-total-tokens", "2048") as a, \
            ServerProcess(work / "qwen3", "--max-total-tokens", "2048") as b:
        before = [httpx.get(f"{s.url}/get_weight_version", timeout=30).json()["weight_version"]
                  for s in (a, b)]
        run = train(work, "run", engine_urls=[a.url, b.url], router=True)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        steps = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps] == [0]
        assert steps[0]["rollout/response_len_mean"] > 0
        after = [httpx.get(f"{s.url}/get_weight_version", timeout=30).json()["weight_version"]
                 for s in (a, b)]
        # The trainer's updates reached both servers, and they still serve.
        assert after[0] == after[1] and after[0] != before[0], (before, after)
        for s in (a, b):
            assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200


class _Fake(BaseHTTPRequestHandler):
    """An "SGLang" whose /generate answers in the wrong shape, or with another tokenizer's ids."""

    mode = "shape"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"weight_version": "0"} if self.path == "/get_weight_version" else {})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        meta = {"finish_reason": {"type": "length"}, "weight_version": "0",
                "output_token_logprobs": [[-0.5, 7, None]]}
        if "text" in req:  # the tokenizer probe: ids no tokenizer of this run would produce
            meta["input_token_logprobs"] = [[None, 9, None], [-1.0, 8, None]]
        body = {"text": "x", "output_ids": [7], "meta_info": meta}
        if self.mode == "shape":
            del body["output_ids"]
        self._send(body)


@pytest.mark.parametrize(("mode", "words"), [
    ("shape", ["/generate", "output_ids", "SGLang's /generate shape"]),
    ("tokenizer", ["tokenizer", "--hf-checkpoint", "[9, 8]"]),
])
def test_a_server_that_breaks_the_protocol_is_refused_naming_it(work: Path, mode: str,
                                                                words: list[str]) -> None:
    handler = type("Fake", (_Fake,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ComponentStartError) as e:
            check_external_engines([url], work / "qwen3")
        assert url in str(e.value) and "conformance check" in str(e.value)
        assert all(w in str(e.value) for w in words), str(e.value)
        if mode == "tokenizer":  # and a run against it stops there, saying so
            run = train(work, "refused", engine_urls=[url])
            assert run.returncode == 1
            assert "conformance check" in run.stdout + run.stderr
            assert not (work / "refused" / "metrics.jsonl").exists()
    finally:
        server.shutdown()
        server.server_close()

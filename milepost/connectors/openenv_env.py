"""OpenEnv environments (`--env openenv:NAME`, `milepost[openenv]`) over OpenEnv's own client/server
protocol: the environment runs as its own server process on loopback, milepost's agent talks to it
with OpenEnv's `GenericEnvClient` (WebSocket `reset` / `step`).

NAME is an installed OpenEnv environment package serving `NAME.server.app:app` (the layout
`openenv init` makes). Each episode: `reset(seed)`; the observation becomes a user message, the
model's reply (through the session server) becomes the action, `step`, until `done` or the turn
limit; the reward is the sum of the steps' rewards. docs/environments.md.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib.util
import json
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx

from milepost.connectors.episodes import (
    DEFAULT_TIMEOUT_S,
    failed,
    run_episode,
    timeout_of,
)
from milepost.connectors.extras import MissingExtraError, require
from milepost.launch.process import ManagedProcess, free_port
from milepost.rollout.layers import AgentContext, AgentOutcome

META_KEY = "openenv"
MAX_TURNS = 8  # model calls per episode when the environment never says done
SETTINGS = {"agent_function_path": "milepost.connectors.openenv_env:agent",
            "custom_generate_function_path": "milepost.connectors.episodes:env_generate",
            "reward_fn": "milepost.connectors.episodes:env_reward"}
_OBS_FIELDS = {"done", "reward", "metadata"}  # every Observation has them; the rest is content

if importlib.util.find_spec("openenv") is None:  # refused at start, naming the extra
    raise MissingExtraError("the OpenEnv connector needs the 'openenv' package; "
                            "install it with: pip install 'milepost[openenv]'")


def _app_module(name: str) -> str:
    module = f"{name}.server.app"
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ValueError(f"OpenEnv environment {name!r}: no module {module} (install the "
                         "environment's package; it must serve `app` from NAME/server/app.py)")
    return module


def prompt_rows(name: str, *, size: int, seed: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                log_dir: str | None = None) -> list[dict[str, Any]]:
    """`size` episodes, seeds `seed`..`seed+size-1`. The prompt shown here only names the
    episode: what the model sees is the environment's observation after `reset`."""
    _app_module(name)
    return [{"prompt": [{"role": "user", "content": f"OpenEnv {name} episode, seed {seed + k}"}],
             "label": None,
             "metadata": {META_KEY: {"env": name, "seed": seed + k, "timeout_s": timeout_s,
                                     "log_dir": log_dir}}}
            for k in range(size)]


def write_prompts(path: Path, name: str, *, size: int, seed: int,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    rows = prompt_rows(name, size=size, seed=seed, timeout_s=timeout_s,
                       log_dir=str(path.parent / "logs"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


class _Servers:
    """One server process per environment, started on first use, stopped at exit.

    Servers are started from one long-lived thread of their own and tied to it: the parent-death
    signal follows the starting *thread*, and a trainer rank leaves by `os._exit` (no atexit), so
    a server dies with the process that started it, however that process ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: dict[str, tuple[ManagedProcess, str]] = {}
        self._starter = concurrent.futures.ThreadPoolExecutor(1, "openenv-servers")
        atexit.register(self.close)

    async def url_async(self, name: str, log_dir: str | None) -> str:
        return await asyncio.wrap_future(self._starter.submit(self.url, name, log_dir))

    def url(self, name: str, log_dir: str | None) -> str:
        with self._lock:
            got = self._procs.get(name)
            if got is not None and got[0].alive:
                return got[1]
            module, port = _app_module(name), free_port()
            log = Path(log_dir or tempfile.mkdtemp(prefix="openenv-")) / f"openenv-{name}.log"
            url = f"http://127.0.0.1:{port}"
            proc = ManagedProcess(f"OpenEnv server {name}", [
                sys.executable, "-m", "uvicorn", f"{module}:app", "--host", "127.0.0.1",
                "--port", str(port)], log, f"{url}/health", timeout_s=300, tied_to_parent=True)
            self._procs[name] = (proc, url)
            return url

    def close(self) -> None:
        with self._lock:
            for proc, _ in self._procs.values():
                proc.close()
            self._procs.clear()


SERVERS = _Servers()


def observation_text(observation: dict[str, Any]) -> str:
    """The observation as a user message: its one text field, else its fields as JSON."""
    content = {k: v for k, v in observation.items() if k not in _OBS_FIELDS}
    texts = [v for v in content.values() if isinstance(v, str)]
    return texts[0] if len(content) == 1 and texts else json.dumps(content, sort_keys=True)


def action_of(reply: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The model's reply as an action: the action's one required text field, else the reply
    parsed as a JSON object (ValueError when it is not one)."""
    props = schema.get("properties", {})
    required = [f for f in schema.get("required", []) if f != "metadata"]
    if len(required) == 1 and props.get(required[0], {}).get("type") == "string":
        return {required[0]: reply}
    try:
        action = json.loads(reply)
    except ValueError:
        action = None
    if not isinstance(action, dict):  # a bad reply (a value): the agent catches ValueError
        raise ValueError(  # noqa: TRY004
            f"the action needs fields {required}: the reply is not a JSON object")
    return action


async def _chat(ctx: AgentContext, messages: list[dict[str, str]]) -> tuple[str, str]:
    resp = await ctx.http.post(f"{ctx.base_url}/chat/completions",
                               json={"messages": messages, "max_tokens": ctx.max_new_tokens})
    if resp.status_code >= 400:
        raise RuntimeError(f"session server answered {resp.status_code}: {resp.text[:300]}")
    choice = resp.json()["choices"][0]
    return choice["message"].get("content") or "", choice["finish_reason"]


async def agent(ctx: AgentContext) -> AgentOutcome:
    """One OpenEnv episode against this trajectory's session (see the module docstring)."""
    meta = ctx.item.metadata.get(META_KEY)
    if not isinstance(meta, dict):
        return failed(f"the prompt has no metadata[{META_KEY!r}]; make the prompts with "
                      "--env openenv:NAME (keep --metadata-key metadata)")
    name = meta["env"]

    async def episode() -> tuple[Any, dict[str, Any]]:
        client_cls = require("openenv.core.generic_client", "openenv",
                             "the OpenEnv connector").GenericEnvClient
        url = await SERVERS.url_async(name, meta.get("log_dir"))
        async with httpx.AsyncClient(timeout=30) as plain:
            schema = (await plain.get(f"{url}/schema")).raise_for_status().json()["action"]
        total, turns, stopped = 0.0, 0, "done"
        episode_id = uuid.uuid4().hex
        env, result = await _open(client_cls, url, meta, episode_id)
        try:
            messages = [{"role": "user", "content": observation_text(result.observation)}]
            while not result.done:
                if turns == MAX_TURNS:
                    stopped = "turn limit"
                    break
                reply, finish = await _chat(ctx, messages)
                turns += 1
                messages.append({"role": "assistant", "content": reply})
                try:
                    action = action_of(reply, schema)
                except ValueError:  # the model's fault, not the environment's: graded 0 from here
                    stopped = "invalid action"
                    break
                result = await env.step(action)
                if result.reward is not None:
                    total = _add(total, result.reward)
                if finish == "length":  # a cut turn cannot be extended: the episode ends here
                    stopped = "length limit"
                    break
                messages.append({"role": "user", "content": observation_text(result.observation)})
        finally:
            await env.__aexit__(None, None, None)
        done = bool(result.done)
        return total, {"openenv_episode": episode_id, "openenv_turns": turns,
                       "openenv_done": done, "openenv_stop": stopped}

    return await run_episode(episode(), timeout_s=timeout_of(meta), what=f"openenv:{name}")


async def _open(client_cls: type, url: str, meta: dict[str, Any], episode_id: str,
                ) -> tuple[Any, Any]:
    """A connected client and its `reset` result. A server at its session limit (OpenEnv's
    CAPACITY_REACHED; many environments serve one session at a time) is asked again until the
    episode's time limit."""
    delay = 0.1
    while True:
        env = client_cls(base_url=url, message_timeout_s=timeout_of(meta))
        try:
            await env.__aenter__()  # connects, in OpenEnv's async mode
            return env, await env.reset(seed=meta["seed"], episode_id=episode_id)
        except Exception as e:
            await env.__aexit__(None, None, None)
            if "CAPACITY_REACHED" not in str(e):
                raise
        await asyncio.sleep(delay)
        delay = min(2 * delay, 2.0)


def _add(total: float, reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise TypeError(f"malformed reward {reward!r} from step (expected a number)")
    return total + float(reward)

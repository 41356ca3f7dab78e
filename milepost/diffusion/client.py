"""Rollout client: one request per microgroup, each scored as soon as it arrives.

Every group (one prompt, n images) is one /generate request, so its condition is computed once.
All requests are sent at once; the engine serves them in turn, and while it generates the next,
this side unpacks the previous body in a process pool (off the event loop) and scores it. Bodies
whose arrays do not have the shapes the run expects are refused with a message naming them.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

import httpx
import numpy as np

from milepost.diffusion.codec import TrajectoryFormatError, decode


@dataclass
class GroupResult:
    labels: np.ndarray  # [n]
    latents: np.ndarray  # [n, S+1, C, H, W]
    log_probs: np.ndarray  # [n, S]
    timesteps: np.ndarray  # [S+1]
    weight_version: str
    images: np.ndarray | None = None  # [n,3,H,W] decoded images of a latent model; None: latents[:, -1]
    rewards: np.ndarray = field(default_factory=lambda: np.zeros(0))
    valid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


@dataclass
class RolloutTimes:
    wall_s: float = 0.0
    decode_s: float = 0.0
    reward_s: float = 0.0
    body_bytes: int = 0


def check_shapes(arrays: dict[str, np.ndarray], n: int, num_steps: int, image: tuple[int, int, int]) -> None:
    """TrajectoryFormatError unless latents [n, S+1, *image], log_probs [n, S], timesteps [S+1]."""
    want = {"latents": (n, num_steps + 1, *image), "log_probs": (n, num_steps), "timesteps": (num_steps + 1,)}
    for name, shape in want.items():
        got = arrays.get(name)
        if got is None or tuple(got.shape) != shape:
            raise TrajectoryFormatError(f"trajectory {name}: shape {None if got is None else tuple(got.shape)}, "
                                        f"expected {shape}; engine and run disagree on the model or --num-denoising-steps")
        if not np.isfinite(got).all():
            raise TrajectoryFormatError(f"trajectory {name} holds NaN or inf")
    images = arrays.get("images")
    if images is not None and (images.ndim != 4 or images.shape[0] != n or not np.isfinite(images).all()):
        raise TrajectoryFormatError(f"trajectory images: shape {tuple(images.shape)}, expected [{n}, 3, H, W] finite")


def final_images(res: GroupResult) -> np.ndarray:
    """The images a group's rewards see, in [-1, 1]: decoded ones (latent models) or the last latents."""
    return np.clip(res.images if res.images is not None else res.latents[:, -1], -1, 1)


async def collect(url: str, groups: list[tuple[int, int]], *, seeds: list[int], params: dict, fmt: str,
                  image: tuple[int, int, int], score, pool: Executor | None,
                  timeout_s: float = 600.0) -> tuple[list[GroupResult], RolloutTimes]:
    """Results in group order for groups [(label, n)]; score(images, labels) -> (rewards, valid)."""
    times = RolloutTimes()
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    results: list[GroupResult | None] = [None] * len(groups)
    async with httpx.AsyncClient(timeout=timeout_s) as http:

        async def one(i: int) -> None:
            label, n = groups[i]
            body = {"labels": [label] * n, "seed": seeds[i], "return_format": fmt, **params}
            r = await http.post(f"{url}/generate", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"engine {url}/generate answered {r.status_code}: {r.text[:500]}")
            times.body_bytes += len(r.content)
            t = time.perf_counter()
            meta, arrays = await loop.run_in_executor(pool, decode, r.content, r.headers.get("content-type", ""))
            times.decode_s += time.perf_counter() - t
            check_shapes(arrays, n, params["num_steps"], image)
            res = GroupResult(np.asarray(meta["labels"]), arrays["latents"], arrays["log_probs"],
                              arrays["timesteps"], str(meta["weight_version"]), arrays.get("images"))
            t = time.perf_counter()
            res.rewards, res.valid = await asyncio.to_thread(score, final_images(res), res.labels)
            times.reward_s += time.perf_counter() - t
            results[i] = res

        await asyncio.gather(*(one(i) for i in range(len(groups))))
    times.wall_s = time.perf_counter() - t0
    return [r for r in results if r is not None], times

"""AdamW whose moments live on disk, one file per bucket of parameters (report section 3.2).

`--stream-optimizer-state-to-disk`: the parameters are cut into buckets of about
`bucket_bytes` of moments each; a bucket's Adam moments (exp_avg, exp_avg_sq) are one file per
rank. The optimizer step loads a bucket, updates its parameters with torch's own AdamW kernel,
writes the moments back and frees them, so the device never holds more than one bucket of
optimizer state. Master weights are the fp32 parameters themselves (the trainer computes in
`dtype` through FSDP's mixed precision), so they stay where the parameters are.

With fp32 moments (the default) the result is bitwise the same as `torch.optim.AdamW` over the
same parameters: the same functional kernel runs on the same values. `moment_dtype=bfloat16`
halves the files; the update math is then done in fp32 on the upcast moments (not bit-exact).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

LAYOUT_FILE = "layout.pt"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard: the moments and the update are elementwise, so they act on it."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Bucket:
    index: int
    params: tuple[int, ...]  # indices into the optimizer's parameter list
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def plan_buckets(numels: list[int], element_size: int, bucket_bytes: int) -> list[Bucket]:
    """Consecutive parameters, a new bucket once the next would pass `bucket_bytes` of moments
    (two per element); a parameter larger than a bucket gets one of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        cost = 2 * n * element_size
        if current and size + cost > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(current), tuple(numels[j] for j in current)))
            current, size = [], 0
        current.append(i)
        size += cost
    if current:
        buckets.append(Bucket(len(buckets), tuple(current), tuple(numels[j] for j in current)))
    return buckets


class StreamingAdamW(torch.optim.Optimizer):
    """AdamW (torch's semantics and defaults) with its moments streamed from `directory`.

    `directory` is this rank's own: files are `bucket_NNNNN.bin`, written whole through a
    temporary name and renamed, so a crash mid-write leaves the previous step's moments.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        directory: str | Path,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bucket_bytes: int = 256 << 20,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"moment_dtype must be float32 or bfloat16, got {moment_dtype}")
        params = list(params)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("StreamingAdamW takes one parameter group")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"--stream-optimizer-state-to-disk: cannot create {self.directory} ({e}); "
                          "point --optimizer-state-dir at a writable node-local directory") from e
        self.moment_dtype = moment_dtype
        self.params: list[torch.nn.Parameter] = list(self.param_groups[0]["params"])
        numels = [_local(p).numel() for p in self.params]
        self.buckets = plan_buckets(numels, torch.empty((), dtype=moment_dtype).element_size(),
                                    bucket_bytes)
        for p in self.params:  # torch's AdamW keeps `step` as a CPU scalar per parameter
            self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
        for b in self.buckets:  # a fresh optimizer: zero moments (resume loads a checkpoint's)
            self._write(b, torch.zeros(2 * b.numel, dtype=moment_dtype))

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 - torch's signature
        if closure is not None:
            raise ValueError("StreamingAdamW does not take a closure")
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        work = [(b, [k for k, i in enumerate(b.params) if self.params[i].grad is not None])
                for b in self.buckets]
        work = [(b, with_grad) for b, with_grad in work if with_grad]
        # One reader thread fetches the next bucket's file while this one updates, and the
        # write-back runs behind the next bucket; at most one of each is in flight, so host
        # memory holds about three buckets. Every write has landed when step() returns.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="adamw-stream") as io:
            reading = io.submit(self._read, work[0][0]) if work else None
            writing: Future | None = None
            for j, (b, with_grad) in enumerate(work):
                flat = reading.result()
                reading = io.submit(self._read, work[j + 1][0]) if j + 1 < len(work) else None
                device = _local(self.params[b.params[0]]).device
                exp_avg, exp_avg_sq = self._unflatten(b, flat.to(device=device, dtype=torch.float32))
                params = [_local(self.params[b.params[k]]) for k in with_grad]
                grads = [_local(self.params[b.params[k]].grad) for k in with_grad]
                adamw(params, grads, [exp_avg[k] for k in with_grad], [exp_avg_sq[k] for k in with_grad],
                      [], [self.state[self.params[b.params[k]]]["step"] for k in with_grad],
                      amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                host = self._flatten(exp_avg, exp_avg_sq)
                if writing is not None:
                    writing.result()  # a failed write (full disk) raises here, the file intact
                writing = io.submit(self._write, b, host)
            if writing is not None:
                writing.result()

    def _load(self, b: Bucket, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The bucket's moments, one fp32 tensor per parameter, shaped like its local shard."""
        return self._unflatten(b, self._read(b).to(device=device, dtype=torch.float32))

    def _unflatten(self, b: Bucket, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shapes = [_local(self.params[i]).shape for i in b.params]
        avg, sq = flat[: b.numel], flat[b.numel:]
        return ([t.view(s) for t, s in zip(avg.split(b.numels), shapes)],
                [t.view(s) for t, s in zip(sq.split(b.numels), shapes)])

    def _flatten(self, exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's moments as one host tensor in the file's dtype (what `_write` takes)."""
        flat = torch.cat([t.reshape(-1) for t in (*exp_avg, *exp_avg_sq)])
        return flat.to(device="cpu", dtype=self.moment_dtype)

    # ---- files ----------------------------------------------------------------------------------
    def _file(self, b: Bucket) -> Path:
        return self.directory / f"bucket_{b.index:05d}.bin"

    def _write(self, b: Bucket, flat: torch.Tensor) -> None:
        path = self._file(b)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(flat.contiguous().view(torch.uint8).numpy()))  # no copy
        except OSError as e:  # a full disk: the previous moments are still in place
            tmp.unlink(missing_ok=True)
            raise OSError(f"--stream-optimizer-state-to-disk: cannot write {path}: {e}") from e
        os.replace(tmp, path)

    def _read(self, b: Bucket) -> torch.Tensor:
        path = self._file(b)
        if not path.is_file():
            raise RuntimeError(f"--stream-optimizer-state-to-disk: {path} is missing: something outside "
                               "milepost removed the optimizer state; resume from the last checkpoint")
        want = 2 * b.numel * torch.empty((), dtype=self.moment_dtype).element_size()
        size = path.stat().st_size
        if size != want:
            raise RuntimeError(f"--stream-optimizer-state-to-disk: {path} holds {size} bytes, "
                               f"expected {want}; the optimizer state files are damaged")
        data = torch.empty(want, dtype=torch.uint8)
        with open(path, "rb") as f:  # straight into the tensor: one copy
            if f.readinto(memoryview(data.numpy())) != want:
                raise RuntimeError(f"--stream-optimizer-state-to-disk: {path} ended early")
        return data.view(self.moment_dtype)

    # ---- checkpoints ----------------------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """What a checkpoint's moment files depend on: resume needs the very same."""
        return {"moment_dtype": str(self.moment_dtype),
                "buckets": [list(b.numels) for b in self.buckets]}

    def state_dict(self) -> dict[str, Any]:
        """Steps, hyper-parameters and layout; the moments are the files (`save_files`)."""
        return {"steps": [float(self.state[p]["step"]) for p in self.params],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups],
                "layout": self.layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("layout") != self.layout():
            raise ValueError(
                "--stream-optimizer-state-to-disk: the checkpoint's optimizer files were written "
                "for another parallel layout or moment dtype; resume on the same number of "
                "trainer ranks and the same settings")
        for p, s in zip(self.params, state["steps"]):
            self.state[p]["step"] = torch.tensor(s, dtype=torch.float32)
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)

    def save_files(self, dest: str | Path) -> None:
        """Copy this rank's moment files into `dest` (a checkpoint's directory for this rank)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for b in self.buckets:
            (dest / self._file(b).name).write_bytes(self._file(b).read_bytes())
        torch.save(self.state_dict(), dest / LAYOUT_FILE)

    def load_files(self, src: str | Path) -> None:
        """Resume from what `save_files` wrote; refuses a different layout or missing files."""
        src = Path(src)
        if not (src / LAYOUT_FILE).is_file():
            raise ValueError(
                f"--stream-optimizer-state-to-disk: {src} holds no streamed optimizer state (the "
                "checkpoint was written without streaming); resume it without "
                "--stream-optimizer-state-to-disk rather than restarting Adam from zero")
        self.load_state_dict(torch.load(src / LAYOUT_FILE, weights_only=True))
        for b in self.buckets:
            f = src / self._file(b).name
            if not f.is_file():
                raise ValueError(f"--stream-optimizer-state-to-disk: {f} is missing from the checkpoint")
            self._write(b, torch.frombuffer(bytearray(f.read_bytes()), dtype=self.moment_dtype))
            self._read(b)  # checks the size

"""The disk-delta store: encodings, the order and base rules, corruption, and atomic publishing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from milepost.weights.delta_replica import DeltaReplica
from milepost.weights.disk_delta import (
    DATA_NAME,
    DeltaError,
    DeltaWriter,
    published_versions,
    version_dir,
)


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g),
            "b.weight": torch.randn(100, generator=g).to(torch.bfloat16),
            "c.bias": torch.randn(7, generator=g)}


def step(state: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """A small 'training step': a few elements of one tensor change."""
    new = {n: t.clone() for n, t in state.items()}
    new["a.weight"].view(-1)[k:k + 5] += 0.5
    return new


def publish(w: DeltaWriter, state: dict[str, torch.Tensor], label: str):
    w.begin(label)
    for n, t in state.items():
        w.add(n, t)
    return w.commit()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_versions_apply_in_order_and_reproduce_the_trainer_state(tmp_path, encoding) -> None:
    w = DeltaWriter(tmp_path, encoding)
    s0 = model()
    base = publish(w, s0, "1")
    assert (base.version, base.base_version, base.encoding) == (0, None, "full")
    s1 = step(s0, 0)
    v1 = publish(w, s1, "2")
    assert (v1.version, v1.base_version, v1.encoding) == (1, 0, encoding)
    assert list(v1.tensors) == ["a.weight"]  # unchanged tensors are not written
    total = sum(t.numel() * t.element_size() for t in s0.values())
    assert 0 < v1.bytes_changed <= 5 * 4 and v1.bytes_total == total
    assert v1.bytes_written < v1.bytes_total // 10  # compressed changed bytes + the index
    r = DeltaReplica()
    for version, want in ((0, s0), (1, s1)):
        index, state = r.prepare(tmp_path, version)
        assert same(state, want)
        r.adopt(version, state)
    assert published_versions(tmp_path) == [0, 1]


def test_xor_twice_wrong_base_and_out_of_order_are_refused_and_change_nothing(tmp_path) -> None:
    w = DeltaWriter(tmp_path, "xor")
    s0 = model()
    s1 = step(s0, 0)
    s2 = step(s1, 9)
    for i, s in enumerate((s0, s1, s2)):
        publish(w, s, str(i))
    r = DeltaReplica()
    r.adopt(0, r.prepare(tmp_path, 0)[1])
    with pytest.raises(DeltaError, match="applies on top of version 1, but this engine holds version 0"):
        r.prepare(tmp_path, 2)  # out of order (skips 1)
    r.adopt(1, r.prepare(tmp_path, 1)[1])
    with pytest.raises(DeltaError, match="exactly once"):
        r.prepare(tmp_path, 1)  # XOR twice would restore s0
    assert r.version == 1 and same(r.state, s1)
    # A replica holding another lineage's version 0 (wrong base) is refused by the digests.
    other = tmp_path / "other"
    publish(DeltaWriter(other), model(seed=5), "x")
    r2 = DeltaReplica()
    r2.adopt(0, r2.prepare(other, 0)[1])
    with pytest.raises(DeltaError, match="digest differs"):
        r2.prepare(tmp_path, 1)
    assert same(r2.state, model(seed=5))


def test_overwrite_is_idempotent(tmp_path) -> None:
    w = DeltaWriter(tmp_path, "overwrite")
    s0 = model()
    s1 = step(s0, 3)
    publish(w, s0, "0")
    publish(w, s1, "1")
    r = DeltaReplica()
    r.adopt(0, r.prepare(tmp_path, 0)[1])
    r.adopt(1, r.prepare(tmp_path, 1)[1])
    _, again = r.prepare(tmp_path, 1)  # a retry: same result, no error
    assert same(again, s1)


def test_corrupt_data_and_missing_index_are_refused(tmp_path) -> None:
    w = DeltaWriter(tmp_path)
    s0 = model()
    publish(w, s0, "0")
    publish(w, step(s0, 0), "1")
    r = DeltaReplica()
    r.adopt(0, r.prepare(tmp_path, 0)[1])
    data = version_dir(tmp_path, 1) / DATA_NAME
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(DeltaError, match="corrupt|digest differs"):
        r.prepare(tmp_path, 1)
    assert r.version == 0 and same(r.state, s0)
    with pytest.raises(DeltaError, match="not published"):
        r.prepare(tmp_path, 7)


def test_names_shapes_dtypes_must_match_the_base(tmp_path) -> None:
    w = DeltaWriter(tmp_path)
    s0 = model()
    publish(w, s0, "0")
    w.begin("1")
    with pytest.raises(DeltaError, match="same names, dtypes and shapes"):
        w.add("a.weight", torch.zeros(64, 31))
    w.abort()
    w.begin("1")
    with pytest.raises(DeltaError, match="same names"):
        w.add("new.weight", torch.zeros(3))
    w.abort()
    w.begin("1")
    w.add("a.weight", s0["a.weight"])
    with pytest.raises(DeltaError, match="lacks 2 tensors"):
        w.commit()
    assert published_versions(tmp_path) == [0]


_PUBLISHER = r"""
import sys, time, torch
from milepost.weights.disk_delta import DeltaWriter
w = DeltaWriter(sys.argv[1])
state = {f"t{i}.weight": torch.randn(512, 1024) for i in range(6)}
for k in range(4):
    w.begin(str(k))
    for i, (n, t) in enumerate(state.items()):
        t.view(-1)[k * 997 % t.numel()] += 1.0
        w.add(n, t)
        if k == 3 and i == 2:  # half of version 3 is on disk: wait here to be killed
            print("mid", flush=True)
            time.sleep(600)
    w.commit()
    print(k, flush=True)
"""


def test_a_writer_killed_mid_publish_leaves_no_visible_partial_version(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        assert lines == ["0", "1", "2", "mid"], f"publisher died: {lines}"
    finally:  # killed inside version 3, with some of its tensors written
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    done = published_versions(tmp_path)
    assert done[:3] == [0, 1, 2]
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    r = DeltaReplica()
    for v in done:  # every visible version is complete and applies cleanly in order
        r.adopt(v, r.prepare(tmp_path, v)[1])
    partial = [d for d in dirs if int(d[1:]) not in done]
    assert done == [0, 1, 2] and partial == ["v00000003"], dirs
    for d in partial:  # a half-written version is refused by name, never read
        with pytest.raises(DeltaError, match="not published"):
            r.prepare(tmp_path, int(d[1:]))
    # A restarted writer republishes from a fresh full version; the replica follows it.
    w = DeltaWriter(tmp_path)
    fresh = publish(w, model(), "after-restart")
    assert fresh.encoding == "full" and fresh.version == max(done) + 1
    r.adopt(fresh.version, r.prepare(tmp_path, fresh.version)[1])
    assert same(r.state, model())

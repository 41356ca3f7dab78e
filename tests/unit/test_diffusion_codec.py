"""Trajectory bodies (milepost/diffusion/codec.py): raw bytes and JSON carry the same arrays, and a
malformed body is refused by name."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from milepost.diffusion.codec import (
    CONTENT_TYPE,
    TrajectoryFormatError,
    decode,
    from_json,
    pack,
    to_json,
    unpack,
)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"latents": rng.standard_normal((2, 5, 3, 4, 4)).astype(np.float32),
            "log_probs": rng.standard_normal((2, 4)).astype(np.float32), "labels": np.array([0, 2])}


def test_raw_round_trip_is_exact_and_smaller_than_json() -> None:
    arrays = _arrays()
    body = pack({"weight_version": "3"}, arrays)
    meta, out = unpack(body)
    assert meta == {"weight_version": "3"}
    for k, v in arrays.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v)
    _, via_json = from_json(to_json({}, arrays))
    for k, v in arrays.items():
        assert np.array_equal(via_json[k], v)  # JSON floats round-trip float32 exactly too
    assert len(body) < len(to_json({}, arrays)) / 2
    assert np.array_equal(decode(body, CONTENT_TYPE)[1]["latents"], arrays["latents"])


def test_malformed_bodies_are_refused_by_name() -> None:
    body = pack({}, _arrays())
    with pytest.raises(TrajectoryFormatError, match="MPTR"):
        unpack(b"JUNK" + body[4:])
    with pytest.raises(TrajectoryFormatError, match="latents|log_probs|labels"):
        unpack(body[:-10])  # truncated: the last array runs past the end
    with pytest.raises(TrajectoryFormatError, match="header length"):
        unpack(b"MPTR" + struct.pack("<I", 1 << 30) + b"{}")
    with pytest.raises(TypeError, match="dtype"):
        pack({}, {"x": np.zeros(2, dtype=np.complex64)})
    with pytest.raises(TrajectoryFormatError, match="malformed"):
        from_json(b"{not json")


def test_trajectories_of_the_wrong_shape_are_refused() -> None:
    from milepost.diffusion.client import check_shapes

    good = {"latents": np.zeros((2, 5, 3, 4, 4), np.float32), "log_probs": np.zeros((2, 4), np.float32),
            "timesteps": np.zeros(5, np.float32)}
    check_shapes(good, 2, 4, (3, 4, 4))
    with pytest.raises(TrajectoryFormatError, match=r"latents: shape \(2, 5, 3, 4, 4\), expected \(2, 5, 3, 8, 8\)"):
        check_shapes(good, 2, 4, (3, 8, 8))
    with pytest.raises(TrajectoryFormatError, match="num-denoising-steps"):
        check_shapes(good, 2, 6, (3, 4, 4))
    bad = {**good, "log_probs": np.full((2, 4), np.nan, np.float32)}
    with pytest.raises(TrajectoryFormatError, match="NaN"):
        check_shapes(bad, 2, 4, (3, 4, 4))

"""The Ray launcher's decisions without a cluster: bundles per placement, refusals with the numbers
(asked vs available), the per-run API key, and the fast refusal of an unreachable head or a Ray
that lacks the API. The launcher on a real local cluster: tests/e2e/test_ray_launcher.py."""

from __future__ import annotations

import socket
import time
import types

import pytest

from milepost.launch import ray_placement
from milepost.launch.ray import (
    RayLaunchError,
    _check_reachable,
    _with_host,
    with_run_api_key,
)


def _cfg(**over: object) -> types.SimpleNamespace:
    base = {"actor_num_gpus_per_node": 2, "rollout_num_engines": 1, "rollout_num_gpus_per_engine": 1,
            "colocate": False, "engine_backend": "embedded", "load_rollouts": None,
            "ray_cpus_per_component": 1.0, "ray_placement_strategy": "PACK",
            "ray_trainer_resources": None, "ray_engine_resources": None}
    return types.SimpleNamespace(**{**base, **over})


def test_disaggregated_pools_one_bundle_per_rank_and_engine() -> None:
    trainer, engines = ray_placement.pools(
        _cfg(rollout_num_engines=2, rollout_num_gpus_per_engine=2, ray_trainer_resources=["node1"],
             ray_engine_resources=["node0=0.5"], ray_placement_strategy="SPREAD"), on_gpu=True)
    assert trainer.bundles == [{"CPU": 1.0, "GPU": 1.0, "node1": 1.0}] * 2
    assert engines.bundles == [{"CPU": 1.0, "GPU": 2.0, "node0": 0.5}] * 2
    assert trainer.strategy == engines.strategy == "SPREAD"
    assert trainer.total()["GPU"] + engines.total()["GPU"] == 6


def test_cpu_runs_ask_no_gpu_and_colocated_runs_share_one_pool() -> None:
    trainer, engines = ray_placement.pools(_cfg(), on_gpu=False)
    assert all("GPU" not in b for b in trainer.bundles + engines.bundles)
    pool, none = ray_placement.pools(_cfg(colocate=True), on_gpu=True)
    assert none is None and pool.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2


def test_external_engines_need_no_engine_pool() -> None:
    _, engines = ray_placement.pools(_cfg(engine_backend="external"), on_gpu=True)
    assert engines is None


@pytest.mark.parametrize("entry", ["", "=2", "node0=0", "node0=-1", "node0=x", "GPU=1", "CPU"])
def test_malformed_custom_resources_name_the_setting(entry: str) -> None:
    with pytest.raises(ValueError, match="--ray-engine-resources"):
        ray_placement.parse_resources([entry], "ray_engine_resources")


def test_too_few_gpus_refused_with_asked_and_available() -> None:
    cfg = _cfg(actor_num_gpus_per_node=4, rollout_num_engines=2)
    problems = ray_placement.refusals(cfg, True, total={"GPU": 4.0, "CPU": 64.0},
                                      available={"GPU": 3.0, "CPU": 64.0})
    assert len(problems) == 1, problems
    msg = problems[0]
    assert "lacks GPU" in msg and "asks 6" in msg and "has 4 of which 3 are free" in msg, msg
    assert "trainer: 4 x 1" in msg and "engines: 2 x 1" in msg, msg


def test_a_custom_resource_no_node_offers_is_named() -> None:
    problems = ray_placement.refusals(_cfg(ray_trainer_resources=["node7"]), False,
                                      total={"CPU": 8.0}, available={"CPU": 8.0})
    assert len(problems) == 1 and "node7" in problems[0] and "ray start --resources" in problems[0]


def test_a_cluster_that_holds_the_run_is_not_refused() -> None:
    assert ray_placement.refusals(_cfg(), True, {"GPU": 3.0, "CPU": 3.0}, {"GPU": 3.0, "CPU": 3.0}) == []


def test_colocated_multi_gpu_engines_are_refused_under_ray() -> None:
    problems = ray_placement.refusals(_cfg(colocate=True, rollout_num_gpus_per_engine=2), True,
                                      {"GPU": 8.0, "CPU": 8.0}, {"GPU": 8.0, "CPU": 8.0})
    assert problems and "--rollout-num-gpus-per-engine 2" in problems[0]


def test_a_run_gets_its_own_api_key_unless_one_is_set() -> None:
    class Cfg(types.SimpleNamespace):
        def model_copy(self, update: dict) -> Cfg:
            return Cfg(**{**vars(self), **update})

    a, b = with_run_api_key(Cfg(api_key=None)), with_run_api_key(Cfg(api_key=None))
    assert a.api_key and b.api_key and a.api_key != b.api_key and len(a.api_key) >= 32
    kept = Cfg(api_key="user-chosen-key")
    assert with_run_api_key(kept) is kept


def test_an_unreachable_head_is_refused_in_seconds() -> None:
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RayLaunchError, match=f"--ray-address 127.0.0.1:{port}: the Ray head is unreachable"):
            _check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 10
    with pytest.raises(RayLaunchError, match="is not HOST:PORT"):
        _check_reachable("headnode")


def test_a_ray_without_the_api_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from milepost.launch import ray as ray_launch

    monkeypatch.setattr(ray_placement, "NEEDED_API", ("ray.util.no_such_function",))
    with pytest.raises(RayLaunchError, match="lacks ray.util.no_such_function"):
        ray_launch._import_ray()


def test_components_bind_the_node_address() -> None:
    cmd = ["python", "-m", "milepost", "serve", "--host", "127.0.0.1", "--port", "5"]
    assert _with_host(cmd, "10.0.0.7") == ["python", "-m", "milepost", "serve", "--host", "10.0.0.7",
                                           "--port", "5"]


@pytest.mark.parametrize("mode", ["broadcast", "p2p"])
def test_weight_groups_listen_on_the_node_address_the_launcher_gives(
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    from milepost.launch.rendezvous import NODE_ADDRESS_ENV
    from milepost.weights.factory import make_transport

    cfg = types.SimpleNamespace(update_weight_transfer_mode=mode, device="cpu")
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)
    assert make_transport(cfg, ["http://10.0.0.9:1"]).master_address == "127.0.0.1"  # local
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.0.0.7")  # what the Ray launcher sets on a rank
    assert make_transport(cfg, ["http://10.0.0.9:1"]).master_address == "10.0.0.7"

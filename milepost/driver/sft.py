"""`milepost sft`: supervised fine-tuning, no engine. `run` starts the trainer ranks; each runs `sft_loop`.

Every rank: take its share of the step's conversations -> train -> log -> save when due; at the end,
export a Hugging Face directory. A rank is `python -m milepost.driver.sft CONFIG` in one
torch.distributed group (gloo on CPU, NCCL on GPU), started like `milepost train`'s ranks.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

from milepost.launch.process import die_with_parent, free_port, openmp_defaults
from milepost.sft_config import SFTConfig, load_sft_config

log = logging.getLogger("milepost.driver.sft")


def sft_loop(rt) -> None:  # rt: milepost.train.sft.SFTRuntime (torch is imported by the ranks only)
    for step in rt.steps():
        batch = rt.batch(step)
        rt.train(batch)
        rt.log(step)
        if rt.save_due(step):
            rt.save(step)
    rt.export()


def run(cfg: SFTConfig) -> int:
    """Start cfg.actor_num_gpus_per_node ranks and wait; the first failure stops the others. Exit code."""
    path = cfg.write_resolved()
    n, port = cfg.actor_num_gpus_per_node, free_port()
    procs = []
    for rank in range(n):
        env = {**os.environ, **openmp_defaults(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank)}
        if cfg.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        else:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        cmd = [sys.executable, "-m", "milepost.driver.sft", str(path)]
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent()))  # noqa: PLW1509
    code = 0
    try:
        pending = list(procs)
        while pending and code == 0:
            for p in list(pending):
                try:
                    rc = p.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                pending.remove(p)
                code = code or rc
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    if code == 0:
        log.info("sft done: metrics in %s, final weights in %s", cfg.run_dir / "metrics.jsonl", cfg.run_dir / "hf")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="milepost.driver.sft")
    parser.add_argument("config", help="the run's config.resolved.toml")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_sft_config(args.config)
    import torch.distributed as dist

    from milepost.data.chat import ChatDataError
    from milepost.train.sft import SFTRuntime

    from milepost.launch.rendezvous import init_default_group

    init_default_group("nccl" if cfg.device == "cuda" else "gloo")  # rank 0 listens on MASTER_ADDR only
    rt = None
    try:
        rt = SFTRuntime(cfg)
        sft_loop(rt)
    except ChatDataError as e:
        log.error("rank %d: %s", dist.get_rank(), e)
        return 1
    finally:
        if rt is not None:
            rt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # see milepost/driver/worker.py: no interpreter teardown behind gloo threads

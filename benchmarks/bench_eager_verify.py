"""`milepost bench engine ARGS...` with speculative verify steps run eagerly (the runner's
`verify_in_graphs` off): the baseline for verify steps replayed by the decode CUDA graphs. Run it
beside the same command without this wrapper and compare their "with speculative" lines:

    python benchmarks/bench_eager_verify.py --shape qwen3-0.6b --no-hf --scenarios fixed \\
        --requests 64 --temperature 0 --speculative ngram --speculative-ngram-scope request
"""

from __future__ import annotations

import runpy
import sys

from milepost.engine.runner import ModelRunner

if __name__ == "__main__":
    ModelRunner.verify_in_graphs = False
    sys.argv = ["milepost", "bench", "engine", *sys.argv[1:]]
    runpy.run_module("milepost", run_name="__main__")

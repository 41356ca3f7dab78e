#!/usr/bin/env bash
# Issue 25 item 4, call A of two (seconds): park GGUF part 1 of SmolLM2-135M-Instruct in
# /tmp/smol, install the gguf + compiled server wheels into /tmp/site, and report what the
# terminal sandbox will find here (bubblewrap, user namespaces, root, prlimit).
# Carry: runs/smol_termA   (part_aa + whl/; 57.3 MB). Then, on the same warm machine: terminal_b.sh.
set -u
LOG=$OUT/term_a.log
{
date -u
mkdir -p /tmp/smol /tmp/site
cp runs/smol_termA/part_aa /tmp/smol/part_aa
echo "part_aa $(stat -c %s /tmp/smol/part_aa) bytes"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site runs/smol_termA/whl/*.whl; echo "pip rc $?"
ls /tmp/site
python3 -V
python3 -c "import torch, transformers, httpx; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
echo "id: $(id)"; echo "bwrap: $(command -v bwrap || echo none)  prlimit: $(command -v prlimit || echo none)  setpriv: $(command -v setpriv || echo none)"
cat /proc/sys/user/max_user_namespaces /proc/sys/kernel/unprivileged_userns_clone 2>&1
unshare -U true 2>&1 && echo "unshare -U: ok" || echo "unshare -U: refused"
grep -E "^(PRETTY_NAME)" /etc/os-release
ldd --version | head -1
df -h /tmp | tail -1
date -u
} > $LOG 2>&1
cat $LOG

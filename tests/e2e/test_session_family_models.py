"""Live family checks (report 2.4.3) for qwen2.5, llama3, deepseek-v3, kimi-k2, mistral (v3 and
tekken), glm4 and gpt-oss: a tiny checkpoint taught the weather conversation in the family's template
(milepost/testing/family_models.py) behind a real engine, checked by `milepost check-family
--serve`: the CPU battery, then real turns whose prompts extend each other token for token, real
stop tokens, and the family's tool-call parser."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from milepost.testing.family_models import make_family_agent_model


# mistral-tekken shares mistral's parser and stop token; its template (the spaces) is checked by
# the CPU battery (tests/unit/test_session_family_templates.py), so its live run is opt-in.
@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "deepseek-v3", "kimi-k2", "mistral",
                                    pytest.param("mistral-tekken", marks=pytest.mark.optin),
                                    "glm4", "gpt-oss"])
def test_live_family_check(tmp_path_factory, family) -> None:
    model = make_family_agent_model(tmp_path_factory.mktemp(family.replace(".", "_")), family)
    proc = subprocess.run(
        [sys.executable, "-m", "milepost", "check-family", "--model", str(model), "--family",
         family, "--serve", "--max-tokens", "96", "--turns", "3", "--prompt", "Weather in Oslo?",
         "--prompt", "Thanks!"],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for line in ("ok   turn 2 extends turn 1", "ok   turn 3 extends turn 2",
                 "ok   turn 1 stop token", "ok   trained ids are the engine's"):
        assert line in out, out
    parsed = re.search(r"ok   tool-call output parses: (\d+) calls parsed, 0 ", out)
    assert parsed and int(parsed.group(1)) >= 1, out  # the model did call its tool

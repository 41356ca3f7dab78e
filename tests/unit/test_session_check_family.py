"""`milepost check-family`: the CPU check on a checkpoint directory, with the first differing
token shown when a template is not append-only (the live part:
tests/e2e/test_session_check_family_live.py)."""

from __future__ import annotations

from milepost.cli import main
from milepost.testing.tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

# Drops the reasoning of every assistant turn but the last, like Qwen3's template does.
DROPS_REASONING = CHAT_TEMPLATE.replace(
    "{%- if message.get('reasoning_content') %}",
    "{%- if message.get('reasoning_content') and loop.last %}")


def _checkpoint(tmp_path, template: str):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_passing_family_exits_0(tmp_path, capsys) -> None:
    assert main(["check-family", "--model", _checkpoint(tmp_path, CHAT_TEMPLATE),
                 "--family", "qwen3"]) == 0
    out = capsys.readouterr().out
    assert "ok   multi-turn chat" in out and "FAIL" not in out


def test_a_failing_family_names_the_case_and_the_token(tmp_path, capsys) -> None:
    model = _checkpoint(tmp_path, DROPS_REASONING)
    assert main(["check-family", "--model", model, "--family", "chatml"]) == 1
    out = capsys.readouterr().out
    assert "FAIL reasoning every turn" in out and "ok   multi-turn chat" in out
    assert "differs from the template's rendering at character" in out
    # The family that knows the template's reasoning drop accepts the same checkpoint.
    assert main(["check-family", "--model", model, "--family", "qwen3"]) == 0


def test_unknown_family_is_named(tmp_path, capsys) -> None:
    assert main(["check-family", "--model", _checkpoint(tmp_path, CHAT_TEMPLATE),
                 "--family", "llama-9"]) == 2
    assert "unknown family 'llama-9'" in capsys.readouterr().out

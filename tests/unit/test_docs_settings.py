"""The settings reference (docs/reference/settings.md) is generated from the config models and
committed; these fail when it is stale or misses a setting, naming the command that fixes it."""

from __future__ import annotations

from pathlib import Path

from milepost.docs_gen import SETTINGS_PAGE, main, settings_markdown, stale_diff


def test_committed_settings_page_is_fresh() -> None:
    diff = stale_diff()
    assert not diff, ("docs/reference/settings.md is stale; run `python -m milepost.docs_gen` and "
                      "commit it:\n" + diff[:3000])


def test_every_setting_is_on_the_page() -> None:
    from milepost.config import TrainConfig
    from milepost.engine.server_args import ServerArgs
    from milepost.sft_config import SFTConfig

    page = settings_markdown()
    for model in (TrainConfig, SFTConfig, ServerArgs):
        for name in model.model_fields:
            assert f"`--{name.replace('_', '-')}`" in page, f"{model.__name__}.{name} is missing"


def test_check_fails_on_a_hand_edit(tmp_path: Path, capsys) -> None:
    edited = tmp_path / "settings.md"
    edited.write_text(settings_markdown().replace("| `seed` |", "| `sead` |", 1))
    diff = stale_diff(edited)
    assert "-| `sead` |" in diff and "+| `seed` |" in diff
    assert main(["--check"]) == 0  # the committed page itself is fresh
    assert SETTINGS_PAGE.is_file()

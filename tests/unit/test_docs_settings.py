"""The generated reference pages (docs/reference/settings.md from the config models, recipes.md
from the recipes' evidence) are committed; these fail when one is stale or misses a setting,
naming the command that fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.docs_gen import PAGES, SETTINGS_PAGE, settings_markdown, stale_diff


@pytest.mark.parametrize("page", list(PAGES), ids=lambda p: p.name)
def test_committed_reference_page_is_fresh(page: Path) -> None:
    diff = stale_diff(page)
    assert not diff, (f"{page} is stale; run `python -m milepost.docs_gen` and commit it:\n"
                      + diff[:3000])


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
    diff = stale_diff(edited, settings_markdown)
    assert "-| `sead` |" in diff and "+| `seed` |" in diff
    assert SETTINGS_PAGE.is_file()

"""The README is the front door: small, and every relative link it holds leads somewhere.

Links inside docs/ are checked by `mkdocs build --strict` (CI, anchors too); this covers the
README, which the site does not build.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """Link targets that are neither URLs nor bare anchors, without their anchor."""
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_relative_links_are_found() -> None:
    text = "see [a](docs/a.md#x), [b](https://x.org/b), [c](#here), ![i](docs/i.png)"
    assert relative_links(text) == ["docs/a.md", "docs/i.png"]


def test_every_readme_link_resolves() -> None:
    text = (ROOT / "README.md").read_text()
    missing = [t for t in relative_links(text) if not (ROOT / t).exists()]
    assert relative_links(text), "the README links no docs page"
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_is_a_front_door() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 10 * 1024, (f"README.md is {size} bytes; keep it under 10 KB and move reference "
                               "material into a docs/ page")


def test_every_docs_page_is_in_the_site_or_listed() -> None:
    # A page nobody can reach from the site's navigation is a page nobody reads.
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    linked = "".join((ROOT / "docs" / p).read_text() for p in pages) + (ROOT / "README.md").read_text()
    orphans = [p for p in pages if p not in nav and Path(p).name not in linked]
    assert not orphans, (f"docs pages neither in mkdocs.yml's nav nor linked from the README or a "
                         f"page: {orphans}; link each from the README or a docs page")

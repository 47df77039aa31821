"""Every relative link in the documentation leads somewhere: the file exists, and a ``#anchor`` names one of its
headings (as GitHub spells them). The README once linked bench/README.md, which did not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DOCUMENTS = sorted(
    [
        *ROOT.glob("*.md"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "bench" / "README.md",
    ]
)

# [text](target) and [text](target "title"), not images; code blocks and code spans are not links.
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    return _SPAN.sub("", _FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation but '-' and '_' dropped, spaces
    as '-'; a repeated heading gets '-1', '-2' ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = 0
        while (candidate := slug if count == 0 else f"{slug}-{count}") in anchors:
            count += 1
        anchors.add(candidate)
    return anchors


def relative_links(document: Path) -> list[str]:
    return [
        target for target in _LINK.findall(_prose(document.read_text())) if not re.match(r"[a-z][a-z+.-]*:", target)
    ]


def broken(document: Path, target: str, root: Path = ROOT) -> str:
    """Why ``target`` (a relative link in ``document``) leads nowhere, or out of ``root``; else ``""``."""
    path, _, anchor = target.partition("#")
    file = (document.parent / path).resolve() if path else document
    if not file.exists():
        return f"{path} does not exist"
    if root not in file.parents and file != root:
        return f"{path} is outside the repository"
    if anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
        return f"{file.name} has no heading #{anchor}"
    return ""


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path) -> None:
    assert document.exists(), f"{document.relative_to(ROOT)} is missing"
    problems = [f"{target}: {why}" for target in relative_links(document) if (why := broken(document, target))]
    assert not problems, f"{document.relative_to(ROOT)}: {problems}"


def test_the_check_finds_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Set up\n\n[a](missing.md) [b](page.md#set-up) [c](#nope) `[d](x.md)` ![e](f.png)\n")
    assert relative_links(page) == ["missing.md", "page.md#set-up", "#nope"]
    assert [broken(page, target, tmp_path) for target in relative_links(page)] == [
        "missing.md does not exist",
        "",
        "page.md has no heading #nope",
    ]


def test_the_bench_readme_lists_every_script_and_every_result() -> None:
    text = (ROOT / "bench" / "README.md").read_text()
    scripts = sorted(path.name for path in (ROOT / "bench").glob("*.py"))
    results = sorted(path.name for path in (ROOT / "bench" / "results").iterdir())
    assert [name for name in scripts if f"]({name})" not in text] == []
    assert [name for name in results if f"](results/{name})" not in text] == []

"""The README and the guide stay true to the tree and the parsers: every relative link names a file
that exists, and every `specdec ...` example in the README's code blocks parses with the real
command line's parsers (the flags it names exist and take what it gives them)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specdec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(page: Path) -> list[str]:
    """The relative link targets of a markdown page, outside its code blocks, without anchors."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    targets = [m.group(1).split("#", 1)[0] for m in LINK.finditer(text)]
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_that_exists(page):
    missing = [t for t in links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def readme_commands() -> list[str]:
    """The `specdec ...` lines of the README's code blocks, comments and continuations joined."""
    commands = []
    for block in FENCE.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("specdec "):
                commands.append(line)
    return commands


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 8  # the guide's jobs each have one


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_parses(command):
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.command == shlex.split(command)[1]


def test_the_link_check_sees_a_broken_link(tmp_path):
    """Power: a page that links to a file that is not there is caught."""
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) and [b](https://example.com) and `[c](x.md)`\n```\n[d](gone.md)\n```\n")
    assert links(page) == ["missing.md", "x.md"]

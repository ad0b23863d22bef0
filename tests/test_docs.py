"""The README and docs/ as a reader follows them: every relative link leads to a file and every
``#anchor`` to a heading of it (GitHub's slugs), and every flag of every ``augur`` subcommand is found
in the README or in a page the README links to, so an operator reaches each one from the front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\]\([^)]*\)|\[", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in CODE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(CODE.sub("", page.read_text()))]


def test_slugs_follow_githubs_rule():
    assert slug("Finding the skip set: `augur tune-layer-skip`") == "finding-the-skip-set-augur-tune-layer-skip"
    assert slug("The server's flags") == "the-servers-flags"
    assert slug("Provenance: how each token came (`stream_options.include_speculation`)") == (
        "provenance-how-each-token-came-stream_optionsinclude_speculation"
    )


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_flag_is_reachable_from_the_readme():
    readme = ROOT / "README.md"
    reached = [readme] + [
        (readme.parent / t.partition("#")[0]).resolve()
        for t in links(readme)
        if t.partition("#")[0].endswith(".md") and not re.match(r"[a-z]+:", t)
    ]
    text = "\n".join(p.read_text() for p in dict.fromkeys(reached))
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    missing = {}
    for name, sub in commands.items():
        flags = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        gone = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
        if gone:
            missing[name] = gone
    assert not missing, f"flags no page linked from the README mentions: {missing}"

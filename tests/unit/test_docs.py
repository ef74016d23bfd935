"""The README stays a short newcomer's page that shows what CI runs, every link of the docs resolves, no page
dates a figure by the work that produced it, and docs/performance.md and the README's performance table are
what the bench JSON files make."""

import re
from pathlib import Path

import pytest

from cli.bench import page, summary
from tests.helpers import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
# A figure carries a date and the machine, never the sitting that measured it.
NARRATION = re.compile(
    rf"\b(?:{ORDINALS})[ -](?:session|sitting)s?\b"
    rf"|\b(?:{ORDINALS.removeprefix('first|')})[ -](?:run|machine)s?\b"
    r"|\b(?:this|that|last|previous|earlier|an earlier)\s+(?:session|sitting)s?\b"
    r"|\bsessions?\s+before\b|\bdevelopment machine\b",
    re.IGNORECASE,
)
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 450, f"README.md has {lines} lines: move the detail to a page under docs/"


def test_the_readme_shows_the_commands_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip().startswith("make ")]
    assert commands, ".ci/run runs no make target"
    shown = README.read_text()
    for command in ["make up", *commands]:
        assert re.search(rf"^{re.escape(command)}\b", shown, re.MULTILINE), (
            f"README does not show `{command}`"
        )


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", doc.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path):
    links = [
        (t, a) for t, a in LINK.findall(doc.read_text()) if "://" not in t and not t.startswith("mailto:")
    ]
    missing = [t for t, _ in links if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"
    to_pages = [(doc.parent / t if t else doc, a) for t, a in links if a and (t.endswith(".md") or not t)]
    broken = [f"{p.name}#{a}" for p, a in to_pages if a not in _anchors(p)]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing headings: {broken}"


def test_the_readme_indexes_every_docs_page():
    linked = {(ROOT / t).resolve() for t, _ in LINK.findall(README.read_text()) if t.startswith("docs/")}
    unlisted = [p.relative_to(ROOT) for p in PAGES if p.resolve() not in linked]
    assert not unlisted, f"README's docs index lacks {unlisted}"


@pytest.mark.parametrize("doc", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_narrates_how_a_figure_was_made(doc: Path):
    found = [m.group(0) for m in NARRATION.finditer(doc.read_text())]
    assert not found, f"{doc.relative_to(ROOT)}: give a date and the machine instead of {found}"


def test_the_narration_check_catches_what_it_is_for():
    for text in (
        "in the fourteenth " + "session's run",  # split: a grep of the tree stays quiet
        "measured this session",
        "the tenth run",
        "earlier sessions",
    ):
        assert NARRATION.search(text), text
    for text in ("the gateway opens a session", "a session's lease lapses", "the first run compiles"):
        assert not NARRATION.search(text), text


def test_the_performance_page_is_made_from_the_bench_files():
    out = ROOT / "docs" / "performance.md"
    assert out.read_text() == page.render(ROOT / "docs" / "bench", out), (
        "docs/performance.md and docs/bench/*.json disagree: run `make docs`"
    )


def test_the_readme_performance_table_is_made_from_the_bench_files():
    text = README.read_text()
    assert summary.with_table(text, summary.table(ROOT / "docs" / "bench")) == text, (
        "README.md's performance table and docs/bench/*.json disagree: run `make docs`"
    )


def test_the_architecture_pages_step_excerpt_is_the_codes():
    """Each line of the excerpt of StepRunner in docs/architecture.md stands in gateway/step_runner.py, in
    that order (an abridged excerpt: lines may be left out between them, none changed)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    excerpt = re.search(r"In code \(`gateway/step_runner.py`.*?```python\n(.*?)```", doc, re.DOTALL)
    assert excerpt, "architecture.md shows no excerpt of gateway/step_runner.py"
    code = [line.strip() for line in (ROOT / "gateway" / "step_runner.py").read_text().splitlines()]
    at = 0
    for line in excerpt.group(1).strip().splitlines():
        assert line.strip() in code[at:], f"{line.strip()!r} is not in gateway/step_runner.py after line {at}"
        at += code[at:].index(line.strip()) + 1

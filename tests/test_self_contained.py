"""The checkout carries everything its tests and its README point to.

Only the research traces (T-Drive, GeoLife; research use only, never copied into the project) may
be read from outside the checkout, and tests that read them skip with a reason when absent.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = "data/research"


def _outside_references(text: str) -> list[str]:
    """Every mention of the sibling ``shared`` folder: a ``../shared/...`` path, or a path built
    from string components with ``"shared"`` among them (``ROOT / ".." / "shared" / ...``, over
    several lines too), returned as a ``/``-joined path."""
    found = re.findall(r"\.\./shared/[^\s`'\")\]]*", text)
    flat = re.sub(r"\s+", " ", text)
    part = r"""["'][^"'/]*["']"""
    shared = r"""["']shared["']"""
    before, after = rf"(?:{part}\s*/\s*)", rf"(?:\s*/\s*{part})"
    for m in re.finditer(rf"{before}+{shared}{after}*|{shared}{after}+", flat):
        found.append("/".join(p.strip().strip("\"'") for p in m.group(0).split("/")))
    return found


def test_tests_read_nothing_outside_the_checkout_but_research_traces() -> None:
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__):
            continue
        for ref in _outside_references(path.read_text(encoding="utf-8")):
            if ALLOWED not in ref:
                offenders.append(f"{path.relative_to(ROOT)}: {ref}")
    assert offenders == []


def test_readme_and_docs_link_nothing_outside_the_checkout_but_research_traces() -> None:
    offenders = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for ref in _outside_references(path.read_text(encoding="utf-8")):
            if ALLOWED not in ref:
                offenders.append(f"{path.relative_to(ROOT)}: {ref}")
    assert offenders == []


def test_the_checker_finds_what_it_looks_for() -> None:
    assert _outside_references('x = ROOT / ".." / "shared" / "CONTRACT.md"') == ["../shared/CONTRACT.md"]
    assert _outside_references('x = (\n  ROOT\n  / ".."\n  / "shared"\n  / "data"\n  / "research"\n)') == [
        "../shared/data/research"
    ]
    assert _outside_references("see `../shared/CONTRACT.md`") == ["../shared/CONTRACT.md"]
    assert _outside_references('no reference here: if spans == "shared"') == []

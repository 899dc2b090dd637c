"""docs/interface.md is the generated reference, up to date, and the reason table matches the code."""

from __future__ import annotations

from pathlib import Path

from kcloak.broker.http_server import _STATUS
from kcloak.broker.interface_docs import interface_markdown
from kcloak.core.profile import ReasonCode
from kcloak.wire.reasons import REASONS

ROOT = Path(__file__).resolve().parents[2]


def test_committed_interface_reference_is_the_generated_one() -> None:
    committed = (ROOT / "docs" / "interface.md").read_text(encoding="utf-8")
    assert committed == interface_markdown(), "run: .venv/bin/python scripts/gen_interface_docs.py"


def test_reason_table_names_every_code_with_the_status_the_http_door_sends() -> None:
    assert [r.code for r in REASONS] == list(ReasonCode)
    for r in REASONS:
        assert r.action and r.when
        if r.error_status is not None:
            assert _STATUS[r.code] == r.error_status, r.code
            assert str(r.error_status) in r.http


def test_readme_points_at_the_interface_reference() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/interface.md)" in readme
    assert "CONTRACT.md" not in readme

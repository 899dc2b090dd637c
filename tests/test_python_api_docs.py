"""docs/python-api.md runs: its worked example is a doctest, every output in it is checked."""

from __future__ import annotations

import doctest
import os
import warnings
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def test_the_python_api_document_runs_as_written() -> None:
    pytest.importorskip("pandas", reason="the Python API needs pandas (extra dataframes; a dev dependency)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import movingpandas  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise  # CI installs the dataframes extra (scripts/bootstrap --tests): the document must run there
        pytest.skip("movingpandas is not installed: pip install 'kcloak[dataframes]' (scripts/bootstrap --tests)")
    result = doctest.testfile(
        str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted >= 25, f"{DOC.name}: only {result.attempted} examples found"
    assert result.failed == 0, f"{DOC.name}: {result.failed} of {result.attempted} examples failed (output above)"

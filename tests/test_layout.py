"""Distribution and imports (issue 14): the packages install and import as ``kcloak.*`` only."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import kcloak

TOP_LEVEL = ("broker", "cloaking", "streams", "simulators")


def test_version_comes_from_the_installed_metadata() -> None:
    assert kcloak.__version__ == metadata.version("kcloak")
    out = subprocess.run(
        [sys.executable, "-I", "-m", "kcloak.cli.main", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"kcloak {metadata.version('kcloak')}"


def test_no_generic_top_level_name_is_installed(tmp_path: Path) -> None:
    """Only ``kcloak`` is importable from outside the checkout: no ``broker``, ``streams``, ... that another
    project of that name could clash with."""
    code = (
        "import importlib.util as u\n"
        f"print(','.join(n for n in {TOP_LEVEL!r} if u.find_spec(n) is not None))\n"
        "print(u.find_spec('kcloak.cli.main') is not None)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["", "True"]


def test_packages_live_in_the_top_folders() -> None:
    """``kcloak.broker`` is the checkout's ``broker/`` folder (through the link ``kcloak/broker``)."""
    import kcloak.broker

    root = Path(kcloak.__file__).resolve().parents[1]
    for name in TOP_LEVEL:
        module = __import__(f"kcloak.{name}", fromlist=["__file__"])
        assert Path(module.__file__ or "").resolve() == root / name / "__init__.py"
    assert not hasattr(kcloak.broker, "__version__")  # one version, kcloak's

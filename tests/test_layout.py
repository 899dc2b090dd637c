"""Distribution and imports (issue 14): the packages install and import as ``kcloak.*`` only."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import kcloak

TOP_LEVEL = ("broker", "cloaking", "streams", "simulators")


def test_version_comes_from_the_installed_metadata() -> None:
    assert kcloak.__version__ == metadata.version("kcloak")
    out = subprocess.run(
        [sys.executable, "-I", "-m", "kcloak", "--version"], capture_output=True, text=True, check=True
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


def test_import_contracts_hold() -> None:
    """The layer order of docs/architecture.md "Layers" (pyproject.toml ``[tool.importlinter]``): ``lint-imports``
    keeps every contract, so the README's pytest command checks the layers too."""
    root = Path(__file__).resolve().parents[1]
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint)], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 kept, 0 broken" in run.stdout


def test_exit_codes_come_from_one_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Exceptions reaching ``main`` map by their package root: bad input 2, any other kcloak error 1, Ctrl-C 130;
    the message is the exception's, never a traceback."""
    import kcloak.cli.lbs
    from kcloak.cli import main as cli
    from kcloak.core.errors import InputError, KcloakError
    from kcloak.core.readers import ReaderError
    from kcloak.streams.errors import StreamsError
    from kcloak.wire.tokens import TokensFileError

    assert cli.exit_code(cli.UsageError("x")) == 2
    assert cli.exit_code(ReaderError("x")) == 2
    assert cli.exit_code(TokensFileError("x")) == 2
    assert cli.exit_code(StreamsError("x")) == 1
    assert cli.exit_code(KeyboardInterrupt()) == 130
    assert cli.exit_code(ValueError("x")) is None

    for exc, code, text in (
        (InputError("bad flag value"), 2, "kcloak: error: bad flag value"),
        (KcloakError("the store failed"), 1, "kcloak: error: the store failed"),
        (KeyboardInterrupt(), 130, "kcloak: interrupted"),
    ):

        def run(_args: argparse.Namespace, exc: BaseException = exc) -> int:
            raise exc

        monkeypatch.setattr(kcloak.cli.lbs, "run", run)  # the real parser, the real main; only the work fails
        assert cli.main(["lbs"]) == code
        assert capsys.readouterr().err.strip() == text


def test_every_package_error_derives_from_its_root() -> None:
    """One root per package, all under KcloakError; the builtin bases callers catch are kept."""
    from kcloak.broker.config import ConfigError
    from kcloak.broker.errors import BrokerError
    from kcloak.cloaking.errors import CloakingError
    from kcloak.cloaking.tabular import NotApplicable, Unsatisfiable
    from kcloak.core.errors import CoreError, InputError, KcloakError
    from kcloak.core.profile import ProfileError
    from kcloak.simulators.errors import SimulatorError
    from kcloak.simulators.traffic import SimulationInputError
    from kcloak.streams.errors import StreamsError
    from kcloak.streams.release import ReleaseError
    from kcloak.wire.errors import WireError
    from kcloak.wire.payloads import InvalidInput

    for root in (CoreError, CloakingError, StreamsError, WireError, BrokerError, SimulatorError):
        assert issubclass(root, KcloakError)
    for exc, root, builtin in (
        (ProfileError, CoreError, ValueError),
        (NotApplicable, CloakingError, ValueError),
        (Unsatisfiable, CloakingError, RuntimeError),
        (ReleaseError, StreamsError, ValueError),
        (InvalidInput, WireError, ValueError),
        (ConfigError, BrokerError, ValueError),
        (SimulationInputError, SimulatorError, ValueError),
    ):
        assert issubclass(exc, root) and issubclass(exc, builtin), exc
    assert not issubclass(Unsatisfiable, InputError)  # a runtime failure: exit 1


def test_every_exception_kcloak_defines_is_under_its_package_root() -> None:
    """Walks every module: each exception class kcloak defines derives from its package's root
    (the command line's from KcloakError), so the exit-code table covers every one of them."""
    import importlib
    import inspect
    import pkgutil

    from kcloak.broker.errors import BrokerError
    from kcloak.cloaking.errors import CloakingError
    from kcloak.core.errors import CoreError, InputError, KcloakError
    from kcloak.simulators.errors import SimulatorError
    from kcloak.streams.errors import StreamsError
    from kcloak.wire.errors import WireError

    roots: dict[str, type[BaseException]] = {
        "kcloak.core": CoreError,
        "kcloak.cloaking": CloakingError,
        "kcloak.streams": StreamsError,
        "kcloak.wire": WireError,
        "kcloak.broker": BrokerError,
        "kcloak.simulators": SimulatorError,
        "kcloak.cli": KcloakError,
    }
    seen = 0
    outside: list[str] = []
    for info in pkgutil.walk_packages(kcloak.__path__, "kcloak."):
        if info.name.endswith("__main__"):  # running it is what importing it does
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if not (inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == info.name):
                continue
            seen += 1
            if obj in (KcloakError, InputError):  # the common bases above every root
                continue
            package = ".".join(info.name.split(".")[:2])
            if not issubclass(obj, roots[package]):
                outside.append(f"{info.name}.{name}")
    assert seen >= 40  # the walk really found kcloak's exceptions
    assert outside == []

"""Contract §9 conformance of the client commands (``simulate``, ``replay``, ``load``, ``bench simulate``)
and of the ``kcloak`` parser itself: exit codes, one JSON object on stdout, the broker probe, help text,
and a ``--help`` that imports no heavy module.

The commands run through :func:`kcloak.cli.main.main` in a worker thread (they call ``asyncio.run``) against
a real broker on loopback, a real reference LBS (an HTTP service that is not kcloak) and, where
installed, a bare mosquitto (an MQTT broker without kcloak).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kcloak.simulators.load as load_module
from kcloak.broker.bench import mosquitto
from kcloak.broker.lbs_server import LbsServer
from kcloak.cli.main import build_parser, main
from kcloak.core.places import load_pois
from kcloak.core.readers import FixTable
from kcloak.simulators.load import LoadConfig, run_load
from kcloak.simulators.preflight import probe_broker, probe_mqtt
from kcloak.simulators.replay import ReplayConfig, plan_replay
from kcloak.simulators.transport import BrokerUrl, TransportError
from kcloak.wire.net import free_port
from tests.broker.conftest import SpyUpstream, spy  # noqa: F401
from tests.simulators.test_traffic import real_broker, tokens_file

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

HEAVY = ("numpy", "scipy", "aiohttp", "matplotlib", "rich", "shapely", "asyncio")


def _run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors
        return int(exc.code or 0)


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(_run_main, list(argv))


# -- the parser ---------------------------------------------------------------------------------
def test_parser_modules_import_nothing_heavy() -> None:
    """``kcloak --help`` builds every command's parser: the command modules import only argparse-level code."""
    code = (
        "import sys\n"
        "from kcloak.cli.main import build_parser\n"
        "build_parser()\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([PYTHON, "-I", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"heavy modules imported while building the parsers: {out.strip()}"


def _choices(path: tuple[str, ...], flag: str) -> tuple[str, ...]:
    action = next(a for a in _subparser(build_parser(), *path)._actions if flag in a.option_strings)
    assert action.choices is not None, f"{path} {flag}: no choices"
    return tuple(action.choices)


def test_parser_choices_are_the_names_enums() -> None:
    """The parsers' choices ARE the enums of kcloak.core.names, which the owning modules use too."""
    import kcloak.broker.config
    import kcloak.core.readers
    import kcloak.simulators.bench
    import kcloak.simulators.traffic
    import kcloak.streams.publish
    from kcloak.cloaking.cloakers import SPATIAL_ALGORITHMS
    from kcloak.cloaking.tabular import ALGORITHMS as TABULAR
    from kcloak.core import names
    from kcloak.streams.kdelta import w4m
    from kcloak.streams.release import KM_ALGORITHMS

    v = names.values
    for path in (("simulate",), ("load",)):
        assert _choices(path, "--model") == v(names.MobilityModelName) == kcloak.simulators.bench.MODELS
    for path in (("simulate",), ("replay",), ("load",)):
        assert _choices(path, "--query-kind") == v(names.SimulatedQueryKind) == kcloak.simulators.traffic.QUERY_KINDS
    for fmt_path in (("replay",), ("anonymize",), ("audit", "trajectories")):
        assert _choices(fmt_path, "--format") == v(names.InputFormat) == kcloak.core.readers.FORMATS
    assert _choices(("demo",), "--algorithm") == names.BROKER_ALGORITHMS == kcloak.broker.config.ALGORITHMS
    assert names.BROKER_ALGORITHMS[: len(SPATIAL_ALGORITHMS)] == v(names.SpatialAlgorithm) == SPATIAL_ALGORITHMS
    assert _choices(("anonymize",), "--distance") == v(names.TrajectoryDistance) == v(w4m.Distance)
    assert v(names.KDeltaMethod) == kcloak.streams.publish.METHODS == kcloak.broker.config.PUBLISH_METHODS
    assert v(names.TabularAlgorithm) == TABULAR
    assert v(names.PlacesAlgorithm) == KM_ALGORITHMS


def test_parser_defaults_match_their_owners() -> None:
    """Numeric defaults spelled out in the CLI modules (to keep --help fast) agree with the modules that own them."""
    import kcloak.cli.anonymize
    import kcloak.cli.bench_cloak
    import kcloak.cloaking.audit
    import kcloak.cloaking.bench
    from kcloak.cli import audit as audit_cli
    from kcloak.streams.kdelta import w4m

    assert kcloak.cli.bench_cloak.K_LEVEL_WEIGHTS == kcloak.cloaking.bench.K_LEVEL_WEIGHTS
    assert kcloak.cli.bench_cloak.DEFAULT_K_SPREAD == kcloak.cloaking.bench.DEFAULT_K_SPREAD
    assert kcloak.cli.anonymize.DEFAULT_TAU_S == w4m.DEFAULT_TAU_S
    assert audit_cli.DEFAULT_KS == kcloak.cloaking.audit.DEFAULT_KS
    assert audit_cli.DEFAULT_SYNTHETIC_USERS == kcloak.cloaking.audit.DEFAULT_SYNTHETIC_USERS


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def test_top_level_help_lists_every_command_with_a_line() -> None:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in action._choices_actions}
    for name in ("serve", "lbs", "simulate", "replay", "load", "release", "bench", "anonymize", "demo", "audit"):
        assert helps.get(name), f"{name}: no one-line description in kcloak --help"
    assert "simulate" in (helps["bench"] or "") and "release" in (helps["bench"] or "")


@pytest.mark.parametrize(
    "path", [("simulate",), ("replay",), ("load",), ("bench", "simulate"), ("release",), ("bench", "release")]
)
def test_every_flag_help_names_its_default(path: tuple[str, ...]) -> None:
    """Each valued flag says its default in parentheses; the page explains exit codes."""
    p = _subparser(build_parser(), *path)
    for action in p._actions:
        if not action.option_strings or action.nargs == 0 or action.required:
            continue
        text = action.help or ""
        assert text.rstrip().endswith(")") and "(" in text, f"{path} {action.option_strings}: {text!r}"
    page = p.format_help()
    assert "Exit codes" in page


@pytest.mark.parametrize(
    "flags", [["--area", "-3"], ["--area", "big"], ["--bbox", "116.5,39.9,116.4,40.0"], ["--bbox", "1,2,3"]]
)
def test_simulate_bad_area_is_exit_2_before_any_traffic(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there: the flags are refused before the broker probe
    assert _run_main(["simulate", "--broker", f"mqtt://127.0.0.1:{port}", *flags]) == 2
    err = capsys.readouterr().err
    assert flags[0] in err and "error" in err


def test_replay_needs_input_or_sample(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(["replay"]) == 2
    assert "INPUT" in capsys.readouterr().err
    assert _run_main(["replay", "x.csv", "--sample"]) == 2
    assert "not both" in capsys.readouterr().err


def test_unknown_flag_shows_the_command_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(["simulate", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage: kcloak simulate" in err and "kcloak simulate: error: unrecognized arguments: --bogus" in err
    assert _run_main(["bench", "simulate", "--users", "5", "--nope"]) == 2
    assert "kcloak bench simulate: error: unrecognized arguments: --nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "simulate", "--duration", "inf", "--models-only"], "--duration"),
        (["bench", "simulate", "--users", "0", "--models-only"], "--users"),
        (["replay", "x.csv", "--user-prefix", "bad user"], "--user-prefix"),
        (["replay", "x.csv", "--user-prefix", "_svc"], "--user-prefix"),
        (["simulate", "--broker", "ftp://127.0.0.1"], "--broker"),
        (["load", "--rate", "0"], "--rate"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kcloak: error: ") and needle in err[0]


def test_replay_reads_its_input_before_contacting_the_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing input is exit 2 even when the broker is unreachable."""
    assert _run_main(["replay", str(tmp_path / "none.csv"), "--broker", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "none.csv" in capsys.readouterr().err


# -- replay planning ----------------------------------------------------------------------------
def _fixes(rows: list[tuple[str, float]]) -> FixTable:
    ids = np.array([r[0] for r in rows], dtype=np.str_)
    t = np.array([r[1] for r in rows])
    return FixTable(ids, t, np.full(len(rows), 39.9), np.full(len(rows), 116.4), 0)


def test_replay_limit_counts_only_the_users_that_send() -> None:
    table = _fixes([("a", 0.0), ("b", 1.0), ("c", 50.0), ("a", 2.0), ("d", 60.0)])
    plan = plan_replay(table, ReplayConfig(input=Path("x"), limit=3), None)
    assert plan.users == ["r000001", "r000002"] and sorted(set(plan.user.tolist())) == [0, 1]
    # Only two users send, so a tokens file with two users is enough.
    plan = plan_replay(table, ReplayConfig(input=Path("x"), limit=3), [("u1", "t1"), ("u2", "t2")])
    assert plan.users == ["u1", "u2"]
    full = plan_replay(table, ReplayConfig(input=Path("x")), None)
    assert len(full.users) == 4 and len(full) == 5


# -- the broker probe ---------------------------------------------------------------------------
async def test_http_service_that_is_not_kcloak_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference LBS answers /healthz 200 too: the client must not mistake it for a broker."""
    async with LbsServer(load_pois(None), host="127.0.0.1", port=0) as lbs:
        port = lbs.port
        code = await _cli("simulate", "--users", "3", "--duration", "1", "--model", "waypoint",
                          "--broker", f"http://127.0.0.1:{port}", "--json", "--no-progress")  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert "not a kcloak broker" in err and len(err.strip().splitlines()) == 1


async def test_unreachable_broker_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    for scheme in ("mqtt", "http"):
        code = await _cli("load", "--rate", "10", "--duration", "1", "--users", "2",
                          "--broker", f"{scheme}://127.0.0.1:{port}", "--json", "--no-progress")  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 1 and out == "" and err.startswith("kcloak: error: ") and "Traceback" not in err


@pytest.mark.skipif(
    shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(), reason="no mosquitto"
)
async def test_mqtt_broker_without_kcloak_is_refused(tmp_path: Path) -> None:
    with mosquitto(tmp_path) as (port, _), pytest.raises(TransportError, match="no kcloak broker"):
        await probe_mqtt(BrokerUrl.parse(f"mqtt://127.0.0.1:{port}"), timeout_s=0.5)


@pytest.mark.parametrize("door", ["embedded", "http"])
async def test_real_broker_passes_the_probe_and_json_is_one_object(
    tmp_path: Path,
    spy: SpyUpstream,  # noqa: F811
    door: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    users = ["u1", "u2", "u3"]
    with tokens_file(tmp_path, users) as tokens:
        async with real_broker(tmp_path, spy.url, door, **{"auth.tokens": str(tokens)}) as (_, url):
            await probe_broker(url, credentials=("u1", "tok-u1"))
            code = await _cli("simulate", "--users", "3", "--duration", "1", "--model", "waypoint",
                              "--tokens", str(tokens), "--broker", url, "--json", "--no-progress")  # fmt: skip
    out, _ = capsys.readouterr()
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert {"users", "sent", "accepted", "refused", "duration_s", "queries", "answers"} <= report.keys()
    assert report["users"] == 3 and report["sent"] >= 3
    assert (report["accepted"] is None) == (door == "embedded")


# -- load -------------------------------------------------------------------------------------
async def test_load_draws_messages_in_chunks(
    tmp_path: Path,
    spy: SpyUpstream,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Message kinds are drawn chunk by chunk: an enormous rate × duration neither crashes nor allocates it."""
    monkeypatch.setattr(load_module, "DRAW_CHUNK", 7)
    async with real_broker(tmp_path, spy.url, "http") as (_, url):
        s = await run_load(LoadConfig(rate=200.0, duration_s=0.5, users=20, broker=url, seed=3, drain_s=5.0))
        assert s.sent_updates + s.sent_queries == 100 and s.sent_queries > 0
        # rate × duration = 1e21 messages: the run starts and is cut off here, instead of a ValueError.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.5):
                await run_load(LoadConfig(rate=1e12, duration_s=1e9, users=5, broker=url, seed=1))

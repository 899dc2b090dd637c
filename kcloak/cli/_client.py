"""What ``kcloak simulate``, ``replay`` and ``load`` share: client flags, the broker probe, output.

Exit codes: 0 success, 1 broker unreachable, not kcloak (:mod:`kcloak.simulators.preflight`) or
connection lost, 2 bad flags or input. ``--json`` prints one object on stdout; progress bars go to
stderr (off with ``--no-progress`` or when stderr is not a TTY).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kcloak.cli._progress import rich_bar
from kcloak.cli.main import UsageError
from kcloak.core.names import InputFormat, MobilityModelName, SimulatedQueryKind, values

if TYPE_CHECKING:
    import asyncio

    from kcloak.simulators.transport import TransportError

MODELS: tuple[str, ...] = values(MobilityModelName)
QUERY_KINDS: tuple[str, ...] = values(SimulatedQueryKind)
FORMATS: tuple[str, ...] = values(InputFormat)
FORMATTER = argparse.RawDescriptionHelpFormatter

T = TypeVar("T")
Progress = Callable[[int, int], None]
"""Progress callback of the client commands: ``(done, total)``."""

CLIENT_EPILOG = (
    "--broker URL is mqtt://HOST[:PORT] (default port 1883) or http://HOST[:PORT] (default port\n"
    '8470); the broker must answer as kcloak (retained kcloak/v1/broker/status "up" over MQTT,\n'
    "GET /healthz over HTTP). --tokens FILE holds plaintext user:token lines: the client then acts\n"
    "as those users, each on its own topic or route with its own credentials; without it (open\n"
    "mode) one gateway connection carries every user. Progress goes to stderr (off when stderr is\n"
    "not a terminal). Exit codes: 0 success, 1 broker unreachable, not kcloak or connection lost,\n"
    "2 bad flags or input."
)


def client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", metavar="URL", help="broker (mqtt://127.0.0.1:1883)")
    p.add_argument("--tokens", type=Path, default=None, metavar="FILE", help="user:token lines (open mode if absent)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with rich_bar() as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def run_client(
    broker: str,
    tokens: Path | None,
    work: Callable[[asyncio.Event | None], Coroutine[Any, Any, T]],
    *,
    announce: str | None = None,
    stoppable: bool = False,
) -> T:
    """Probe ``broker`` (must be a running kcloak), then run ``work(stop)``; bad input becomes :class:`UsageError`.

    ``announce`` goes to stderr once the probe succeeded. The probe uses the tokens file's first user over MQTT. Raises
    :class:`~kcloak.simulators.transport.TransportError` (exit 1) when the broker is unreachable or not kcloak.
    ``stoppable``: the work ends its run early and still reports when ``stop`` is set, which SIGINT (Ctrl-C) or
    SIGTERM do (:func:`~kcloak.cli._signals.signals_stop`); otherwise ``stop`` is None and Ctrl-C interrupts.
    """
    import asyncio

    from kcloak.cli._signals import signals_stop
    from kcloak.simulators.client import ClientInputError, load_client_tokens
    from kcloak.simulators.preflight import probe_broker
    from kcloak.simulators.traffic import SimulationInputError

    try:
        credentials = load_client_tokens(tokens)[0] if tokens is not None else None
    except ClientInputError as exc:
        raise UsageError(str(exc)) from None

    async def checked() -> T:
        stop = asyncio.Event() if stoppable else None
        with signals_stop(stop) if stop is not None else nullcontext():
            await probe_broker(broker, credentials=credentials)
            if announce is not None:
                say(announce)
            return await work(stop)

    try:
        return asyncio.run(checked())
    except SimulationInputError as exc:
        raise UsageError(str(exc)) from None


def emit(obj: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj) + "\n")
        return
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{title}[/bold]")
    for key, value in obj.items():
        console.print(f"  {key}: {json.dumps(value)}", soft_wrap=True)


def traffic_hints() -> dict[str, str]:
    """What a refusal of client traffic means for the run, by reason code (else the interface's advice), with
    the shipped configuration's numbers."""
    from kcloak.broker.config import CloakingConfig, ProfileConfig

    max_area_km2 = ProfileConfig().max_area_m2 / 1e6
    return {
        "k_unreachable": "fewer users were present than the querier's k",
        "area_exceeded": (
            f"too few users stood near the querier for a region of at most max_area_m2 ({max_area_km2:g} km2 "
            "shipped) to hold k of them"
        ),
        "stale_position": (
            f"the querier's latest fix was older than {CloakingConfig().stale_after_s:g} s when the query was "
            "cloaked: the client fell behind"
        ),
        "rate_limited": "the broker's per-user limits: fewer queries per user, or raise the broker's limits",
        "overloaded": "the broker's queues were full: a lower rate, or fewer users",
        "upstream_error": "the location service did not answer: is kcloak serve's --upstream running?",
    }


def refusal_lines(reasons: dict[str, int], answered: int, fixes: dict[str, str] | None = None) -> list[str]:
    """One line per refusal reason, most frequent first: share of the answers, why, and (``fixes``, by code)
    what to change in the command."""
    from kcloak.wire.reasons import REASONS

    advice = {r.code.value: r.action for r in REASONS}
    hints = traffic_hints()
    lines = []
    for code, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        share = f" ({n / answered:.0%} of answers)" if answered else ""
        why = hints.get(code, advice.get(code, "see docs/interface.md"))
        fix = (fixes or {}).get(code)
        lines.append(f"  {code} {n:,}{share}: {why}" + (f": {fix}" if fix else ""))
    return lines


def say(message: str) -> None:
    """A line for the person at the terminal, on stderr (stdout stays one JSON object with --json)."""
    print(message, file=sys.stderr, flush=True)


def explain(summary: dict[str, Any], as_json: bool, fixes: dict[str, str] | None = None) -> None:
    """After a client command's summary: its success rate and why queries were refused (stderr with --json)."""
    answers = summary.get("answers")
    if isinstance(answers, dict):  # simulate, replay
        ok, refused, reasons = int(answers.get("ok") or 0), int(answers.get("refused") or 0), answers.get("reasons")
    else:  # load
        ok, refused = int(summary.get("answers_ok") or 0), int(summary.get("answers_refused") or 0)
        reasons = summary.get("reasons")
    reasons = reasons or {}
    if ok + refused == 0:
        return
    out = [f"answered ok: {ok:,} of {ok + refused:,} answers ({ok / (ok + refused):.1%})"]
    if reasons:
        out.append("refused because:")
        out += refusal_lines(reasons, ok + refused, fixes)
    for line in out:
        if as_json:
            say(line)
        else:
            print(line)


def unreachable(exc: TransportError) -> int:
    print(f"kcloak: error: {exc}", file=sys.stderr)
    return 1


def run_and_report(
    args: argparse.Namespace,
    label: str,
    work: Callable[[Progress | None, asyncio.Event | None], Coroutine[Any, Any, Any]],
    *,
    announce: str | None = None,
    stoppable: bool = False,
    after: Callable[[dict[str, Any]], str | None] | None = None,
    fixes: dict[str, str] | None = None,
) -> int:
    """``kcloak LABEL``'s run: probe the broker, run ``work(progress)`` with a progress bar on stderr, print its
    summary (``--json``: one object); exit 0, or 1 when the broker is unreachable, not kcloak or lost.
    Bad input raises (exit 2 through the command line's exit-code table)."""
    from kcloak.simulators.transport import TransportError

    with progress_bar(not args.no_progress, label) as update:
        try:
            summary = run_client(
                args.broker, args.tokens, lambda stop: work(update, stop), announce=announce, stoppable=stoppable
            )
        except TransportError as exc:
            return unreachable(exc)
    obj = summary.to_json()
    emit(obj, args.json, f"kcloak {label}")
    explain(obj, args.json, fixes)
    note = after(obj) if after is not None else None
    if note is not None:
        say(note)
    return 0

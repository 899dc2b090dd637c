"""The soak's verdict on synthetic samples: each criterion fails when violated and only then; the
answer ledger; the outside looks at a process and a data directory."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kcloak.simulators.soak import AnswerLedger, Criteria, LedgerTotals, Sample, read_process, sqlite_sizes, verdict

MiB = 2**20
TARGET = 100.0
CRIT = Criteria(warmup_s=120.0)
ALL_ONCE = LedgerTotals(sent=60_000, answered_once=60_000, unanswered=0, duplicated=0, stray=0)


def samples(
    minutes: int = 20,
    *,
    rss: list[float] | None = None,
    p99: Sequence[float | None] | None = None,
    refusals: dict[int, dict[str, int]] | None = None,
    answers: dict[int, int] | None = None,
) -> list[Sample]:
    """One sample a minute: RSS in MiB, p99 in ms, refusals and answers of a minute by its index."""
    out = []
    for i in range(minutes):
        out.append(
            Sample(
                t_s=60.0 * (i + 1),
                interval_s=60.0,
                rss_bytes=int((rss[i] if rss else 100.0) * MiB),
                children_rss_bytes=0,
                open_files=40,
                cpu_s=10.0 * i,
                sqlite_bytes={"movement.sqlite3": 4096, "movement.sqlite3-wal": 1000 * i},
                queue_depths={"cloak": 0.0, "upstream": 0.0},
                queries_sent=6000,
                answers=(answers or {}).get(i, 6000),
                refusals=(refusals or {}).get(i, {"k_unreachable": 30}),
                p99_ms=p99[i] if p99 else 20.0,
            )
        )
    return out


def failed(v: object) -> set[str]:
    return {c.name for c in v.checks if not c.passed}  # type: ignore[attr-defined]


def test_a_steady_run_passes_every_check() -> None:
    v = verdict(samples(), ALL_ONCE, TARGET, CRIT)
    assert v.passed and failed(v) == set() and v.reasons() == []
    assert [c.name for c in v.checks] == ["rss_growth", "p99_drift", "refusals", "exactly_once", "load_held"]


def test_rss_growth_over_5_percent_after_warmup_fails() -> None:
    rss = [100.0] * 20
    rss[19] = 105.5  # +5.5 % over minute 2
    v = verdict(samples(rss=rss), ALL_ONCE, TARGET, CRIT)
    assert failed(v) == {"rss_growth"}
    assert v.checks[0].value == pytest.approx(0.055, abs=1e-3)
    assert "rss_growth" in v.reasons()[0]


def test_rss_growth_of_4_percent_and_growth_during_warmup_pass() -> None:
    rss = [50.0, 100.0] + [100.0 + 4.0 * i / 17 for i in range(18)]  # doubles in warm-up, then +4 %
    assert verdict(samples(rss=rss), ALL_ONCE, TARGET, CRIT).passed


def test_a_slow_leak_fails_even_when_rss_falls_back_at_the_end() -> None:
    rss = [100.0] * 20
    rss[10] = 106.0
    assert failed(verdict(samples(rss=rss), ALL_ONCE, TARGET, CRIT)) == {"rss_growth"}


def test_p99_rising_by_more_than_20_percent_fails() -> None:
    p99: list[float | None] = [20.0] * 20
    for i in range(15, 20):
        p99[i] = 25.0  # the last quarter +25 %
    v = verdict(samples(p99=p99), ALL_ONCE, TARGET, CRIT)
    assert failed(v) == {"p99_drift"}
    assert v.checks[1].value == pytest.approx(0.25)


def test_p99_within_20_percent_one_noisy_minute_and_a_falling_p99_pass() -> None:
    rising = [20.0] * 15 + [23.9] * 5
    noisy: list[float | None] = [20.0] * 20
    noisy[18] = 200.0  # one minute of a busy shared host: the median of the last quarter ignores it
    falling = [30.0] * 10 + [15.0] * 10
    for p99 in (rising, noisy, falling):
        assert verdict(samples(p99=p99), ALL_ONCE, TARGET, CRIT).passed, p99


def test_p99_of_the_warmup_does_not_count() -> None:
    p99 = [80.0, 80.0] + [20.0] * 18
    assert verdict(samples(p99=p99), ALL_ONCE, TARGET, CRIT).passed


@pytest.mark.parametrize("code", ["overloaded", "internal", "rate_limited", "upstream_error", "stale_position"])
def test_a_refusal_not_caused_by_a_profile_fails_even_in_warmup(code: str) -> None:
    v = verdict(samples(refusals={0: {code: 1}}), ALL_ONCE, TARGET, CRIT)
    assert failed(v) == {"refusals"}
    assert code in v.reasons()[0]


def test_profile_driven_refusals_pass_in_any_number() -> None:
    many = {i: {"k_unreachable": 500, "area_exceeded": 400, "l_unreachable": 3, "expired": 2} for i in range(20)}
    assert verdict(samples(refusals=many), ALL_ONCE, TARGET, CRIT).passed


@pytest.mark.parametrize(
    "totals",
    [
        LedgerTotals(sent=10, answered_once=9, unanswered=1, duplicated=0, stray=0),
        LedgerTotals(sent=10, answered_once=9, unanswered=0, duplicated=1, stray=0),
        LedgerTotals(sent=10, answered_once=10, unanswered=0, duplicated=0, stray=1),
        LedgerTotals(sent=0, answered_once=0, unanswered=0, duplicated=0, stray=0),
    ],
)
def test_a_query_unanswered_answered_twice_an_unknown_answer_or_no_query_fails(totals: LedgerTotals) -> None:
    assert failed(verdict(samples(), totals, TARGET, CRIT)) == {"exactly_once"}


def test_an_interval_below_80_percent_of_the_target_rate_fails() -> None:
    v = verdict(samples(answers={12: 4700}), ALL_ONCE, TARGET, CRIT)  # 78 % of 100/s × 60 s
    assert failed(v) == {"load_held"}
    assert verdict(samples(answers={12: 4900, 0: 10}), ALL_ONCE, TARGET, CRIT).passed  # 82 %; warm-up ignored


def test_a_run_too_short_to_judge_fails_instead_of_passing() -> None:
    v = verdict(samples(minutes=2), ALL_ONCE, TARGET, CRIT)
    assert {"rss_growth", "p99_drift", "load_held"} <= failed(v)
    assert all("too short" in r for r in v.reasons() if not r.startswith("refusals"))


def test_the_warmup_and_limits_are_the_criteria_s() -> None:
    rss = [100.0] * 20
    rss[19] = 108.0
    assert not verdict(samples(rss=rss), ALL_ONCE, TARGET, CRIT).passed
    assert verdict(samples(rss=rss), ALL_ONCE, TARGET, dataclasses.replace(CRIT, rss_growth_max=0.1)).passed


# -- the ledger ---------------------------------------------------------------------------------------
def test_ledger_counts_each_query_s_answers_and_unknown_ones() -> None:
    ledger = AnswerLedger()
    for i in range(1, 6):
        ledger.sent_query(f"ab12-q{i}")
    ledger.answer(b'{"query_id":"ab12-q1","status":"ok","results":[]}')
    ledger.answer(b'{"query_id":"ab12-q2","status":"refused","reason":"overloaded"}')
    ledger.answer(b'{"query_id":"ab12-q2","status":"ok"}')  # a second answer
    ledger.answer(b'{"query_id":"ab12-q3","status":"refused","reason":"k_unreachable"}')
    ledger.answer(b'{"query_id":"ab12-q9","status":"ok"}')  # never sent
    ledger.answer(b'{"query_id":"other-q4","status":"ok"}')  # another run's
    ledger.answer(b"not json")
    ledger.answer(b'{"query_id":"ab12-q5","status":"ok"}')
    ledger.answer(b'{"query_id":"ab12-q5","status":"ok"}')
    ledger.answer(b'{"query_id":"ab12-q5","status":"ok"}')
    t = ledger.totals()
    assert (t.sent, t.answered_once, t.unanswered, t.duplicated, t.stray) == (5, 2, 1, 2, 3)
    assert ledger.first_answers == 4
    assert dict(ledger.refusals) == {"overloaded": 1, "k_unreachable": 1}


def test_ledger_holds_a_few_bytes_per_query() -> None:
    ledger = AnswerLedger()
    for i in range(200_000):
        ledger.sent_query(f"r-q{i}")
    assert ledger.totals().unanswered == 200_000
    assert len(ledger.counts) + len(ledger.sent_flags) < 5 * 200_000


def test_ledger_refuses_ids_it_cannot_count() -> None:
    ledger = AnswerLedger()
    ledger.sent_query("a-q1")
    with pytest.raises(ValueError):
        ledger.sent_query("b-q2")
    with pytest.raises(ValueError):
        ledger.sent_query("no-number")


# -- looking from outside -----------------------------------------------------------------------------
@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process holding 64 MiB it has written to and 30 open files, with a child holding 32 MiB."""
    code = (
        "import os, subprocess, sys\n"
        "b = bytearray(64 * 2**20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"
        f"fs = [open(os.path.join({str(tmp_path)!r}, str(i)), 'w') for i in range(30)]\n"
        "c = subprocess.Popen([sys.executable, '-c', "
        "'b = bytearray(32 * 2**20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\nprint(1, flush=True)\\ninput()'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "c.stdout.readline()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "c.stdin.write('\\n'); c.stdin.flush(); c.wait()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(10)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_read_process_sees_memory_files_and_children(holder: subprocess.Popen[str]) -> None:
    look = read_process(holder.pid)
    assert 64 * 2**20 <= look.rss_bytes < 200 * 2**20
    assert 32 * 2**20 <= look.children_rss_bytes < 150 * 2**20
    assert 30 + 3 <= look.open_files < 60
    assert look.cpu_s >= 0.0


def test_read_process_of_a_gone_process_raises_oserror() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(OSError):
        read_process(proc.pid)


def test_sqlite_sizes_include_the_write_ahead_log(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    db = sqlite3.connect(tmp_path / "sub" / "store.sqlite3")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x BLOB)")
    db.executemany("INSERT INTO t VALUES (?)", [(os.urandom(1000),) for _ in range(200)])
    db.commit()
    (tmp_path / "notes.txt").write_text("not a database")
    sizes = sqlite_sizes(tmp_path)
    db.close()
    assert set(sizes) >= {"sub/store.sqlite3", "sub/store.sqlite3-wal"} and "notes.txt" not in sizes
    assert sizes["sub/store.sqlite3-wal"] > 200 * 1000


def test_upstream_failures_are_the_interval_s_failed_attempts_by_outcome() -> None:
    """As scraped from /metrics: ``ok`` and outcomes that did not grow are left out."""
    from kcloak.cli._soak_run import upstream_failures

    name = "kcloak_upstream_seconds_count"
    before = {f'{name}{{outcome="ok"}}': 100.0, f'{name}{{outcome="timeout"}}': 3.0, "kcloak_other_total": 1.0}
    after = {
        f'{name}{{outcome="ok"}}': 900.0,
        f'{name}{{outcome="timeout"}}': 10.0,
        f'{name}{{outcome="connection_error"}}': 2.0,
        f'{name}{{outcome="http_error"}}': 0.0,
        'kcloak_upstream_seconds_bucket{outcome="timeout",le="+Inf"}': 10.0,
    }
    assert upstream_failures(before, after) == {"connection_error": 2, "timeout": 7}
    assert upstream_failures(after, after) == {}

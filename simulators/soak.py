"""What ``kcloak bench soak`` observes from outside a running broker, and its verdict.

Three kinds of observation, none of them inside the broker:

* the broker's process as the operating system sees it (:func:`read_process`: resident memory,
  open files and CPU time from ``/proc``, for the process and its children);
* its data directory on disk (:func:`sqlite_sizes`: every SQLite file, ``-wal`` and ``-shm``
  included) and its ``/metrics`` (read as ``kcloak bench broker`` reads it, then :func:`gauge_by_label`,
  :func:`counter_sum`);
* what the clients saw: :class:`AnswerLedger` counts every answer message per ``query_id`` from a
  connection of its own, so a query answered twice, never, or an answer nobody asked for is seen.

:func:`verdict` is a pure function of the samples and the ledger's totals (:class:`Criteria`
holds the limits), so its logic can be tested on synthetic samples.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

PROFILE_REASONS: Final = frozenset({"k_unreachable", "area_exceeded", "l_unreachable", "expired"})
"""Refusals a user's privacy profile causes (too few users near, region too large, too few place
kinds, a held query not met within ``max_delay_s``): expected under street traffic, never a failure.
Every other reason (``overloaded``, ``internal``, ``rate_limited``, ``upstream_error``,
``stale_position``, ``shutdown``, ``invalid``, ...) is the broker failing its users and fails the soak."""


@dataclass(frozen=True, slots=True)
class Criteria:
    """The pass limits of a soak."""

    warmup_s: float = 120.0
    """Memory and latency are judged only after this (caches fill, the interpreter warms up)."""
    rss_growth_max: float = 0.05
    """Largest allowed growth of the broker's resident memory over its value at the end of warm-up."""
    p99_drift_max: float = 0.20
    """Largest allowed rise of the p99 latency, last quarter of the run against the first (after warm-up)."""
    load_min: float = 0.8
    """Each interval after warm-up must have answered at least this share of the target query rate."""
    profile_reasons: frozenset[str] = PROFILE_REASONS


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at the broker, ``t_s`` seconds into the traffic, covering the interval since the previous one."""

    t_s: float
    interval_s: float
    rss_bytes: int
    """Resident memory of the broker's own process."""
    children_rss_bytes: int
    """Resident memory of its child processes (the publication worker, when running)."""
    open_files: int
    cpu_s: float
    """CPU seconds (user + system) the broker's process has used since it started."""
    sqlite_bytes: Mapping[str, int]
    """Size of each SQLite file in the data directory (relative name → bytes)."""
    queue_depths: Mapping[str, float]
    """``kcloak_queue_depth{queue}`` at the time of the sample."""
    queries_sent: int
    answers: int
    """Answers that arrived in the interval (each query's first; duplicates are the ledger's)."""
    refusals: Mapping[str, int]
    """Refused answers of the interval by reason code."""
    p99_ms: float | None
    """p99 latency the clients measured (intended send time → answer) for the interval's answers."""
    added_p99_ms: float | None = None
    """p99 of the broker's own ``kcloak_added_latency_seconds`` over the interval (upstream excluded)."""
    fixes_accepted: int = 0
    windows: int = 0
    """Publication windows the broker committed in the interval (``kcloak_published_windows_total``)."""
    upstream_failures: Mapping[str, int] = field(default_factory=dict)
    """Upstream attempts of the interval that failed, by outcome (``kcloak_upstream_seconds_count{outcome}``
    but ``ok``: ``timeout``, ``connection_error``, ``http_error``, ...)."""
    loadavg_1m: float | None = None
    """The host's 1-minute load average at the time of the sample (the soak shares the host)."""

    def sqlite_total(self) -> int:
        return sum(self.sqlite_bytes.values())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["sqlite_bytes"] = dict(self.sqlite_bytes)
        out["queue_depths"] = dict(self.queue_depths)
        out["refusals"] = dict(sorted(self.refusals.items()))
        out["upstream_failures"] = dict(sorted(self.upstream_failures.items()))
        out["sqlite_total_bytes"] = self.sqlite_total()
        return out


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """The ledger's account at the end: every query sent, and how often each was answered."""

    sent: int
    answered_once: int
    unanswered: int
    duplicated: int
    """Queries answered more than once."""
    stray: int
    """Answers to a ``query_id`` never sent (or not of this run)."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    value: float | None
    limit: float | None
    detail: str


@dataclass(frozen=True, slots=True)
class Verdict:
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def reasons(self) -> list[str]:
        """One line per failed check."""
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [asdict(c) for c in self.checks], "reasons": self.reasons()}


def _after_warmup(samples: Sequence[Sample], warmup_s: float) -> list[Sample]:
    """Samples whose whole interval lies after warm-up."""
    return [s for s in samples if s.t_s - s.interval_s >= warmup_s - 1e-6]


def rss_check(samples: Sequence[Sample], c: Criteria) -> Check:
    """Growth of the broker's RSS: the largest value after warm-up against the first sample taken at
    or after the end of warm-up."""
    later = [s for s in samples if s.t_s >= c.warmup_s - 1e-6]
    if len(later) < 2:
        return Check(
            "rss_growth", False, None, c.rss_growth_max, "too short to judge: fewer than 2 samples after warm-up"
        )
    base = later[0].rss_bytes
    peak = max(s.rss_bytes for s in later[1:])
    growth = peak / base - 1.0 if base > 0 else math.inf
    ok = growth <= c.rss_growth_max
    detail = (
        f"RSS {base / 2**20:.1f} MiB at {later[0].t_s:.0f} s, peak {peak / 2**20:.1f} MiB after: "
        f"{growth * 100:+.1f} % ({'≤' if ok else '>'} {c.rss_growth_max * 100:.0f} %)"
    )
    return Check("rss_growth", ok, growth, c.rss_growth_max, detail)


def p99_check(samples: Sequence[Sample], c: Criteria) -> Check:
    """Rise of the p99 latency: the median of the per-interval p99s of the last quarter of the
    intervals after warm-up against that of the first quarter (at least one interval each); the
    median keeps one noisy interval from deciding. Only a rise fails."""
    p99s = [s.p99_ms for s in _after_warmup(samples, c.warmup_s) if s.p99_ms is not None]
    if len(p99s) < 2:
        return Check(
            "p99_drift", False, None, c.p99_drift_max, "too short to judge: fewer than 2 intervals after warm-up"
        )
    q = max(1, len(p99s) // 4)
    first, last = statistics.median(p99s[:q]), statistics.median(p99s[-q:])
    drift = last / first - 1.0 if first > 0 else (0.0 if last == 0 else math.inf)
    ok = drift <= c.p99_drift_max
    detail = (
        f"p99 {first:.1f} ms (first {q} interval(s) after warm-up) → {last:.1f} ms (last {q}): "
        f"{drift * 100:+.1f} % ({'≤' if ok else '>'} {c.p99_drift_max * 100:.0f} %)"
    )
    return Check("p99_drift", ok, drift, c.p99_drift_max, detail)


def refusals_check(samples: Sequence[Sample], c: Criteria) -> Check:
    """No refusal but the profile-driven ones, over the whole run (warm-up included)."""
    bad: Counter[str] = Counter()
    for s in samples:
        bad.update({code: n for code, n in s.refusals.items() if code not in c.profile_reasons and n})
    total = sum(bad.values())
    if total:
        detail = "refusals not caused by a profile: " + ", ".join(f"{k} {v}" for k, v in sorted(bad.items()))
    else:
        profile = sum(n for s in samples for code, n in s.refusals.items() if code in c.profile_reasons)
        detail = f"none but profile-driven ones ({profile} of {', '.join(sorted(c.profile_reasons))})"
    return Check("refusals", total == 0, float(total), 0.0, detail)


def exactly_once_check(totals: LedgerTotals) -> Check:
    """Every query sent got exactly one answer, and no answer came for a query not sent."""
    wrong = totals.unanswered + totals.duplicated + totals.stray
    ok = wrong == 0 and totals.sent > 0
    detail = (
        f"{totals.sent} queries: {totals.answered_once} answered once, {totals.unanswered} never, "
        f"{totals.duplicated} more than once; {totals.stray} answers to unknown query ids"
    )
    return Check("exactly_once", ok, float(wrong), 0.0, detail)


def load_check(samples: Sequence[Sample], c: Criteria, target_qps: float) -> Check:
    """Each interval after warm-up answered at least ``load_min`` of the target rate (else the soak
    did not run the load it claims, e.g. an overloaded host made the clients fall behind)."""
    later = _after_warmup(samples, c.warmup_s)
    if not later or target_qps <= 0:
        return Check("load_held", False, None, c.load_min, "too short to judge: no interval after warm-up")
    worst = min(s.answers / (target_qps * s.interval_s) for s in later)
    ok = worst >= c.load_min
    detail = (
        f"lowest interval answered {worst * 100:.0f} % of {target_qps:.0f} queries/s "
        f"({'≥' if ok else '<'} {c.load_min * 100:.0f} %)"
    )
    return Check("load_held", ok, worst, c.load_min, detail)


def verdict(samples: Sequence[Sample], totals: LedgerTotals, target_qps: float, criteria: Criteria) -> Verdict:
    """The soak's verdict: each :class:`Check` with its value, its limit and a sentence."""
    return Verdict(
        (
            rss_check(samples, criteria),
            p99_check(samples, criteria),
            refusals_check(samples, criteria),
            exactly_once_check(totals),
            load_check(samples, criteria, target_qps),
        )
    )


# -- the ledger ---------------------------------------------------------------------------------------
_SEQ = re.compile(r"^(.*?)(\d+)$")


@dataclass(slots=True)
class AnswerLedger:
    """Every query sent and every answer message seen, per ``query_id``.

    Query ids of a run share a prefix and end in a sequence number (``<prefix><n>``), so the
    ledger holds one byte per query (how often it was answered, up to 255) instead of a set of
    strings. :meth:`answer` takes the raw payload of an answer message and reads it itself.
    """

    prefix: str | None = None
    counts: bytearray = field(default_factory=bytearray)
    sent_flags: bytearray = field(default_factory=bytearray)
    sent: int = 0
    stray: int = 0
    first_answers: int = 0
    refusals: Counter[str] = field(default_factory=Counter)

    def _index(self, qid: str) -> int | None:
        m = _SEQ.match(qid)
        if m is None or m.group(1) != self.prefix:
            return None
        return int(m.group(2))

    def sent_query(self, qid: str) -> None:
        m = _SEQ.match(qid)
        if m is None:
            raise ValueError("query ids of a soak must end in a sequence number")
        if self.prefix is None:
            self.prefix = m.group(1)
        elif m.group(1) != self.prefix:
            raise ValueError("query ids of a soak must share one prefix")
        i = int(m.group(2))
        if i >= len(self.sent_flags):
            grow = max(i + 1 - len(self.sent_flags), len(self.sent_flags), 1024)
            self.sent_flags.extend(bytes(grow))
            self.counts.extend(bytes(grow))
        if not self.sent_flags[i]:
            self.sent_flags[i] = 1
            self.sent += 1

    def answer(self, payload: bytes) -> None:
        try:
            obj = json.loads(payload)
        except ValueError:
            self.stray += 1
            return
        qid = obj.get("query_id") if isinstance(obj, dict) else None
        i = self._index(qid) if isinstance(qid, str) else None
        if i is None or i >= len(self.sent_flags) or not self.sent_flags[i]:
            self.stray += 1
            return
        if self.counts[i] < 255:
            self.counts[i] += 1
        if self.counts[i] == 1:
            self.first_answers += 1
            if obj.get("status") != "ok":
                self.refusals[str(obj.get("reason", "unknown"))] += 1

    def totals(self) -> LedgerTotals:
        once = dup = 0
        for flag, n in zip(self.sent_flags, self.counts, strict=True):
            if flag:
                once += n == 1
                dup += n > 1
        return LedgerTotals(
            sent=self.sent,
            answered_once=once,
            unanswered=self.sent - once - dup,
            duplicated=dup,
            stray=self.stray,
        )


# -- looking at the broker from outside ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProcessLook:
    rss_bytes: int
    children_rss_bytes: int
    open_files: int
    cpu_s: float


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def read_process(pid: int) -> ProcessLook:
    """Resident memory, open file descriptors and CPU seconds of ``pid`` (Linux ``/proc``), and the
    resident memory of its descendants. Raises :class:`OSError` when the process is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
    open_files = len(os.listdir(f"/proc/{pid}/fd"))
    children = 0
    todo = _children(pid)
    while todo:
        child = todo.pop()
        try:
            children += _rss(child)
            todo += _children(child)
        except OSError:
            continue
    return ProcessLook(_rss(pid), children, open_files, cpu)


def sqlite_sizes(data_dir: Path) -> dict[str, int]:
    """Bytes of every SQLite file under ``data_dir`` (``*.db``, ``*.sqlite*`` and their ``-wal``/``-shm``)."""
    out: dict[str, int] = {}
    for path in sorted(data_dir.rglob("*")):
        name = path.name
        base = name.removesuffix("-wal").removesuffix("-shm").removesuffix("-journal")
        if base.endswith((".db", ".sqlite", ".sqlite3")) and path.is_file():
            try:
                out[str(path.relative_to(data_dir))] = path.stat().st_size
            except OSError:
                continue
    return out


def gauge_by_label(metrics: Mapping[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: value}`` of one labelled gauge, e.g. ``kcloak_queue_depth`` by ``queue``."""
    out: dict[str, float] = {}
    needle = f'{label}="'
    for key, value in metrics.items():
        if key.startswith(name + "{") and needle in key:
            out[key.split(needle, 1)[1].split('"', 1)[0]] = value
    return out


def counter_sum(metrics: Mapping[str, float], name: str, *needles: str) -> float:
    """Sum of a counter's series whose labels hold every needle."""
    return sum(v for k, v in metrics.items() if k.split("{", 1)[0] == name and all(n in k for n in needles))


def p99_ms(latencies_s: Sequence[float]) -> float | None:
    """Nearest-rank p99 of latencies in seconds, in milliseconds (None when empty)."""
    if not latencies_s:
        return None
    xs = sorted(latencies_s)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(0.99 * len(xs)) - 1))] * 1000.0, 3)


__all__ = [
    "PROFILE_REASONS",
    "AnswerLedger",
    "Check",
    "Criteria",
    "LedgerTotals",
    "ProcessLook",
    "Sample",
    "Verdict",
    "counter_sum",
    "gauge_by_label",
    "p99_ms",
    "read_process",
    "sqlite_sizes",
    "verdict",
]

"""The README's examples as a new user runs them. The "Running it" walkthrough: ``kcloak lbs``, ``kcloak serve`` and
``kcloak simulate`` started from the command line, then the README's three requests over plain HTTP.

A lone user is refused, and the refusal says in words what to change; once the simulator has put
a crowd around central Beijing, the same requests get an ``ok`` answer with a region of at least k
users and restaurants in it. Then "Testing a deployment": ``kcloak replay --sample`` and ``kcloak load``
say how long they take and keep to it.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conformance.conftest import ROOT, Served, Servers, http_json, kcloak

ALICE = {"lat": 39.9087, "lon": 116.3975}  # the README's position, near Tiananmen
QUERY = {"kind": "knn", "n": 5, "category": "restaurant"}


def _readme_sequence(base: str, qid: str, *, profile: bool = True) -> dict[str, object]:
    """The README's curl lines: a fix, the profile k = 10 (once: profile writes are rate limited), a knn
    query; returns the answer."""
    status, _, body = http_json("POST", f"{base}/v1/users/alice/location", {"t": time.time(), **ALICE})
    assert status == 200 and body == {"accepted": 1, "rejected": []}, body
    if profile:
        status, _, body = http_json("PUT", f"{base}/v1/users/alice/profile", {"k": 10})
        assert status == 200 and body["profile"]["k"] == 10, body
    status, _, answer = http_json("POST", f"{base}/v1/users/alice/query", {"query_id": qid, **QUERY})
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def _background(servers: Servers, argv: list[str]) -> subprocess.Popen[bytes]:
    """A client command started as the README starts it (in the background), its output piped; stopped with the
    servers."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    servers.procs.append(proc)
    return proc


def test_readme_curl_sequence_succeeds_while_simulate_runs(servers: Servers) -> None:
    served = servers.serve(upstream=servers.lbs())
    base = served.url("")

    alone = _readme_sequence(base, "q-alone")
    assert alone["status"] == "refused" and alone["reason"] == "k_unreachable", alone
    message = str(alone["message"])
    assert "k" in message and "retry" in message and "lower k" in message, message  # says what to change

    sim = _background(
        servers,
        kcloak(
            "simulate",
            "--broker",
            f"mqtt://127.0.0.1:{served.mqtt_port}",
            "--users",
            "300",
            "--duration",
            "5",
            "--query-rate",
            "20",
            "--seed",
            "7",
            "--json",
        ),
    )
    deadline = time.monotonic() + 30.0
    answers: list[dict[str, object]] = []
    while time.monotonic() < deadline and sim.poll() is None:
        answers.append(_readme_sequence(base, f"q{len(answers)}", profile=False))
        if answers[-1]["status"] == "ok":
            break
        time.sleep(0.5)
    stdout, stderr = (b.decode() for b in sim.communicate(timeout=60))
    ok = answers[-1] if answers else {}
    assert ok.get("status") == "ok", f"no ok answer while simulate ran: {answers[-3:]}\n{stderr[-2000:]}"
    assert isinstance(ok["k_achieved"], int) and ok["k_achieved"] >= 10
    west, south, east, north = (float(v) for v in ok["region"]["bbox"])  # type: ignore[index]
    assert west <= ALICE["lon"] <= east and south <= ALICE["lat"] <= north
    results = ok["results"]
    assert isinstance(results, list) and len(results) == 5
    assert all(r["category"] == "restaurant" for r in results)

    # simulate's own queries, with its default area: most succeed, and each refusal reason is explained.
    assert sim.returncode == 0, stderr
    answers_sim = json.loads(stdout)["answers"]
    answered = answers_sim["ok"] + answers_sim["refused"]
    assert answered >= 100, answers_sim
    assert answers_sim["ok"] / answered >= 0.8, answers_sim
    assert "square around central Beijing" in stderr
    assert f"answered ok: {answers_sim['ok']:,} of {answered:,}" in stderr
    for code, n in answers_sim["reasons"].items():
        assert f"  {code} {n:,}" in stderr, stderr  # each refusal reason, with what it means


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One ``kcloak serve`` (with the reference LBS) for the replay and load examples: they only send."""
    servers = Servers(tmp_path_factory.mktemp("shared"))
    try:
        yield servers.serve(upstream=servers.lbs())
    finally:
        servers.close()


def _count_sample_rows() -> int:
    """Data rows of the bundled replay sample, read with the standard library."""
    with gzip.open(ROOT / "simulators" / "data" / "ais_nyharbor.csv.gz", "rt", encoding="utf-8") as f:
        return sum(1 for _ in csv.reader(f)) - 1


def test_replay_sample_announces_its_length_and_stops_at_max_duration(shared: Served) -> None:
    """``kcloak replay --sample`` works from any folder (the sample is bundled), says before sending how
    long it will take, and ``--max-duration`` cuts the input: the fixes sent and left out add up."""
    served = shared
    t0 = time.monotonic()
    out = subprocess.run(
        kcloak(
            "replay",
            "--sample",
            "--speed",
            "600",
            "--max-duration",
            "2",
            "--json",
            "--broker",
            f"mqtt://127.0.0.1:{served.mqtt_port}",
        ),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    first = out.stderr.splitlines()[0]
    m = re.fullmatch(
        r"kcloak replay: ([\d,]+) fixes of ([\d,]+) users \(59 min 59 s recorded\) at speed 600: about (\d) s, "
        r"until \d\d:\d\d:\d\d; ([\d,]+) later fixes left out by --max-duration 2",
        first,
    )
    assert m is not None, first
    sent, users, eta_s, dropped = (int(g.replace(",", "")) for g in m.groups())
    report = json.loads(out.stdout)
    assert report["sent"] == sent and report["users"] == users
    assert sent + dropped + report["bad_rows"] == _count_sample_rows()
    assert eta_s == 2 and wall < 60  # it stopped at --max-duration, not at the hour / 600 = 6 s of the input


def test_replay_of_a_long_input_offers_a_speed(shared: Served) -> None:
    """At speed 1 the bundled hour takes an hour: the first line says so and names a --speed that fits 5 min."""
    served = shared
    proc = subprocess.Popen(
        kcloak("replay", "--sample", "--broker", f"mqtt://127.0.0.1:{served.mqtt_port}", "--json"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline().strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "at speed 1: about 1 h 0 min" in first, first
    assert "(--speed 12 plays it in 5 min 0 s; --max-duration S stops after S seconds)" in first, first


def test_load_accounts_for_its_time(shared: Served) -> None:
    """``kcloak load --duration 2``: the timed run stops on time and stderr says where the whole run's time went."""
    served = shared
    t0 = time.monotonic()
    out = subprocess.run(
        kcloak(
            "load",
            "--rate",
            "300",
            "--duration",
            "2",
            "--users",
            "300",
            "--json",
            "--broker",
            f"mqtt://127.0.0.1:{served.mqtt_port}",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    m = re.search(
        r"took ([\d.]+) s: start-up ([\d.]+) s \(Python, broker probe, connecting\), setup ([\d.]+) s \(users placed, "
        r"one fix each\), sending ([\d.]+) s \(--duration\), last answers ([\d.]+) s",
        out.stderr,
    )
    assert m is not None, out.stderr
    took, startup, setup, sending, drain = (float(g) for g in m.groups())
    assert abs(startup + setup + sending + drain - took) <= 0.25  # the parts add up (each rounded to 0.1 s)
    # and account for the time seen from outside: took is printed to 0.1 s (up to 0.05 s above the true value)
    # and counts from the process's start time in clock ticks (up to 0.01 s early); the exit comes after the line
    assert took - 0.06 <= wall and wall - took < 3.0
    assert 2.0 <= sending <= 2.3  # the timed run ends on time
    report = json.loads(out.stdout)
    sent = report["sent_updates"] + report["sent_queries"]
    assert sent + report["unsent"] == 600


@pytest.mark.parametrize(
    "command",
    [
        ("simulate", "--users", "200", "--duration", "600", "--seed", "3"),
        ("replay", "--sample", "--speed", "10"),
    ],
    ids=["simulate", "replay"],
)
def test_a_background_run_stopped_by_sigterm_still_reports(servers: Servers, command: tuple[str, ...]) -> None:
    """The README starts ``kcloak simulate`` in the background for ten minutes; ``kill`` (SIGTERM) ends such a run
    early, and the command still waits for its last answers and prints its summary (exit 0)."""
    served = servers.serve()
    proc = _background(servers, kcloak(*command, "--broker", f"mqtt://127.0.0.1:{served.mqtt_port}", "--json"))
    assert proc.stderr is not None
    announced = proc.stderr.readline().decode()  # written once the broker answered the probe, before any traffic
    assert announced.startswith(f"kcloak {command[0]}: "), announced
    time.sleep(3.0)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert time.monotonic() - started < 30.0  # stopped early, not at the end of its 10 min (or 6 min) run
    summary = json.loads(out)
    assert summary["sent"] > 0
    assert summary["duration_s"] < 60.0

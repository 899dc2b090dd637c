"""The README's "Running it" walkthrough, as a new user runs it: ``kcloak lbs``, ``kcloak serve`` and
``kcloak simulate`` started from the command line, then the README's three requests over plain HTTP.

A lone user is refused, and the refusal says in words what to change; once the simulator has put
a crowd around central Beijing, the same requests get an ``ok`` answer with a region of at least k
users and restaurants in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from tests.conformance.conftest import ROOT, Servers, free_port, http_json, kcloak

ALICE = {"lat": 39.9087, "lon": 116.3975}  # the README's position, near Tiananmen
QUERY = {"kind": "knn", "n": 5, "category": "restaurant"}


def _readme_sequence(base: str, qid: str) -> dict[str, object]:
    """The README's curl lines: a fix, the profile k = 10, a knn query; returns the answer."""
    status, _, body = http_json("POST", f"{base}/v1/users/alice/location", {"t": time.time(), **ALICE})
    assert status == 200 and body == {"accepted": 1, "rejected": []}, body
    status, _, body = http_json("PUT", f"{base}/v1/users/alice/profile", {"k": 10})
    assert status == 200 and body["profile"]["k"] == 10, body
    status, _, answer = http_json("POST", f"{base}/v1/users/alice/query", {"query_id": qid, **QUERY})
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def test_readme_curl_sequence_succeeds_while_simulate_runs(servers: Servers) -> None:
    served = servers.serve(upstream=servers.lbs())
    base = served.url("")

    alone = _readme_sequence(base, "q-alone")
    assert alone["status"] == "refused" and alone["reason"] == "k_unreachable", alone
    message = str(alone["message"])
    assert "k" in message and "retry" in message and "lower k" in message, message  # says what to change

    sim = subprocess.Popen(
        kcloak(
            "simulate",
            "--broker",
            f"mqtt://127.0.0.1:{served.mqtt_port}",
            "--users",
            "300",
            "--duration",
            "8",
            "--query-rate",
            "20",
            "--seed",
            "7",
            "--json",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    servers.procs.append(sim)
    deadline = time.monotonic() + 30.0
    answers: list[dict[str, object]] = []
    while time.monotonic() < deadline and sim.poll() is None:
        answers.append(_readme_sequence(base, f"q{len(answers)}"))
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


def test_simulate_area_flag_checks() -> None:
    """Bad ``--area``/``--bbox`` values are refused with exit 2 before any traffic."""
    port = free_port()  # nothing listens: the flags are checked first
    for flags in (["--area", "-3"], ["--area", "big"], ["--bbox", "116.5,39.9,116.4,40.0"], ["--bbox", "1,2,3"]):
        out = subprocess.run(
            kcloak("simulate", "--broker", f"mqtt://127.0.0.1:{port}", *flags),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 2, (flags, out.stderr)
        assert "--area" in out.stderr or "--bbox" in out.stderr, out.stderr

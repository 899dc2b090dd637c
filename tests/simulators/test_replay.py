"""Replay: time shifting and user mapping, then real GPX and AIS files through a real broker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcloak.core.readers import FixTable, read_fixes
from kcloak.simulators.replay import ReplayConfig, ReplayInputError, load_plan, plan_replay, resample, run_replay
from tests.broker.conftest import SpyUpstream, spy  # noqa: F401
from tests.simulators.test_traffic import count, fixes_counted, real_broker, settled, tokens_file

DATA = Path(__file__).resolve().parents[1] / "data"
GPX = DATA / "around-visnjan-with-car.gpx"
AIS = DATA / "ais_nyharbor.csv.gz"


def _table(rows: list[tuple[str, float, float, float]], bad: int = 0) -> FixTable:
    ids, t, lat, lon = zip(*rows, strict=True)
    return FixTable(np.array(ids), np.array(t, float), np.array(lat, float), np.array(lon, float), bad)


def test_plan_shifts_times_keeps_order_and_numbers_users_by_first_appearance() -> None:
    table = _table([("b", 110.0, 1.0, 1.0), ("a", 100.0, 2.0, 2.0), ("b", 104.0, 1.5, 1.5), ("a", 130.0, 3, 3)])
    plan = plan_replay(table, ReplayConfig(input=Path("x"), speed=2.0), None)
    assert plan.users == ["r000001", "r000002"]  # "b" appears first in the file
    assert plan.offset_s.tolist() == [1.0, 3.0, 6.0, 16.0]  # start + 1 s, then (t - t_min) / speed
    assert plan.user.tolist() == [1, 0, 0, 1]
    assert plan.lat.tolist() == [2.0, 1.5, 1.0, 3.0]
    limited = plan_replay(table, ReplayConfig(input=Path("x"), limit=2, user_prefix="v"), None)
    assert len(limited) == 2 and limited.users == ["v000001", "v000002"]
    with pytest.raises(ReplayInputError):  # more sources than tokens
        plan_replay(table, ReplayConfig(input=Path("x")), [("alice", "t")])
    toks = plan_replay(table, ReplayConfig(input=Path("x")), [("alice", "t"), ("bob", "u"), ("carol", "v")])
    assert toks.users == ["alice", "bob"]


def test_interpolation_resamples_each_trajectory() -> None:
    t, (v,) = resample(np.array([0.0, 10.0, 25.0]), [np.array([0.0, 10.0, 40.0])], 5.0)
    assert t.tolist() == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
    assert v.tolist() == [0.0, 5.0, 10.0, 20.0, 30.0, 40.0]
    table = _table([("a", 0.0, 39.0, 116.0), ("a", 10.0, 39.1, 116.1), ("b", 3.0, 40.0, 117.0)])
    plan = plan_replay(table, ReplayConfig(input=Path("x"), interpolate_s=2.5), None)
    assert len(plan) == 5 + 1
    assert np.all(np.diff(plan.offset_s) >= 0)


def test_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ReplayInputError):
        load_plan(ReplayConfig(input=tmp_path / "missing.csv"))
    (tmp_path / "junk.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ReplayInputError):
        load_plan(ReplayConfig(input=tmp_path / "junk.csv"))
    for bad in ({"speed": 0.0}, {"interpolate_s": -1.0}, {"limit": 0}, {"format": "kml"}):
        with pytest.raises(ReplayInputError):
            ReplayConfig(input=GPX, **bad)


async def test_replay_public_ais_over_mqtt_is_counted_exactly(tmp_path: Path, spy: SpyUpstream) -> None:  # noqa: F811
    table = read_fixes(AIS)
    async with real_broker(tmp_path, spy.url, "embedded") as (b, url):
        s = await run_replay(ReplayConfig(input=AIS, speed=3000.0, broker=url, queries_per_min=30.0, seed=2))
        text = await settled(b, "mqtt", s.sent)
    assert s.users == table.n_trajectories == 295 and s.bad_rows == table.bad_rows == 2
    assert s.sent == len(table) and s.accepted is None
    assert fixes_counted(text, "mqtt") == s.sent
    assert count(text, "kcloak_updates_accepted_total") + count(text, "kcloak_updates_rejected_total") == s.sent
    # Stamps are the scheduled send times, strictly increasing per user: nothing is out of order.
    assert count(text, "kcloak_updates_rejected_total", 'reason="out_of_order"') == 0
    assert s.queries > 0 and count(text, "kcloak_queries_total") == s.queries == s.answers_ok + s.answers_refused
    assert 1.0 < s.duration_s < 5.0
    assert s.to_json()["bad_rows"] == 2


async def test_replay_gpx_over_http_with_tokens(tmp_path: Path, spy: SpyUpstream) -> None:  # noqa: F811
    with tokens_file(tmp_path, ["driver", "spare"]) as tokens:
        async with real_broker(tmp_path, spy.url, "http", **{"auth.tokens": str(tokens)}) as (b, url):
            s = await run_replay(ReplayConfig(input=GPX, speed=400.0, broker=url, tokens=tokens))
            text = await settled(b, "http", s.sent)
    assert s.users == 1 and s.sent == 104 and s.bad_rows == 0
    assert s.accepted is not None and s.accepted + sum(s.refused.values()) == s.sent
    assert count(text, "kcloak_updates_accepted_total", 'transport="http"') == s.accepted
    assert fixes_counted(text, "http") == s.sent
    assert count(text, "kcloak_messages_total", 'topic="updates"') == 0  # own route, one fix per request


async def test_replay_contract_csv_with_bad_rows_and_interpolation(tmp_path: Path, spy: SpyUpstream) -> None:  # noqa: F811
    csv = tmp_path / "in.csv"
    csv.write_text(
        "traj_id,t,lat,lon\n"
        "a,1000,39.90,116.40\na,1010,39.91,116.41\na,1005,oops,116.40\n"
        "b,1002,39.95,116.45\nb,1002,39.95,116.45\nb,1012,95,116.45\nb,1020,39.96,116.46\n"
    )
    async with real_broker(tmp_path, spy.url, "http") as (b, url):
        s = await run_replay(ReplayConfig(input=csv, speed=20.0, interpolate_s=2.0, broker=url))
        text = await settled(b, "http", s.sent)
    # a: 1000..1010 every 2 s = 6 fixes; b: 1002..1020 every 2 s = 10 fixes; 3 bad rows skipped.
    assert s.bad_rows == 3 and s.users == 2 and s.sent == 16
    assert s.accepted == 16 and fixes_counted(text, "http") == 16


@pytest.mark.parametrize("with_tokens", [False, True])
async def test_replay_over_http_keeps_each_users_order(tmp_path: Path, spy: SpyUpstream, with_tokens: bool) -> None:  # noqa: F811
    """Fast replay over HTTP sends many requests at once; a user's fixes still arrive in order."""
    csv = tmp_path / "fast.csv"
    rows = [
        f"{u},{1000 + i},{39.9 + i * 1e-4:.6f},{116.4 + j * 1e-3:.6f}" for i in range(150) for j, u in enumerate("xyz")
    ]
    csv.write_text("traj_id,t,lat,lon\n" + "\n".join(rows) + "\n")
    with tokens_file(tmp_path, ["u1", "u2", "u3"]) as tokens:
        extra = {"auth.tokens": str(tokens)} if with_tokens else {}
        async with real_broker(tmp_path, spy.url, "http", **extra) as (b, url):
            cfg = ReplayConfig(input=csv, speed=1000.0, broker=url, tokens=tokens if with_tokens else None)
            s = await run_replay(cfg)
            text = await settled(b, "http", s.sent)
    assert s.sent == 450 and s.accepted == 450 and not s.refused
    assert count(text, "kcloak_updates_rejected_total", 'reason="out_of_order"') == 0

"""Every snapshot cloaker on real AIS positions, every region checked independently (CONCEPTS §9.1).

Data: ``tests/data/ais_nyharbor.csv.gz`` (New York harbour, 2020-06-30 00:00–01:00 UTC, 295
vessels; see ``tests/data/ATTRIBUTION.md``). Snapshots every 10 minutes hold the latest fix of each
vessel seen within the last ``STALE_AFTER_S`` = 600 s: AIS class B transponders report every
30 s–3 min and moored or slow vessels even less often, so the broker's default 60 s window would
leave only a handful of vessels present. The position index is fed the raw fixes and snapshotted
the production way; the checker gets the same raw fixes and decides presence itself.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kcloak.cloaking.checks import (
    Places,
    Published,
    Snapshot,
    Violation,
    check_clique_stream,
    check_refusal,
    check_region,
)
from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.cloakers.base import Refusal, Region
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile

DATA = Path(__file__).resolve().parents[1] / "data" / "ais_nyharbor.csv.gz"
STALE_AFTER_S = 600.0
STEP_S = 600
KS = (2, 5, 10)
MAX_AREA_M2 = 2.5e9
"""The contract's cap: harbour vessels are sparse, so a smaller bound mostly tests refusals."""
ALGORITHMS = ("nn", "interval", "casper", "hilbert", "privacygrid")
REPLAY_EVERY = 5
"""Checks 1–5 run on every region; determinism (same view and an independently built one) on every
5th vessel, and reciprocity (check 6) on every region of a reciprocal cloaker."""
ALLOWED = frozenset({"k_unreachable", "area_exceeded"})


@dataclass(frozen=True, slots=True)
class Fixes:
    """AIS rows in file (= time) order: MMSI as the user id, UTC seconds, position."""

    ids: list[str]
    t: npt.NDArray[np.float64]
    lat: npt.NDArray[np.float64]
    lon: npt.NDArray[np.float64]


def read_ais(path: Path) -> Fixes:
    """MMSI, BaseDateTime (UTC, no zone suffix), LAT, LON of a MarineCadastre-layout CSV."""
    ids: list[str] = []
    t: list[float] = []
    lat: list[float] = []
    lon: list[float] = []
    with gzip.open(path, "rt", encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh):
            ids.append(row["MMSI"])
            t.append(datetime.fromisoformat(row["BaseDateTime"]).replace(tzinfo=UTC).timestamp())
            lat.append(float(row["LAT"]))
            lon.append(float(row["LON"]))
    return Fixes(ids, np.array(t), np.array(lat), np.array(lon))


@pytest.fixture(scope="module")
def fixes() -> Fixes:
    return read_ais(DATA)


def snapshot_times(f: Fixes) -> list[float]:
    t0 = float(f.t.min())
    return [t0 + STEP_S * i for i in range(1, int((f.t.max() - t0) // STEP_S) + 2)]


def build(f: Fixes, now: float, k: int) -> tuple[Snapshot, IndexView, IndexView]:
    """Checker snapshot from the raw fixes, and two views taken from a position index (for replay)."""
    upto = int(np.searchsorted(f.t, now, side="right"))
    index = PositionIndex(stale_after_s=STALE_AFTER_S, default_profile=PrivacyProfile(k=k, max_area_m2=MAX_AREA_M2))
    index.update_batch(f.ids[:upto], f.lat[:upto], f.lon[:upto], f.t[:upto])
    snap = Snapshot.from_arrays(
        f.ids[:upto], f.lat[:upto], f.lon[:upto], f.t[:upto], now=now, stale_after_s=STALE_AFTER_S
    )
    return snap, index.snapshot(now, seed=11), index.snapshot(now, seed=11)


def test_reader_and_snapshots(fixes: Fixes) -> None:
    assert len(fixes.ids) == 8689
    assert len(set(fixes.ids)) == 295
    assert bool(np.all(np.diff(fixes.t) >= 0))  # time order, as the attribution states
    times = snapshot_times(fixes)
    assert len(times) == 6
    sizes = [build(fixes, now, 5)[0].n_present for now in times]
    assert all(100 <= s <= 295 for s in sizes), sizes


def _bundled_places() -> tuple[PlacesLayer, Places]:
    layer = PlacesLayer.bundled()
    return layer, Places.from_arrays(layer.lat, layer.lon, layer.category_code.tolist())


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_region_on_ais_passes_the_checker(fixes: Fixes, name: str) -> None:
    try:
        cloaker: Any = get_cloaker(name)
    except ModuleNotFoundError:
        pytest.skip(f"{name}: module not written yet")
    layer, places = _bundled_places()
    failures: list[Violation] = []
    answered = refused = 0
    for now in snapshot_times(fixes):
        for k in KS:
            snap, view, replay = build(fixes, now, k)
            profile = PrivacyProfile(k=k, max_area_m2=MAX_AREA_M2)
            stored = dict.fromkeys(view.user_ids, profile)
            for row, user in enumerate(view.user_ids):
                res = cloaker.cloak(view, row, profile)
                if isinstance(res, Region):
                    answered += 1
                    black_box = cloaker.reciprocal or row % REPLAY_EVERY == 0
                    failures += check_region(
                        snap,
                        user,
                        Published.of(res),
                        effective=profile,
                        stored=stored,
                        places=places if name == "privacygrid" else None,
                        cloaker=cloaker if black_box else None,
                        view=view if black_box else None,
                        replay_view=replay if row % REPLAY_EVERY == 0 else None,
                    )
                else:
                    assert isinstance(res, Refusal)
                    refused += 1
                    failures += check_refusal(
                        snap, user, str(res.reason), effective=profile, allowed=ALLOWED, supports_l=False
                    ).violations
    assert failures == [], "\n".join(str(v) for v in failures[:20])
    assert answered > 0.9 * (answered + refused), (answered, refused)
    assert layer.category_names  # the bundled layer was really used for privacygrid's l_achieved


# -- clique on the AIS stream (§9.4) ---------------------------------------------------------------

CLIQUE_DELAY_S = 60.0


def clique_requests(f: Fixes, k: int, max_area_m2: float, *, spaced: bool) -> list[Any]:
    """One request per AIS fix (receipt time = fix time); ``spaced`` keeps a vessel's next request only
    once its previous one has been released or expired (more than ``CLIQUE_DELAY_S`` later)."""
    from kcloak.cloaking.cloakers.clique import CliqueRequest

    last: dict[str, float] = {}
    out = []
    for i, (user, t, lat, lon) in enumerate(zip(f.ids, f.t.tolist(), f.lat.tolist(), f.lon.tolist(), strict=True)):
        if spaced and user in last and t - last[user] <= CLIQUE_DELAY_S:
            continue
        last[user] = t
        out.append(CliqueRequest(f"r{i}", user, lat, lon, t, k, 0.0, max_area_m2, CLIQUE_DELAY_S))
    return out


def _clique(seed: int) -> Any:
    try:
        return get_cloaker("clique", seed=seed)
    except ModuleNotFoundError:
        pytest.skip("clique: module not written yet")


@pytest.mark.parametrize("k, max_area_m2", [(2, 4.0e6), (5, 4.0e6), (10, 4.0e6), (5, 2.5e8)])
def test_clique_on_the_ais_stream_passes_the_checker(fixes: Fixes, k: int, max_area_m2: float) -> None:
    requests = clique_requests(fixes, k, max_area_m2, spaced=True)
    releases, expired = _clique(3).run_stream([(r.t, r) for r in requests])
    violations = check_clique_stream(requests, releases, expired)
    assert violations == [], "\n".join(str(v) for v in violations[:20])
    assert len(requests) > 8000
    assert sum(len(r.members) for r in releases) >= 0.05 * len(requests)  # a real share is forwarded


def test_clique_on_every_ais_fix_counts_vessels(fixes: Fixes) -> None:
    """Every fix a request, so a vessel may have two pending at once: they must never make one clique."""
    requests = clique_requests(fixes, 2, 4.0e6, spaced=False)
    releases, expired = _clique(3).run_stream([(r.t, r) for r in requests])
    assert check_clique_stream(requests, releases, expired) == []
    assert all(len({m.user for m in r.members}) == len(r.members) for r in releases)

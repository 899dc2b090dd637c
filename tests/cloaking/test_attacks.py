"""Reciprocity (§1.5, §6.3) and the centre-of-region identity guess (§6.1) against nn and hilbert.

Statistical assertions use the Wilson score interval at 99.9 % two-sided confidence over
``SAMPLE`` = 400 queriers drawn without replacement from a fixed clustered population (fixed
seeds, so the outcome is reproducible; the interval says how far the sample rate may be from the
population rate). At p ≈ 0.5 its half-width is ≈ 0.08, at p ≈ 0.15 ≈ 0.06.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kcloak.cloaking.checks import candidate_sets, centre_guess, wilson_interval
from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.index import IndexView
from kcloak.core.profile import PrivacyProfile

F64 = npt.NDArray[np.float64]
K = 5
SAMPLE = 400
CONFIDENCE = 0.999
N_USERS = 1500


def clustered(n: int, seed: int) -> tuple[F64, F64]:
    """Eight Gaussian clusters (σ ≈ 330 m) over a 18 km × 17 km city box around New York."""
    rng = np.random.default_rng(seed)
    centres = np.column_stack([40.70 + rng.uniform(-0.08, 0.08, 8), -73.95 + rng.uniform(-0.1, 0.1, 8)])
    which = rng.integers(0, 8, n)
    return centres[which, 0] + rng.normal(0, 0.003, n), centres[which, 1] + rng.normal(0, 0.004, n)


def population(k: int = K, n: int = N_USERS, seed: int = 1) -> tuple[IndexView, list[PrivacyProfile]]:
    lat, lon = clustered(n, seed)
    view = IndexView.from_points([f"u{i}" for i in range(n)], lat, lon, k=[k] * n, max_area_m2=[2.5e9] * n, seed=3)
    return view, [PrivacyProfile(k=k, max_area_m2=2.5e9)] * n


def sample_rows(n: int) -> list[int]:
    rows: list[int] = np.random.default_rng(9).choice(n, SAMPLE, replace=False).tolist()
    return rows


def cloaker(name: str) -> Any:
    try:
        return get_cloaker(name)
    except ModuleNotFoundError:
        pytest.skip(f"{name}: module not written yet")


def test_wilson_interval_reference_values() -> None:
    lo, hi = wilson_interval(50, 100, 0.95)
    assert (round(lo, 4), round(hi, 4)) == (0.4038, 0.5962)
    assert wilson_interval(0, 10, 0.95)[0] == 0.0
    assert wilson_interval(10, 10, 0.95)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


# The line example of §1.5 (test recip_nn_line), 1e-3 degrees on the equator, k = 2, ties by user id.
LINE_IDS = ["u1", "u2", "u3", "u4"]
LINE_LON = [0.0, 0.001, 0.002, 0.010]


def test_recip_nn_line() -> None:
    view = IndexView.from_points(LINE_IDS, [0.0] * 4, LINE_LON, k=[2] * 4)
    nn = cloaker("nn")
    k2 = [PrivacyProfile(k=2)] * 4
    regions = [nn.cloak(view, r, k2[r]).bbox for r in range(4)]
    assert regions[0] == regions[1]  # u2's tie (u1 or u3) goes to the smaller id, u1
    assert len({regions[0], regions[2], regions[3]}) == 3
    cs = candidate_sets(nn, view, profiles=k2)
    assert cs.size.tolist() == [2, 2, 1, 1]  # [2,10] holds u3 and u4, yet only u4 produces it
    assert cs.k_violation_rate == 0.5
    assert cs.histogram() == {1: 2, 2: 2}


def test_nn_is_not_reciprocal_on_a_clustered_population() -> None:
    view, profiles = population()
    cs = candidate_sets(cloaker("nn"), view, profiles=profiles)
    assert cs.refused == 0 and cs.trials == N_USERS
    assert cs.k_violation_rate > 0
    assert cs.success_rate > cs.baseline  # the policy-aware attacker beats 1/k on average


@pytest.mark.parametrize("k", [2, 5, 10])
def test_hilbert_k_violation_rate_is_exactly_zero(k: int) -> None:
    view, profiles = population(k=k, n=800, seed=2)
    cs = candidate_sets(cloaker("hilbert"), view, profiles=profiles)
    assert cs.trials == 800
    assert cs.k_violation_rate == 0.0
    assert int(cs.size.min()) >= k


@pytest.mark.parametrize("override", [None, {"k": 7}, {"k": 12, "min_area_m2": 2.0e5}, {"max_area_m2": 1.0e6}])
def test_hilbert_stays_reciprocal_with_personalized_profiles_and_overrides(override: dict[str, Any] | None) -> None:
    """Stored k in 1…8 and min_area_m2 in {0, 1e4, 1e5}; every user sends the same override."""
    lat, lon = clustered(800, 2)
    rng = np.random.default_rng(4)
    ks = rng.integers(1, 9, 800)
    amin = rng.choice([0.0, 1.0e4, 1.0e5], 800)
    view = IndexView.from_points(
        [f"u{i}" for i in range(800)], lat, lon, k=ks, min_area_m2=amin, max_area_m2=[2.5e9] * 800, seed=3
    )
    profiles = [
        PrivacyProfile(k=int(a), min_area_m2=float(b), max_area_m2=2.5e9) for a, b in zip(ks, amin, strict=True)
    ]
    cs = candidate_sets(cloaker("hilbert"), view, profiles=profiles, override=override)
    assert cs.trials > 700
    assert cs.k_violation_rate == 0.0
    assert bool(np.all(cs.size >= cs.k))


def test_centre_guess_finds_the_nn_querier_far_more_often_than_hilbert() -> None:
    view, profiles = population()
    rows = sample_rows(len(view))
    baseline = 1 / K
    nn = centre_guess(cloaker("nn"), view, rows=rows, profiles=profiles)
    hb = centre_guess(cloaker("hilbert"), view, rows=rows, profiles=profiles)
    assert nn.trials == hb.trials == SAMPLE
    assert nn.baseline == pytest.approx(baseline) and hb.baseline == pytest.approx(baseline)
    nn_lo, _ = nn.interval(CONFIDENCE)
    hb_lo, hb_hi = hb.interval(CONFIDENCE)
    assert nn_lo > 2 * baseline  # nn: far above 1/k, with 99.9 % confidence
    assert hb_lo <= baseline  # hilbert: consistent with (at most) 1/k
    assert hb_hi < nn_lo  # and clearly separated from nn


def test_hilbert_centre_guess_over_the_whole_population_is_at_most_one_over_k() -> None:
    """Every bucket shares one region, so at most one member per bucket is the user nearest its centre."""
    view, profiles = population(n=800, seed=2)
    hb = centre_guess(cloaker("hilbert"), view, profiles=profiles)
    assert hb.trials == 800
    assert hb.success_rate <= 1 / K

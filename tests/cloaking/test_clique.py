"""CliqueCloak (CONCEPTS §4.5): the worked example, §9.4 on random streams by brute force, no holding."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.cloakers.clique import (
    CliqueCloak,
    CliqueRelease,
    CliqueRequest,
    constraint_box_udeg,
    exact_key,
)
from kcloak.core.geometry import EARTH_RADIUS_M, Aeqd, BBox, bbox_area_m2, coordinate_keys
from kcloak.core.profile import PrivacyProfile

UNIT_DEG = 1e-4
"""The planar test frame of §4.5's example: one unit is 1e-4° (≈ 11 m) on the equator."""
UNIT_M = EARTH_RADIUS_M * math.radians(UNIT_DEG)
HALF_SIDE_10 = (20 * UNIT_M) ** 2  # max_area_m2 of a constraint box of half-side 10 units


def planar(request_id: str, x: float, y: float, k: int, t: float, **kw: float) -> CliqueRequest:
    return CliqueRequest(
        request_id=request_id,
        user=f"user-{request_id}",
        lat=y * UNIT_DEG,
        lon=x * UNIT_DEG,
        t=t,
        k=k,
        min_area_m2=kw.get("min_area_m2", 0.0),
        max_area_m2=kw.get("max_area_m2", HALF_SIDE_10),
        max_delay_s=kw.get("max_delay_s", 30.0),
    )


# -- independent brute-force checks (§9.4) --------------------------------------------------------


def _inside(v: float, lo: int, hi: int) -> bool:
    """Strictly inside as a client reads it: float64 and the exact decimals of the texts."""
    return Fraction(lo, 10**6) < Fraction(repr(v)) < Fraction(hi, 10**6) and lo / 10**6 < v < hi / 10**6


def strictly_inside(bbox: BBox, req: CliqueRequest) -> bool:
    return _inside(req.lon, bbox.min_lon_udeg, bbox.max_lon_udeg) and _inside(
        req.lat, bbox.min_lat_udeg, bbox.max_lat_udeg
    )


def overshoot_m(req: CliqueRequest, lat: np.ndarray, lon: np.ndarray) -> float:
    """How far (m) the points stick out of ``req``'s metric square (≤ 0: inside)."""
    x, y = Aeqd(req.lat, req.lon).forward(lat, lon)
    return float(max(np.abs(x).max(), np.abs(y).max())) - math.sqrt(req.max_area_m2) / 2


def box_points(bbox: BBox, per_edge: int = 65) -> tuple[np.ndarray, np.ndarray]:
    lon0, lat0, lon1, lat1 = bbox.to_geojson()
    lats = np.linspace(lat0, lat1, per_edge)
    lons = np.linspace(lon0, lon1, per_edge)
    if lat0 < 0 < lat1:
        lats = np.append(lats, 0.0)
    lat = np.concatenate([lats, lats, np.full(per_edge, lat0), np.full(per_edge, lat1)])
    lon = np.concatenate([np.full(len(lats), lon0), np.full(len(lats), lon1), lons, lons])
    return lat, lon


def tight_mbr(members: tuple[CliqueRequest, ...]) -> BBox:
    """§2.2 by brute force: each edge the nearest whole micro-degree strictly outside as a client reads it."""

    def below(v: float) -> int:
        m = math.floor(Fraction(repr(v)) * 10**6)
        while not (m / 10**6 < v and Fraction(m, 10**6) < Fraction(repr(v))):
            m -= 1
        return m

    def above(v: float) -> int:
        m = math.ceil(Fraction(repr(v)) * 10**6)
        while not (m / 10**6 > v and Fraction(m, 10**6) > Fraction(repr(v))):
            m += 1
        return m

    return BBox(
        below(min(m.lon for m in members)),
        below(min(m.lat for m in members)),
        above(max(m.lon for m in members)),
        above(max(m.lat for m in members)),
    )


def check_stream(
    requests: list[CliqueRequest],
    releases: list[CliqueRelease],
    expired: list[tuple[float, CliqueRequest]],
) -> None:
    """Every §9.4 property, recomputed from the requests and the outcomes only."""
    outcomes = {r.request_id: 0 for r in requests}
    for rel in releases:
        members = rel.members
        bbox = rel.bbox
        users = {m.user for m in members}
        assert len({m.request_id for m in members}) == len(members)
        area = bbox_area_m2(*bbox.to_geojson())
        assert rel.area_m2 == area
        a_min = max(m.min_area_m2 for m in members)
        tight = tight_mbr(members)
        if tight.area_m2 >= a_min:
            assert bbox == tight  # the MBR of the members' positions (§9.4)
        else:  # grown to the largest A_min: still around the MBR
            assert bbox.min_lon_udeg <= tight.min_lon_udeg and bbox.min_lat_udeg <= tight.min_lat_udeg
            assert bbox.max_lon_udeg >= tight.max_lon_udeg and bbox.max_lat_udeg >= tight.max_lat_udeg
            assert area >= a_min
        blat, blon = box_points(bbox)
        for m in members:
            outcomes[m.request_id] += 1
            assert len(users) >= m.k  # |M| ≥ k_s, distinct senders
            assert strictly_inside(bbox, m)
            assert m.t <= rel.released_at <= m.deadline  # released before the deadline
            assert overshoot_m(m, blat, blon) <= 1e-6  # inside every member's constraint box
            assert area <= m.max_area_m2
            for o in members:  # mutual containment: the members form a clique
                assert overshoot_m(m, np.array([o.lat]), np.array([o.lon])) <= 0
    for t, req in expired:
        outcomes[req.request_id] += 1
        assert t >= req.deadline
    assert all(n == 1 for n in outcomes.values()), "every request released once or expired once"


# -- the worked example ---------------------------------------------------------------------------


@pytest.mark.parametrize("larger_cliques", [True, False])
def test_clique_3(larger_cliques: bool) -> None:
    """§4.5 worked example: ma waits, mb waits (ma has k = 3), mc completes {ma, mb, mc}."""
    cc = CliqueCloak(seed=1, larger_cliques=larger_cliques)
    ma = planar("ma", 0, 0, 3, 1.0)
    mb = planar("mb", 4, 0, 2, 2.0)
    mc = planar("mc", 2, 3, 3, 3.0)
    assert cc.submit(ma, 1.0) == [] and cc.pending == 1
    assert cc.submit(mb, 2.0) == [] and cc.pending == 2
    out = cc.submit(mc, 3.0)
    assert cc.pending == 0
    assert len(out) == 1
    rel = out[0]
    assert {m.request_id for m in rel.members} == {"ma", "mb", "mc"}
    assert rel.released_at == 3.0 and rel.k_achieved == 3
    # The box [0,4] × [0,3] (units), published strictly around the three positions.
    assert rel.bbox == BBox(-1, -1, 401, 301)
    check_stream([ma, mb, mc], out, [])


def test_clique_3_box_tolerance_excludes_far_messages() -> None:
    """Same example with mb 10.5 units away from ma: no edge, so mc finds no clique."""
    cc = CliqueCloak(seed=1)
    assert cc.submit(planar("ma", 0, 0, 3, 0.0), 0.0) == []
    assert cc.submit(planar("mb", 10.5, 0, 2, 0.0), 0.0) == []
    assert cc.submit(planar("mc", 5, 3, 3, 0.0), 0.0) == []
    assert cc.pending == 3


# -- constraint boxes ------------------------------------------------------------------------------


def test_constraint_box_is_inside_the_metric_square_and_nearly_fills_it() -> None:
    rng = np.random.default_rng(1)
    for i in range(300):
        lat = float(rng.uniform(-0.3, 0.3)) if i % 4 == 0 else float(rng.uniform(-80, 80))
        lon = float(rng.uniform(-180, 180))
        area = float(10 ** rng.uniform(2, math.log10(2.5e9)))
        lon0, lat0, lon1, lat1 = constraint_box_udeg(lat, lon, area)
        box = BBox(lon0, lat0, lon1, lat1)
        g_lat, g_lon = np.meshgrid(np.linspace(lat0, lat1, 81) / 1e6, np.linspace(lon0, lon1, 81) / 1e6)
        req = CliqueRequest("r", "u", lat, lon, 0.0, 1, 0.0, area, 0.0)
        assert overshoot_m(req, g_lat.ravel(), g_lon.ravel()) <= 0
        assert req.constraint_box() == box
        assert box.area_m2 > 0.9 * area  # never loosened, hardly tightened


def test_tiny_square_gives_an_empty_box_and_the_request_expires() -> None:
    cc = CliqueCloak(seed=1)
    req = CliqueRequest("r", "u", 10.0, 10.0, 0.0, 1, 0.0, 1e-4, 5.0)
    assert req.constraint_box() is None
    assert cc.submit(req, 0.0) == []
    assert cc.expire(5.0) == [req]


def test_exact_key_matches_coordinate_keys() -> None:
    rng = np.random.default_rng(2)
    v = np.concatenate(
        [rng.uniform(-180, 180, 5000), np.round(rng.uniform(-180, 180, 5000), 6), [0.0, -0.0, 180.0, -90.0]]
    )
    assert [exact_key(float(x)) for x in v] == coordinate_keys(v).tolist()


# -- §9.4 on random streams -------------------------------------------------------------------------


def random_stream(rng: np.random.Generator, m: int, spread_deg: float) -> list[tuple[float, CliqueRequest]]:
    lat = 39.9 + rng.normal(0, spread_deg, m)
    lon = 116.4 + rng.normal(0, spread_deg, m)
    users = rng.integers(0, max(2, m // 2), m)  # some users send several requests
    t = np.round(np.sort(rng.uniform(0, 30, m)), 1)  # equal times happen
    out: list[tuple[float, CliqueRequest]] = []
    for i in range(m):
        max_area = float(rng.choice([2e4, 2e5, 1e6, 4e6]))
        min_area = float(rng.choice([0.0, 0.0, 0.0, 0.05, 0.6])) * max_area
        req = CliqueRequest(
            request_id=f"q{i}",
            user=f"u{users[i]}",
            lat=float(lat[i]),
            lon=float(lon[i]),
            t=float(t[i]),
            k=int(rng.integers(1, 6)),
            min_area_m2=min_area,
            max_area_m2=max_area,
            max_delay_s=float(rng.choice([0.0, 1.0, 5.0, 30.0])),
        )
        out.append((float(t[i]), req))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 120),
    spread=st.sampled_from([0.0005, 0.002, 0.01]),
    larger=st.booleans(),
)
def test_stream_properties_by_brute_force(seed: int, m: int, spread: float, larger: bool) -> None:
    rng = np.random.default_rng(seed)
    stream = random_stream(rng, m, spread)
    cc = CliqueCloak(seed=seed, larger_cliques=larger)
    releases, expired = cc.run_stream(stream)
    check_stream([r for _, r in stream], releases, expired)
    assert cc.pending == 0


def test_stream_releases_most_requests_in_a_crowd() -> None:
    rng = np.random.default_rng(3)
    prof = PrivacyProfile(k=4, max_area_m2=1e6, max_delay_s=30.0)
    lat = 39.9 + rng.normal(0, 0.002, 400)
    lon = 116.4 + rng.normal(0, 0.002, 400)
    t = np.sort(rng.uniform(0, 20, 400))
    stream = [
        (float(t[i]), CliqueRequest.from_profile(f"q{i}", f"u{i}", float(lat[i]), float(lon[i]), float(t[i]), prof))
        for i in range(400)
    ]
    releases, expired = CliqueCloak(seed=3).run_stream(stream)
    check_stream([r for _, r in stream], releases, expired)
    assert sum(len(r.members) for r in releases) > 0.9 * 400


def test_run_stream_is_deterministic_for_a_seed() -> None:
    stream = random_stream(np.random.default_rng(4), 150, 0.002)

    def run(seed: int) -> list[tuple[tuple[str, ...], BBox]]:
        releases, _ = CliqueCloak(seed=seed).run_stream(stream)
        return [(tuple(m.request_id for m in r.members), r.bbox) for r in releases]

    assert run(7) == run(7)
    assert run(-1) == run(2**64 - 1)  # any integer seeds the salt (its low 64 bits)


# -- holding, expiry, no holding ------------------------------------------------------------------


def test_max_delay_zero_means_no_holding() -> None:
    """§5.2: released at once if satisfiable, else expired at once."""
    cc = CliqueCloak(seed=1)
    alone = planar("a", 0, 0, 2, 10.0, max_delay_s=0.0)
    assert cc.submit(alone, 10.0) == []
    assert cc.next_deadline() == 10.0
    assert cc.expire(10.0) == [alone] and cc.pending == 0
    # Satisfiable immediately: a waiting partner completes the pair at the arrival instant.
    waiting = planar("w", 1, 0, 2, 10.0, max_delay_s=30.0)
    now = planar("n", 0, 1, 2, 12.0, max_delay_s=0.0)
    assert cc.submit(waiting, 10.0) == []
    out = cc.submit(now, 12.0)
    assert len(out) == 1 and {m.request_id for m in out[0].members} == {"w", "n"}
    # k = 1 with no holding: released alone, immediately.
    solo = planar("s", 5, 5, 1, 13.0, max_delay_s=0.0)
    out = cc.submit(solo, 13.0)
    assert len(out) == 1 and out[0].members == (solo,) and strictly_inside(out[0].bbox, solo)


def test_run_stream_expires_zero_delay_requests_at_their_receipt_time() -> None:
    stream = [(float(i), planar(f"q{i}", 0, 0, 2, float(i), max_delay_s=0.0)) for i in range(3)]
    releases, expired = CliqueCloak(seed=1).run_stream(stream)
    assert releases == []
    assert [(t, r.request_id) for t, r in expired] == [(0.0, "q0"), (1.0, "q1"), (2.0, "q2")]


def test_expired_requests_leave_every_structure() -> None:
    cc = CliqueCloak(seed=1)
    old = planar("old", 0, 0, 2, 0.0, max_delay_s=5.0)
    cc.submit(old, 0.0)
    assert cc.expire(4.9) == []
    assert cc.expire(5.0) == [old]
    assert cc.pending == 0 and cc.next_deadline() is None
    # A later neighbour cannot pair with the expired request.
    assert cc.submit(planar("new", 1, 1, 2, 6.0), 6.0) == []
    assert cc.pending == 1
    # The same request id may be used again once the first one is gone.
    assert cc.submit(planar("old", 0, 0, 2, 7.0), 7.0) != []


def test_past_deadline_requests_are_not_released_before_expiry() -> None:
    cc = CliqueCloak(seed=1)
    late = planar("late", 0, 0, 2, 0.0, max_delay_s=1.0)
    cc.submit(late, 0.0)
    assert cc.submit(planar("x", 1, 0, 2, 2.0), 2.0) == []  # late's deadline (1.0) has passed
    assert cc.expire(2.0) == [late]


def test_duplicate_pending_request_id_is_rejected() -> None:
    cc = CliqueCloak(seed=1)
    cc.submit(planar("a", 0, 0, 3, 0.0), 0.0)
    with pytest.raises(ValueError, match="request_id"):
        cc.submit(planar("a", 1, 0, 3, 0.0), 0.0)


def test_one_user_never_counts_as_two_senders() -> None:
    cc = CliqueCloak(seed=1)
    a = CliqueRequest("a", "same", 0.0, 0.0, 0.0, 2, 0.0, HALF_SIDE_10, 30.0)
    b = CliqueRequest("b", "same", 0.0001, 0.0, 1.0, 2, 0.0, HALF_SIDE_10, 30.0)
    assert cc.submit(a, 0.0) == [] and cc.submit(b, 1.0) == []
    out = cc.submit(CliqueRequest("c", "other", 0.0, 0.0001, 2.0, 2, 0.0, HALF_SIDE_10, 30.0), 2.0)
    assert len(out) == 1 and len({m.user for m in out[0].members}) == 2


def test_larger_cliques_strand_no_request() -> None:
    """Two waiting k = 3 requests and an arrival with k = 2: a 3-clique serves all of them."""
    reqs = [planar("a", 0, 0, 3, 0.0), planar("b", 2, 0, 3, 1.0), planar("c", 1, 1, 2, 2.0)]
    paper = CliqueCloak(seed=1, larger_cliques=False)
    assert [paper.submit(r, r.t) for r in reqs] == [[], [], []]
    ours = CliqueCloak(seed=1)
    out = [rel for r in reqs for rel in ours.submit(r, r.t)]
    assert len(out) == 1 and len(out[0].members) == 3
    check_stream(reqs, out, [])


def test_min_area_growth_stays_inside_every_constraint_box() -> None:
    a_min = 0.5 * HALF_SIDE_10
    pts = [(0, 0), (4, 1), (2, 3)]
    reqs = [planar(f"m{i}", x, y, 3, float(i), min_area_m2=a_min) for i, (x, y) in enumerate(pts)]
    cc = CliqueCloak(seed=1)
    out = [rel for r in reqs for rel in cc.submit(r, r.t)]
    assert len(out) == 1
    assert out[0].area_m2 >= a_min
    check_stream(reqs, out, [])


def test_grown_box_is_translated_into_the_shared_constraint() -> None:
    """Half-sides 10 and 20 units: the 18-unit box about the MBR centre sticks out of ma's box; shifted in."""
    a_min = (18 * UNIT_M) ** 2
    ma = planar("ma", 0, 0, 2, 0.0, min_area_m2=a_min)
    mb = planar("mb", 4, 0, 2, 1.0, min_area_m2=a_min, max_area_m2=4 * HALF_SIDE_10)
    cc = CliqueCloak(seed=1)
    out = cc.submit(ma, 0.0) + cc.submit(mb, 1.0)
    assert len(out) == 1
    box = out[0].bbox
    ma_box = ma.constraint_box()
    assert ma_box is not None and box.max_lon_udeg <= ma_box.max_lon_udeg
    assert (box.min_lon_udeg + box.max_lon_udeg) / 2 < 2 * UNIT_DEG * 1e6  # left of the MBR centre
    check_stream([ma, mb], out, [])


def test_min_area_that_no_shared_box_can_reach_keeps_members_waiting() -> None:
    reqs = [planar(f"m{i}", 9 * i, 0, 2, 0.0, min_area_m2=0.95 * HALF_SIDE_10) for i in range(2)]
    cc = CliqueCloak(seed=1)
    assert [cc.submit(r, 0.0) for r in reqs] == [[], []]
    assert cc.pending == 2


def test_max_combinations_caps_the_search() -> None:
    """A crowd whose cliques all fail the area rule: the capped search gives up, nothing breaks."""
    rng = np.random.default_rng(5)
    reqs = [
        planar(f"q{i}", float(rng.uniform(-3, 3)), float(rng.uniform(-3, 3)), 6, 0.0, min_area_m2=0.8 * HALF_SIDE_10)
        for i in range(40)
    ]
    small = CliqueCloak(seed=1, max_combinations=200)
    releases, expired = small.run_stream([(0.0, r) for r in reqs])
    check_stream(reqs, releases, expired)
    assert small.gave_up > 0


def test_from_profile_and_registry() -> None:
    prof = PrivacyProfile(k=7, min_area_m2=10.0, max_area_m2=1e6, max_delay_s=12.0)
    req = CliqueRequest.from_profile("q1", "alice", 39.9, 116.4, 100.0, prof)
    assert (req.k, req.min_area_m2, req.max_area_m2, req.max_delay_s) == (7, 10.0, 1e6, 12.0)
    assert req.deadline == 112.0
    cc = get_cloaker("clique", seed=3)
    assert isinstance(cc, CliqueCloak)
    assert (cc.name, cc.reciprocal, cc.supports_l) == ("clique", True, False)
    with pytest.raises(ValueError, match="k"):
        CliqueRequest("q", "u", 0.0, 0.0, 0.0, 0, 0.0, 1.0, 1.0)

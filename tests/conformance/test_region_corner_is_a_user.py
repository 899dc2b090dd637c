"""Attack: the forwarded region's corner is a user's exact position (issue 13; contract §0).

Positions as apps send them (5 decimals, like T-Drive, plus the contract's 6-decimal example
fix) fall exactly on whole micro-degrees. A client that parses the forwarded bbox and the texts
it posted, as float64 or as exact decimals, must find the querier and at least k posted users
strictly inside, and exactly ``k_achieved`` of them: a user on an edge is not inside, and kcloak
must never count one. The old kcloak compared edges with the binary values of the floats and
forwarded, e.g., ``[116.30395, 39.92562, 116.30438, 39.92653]`` for a querier at
(39.92653, 116.30395): the corner was the querier.

Grid algorithms publish quadtree cells (CONCEPTS §2.1: root ±2^28 µdeg, public knowledge of the
algorithm), so some users are also sent exactly on cell edges of several levels, at texts whose
float lies just below the decimal: the old keys put such a user in the cell below, whose published
upper edge was then the user's coordinate.

A side of a published box may pass through the coordinate of a user it does not count (a grid
cell's upper edge, a box grown to ``min_area_m2``): the contract allows that, and it is a
coincidence of the cell or the growth, not derived from that user. A *corner* on a posted position
would need two such coincidences at once, so the test requires that no corner is any posted
position, and that no edge is a coordinate of the querier.

Black box: a real ``kcloak serve`` over HTTP (``--mqtt none``) in front of a real ``kcloak lbs``.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from tests.conformance.conftest import Served, Servers, http_json

SEED = 13
N_GRID_USERS = 120
CONTRACT_FIX = ("39.908692", "116.397477")
"""The contract's example fix (§3), as text."""


def _post_raw(url: str, text: str) -> tuple[int, str]:
    """POST a JSON text exactly as written; returns the status and the raw response text."""
    req = urllib.request.Request(url, data=text.encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode()


def _post_fixes(served: Served, positions: dict[str, tuple[str, str]]) -> None:
    """One batch (open mode: ``user`` per item) carrying each position's text verbatim."""
    t = time.time() - 0.5
    items = [f'{{"user": "{u}", "t": {t!r}, "lat": {lat}, "lon": {lon}}}' for u, (lat, lon) in positions.items()]
    status, text = _post_raw(served.url("/v1/locations"), '{"updates": [' + ", ".join(items) + "]}")
    assert status == 200, text
    body = json.loads(text)
    assert body["accepted"] == len(positions) and body["rejected"] == [], body


def _put_profile(served: Served, user: str, profile: dict[str, Any]) -> None:
    status, _, body = http_json("PUT", served.url(f"/v1/users/{user}/profile"), profile)
    assert status == 200, body


def _query(served: Served, user: str, query_id: str, override: dict[str, Any] | None = None) -> str:
    q: dict[str, Any] = {"query_id": query_id, "kind": "knn", "n": 1}
    if override:
        q["profile"] = override
    status, text = _post_raw(served.url(f"/v1/users/{user}/query"), json.dumps(q))
    assert status == 200, text
    return text


def _inside(v: Any, lo: Any, hi: Any) -> bool:
    return bool(lo < v < hi)


def _check_answer(
    text: str, querier: str, k: int, positions: dict[str, tuple[str, str]], *, may_refuse: frozenset[str] = frozenset()
) -> list[str]:
    """Every failure of one answer, read as a client reads it (float64 and Decimal of the texts).

    A refusal is a failure unless its reason is in ``may_refuse`` (refusing is never unsafe).
    """
    as_float = json.loads(text)
    as_dec = json.loads(text, parse_float=Decimal, parse_int=Decimal)
    if as_float.get("status") != "ok":
        if as_float.get("status") == "refused" and as_float.get("reason") in may_refuse:
            return []
        return [f"{querier}: expected an ok answer, got {as_float.get('reason')}"]
    fb = as_float["region"]["bbox"]
    db = as_dec["region"]["bbox"]
    out: list[str] = []
    counts = []
    for box, num in ((fb, float), (db, Decimal)):
        inside = {
            u
            for u, (lat, lon) in positions.items()
            if _inside(num(lon), box[0], box[2]) and _inside(num(lat), box[1], box[3])
        }
        counts.append(len(inside))
        if querier not in inside:
            out.append(f"{querier}: not strictly inside {box} as {num.__name__}")
    if min(counts) < k:
        out.append(f"{querier}: {counts} users strictly inside (float64, decimal) < k = {k} in {fb}")
    if not counts[0] == counts[1] == as_float["k_achieved"]:
        out.append(f"{querier}: k_achieved {as_float['k_achieved']} != strict counts {counts} in {fb}")
    corners = {(lon, lat) for lon in (db[0], db[2]) for lat in (db[1], db[3])}
    for u, (lat, lon) in positions.items():
        if (Decimal(lon), Decimal(lat)) in corners:
            out.append(f"{querier}: corner of {fb} is the position of {u}")
    q_lat, q_lon = positions[querier]
    if Decimal(q_lon) in (db[0], db[2]) or Decimal(q_lat) in (db[1], db[3]):
        out.append(f"{querier}: an edge of {fb} is the querier's coordinate")
    return out


def _cell_edge(near_udeg: int, shift: int, max_cells: int) -> int:
    """The quadtree cell edge ``c · 2^shift − 2^28`` µdeg nearest to ``near_udeg`` whose float lies
    below its decimal (the old keys put a user there in the cell below, on its upper edge)."""
    c = (near_udeg + (1 << 28) + (1 << (shift - 1))) >> shift
    for step in range(max_cells + 1):
        for cell in (c + step, c - step):
            udeg = (cell << shift) - (1 << 28)
            if Fraction(udeg / 1e6) < Fraction(udeg, 10**6):
                return udeg
    raise AssertionError("no cell edge whose float lies below its decimal")


def _udeg_text(udeg: int) -> str:
    return f"{udeg / 1e6:.6f}"


def _population() -> dict[str, tuple[str, str]]:
    """131 users near Beijing's centre: 120 on a 5-decimal grid with few lines (many users share
    each), a co-located pair, the issue's querier position, the contract's example fix, and users
    on quadtree cell edges (2^14 µdeg edges are edges of every finer level too)."""
    rng = np.random.default_rng(SEED)
    lat_e = _cell_edge(39_908_692, 14, 8)  # 39.911424
    lon_e = _cell_edge(116_397_477, 14, 8)  # 116.375552, 2 km west of the contract's fix
    lat_lines = (lat_e - 2_000) // 10 + np.sort(rng.choice(np.arange(-600, 600), 9, replace=False))
    lon_lines = (lon_e + 11_000) // 10 + np.sort(rng.choice(np.arange(-1_300, 1_300), 11, replace=False))
    out: dict[str, tuple[str, str]] = {}
    for i in range(N_GRID_USERS):
        lat = int(rng.choice(lat_lines))
        lon = int(rng.choice(lon_lines))
        out[f"u{i:03d}"] = (f"{lat / 1e5:.5f}", f"{lon / 1e5:.5f}")
    out["pair-a"] = out["pair-b"] = (f"{lat_lines[3] / 1e5:.5f}", f"{lon_lines[2] / 1e5:.5f}")
    out["fix"] = CONTRACT_FIX
    out["tdrive"] = ("39.90653", "116.39395")  # the position
    out["edge-a"] = (_udeg_text(lat_e), _udeg_text(lon_e))
    out["edge-b"] = (_udeg_text(lat_e), f"{lon_lines[4] / 1e5:.5f}")
    out["edge-c"] = (f"{lat_lines[1] / 1e5:.5f}", _udeg_text(lon_e))
    for shift in (11, 12, 13):  # edges of these levels only, inside the population's box
        lat = _cell_edge(lat_e - (1 << shift), shift, 2)
        lon = _cell_edge(lon_e + (1 << shift), shift, 2)
        out[f"edge{shift}"] = (_udeg_text(lat), _udeg_text(lon))
    return out


def _contract_examples(served: Served) -> list[str]:
    """The contract's example fix alone at k = 1, then with a second user at k = 2: the old regions
    had the fix on a corner (to every digit sent). Run on a server that has no other user yet."""
    alone = {"alice": CONTRACT_FIX}
    _put_profile(served, "alice", {"k": 1, "min_area_m2": 0})
    _post_fixes(served, alone)
    failures = _check_answer(_query(served, "alice", "q1"), "alice", 1, alone)
    both = {"alice": CONTRACT_FIX, "bob": ("39.90912", "116.39803")}
    _put_profile(served, "bob", {"k": 2, "min_area_m2": 0})
    _put_profile(served, "alice", {"k": 2, "min_area_m2": 0})
    time.sleep(0.6)  # fixes must carry strictly increasing t
    _post_fixes(served, both)
    for u in both:
        text = _query(served, u, f"q2-{u}")
        failures += _check_answer(text, u, 2, both)
        fb = json.loads(text)["region"]["bbox"] if '"ok"' in text else None
        for lat, lon in both.values():  # both users are counted: no edge is either one's coordinate
            if fb is not None and (float(lon) in (fb[0], fb[2]) or float(lat) in (fb[1], fb[3])):
                failures.append(f"{u}: an edge of {fb} is a coordinate of a counted user")
    return failures


@pytest.mark.parametrize("algorithm", ["hilbert", "casper", "interval", "nn", "privacygrid", "temporal"])
def test_region_corner_is_never_a_counted_user(servers: Servers, algorithm: str) -> None:
    served = servers.serve("--algorithm", algorithm, upstream=servers.lbs(), mqtt=False)
    # First the contract's own examples, alone on the server (temporal holds a query until k users
    # visited its cell, which the population below exercises instead).
    failures = _contract_examples(served) if algorithm != "temporal" else []
    positions = _population()
    users = sorted(positions)
    if algorithm != "temporal":  # alice and bob stay present: they count like everyone else
        positions |= {"alice": CONTRACT_FIX, "bob": ("39.90912", "116.39803")}
    # Half the users store k = 3 with no area floor (regions then hug the users' positions, where
    # the old corners fell on them); the others keep the server default.
    for u in users[::2]:
        _put_profile(served, u, {"k": 3, "min_area_m2": 0})
    _post_fixes(served, positions)
    answered = 0
    queriers = [*users[::6], "fix", "pair-a", "pair-b", "tdrive", *(u for u in users if u.startswith("edge"))]
    for i, u in enumerate(queriers):
        stored_k = 3 if u in users[::2] else 5
        k = stored_k + (i % 3)
        text = _query(served, u, f"q{i}", {"k": k, "max_delay_s": 2})  # temporal: held 2 s at most
        # A bucket or cell too large for max_area_m2 is refused, which is safe; most are answered.
        failures += _check_answer(text, u, k, positions, may_refuse=frozenset({"area_exceeded", "expired"}))
        answered += json.loads(text).get("status") == "ok"
    assert failures == [], "\n".join(failures)
    assert answered >= 0.8 * len(queriers), f"only {answered} of {len(queriers)} queries answered"


def test_clique_regions_strictly_hold_their_members(servers: Servers) -> None:
    """CliqueCloak releases one box per group of pending queries: members sent on 5-decimal grid
    lines (and the contract's fix) are strictly inside it, as every client reads it."""
    served = servers.serve("--algorithm", "clique", upstream=servers.lbs(), mqtt=False)
    group = {"c1": CONTRACT_FIX, "c2": ("39.90912", "116.39803"), "c3": ("39.90912", "116.39748")}
    for u in group:
        _put_profile(served, u, {"k": 3, "min_area_m2": 0, "max_delay_s": 10})
    _post_fixes(served, group)
    answers: dict[str, str] = {}

    def ask(u: str) -> None:
        answers[u] = _query(served, u, f"q-{u}")

    threads = [threading.Thread(target=ask, args=(u,)) for u in group]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    failures: list[str] = []
    for u in group:
        failures += _check_answer(answers[u], u, 3, group)
    assert failures == [], "\n".join(failures)


def _area_m2(b: list[float]) -> float:
    """Contract §0 bbox area on the sphere R = 6,371,008.8 m."""
    r = 6_371_008.8
    return r * r * math.radians(b[2] - b[0]) * abs(math.sin(math.radians(b[3])) - math.sin(math.radians(b[1])))


def test_co_located_users_are_not_pinpointed_by_default(servers: Servers) -> None:
    """Five users at one point under the server's default profile: the region used to be a box a
    few micro-degrees wide (0.0095 m²) around them. The shipped default floor is 10,000 m², and a
    query cannot lower it."""
    served = servers.serve("--algorithm", "hilbert", upstream=servers.lbs(), mqtt=False)
    status, _, info = http_json("GET", served.url("/v1/info"))
    assert status == 200 and info["profile_defaults"]["min_area_m2"] == 10_000
    crowd = {f"bus{i}": CONTRACT_FIX for i in range(5)}
    _post_fixes(served, crowd)
    text = _query(served, "bus0", "q1")
    assert _check_answer(text, "bus0", 5, crowd) == []
    answer = json.loads(text)
    assert answer["k_achieved"] == 5
    assert answer["area_m2"] >= 10_000 and _area_m2(answer["region"]["bbox"]) >= 10_000 * (1 - 1e-9)
    looser = json.loads(_query(served, "bus1", "q2", {"min_area_m2": 100}))
    assert (looser["status"], looser["reason"]) == ("refused", "looser_than_profile")

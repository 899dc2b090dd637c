"""k^m-anonymity: S002's worked example and an independent brute-force checker (CONCEPTS §8.15, §9.8)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloaking.tabular.km import (
    IntervalHierarchy,
    KmError,
    KmRelease,
    KmUnsatisfiable,
    anonymize_km,
    release_places,
)

# -- the independent checker: written forms and bags only, nothing from the algorithm ----------
_B32 = "0123456789bcdefghjkmnpqrstuvwxyz"


def _gh_int(cell: str) -> int:
    v = 0
    for ch in cell:
        v = v * 32 + _B32.index(ch)
    return v


def covers(item: str, value: str) -> bool:
    """Whether a released item (any written form of contract §8) holds the original ``value``."""
    numeric = value.lstrip("-").isdigit()
    key = int(value) if numeric else _gh_int(value)

    def conv(x: str) -> int:
        return int(x) if numeric else _gh_int(x)

    if item == "*":
        return True
    if item.endswith("*"):
        return value.startswith(item[:-1])
    if item.startswith("("):  # S002's (a-b] seed notation
        a, b = item[1:-1].split("-")
        return int(a) < key <= int(b)
    if item.startswith("["):
        a, b = item[1:-1].split(",")
        return conv(a) <= key < conv(b) if item.endswith(")") else conv(a) <= key <= conv(b)
    return item == value


def subbags(bag: Sequence[str], m: int) -> set[tuple[str, ...]]:
    items = sorted(bag)
    return {c for i in range(1, m + 1) for c in itertools.combinations(items, i)}


def km_violations(published: Sequence[Sequence[str]], k: int, m: int) -> list[tuple[tuple[str, ...], int]]:
    """Every sub-bag (size ≤ m) of a published record with support < k; support counts multiplicities."""
    counters = [Counter(r) for r in published]
    support: dict[tuple[str, ...], int] = {}
    bad = []
    for rec in published:
        for sb in subbags(rec, m):
            if sb not in support:
                need = Counter(sb)
                support[sb] = sum(1 for c in counters if all(c[x] >= n for x, n in need.items()))
            if support[sb] < k:
                bad.append((sb, support[sb]))
    return bad


def consistent(known: Sequence[str], record: Sequence[str]) -> bool:
    """An attacker knowing the values ``known`` can match them to distinct items of ``record``."""
    return any(
        all(covers(record[j], v) for v, j in zip(known, perm, strict=True))
        for perm in itertools.permutations(range(len(record)), len(known))
    )


def check_release(originals: Sequence[Sequence[str]], rel: KmRelease, k: int, m: int, max_sup: float) -> None:
    """k^m on the written forms, the attacker's view, truthful global recoding, the suppression budget."""
    assert len(rel.records) == len(originals)
    kept = [(o, r) for o, r in zip(originals, rel.records, strict=True) if r is not None]
    published = [r for _, r in kept]
    assert not km_violations(published, k, m)
    # global recoding: the distinct released items are disjoint and each original value has one image
    tokens = {x for r in published for x in r}
    for orig, rec in kept:
        images = []
        for v in orig:
            holders = [t for t in tokens if covers(t, v)]
            assert len(holders) == 1, (v, holders)
            images.append(holders[0])
        assert sorted(images) == sorted(rec)
    # attacker with ≤ m known values of a released record finds ≥ k candidates
    for orig, _ in kept[:8]:
        for sb in subbags(orig, m):
            assert sum(1 for r in published if consistent(sb, r)) >= k
    suppressed = sum(1 for r in rel.records if r is None)
    assert suppressed == rel.suppressed_rows <= math.floor(max_sup * len(originals) + 1e-9)
    if published:
        assert rel.k_achieved is not None and rel.k_achieved >= k


def test_checker_rejects_table1() -> None:
    """The checker itself: S002 Table 1 is not 2²-anonymous, with exactly the listed violations."""
    table1 = [["11000", "11000", "20000", "40000", "40000"], ["11000", "30500", "40000"],
              ["11000", "11000", "40000", "40000"], ["11000"], ["20000"]]  # fmt: skip
    bad = {sb for sb, _ in km_violations(table1, 2, 2)}
    assert {sb for sb in bad if len(sb) == 1} == {("30500",)}
    assert {sb for sb in bad if len(sb) == 2} == {
        ("11000", "20000"),
        ("20000", "40000"),
        ("11000", "30500"),
        ("30500", "40000"),
    }


# -- S002 Example 1 (test km_acd_example) ---------------------------------------------------
TABLE1 = [[11000, 11000, 20000, 40000, 40000], [11000, 30500, 40000], [11000, 11000, 40000, 40000], [11000], [20000]]


def test_km_acd_example() -> None:
    rel = anonymize_km(TABLE1, k=2, m=2, algorithm="acd")
    g = "[20000,30500]"
    assert rel.records == (
        tuple(sorted(["11000", "11000", g, "40000", "40000"])),
        tuple(sorted(["11000", g, "40000"])),
        tuple(sorted(["11000", "11000", "40000", "40000"])),
        ("11000",),
        (g,),
    )  # S002 Table 3
    assert rel.ncp == pytest.approx(3 * 10500 / 29000 / 14, abs=1e-12)  # 0.0776
    assert rel.ncp == pytest.approx(0.0776, abs=1e-4)
    assert rel.suppressed_rows == 0 and rel.k_achieved == 2
    check_release([[str(v) for v in r] for r in TABLE1], rel, 2, 2, 0.0)


def test_km_acd_example_count_tree_and_candidates() -> None:
    """S002 Fig. 2(a) supports and the three candidate rules for 30500 with their dataset NCP."""
    from cloaking.tabular import km

    data = km._Data(TABLE1)
    vals = data.vals.tolist()
    t1 = data.count_subbags(1)
    assert {vals[f[0]]: c for f, c in t1.items()} == {11000: 4, 40000: 3, 20000: 2, 30500: 1}
    rare = vals.index(30500)
    by_prefix: dict[tuple[int, ...], list[tuple[int, ...]]] = {(): list(t1)}
    cut = km._Cut(data, km._acd_ncp(data))
    cands = list(km._acd_candidates(data, (rare,), (rare,), by_prefix, 1, cut, data.extent, {}))
    got = [(vals[spans[0][0]], vals[spans[0][1]], round(ncp, 4)) for ncp, spans in cands]
    assert got == [(20000, 30500, 0.0776), (30500, 40000, 0.1404), (11000, 30500, 0.4323)]
    t2 = {tuple(vals[b] for b in f): c for f, c in km._Data(TABLE1).count_subbags(2).items()}
    rare2 = {tuple(sorted(f)) for f, c in t2.items() if c < 2}
    assert rare2 == {(11000, 20000), (20000, 40000), (11000, 30500), (30500, 40000)}


def test_km_acd_threshold_blocks_cheap_rule() -> None:
    """The cheapest rule's NCP is 0.0776: with d below it ACD climbs and still ends 2²-anonymous."""
    rel = anonymize_km(TABLE1, k=2, m=2, algorithm="acd", ncp_threshold=0.05)
    check_release([[str(v) for v in r] for r in TABLE1], rel, 2, 2, 0.0)


def test_km_aa_example() -> None:
    """AA with S002's 10000-wide hierarchy generalizes all 14 values: NCP 10000/29000 (Table 2).

    S002 prints John's row as 2 × (10000-20000] and 3 × (30000-40000], but John's values
    11000, 11000, 20000 all lie in (10000-20000] (Mary's row agrees); the test follows Table 1.
    """
    h = IntervalHierarchy(origin=0, leaf_width=10000, fanout=2, levels=3)
    rel = anonymize_km(TABLE1, k=2, m=2, algorithm="aa", hierarchy=h)
    lo, hi = "(10000-20000]", "(30000-40000]"
    assert rel.records == (
        (lo, lo, lo, hi, hi),
        (lo, hi, hi),
        (lo, lo, hi, hi),
        (lo,),
        (lo,),
    )
    assert rel.ncp == pytest.approx(10000 / 29000)
    assert rel.generalized_items == 14
    check_release([[str(v) for v in r] for r in TABLE1], rel, 2, 2, 0.0)


def test_acd_beats_aa_on_the_example() -> None:
    h = IntervalHierarchy(origin=0, leaf_width=10000, fanout=2, levels=3)
    acd = anonymize_km(TABLE1, k=2, m=2, algorithm="acd")
    aa = anonymize_km(TABLE1, k=2, m=2, algorithm="aa", hierarchy=h)
    assert acd.ncp < aa.ncp / 3


# -- geohash places ---------------------------------------------------------------------------
BASE = _gh_int("wx4g000")


def _cell(x: int) -> str:
    v, out = BASE + x, []
    for _ in range(7):
        out.append(_B32[v % 32])
        v //= 32
    return "".join(reversed(out))


def test_places_written_forms() -> None:
    bags = [[_cell(0)], [_cell(1)], [_cell(2)], [_cell(40)], [_cell(41)], [_cell(42)]]
    acd = release_places(bags, k=3, m=1, algorithm="acd", max_suppression=0.0)
    assert (
        sorted(r[0] for r in acd.records if r) == [f"[{_cell(0)},{_cell(3)})"] * 3 + [f"[{_cell(40)},{_cell(43)})"] * 3
    )
    aa = release_places(bags, k=3, m=1, algorithm="aa", max_suppression=0.0)
    assert sorted(r[0] for r in aa.records if r) == ["wx4g00*"] * 3 + ["wx4g01*"] * 3  # 32 cells per prefix
    for rel in (acd, aa):
        check_release(bags, rel, 3, 1, 0.0)


def test_outlier_is_suppressed_within_budget() -> None:
    bags = [[_cell(i)] for i in range(20)] + [["ww0000b"]]  # one far-away cell
    rel = release_places(bags, k=5, m=1, algorithm="acd", max_suppression=0.05)
    assert rel.records[-1] is None and rel.suppressed_rows == 1
    check_release(bags, rel, 5, 1, 0.05)
    aa = release_places(bags, k=5, m=1, algorithm="aa", max_suppression=0.05)
    assert aa.records[-1] is None
    check_release(bags, aa, 5, 1, 0.05)


def test_unsatisfiable_beyond_budget() -> None:
    bags = [[_cell(i), _cell(i + 1)] for i in range(3)] + [[_cell(9)]] * 5
    with pytest.raises(KmUnsatisfiable):  # {x, y} pairs exist in only 3 records, k = 4
        release_places(bags, k=4, m=2, algorithm="acd", max_suppression=0.0)
    rel = release_places(bags, k=4, m=2, algorithm="acd", max_suppression=0.5)
    assert rel.suppressed_rows == 3
    check_release(bags, rel, 4, 2, 0.5)


def test_bad_parameters() -> None:
    with pytest.raises(KmError):
        anonymize_km(TABLE1, k=2, m=2, algorithm="aa")  # no hierarchy
    with pytest.raises(KmError):
        release_places([["wx4g0b7", "wx4g0b"]], k=1)
    with pytest.raises(ValueError):
        anonymize_km(TABLE1, k=2, algorithm="nope")


_bags = st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=4), min_size=1, max_size=18)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=_bags,
    k=st.integers(1, 4),
    m=st.integers(1, 3),
    algorithm=st.sampled_from(["acd", "aa"]),
    max_sup=st.sampled_from([0.0, 0.2, 1.0]),
)
def test_km_property(raw: list[list[int]], k: int, m: int, algorithm: str, max_sup: float) -> None:
    """Whatever the input, a release is k^m-anonymous, truthful and within budget, or honestly refused."""
    bags = [[_cell(x * x % 97) for x in r] for r in raw]
    try:
        rel = release_places(bags, k=k, m=m, algorithm=algorithm, max_suppression=max_sup)
    except KmUnsatisfiable:
        assert max_sup < 1.0  # suppressing everything always works
        return
    check_release(bags, rel, k, m, max_sup)
    assert 0.0 <= rel.ncp <= 1.0


@settings(max_examples=30, deadline=None)
@given(
    raw=st.lists(st.lists(st.integers(0, 200), min_size=1, max_size=3), min_size=4, max_size=24),
    k=st.integers(2, 3),
    m=st.integers(1, 2),
)
def test_acd_numeric_property(raw: list[list[int]], k: int, m: int) -> None:
    """Numbers with closed ranges ``[a,b]`` (S002's continuous data): the same guarantees."""
    try:
        rel = anonymize_km(raw, k=k, m=m, algorithm="acd", max_suppression=0.25)
    except KmUnsatisfiable:
        return
    check_release([[str(v) for v in r] for r in raw], rel, k, m, 0.25)
    assert 0.0 <= rel.ncp <= 1.0

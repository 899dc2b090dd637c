"""The user ↔ row map of the position index (kcloak.cloaking.userrows) against a plain dict model."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.index import PositionIndex
from kcloak.cloaking.userrows import UserRows

CONTRACT_IDS = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
ANY_IDS = st.text(min_size=0, max_size=70)  # the index itself takes any str (surrogates too)
SHORT_IDS = st.text(alphabet=string.ascii_letters[:3] + "._-", min_size=1, max_size=3)  # many repeats


class SameHash(str):
    """An id whose hash is the same for every id: every lookup must tell ids apart by their bytes."""

    def __hash__(self) -> int:
        return 12345


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "get", "freeze"]), st.one_of(CONTRACT_IDS, ANY_IDS, SHORT_IDS)),
    max_size=120,
)


def _run(ops: list[tuple[str, str]], hot_max: int, wrap: type[str] = str) -> None:
    rows = UserRows(hot_max=hot_max, compact_above=0)  # compacts whenever half the id bytes are removed ones
    model: dict[str, int] = {}
    free: list[int] = []
    next_row = 0
    frozen: list[tuple[object, dict[int, str]]] = []
    for op, raw in ops:
        user = wrap(raw)
        if op == "add" and raw not in model:
            if free:
                row = free.pop()
            else:
                row, next_row = next_row, next_row + 1
            rows.add(user, row)
            model[raw] = row
        elif op == "remove":
            got = rows.remove(user)
            expected = model.pop(raw, None)
            assert got == expected
            if expected is not None:
                free.append(expected)
        elif op == "freeze":
            frozen.append((rows.frozen(), {r: u for u, r in model.items()}))
        assert rows.get(wrap(raw)) == model.get(raw)
        assert len(rows) == len(model)
    for user, row in model.items():
        assert rows.get(wrap(user)) == row
        assert rows.find(wrap(user)) == row
        assert rows.user(row) == user
        assert type(rows.user(row)) is str
    assert sorted(rows.users()) == sorted(model)
    for ids, then in frozen:  # a frozen copy still reads the ids as they were
        for row, user in then.items():
            assert ids[row] == user  # type: ignore[index]
            assert ids.is_user(row, user)  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([1, 2, 1000]))
def test_map_equals_a_dict(ops: list[tuple[str, str]], hot_max: int) -> None:
    _run(ops, hot_max)


@settings(max_examples=100, deadline=None)
@given(OPS)
def test_ids_sharing_one_hash_are_told_apart_by_their_bytes(ops: list[tuple[str, str]]) -> None:
    _run(ops, hot_max=1, wrap=SameHash)


def test_growth_removal_and_re_add_at_scale() -> None:
    rows = UserRows(hot_max=8, compact_above=50_000)
    n = 20_000
    for i in range(n):
        rows.add(f"u{i:07d}", i)
    before_bytes = rows.nbytes
    before = rows.frozen()
    for i in range(0, n, 2):  # half the users leave: the id bytes are compacted
        assert rows.remove(f"u{i:07d}") == i
    assert rows.nbytes < before_bytes
    assert rows.remove("u0000000") is None
    for i in range(0, n, 2):  # others take their rows
        rows.add(f"x{i}", i)
    for i in range(n):
        user = f"x{i}" if i % 2 == 0 else f"u{i:07d}"
        assert rows.get(user) == i
        assert rows.user(i) == user
    assert rows.get("u0000002") is None
    assert len(rows) == n
    assert all(before[i] == f"u{i:07d}" for i in range(n))  # a copy taken before still reads the old ids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(CONTRACT_IDS, ANY_IDS), min_size=1, max_size=40, unique=True), st.data())
def test_a_views_ids_round_trip_exactly_and_stay_as_at_the_snapshot(ids: list[str], data: st.DataObject) -> None:
    index = PositionIndex(hot_users=2)
    for i, user in enumerate(ids):
        index.update(user, 39.9 + i * 1e-4, 116.4, 100.0)
    view = index.snapshot(100.0)
    by_row = sorted(ids, key=lambda u: view.row(u))  # type: ignore[arg-type,return-value]
    assert list(view.user_ids) == by_row
    assert [view.user_ids[i] for i in range(len(view))] == by_row
    assert view.user_ids[1:3] == by_row[1:3]
    assert len(view.user_ids) == len(ids)
    gone = data.draw(st.lists(st.sampled_from(ids), unique=True))
    for user in gone:  # rows handed back and taken by new users
        index.remove(user)
    arrivals = []
    for j in range(len(gone)):
        name = f"new{j}"
        while name in ids:
            name += "_"
        arrivals.append(name)
        index.update(name, 39.9, 116.4, 101.0)
    assert list(view.user_ids) == by_row
    assert all(view.row(u) == r for r, u in enumerate(by_row))
    later = index.snapshot(101.0)
    expected = sorted([u for u in ids if u not in gone] + arrivals)
    assert sorted(later.user_ids) == expected

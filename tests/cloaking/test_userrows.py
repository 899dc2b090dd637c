"""The user ↔ row map of the position index (kcloak.cloaking.userrows) against a plain dict model."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

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

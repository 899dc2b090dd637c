"""Tokens file parsing and token checks (contract §9)."""

from __future__ import annotations

import hashlib

import pytest

from kcloak.broker.auth import TokenStore
from kcloak.wire.tokens import TokenLine, TokensFileError, parse_tokens, token_digest


def test_plain_hashed_rotation_and_comments() -> None:
    hashed = hashlib.sha256(b"s3cret-B").hexdigest()
    lines = parse_tokens(f"# comment\n\nalice:tokA1\nalice:tokA2\nbob:sha256:{hashed}\n")
    store = TokenStore.from_lines(lines)
    assert sorted(store.users) == ["alice", "bob"]
    assert store.user_of("tokA1") == "alice" and store.user_of("tokA2") == "alice"
    assert store.user_of("s3cret-B") == "bob"
    assert store.user_of("nope") is None and store.user_of("bad token!") is None
    assert store.check("alice", "tokA2") and not store.check("alice", "s3cret-B") and not store.check("carol", "x")
    assert [ln.plaintext for ln in lines] == ["tokA1", "tokA2", None]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("alice:ok\nnocolon\n", 2),
        ("_svc:tok\n", 1),
        ("alice:sha256:ABC\n", 1),
        ("\n\nalice:has space\n", 3),
    ],
)
def test_malformed_line_names_its_number_not_its_content(text: str, line: int) -> None:
    with pytest.raises(TokensFileError) as err:
        parse_tokens(text)
    msg = str(err.value)
    assert f"line {line}" in msg
    assert "has space" not in msg and "nocolon" not in msg


@pytest.mark.parametrize(
    ("text", "lines"),
    [
        ("alice:tokX\nbob:tokX\n", (1, 2)),
        (f"alice:tokX\n# c\n\nbob:sha256:{hashlib.sha256(b'tokX').hexdigest()}\n", (1, 4)),
        (f"alice:sha256:{'a' * 64}\ncarol:other\nbob:sha256:{'a' * 64}\n", (1, 3)),
    ],
    ids=["plain", "plain-and-hash", "two-hashes"],
)
def test_token_listed_for_two_users_names_both_lines_not_the_token(text: str, lines: tuple[int, int]) -> None:
    with pytest.raises(TokensFileError) as err:
        parse_tokens(text)
    msg = str(err.value)
    assert f"lines {lines[0]} and {lines[1]}" in msg
    assert "tokX" not in msg and "a" * 64 not in msg and "alice" not in msg and "bob" not in msg


def test_one_user_may_list_a_token_twice_and_rotate() -> None:
    digest = hashlib.sha256(b"tokA").hexdigest()
    store = TokenStore.from_lines(parse_tokens(f"alice:tokA\nalice:sha256:{digest}\nalice:tokB\nbob:tokC\n"))
    assert store.user_of("tokA") == "alice" and store.user_of("tokB") == "alice" and store.user_of("tokC") == "bob"


def test_token_store_refuses_shared_digests_from_any_source() -> None:
    lines = [TokenLine("alice", token_digest("t"), "t"), TokenLine("bob", token_digest("t"), "t")]
    with pytest.raises(TokensFileError):
        TokenStore.from_lines(lines)


def test_token_with_a_trailing_newline_is_no_token() -> None:
    store = TokenStore.from_lines(parse_tokens("alice:tokA\n"))
    assert store.user_of("tokA\n") is None and not store.check("alice", "tokA\n")
    assert store.user_of("tokA") == "alice"

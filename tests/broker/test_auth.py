"""Tokens file parsing and token checks (contract §9)."""

from __future__ import annotations

import hashlib

import pytest

from broker.auth import TokensFileError, TokenStore, parse_tokens


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

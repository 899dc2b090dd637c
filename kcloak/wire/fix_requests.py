"""The request head of a single fix, read from the bytes a connection received, for the HTTP
door's fast path (:mod:`kcloak.broker.http_fast`).

:func:`read_fix_head` accepts a narrow, unambiguous subset of HTTP/1.1: the request line
``POST /v1/users/{user}/location HTTP/1.1`` with a user id as the contract writes it, then header
lines of a token name, a colon and a value of visible ASCII (spaces and tabs within), each ended
by CRLF, with exactly one ``Content-Length`` (digits, no sign, no leading zero), exactly one
``Content-Type`` of ``application/json`` (any case, at most a ``charset=utf-8`` parameter, as
phone apps' HTTP libraries send it), at most one ``Authorization``, ``Host`` and ``Connection``
(``keep-alive`` or ``close``), and none of ``Transfer-Encoding``, ``Expect``, ``Upgrade`` or
``Content-Encoding``. For every head it accepts, the user, the body's length, the token and
whether the connection stays open are what a full HTTP/1.1 parser reads from the same bytes
(``tests/wire/test_fix_requests.py`` holds it to aiohttp's parser). Everything else, valid or
not, is :data:`DECLINE`: the caller hands those bytes to a full HTTP server, which answers them
with its own rules; so the subset needs no error handling of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

MAX_HEAD_BYTES: Final = 8190
"""The longest head read here (a full server takes the longer ones: aiohttp's line limit)."""
MAX_HEADERS: Final = 64
"""The most header lines read here."""

INCOMPLETE: Final = "incomplete"
"""The bytes so far may begin an accepted head: wait for more."""
DECLINE: Final = "decline"
"""Not a head read here: hand the bytes, from the first, to a full HTTP server."""

_PREFIX = b"POST /v1/users/"
_LINE = re.compile(rb"POST /v1/users/([A-Za-z0-9][A-Za-z0-9._-]{0,63})/location HTTP/1\.1")
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*((?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?)[ \t]*")
_JSON = re.compile(rb'application/json(?:[ \t]*;[ \t]*charset=(?:utf-8|"utf-8"))?', re.IGNORECASE)
_LENGTH = re.compile(rb"0|[1-9][0-9]{0,8}")
_OUTSIDE_A_LINE = re.compile(rb"[^\x20-\x7e\t]")
_REFUSED = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"content-encoding"})
_ONCE = frozenset({b"content-length", b"content-type", b"authorization", b"host", b"connection"})


@dataclass(frozen=True, slots=True)
class FixHead:
    """An accepted head: ``end`` is the offset of the body's first byte in the bytes read."""

    user: str
    length: int
    authorization: str | None
    close: bool
    end: int


def read_fix_head(buf: bytes | bytearray, limit: int) -> FixHead | str:
    """The single-fix head at the start of ``buf``, or :data:`INCOMPLETE` or :data:`DECLINE`.
    ``limit``: the largest body taken here (a longer one is a full server's 413)."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
    if end < 0:
        return _incomplete_or_decline(buf)
    lines = bytes(buf[:end]).split(b"\r\n")
    found = _LINE.fullmatch(lines[0])
    if found is None or len(lines) > MAX_HEADERS + 1:
        return DECLINE
    seen: dict[bytes, bytes] = {}
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None:
            return DECLINE
        name = field.group(1).lower()
        if name in _REFUSED or (name in seen and name in _ONCE):
            return DECLINE
        seen[name] = field.group(2)
    length = seen.get(b"content-length")
    if length is None or _LENGTH.fullmatch(length) is None or int(length) > limit:
        return DECLINE
    content_type = seen.get(b"content-type")
    if content_type is None or _JSON.fullmatch(content_type) is None:
        return DECLINE
    connection = seen.get(b"connection", b"keep-alive").lower()
    if connection not in (b"keep-alive", b"close"):
        return DECLINE
    auth = seen.get(b"authorization")
    return FixHead(
        user=found.group(1).decode("ascii"),
        length=int(length),
        authorization=auth.decode("ascii") if auth is not None else None,
        close=connection == b"close",
        end=end + 4,
    )


def _incomplete_or_decline(buf: bytes | bytearray) -> str:
    """:data:`INCOMPLETE` while the bytes so far can still begin a head read here: every line
    ended so far is well formed, and the line being received holds only bytes such a line holds."""
    if len(buf) > MAX_HEAD_BYTES:
        return DECLINE
    lines = bytes(buf).split(b"\r\n")
    last = lines.pop()
    if last.endswith(b"\r"):  # a CRLF cut between two reads
        last = last[:-1]
    if _OUTSIDE_A_LINE.search(last) is not None:
        return DECLINE
    if not lines:
        return INCOMPLETE if last.startswith(_PREFIX) or _PREFIX.startswith(last) else DECLINE
    if _LINE.fullmatch(lines[0]) is None or len(lines) > MAX_HEADERS + 1:
        return DECLINE
    if any(_FIELD.fullmatch(line) is None for line in lines[1:]):
        return DECLINE
    return INCOMPLETE


__all__ = ["DECLINE", "INCOMPLETE", "MAX_HEADERS", "MAX_HEAD_BYTES", "FixHead", "read_fix_head"]

"""The tokens file (contract §9 "Tokens file"): its format, parsed for the broker and its clients.

Lines: ``user_id:token`` or ``user_id:sha256:<64 lowercase hex>``; blank lines and ``#`` comments
are ignored; a user may have several lines (rotation). A token listed for two users (in either
form) is refused. Parsing keeps SHA-256 digests (and the plain token only while converting to
mosquitto's password file); the server side, :class:`kcloak.broker.auth.TokenStore`, builds on it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from kcloak.core.errors import InputError
from kcloak.wire.errors import WireError
from kcloak.wire.payloads import valid_user_id

TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]{1,256}\Z")  # \Z: "$" would let a final newline in
HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")


class TokensFileError(WireError, InputError, ValueError):
    """A tokens file that cannot be used; names the line number, never its content."""


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class TokenLine:
    user: str
    digest: bytes
    plaintext: str | None  # kept only while converting to mosquitto's password file


def parse_tokens(text: str) -> list[TokenLine]:
    """Parse tokens-file text; raises :class:`TokensFileError` naming the first bad line, or the
    two lines that give one token (plain or ``sha256:``) to different users."""
    out: list[TokenLine] = []
    owners: dict[bytes, tuple[str, int]] = {}

    def add(line: TokenLine, number: int) -> None:
        user, first = owners.setdefault(line.digest, (line.user, number))
        if user != line.user:
            raise TokensFileError(f"tokens file: lines {first} and {number}: the same token is listed for two users")
        out.append(line)

    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, rest = line.partition(":")
        if not sep or not valid_user_id(user):
            raise TokensFileError(f"tokens file: line {number}: expected user_id:token with a valid user id")
        if rest.startswith("sha256:"):
            hexpart = rest[len("sha256:") :]
            if not HEX64_RE.match(hexpart):
                raise TokensFileError(f"tokens file: line {number}: sha256 needs 64 lowercase hex digits")
            add(TokenLine(user, bytes.fromhex(hexpart), None), number)
            continue
        if not TOKEN_RE.match(rest):
            raise TokensFileError(f"tokens file: line {number}: token must be 1-256 chars of [A-Za-z0-9._~+/=-]")
        add(TokenLine(user, token_digest(rest), rest), number)
    return out


def read_tokens_file(path: str | Path) -> list[TokenLine]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokensFileError(f"tokens file: cannot read {p}") from exc
    return parse_tokens(text)

"""Bearer tokens per user from a tokens file (contract §9 "Tokens file"; §2 ``unauthorized``).

Only SHA-256 digests are kept in memory; comparisons use :func:`hmac.compare_digest`. A token
acts for its own user only. Lines: ``user_id:token`` or ``user_id:sha256:<64 lowercase hex>``;
blank lines and ``#`` comments are ignored; a user may have several lines (rotation). A token
listed for two users (in either form) is refused: HTTP would act as one of them, MQTT as both.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from kcloak.wire.tokens import TOKEN_RE, TokenLine, TokensFileError, read_tokens_file, token_digest


@dataclass(slots=True)
class TokenStore:
    """Users and the digests of their tokens."""

    _by_user: dict[str, list[bytes]] = field(default_factory=dict)
    _by_digest: dict[bytes, str] = field(default_factory=dict)

    @classmethod
    def from_lines(cls, lines: list[TokenLine]) -> TokenStore:
        store = cls()
        for line in lines:
            owner = store._by_digest.setdefault(line.digest, line.user)
            if owner != line.user:
                raise TokensFileError("tokens: the same token is listed for two users")
            store._by_user.setdefault(line.user, []).append(line.digest)
        return store

    @classmethod
    def from_file(cls, path: str | Path) -> TokenStore:
        return cls.from_lines(read_tokens_file(path))

    def __len__(self) -> int:
        return len(self._by_user)

    @property
    def users(self) -> list[str]:
        return list(self._by_user)

    def user_of(self, token: str) -> str | None:
        """The user a bearer token belongs to, or ``None``."""
        if not TOKEN_RE.match(token):
            return None
        digest = token_digest(token)
        user = self._by_digest.get(digest)
        if user is None:
            return None
        return user if any(hmac.compare_digest(digest, d) for d in self._by_user[user]) else None

    def check(self, user: str, token: str) -> bool:
        """True iff ``token`` is one of ``user``'s tokens (constant time per stored digest)."""
        digests = self._by_user.get(user)
        if not digests or not TOKEN_RE.match(token):
            return False
        digest = token_digest(token)
        ok = False
        for d in digests:
            ok |= hmac.compare_digest(digest, d)
        return ok

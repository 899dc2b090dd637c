"""Stored privacy profiles (contract §2): read from memory, written through to the profile store,
and handed to the position index (a view carries each user's stored k, CONCEPTS §2.4)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kcloak.broker.stores import ProfileStore, StoredProfile
from kcloak.cloaking.index import PositionIndex
from kcloak.core.profile import PrivacyProfile


class Profiles:
    """Each user's stored profile, or the server default.

    Keyword arguments: ``store`` (the :class:`ProfileStore`, loaded at once), ``index`` (told of
    every change), ``default`` (the server's default profile), ``clock``.
    """

    def __init__(
        self,
        *,
        store: ProfileStore,
        index: PositionIndex,
        default: PrivacyProfile,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.index = index
        self.default = default
        self.clock = clock
        self._stored: dict[str, StoredProfile] = dict(store.all())
        for user, sp in self._stored.items():
            index.set_profile(user, sp.profile)

    def get(self, user: str) -> tuple[PrivacyProfile, str, float | None]:
        """The user's profile, its source (``stored`` or ``default``) and when it was stored."""
        sp = self._stored.get(user)
        if sp is None:
            return self.default, "default", None
        return sp.profile, "stored", sp.updated_t

    async def set(self, user: str, data: dict[str, Any] | None) -> PrivacyProfile:
        """Replace (or with ``None`` reset) the stored profile; raises :class:`ProfileError`."""
        if data is None:
            await asyncio.to_thread(self.store.delete, user)
            self._stored.pop(user, None)
            self.index.set_profile(user, None)
            return self.default
        profile = PrivacyProfile.from_mapping(data, self.default)
        t = self.clock()
        await asyncio.to_thread(self.store.put, user, profile, t)
        self._stored[user] = StoredProfile(profile, t)
        self.index.set_profile(user, profile)
        return profile


__all__ = ["Profiles"]

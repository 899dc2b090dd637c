"""Housekeeping: retention of the movement store, pruning of the recent-fix history, and the
presence gauge (contract §11), once a period; a failure is logged and retried, never fatal."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable

from kcloak.broker.metrics import Metrics
from kcloak.broker.positions import PositionReader
from kcloak.broker.stores import MovementStore, StoreError
from kcloak.core.logs import log_event

log = logging.getLogger("kcloak.pipeline")


class Housekeeping:
    """Deletes fixes older than ``retention_s``, except those of a window not yet published.

    Keyword arguments: ``retention_s`` (``storage.retention_s``), ``metrics``, ``movement``,
    ``positions``, ``clock``. ``retention_floor``, when set (by trajectory publication), returns
    the time from which fixes must be kept.
    """

    def __init__(
        self,
        *,
        retention_s: float,
        metrics: Metrics,
        movement: MovementStore,
        positions: PositionReader,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention_s = retention_s
        self.metrics = metrics
        self.movement = movement
        self.positions = positions
        self.clock = clock
        self.retention_floor: Callable[[], float | None] | None = None
        """Fixes at or after the time this returns are never deleted (set by trajectory publication)."""

    async def run(self, period_s: float = 60.0) -> None:
        """Once per ``period_s``: retention, history pruning and the presence gauge; until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            try:
                deleted = await self.apply_retention()
            except (StoreError, sqlite3.Error) as exc:  # retried next period; never stops the broker
                log_event(log, "retention_failed", logging.ERROR, store="movement", error=type(exc).__name__)
                deleted = 0
            history = self.positions.history
            if history is not None:
                history.prune(self.clock())
            if deleted:
                log_event(log, "retention", store="movement", deleted=deleted)
            # A count, not len(snapshot()): a view of everyone (at a million users, the kept Hilbert
            # order and ~1 s of work) only for a gauge.
            self.metrics.users_present.set(self.positions.present_count(self.clock()))

    async def apply_retention(self) -> int:
        """Delete fixes older than ``retention_s``, never those of a window not yet committed."""
        cutoff = self.clock() - self.retention_s
        keep_from = self.retention_floor() if self.retention_floor is not None else None
        return await self.movement.delete_older_than(cutoff, keep_from=keep_from)


__all__ = ["Housekeeping"]

"""The root of the errors of kcloak.streams."""

from __future__ import annotations

from kcloak.core.errors import KcloakError


class StreamsError(KcloakError):
    """Base of every error raised by kcloak.streams (trajectories, (k,δ), quality, tables, releases)."""

"""The root of the errors of kcloak.cloaking."""

from __future__ import annotations

from kcloak.core.errors import KcloakError


class CloakingError(KcloakError):
    """Base of every error raised by kcloak.cloaking (cloakers, checks, attacks, the index, tabular release)."""

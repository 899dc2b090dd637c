"""The root of the errors of kcloak.broker."""

from __future__ import annotations

from kcloak.core.errors import KcloakError


class BrokerError(KcloakError):
    """Base of every error raised by kcloak.broker (the service)."""

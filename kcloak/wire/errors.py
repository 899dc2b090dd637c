"""The root of the errors of kcloak.wire."""

from __future__ import annotations

from kcloak.core.errors import KcloakError


class WireError(KcloakError):
    """Base of every error raised by kcloak.wire (payload codec, HTTP and MQTT clients, tokens file)."""

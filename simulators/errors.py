"""The root of the errors of kcloak.simulators."""

from __future__ import annotations

from kcloak.core.errors import KcloakError


class SimulatorError(KcloakError):
    """Base of every error raised by kcloak.simulators (the clients of the public interface)."""

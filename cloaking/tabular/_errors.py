"""Exceptions of tabular release (CONCEPTS §8); the CLI maps them to exit codes (contract §9)."""

from __future__ import annotations

from kcloak.cloaking.errors import CloakingError
from kcloak.core.errors import InputError


class TabularError(CloakingError):
    """Base of every error raised by :mod:`kcloak.cloaking.tabular`."""


class NotApplicable(TabularError, InputError, ValueError):
    """The requested combination does not apply (e.g. Anatomy without a sensitive column): exit 2."""


class InvalidTableInput(NotApplicable):
    """Bad parameters or unusable input values (non-numeric value in a numeric QI, ...): exit 2."""


class Unsatisfiable(TabularError, RuntimeError):
    """The privacy criteria cannot be met within the suppression budget: a runtime failure, exit 1."""

"""kcloak's exception roots (docs/architecture.md "Layers").

Every exception kcloak raises on purpose derives from :class:`KcloakError`, through the root of
the package that raises it: :class:`CoreError` here, ``CloakingError`` (:mod:`kcloak.cloaking.errors`),
``StreamsError``, ``WireError``, ``BrokerError``, ``SimulatorError`` and the command line's
``UsageError``. An error caused by what a user handed in (a flag value, a file, a payload) also
derives from :class:`InputError`. The command line maps these roots to exit codes in one table
(``kcloak.cli.main.EXIT_CODES``): input errors exit 2, every other kcloak error exits 1.
Exceptions keep the builtin base they had (``ValueError``, ``RuntimeError``, ``ConnectionError``)
so that callers catching those still catch them.
"""

from __future__ import annotations


class KcloakError(Exception):
    """Base of every exception kcloak raises on purpose."""


class InputError(KcloakError):
    """Bad input from the user (a flag value, a file, a payload): the command line's exit 2."""


class CoreError(KcloakError):
    """Base of the errors of :mod:`kcloak.core` (readers, places, profiles, geohashes)."""


class BenchError(CoreError, InputError, ValueError):
    """Parameters or data a benchmark cannot run with (the command line's exit 2)."""

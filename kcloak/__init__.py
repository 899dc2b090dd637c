"""kcloak: a location-privacy middleware (trusted anonymizer between apps and location-based services).

The repository keeps its packages at the top (``broker/``, ``cloaking/``, ``streams/``,
``simulators/``); they install and import as ``kcloak.broker``, ``kcloak.cloaking``,
``kcloak.streams`` and ``kcloak.simulators`` (see "Layout and imports" in docs/architecture.md).

The Python API (docs/python-api.md): :func:`anonymize`, :func:`release`, :func:`audit` and
:func:`audit_cloaking` on pandas DataFrames, with their results :class:`Anonymized` and
:class:`Released`. They live in :mod:`kcloak.api` and are loaded on first use, so ``import kcloak``
(and ``kcloak --help``) imports neither numpy nor pandas.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kcloak.api import Anonymized, Released, anonymize, audit, audit_cloaking, release

try:
    __version__ = version("kcloak")
except PackageNotFoundError:  # pragma: no cover - only when run from an uninstalled checkout
    __version__ = "0+unknown"

API: tuple[str, ...] = ("Anonymized", "Released", "anonymize", "audit", "audit_cloaking", "release")
"""The names :mod:`kcloak.api` lends the package (loaded on first access)."""


def __getattr__(name: str) -> Any:
    if name in API:
        from kcloak import api

        return getattr(api, name)
    raise AttributeError(f"module 'kcloak' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API})


__all__ = ["API", "Anonymized", "Released", "__version__", "anonymize", "audit", "audit_cloaking", "release"]

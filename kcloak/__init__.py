"""kcloak: a location-privacy middleware (trusted anonymizer between apps and location-based services).

The repository keeps its packages at the top (``broker/``, ``cloaking/``, ``streams/``,
``simulators/``); they install and import as ``kcloak.broker``, ``kcloak.cloaking``,
``kcloak.streams`` and ``kcloak.simulators`` (see "Layout and imports" in docs/architecture.md).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kcloak")
except PackageNotFoundError:  # pragma: no cover - only when run from an uninstalled checkout
    __version__ = "0+unknown"

"""Spatial cloakers behind one protocol and a registry by name (CONCEPTS §4)."""

from __future__ import annotations

import importlib
from typing import Any

from kcloak.cloaking.cloakers.base import (
    BATCH_CODES,
    REFUSAL_MESSAGES,
    STATUS_OK,
    BatchResult,
    Cloaker,
    CloakMode,
    CloakResult,
    Refusal,
    Region,
    cloak_each,
    finish_region,
    refuse,
)
from kcloak.core.names import SpatialAlgorithm, values

# name -> "module:Class"; modules are imported on first use.
_REGISTRY: dict[str, str] = {
    SpatialAlgorithm.NN.value: "kcloak.cloaking.cloakers.nn:NearestNeighbourCloak",
    SpatialAlgorithm.INTERVAL.value: "kcloak.cloaking.cloakers.interval:IntervalCloak",
    SpatialAlgorithm.CASPER.value: "kcloak.cloaking.cloakers.casper:CasperCloak",
    SpatialAlgorithm.HILBERT.value: "kcloak.cloaking.cloakers.hilbert:HilbertCloak",
    SpatialAlgorithm.CLIQUE.value: "kcloak.cloaking.cloakers.clique:CliqueCloak",
    SpatialAlgorithm.PRIVACYGRID.value: "kcloak.cloaking.cloakers.privacygrid:PrivacyGridCloak",
}
SPATIAL_ALGORITHMS: tuple[str, ...] = values(SpatialAlgorithm)


def cloaker_class(name: str) -> type[Any]:
    """The class registered under ``name`` (KeyError for an unknown name)."""
    target = _REGISTRY[name]
    module, name_in_module = target.split(":")
    cls: type[Any] = getattr(importlib.import_module(module), name_in_module)  # clique is not a Cloaker
    return cls


def get_cloaker(name: str, **params: Any) -> Any:
    """A cloaker instance by its contract name (``--algorithm`` values).

    Snapshot cloakers satisfy :class:`Cloaker`; ``clique`` holds requests and is driven by an
    explicit clock instead (see :mod:`kcloak.cloaking.cloakers.clique`).
    """
    return cloaker_class(name)(**params)


__all__ = [
    "BATCH_CODES",
    "REFUSAL_MESSAGES",
    "SPATIAL_ALGORITHMS",
    "STATUS_OK",
    "BatchResult",
    "CloakMode",
    "CloakResult",
    "Cloaker",
    "Refusal",
    "Region",
    "cloak_each",
    "cloaker_class",
    "finish_region",
    "get_cloaker",
    "refuse",
]

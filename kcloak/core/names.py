"""The names users type and the contract spells (algorithms, methods, models, formats), defined once.

Each set of names is a :class:`~enum.StrEnum`; the command-line parsers import this cheap module
for their ``choices`` and the modules that own the work use the same enums (or the plain-string
tuples :func:`values` makes of them), so no list has to be kept in step with another.
"""

from __future__ import annotations

from enum import StrEnum


def values(names: type[StrEnum]) -> tuple[str, ...]:
    """The names of an enum as plain strings, in definition order (``choices=`` and error messages)."""
    return tuple(str(member.value) for member in names)


class SpatialAlgorithm(StrEnum):
    """Snapshot spatial cloaking algorithms (contract §6, CONCEPTS §5)."""

    NN = "nn"
    INTERVAL = "interval"
    CASPER = "casper"
    HILBERT = "hilbert"
    CLIQUE = "clique"
    PRIVACYGRID = "privacygrid"


class TemporalAlgorithm(StrEnum):
    """Cloaking that delays queries as well as enlarging them (the broker's ``temporal`` mode)."""

    TEMPORAL = "temporal"


BROKER_ALGORITHMS: tuple[str, ...] = values(SpatialAlgorithm) + values(TemporalAlgorithm)
"""``cloaking.algorithm`` of ``kcloak serve`` and ``kcloak demo --algorithm``."""


class KDeltaMethod(StrEnum):
    """(k,δ)-anonymity methods for trajectories (``kcloak anonymize --method``, publication)."""

    NWA = "nwa"
    W4M = "w4m"
    MICROAGG = "microagg"


class TrajectoryDistance(StrEnum):
    """Time-tolerant trajectory distances of W4M (CONCEPTS §7.4)."""

    EDR = "edr"
    LST = "lst"


class TabularAlgorithm(StrEnum):
    """Tabular release algorithms (``kcloak release --algorithm``, CONCEPTS §8)."""

    SAMARATI = "samarati"
    INCOGNITO = "incognito"
    OLA = "ola"
    MONDRIAN = "mondrian"
    MONDRIAN_RELAXED = "mondrian-relaxed"
    MDAV = "mdav"
    KACA = "kaca"
    ANATOMY = "anatomy"


class PlacesAlgorithm(StrEnum):
    """k^m-anonymity algorithms of the places table (``kcloak release places``)."""

    ACD = "acd"
    AA = "aa"


class MobilityModelName(StrEnum):
    """Mobility models of the simulators (``--model``)."""

    WAYPOINT = "waypoint"
    STREET = "street"
    HOTSPOT = "hotspot"


class SimulatedQueryKind(StrEnum):
    """Queries the simulated users send (``--query-kind``): one kind, or a mix of both."""

    RANGE = "range"
    KNN = "knn"
    MIX = "mix"


class InputFormat(StrEnum):
    """Trajectory formats kcloak's readers understand (``--format``)."""

    CSV = "csv"
    GEOLIFE = "geolife"
    GPX = "gpx"
    AIS = "ais"

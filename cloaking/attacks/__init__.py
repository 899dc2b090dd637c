"""Attacks on cloaked requests, one class per attacker (CONCEPTS §6; STYLE: ``assess_risk(data, targets)``)."""

from kcloak.cloaking.attacks.base import (
    AttackError,
    AttackName,
    CloakedWorld,
    CloakingAttack,
    Forwarded,
    Risk,
    Target,
    World,
    tolerance,
)
from kcloak.cloaking.attacks.snapshot import (
    BoundaryGuess,
    CentreGuess,
    Homogeneity,
    ObservationIdentification,
    RestrictedSpaceIdentification,
)
from kcloak.cloaking.attacks.tracking import QueryTrackingNaive, QueryTrackingSession

__all__ = [
    "AttackError",
    "AttackName",
    "BoundaryGuess",
    "CentreGuess",
    "CloakedWorld",
    "CloakingAttack",
    "Forwarded",
    "Homogeneity",
    "ObservationIdentification",
    "QueryTrackingNaive",
    "QueryTrackingSession",
    "RestrictedSpaceIdentification",
    "Risk",
    "Target",
    "World",
    "tolerance",
]

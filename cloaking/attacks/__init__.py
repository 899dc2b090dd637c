"""Attacks on cloaked requests, one class per attacker (CONCEPTS §6; STYLE: ``assess_risk(data, targets)``)."""

from cloaking.attacks.base import (
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
from cloaking.attacks.snapshot import (
    BoundaryGuess,
    CentreGuess,
    Homogeneity,
    ObservationIdentification,
    RestrictedSpaceIdentification,
)
from cloaking.attacks.tracking import QueryTrackingNaive, QueryTrackingSession

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

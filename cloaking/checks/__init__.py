"""Independent checkers and black-box evaluators (CONCEPTS §6.1, §6.3, §9.0, §9.1).

``regions`` imports only the standard library, ``decimal`` and numpy; ``reciprocity`` drives a
cloaker through its public protocol only.
"""

from kcloak.cloaking.checks.reciprocity import (
    CandidateSets,
    CentreGuess,
    candidate_sets,
    centre_guess,
    stored_profiles,
    wilson_interval,
)
from kcloak.cloaking.checks.regions import (
    EARTH_RADIUS_M,
    Places,
    Property,
    Published,
    RefusalCheck,
    Snapshot,
    Violation,
    apply_override,
    area_m2,
    check_clique_stream,
    check_refusal,
    check_region,
    haversine_m,
    join_override,
    min_box_area_m2,
    strictly_inside,
    tight_box,
    users_inside,
)

__all__ = [
    "EARTH_RADIUS_M",
    "CandidateSets",
    "CentreGuess",
    "Places",
    "Property",
    "Published",
    "RefusalCheck",
    "Snapshot",
    "Violation",
    "apply_override",
    "area_m2",
    "candidate_sets",
    "centre_guess",
    "check_clique_stream",
    "check_refusal",
    "check_region",
    "haversine_m",
    "join_override",
    "min_box_area_m2",
    "stored_profiles",
    "strictly_inside",
    "tight_box",
    "users_inside",
    "wilson_interval",
]

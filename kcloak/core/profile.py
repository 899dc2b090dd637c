"""Personalized privacy profiles and the "only stricter" rule (CONCEPTS §3; contract §2)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import CoreError, InputError


class ReasonCode(enum.StrEnum):
    """Every reason code of the contract (§2): HTTP error codes, answer reasons, metric labels."""

    INVALID = "invalid"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    DUPLICATE = "duplicate"
    TOO_LARGE = "too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RATE_LIMITED = "rate_limited"
    INTERNAL = "internal"
    OVERLOADED = "overloaded"
    SHUTDOWN = "shutdown"
    LOOSER_THAN_PROFILE = "looser_than_profile"
    UNKNOWN_SESSION = "unknown_session"
    STALE_POSITION = "stale_position"
    UNSUPPORTED = "unsupported"
    K_UNREACHABLE = "k_unreachable"
    AREA_EXCEEDED = "area_exceeded"
    L_UNREACHABLE = "l_unreachable"
    EXPIRED = "expired"
    UPSTREAM_ERROR = "upstream_error"
    OUT_OF_ORDER = "out_of_order"
    TOO_OLD = "too_old"


class ProfileError(CoreError, InputError, ValueError):
    """A profile or override that cannot be used; ``code`` is the contract reason."""

    def __init__(self, code: ReasonCode, field: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


MAX_AREA_CAP_M2 = 2.5e9

# field -> (is integer, lower bound, lower inclusive, upper bound, stricter means larger)
_RULES: dict[str, tuple[bool, float, bool, float, bool]] = {
    "k": (True, 1, True, 1000, True),
    "l": (True, 1, True, 50, True),
    "min_area_m2": (False, 0.0, True, MAX_AREA_CAP_M2, True),
    "max_area_m2": (False, 0.0, False, MAX_AREA_CAP_M2, False),
    "max_delay_s": (False, 0.0, True, 600.0, False),
}
PROFILE_FIELDS: tuple[str, ...] = tuple(_RULES)
PROFILE_RULES: Mapping[str, tuple[bool, float, bool, float, bool]] = _RULES
"""The bounds of each profile field, as above: the validators and the published JSON Schemas read them."""


@dataclass(frozen=True, slots=True)
class PrivacyProfile:
    """The five profile fields of contract §2; construction validates them."""

    k: int = 5
    l: int = 1  # noqa: E741 - the field's name in the contract
    min_area_m2: float = 10_000.0
    max_area_m2: float = 4.0e6
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f.name, getattr(self, f.name))
        if self.min_area_m2 > self.max_area_m2:
            raise ProfileError(ReasonCode.INVALID, "min_area_m2", "min_area_m2: must not exceed max_area_m2")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, defaults: PrivacyProfile | None = None) -> PrivacyProfile:
        """A whole profile from a (possibly partial) JSON object; omitted fields take ``defaults``."""
        base = defaults if defaults is not None else cls()
        if data is None:
            return base
        if not isinstance(data, Mapping):
            raise ProfileError(ReasonCode.INVALID, "profile", "profile: must be an object")
        for name in data:
            if name not in _RULES:
                raise ProfileError(ReasonCode.INVALID, str(name)[:64], "profile: unknown field")
        values = {name: getattr(base, name) for name in PROFILE_FIELDS}
        for name, value in data.items():
            _check_field(name, value)
            values[name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in PROFILE_FIELDS}

    def tightened(self, override: Mapping[str, Any] | None) -> PrivacyProfile:
        """The effective profile E of a query (§3.2): ``self`` is the stored profile S.

        Raises :class:`ProfileError` with ``invalid`` (out of bounds, unknown field, E.min > E.max)
        or ``looser_than_profile`` (a field moves the permissive way).
        """
        if override is None:
            return self
        if not isinstance(override, Mapping):
            raise ProfileError(ReasonCode.INVALID, "profile", "profile: must be an object")
        for name, value in override.items():
            if name not in _RULES:
                raise ProfileError(ReasonCode.INVALID, str(name)[:64], "profile: unknown field")
            _check_field(name, value)
        for name, value in override.items():
            larger_is_stricter = _RULES[name][4]
            stored = getattr(self, name)
            looser = value < stored if larger_is_stricter else value > stored
            if looser:
                raise ProfileError(
                    ReasonCode.LOOSER_THAN_PROFILE, name, f"{name}: override is looser than the stored profile"
                )
        values = {name: override.get(name, getattr(self, name)) for name in PROFILE_FIELDS}
        return PrivacyProfile(**values)


def _check_field(name: str, value: object) -> None:
    is_int, lo, lo_incl, hi, _ = _RULES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(ReasonCode.INVALID, name, f"{name}: must be a number")
    if is_int and not isinstance(value, int):
        raise ProfileError(ReasonCode.INVALID, name, f"{name}: must be an integer")
    if not math.isfinite(value):
        raise ProfileError(ReasonCode.INVALID, name, f"{name}: must be finite")
    low_ok = value >= lo if lo_incl else value > lo
    if not low_ok or value > hi:
        bracket = "[" if lo_incl else "("
        raise ProfileError(ReasonCode.INVALID, name, f"{name}: must be within {bracket}{lo:g}, {hi:g}]")


@dataclass(frozen=True, slots=True)
class ProfileArrays:
    """Columns of effective profiles for the batch API (one entry per request)."""

    k: npt.NDArray[np.int64]
    l: npt.NDArray[np.int64]  # noqa: E741
    min_area_m2: npt.NDArray[np.float64]
    max_area_m2: npt.NDArray[np.float64]
    max_delay_s: npt.NDArray[np.float64]

    def __len__(self) -> int:
        return len(self.k)

    @classmethod
    def from_profiles(cls, profiles: Sequence[PrivacyProfile]) -> ProfileArrays:
        return cls(
            k=np.fromiter((p.k for p in profiles), np.int64, len(profiles)),
            l=np.fromiter((p.l for p in profiles), np.int64, len(profiles)),
            min_area_m2=np.fromiter((p.min_area_m2 for p in profiles), np.float64, len(profiles)),
            max_area_m2=np.fromiter((p.max_area_m2 for p in profiles), np.float64, len(profiles)),
            max_delay_s=np.fromiter((p.max_delay_s for p in profiles), np.float64, len(profiles)),
        )

    @classmethod
    def uniform(cls, profile: PrivacyProfile, n: int) -> ProfileArrays:
        return cls(
            k=np.full(n, profile.k, np.int64),
            l=np.full(n, profile.l, np.int64),
            min_area_m2=np.full(n, profile.min_area_m2),
            max_area_m2=np.full(n, profile.max_area_m2),
            max_delay_s=np.full(n, profile.max_delay_s),
        )

    def __getitem__(self, i: int) -> PrivacyProfile:
        return PrivacyProfile(
            int(self.k[i]),
            int(self.l[i]),
            float(self.min_area_m2[i]),
            float(self.max_area_m2[i]),
            float(self.max_delay_s[i]),
        )

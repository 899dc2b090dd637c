"""The answer to a query (contract §3 "Answer", §6): one typed value, turned into JSON in one place.

Both doors send :meth:`Answer.to_json` (MQTT as compact JSON on ``kcloak/v1/answer/{user}``,
HTTP as the 200 body), so an answer has the same members, in the same order, on both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from kcloak.core.profile import ReasonCode

AnswerStatus = Literal["ok", "refused"]


@dataclass(frozen=True, slots=True)
class PoiResult:
    """One result: a POI and its distance from the querier's exact position (contract §3)."""

    poi_id: str
    lat: float
    lon: float
    category: str
    name: str
    distance_m: float

    def to_json(self) -> dict[str, Any]:
        return {
            "poi_id": self.poi_id,
            "lat": self.lat,
            "lon": self.lon,
            "category": self.category,
            "name": self.name,
            "distance_m": self.distance_m,
        }


@dataclass(frozen=True, slots=True)
class AnsweredRegion:
    """The region exactly as sent upstream: GeoJSON-order bbox, and the interval of a temporal one."""

    bbox: tuple[float, float, float, float]
    t_start: int | None = None
    t_end: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bbox": list(self.bbox)}
        if self.t_start is not None and self.t_end is not None:
            out["t_start"] = self.t_start
            out["t_end"] = self.t_end
        return out


@dataclass(frozen=True, slots=True)
class SessionBrief:
    """The ``session`` member of an answer (contract §6): id, state, and ``expires_t`` while active."""

    session_id: str
    state: str
    expires_t: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session_id": self.session_id, "state": self.state}
        if self.expires_t is not None:
            out["expires_t"] = self.expires_t
        return out


@dataclass(frozen=True, slots=True)
class Answer:
    """Exactly one per query (contract §2): ``ok`` with results, or ``refused`` with a reason.

    A field left ``None`` is not sent. Members go out in this order: ``query_id``, ``status``,
    ``reason``, ``message``, ``algorithm``, ``k_achieved``, ``area_m2``, ``region``,
    ``l_achieved``, ``results``, ``truncated``, ``t``, ``session``; a stop's answer (``ok``
    without results) carries ``session`` before ``t``, as it always has.
    """

    query_id: str
    status: AnswerStatus
    t: float
    reason: ReasonCode | None = None
    message: str | None = None
    algorithm: str | None = None
    k_achieved: int | None = None
    area_m2: float | None = None
    region: AnsweredRegion | None = None
    l_achieved: int | None = None
    results: tuple[PoiResult, ...] | None = None
    truncated: bool | None = None
    session: SessionBrief | None = None

    @classmethod
    def refused(cls, query_id: str, reason: ReasonCode, message: str, t: float) -> Answer:
        """A refusal: ``query_id``, ``status``, ``reason``, ``message``, ``t``."""
        return cls(query_id=query_id, status="refused", t=t, reason=reason, message=message)

    @classmethod
    def stopped(cls, query_id: str, session: SessionBrief, t: float) -> Answer:
        """The answer to a session's stop: ``ok``, its ``session``, no results."""
        return cls(query_id=query_id, status="ok", t=t, session=session)

    @property
    def reason_label(self) -> str:
        """The ``reason`` metric label: the reason code, ``none`` for an ``ok`` answer."""
        return self.reason.value if self.reason is not None else "none"

    def with_session(self, session: SessionBrief) -> Answer:
        """This answer carrying ``session`` (every answer to a session's start, refresh or stop)."""
        return replace(self, session=session)

    def to_json(self) -> dict[str, Any]:
        """The answer object both doors send."""
        out: dict[str, Any] = {"query_id": self.query_id, "status": self.status}
        if self.reason is not None:
            out["reason"] = self.reason.value
        if self.message is not None:
            out["message"] = self.message
        if self.algorithm is not None:
            out["algorithm"] = self.algorithm
        if self.k_achieved is not None:
            out["k_achieved"] = self.k_achieved
        if self.area_m2 is not None:
            out["area_m2"] = self.area_m2
        if self.region is not None:
            out["region"] = self.region.to_json()
        if self.l_achieved is not None:
            out["l_achieved"] = self.l_achieved
        if self.results is not None:
            out["results"] = [r.to_json() for r in self.results]
        if self.truncated is not None:
            out["truncated"] = self.truncated
        session = self.session.to_json() if self.session is not None else None
        if session is not None and self.status == "ok" and self.results is None:
            out["session"] = session
            session = None
        out["t"] = self.t
        if session is not None:
            out["session"] = session
        return out


__all__ = ["Answer", "AnswerStatus", "AnsweredRegion", "PoiResult", "SessionBrief"]

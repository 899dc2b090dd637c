"""Every reason code of the v1 interface: when it happens, how each door carries it, and what a
client should do about it. ``docs/interface.md``, the OpenAPI and the AsyncAPI documents read
this table; ``tests/wire/test_interface_docs.py`` checks it names every :class:`ReasonCode` and
that its HTTP statuses are the ones the HTTP door sends."""

from __future__ import annotations

from dataclasses import dataclass

from kcloak.core.profile import ReasonCode


@dataclass(frozen=True, slots=True)
class Reason:
    code: ReasonCode
    when: str
    http: str
    """How HTTP carries it: ``"400 error"``, ``"200 answer"``, ``"—"`` …"""
    mqtt: str
    action: str
    """What a client should do about it."""
    answer: bool = False
    """A ``refused`` answer may carry it (on MQTT, or as the 200 body of a query route)."""
    error_status: int | None = None
    """The HTTP status of its error body, when it is one."""


R = ReasonCode
REASONS: tuple[Reason, ...] = (
    Reason(
        R.INVALID,
        "schema, type, range or consistency error; unknown field; unknown kind; a fix more than 5 s ahead",
        "400 error",
        "query with a valid topic user and query_id: answer; profile: status refused; else dropped (counter)",
        "Fix the request: `field` names the field and `message` the rule. Do not retry it unchanged.",
        answer=True,
        error_status=400,
    ),
    Reason(
        R.UNAUTHORIZED,
        "tokens are configured and the bearer token is missing or unknown",
        "401 error + `WWW-Authenticate: Bearer`",
        "the MQTT server refuses the CONNECT",
        "Send `Authorization: Bearer <token>` (MQTT: username = user id, password = token); ask the operator "
        "for a token.",
        error_status=401,
    ),
    Reason(
        R.FORBIDDEN,
        "the token's user is not the user acted for; a batch item for another user with tokens; published data "
        "read by a user not in `published_readers`",
        "403 error",
        "whole message dropped (counter)",
        "Act only for the token's own user; ask the operator to list you in `auth.published_readers`.",
        error_status=403,
    ),
    Reason(
        R.NOT_FOUND,
        "unknown route or window",
        "404 error",
        "—",
        "Check the path (all routes are under `/v1/`); list windows with `GET /v1/published/windows`.",
        error_status=404,
    ),
    Reason(
        R.METHOD_NOT_ALLOWED,
        "the route exists, the method does not",
        "405 error",
        "—",
        "Use the method `/v1/openapi.json` lists for the route.",
        error_status=405,
    ),
    Reason(
        R.DUPLICATE,
        "the `query_id` was already used by this user in the last 10 minutes",
        "409 error",
        "dropped silently (counter): makes QoS 1 redelivery safe",
        "Use a new `query_id` for every query (a UUID or a counter); a repeated id is the same query.",
        error_status=409,
    ),
    Reason(
        R.TOO_LARGE,
        "a size or batch limit (see Limits)",
        "413 error",
        "dropped (counter)",
        "Send less: split a batch into several of at most 10,000 fixes and 1 MiB.",
        error_status=413,
    ),
    Reason(
        R.UNSUPPORTED_MEDIA_TYPE,
        "the request body is not `application/json`",
        "415 error",
        "—",
        "Send `Content-Type: application/json`.",
        error_status=415,
    ),
    Reason(
        R.RATE_LIMITED,
        "per-user rate, pending-query or session limit",
        "429 error + `Retry-After`",
        "answer (queries), rejected (fixes), status refused (profiles)",
        "Slow down: wait `Retry-After` seconds; stop sessions you no longer need (at most 4 active).",
        answer=True,
        error_status=429,
    ),
    Reason(
        R.INTERNAL,
        "an unexpected bug; the query still gets its one answer",
        "500 error",
        "answer",
        "Retry later with a new `query_id`; report it with the time (the broker logs the stack, never the values).",
        answer=True,
        error_status=500,
    ),
    Reason(
        R.OVERLOADED,
        "a bounded queue is full at any stage, or a store cannot write",
        "503 error + `Retry-After: 1`",
        "answer / fix rejected",
        "Back off and retry after a second, with a new `query_id` for a query.",
        answer=True,
        error_status=503,
    ),
    Reason(
        R.SHUTDOWN,
        "intake stopped, or the query was pending when shutdown began",
        "503 error + `Retry-After: 1`",
        "answer",
        "Retry once the broker is back (`kcloak/v1/broker/status` says `up`, `/healthz` says `ok`).",
        answer=True,
        error_status=503,
    ),
    Reason(
        R.LOOSER_THAN_PROFILE,
        "a query's `profile` override loosens a field of the stored profile",
        "200 answer",
        "answer",
        "Overrides may only tighten: raise `k`/`l`/`min_area_m2`, lower `max_area_m2`/`max_delay_s`; or change "
        "the stored profile.",
        answer=True,
    ),
    Reason(
        R.UNKNOWN_SESSION,
        "`session_id` unknown, stopped, expired or ended, or another user's",
        "200 answer (query routes); 404 error (GET/DELETE session)",
        "answer",
        "Start a new session (`continuous: true`); sessions do not survive a broker restart.",
        answer=True,
        error_status=404,
    ),
    Reason(
        R.STALE_POSITION,
        "the querier has no fix, or its latest fix is older than 60 s",
        "200 answer",
        "answer",
        "Send a fix first, or carry `lat`, `lon`, `t` in the query.",
        answer=True,
    ),
    Reason(
        R.UNSUPPORTED,
        "the configured algorithm cannot honour a field (`l` > 1 without place diversity, a continuous query "
        "with `temporal`)",
        "200 answer",
        "answer",
        "Drop the field (e.g. `l`), or ask the operator for an algorithm that supports it (`privacygrid` for `l`).",
        answer=True,
    ),
    Reason(
        R.K_UNREACHABLE,
        "fewer than k users are present at all; or a session's group has fewer than k present members",
        "200 answer",
        "answer",
        "Not enough people are around right now (present = a fix in the last 60 s): retry later, or lower `k` "
        "in the stored profile. A session that ended must be started anew.",
        answer=True,
    ),
    Reason(
        R.AREA_EXCEEDED,
        "k users are present, but no region holding k of them (and at least `min_area_m2`) fits within "
        "`max_area_m2` (the users near the querier are too few); with `hilbert`, also when fewer users are "
        "present than the largest k any present user stored (every user's group must be that large)",
        "200 answer",
        "answer",
        "Too few users are near: retry when more are around, or raise `max_area_m2` or lower `k` in the stored "
        "profile. A lone user (a first test) gets this or `k_unreachable` whatever its k: cloaking needs a "
        "crowd, e.g. `kcloak simulate` running.",
        answer=True,
    ),
    Reason(
        R.L_UNREACHABLE,
        "a region with k users fits, but none with l place categories does",
        "200 answer",
        "answer",
        "Lower `l`, or raise `max_area_m2`.",
        answer=True,
    ),
    Reason(
        R.EXPIRED,
        "a held query (temporal, clique) could not be met within `max_delay_s`",
        "200 answer",
        "answer",
        "Raise `max_delay_s` in the stored profile, or retry.",
        answer=True,
    ),
    Reason(
        R.UPSTREAM_ERROR,
        "the location-based service failed after retries (timeout, connection error, 5xx, 429, bad response)",
        "200 answer",
        "answer",
        "Retry later with a new `query_id`; the privacy side succeeded, the service did not answer.",
        answer=True,
    ),
    Reason(
        R.OUT_OF_ORDER,
        "a fix whose `t` is not after the user's latest accepted fix",
        "in `rejected` of a fix answer",
        "rejected (counter)",
        "Send each user's fixes in strictly increasing `t`; drop the old one.",
    ),
    Reason(
        R.TOO_OLD,
        "a fix older than 120 s (`max_update_age_s`)",
        "in `rejected` of a fix answer",
        "rejected (counter)",
        "Check the device clock; send fixes when they are taken, not in a late backlog.",
    ),
)

ANSWER_REASONS: list[str] = [r.code.value for r in REASONS if r.answer]
ERROR_CODES: list[str] = sorted({r.code.value for r in REASONS if r.error_status is not None})

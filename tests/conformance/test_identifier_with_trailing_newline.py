"""Attack: identifiers with a trailing newline (``alice%0A`` in a path, ``"q1\\n"`` in a body).

Python's ``$`` matches before a final newline, so ``^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`` accepts
``"alice\\n"``: a second identity that looks like alice in logs, files and MQTT topics. Contract
§1: identifiers match their pattern exactly; anything else is ``invalid``.
"""

from __future__ import annotations

import time
from typing import Any

from tests.conformance.conftest import Servers, http_json, metric


def _fix() -> dict[str, Any]:
    return {"t": time.time(), "lat": 39.9, "lon": 116.4}


def _error(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and "error" in body, body
    error: dict[str, Any] = body["error"]
    return error


def test_trailing_newline_is_not_part_of_any_identifier(servers: Servers) -> None:
    served = servers.serve(mqtt=False)
    # user id in the path, on every user route
    for method, path, body in [
        ("POST", "/v1/users/alice%0A/location", _fix()),
        ("GET", "/v1/users/alice%0A/profile", None),
        ("PUT", "/v1/users/alice%0A/profile", {"k": 6}),
        ("DELETE", "/v1/users/alice%0A/profile", None),
        ("POST", "/v1/users/alice%0A/query", {"query_id": "q0", "kind": "knn", "n": 1}),
        ("POST", "/v1/users/alice%0A/sessions", {"query_id": "q0", "kind": "knn", "n": 1}),
        ("GET", "/v1/users/alice%0A/sessions/" + "0" * 32, None),
    ]:
        status, _, reply = http_json(method, served.url(path), body)
        assert status == 400, (method, path, reply)
        assert _error(reply)["code"] == "invalid" and _error(reply)["field"] == "user"
    assert metric(served.metrics(), "kcloak_updates_accepted_total") == 0

    # identifiers in bodies
    status, _, reply = http_json("POST", served.url("/v1/users/alice/location"), _fix())
    assert status == 200
    base = {"kind": "knn", "n": 1}
    for extra, field in [
        ({"query_id": "q1\n"}, "query_id"),
        ({"query_id": "q2", "category": "cafe\n"}, "category"),
    ]:
        status, _, reply = http_json("POST", served.url("/v1/users/alice/query"), {**base, **extra})
        assert status == 400 and _error(reply)["code"] == "invalid", reply
        assert _error(reply).get("field", field) == field and _error(reply)["message"].startswith(f"{field}:")
    refresh = served.url("/v1/users/alice/sessions/" + "0" * 32 + "%0A/refresh")
    status, _, reply = http_json("POST", refresh, {"query_id": "q3"})
    assert status == 400 and _error(reply)["code"] == "invalid", reply
    assert _error(reply)["message"].startswith("session_id:")
    # batch items naming a user (open mode: each item carries its user)
    status, _, reply = http_json(
        "POST", served.url("/v1/locations"), {"updates": [{**_fix(), "user": "bob\n"}, {**_fix(), "user": "bob"}]}
    )
    assert status == 200 and reply == {"accepted": 1, "rejected": [{"index": 0, "code": "invalid"}]}
    # a window id with a newline is no window (and no crash)
    status, _, reply = http_json("GET", served.url("/v1/published/windows/1714550400-1714551300%0A"))
    assert status == 404 and _error(reply)["code"] == "not_found"

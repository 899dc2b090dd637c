"""Attack: integers in a query string written with non-ASCII digits (``since=²``, ``limit=٣``).

``str.isdigit()`` accepts a superscript two and ``int()`` accepts Arabic-Indic digits, so a
check built on them either crashes (plain-text 500) or accepts what the contract does not.
Contract §4: ``since`` and ``limit`` are integers; anything else is 400 ``invalid`` naming the
parameter, with the contract's error body.
"""

from __future__ import annotations

from tests.conformance.conftest import Servers, http_json, metric

BAD = [
    ("since", "%C2%B2"),  # ² superscript two: isdigit() but not int()
    ("since", "%D9%A3"),  # ٣ Arabic-Indic three: int() accepts it
    ("limit", "%EF%BC%95"),  # ５ fullwidth five
    ("limit", "%E2%91%A0"),  # ① circled one
    ("since", "1_000"),  # int() accepts underscores
    ("since", "+5"),
    ("since", "%205"),  # leading space
    ("limit", "5%0A"),  # trailing newline
    ("since", "9" * 400),  # beyond the range, and long
    ("limit", ""),
]


def test_query_string_integers_are_plain_ascii_digits(servers: Servers) -> None:
    served = servers.serve(mqtt=False)
    for name, value in BAD:
        status, headers, body = http_json("GET", served.url(f"/v1/published/windows?{name}={value}"))
        assert status == 400, (name, value, body)
        assert isinstance(body, dict) and body["error"]["code"] == "invalid" and body["error"]["field"] == name
        assert headers["Content-Type"].startswith("application/json")
    status, _, body = http_json("GET", served.url("/v1/published/windows?since=0&limit=5"))
    assert status == 200 and body["windows"] == []
    assert metric(served.metrics(), "kcloak_http_requests_total", status="500") == 0

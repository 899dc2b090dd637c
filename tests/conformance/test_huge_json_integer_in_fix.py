"""Attack: a fix whose number is a JSON integer of thousands of digits.

Python 3.11 refuses to convert integer literals of more than 4,300 digits (and an integer of a
few hundred digits overflows a float), so a careless parser answers a plain-text 500, and on MQTT
the exception ends the intake. Contract §0/§1: a number that cannot be a valid value is
``invalid`` (naming the field), the broker keeps serving, and MQTT intake keeps running.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

from tests.conformance.conftest import Servers, http_json, metric

HUGE = "1" + "0" * 4999  # beyond Python's int-string conversion limit
OVERFLOW = "1" + "0" * 399  # an int, but too large for a float
TOPIC = ["-t", "kcloak/v1/update/alice", "-s"]  # the payload comes from stdin


def _fix_raw(lat: str = "39.9", t: str | None = None) -> bytes:
    return f'{{"t": {t or repr(time.time())}, "lat": {lat}, "lon": 116.4}}'.encode()


def _is_contract_error(body: Any, code: str) -> bool:
    return isinstance(body, dict) and body.get("error", {}).get("code") == code


def test_huge_integers_are_invalid_over_http(servers: Servers) -> None:
    served = servers.serve(mqtt=False)
    url = served.url("/v1/users/alice/location")
    for digits, field in ((HUGE, "lat"), (OVERFLOW, "lat"), ("-" + HUGE, "lat")):
        status, headers, body = http_json("POST", url, raw=_fix_raw(lat=digits))
        assert status == 400, body
        assert _is_contract_error(body, "invalid") and body["error"]["field"] == field
        assert headers["Content-Type"].startswith("application/json")
    status, _, body = http_json("POST", url, raw=_fix_raw(t=HUGE))
    assert status == 400 and _is_contract_error(body, "invalid") and body["error"]["field"] == "t"
    # in a query (n, radius_m) and a profile (k): still the field's invalid, never a 500
    query = f'{{"query_id": "q1", "kind": "knn", "n": {HUGE}}}'.encode()
    status, _, body = http_json("POST", served.url("/v1/users/alice/query"), raw=query)
    assert status == 400 and _is_contract_error(body, "invalid") and body["error"]["query_id"] == "q1"
    assert body["error"]["message"].startswith("n:"), body
    for value in (HUGE, OVERFLOW):
        status, _, body = http_json("PUT", served.url("/v1/users/alice/profile"), raw=f'{{"k": {value}}}'.encode())
        assert status == 400 and _is_contract_error(body, "invalid") and body["error"]["field"] == "k", body
    # the broker is unharmed: a good fix is accepted
    status, _, body = http_json("POST", url, raw=_fix_raw())
    assert status == 200 and body == {"accepted": 1, "rejected": []}
    text = served.metrics()
    assert metric(text, "kcloak_updates_rejected_total", transport="http", reason="invalid") >= 4
    assert metric(text, "kcloak_http_requests_total", status="500") == 0


def test_huge_integer_does_not_end_mqtt_intake(servers: Servers) -> None:
    served = servers.serve(mqtt=True)
    assert served.mqtt_port is not None

    def publish(payload: bytes) -> None:
        subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(served.mqtt_port), "-q", "1", *TOPIC],
            input=payload,
            check=True,
            timeout=10,
        )

    publish(_fix_raw(lat=HUGE))
    publish(_fix_raw(lat=OVERFLOW))
    publish(_fix_raw())
    deadline = time.monotonic() + 10
    accepted = 0.0
    while time.monotonic() < deadline:
        accepted = metric(served.metrics(), "kcloak_updates_accepted_total", transport="mqtt")
        if accepted >= 1:
            break
        time.sleep(0.1)
    assert accepted == 1, "MQTT intake stopped after a huge integer"
    text = served.metrics()
    assert metric(text, "kcloak_updates_rejected_total", transport="mqtt", reason="invalid") == 2

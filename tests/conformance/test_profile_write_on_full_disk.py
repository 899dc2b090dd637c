"""Attack (or bad luck): the disk fills up while users set their profiles.

The full disk is real: the running broker gets a file-size limit (``RLIMIT_FSIZE``, settable on
one's own processes without privileges), so SQLite's next write past it fails exactly as on a
full disk. Contract §4: every failure leaves as the contract's error body; a store that cannot
write is a temporary condition (503 ``overloaded`` with ``Retry-After``), never aiohttp's plain
text. Extension (docs/contract-extensions.md): ``/healthz`` says ``degraded`` (503) and
``kcloak_store_healthy{store}`` is 0 while a store cannot write, and both recover once a write
succeeds again.
"""

from __future__ import annotations

import resource
from typing import Any

from tests.conformance.conftest import Served, Servers, http_json, metric


def _put_profile(served: Served, user: str) -> tuple[int, dict[str, str], Any]:
    return http_json("PUT", served.url(f"/v1/users/{user}/profile"), {"k": 7})


def test_profile_write_on_full_disk_is_503_and_healthz_degraded(servers: Servers) -> None:
    served = servers.serve(mqtt=False)
    status, _, health = http_json("GET", served.url("/healthz"))
    assert status == 200 and health["status"] == "ok"
    status, _, _ = _put_profile(served, "before-full")
    assert status == 200

    files = [p for p in served.data_dir.iterdir() if p.is_file()] + [served.log_path]
    limit = max(p.stat().st_size for p in files) + 8192
    hard = resource.prlimit(served.proc.pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(served.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
    try:
        refused: tuple[int, dict[str, str], Any] | None = None
        for i in range(40):  # each stored profile adds a WAL frame; the file soon hits the limit
            status, headers, body = _put_profile(served, f"user{i}")
            if status != 200:
                refused = (status, headers, body)
                break
        assert refused is not None, "no write ever failed under the file-size limit"
        status, headers, body = refused
        assert status == 503, body
        assert headers["Content-Type"].startswith("application/json")
        assert isinstance(body, dict) and body["error"]["code"] == "overloaded"
        assert headers.get("Retry-After") == "1"
        assert f"user{i}" not in str(body)
        status, _, health = http_json("GET", served.url("/healthz"))
        assert status == 503 and health["status"] == "degraded", health
        text = served.metrics()
        assert metric(text, "kcloak_store_healthy", store="profiles") == 0
        assert metric(text, "kcloak_store_healthy", store="movement") == 1
        assert metric(text, "kcloak_store_write_failures_total", store="profiles") >= 1
        # a refused write stored nothing
        status, _, body = http_json("GET", served.url(f"/v1/users/user{i}/profile"))
        assert status == 200 and body["source"] == "default"
    finally:
        resource.prlimit(served.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))

    # space is back: the next write succeeds and health recovers
    status, _, body = _put_profile(served, f"user{i}")
    assert status == 200 and body["source"] == "stored" and body["profile"]["k"] == 7
    status, _, health = http_json("GET", served.url("/healthz"))
    assert status == 200 and health["status"] == "ok"
    assert metric(served.metrics(), "kcloak_store_healthy", store="profiles") == 1
    assert served.stop() == 0

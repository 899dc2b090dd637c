"""The lean HTTP client over TLS (an ``https://`` upstream): a real aiohttp server on loopback
with a certificate from a throw-away certificate authority (trustme)."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme
from aiohttp import web

from kcloak.broker.upstream import SearchRequest, UpstreamClient, UpstreamError
from kcloak.wire.http_client import HttpConnectionError, HttpPool

CANDIDATE = {"poi_id": "p1", "lat": 39.9, "lon": 116.4, "category": "cafe", "name": "tls"}


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def tls_port(ca: trustme.CA) -> AsyncIterator[int]:
    """An HTTPS provider on 127.0.0.1 whose certificate names ``localhost`` and 127.0.0.1."""

    async def search(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"candidates": [CANDIDATE | {"name": body["pseudonym"]}]})

    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(server_ctx)
    app = web.Application()
    app.router.add_post("/v1/search", search)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await runner.cleanup()


def _client_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


async def test_https_requests_reuse_one_verified_connection(ca: trustme.CA, tls_port: int) -> None:
    body = json.dumps({"pseudonym": "a" * 32}).encode()
    async with HttpPool(host="localhost", port=tls_port, scheme="https", ssl_context=_client_ctx(ca)) as pool:
        for _ in range(3):
            resp = await pool.request("POST", "/v1/search", body, timeout_s=5)
            assert resp.status == 200
            assert json.loads(resp.body)["candidates"][0]["name"] == "a" * 32


async def test_an_untrusted_certificate_is_refused(tls_port: int) -> None:
    async with HttpPool(host="localhost", port=tls_port, scheme="https") as pool:  # system CAs only
        with pytest.raises(HttpConnectionError):
            await pool.request("POST", "/v1/search", b"{}", timeout_s=5)


async def test_a_certificate_for_another_name_is_refused(ca: trustme.CA, tls_port: int) -> None:
    other = trustme.CA()
    ctx = _client_ctx(other)
    async with HttpPool(host="localhost", port=tls_port, scheme="https", ssl_context=ctx) as pool:
        with pytest.raises(HttpConnectionError):
            await pool.request("POST", "/v1/search", b"{}", timeout_s=5)
    # the right CA but a name the certificate does not carry
    async with HttpPool(host="127.0.0.2", port=tls_port, scheme="https", ssl_context=_client_ctx(ca)) as pool:
        with pytest.raises(HttpConnectionError):
            await pool.request("POST", "/v1/search", b"{}", timeout_s=5)


async def test_upstream_over_https_trusts_the_ca_named_by_ssl_cert_file(
    ca: trustme.CA, tls_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator with a private CA points ``SSL_CERT_FILE`` at it; without it the provider is refused."""
    request = SearchRequest(kind="knn", bbox=[116.39, 39.89, 116.41, 39.91], n=1)
    url = f"https://localhost:{tls_port}"
    async with UpstreamClient(url=url, timeout_s=2, retries=0, deadline_s=5) as client:
        with pytest.raises(UpstreamError):
            await client.search(request)
    pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    monkeypatch.setenv("SSL_CERT_FILE", str(pem))
    async with UpstreamClient(url=url, timeout_s=2, retries=0, deadline_s=5) as client:
        [candidate] = await client.search(request)
    assert candidate.poi_id == "p1" and len(candidate.name) == 32

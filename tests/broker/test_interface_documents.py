"""The interface documents a running broker serves: ``/v1/openapi.json`` validates with
openapi-spec-validator and lists exactly the routes the HTTP door registers; ``/v1/asyncapi.json``
validates against the AsyncAPI 3.0.0 JSON Schema (vendored in tests/data/asyncapi with its licence)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp import ClientSession
from openapi_spec_validator import validate as validate_openapi
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from kcloak.broker.auth import TokenStore
from kcloak.broker.http_server import build_app
from kcloak.broker.service import Broker
from kcloak.wire.tokens import parse_tokens
from tests.broker.conftest import SpyUpstream, broker_config

ASYNCAPI_SCHEMA = Path(__file__).resolve().parents[1] / "data" / "asyncapi" / "asyncapi-3.0.0.schema.json"
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


async def _served(tmp_path: Path, spy: SpyUpstream) -> tuple[dict[str, Any], dict[str, Any], set[tuple[str, str]]]:
    """Both documents as a broker with tokens serves them (no token sent), and its registered routes."""
    tokens = TokenStore.from_lines(parse_tokens("alice:tok-alice\n"))
    async with Broker(config=broker_config(tmp_path, spy.url), tokens=tokens) as broker, ClientSession() as http:
        base = f"http://127.0.0.1:{broker.http_port}"
        docs = []
        for name in ("openapi", "asyncapi"):
            r = await http.get(f"{base}/v1/{name}.json")
            assert r.status == 200, name
            docs.append(await r.json())
        assert broker.pipeline is not None
        app = build_app(broker.pipeline, broker.config, None, broker.state)
        routes = {(route.method.lower(), route.resource.canonical) for route in app.router.routes() if route.resource}
        return docs[0], docs[1], routes


async def test_openapi_validates_and_lists_every_route(tmp_path: Path, spy: SpyUpstream) -> None:
    openapi, _, routes = await _served(tmp_path, spy)
    validate_openapi(openapi)
    documented = {(m, path) for path, item in openapi["paths"].items() for m in item if m in _METHODS}
    assert documented == routes
    operation_ids = [item[m]["operationId"] for item in openapi["paths"].values() for m in item if m in _METHODS]
    assert len(operation_ids) == len(documented) == len(set(operation_ids))
    # Every route but the open ones names its bearer security; every error response is the error body.
    for path, item in openapi["paths"].items():
        for method in (m for m in item if m in _METHODS):
            op = item[method]
            assert ("security" in op) == (path.startswith("/v1/") and path not in _open_paths()), (method, path)
            for status, resp in op["responses"].items():
                if int(status) >= 400:
                    assert resp["content"]["application/json"]["schema"]["required"] == ["error"]


def _open_paths() -> set[str]:
    return {"/v1/openapi.json", "/v1/asyncapi.json", "/v1/info"}


def test_openapi_validator_refuses_an_unresolved_path_parameter() -> None:
    """The check above can fail: a path template without its parameter is what the document had."""
    from kcloak.broker.openapi import broker_openapi

    doc = broker_openapi()
    del doc["paths"]["/v1/users/{user}/location"]["parameters"]  # type: ignore[index]
    with pytest.raises(OpenAPIValidationError, match="user"):
        validate_openapi(doc)


def _asyncapi_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(ASYNCAPI_SCHEMA.read_text(encoding="utf-8")))


async def test_asyncapi_validates_and_describes_every_topic(tmp_path: Path, spy: SpyUpstream) -> None:
    _, asyncapi, _ = await _served(tmp_path, spy)
    errors = [f"{e.json_path}: {e.message[:200]}" for e in _asyncapi_validator().iter_errors(asyncapi)]
    assert errors == []
    assert asyncapi["asyncapi"] == "3.0.0"
    addresses = {ch["address"]: name for name, ch in asyncapi["channels"].items()}
    assert set(addresses) == {
        f"kcloak/v1/{t}/{{user}}" for t in ("update", "updates", "profile", "query", "answer", "status")
    } | {"kcloak/v1/broker/status", "kcloak/v1/published/trajectories"}
    ops = asyncapi["operations"]
    for address, name in addresses.items():
        kcloak_receives = any(f"/{t}/" in address for t in ("update", "updates", "profile", "query"))
        assert ops[name]["action"] == ("receive" if kcloak_receives else "send")
        mqtt = ops[name]["bindings"]["mqtt"]
        assert mqtt["qos"] == 1 and mqtt["retain"] == (address == "kcloak/v1/broker/status")


@pytest.mark.parametrize(
    "path, value",
    [
        (("operations", "update", "bindings", "mqtt", "qos"), 3),
        (("channels", "update", "qos"), 1),
        (("components", "messages", "query", "payload", "schema", "type"), 5),
    ],
)
def test_asyncapi_schema_refuses_a_broken_document(path: tuple[str, ...], value: object) -> None:
    """The vendored AsyncAPI schema does check: a QoS 3, an unknown channel field, a payload schema that
    is not a JSON Schema are each refused."""
    from kcloak.broker.asyncapi import broker_asyncapi

    doc = broker_asyncapi()
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert not _asyncapi_validator().is_valid(doc)


def test_changing_a_served_document_never_changes_the_validators_schemas() -> None:
    """The documents embed the payload schemas the validators' tests use; a caller that edits its document
    (as the test above does) must not edit them for everyone (it once turned the query schema's type into 5
    for every later test in the process)."""
    from kcloak.broker.asyncapi import broker_asyncapi
    from kcloak.broker.openapi import broker_openapi

    first_async, first_open = broker_asyncapi(), broker_openapi()
    first_async["components"]["messages"]["query"]["payload"]["schema"]["type"] = 5
    first_open["components"] = {"broken": True}
    assert broker_asyncapi()["components"]["messages"]["query"]["payload"]["schema"]["type"] == "object"
    assert broker_openapi()["components"] != {"broken": True}

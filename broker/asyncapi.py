"""The AsyncAPI 3.0 document of the MQTT interface (``GET /v1/asyncapi.json``).

Channels are the ``kcloak/v1/...`` topics, with their direction (``send`` = kcloak publishes,
``receive`` = kcloak subscribes), QoS and retain rule in MQTT bindings; payload schemas come from
:mod:`kcloak.wire.schemas`, the same ones the OpenAPI document uses and the tests hold against the
validators. ``tests/broker/test_asyncapi.py`` validates the document against the AsyncAPI 3.0.0
JSON Schema.
"""

from __future__ import annotations

import copy
from typing import Any

from kcloak import __version__
from kcloak.wire import schemas as s
from kcloak.wire.reasons import ANSWER_REASONS

_SCHEMA_FORMAT = "application/schema+json;version=draft-07"
_USER_PARAMETER = {
    "description": "the user id: 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit; with tokens "
    "the MQTT username, and each user may use only his own topics"
}


class Channel:
    """One topic: its address, who publishes, QoS, retain flag, payload and what it is for."""

    def __init__(
        self,
        name: str,
        address: str,
        *,
        action: str,
        qos: int,
        payload: s.Schema,
        summary: str,
        description: str,
        retain: bool = False,
        qos_text: str | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self.action = action  # "receive": clients publish it, kcloak subscribes; "send": kcloak publishes
        self.qos = qos
        self.qos_text = qos_text or str(qos)
        self.payload = payload
        self.summary = summary
        self.description = description
        self.retain = retain


CHANNELS: tuple[Channel, ...] = (
    Channel(
        "update",
        "kcloak/v1/update/{user}",
        action="receive",
        qos=1,
        qos_text="0 or 1 (1 when every fix matters: the PUBACK comes once the fix is stored)",
        payload=s.FIX,
        summary="Submit one location fix",
        description="Payload at most 64 KiB. Nothing is answered on MQTT; rejected fixes are counted.",
    ),
    Channel(
        "updates",
        "kcloak/v1/updates/{user}",
        action="receive",
        qos=1,
        payload=s.BATCH,
        summary="Submit a batch of fixes",
        description="Payload at most 1 MiB, at most 10,000 fixes. An item naming another user is allowed only "
        "without tokens; with tokens the whole message is dropped forbidden.",
    ),
    Channel(
        "profile",
        "kcloak/v1/profile/{user}",
        action="receive",
        qos=1,
        payload=s.PROFILE_MESSAGE,
        summary="Set or reset the stored profile",
        description="Answered on kcloak/v1/status/{user} with kind profile. Payload at most 64 KiB.",
    ),
    Channel(
        "query",
        "kcloak/v1/query/{user}",
        action="receive",
        qos=1,
        payload=s.QUERY,
        summary="Run a query: one-shot, session start, refresh or stop",
        description="Answered exactly once on kcloak/v1/answer/{user} when the topic user and query_id are "
        "valid; a repeated query_id gets nothing more. Subscribe to the answer topic before querying (a "
        "persistent session keeps answers across reconnects). Payload at most 64 KiB.",
    ),
    Channel(
        "answer",
        "kcloak/v1/answer/{user}",
        action="send",
        qos=1,
        payload=s.answer_schema(ANSWER_REASONS),
        summary="The one answer to each query",
        description="Answers to HTTP queries are never published here.",
    ),
    Channel(
        "status",
        "kcloak/v1/status/{user}",
        action="send",
        qos=1,
        payload=s.STATUS,
        summary="Profile results and session ends",
        description="kind profile after every profile message with a valid topic user; kind session when a "
        "session expired or ended without an answer to carry it.",
    ),
    Channel(
        "brokerStatus",
        "kcloak/v1/broker/status",
        action="send",
        qos=1,
        retain=True,
        payload=s.BROKER_STATUS,
        summary="Whether kcloak is up (retained; also the last will)",
        description="Readable by every user. Read it to know kcloak is running before sending.",
    ),
    Channel(
        "publishedTrajectories",
        "kcloak/v1/published/trajectories",
        action="send",
        qos=1,
        payload=s.WINDOW_PART,
        summary="Published anonymized trajectory windows, in parts",
        description="Readable only by users in auth.published_readers. The same windows are served over HTTP "
        "at /v1/published/windows.",
    ),
)


def broker_asyncapi() -> dict[str, Any]:
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for ch in CHANNELS:
        message = {
            "name": ch.name,
            "title": ch.payload.get("title", ch.name),
            "summary": ch.summary,
            "contentType": "application/json",
            "payload": {"schemaFormat": _SCHEMA_FORMAT, "schema": ch.payload},
        }
        messages[ch.name] = message
        channel: dict[str, Any] = {
            "address": ch.address,
            "title": ch.name,
            "summary": ch.summary,
            "description": ch.description,
            "messages": {ch.name: {"$ref": f"#/components/messages/{ch.name}"}},
        }
        if "{user}" in ch.address:
            channel["parameters"] = {"user": {"$ref": "#/components/parameters/user"}}
        channels[ch.name] = channel
        verb = "publish" if ch.action == "receive" else "receive"
        operations[ch.name] = {
            "action": ch.action,
            "channel": {"$ref": f"#/channels/{ch.name}"},
            "summary": f"kcloak {'receives' if ch.action == 'receive' else 'sends'}; clients {verb}",
            "messages": [{"$ref": f"#/channels/{ch.name}/messages/{ch.name}"}],
            "bindings": {"mqtt": {"qos": ch.qos, "retain": ch.retain, "bindingVersion": "0.2.0"}},
        }
    document: dict[str, Any] = {
        "asyncapi": "3.0.0",
        "info": {
            "title": "kcloak MQTT interface",
            "version": __version__,
            "description": "MQTT 3.1.1. With tokens, the MQTT username is the user id and the password the token; "
            "each user may write only its own update, updates, profile and query topics and read its own "
            "answer and status topics and kcloak/v1/broker/status. Messages published with the retain flag on "
            "an input topic are dropped. Bad messages are dropped and counted, never answered, except queries "
            "with a valid topic user and query_id (answered) and profile messages (a status). Reason codes: "
            "docs/interface.md.",
        },
        "defaultContentType": "application/json",
        "servers": {
            "embedded": {
                "host": "127.0.0.1:1883",
                "protocol": "mqtt",
                "protocolVersion": "3.1.1",
                "description": "kcloak serve's own MQTT server (--mqtt embedded, --mqtt-listen)",
                "security": [{"$ref": "#/components/securitySchemes/tokens"}],
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "messages": messages,
            "parameters": {"user": _USER_PARAMETER},
            "securitySchemes": {
                "tokens": {
                    "type": "userPassword",
                    "description": "username = user id, password = its token (only when tokens are configured)",
                }
            },
        },
    }
    # a copy: the payload schemas are shared with the validators, and a caller may change its document
    return copy.deepcopy(document)

"""The cluster's JetStream layout: subjects, streams, key-value buckets and consumers (docs/cluster.md).

Everything a gateway, a worker and an operator must agree on lives here, so they cannot drift:

- ``kcloak.in.<p>.<kind>.<token>`` — stream ``KCLOAK_IN`` (work queue, replicated): what apps sent,
  validated by a gateway, partitioned **by user** (``p = partition_of(token, P)``, the FNV-1a hash NATS's
  own ``partition()`` transform uses) so one pinned consumer per partition sees a user's messages in
  order. ``kind`` is ``update``, ``updates``, ``profile`` or ``query``. Message id: the gateway's, so a
  retried publish is stored once.
- ``kcloak.cell.<c>.<p>.<token>`` — stream ``KCLOAK_CELLS`` (one message per subject): the latest event of
  a user **in cell** ``c`` (a fix, or a ``leave`` once he moved away). Cell ``c``'s owner rebuilds its
  index from the last message of every ``kcloak.cell.<c>.>`` subject; partition ``p``'s router rebuilds
  each user's current cell and latest fix from ``kcloak.cell.*.<p>.>``.
- ``kcloak.cellq.<c>`` — core NATS (queue group ``kcloak``): queries routed to cell ``c``'s owner, requests
  whose intake message the router holds until the owner replies that the answer is stored
  (:mod:`~kcloak.broker.cluster.routed`).
- ``kcloak.ans.<token>.<qkey>`` — stream ``KCLOAK_ANSWERS`` (one message per subject, duplicate window):
  the one answer of a query, message id ``<token>/<qkey>`` so a recomputed answer is dropped; the
  stream republishes each *stored* answer on ``kcloak.out.ans.<token>.<qkey>`` for the gateways.
- ``kcloak.out.status.<token>`` — core NATS: profile and session statuses for the gateways.
- ``kcloak.moves.<p>`` — stream ``KCLOAK_MOVES`` (limits retention, ``max_age`` = a few publication windows):
  every fix a router accepted (``{"u", "t", "lat", "lon"}``), the cluster's movement history from which
  closed windows are published (:mod:`kcloak.broker.cluster.moves`).
- buckets ``kcloak_profiles`` (stored profile per user token), ``kcloak_windows`` (publication ledger) and
  ``kcloak_regions`` (the region forwarded for each query, so a retried query never forwards another).
- ``kcloak.published.<window id>`` — stream ``KCLOAK_PUBLISHED`` (duplicate window): the parts of each
  published window, message id ``<window id>/<content hash>/<part>``; object store
  ``kcloak_window_content`` keeps a window's release between anonymizing and publishing
  (:func:`ensure_publication_layout`, docs/cluster.md "Window publication").

A subject token is a user id or query id with ``.`` written as ``//`` (NATS's MQTT listener does the
same, so both doors give one subject); user ids are ``[A-Za-z0-9._-]`` and query ids
``[A-Za-z0-9._:-]``, all legal in a subject token otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kcloak.broker.config import ConfigError
from kcloak.broker.errors import BrokerError
from kcloak.core.extras import CLUSTER, require

IN_STREAM = "KCLOAK_IN"
CELLS_STREAM = "KCLOAK_CELLS"
ANSWERS_STREAM = "KCLOAK_ANSWERS"
MOVES_STREAM = "KCLOAK_MOVES"
PROFILES_BUCKET = "kcloak_profiles"
WINDOWS_BUCKET = "kcloak_windows"
PUBLISHED_STREAM = "KCLOAK_PUBLISHED"
WINDOW_CONTENT_BUCKET = "kcloak_window_content"
REGIONS_BUCKET = "kcloak_regions"
"""The region forwarded for each query (create-only, kept for the duplicate window): a retried query
forwards that region again, never a second one (cell owners, docs/cluster.md "Workers")."""
PRIORITY_GROUP = "kcloak"
KINDS = ("update", "updates", "profile", "query")


def subject_token(ident: str) -> str:
    """A user or query id as one subject token (``.`` → ``//``); ids are validated before this."""
    return ident.replace(".", "//")


def ident_of(token: str) -> str:
    """The id a :func:`subject_token` came from."""
    return token.replace("//", ".")


def fnv1a_32(data: bytes) -> int:
    """32-bit FNV-1a, the hash of NATS's ``partition(n, ...)`` subject transform."""
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def partition_of(token: str, partitions: int) -> int:
    """The intake partition of a user's subject token (equal to NATS's ``{{partition(P,…)}}`` on it)."""
    return fnv1a_32(token.encode()) % partitions


def in_subject(partition: int, kind: str, token: str) -> str:
    return f"kcloak.in.{partition}.{kind}.{token}"


def in_filter(partition: int) -> str:
    return f"kcloak.in.{partition}.>"


def cell_subject(cell: int, partition: int, token: str) -> str:
    return f"kcloak.cell.{cell}.{partition}.{token}"


def cell_filter(cell: int) -> str:
    return f"kcloak.cell.{cell}.>"


def partition_cells_filter(partition: int) -> str:
    return f"kcloak.cell.*.{partition}.>"


def cellq_subject(cell: int) -> str:
    return f"kcloak.cellq.{cell}"


def answer_subject(token: str, qkey: str) -> str:
    return f"kcloak.ans.{token}.{qkey}"


def answer_msg_id(token: str, qkey: str) -> str:
    return f"{token}/{qkey}"


def answer_out_subject(token: str, qkey: str = "*") -> str:
    """Where the answers stream republishes a stored answer (``qkey="*"``: a gateway's filter for a user)."""
    return f"kcloak.out.ans.{token}.{qkey}"


def moves_subject(partition: int) -> str:
    """Where partition ``p``'s router stores each accepted fix (stream ``KCLOAK_MOVES``)."""
    return f"kcloak.moves.{partition}"


def moves_filter() -> str:
    return "kcloak.moves.*"


def owner_applied_subject(cell: int) -> str:
    """Core NATS: cell ``c``'s live owner answers a request here with ``{"applied": <stream seq>}``, the last
    ``KCLOAK_CELLS`` sequence its index holds (a router waits on it before moving a user out of the cell)."""
    return f"kcloak.owner.applied.{cell}"


def status_out_subject(token: str) -> str:
    return f"kcloak.out.status.{token}"


def published_subject(window_id: str = "*") -> str:
    """Where the parts of a published window are stored (``window_id="*"``: every window)."""
    return f"kcloak.published.{window_id}"


def split_subject(subject: str, prefix: str, parts: int) -> list[str]:
    """The ``parts`` tokens after ``prefix.`` of a subject; raises ValueError when it does not fit."""
    if not subject.startswith(prefix + "."):
        raise ValueError("subject outside the expected prefix")
    tokens = subject[len(prefix) + 1 :].split(".")
    if len(tokens) != parts:
        raise ValueError("subject with an unexpected number of tokens")
    return tokens


@dataclass(frozen=True, slots=True)
class Layout:
    """The numbers every process of one cluster must share (``kcloak serve --cluster`` options)."""

    partitions: int = 16
    cells: int = 1
    replicas: int = 3
    dedup_window_s: float = 600.0
    position_ttl_s: float = 3600.0
    pinned_timeout_s: float = 5.0
    moves_max_age_s: float = 4 * (900.0 + 120.0)
    """``KCLOAK_MOVES``'s ``max_age``: a few publication windows (``moves.moves_max_age_s`` of the serve
    config's ``publish.window_s`` and ``cloaking.max_update_age_s``; the default is that of the defaults)."""

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= 4096:
            raise ConfigError("cluster.partitions must be within 1..4096")
        if not 1 <= self.cells <= 65536:
            raise ConfigError("cluster.cells must be within 1..65536")
        if self.replicas not in (1, 3, 5):
            raise ConfigError("cluster.replicas must be 1, 3 or 5")
        for name in ("dedup_window_s", "position_ttl_s", "pinned_timeout_s", "moves_max_age_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cluster.{name} must be > 0")

    @property
    def lease_s(self) -> float:
        """How long a pinned member may go without an answered pull before it gives up its pin and its
        state: half the consumer's ``priority_timeout``, so it has let go before a successor can be pinned."""
        return self.pinned_timeout_s / 2

    @property
    def pull_expires_s(self) -> float:
        """A pull's expiry: short enough that a live member answers well within its lease."""
        return min(1.0, self.pinned_timeout_s / 4)

    def stream_configs(self) -> list[dict[str, Any]]:
        """The four streams as JetStream API configs (durations in nanoseconds)."""
        ns = 1_000_000_000
        base = {"storage": "file", "num_replicas": self.replicas, "discard": "old"}
        return [
            {
                **base,
                "name": IN_STREAM,
                "subjects": ["kcloak.in.>"],
                "retention": "workqueue",
                "duplicate_window": int(self.dedup_window_s * ns),
                "max_age": int(self.dedup_window_s * 6 * ns),
            },
            {
                **base,
                "name": CELLS_STREAM,
                "subjects": ["kcloak.cell.>"],
                "retention": "limits",
                "max_msgs_per_subject": 1,
                "max_age": int(self.position_ttl_s * ns),
                "duplicate_window": int(min(self.dedup_window_s, self.position_ttl_s) * ns),
            },
            {
                **base,
                "name": ANSWERS_STREAM,
                "subjects": ["kcloak.ans.*.*"],
                "retention": "limits",
                "max_msgs_per_subject": 1,
                "duplicate_window": int(self.dedup_window_s * ns),
                "max_age": int(self.dedup_window_s * ns),
                "allow_direct": True,
                "republish": {"src": "kcloak.ans.*.*", "dest": "kcloak.out.ans.{{wildcard(1)}}.{{wildcard(2)}}"},
            },
            {
                **base,
                "name": MOVES_STREAM,
                "subjects": [moves_filter()],
                "retention": "limits",
                "max_age": int(self.moves_max_age_s * ns),
                "duplicate_window": int(min(self.dedup_window_s, self.moves_max_age_s) * ns),
            },
        ]

    def published_stream_config(self) -> dict[str, Any]:
        """The stream of published windows (kept until an operator's limits remove them)."""
        return {
            "storage": "file",
            "num_replicas": self.replicas,
            "discard": "old",
            "name": PUBLISHED_STREAM,
            "subjects": [published_subject()],
            "retention": "limits",
            "duplicate_window": int(self.dedup_window_s * 1_000_000_000),
            "allow_direct": True,
        }

    def pinned_consumer_config(self, name: str, filter_subject: str, *, ack_policy: str = "explicit") -> dict[str, Any]:
        """A durable pull consumer whose messages go to one pinned client of group ``kcloak`` at a time
        (``ack_policy``: ``explicit``, each message acknowledged, or ``all``, an ack covers every earlier one)."""
        ns = 1_000_000_000
        return {
            "durable_name": name,
            "name": name,
            "filter_subject": filter_subject,
            "ack_policy": ack_policy,
            "deliver_policy": "all",
            "ack_wait": int(max(30.0, 6 * self.pinned_timeout_s) * ns),
            "max_ack_pending": 10_000,
            "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "pinned_client",
            "priority_timeout": int(self.pinned_timeout_s * ns),
            "num_replicas": self.replicas,
        }

    def consumers(self) -> list[tuple[str, dict[str, Any]]]:
        """Every pinned consumer: ``(stream, config)`` for each intake partition and each cell. A cell's consumer
        acknowledges with ``all``: its owner applies each micro-batch in stream order and acknowledges only the
        batch's highest sequence (one ack, and one replicated ack-floor update, per batch instead of per event)."""
        out: list[tuple[str, dict[str, Any]]] = []
        for p in range(self.partitions):
            out.append((IN_STREAM, self.pinned_consumer_config(f"in-{p}", in_filter(p))))
        for c in range(self.cells):
            out.append((CELLS_STREAM, self.pinned_consumer_config(f"cell-{c}", cell_filter(c), ack_policy="all")))
        return out


class JetStreamApiError(BrokerError, RuntimeError):
    """A JetStream API call answered with an error (the server's code and description, never payloads)."""


async def api_request(nc: Any, subject: str, body: dict[str, Any] | None, *, timeout: float = 5.0) -> dict[str, Any]:
    """One ``$JS.API`` request on a connected ``nats.aio.client.Client``; raises :class:`JetStreamApiError`."""
    payload = b"" if body is None else json.dumps(body).encode()
    reply = await nc.request(f"$JS.API.{subject}", payload, timeout=timeout)
    data: dict[str, Any] = json.loads(reply.data)
    error = data.get("error")
    if error:
        raise JetStreamApiError(
            f"{subject.split('.')[0].lower()} failed: {error.get('code')} {error.get('description')}"
        )
    return data


async def _create_consumer(nc: Any, stream: str, config: dict[str, Any], timeout: float) -> None:
    await api_request(
        nc,
        f"CONSUMER.CREATE.{stream}.{config['name']}",
        {"stream_name": stream, "config": config, "action": ""},
        timeout=timeout,
    )


async def ensure_layout(nc: Any, layout: Layout, *, timeout: float = 10.0) -> None:
    """Create (or update to this layout) every stream, bucket and pinned consumer; safe to run from every process.

    Consumers with priority groups are created through the JetStream API directly: nats-py 2.16 has no
    ``priority_groups`` in its consumer configuration.
    """
    for config in layout.stream_configs():
        name = config["name"]
        try:
            await api_request(nc, f"STREAM.CREATE.{name}", config, timeout=timeout)
        except JetStreamApiError as exc:
            if "already in use" not in str(exc) and "10058" not in str(exc):
                raise
            await api_request(nc, f"STREAM.UPDATE.{name}", config, timeout=timeout)
    for stream, config in layout.consumers():
        try:
            await _create_consumer(nc, stream, config, timeout)
        except JetStreamApiError:
            if config["ack_policy"] == "explicit":
                raise
            # A consumer created by an earlier version acknowledges each message, and NATS cannot change a
            # consumer's ack policy: it keeps it (its owner reads the policy on pin and acknowledges to match).
            await _create_consumer(nc, stream, {**config, "ack_policy": "explicit"}, timeout)
    js = nc.jetstream(timeout=timeout)
    for bucket in (PROFILES_BUCKET, WINDOWS_BUCKET):
        await js.create_key_value(bucket=bucket, replicas=layout.replicas, history=1)
    await js.create_key_value(bucket=REGIONS_BUCKET, replicas=layout.replicas, history=1, ttl=layout.dedup_window_s)


async def ensure_publication_layout(nc: Any, layout: Layout, *, timeout: float = 10.0) -> None:
    """Create (or update) what window publication needs: the ledger bucket, the content store and the stream."""
    config = layout.published_stream_config()
    try:
        await api_request(nc, f"STREAM.CREATE.{PUBLISHED_STREAM}", config, timeout=timeout)
    except JetStreamApiError as exc:
        if "already in use" not in str(exc) and "10058" not in str(exc):
            raise
        await api_request(nc, f"STREAM.UPDATE.{PUBLISHED_STREAM}", config, timeout=timeout)
    js = nc.jetstream(timeout=timeout)
    await js.create_key_value(bucket=WINDOWS_BUCKET, replicas=layout.replicas, history=1)
    await js.create_object_store(WINDOW_CONTENT_BUCKET, replicas=layout.replicas)


class NatsUnreachable(BrokerError, RuntimeError):
    """No NATS server of the list answered (the message names the error type, never credentials)."""


async def _quiet_error(exc: Exception) -> None:
    """nats-py's default error callback prints a traceback for every failed connection attempt."""


def require_nats() -> ModuleType:
    """nats-py, or :class:`~kcloak.core.extras.MissingExtra` naming the ``cluster`` extra."""
    return require("nats", extra=CLUSTER, purpose="NATS connections (cluster mode)")


async def connect_nats(servers: list[str], *, timeout: float = 3.0, reconnect: bool = True) -> Any:
    """A connected ``nats.aio.client.Client`` or :class:`NatsUnreachable` (no traceback on stderr)."""
    nats = require_nats()

    try:
        return await nats.connect(
            servers=servers,
            connect_timeout=timeout,
            allow_reconnect=reconnect,
            max_reconnect_attempts=10 if reconnect else 1,  # per server; 0 or less would retry forever
            reconnect_time_wait=0.5,
            error_cb=_quiet_error,
        )
    except Exception as exc:  # nats-py's errors have no common root with OSError
        raise NatsUnreachable(f"cannot reach NATS at any of {len(servers)} server(s) ({type(exc).__name__})") from None

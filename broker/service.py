"""The ``Broker``: one async context manager that owns every component and one TaskGroup.

Entering opens, in order, the data directory (locked), the stores, the upstream client, the
pipeline and its workers, the HTTP server and the MQTT session; leaving tears them down in
reverse order. :meth:`Broker.shutdown` is the graceful stop of contract §9: stop intake, let
in-flight upstream calls finish within ``server.shutdown_grace_s``, answer everything else
``shutdown``, flush the stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from kcloak import __version__
from kcloak.broker.auth import TokenStore
from kcloak.broker.config import Config, parse_listen
from kcloak.broker.errors import BrokerError
from kcloak.broker.memory import run_memdiag, run_trim, tune_allocator
from kcloak.broker.metrics import Metrics
from kcloak.broker.pipeline import Pipeline
from kcloak.broker.stats import StatsLine
from kcloak.broker.stores import DataDir, MovementStore, ProfileStore, QueryLog, StoreError, WriteHealth
from kcloak.broker.upstream import Upstream, UpstreamClient
from kcloak.broker.upstream_processes import UpstreamProcesses
from kcloak.core.logs import log_event
from kcloak.core.places import PlacesLayer, load_pois
from kcloak.core.schemas import MOVEMENT_FILE, PROFILES_FILE, QUERYLOG_FILE

if TYPE_CHECKING:
    from kcloak.broker.publication import WindowPublisher

log = logging.getLogger("kcloak.broker")


class StartupError(BrokerError, RuntimeError):
    """The broker could not start (port in use, data directory locked, MQTT unreachable)."""


class Service:
    """What one ``kcloak serve`` process is, alone (:class:`Broker`) or as a cluster node
    (:class:`~kcloak.broker.cluster.gateway.ClusterGateway`): an async context manager that starts its parts
    in :meth:`_start` on an exit stack, its HTTP and MQTT doors in front of a pipeline, and the graceful stop
    of contract §9 (:meth:`shutdown`: no new intake, drain what is pending within
    ``server.shutdown_grace_s``, then :meth:`wait_stopped` returns)."""

    STOPPED_EVENT = "service_stopped"
    pipeline: Any
    """Set by :meth:`_start`: what the doors call, with ``closing``, ``begin_shutdown()`` and ``drain(s)``."""

    def __init__(self, *, config: Config, tokens: TokenStore | None) -> None:
        self.config = config
        self.tokens = tokens
        self.metrics = Metrics(version=__version__, algorithm=config.cloaking.algorithm)
        self.state: dict[str, Any] = {"started": time.monotonic(), "mqtt": "none"}
        self.pipeline = None
        self.http_port: int | None = None
        self.mqtt_port: int | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()

    async def __aenter__(self) -> Self:
        tune_allocator()
        try:
            await self._start()
        except BaseException:
            # The exit stack closes a TaskGroup without an exception, which waits for its tasks:
            # cancel them first, or a startup failure (e.g. MQTT port in use) would hang forever.
            await self._cancel_tasks()
            await self._stack.aclose()
            raise
        self._tasks.append(asyncio.create_task(run_trim(), name="trim"))
        self._tasks.append(asyncio.create_task(run_memdiag(), name="memdiag"))
        if self.config.log.stats_interval_s > 0:  # cancelled with the other tasks when the service stops
            stats = StatsLine(registry=self.metrics.registry, interval_s=self.config.log.stats_interval_s)
            self._tasks.append(asyncio.create_task(stats.run(), name="stats"))
        return self

    async def _start(self) -> None:
        raise NotImplementedError

    async def _listen_http(self, app: Any) -> None:
        """Serve ``app`` (from :func:`~kcloak.broker.http_server.build_app`) on ``http.listen``."""
        from kcloak.broker.http_server import HttpServer

        host, port = parse_listen(self.config.http.listen)
        server = HttpServer(
            app,
            host=host,
            port=port,
            head_timeout_s=self.config.http.head_timeout_s,
            metrics=self.metrics,
            access_log=self.config.log.access,
            fast_fixes=self.config.http.fast_fixes,
        )
        try:
            await self._stack.enter_async_context(server)
        except OSError as exc:
            raise StartupError(f"HTTP: cannot listen on {host}:{port} ({exc.strerror})") from None
        self.http_port = server.port

    async def _listen_mqtt(self, door: Any) -> None:
        """Run ``door``'s embedded MQTT server on ``mqtt.listen`` (port in use → :class:`StartupError` at once)."""
        host, port = parse_listen(self.config.mqtt.listen)
        server = door.embedded_server(host=host, port=port, tokens=self.tokens)
        try:
            await self._stack.enter_async_context(server)
        except OSError as exc:
            raise StartupError(f"MQTT: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        self.mqtt_port = server.port

    async def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)

    async def shutdown(self) -> None:
        """Graceful stop: no new intake, finish or refuse what is pending, then exit."""
        if self.pipeline is None or self.pipeline.closing:
            return
        log_event(log, "shutdown_started")
        self.pipeline.begin_shutdown()
        await self.pipeline.drain(self.config.server.shutdown_grace_s)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.pipeline is not None and not self.pipeline.closing:
            await self.shutdown()
        await self._stack.aclose()
        log_event(log, self.STOPPED_EVENT)


class Broker(Service):
    """The trusted anonymizer service.

    Keyword arguments: ``config`` (the effective :class:`Config`), ``tokens`` (a
    :class:`TokenStore`, or None for open mode; the embedded MQTT server authenticates with it too).
    """

    STOPPED_EVENT = "broker_stopped"
    pipeline: Pipeline | None

    def __init__(self, *, config: Config, tokens: TokenStore | None = None) -> None:
        super().__init__(config=config, tokens=tokens)
        self.mqtt: Any = None
        self._tg: asyncio.TaskGroup | None = None
        self.publication: WindowPublisher | None = None

    async def _start(self) -> None:
        cfg = self.config
        data = DataDir(cfg.storage.data_dir)
        try:
            self._stack.enter_context(data)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        health = {name: WriteHealth(name, self.metrics.store_write) for name in ("movement", "profiles", "querylog")}
        self.state["stores"] = list(health.values())  # /healthz: degraded while a store cannot write
        store_hist = self.metrics.store_commit
        try:  # a file that cannot be opened (e.g. of another schema version) is a startup failure
            profiles = ProfileStore(data.file(PROFILES_FILE.filename), health=health["profiles"])
            self._stack.callback(profiles.close)
            movement = MovementStore(
                data.file(MOVEMENT_FILE.filename),
                capacity=cfg.queues.store,
                on_commit=store_hist.labels(store="movement").observe,
                health=health["movement"],
            )
            self._stack.push_async_callback(asyncio.to_thread, movement.close)
            querylog = QueryLog(
                data.file(QUERYLOG_FILE.filename),
                on_commit=store_hist.labels(store="querylog").observe,
                health=health["querylog"],
            )
            self._stack.push_async_callback(asyncio.to_thread, querylog.close)
        except StoreError as exc:
            raise StartupError(str(exc)) from None
        upstream: Upstream
        if cfg.upstream.processes:
            upstream = await self._stack.enter_async_context(
                UpstreamProcesses.from_config(cfg.upstream, metrics=self.metrics)
            )
        else:
            client = UpstreamClient.from_config(cfg.upstream, metrics=self.metrics)
            upstream = await self._stack.enter_async_context(client)
        places = None
        if cfg.cloaking.algorithm == "privacygrid":
            places = PlacesLayer.from_pois(load_pois(cfg.cloaking.places or None))
        self.pipeline = Pipeline(
            config=cfg,
            metrics=self.metrics,
            profiles=profiles,
            movement=movement,
            querylog=querylog,
            upstream=upstream,
            places=places,
        )
        restored = self.pipeline.restore_positions()
        self._tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._tasks.append(self._tg.create_task(self.pipeline.run_cloaking(), name="cloaking"))
        self._tasks.append(self._tg.create_task(self.pipeline.run_housekeeping(), name="housekeeping"))
        self._tasks.append(self._tg.create_task(self.pipeline.run_sessions(), name="sessions"))
        if cfg.mqtt.mode != "none":
            await self._start_mqtt()
        self._start_publication(data.path, movement)
        self._stack.push_async_callback(self._cancel_tasks)
        if cfg.http.listen != "none":
            await self._start_http()
        log_event(
            log,
            "broker_started",
            algorithm=cfg.cloaking.algorithm,
            auth="tokens" if self.tokens else "open",
            http=cfg.http.listen,
            mqtt=cfg.mqtt.mode if cfg.mqtt.mode in ("embedded", "none") else "external",
            restored_positions=restored,
        )

    async def _start_http(self) -> None:
        from kcloak.broker.http_server import build_app

        assert self.pipeline is not None
        app = build_app(self.pipeline, self.config, self.tokens, self.state)
        if self.publication is not None:
            from kcloak.broker.http_server import PUBLICATION

            app[PUBLICATION] = self.publication
        await self._listen_http(app)

    def _start_publication(self, data_dir: Path, movement: MovementStore) -> None:
        """Live trajectory windows (contract §7); the HTTP routes read them even when publication is off."""
        from kcloak.broker.publication import PublicationError, WindowPublisher

        assert self.pipeline is not None and self._tg is not None
        try:
            publication = WindowPublisher(
                config=self.config,
                movement=movement,
                directory=data_dir / "published" / "trajectories",
                metrics=self.metrics,
                send=self.mqtt.publish_confirmed if self.mqtt is not None else None,
                clock=self.pipeline.clock,
            )
        except PublicationError as exc:
            raise StartupError(str(exc)) from None
        self._stack.push_async_callback(asyncio.to_thread, publication.close)
        self.publication = publication
        if publication.enabled:
            self.pipeline.retention_floor = publication.retention_floor
            self._tasks.append(self._tg.create_task(publication.run(), name="publication"))

    async def _start_mqtt(self) -> None:
        """The MQTT door: embedded, kcloak's own MQTT server in this process (port in use →
        :class:`StartupError` at once); external, client connections to ``mqtt://…``."""
        from kcloak.broker.mqtt import MqttDoor, external_target

        assert self.pipeline is not None and self._tg is not None
        cfg = self.config
        if cfg.mqtt.mode == "embedded":
            door = MqttDoor(pipeline=self.pipeline, config=cfg, tokens_mode=self.tokens is not None, state=self.state)
            await self._listen_mqtt(door)
            where = f"{parse_listen(cfg.mqtt.listen)[0]}:{self.mqtt_port}"
        else:
            host, port, username = external_target(cfg)
            password = None
            if cfg.mqtt.password_file:
                password = Path(cfg.mqtt.password_file).read_text(encoding="utf-8").strip()
            door = MqttDoor(
                pipeline=self.pipeline,
                config=cfg,
                tokens_mode=self.tokens is not None,
                state=self.state,
                host=host,
                port=port,
                username=username,
                password=password,
            )
            self.mqtt_port = port
            where = f"{host}:{port}"
        self.mqtt = door

        async def publish_session_status(user: str, body: dict[str, Any]) -> None:
            await door.publish(f"kcloak/v1/status/{user}", body)

        self.pipeline.session_status = publish_session_status
        self._tasks.append(self._tg.create_task(door.run(), name="mqtt"))
        try:
            await door.wait_connected(10.0)
        except TimeoutError:
            raise StartupError(f"MQTT: broker at {where} unreachable for 10 s") from None

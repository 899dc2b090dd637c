"""Service configuration: shipped defaults < TOML file < flags (contract §9 "kcloak serve").

Each TOML section is a frozen dataclass whose fields carry their default and the comment that
``--print-config`` writes back, so the printed defaults are exactly the contract's block.
Unknown sections or keys, wrong types and inconsistent values raise :class:`ConfigError`
(the CLI turns it into exit code 2).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kcloak.broker.errors import BrokerError
from kcloak.core import names
from kcloak.core.errors import InputError
from kcloak.core.profile import PrivacyProfile, ProfileError
from kcloak.wire.http_client import Origin

ALGORITHMS = names.BROKER_ALGORITHMS
PUBLISH_METHODS = names.values(names.KDeltaMethod)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("json", "text")
_COMMENT_COLUMN = 32


class ConfigError(BrokerError, InputError, ValueError):
    """A configuration that cannot be used; the message names the key and the rule."""


def _c(default: Any, comment: str = "") -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"comment": comment})
    return field(default=default, metadata={"comment": comment})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    shutdown_grace_s: float = _c(5.0)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    listen: str = _c("127.0.0.1:8470")
    # Extensions (docs/contract-extensions.md): a connection that has not sent a complete request
    # head within head_timeout_s (idle keep-alive included) is closed; so is one whose body has not
    # arrived within body_timeout_s.
    head_timeout_s: float = _c(10.0, "extension: close without a complete request head")
    body_timeout_s: float = _c(30.0, "extension: close without a complete body")
    fast_fixes: bool = _c(True, "extension: single fixes without aiohttp's request objects")


@dataclass(frozen=True, slots=True)
class MqttConfig:
    mode: str = _c("embedded")
    listen: str = _c("127.0.0.1:1883")
    username: str = _c("_kcloak", "service account used with mqtt://")
    password_file: str = _c("")
    ingest_connections: int = _c(1)
    connect_timeout_s: float = _c(10.0, "extension: embedded server, time to a complete CONNECT")


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    url: str = _c("http://127.0.0.1:8471")
    timeout_s: float = _c(2.0)
    retries: int = _c(2)
    deadline_s: float = _c(5.0)
    concurrency: int = _c(64)
    processes: int = _c(1, "extension: child processes making the requests, 0 = the event loop's own")
    token_file: str = _c("")


@dataclass(frozen=True, slots=True)
class CloakingConfig:
    algorithm: str = _c("hilbert")
    places: str = _c("", '"" = bundled Beijing POIs')
    stale_after_s: float = _c(60.0)
    max_update_age_s: float = _c(120.0)
    max_clock_skew_s: float = _c(5.0)
    temporal_lookback_s: float = _c(300.0)


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    k: int = _c(5)
    l: int = _c(1)  # noqa: E741 - the contract's name
    min_area_m2: float = _c(10000.0, "not 0: co-located users, see README")
    max_area_m2: float = _c(4000000.0)
    max_delay_s: float = _c(30.0)

    def to_profile(self) -> PrivacyProfile:
        return PrivacyProfile(self.k, self.l, self.min_area_m2, self.max_area_m2, self.max_delay_s)


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    idle_s: float = _c(120.0)
    max_s: float = _c(3600.0)
    per_user: int = _c(4)


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    body_bytes: int = _c(65536)
    batch_bytes: int = _c(1048576)
    batch_items: int = _c(10000)
    update_rate: float = _c(20.0, "fixes/s per user, token bucket")
    update_burst: int = _c(200)
    query_rate: float = _c(5.0, "queries/s per user")
    query_burst: int = _c(20)
    profile_rate: float = _c(1.0)
    profile_burst: int = _c(5)
    pending_queries_per_user: int = _c(16)
    dedup_window_s: float = _c(600.0)


@dataclass(frozen=True, slots=True)
class QueuesConfig:
    ingest: int = _c(100000)
    cloak: int = _c(10000)
    hold: int = _c(10000)
    upstream: int = _c(10000)
    store: int = _c(200000)


@dataclass(frozen=True, slots=True)
class StorageConfig:
    data_dir: str = _c("./kcloak-data")
    retention_s: float = _c(86400.0, "must be ≥ publish.window_s + max_update_age_s")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    tokens: str = _c("")
    published_readers: list[str] = field(default_factory=list, metadata={"comment": ""})
    map_viewers: list[str] = field(
        default_factory=list, metadata={"comment": "extension: token users who may read the live map's data"}
    )


@dataclass(frozen=True, slots=True)
class MapConfig:
    """The live map (``GET /map``, docs/contract-extensions.md): aggregates only."""

    min_k: int = _c(10, "density cells with fewer users are hidden (≥ profile.k)")
    cell_deg: float = _c(0.01, "density grid cell side, degrees")
    region_age_s: float = _c(15.0, "cloaked regions shown this long")
    streets: str = _c("", "GeoJSON LineStrings drawn under the map")


@dataclass(frozen=True, slots=True)
class PublishConfig:
    window_s: int = _c(900)
    k: int = _c(5)
    delta_m: float = _c(500.0)
    method: str = _c("nwa")
    trash_max: float = _c(0.1)
    min_points: int = _c(2)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = _c("info")
    format: str = _c("json")
    # Extensions (docs/configuration.md "Logs and metrics"): one JSON line per HTTP request (route
    # pattern, status, duration, bytes: never a path, query string, id or token), and a counts-only
    # stats line every stats_interval_s (0 turns it off).
    access: bool = _c(False, "extension: one line per HTTP request")
    stats_interval_s: float = _c(60.0, "extension: counts-only stats line; 0 = off")


@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration of ``kcloak serve``."""

    server: ServerConfig = field(default_factory=ServerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    cloaking: CloakingConfig = field(default_factory=CloakingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    queues: QueuesConfig = field(default_factory=QueuesConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    map: MapConfig = field(default_factory=MapConfig)
    log: LogConfig = field(default_factory=LogConfig)

    SECTION_COMMENTS: ClassVar[dict[str, str]] = {
        "profile": "server default profile",
        "queues": "bounded; full → overloaded",
        "map": "extension: the live map, GET /map",
    }

    # -- building --------------------------------------------------------------------------
    @classmethod
    def from_toml_file(cls, path: str | Path) -> Config:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config: cannot read {p}") from exc
        return cls.from_toml_text(text)

    @classmethod
    def from_toml_text(cls, text: str) -> Config:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: not valid TOML ({exc})") from None
        return cls().merged(data)

    def merged(self, data: dict[str, Any]) -> Config:
        """This configuration with the values of a TOML-shaped mapping on top."""
        sections: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            sections[f.name] = getattr(self, f.name)
        for name, values in data.items():
            if name not in sections:
                raise ConfigError(f"config: unknown section [{name}]")
            if not isinstance(values, dict):
                raise ConfigError(f"config: [{name}] must be a table")
            sections[name] = _merge_section(name, sections[name], values)
        cfg = Config(**sections)
        cfg.validate()
        return cfg

    def with_values(self, dotted: dict[str, Any]) -> Config:
        """Override with ``{"section.key": value}`` (flags); ``None`` values are ignored."""
        data: dict[str, dict[str, Any]] = {}
        for key, value in dotted.items():
            if value is None:
                continue
            section, name = key.split(".", 1)
            data.setdefault(section, {})[name] = value
        return self.merged(data)

    # -- checking --------------------------------------------------------------------------
    def validate(self) -> None:
        _listen(self.http.listen, "http.listen", allow_none=True)
        _listen(self.mqtt.listen, "mqtt.listen")
        mode = self.mqtt.mode
        if mode not in ("embedded", "none") and not mode.startswith("mqtt://"):
            raise ConfigError('mqtt.mode: must be "embedded", "none" or mqtt://[USER@]HOST[:PORT]')
        try:
            Origin.parse(self.upstream.url)
        except ValueError:
            raise ConfigError(
                "upstream.url: must be an http:// or https:// URL with a host and no query, fragment or credentials"
            ) from None
        if self.cloaking.algorithm not in ALGORITHMS:
            raise ConfigError(f"cloaking.algorithm: must be one of {', '.join(ALGORITHMS)}")
        if self.publish.method not in PUBLISH_METHODS:
            raise ConfigError(f"publish.method: must be one of {', '.join(PUBLISH_METHODS)}")
        if self.log.level not in LOG_LEVELS:
            raise ConfigError(f"log.level: must be one of {', '.join(LOG_LEVELS)}")
        if self.log.format not in LOG_FORMATS:
            raise ConfigError("log.format: must be json or text")
        try:
            self.profile.to_profile()
        except ProfileError as exc:
            raise ConfigError(f"profile.{exc}") from None
        for section in ("server", "http", "upstream", "cloaking", "sessions", "limits", "queues", "storage", "publish"):
            obj = getattr(self, section)
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    zero_ok = f.name in ("retries", "window_s", "trash_max", "max_clock_skew_s", "processes")
                    if v < 0 or (v == 0 and not zero_ok):
                        raise ConfigError(f"{section}.{f.name}: must be {'≥ 0' if zero_ok else '> 0'}")
        if self.log.stats_interval_s < 0:
            raise ConfigError("log.stats_interval_s: must be ≥ 0 (0 turns the stats line off)")
        if self.upstream.processes > self.upstream.concurrency:
            raise ConfigError("upstream.processes: must be ≤ upstream.concurrency (each process holds a connection)")
        if self.mqtt.ingest_connections < 1:
            raise ConfigError("mqtt.ingest_connections: must be ≥ 1")
        if self.publish.trash_max >= 1:
            raise ConfigError("publish.trash_max: must be < 1")
        if self.publish.k < 2:
            raise ConfigError("publish.k: must be ≥ 2")
        if self.map.min_k < 2:
            raise ConfigError("map.min_k: must be ≥ 2")
        if not 0.001 <= self.map.cell_deg <= 1.0:
            raise ConfigError("map.cell_deg: must be within [0.001, 1]")
        if self.map.region_age_s <= 0:
            raise ConfigError("map.region_age_s: must be > 0")
        if self.storage.retention_s < self.publish.window_s + self.cloaking.max_update_age_s:
            raise ConfigError("storage.retention_s: must be ≥ publish.window_s + cloaking.max_update_age_s")

    # -- printing --------------------------------------------------------------------------
    def to_toml(self) -> str:
        """The configuration as TOML, in the contract's layout (comments included)."""
        lines: list[str] = []
        for sf in dataclasses.fields(self):
            header = f"[{sf.name}]"
            comment = self.SECTION_COMMENTS.get(sf.name)
            lines.append(_with_comment(header, comment))
            obj = getattr(self, sf.name)
            for f in dataclasses.fields(obj):
                lines.append(_with_comment(f"{f.name} = {_toml_value(getattr(obj, f.name))}", f.metadata["comment"]))
        return "\n".join(lines) + "\n"


def _merge_section(name: str, current: Any, values: dict[str, Any]) -> Any:
    known = {f.name: f for f in dataclasses.fields(current)}
    updates: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"config: unknown key {name}.{key}")
        default = getattr(type(current)(), key)
        updates[key] = _coerce(f"{name}.{key}", default, value)
    return dataclasses.replace(current, **updates)


def _coerce(key: str, default: Any, value: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: must be true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: must be an integer")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: must be a string")
        return value
    if isinstance(default, list):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: must be a list of strings")
        return list(value)
    raise ConfigError(f"{key}: unsupported value")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def _with_comment(text: str, comment: str | None) -> str:
    if not comment:
        return text
    return f"{text:<{_COMMENT_COLUMN}}# {comment}"


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 hosts in brackets) → (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not (0 <= int(port) <= 65535):
        raise ConfigError(f"listen address: expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _listen(value: str, key: str, *, allow_none: bool = False) -> None:
    if allow_none and value == "none":
        return
    try:
        parse_listen(value)
    except ConfigError:
        raise ConfigError(f"{key}: must be HOST:PORT{' or none' if allow_none else ''}") from None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: the only addresses open mode may listen on."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

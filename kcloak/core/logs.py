"""Structured logs (contract §10): JSON lines on stderr with enumerated fields only.

``log_event(logger, "query_answered", status="ok", algorithm="hilbert")`` writes
``{"t": …, "level": "info", "event": "query_answered", "status": "ok", …}``. Field values must
be codes, counts, durations or configuration values: never a user id, query id, coordinate,
token or payload. Records of third-party loggers (aiohttp access, aiomqtt) keep only their
level, logger name and an event name; their free text, which can hold client ids and
addresses, is dropped.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_OWN_PREFIXES = ("kcloak",)
_EXTRA = "kcloak_fields"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"t": round(record.created, 3), "level": record.levelname.lower()}
        fields = getattr(record, _EXTRA, None)
        if record.name.startswith(_OWN_PREFIXES) and fields is not None:
            out["event"] = record.getMessage()
            out.update(fields)
        else:
            out["event"] = "library_log"
            out["logger"] = record.name
        if record.exc_info and record.exc_info[0] is not None:
            out["error"] = record.exc_info[0].__name__
            out["stack"] = self.formatException(record.exc_info).splitlines()[-12:]
        return json.dumps(out, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, _EXTRA, None)
        if record.name.startswith(_OWN_PREFIXES) and fields is not None:
            tail = " ".join(f"{k}={v}" for k, v in fields.items())
            return f"{ts} {record.levelname.lower():7} {record.getMessage()} {tail}".rstrip()
        return f"{ts} {record.levelname.lower():7} library_log logger={record.name}"


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Route every logger to stderr through the privacy-preserving formatter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Neither formatter writes the caller, thread or process of a record: not collecting them
    # (the logging HOWTO's "Optimization") takes a quarter off a line's cost (one per HTTP
    # request with log.access).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # Chatty libraries: their messages carry client ids and addresses; keep warnings only.
    for name in ("aiohttp.access", "aiomqtt"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event (``fields`` must hold no identifying value)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={_EXTRA: fields})

"""Structured logs: one JSON object per line on stderr, so that a log shipper (or ``jq``) can read every field.

Each call is one ``call`` line with the method, model, status code, duration and size; start-up, shutdown and
internal errors (with their traceback) have their own lines. Fields go in through ``extra={"fields": {...}}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

LOGGER = "lmserve"
REPLICA_ENV = "LMSERVE_REPLICA"


class JsonFormatter(logging.Formatter):
    """A process started by ``lm-serve serve --replicas`` (``server.replicas``) tags every line with its index."""

    def __init__(self):
        super().__init__()
        replica = os.environ.get(REPLICA_ENV)
        self.tags = {} if replica is None else {"replica": int(replica)}
        # one encoder for every line: json.dumps with options builds a new one each call (a line per call served)
        self.encode = json.JSONEncoder(ensure_ascii=False, default=str).encode

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self.tags,
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self.encode(entry)


def quiet_onnxruntime() -> None:
    """ONNX Runtime's own log lines (coloured, not JSON) down to its errors; before the first session is made. Its
    telemetry warning comes at import, earlier: ``lmserve.server`` turns that telemetry off (``__init__.py``)."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)


def setup_logging(level: str = "info", stream=None) -> logging.Logger:
    """JSON lines on ``stream`` (stderr) for the ``lmserve`` logger; idempotent."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level.upper())
    logger.propagate = False
    if not logger.handlers:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
    return logger

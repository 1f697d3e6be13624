"""Prometheus metrics and structured (JSON lines) logs of afl-server (docs/operations.md §13).

Metrics live in their own :class:`prometheus_client.CollectorRegistry` per server, so several
servers in one process (tests) never collide; :func:`start_metrics_http` serves it. Log records
are one JSON object per line with ``time``, ``level``, ``logger``, ``event`` and any ``extra``
fields; they never carry statistics or key material.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, start_http_server

from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "STAGE_NAMES",
    "JsonLogFormatter",
    "ServerMetrics",
    "configure_logging",
    "start_metrics_http",
]

#: RoundStage names without their prefix, as afl_round_stage reports them.
STAGE_NAMES = [v.name.removeprefix("ROUND_STAGE_") for v in pb.RoundStage.DESCRIPTOR.values]
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class ServerMetrics:
    """Counters and gauges of one coordinator."""

    def set_stage(self, stage: int) -> None:
        """Report the current round's RoundStage by name."""
        self.stage.state(pb.RoundStage.Name(stage).removeprefix("ROUND_STAGE_"))  # type: ignore[arg-type]

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.enrolments = Counter(
            "afl_enrolments_total", "Successful Enroll calls", registry=self.registry
        )
        self.uploads = Counter(
            "afl_uploads_total", "Upload outcomes", ["outcome"], registry=self.registry
        )
        self.upload_bytes = Counter(
            "afl_upload_bytes_total", "Payload bytes stored", registry=self.registry
        )
        self.rounds = Counter(
            "afl_rounds_total", "Rounds that ended", ["outcome"], registry=self.registry
        )
        # One series per stage name, 1 for the current round's stage:
        # afl_round_stage{afl_round_stage="UPLOAD"} 1.0 (docs/operations.md §13).
        self.stage = Enum(
            "afl_round_stage",
            "Stage of the current round",
            states=STAGE_NAMES,
            registry=self.registry,
        )
        self.stage.state("UNSPECIFIED")
        self.rpc_errors = Counter(
            "afl_rpc_errors_total", "RPCs that failed", ["method", "code"], registry=self.registry
        )


def start_metrics_http(metrics: ServerMetrics, *, port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` on ``host:port``; returns what prometheus_client returns."""
    return start_http_server(port, addr=host, registry=metrics.registry)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    """Send afl.* logs to stderr as JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logger = logging.getLogger("afl")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False

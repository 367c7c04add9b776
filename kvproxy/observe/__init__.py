"""What kvproxy tells its operators: every Prometheus metric, defined once (`metrics`), and
JSON-lines logging with the one access line per request (`logs`). Never prompt or
completion text (I8)."""

from kvproxy.observe.logs import (
    ACCESS_LOGGER,
    JsonFormatter,
    emit_access,
    log_event,
    rounded,
    setup_logging,
)
from kvproxy.observe.metrics import IMPLICIT_UPSTREAM, UNKNOWN_MODEL, Metrics
from kvproxy.observe.redact import redact

__all__ = [
    "ACCESS_LOGGER",
    "IMPLICIT_UPSTREAM",
    "UNKNOWN_MODEL",
    "JsonFormatter",
    "Metrics",
    "emit_access",
    "log_event",
    "redact",
    "rounded",
    "setup_logging",
]

"""Logging: JSON lines on stderr, and the one access line per request.

Must never: log prompt or completion text (I8), bearer tokens, or request bodies. The
access log takes an explicit, closed set of fields; nothing free-form from a request is
copied into it except ids the proxy generated or sanitised.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import orjson

from kvproxy.observe.redact import redact

ACCESS_LOGGER = "kvproxy.access"


def rounded(seconds: float, per_second: int) -> float:
    """`seconds` to the nearest 1/`per_second` (1000: ms, 1_000_000: us), as log lines print
    times. Not round(x, digits): rounding to a number of digits goes through a decimal
    conversion, ~3 times the instructions, several times a request."""
    return round(seconds * per_second) / per_second


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": rounded(record.created, 1000),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info and record.levelno >= logging.ERROR:
            out["exc"] = self.formatException(record.exc_info)
        # A URL anywhere in the line (an engine's, a router's, Redis's) shows no password or
        # token: credentials are never printed.
        return redact(orjson.dumps(out, default=str).decode())


# Access lines held for one event-loop iteration at most; past this many they are written
# at once (memory stays bounded whatever the loop does).
PENDING_LINES = 256


class JsonStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The JSON-lines handler `setup_logging` installs; the access log may write to it
    directly (`emit_access`), a loop iteration's lines in one write.

    Why batched: a write() per request is a system call per request and, where stderr is a
    pipe to a log collector, a wake-up of that reader per line; nginx buffers its access
    log for the same reason. A line waits at most until the end of the loop
    iteration that wrote it, and every other record, a flush and a close write the waiting
    lines first, so the stream keeps the order lines were made in."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._pending: list[str] = []

    def write_soon(self, line: str, loop: asyncio.AbstractEventLoop | None) -> None:
        """Write `line` with the others of this loop iteration (now, without a loop)."""
        # Under the handler's lock: a record logged from another thread writes the waiting
        # lines (`emit`), and a line appended while it does so must not be dropped.
        with self.lock:  # type: ignore[union-attr]  # a StreamHandler has one
            pending = self._pending
            pending.append(line)
            if loop is not None and len(pending) < PENDING_LINES:
                if len(pending) == 1:
                    loop.call_soon(self.write_pending)
                return
            self.write_pending()

    def write_pending(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # a StreamHandler has one
            if not self._pending:
                return
            data = "".join(self._pending)
            self._pending.clear()
            try:
                self.stream.write(data)
                self.stream.flush()
            except Exception:
                # What logging does when a stream fails: report on stderr, never raise into
                # the request (or the loop callback) that logged.
                self.handleError(logging.makeLogRecord({"msg": "access log lines"}))

    def emit(self, record: logging.LogRecord) -> None:
        self.write_pending()
        super().emit(record)

    def flush(self) -> None:
        self.write_pending()
        super().flush()


def setup_logging(level: str = "info") -> None:
    handler = JsonStreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # No record field the JSON lines show needs them, and filling them (the thread's name,
    # the pid, the multiprocessing process name) is most of a LogRecord's cost: the access
    # log makes one per request.
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # aiohttp logs every client-gone condition with a traceback at ERROR in some paths and
    # its own access log duplicates ours; we log those events ourselves, without content.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)


def log_event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Structured log line; callers pass only sizes, ids, tenants, reasons."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})


def emit_access(
    logger: logging.Logger,
    names: tuple[str, ...],
    values: tuple[Any, ...],
    loop: asyncio.AbstractEventLoop | None = None,
) -> None:
    """Write one access line: `names[i]` is `values[i]`, a None value is left out
    (kvproxy.serve.context's `access_fields`: sizes, durations, ids and labels only).

    `loop`: the running loop, when the caller has it; kvproxy's own handler then writes the
    line with the others of this loop iteration (`JsonStreamHandler.write_soon`)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    direct = _only_json_handler(logger)
    if direct is not None:
        # The line JsonFormatter would write, without the LogRecord, the handler walk and
        # the formatter (they were ~8% of a small request's CPU). Only when that is all the
        # logging configuration would do with the record.
        # The fields go straight into the line's dict: a filtered dict merged into it cost a
        # third more instructions, and building the dict in C (the None pattern by map, the
        # kept values by itemgetter, dict(zip)) a quarter more than this loop.
        out = {"ts": rounded(time.time(), 1000), "level": "info", "logger": logger.name,
               "msg": "request"}  # fmt: skip
        for name, value in zip(names, values, strict=True):
            if value is not None:
                out[name] = value
        terminator = direct.terminator
        if terminator == "\n":
            line = orjson.dumps(out, default=str, option=orjson.OPT_APPEND_NEWLINE).decode()
        else:
            line = orjson.dumps(out, default=str).decode() + terminator
        direct.write_soon(line, loop)
        return
    # makeRecord + handle, not logger.info: info() walks the stack to find the caller's file
    # and line (findCaller), which a fixed access line never shows; 4.8 -> 3.2 us per record.
    # Handlers, filters and propagation are the same.
    fields = {name: value for name, value in zip(names, values, strict=True) if value is not None}
    record = logger.makeRecord(
        logger.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields}
    )
    logger.handle(record)


def _only_json_handler(logger: logging.Logger) -> JsonStreamHandler | None:
    """The one handler an INFO record of `logger` would reach, if it is kvproxy's own JSON
    handler with no filter anywhere on the way; else None (go through logging)."""
    if logger.filters:
        return None
    found: JsonStreamHandler | None = None
    node: logging.Logger | None = logger
    while node is not None:
        for h in node.handlers:
            if h.level > logging.INFO:
                continue
            if found is not None or type(h) is not JsonStreamHandler or h.filters:
                return None
            if type(h.formatter) is not JsonFormatter:
                return None
            found = h
        if not node.propagate:
            break
        node = node.parent
    return found

"""Log set-up: human-readable lines, or JSON lines (NIM_JSONL_LOGGING) for log pipelines."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

# The id of the HTTP request being served (set by the API middleware), stamped on every log record.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


@dataclass(frozen=True)
class TraceContext:
    """What ties a request's log records to a distributed trace."""

    trace_id: str
    traceparent: str | None = None  # as the caller sent it
    tracestate: str | None = None
    span_id: str | None = None  # this process's span for the request, when traces are exported


trace_var: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("trace", default=None)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = request_id_var.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        trace = trace_var.get()
        if trace is not None and not hasattr(record, "trace_id"):
            record.trace_id = trace.trace_id
            for name in ("traceparent", "tracestate", "span_id"):
                if getattr(trace, name) is not None:
                    setattr(record, name, getattr(trace, name))
        return True


_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JSONLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, jsonl: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if jsonl:
        handler.setFormatter(JSONLinesFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # uvicorn's loggers propagate to ours so every line has one format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True

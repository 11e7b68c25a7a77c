"""Logging: the library logs through structlog onto the standard `logging` tree and stays
silent (warnings aside) until an application - the CLI or the server - calls `configure`."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LOGGER_NAME = "dspark_flow"

_PRE_CHAIN: list[Any] = [
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso"),
]


def _formatter(fmt: str, colors: bool = False) -> logging.Formatter:
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=colors)
    )
    return structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=_PRE_CHAIN,
    )


class _Unconfigured(logging.Handler):
    """Warnings while no application has configured logging, rendered as the CLI renders them:
    Python's last-resort handler would print structlog's raw event dict. Silent once the
    application's root logger has a handler (the record propagates there) or `configure` ran."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # logging must never raise into the library
            self.handleError(record)


def _fallback() -> None:
    root = logging.getLogger(LOGGER_NAME)
    if not root.handlers:
        handler = _Unconfigured(logging.WARNING)
        handler.setFormatter(_formatter("console"))
        root.addHandler(handler)


def get_logger(name: str = LOGGER_NAME) -> Any:
    """A structlog logger that writes through stdlib logging (configured or not)."""
    _fallback()
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.stdlib.filter_by_level,
            *_PRE_CHAIN,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure(fmt: str = "console", level: str = "info") -> None:
    """Send the library's records to stderr as console lines or JSON objects."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter(fmt, colors=sys.stderr.isatty()))
    root = logging.getLogger(LOGGER_NAME)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False

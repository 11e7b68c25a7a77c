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


def get_logger(name: str = LOGGER_NAME) -> Any:
    """A structlog logger that writes through stdlib logging (configured or not)."""
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
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=_PRE_CHAIN,
        )
    )
    root = logging.getLogger(LOGGER_NAME)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False

"""NIXL's logging set-up (`nixl.logging`), which its examples print through.

`get_logger(name)` configures, once a process, the `nixl` logger as NIXL does: records at INFO and
above to standard output, formatted "<date time> NIXL <LEVEL> <file>:<line> <message>", not
propagated to the root logger; the level from NIXL_LOG_LEVEL (TRACE, DEBUG, INFO, WARN, ERROR,
FATAL) when set; logging's own errors raised only with NIXL_DEBUG_LOGGING (true, 1, yes). It returns
the logger `nixl.<name without leading underscores>`. tcpxd.nixl's own messages go to the
`tcpxd.nixl` logger, configured by the application.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

FORMAT = "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
          "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}

_lock = threading.Lock()
_configured = False


class _Stdout(logging.StreamHandler):
    """A handler writing to whatever sys.stdout is when a record is written (pytest swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def setup_logging() -> None:
    """Configures the `nixl` logger (once a process)."""
    global _configured
    with _lock:
        if _configured:
            return
        root = logging.getLogger("nixl")
        handler = _Stdout()
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        for h in list(root.handlers):
            root.removeHandler(h)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
        env = os.environ.get("NIXL_LOG_LEVEL")
        if env:
            level = LEVELS.get(env.upper())
            if level is None:
                root.warning("Invalid NIXL_LOG_LEVEL value '%s': not one of %s. Using configuration default.",
                             env, ", ".join(LEVELS))
            else:
                root.setLevel(level)
                root.info("Log level set to %s from NIXL_LOG_LEVEL environment variable", env.upper())
        logging.raiseExceptions = os.environ.get("NIXL_DEBUG_LOGGING", "").lower() in ("true", "1", "yes")
        _configured = True


def get_logger(name: str) -> logging.Logger:
    """The logger `nixl.<name>` (leading underscores dropped), the `nixl` logger configured first."""
    setup_logging()
    return logging.getLogger(f"nixl.{name.lstrip('_')}")


__all__ = ["get_logger", "setup_logging"]

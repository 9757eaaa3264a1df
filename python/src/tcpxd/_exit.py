"""A process exits promptly whatever state its clients and agents are in.

At interpreter exit Python first runs the `atexit` handlers, while every thread still runs, then
finalizes with daemon threads frozen. Closing a gRPC channel waits for its calls to end, and a
call read by a daemon thread (a subscription, the notification thread of a NIXL agent) never ends
once that thread is frozen: a `close()` from a finalizer (`nixl_agent.__del__`) would wait
forever. So every client and agent is tracked here, and one `atexit` handler closes those still
open while the threads run, agents first (each closes its client), within EXIT_CLOSE_S; what has
not closed by then is left to the operating system (the daemon releases a connection's buffers
and cancels its transfers when the connection closes). `finalizing()` tells a `close()` reached
after that (from a finalizer) to leave the channel alone.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Any, List

#: How long, in seconds, the exit handler gives open clients and agents to close.
EXIT_CLOSE_S = 2.0

log = logging.getLogger("tcpxd")

_agents: "weakref.WeakSet[Any]" = weakref.WeakSet()
_clients: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track_agent(agent: Any) -> None:
    """Closes `agent` (its `close()`) at exit if it is still alive then."""
    _agents.add(agent)


def track_client(client: Any) -> None:
    """Closes `client` at exit, after the agents, if it is still alive then."""
    _clients.add(client)


def finalizing() -> bool:
    """Whether the interpreter is past the exit handlers: other threads may be frozen, so nothing
    may wait on them (a gRPC channel's close does)."""
    return sys.is_finalizing()


def _close(objs: List[Any]) -> None:
    for obj in objs:
        try:
            obj.close()
        except Exception as e:  # noqa: BLE001 - at exit: say it, go on with the others
            log.debug("closing %r at exit: %s", obj, e)


def close_all(timeout: float = EXIT_CLOSE_S) -> bool:
    """Closes every tracked agent, then every tracked client, on a thread of its own; True if all
    closed within `timeout` seconds (else they are left to the process's end)."""
    objs = list(_agents) + list(_clients)
    if not objs:
        return True
    t = threading.Thread(target=_close, args=(objs,), name="tcpxd-exit", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.debug("tcpxd: %d clients and agents still closing after %.1f s at exit; left to the process's end",
                  len(objs), timeout)
        return False
    return True


atexit.register(close_all)

"""nixl_agent's metadata and remote agents: this agent's metadata as it hands it out, remote
agents' loaded (`add_remote_agent`; fetched from or sent to a peer's listener), pairing with their
nodes, and the loopback (this agent as its own remote side). Each function here is a method of
nixl_agent (tcpxd.nixl._agent: the class names them), `self` the agent."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

from ..errors import TcpxdError
from . import _listen
from ._descs import parse
from ._errors import from_tcpxd, nixlInvalidParamError, nixlNotFoundError, nixlNotSupportedError
from ._handles import DEFAULT_COMM_PORT
from ._metadata import AgentMetadata
from ._regions import RegionTable

if TYPE_CHECKING:
    from ._agent import nixl_agent

log = logging.getLogger("tcpxd.nixl")

AgentName = Union[str, bytes]


def _name(agent: AgentName, what: str) -> str:
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode()
    if not isinstance(agent, str):
        raise nixlInvalidParamError(f"{what}: an agent name (str) is needed, got {type(agent).__name__}")
    return agent


class _Remote:
    def __init__(self, md: AgentMetadata):
        self.md = md
        self.table = RegionTable(md.regions)
        #: The mailbox WRITE's entry field, encoded on first use.
        self.mailbox_entry: Optional[bytes] = None
        #: send_notif's WriteRequest to it up to the message, in three pieces (the entry field
        #: and the notification's key; the notification frame's head; the timeout field),
        #: encoded on first use (`nixl_agent.send_notif`).
        self.notif_head: Optional[Tuple[bytes, bytes, bytes]] = None
        #: The pairing with its node started when the metadata was loaded (`_pair_ahead`).
        self.pairing: Any = None
        #: The last send_notif to it (its WRITE's answer to come: a `_notify.Sent` on the
        #: notification feed, else a future of the agent's session) and the lock that orders
        #: them (`nixl_agent.send_notif`).
        self.notif_sent: Any = None
        self.notif_lock = threading.Lock()


def _metadata(self: nixl_agent, regions: Any = None) -> AgentMetadata:
    regs = self._memory.regions()
    if regions is not None:
        keep = {tuple(int(x) for x in row) for row in regions.rows}
        regs = [r for r in regs if (r.addr, r.size, r.dev) in keep]
    return AgentMetadata(self.name, self._node.node_id, list(self._node.peer_addresses), self._mailbox.descriptor,
                         regs, list(self.backends))


def get_agent_metadata(self: nixl_agent) -> bytes:
    """This agent's name, node, registered regions (raw base addresses and the daemon buffers
    holding them: access keys, keep it private) and mailbox."""
    return self._metadata().encode()


def get_partial_agent_metadata(self: nixl_agent, descs: Any, inc_conn_info: bool = False, backends: Optional[List[str]] = None) -> bytes:
    """Metadata of only the regions `descs` names (a registration list)."""
    dl = parse(descs, None, True, "descs")
    return self._metadata(dl).encode()


def add_remote_agent(self: nixl_agent, metadata: bytes) -> bytes:
    """Loads a remote agent's metadata (again: its regions are replaced). Returns its name as
    bytes, as NIXL's binding does."""
    md = AgentMetadata.decode(metadata)
    if md.name == self.name:
        raise nixlInvalidParamError(f"metadata: names this agent itself ({self.name!r})")
    remote = _Remote(md)
    with self._lock:
        self._remotes[md.name] = remote
    self._pair_ahead(remote)
    return md.name.encode()


def _pair_ahead(self: nixl_agent, remote: _Remote) -> None:
    """Starts pairing with the remote agent's node, not waiting for it (gRPC's own thread
    carries the call), as NIXL's backends connect when metadata is loaded: the first
    prep_xfer_dlist or transfer towards it then finds the pairing done or under way (the
    daemon pairs once however many ask). A failure here is left for that call to report."""
    if remote.md.node_id == self._node.node_id or not remote.md.peer_addresses:
        return
    try:
        remote.pairing = self._client._connect_peer_started(remote.md.peer_addresses[0])
    except Exception as e:  # noqa: BLE001 - an optimisation only: the transfer pairs as before
        log.debug("agent %s: pairing ahead with %s: %s", self.name, remote.md.name, e)


def remove_remote_agent(self: nixl_agent, agent: AgentName) -> None:
    with self._lock:
        self._remotes.pop(_name(agent, "agent"), None)


def check_remote_metadata(self: nixl_agent, agent: AgentName, descs: Any = None) -> bool:
    with self._lock:
        remote = self._remotes.get(_name(agent, "agent"))
    if remote is None:
        return False
    if descs is None:
        return True
    dl = parse(descs, None, False, "descs")
    try:
        remote.table.resolve(dl.mem, dl.rows, remote.md.name, "descs")
    except TcpxdError:
        return False
    return True


def make_connection(self: nixl_agent, remote_agent: AgentName, backends: Optional[List[str]] = None) -> None:
    """Pairs this node with the remote agent's node now (else the first transfer does)."""
    remote = self._remote(remote_agent, "remote_agent")
    if remote.md.node_id == self._node.node_id:
        return  # an agent of this agent's own daemon: nothing to pair
    last: Optional[TcpxdError] = None
    for addr in remote.md.peer_addresses:
        try:
            self._client.connect_peer(addr)
            return
        except TcpxdError as e:
            last = e
    if last is not None:
        raise from_tcpxd(last, f"make_connection to {remote.md.name}")


def send_local_metadata(self: nixl_agent, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
    self._peer_exchange("send_local_metadata", ip_addr, port, b"SEND", self.get_agent_metadata())


def send_partial_agent_metadata(self: nixl_agent, descs: Any, inc_conn_info: bool = False, backends: Optional[List[str]] = None,
                                ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
    self._peer_exchange("send_partial_agent_metadata", ip_addr, port, b"SEND", self.get_partial_agent_metadata(descs))


def fetch_remote_metadata(self: nixl_agent, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
    name = _name(remote_agent, "remote_agent")
    self._peer_exchange("fetch_remote_metadata", ip_addr, port, b"FTCH", name.encode(), self.add_remote_agent)
    self._fetched[name] = (ip_addr, int(port))


def _on_remote(self: nixl_agent, name: str, what: str, resolve: Callable[[_Remote], Any]) -> Any:
    """`resolve(remote)`; when a descriptor lies outside the remote agent's regions and its
    metadata was fetched from its listener, fetched again once and retried: it may have
    registered memory after it answered (NIXL's two-peer examples fetch while the target
    registers)."""
    try:
        return resolve(self._peer(name, what))
    except nixlNotFoundError:
        got = _listen.fetch_now(self._fetched[name], name) if name in self._fetched else None
        if not got:
            raise
        self.add_remote_agent(got)
        return resolve(self._peer(name, what))


def invalidate_local_metadata(self: nixl_agent, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
    self._peer_exchange("invalidate_local_metadata", ip_addr, port, b"INVL", self.name.encode())


def _peer_exchange(self: nixl_agent, what: str, ip: str, port: int, kind: bytes, body: bytes, answer: Any = None) -> None:
    if not ip:
        raise nixlNotSupportedError(
            f"{what}: a central metadata server (etcd) is not supported by tcpxd.nixl; give ip_addr (a peer's listener)")
    _listen.in_background(what, (ip, int(port)), kind, body, answer)


def _remote(self: nixl_agent, agent: AgentName, what: str) -> _Remote:
    name = _name(agent, what)
    with self._lock:
        remote = self._remotes.get(name)
    if remote is None:
        if name == self.name:
            return self._loopback()
        raise nixlNotFoundError(f"{what}: no remote agent {name!r} (load its metadata with add_remote_agent first)")
    return remote


def _loopback(self: nixl_agent) -> _Remote:
    """This agent as the remote side of a loopback list (prep_xfer_dlist with its own name, as
    NIXL's loopback): its own metadata, made again once its registrations changed. Its
    transfers are between two buffers of this agent's daemon, which copies them."""
    table = self._memory.table()
    with self._lock:
        lb = self._self_remote
        if lb is None or lb[0] is not table:
            lb = self._self_remote = (table, _Remote(self._metadata()))
        return lb[1]


def _peer(self: nixl_agent, agent: AgentName, what: str) -> _Remote:
    """A remote agent this one can move data to: on another node, or on this agent's daemon
    (another process of this node: the daemon copies between the two, docs/NIXL.md)."""
    return self._remote(agent, what)

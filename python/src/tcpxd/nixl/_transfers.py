"""nixl_agent's prepared lists and transfers: prep_xfer_dlist and the daemon's copy of a prepared
list, making transfer handles (make_prepped_xfer and its lane, initialize_xfer), the index ring,
and posting (`transfer`; a lane's request the fast way). Each function here is a method of
nixl_agent (tcpxd.nixl._agent: the class names them), `self` the agent; a transfer's state,
telemetry and release are the agent's own."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

from ..errors import TcpxdError
from . import _indices, _plan
from ._descs import parse
from ._errors import from_tcpxd, nixlBackendError, nixlInvalidKeyError, nixlInvalidParamError, nixlNotFoundError
from ._handles import NIXL_INIT_AGENT, nixl_prepped_dlist_handle, nixl_xfer_handle
from ._notify import frame
from ._remotes import AgentName, _name
from ._xfer import Xfer, mailbox_entry, mailbox_write

if TYPE_CHECKING:
    from ._agent import nixl_agent

log = logging.getLogger("tcpxd.nixl")


def _bytes(msg: Any, what: str) -> bytes:
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise nixlInvalidParamError(f"{what}: bytes (or str) are needed, got {type(msg).__name__}")


def prep_xfer_dlist(self: nixl_agent, agent_name: AgentName, xfer_list: Any, mem_type: Optional[str] = None,
                    backends: Optional[List[str]] = None) -> nixl_prepped_dlist_handle:
    """Resolves each descriptor to a registered region: of this agent for "NIXL_INIT_AGENT"
    (or ""), else of the remote agent named (raw addresses in its memory, from its metadata).
    nixlNotFoundError names the first descriptor outside them."""
    name = _name(agent_name, "agent_name")
    dl = parse(xfer_list, mem_type, False, "xfer_list")
    if name in (NIXL_INIT_AGENT, ""):
        prepped = _plan.prepare(self._memory.table(), dl.mem, dl.rows, "", f"agent {self.name!r}", "xfer_list")
    elif name == self.name:  # loopback: the remote side is this agent's own memory
        prepped = _plan.prepare(self._loopback().table, dl.mem, dl.rows, name, f"agent {name!r} (loopback)", "xfer_list")
    else:
        prepped = self._on_remote(name, "agent_name", lambda r: _plan.prepare(
            r.table, dl.mem, dl.rows, name, f"remote agent {name!r}", "xfer_list"))
    if prepped.preparable:  # held by the daemon too (the prepared path): prepared now, once
        try:
            self._prepared_id(self._session_now(), prepped)
        except (TcpxdError, nixlBackendError) as e:
            log.debug("agent %s: the daemon did not prepare a list of %d descriptors (%s): the block path serves it",
                      self.name, len(prepped), e)
    return nixl_prepped_dlist_handle(self, next(self._ids), prepped)


def _prepared_id(self: nixl_agent, session: Any, prepped: _plan.Prepped) -> int:
    """The daemon's id of `prepped` on `session` (PrepareBlocks on it the first time: the
    list goes with the session). A refusal marks the list unpreparable and raises."""
    with prepped.daemon_lock:
        d = prepped.daemon
        if d is not None and d[0] is session:
            return d[1]
        try:
            got = session._submit(prepare_blocks=prepped.prepare_request()).result(timeout=self._call_timeout_s)
        except TcpxdError:
            prepped.refused = True
            raise
        except Exception as e:  # noqa: BLE001 - no answer in time
            raise nixlBackendError(f"prep_xfer_dlist: the daemon did not prepare the list: {e!r}") from None
        prepped.daemon = (session, int(got.prepared_id))
        prepped.held = True
        return prepped.daemon[1]


def _unprepare(self: nixl_agent, prepped: _plan.Prepped) -> None:
    """Releases the daemon's copy of a prepared list (best effort: the session's end releases
    it anyway)."""
    with prepped.daemon_lock:
        d, prepped.daemon = prepped.daemon, None
    if d is not None and d[0]._ended is None and not d[0]._closed:
        try:
            d[0]._submit(release_prepared=d[1])
        except TcpxdError:
            pass


def release_dlist_handle(self: nixl_agent, handle: nixl_prepped_dlist_handle) -> None:
    handle.release()


def _dlist(self: nixl_agent, handle: Any, what: str) -> _plan.Prepped:
    if not isinstance(handle, nixl_prepped_dlist_handle) or handle._agent is not self:
        raise nixlInvalidParamError(f"{what}: not a prepared list of this agent (prep_xfer_dlist)")
    p = handle._prepped
    if p is None:
        raise nixlNotFoundError(f"{what}: released")
    return p


def _xfer_handle(self: nixl_agent, plan: Any, remote: str, notif: Any) -> nixl_xfer_handle:
    xfer = Xfer(plan, remote, notif if type(notif) is bytes else _bytes(notif, "notif_msg"), self._telemetry)
    return nixl_xfer_handle(self, next(self._ids), xfer)  # (next() on a count is atomic: no lock)


def _keep_lane(self: nixl_agent, operation: str, local_xfer_side: Any, remote_xfer_side: Any, skip_desc_merge: Any, plan: Any) -> None:
    """Keeps a prepared plan's lane on the local handle for the next requests between these
    handles, when its indices went as outer sums on both sides found by the native pass, or
    without outer sums (through the index ring, or packed when few) and the ring may serve."""
    if type(plan) is not _plan.Prepared:
        return
    outer = plan.lo is not None and plan.ro is not None and self._outer_native
    ring = plan.lo is None and plan.ro is None and not self._no_windows and len(plan.li) <= _indices.WINDOW_MAX
    if outer or ring:
        lanes = local_xfer_side._lanes
        if len(lanes) >= 16:  # handles made and dropped unreleased: keep a few
            lanes.clear()
        plan.lane.note_head = frame(self.name, plan.lane.remote.agent, b"")
        lanes[operation, remote_xfer_side, skip_desc_merge] = plan.lane


def make_prepped_xfer(self: nixl_agent, operation: str, local_xfer_side: nixl_prepped_dlist_handle, local_indices: Any,
                      remote_xfer_side: nixl_prepped_dlist_handle, remote_indices: Any, notif_msg: Any = b"",
                      backends: Optional[List[str]] = None, skip_desc_merge: bool = False) -> nixl_xfer_handle:
    """A transfer of local descriptor local_indices[k] with remote descriptor remote_indices[k]
    (WRITE: local into remote; READ: remote into local), equal lengths pairwise.

    Requests between two handles whose first request took the prepared path take its lane
    (one lookup, both arrays found in vLLM's form by the C pass or checked in one reduction
    each, no plan worked out again); anything else goes the general way below."""
    try:  # the lane kept on the local handle for (operation, remote handle, skip_desc_merge) (`_keep_lane`)
        lane = local_xfer_side._lanes[operation, remote_xfer_side, skip_desc_merge]
    except (AttributeError, KeyError, TypeError):  # not a handle, no lane yet, not hashable
        lane = None
    # the fast path when both handles are this agent's and live, neither list refused by
    # the daemon since, and the index arrays as `Lane.take` takes them (outer sums found by
    # the C pass, else the index ring); else the general way decides, checks and names
    if (lane is not None and local_xfer_side._agent is self and not remote_xfer_side._released
            and not lane.local.refused and not lane.remote.refused):
        pr = lane.take(local_indices, remote_indices, self._outer_native, not self._no_windows)
        if pr is not None:
            xfer = Xfer(pr, lane.remote.agent, notif_msg if type(notif_msg) is bytes else _bytes(notif_msg, "notif_msg"),
                        self._telemetry)
            return nixl_xfer_handle(self, next(self._ids), xfer)
    op = operation if operation == "READ" or operation == "WRITE" else _op(operation)
    local = self._dlist(local_xfer_side, "local_xfer_side")
    remote = self._dlist(remote_xfer_side, "remote_xfer_side")
    if local.agent:
        raise nixlInvalidParamError("local_xfer_side: prepared for a remote agent; prepare it with \"NIXL_INIT_AGENT\"")
    if not remote.agent:
        raise nixlInvalidParamError("remote_xfer_side: prepared for this agent; prepare it with the remote agent's name")
    # vLLM's form (regions × blocks) is found and encoded compactly, in range, first where the
    # C pass is built, else where the index ring will not carry the indices (_plan module doc);
    # else checked
    if self._outer_ok and (self._outer_native or self._no_windows or _size(local_indices) > _indices.WINDOW_MAX):
        lo = self._outer.encode(local_indices, local) if local.held and local.preparable else None
        ro = self._outer.encode(remote_indices, remote) if remote.held and remote.preparable else None
        if (lo is None) != (ro is None) and not self._no_windows and _size(local_indices) <= _indices.WINDOW_MAX:
            lo = ro = None  # one side alone of the form: both through the ring (a lane's request)
    else:
        lo = ro = None
    li = local_indices if lo is not None else _indices.indices(local_indices, local.count, "local_indices")
    ri = remote_indices if ro is not None else _indices.indices(remote_indices, remote.count, "remote_indices")
    plan = _plan.plan(op, local, li, remote, ri, not skip_desc_merge, self._timeout_ms, lo, ro)
    h = self._xfer_handle(plan, remote.agent, notif_msg)
    self._keep_lane(op, local_xfer_side, remote_xfer_side, skip_desc_merge, plan)
    return h


def initialize_xfer(self: nixl_agent, operation: str, local_descs: Any, remote_descs: Any, remote_agent: AgentName,
                    notif_msg: Any = b"", backends: Optional[List[str]] = None) -> nixl_xfer_handle:
    """A transfer of every local descriptor with the remote descriptor at the same position."""
    op = _op(operation)
    name = _name(remote_agent, "remote_agent")
    self._peer(name, "remote_agent")  # an unknown agent is named before any descriptor
    ld = parse(local_descs, None, False, "local_descs")
    rd = parse(remote_descs, None, False, "remote_descs")
    local = _plan.prepare(self._memory.table(), ld.mem, ld.rows, "", f"agent {self.name!r}", "local_descs")
    rem = self._on_remote(name, "remote_agent", lambda r: _plan.prepare(
        r.table, rd.mem, rd.rows, name, f"remote agent {name!r}", "remote_descs"))
    return self._xfer_handle(_plan.descs_plan(op, local, rem, self._timeout_ms), name, notif_msg)


def _windows_now(self: nixl_agent) -> Optional[_indices.Windows]:
    """The agent's index ring (_indices.Windows), registered on first use; None where this
    process cannot share memory with the daemon (a TCP endpoint) or the daemon refused it."""
    with self._lock:
        if self._windows is None and not self._no_windows and not self._closed:
            try:
                buf = self._client.register_host(_indices.Windows.nbytes(), shared=True)
            except (TcpxdError, OSError, ValueError) as e:
                log.debug("agent %s: no index ring (%s): indices go packed", self.name, e)
                self._no_windows = True
            else:
                if buf.shared:
                    self._windows = _indices.Windows(buf)
                else:
                    buf.release()
                    self._no_windows = True
        return self._windows


def transfer(self: nixl_agent, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
    """Posts the transfer: "PROC" (or "DONE"/"ERR" if it already ended). A notification reaches
    the remote agent after the data landed (after it was read, for a READ)."""
    xfer = handle._xfer if type(handle) is nixl_xfer_handle and handle._agent is self and not handle._released else self._live(handle)
    plan = xfer.plan
    to = self._remotes.get(xfer.remote)  # (a dict read is atomic: no lock)
    if to is not None and to.notif_sent is not None and (xfer.notif or not (type(notif_msg) is bytes and not notif_msg)):
        _notif_first(to.notif_sent)
    if type(plan) is _plan.Prepared and plan.lane.note_head is not None and type(notif_msg) is bytes and not notif_msg:
        state = self._post_lane(xfer, plan)
        if state is not None:
            return state
    remote = self._remotes.get(xfer.remote)  # (a dict read is atomic: no lock)
    if remote is None:
        remote = self._remote(xfer.remote, "handle's remote agent")  # raises, naming it
    if type(notif_msg) is bytes and not notif_msg:  # the handle's own: framed once
        framed = xfer.framed
        if framed is None:
            framed = xfer.framed = frame(self.name, remote.md.name, xfer.notif) if xfer.notif else b""
    else:
        msg = _bytes(notif_msg, "notif_msg") or xfer.notif
        framed = frame(self.name, remote.md.name, msg) if msg else b""
    session = self._session_now()
    pr = xfer.plan.prepared
    if pr is not None:  # bound to the session's prepared ids (prepared there if it is new)
        ld, rd = pr.local.daemon, pr.remote.daemon  # (session, id) tuples: read without a lock
        lid: Optional[int] = None
        if ld is not None and rd is not None and ld[0] is session and rd[0] is session:
            lid, rid = ld[1], rd[1]
        else:
            try:
                lid, rid = self._prepared_id(session, pr.local), self._prepared_id(session, pr.remote)
            except (TcpxdError, nixlBackendError) as e:
                log.debug("agent %s: prepared path refused (%s): the block or batch path instead", self.name, e)
                xfer.plan = pr.unprepared(xfer.plan.op)
        if lid is not None:  # one request, the notification in it; its indices in the index ring, else packed
            ring = None
            if _indices.WINDOW_MIN <= len(pr.li) <= _indices.WINDOW_MAX:
                ring = self._windows if self._windows is not None or self._no_windows else self._windows_now()
            slot = ring.take() if ring is not None else None
            if slot is not None:
                assert ring is not None
                try:
                    body = pr.window_body(_plan.ids_field(lid, rid), framed, ring, slot)
                    return xfer.post(session, b"", None, [body], functools.partial(ring.give, slot))
                except BaseException as e:  # nothing was sent: the slot is free again
                    ring.give(slot)
                    if isinstance(e, TcpxdError):
                        raise from_tcpxd(e, "transfer") from None
                    raise
            with self._scratch.lock:
                try:
                    return xfer.post(session, b"", None, [pr.body(lid, rid, framed, self._scratch)])
                except TcpxdError as e:
                    raise from_tcpxd(e, "transfer") from None
    ride = framed if xfer.plan.carries_notification else b""
    followup = None
    if framed and not ride:  # after every part: a WRITE between the mailboxes carries it alone
        if remote.mailbox_entry is None:
            remote.mailbox_entry = mailbox_entry(self._mailbox.id, remote.md.mailbox, self._notif_alone)
        body = mailbox_write(remote.mailbox_entry, framed, self._timeout_ms)
        followup = lambda s, sink: s._submit_encoded("write", [body], [sink])  # noqa: E731
    try:
        return xfer.post(session, ride, followup)
    except TcpxdError as e:
        raise from_tcpxd(e, "transfer") from None


def _post_lane(self: nixl_agent, xfer: Xfer, pr: _plan.Prepared) -> Optional[str]:
    """transfer() of a request made on a lane (make_prepped_xfer's fast path), the fast way:
    the session's prepared ids from the lane (bound again only when the lists' daemon ids
    changed); both sides' outer sums in the request, its frame joined in one C call; else both
    index arrays packed into a slot of the index ring (fewer than WINDOW_MIN a side: into the
    request), the request one bytes object in one frame. None, having sent nothing, where the
    general way must serve it: the remote agent removed, the lists not yet prepared on this
    session, no ring or no slot free."""
    if xfer.remote not in self._remotes:
        return None
    lane = pr.lane
    session = self._session
    if session is None or session._ended is not None or session._closed or session._why is not None or self._closed:
        session = self._session_now()
    single = pr.single
    if single is not None and (lane.op == "WRITE" or not xfer.notif):  # one pair: the plain request (`Lane.one`)
        pr.windowed = 0
        framed = _framed_note(xfer, lane)
        key = _plan._NOTIF_KEY["plain"]  # WriteRequest.notification = 2
        body = single[0] + (key + _plan.V(len(framed)) + framed if framed else b"") + single[1]
        try:
            return xfer.post_one(session, _plan.field(lane.op, "plain"), body, None)
        except TcpxdError as e:
            raise from_tcpxd(e, "transfer") from None
    ld, rd = lane.local.daemon, lane.remote.daemon  # (session, id) tuples: read without a lock
    bound = lane.bound
    if ld is bound[0] and rd is bound[1] and ld[0] is session:
        ids = bound[2]
    elif ld is not None and rd is not None and ld[0] is session and rd[0] is session:
        ids = lane.bind(ld, rd)
    else:
        return None
    fields = pr.fields
    if fields is not None:  # both sides as outer sums (`Lane.take`): a few KiB, framed in one C call
        note = xfer.note_field
        if note is None:
            note = xfer.note_field = _plan.note_field(lane.note_head, xfer.notif)  # type: ignore[arg-type]
        try:
            return xfer.post_one(session, lane.field, (ids, note, lane.tmo, fields), None, lane.key)
        except TcpxdError as e:
            raise from_tcpxd(e, "transfer") from None
    framed = _framed_note(xfer, lane)
    head = ids + (b"\x2a" + _plan.V(len(framed)) + framed if framed else b"") + lane.tmo  # notification = 5
    if len(pr.li) < _indices.WINDOW_MIN:  # few indices: packed into the request
        pr.windowed = 0
        try:
            return xfer.post_one(session, lane.field, head + lane.packed(pr.li, pr.ri), None)
        except TcpxdError as e:
            raise from_tcpxd(e, "transfer") from None
    ring = self._windows if self._windows is not None else self._windows_now()
    got = ring.put(pr.li, pr.ri) if ring is not None else None
    if got is None or ring is None:
        return None
    slot, windows = got
    pr.windowed = 2
    try:
        return xfer.post_one(session, lane.field, head + windows, functools.partial(ring.give, slot))
    except BaseException as e:  # nothing was sent: the slot is free again
        ring.give(slot)
        if isinstance(e, TcpxdError):
            raise from_tcpxd(e, "transfer") from None
        raise


def _framed_note(xfer: Any, lane: Any) -> bytes:
    """The transfer's notification framed for its remote agent (empty without one), made once
    per handle and kept on it."""
    framed = xfer.framed
    if framed is None:
        framed = xfer.framed = lane.note_head + xfer.notif if xfer.notif else b""
    return framed


def _notif_first(sent: Any) -> None:
    """Before a transfer whose notification goes to an agent a send_notif was just posted to:
    waits for that send_notif's answer, so the transfer's notification cannot arrive first (NIXL's
    keep that order: both ride one UCX endpoint; vLLM's prefix-hit send_notif, then the next
    request's READ with its own, relies on it). Its failure is the next send_notif's to raise."""
    if not sent.done():
        try:
            sent.exception()
        except Exception:  # noqa: BLE001 - a failure: raised by the next send_notif (and logged)
            pass


def _size(idx: Any) -> int:
    """The number of indices of a numpy array (0 for anything else: the outer form needs one)."""
    return idx.size if type(idx) is np.ndarray else int(idx.size) if isinstance(idx, np.ndarray) else 0


def _op(operation: Any) -> str:
    if operation not in ("WRITE", "READ"):
        raise nixlInvalidKeyError(f"operation: {operation!r} is neither \"WRITE\" nor \"READ\"")
    return str(operation)


//! The poller's commands: [`Poller::handle`] carries out each [`Command`] from the channel
//! (buffers, lane set-up and pairings, WRITEs and READs, block lists and block transfers,
//! prepared lists, cancel, peer messages, stats, drain), with its helpers: a block list's facts
//! for the API, the bytes a block transfer moves, and the status channel each started transfer
//! is tracked by.

use std::time::Instant;

use super::{Batch, Command, ListFacts, PeerStats, Phase, Poller, Refused, StatsSnapshot, TransferStatus};
use crate::engine::blocks::BlockList;
use crate::engine::{BlockSpec, Code, Engine, EngineError, TransferId, TransferKind};
use crate::metrics::Op;
use crate::status_watch;

/// `Engine::start_write_prepared` or `Engine::start_read_prepared`.
type PreparedStart =
    fn(&mut Engine, u64, &[u32], u64, &[u32], Vec<u8>, Instant, Instant) -> Result<TransferId, EngineError>;

/// The bytes `indices` select from `list`: one multiplication when its blocks are all of one
/// size, else a pass over the indices (indices past the list count nothing: the engine refuses
/// them before this is asked).
fn selected_bytes(list: &BlockList, indices: &crate::engine::blocks::IndexArray) -> u64 {
    match list.uniform_len() {
        Some(len) => indices.count() * u64::from(len),
        None => indices
            .iter()
            .filter_map(|i| list.block(i))
            .map(|(_, len)| u64::from(len))
            .sum(),
    }
}

impl Poller {
    /// Carries out one command from the channel.
    pub(super) fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::AddBuffer { entry, reply } => {
                // A GPU's unpack stage is built with its first buffer, before the registration
                // answers: its kernels may take ~0.1 s to compile (NVRTC), which the first
                // transfer would otherwise wait for. A failure here is reported again by the
                // first receive that needs the stage; sends from the buffer still work.
                if let Some(region) = entry.device_region()
                    && let Err(e) = crate::lanes::stage_for(&mut self.stages, region.gpu(), self.unpack_impl)
                {
                    tracing::warn!("{e}");
                }
                if let Some(region) = entry.device_region() {
                    self.prepare_inline_copies(region.gpu());
                }
                let r = self.engine.add_buffer(entry.id, entry.size, entry.key());
                if r.is_ok() {
                    if let Some(region) = entry.device_region() {
                        // GPU memory: routed lanes follow it, and peers may send into it by
                        // credits at any size.
                        let gpu = crate::engine::topology::Memory::Gpu(region.gpu().ordinal() as u32);
                        self.engine.set_buffer_memory(entry.id, gpu);
                    }
                    self.buffers.insert(entry.id, entry);
                }
                let _ = reply.send(r);
            }
            Command::AddBuffers { items, reply } => {
                let added = items
                    .into_iter()
                    .map(|(entry, layouts)| self.add_host_buffer(entry, layouts))
                    .collect();
                let _ = reply.send(added);
            }
            Command::RekeyBuffer { id, key, reply } => {
                let _ = reply.send(self.engine.rekey_buffer(id, key));
            }
            Command::RemoveBuffer { id, reply } => {
                let r = self.remove_buffers(&[id]).pop().unwrap_or(Ok(()));
                let _ = reply.send(r);
            }
            Command::RemoveBuffers { ids, reply } => {
                let _ = reply.send(self.remove_buffers(&ids));
            }
            Command::PrepareLanes { reply } => {
                let r = self.open_listens().map(|(listens, infos)| {
                    let id = self.next_prepared;
                    self.next_prepared += 1;
                    self.prepared.insert(id, listens);
                    (id, infos)
                });
                let _ = reply.send(r);
            }
            Command::DropPrepared { prepared } => {
                self.prepared.remove(&prepared);
            }
            Command::CompletePeer {
                prepared,
                node_id,
                remote,
                topology,
                channels,
                reply,
            } => {
                let r = match self.prepared.remove(&prepared) {
                    None => Err("lane set-up expired".to_string()),
                    Some(listens) => self.add_peer(node_id, listens, remote, topology, channels),
                };
                let _ = reply.send(r);
            }
            Command::AcceptPeer {
                node_id,
                remote,
                topology,
                channels,
                reply,
            } => {
                let r = self.open_listens().and_then(|(listens, infos)| {
                    self.add_peer(node_id, listens, remote, topology, channels)
                        .map(|idx| (idx, infos))
                });
                let _ = reply.send(r);
            }
            Command::Write {
                batch,
                notification,
                deadline,
                reply,
            } => {
                let r = self.start_batch(Op::Write, batch, notification, deadline, "write");
                let r = r.map(|(id, rx, _)| (id, rx));
                self.answer_started(reply, r);
            }
            Command::Read {
                batch,
                deadline,
                reply,
            } => {
                let r = self.start_batch(Op::Read, batch, Vec::new(), deadline, "read");
                let r = r.map(|(id, rx, _)| (id, rx));
                self.answer_started(reply, r);
            }
            Command::RegisterBlocks {
                buffer,
                layout,
                reattach,
                reply,
            } => {
                let r = self
                    .engine
                    .register_blocks_as(reattach, buffer, layout)
                    .and_then(|id| self.list_facts(id));
                let _ = reply.send(r);
            }
            Command::ReleaseBlocks { list, reply } => {
                let _ = reply.send(self.engine.release_blocks(list));
            }
            Command::DescribeBlocks { list, reply } => {
                let _ = reply.send(self.list_facts(list));
            }
            Command::PlanSameNodeBlocks {
                local_list,
                local_indices,
                remote,
                write,
                reply,
            } => {
                let _ =
                    reply.send(
                        self.engine
                            .plan_same_node_blocks(local_list, &local_indices, &remote, write),
                    );
            }
            Command::PrepareSameNode {
                lists,
                entries,
                reply,
            } => {
                let _ = reply.send(self.engine.prepare_same_node(lists, entries));
            }
            Command::PlanSameNodePrepared {
                transfer,
                write,
                reply,
            } => {
                let _ = reply.send(self.engine.plan_same_node_prepared(
                    (transfer.local, &transfer.local_indices),
                    (transfer.remote, &transfer.remote_indices),
                    write,
                ));
            }
            Command::WriteBlocks {
                spec,
                notification,
                deadline,
                reply,
            } => {
                // Its pairing closed when idle: the spec goes back to be started again.
                if let Some(error) = self.engine.pairing_closed(spec.peer) {
                    let _ = reply.send(Err(Refused {
                        error,
                        again: Some(spec),
                    }));
                    return;
                }
                let now = Instant::now();
                let total = self.block_total(&spec);
                let r = self.engine.start_write_blocks(spec, notification, deadline, now);
                if let Ok(id) = &r {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.cmd", kind = "write_blocks", id = id.0, us = now.elapsed().as_micros() as u64);
                }
                let r = r.map_err(Refused::from);
                let r = r.map(|id| (id, self.track(id, Op::Write, total), total));
                self.answer_started(reply, r);
            }
            Command::ReadBlocks {
                spec,
                deadline,
                reply,
            } => {
                if let Some(error) = self.engine.pairing_closed(spec.peer) {
                    let _ = reply.send(Err(Refused {
                        error,
                        again: Some(spec),
                    }));
                    return;
                }
                let now = Instant::now();
                let total = self.block_total(&spec);
                let r = self.engine.start_read_blocks(spec, deadline, now);
                if let Ok(id) = &r {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.cmd", kind = "read_blocks", id = id.0, us = now.elapsed().as_micros() as u64);
                }
                let r = r.map_err(Refused::from);
                let r = r.map(|id| (id, self.track(id, Op::Read, total), total));
                self.answer_started(reply, r);
            }
            Command::PrepareLocal {
                reattach,
                lists,
                entries,
                reply,
            } => {
                let _ = reply.send(self.engine.prepare_local_as(reattach, lists, entries));
            }
            Command::PrepareRemote {
                reattach,
                peer,
                lists,
                entries,
                reply,
            } => {
                let _ = reply.send(self.engine.prepare_remote_as(reattach, peer, lists, entries));
            }
            Command::StartIdsAt { lists, prepared } => {
                self.engine.start_ids_at(lists, prepared);
            }
            Command::ReleasePrepared { id, reply } => {
                let _ = reply.send(self.engine.release_prepared(id));
            }
            Command::StartPrepared {
                kind,
                transfer: t,
                deadline,
                reply,
            } => {
                let now = Instant::now();
                let (start, op, label) = match kind {
                    TransferKind::Write => (
                        Engine::start_write_prepared as PreparedStart,
                        Op::Write,
                        "write_prepared",
                    ),
                    TransferKind::Read => (
                        Engine::start_read_prepared as PreparedStart,
                        Op::Read,
                        "read_prepared",
                    ),
                };
                let r = start(
                    &mut self.engine,
                    t.local,
                    &t.local_indices,
                    t.remote,
                    &t.remote_indices,
                    // Kept: a start refused because its pairing closed goes back whole.
                    t.notification.clone(),
                    deadline,
                    now,
                );
                let r = r.map_err(|error| match error.closed_pairing {
                    Some(_) => Refused {
                        error,
                        again: Some(t),
                    },
                    None => Refused::from(error),
                });
                let r = r.map(|id| {
                    // `us`: how long the engine took to check and plan it (the poller did nothing else).
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.cmd", kind = label, id = id.0, us = now.elapsed().as_micros() as u64);
                    let total = self.engine.transfer_total(id).unwrap_or(0);
                    (id, self.track(id, op, total), total)
                });
                self.answer_started(reply, r);
            }
            Command::Cancel { id, reply } => {
                let _ = reply.send(self.engine.cancel(id, Code::Cancelled, "cancelled by the client"));
            }
            Command::Message { peer, msg } => {
                let (kind, id) = msg.label();
                tracing::trace!(target: "tcpxd::hop", hop = "poller.in", pass = crate::lanes::pass(), kind, id);
                // The peer's first message (its ReceiveMode) says it keeps this pairing: up.
                // (Lanes open on first use; a pairing the peer dropped while two handshakes
                // settled never hears from it and never comes up.)
                if let Some(p) = self.peers.get_mut(&peer)
                    && !p.up
                    && !p.failed
                {
                    p.up = true;
                    tracing::info!(peer = %p.node_id, "peer up (lanes open on first use)");
                    p.link.send_replace(super::PeerLink::Up);
                }
                let life = self.engine.pairing_life(peer);
                self.engine.on_message(peer, msg, Instant::now());
                // A pairing closed when idle (or kept): its link follows before the next command,
                // so a start refused for it (`EngineError::closed_pairing`) is answered to an API
                // that sees why (`Peers::settle_close`, `revive`).
                if self.engine.pairing_life(peer) != life {
                    self.run_actions();
                }
            }
            Command::Malformed { peer, request } => self.engine.on_malformed(peer, request),
            Command::PeerDown { peer, reason } => self.engine.on_peer_failed(peer, &reason),
            Command::DirectControl { peer, conn } => self.direct_control(peer, conn),
            Command::DirectSwitch { peer } => self.direct_switch(peer),
            Command::ControlStreamEnded { peer, reason } => self.stream_ended(peer, reason),
            Command::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
            Command::Drain { deadline, reply } => {
                self.engine.begin_drain(deadline);
                self.drain = Some(reply);
            }
            Command::WhenBufferIdle { id, reply } => {
                if self.engine.watch_buffer(id) {
                    let _ = reply.send(());
                } else {
                    let waiters = self.idle_waiters.entry(id).or_default();
                    waiters.retain(|w| !w.is_closed());
                    waiters.push(reply);
                }
            }
        }
    }

    /// A list's facts for the API (its token's fields, the buffer's current key).
    /// Removes buffers no transfer uses (`Command::RemoveBuffer`, `RemoveBuffers`): per id, in
    /// order, removed or why not; the lanes' handles of those removed dropped in one pass.
    fn remove_buffers(&mut self, ids: &[u64]) -> Vec<Result<(), EngineError>> {
        let out: Vec<Result<(), EngineError>> = ids.iter().map(|&id| self.engine.remove_buffer(id)).collect();
        let removed: std::collections::HashSet<u64> = ids
            .iter()
            .zip(&out)
            .filter(|(_, r)| r.is_ok())
            .map(|(&id, _)| id)
            .collect();
        if !removed.is_empty() {
            // A host copy queued on a helper holds the region itself, but not the
            // registrations dropped below.
            self.host_copies.quiesce();
            for id in &removed {
                self.buffers.remove(id);
            }
            // The lane threads' registrations of them go too, before anything they are told next.
            if let Some(t) = &self.lanes {
                t.forget(&removed.iter().copied().collect::<Vec<_>>());
            }
            for p in self.peers.values_mut() {
                for l in &mut p.send {
                    l.handles.retain(|(b, _), _| !removed.contains(b));
                }
                for l in &mut p.recv {
                    l.handles.retain(|(b, _), _| !removed.contains(b));
                }
            }
        }
        out
    }

    /// One buffer of `Command::AddBuffers` (host memory: no GPU stage or memory to set up, as
    /// `Command::AddBuffer` does for device memory), with its block lists.
    fn add_host_buffer(
        &mut self,
        entry: std::sync::Arc<crate::buffers::BufferEntry>,
        layouts: Vec<crate::engine::blocks::Layout>,
    ) -> super::AddedBuffer {
        if entry.device_region().is_some() {
            return Err(EngineError::new(
                Code::Internal,
                format!("buffer {}: AddBuffers carries host memory only", entry.id),
            ));
        }
        let buffer = entry.id;
        self.engine.add_buffer(buffer, entry.size, entry.key())?;
        self.buffers.insert(buffer, entry);
        Ok(layouts
            .into_iter()
            .map(|layout| {
                self.engine
                    .register_blocks_as(None, buffer, layout)
                    .and_then(|id| self.list_facts(id))
            })
            .collect())
    }

    fn list_facts(&self, id: u64) -> Result<ListFacts, EngineError> {
        let list = self
            .engine
            .block_list(id)
            .ok_or_else(|| EngineError::not_found(format!("list_id: list {id} does not exist")))?;
        let key = self.engine.buffer_key(list.buffer()).ok_or_else(|| {
            EngineError::not_found(format!(
                "list_id: list {id}'s buffer {} does not exist",
                list.buffer()
            ))
        })?;
        Ok(ListFacts {
            id,
            buffer: list.buffer(),
            count: list.len(),
            block_len: list.uniform_len().unwrap_or(0),
            key,
        })
    }

    /// The bytes a block transfer moves, from its local list (0 when the list is unknown: the
    /// engine refuses the transfer then).
    fn block_total(&self, spec: &BlockSpec) -> u64 {
        self.engine
            .block_list(spec.local_list)
            .map_or(0, |l| selected_bytes(l, &spec.local_indices))
    }

    /// Answers a command that started a transfer: a refusal at once, a start at the end of the
    /// pass ([`Poller::send_answers`]), once the transfer's first messages are on the wire and
    /// its first posts made. The answer wakes the API's task; on few CPUs the woken thread may
    /// take this one's CPU at once, and the peer should not wait for that. The transfer's
    /// status channel exists already (`track`), so an end published before the API reads the
    /// answer is kept for it.
    /// Starts a plain WRITE (with its `notification`) or READ batch on the engine and tracks it:
    /// a command's way and a fast start's (`fast_starts.rs`) alike. `kind` names it in the hop
    /// trace. Returns the id, its status channel and the batch's bytes.
    pub(super) fn start_batch(
        &mut self,
        op: Op,
        batch: Batch,
        notification: Vec<u8>,
        deadline: Instant,
        kind: &'static str,
    ) -> Result<(TransferId, status_watch::Receiver<TransferStatus>, u64), EngineError> {
        let now = Instant::now();
        let e = &mut self.engine;
        let (r, total) = match (batch, op) {
            (Batch::Entries(specs), op) => {
                let total = specs.iter().map(|s| s.remote.length).sum();
                let r = match op {
                    Op::Write => e.start_write(specs, notification, deadline, now),
                    Op::Read => e.start_read(specs, deadline, now),
                };
                (r, total)
            }
            (Batch::Packed(b), op) => {
                let total = b.remote.total().unwrap_or(0);
                let r = match op {
                    Op::Write => e.start_write_packed(b, notification, deadline, now),
                    Op::Read => e.start_read_packed(b, deadline, now),
                };
                (r, total)
            }
        };
        let id = r?;
        tracing::trace!(target: "tcpxd::hop", hop = "poller.cmd", kind, id = id.0, us = now.elapsed().as_micros() as u64);
        Ok((id, self.track(id, op, total), total))
    }

    fn answer_started<T: Send + 'static, E: Send + 'static>(
        &mut self,
        reply: super::Reply<Result<T, E>>,
        r: Result<T, E>,
    ) {
        if r.is_ok() {
            self.answers.push(Box::new(move || {
                let _ = reply.send(r);
            }));
        } else {
            let _ = reply.send(r);
        }
    }

    /// Sends the answers [`Poller::answer_started`] held back (end of each pass, and before
    /// the poller stops).
    pub(super) fn send_answers(&mut self) {
        for answer in self.answers.drain(..) {
            answer();
        }
    }

    pub(super) fn track(
        &mut self,
        id: TransferId,
        op: Op,
        total: u64,
    ) -> status_watch::Receiver<TransferStatus> {
        // One clock read for the metric's start and the status's.
        let now = Instant::now();
        self.meter.started_at(id, op, total, now);
        let (tx, rx) = status_watch::channel(TransferStatus {
            phase: Phase::Offered,
            bytes_done: 0,
            total: 0,
            outcome: None,
            started: now,
            finished_at: None,
        });
        self.transfers.insert(id, tx);
        rx
    }

    fn stats(&self) -> StatsSnapshot {
        StatsSnapshot {
            peers: self
                .peers
                .iter()
                .filter_map(|(&i, p)| {
                    Some(PeerStats {
                        counters: self.engine.listed_counters(i)?,
                        link: p.link.borrow().clone(),
                        send_devices: p.send.iter().map(|l| l.device).collect(),
                        recv_devices: p.recv.iter().map(|l| l.device).collect(),
                        send_gpus: p.send.iter().map(|l| l.gpu).collect(),
                        recv_gpus: p.recv.iter().map(|l| l.gpu).collect(),
                        direct_control: p.direct.as_ref().is_some_and(|d| d.switched),
                        direct_messages_sent: p.direct.as_ref().map_or(0, |d| d.messages_sent),
                    })
                })
                .collect(),
            retired: self.engine.retired_counters().cloned().collect(),
            active_transfers: self.engine.active_transfers(),
        }
    }
}

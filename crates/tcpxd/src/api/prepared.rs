//! Prepared lists through the client API (docs/BLOCKS.md, "Prepared lists"): PrepareBlocks over
//! local lists or one other node's tokens, ReleasePrepared, and WritePrepared / ReadPrepared,
//! which name two prepared lists and two packed arrays of entry indices.
//!
//! Only the request's shape is checked here (packed arrays of whole values, counts within the
//! limits before anything is unpacked, tokens of one node, the peer); the entries and indices are
//! the engine's to check, once, naming the field. A side's indices come packed, as an outer sum
//! (expanded here) or as a window of a host buffer (read here, once).

use std::time::Instant;

use tonic::{Request, Response, Status};

use super::proto::v1 as pb;
use super::state::{DaemonState, status};
use super::transfers::Started;
use crate::block_token::BlockToken;
use crate::buffers::BufferRegistry;
use crate::engine::{
    EngineError, MAX_PREPARED_ENTRIES, MAX_PREPARED_LISTS, PreparedEntry, PreparedInfo, RemoteList,
    TransferKind,
};
use crate::journal::{Record, Space};
use crate::poller::{Command, PreparedTransfer};

/// Bytes one packed entry takes: three little-endian u32s (list position, first block, count).
pub const ENTRY_BYTES: usize = 12;

/// Unpacks a prepared list's entries, their count checked before anything is unpacked.
pub fn entries(bytes: &[u8]) -> Result<Vec<PreparedEntry>, EngineError> {
    if bytes.len() % ENTRY_BYTES != 0 {
        return Err(EngineError::invalid(format!(
            "entries: {} bytes are not a whole number of {ENTRY_BYTES}-byte entries (three little-endian u32s each)",
            bytes.len()
        )));
    }
    let n = bytes.len() / ENTRY_BYTES;
    check_count("entries", n, "entries")?;
    let u32_at = |c: &[u8], i: usize| u32::from_le_bytes(c[i..i + 4].try_into().expect("4 bytes"));
    Ok(bytes
        .chunks_exact(ENTRY_BYTES)
        .map(|c| PreparedEntry {
            list: u32_at(c, 0),
            first: u32_at(c, 4),
            count: u32_at(c, 8),
        })
        .collect())
}

/// Unpacks a transfer's entry indices (`field`), their count checked first.
pub fn indices(field: &str, bytes: &[u8]) -> Result<Vec<u32>, EngineError> {
    packed_u32s(field, bytes, "indices", ("entry", "entries"))
}

/// Unpacks a packed array of little-endian u32s (`field`), its shape checked first: whole values
/// (`values`: what the shape error calls them), at least one and at most `MAX_PREPARED_ENTRIES`
/// (`counted`: what the count errors call one and many).
fn packed_u32s(
    field: &str,
    bytes: &[u8],
    values: &str,
    counted: (&str, &str),
) -> Result<Vec<u32>, EngineError> {
    if bytes.len() % 4 != 0 {
        return Err(EngineError::invalid(format!(
            "{field}: {} bytes are not a whole number of 4-byte little-endian {values}",
            bytes.len()
        )));
    }
    check_count_of(field, bytes.len() / 4, counted)?;
    Ok(le_u32s(bytes))
}

/// Little-endian u32s, a whole number of them (checked by the caller).
fn le_u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// One side's entry indices as a request may carry them: packed, as an outer sum or as a window
/// of a host buffer (each with its field's name); exactly one is set.
pub struct SideIndices<'a> {
    pub packed: (&'a str, &'a [u8]),
    pub outer: (&'a str, Option<&'a pb::OuterIndices>),
    pub window: (&'a str, Option<&'a pb::IndexWindow>),
}

impl<'a> SideIndices<'a> {
    /// A request's local side: `local_indices`, `local_outer`, `local_window`.
    pub fn local(
        packed: &'a [u8],
        outer: Option<&'a pb::OuterIndices>,
        window: Option<&'a pb::IndexWindow>,
    ) -> Self {
        SideIndices {
            packed: ("local_indices", packed),
            outer: ("local_outer", outer),
            window: ("local_window", window),
        }
    }

    /// A request's remote side: `remote_indices`, `remote_outer`, `remote_window`.
    pub fn remote(
        packed: &'a [u8],
        outer: Option<&'a pb::OuterIndices>,
        window: Option<&'a pb::IndexWindow>,
    ) -> Self {
        SideIndices {
            packed: ("remote_indices", packed),
            outer: ("remote_outer", outer),
            window: ("remote_window", window),
        }
    }

    /// The indices: unpacked, expanded from the outer sum, or read from the window's buffer.
    pub fn resolve(&self, buffers: &BufferRegistry) -> Result<Vec<u32>, EngineError> {
        let (field, packed) = self.packed;
        let mut set: Vec<&str> = Vec::new();
        if !packed.is_empty() {
            set.push(field);
        }
        if self.outer.1.is_some() {
            set.push(self.outer.0);
        }
        if self.window.1.is_some() {
            set.push(self.window.0);
        }
        if set.len() > 1 {
            return Err(EngineError::invalid(format!(
                "{}: set one of them, not {}",
                set.join(", "),
                if set.len() == 2 { "both" } else { "several" }
            )));
        }
        match (self.outer.1, self.window.1) {
            (Some(o), _) => outer_indices(self.outer.0, o),
            (_, Some(w)) => window_indices(self.window.0, w, buffers),
            _ => indices(field, packed),
        }
    }
}

/// Reads an index window (`field`: IndexWindow): `count` little-endian u32s at `offset` of a
/// host buffer of this node, the count, the buffer and the bounds checked first. The bytes are
/// copied out once, then only the copy is used (the client may write the buffer meanwhile).
pub fn window_indices(
    field: &str,
    w: &pb::IndexWindow,
    buffers: &BufferRegistry,
) -> Result<Vec<u32>, EngineError> {
    let n = w.count as usize;
    check_count(&format!("{field}.count"), n, "indices")?;
    let entry = buffers.get_as(&format!("{field}.buffer_id"), w.buffer_id)?;
    let Some(host) = entry.host_region() else {
        return Err(EngineError::invalid(format!(
            "{field}.buffer_id: buffer {} is not host memory (an index window is read from a host buffer)",
            w.buffer_id
        )));
    };
    let len = n * 4;
    let past = w
        .offset
        .checked_add(len as u64)
        .is_none_or(|end| end > entry.size);
    if past {
        return Err(EngineError::invalid(format!(
            "{field}: {n} indices ({len} bytes) at offset {} run past the end of buffer {} ({} bytes)",
            w.offset, w.buffer_id, entry.size
        )));
    }
    let mut bytes = vec![0u8; len];
    host.read(w.offset as usize, &mut bytes)
        .map_err(|e| EngineError::invalid(format!("{field}: buffer {}: {e}", w.buffer_id)))?;
    Ok(le_u32s(&bytes))
}

/// Expands an outer sum (`field`: OuterIndices), its shape checked before anything is
/// allocated: whole u32 arrays of at least one value each, rows × cols within the entry limit,
/// the largest row plus the largest column within u32.
pub fn outer_indices(field: &str, o: &pb::OuterIndices) -> Result<Vec<u32>, EngineError> {
    let unpack = |name: &str, bytes: &[u8]| {
        packed_u32s(&format!("{field}.{name}"), bytes, "values", ("value", "values"))
    };
    let rows = unpack("rows", &o.rows)?;
    let cols = unpack("cols", &o.cols)?;
    let n = rows.len() as u64 * cols.len() as u64;
    if n > MAX_PREPARED_ENTRIES as u64 {
        return Err(EngineError::invalid(format!(
            "{field}: {} rows x {} cols = {n} entries exceed the limit of {MAX_PREPARED_ENTRIES}",
            rows.len(),
            cols.len()
        )));
    }
    let top_row = rows.iter().copied().max().unwrap_or(0);
    let top_col = cols.iter().copied().max().unwrap_or(0);
    if u64::from(top_row) + u64::from(top_col) > u64::from(u32::MAX) {
        return Err(EngineError::invalid(format!(
            "{field}: the largest row ({top_row}) plus the largest col ({top_col}) exceed the u32 limit of {}",
            u32::MAX
        )));
    }
    let mut out = Vec::with_capacity(n as usize);
    for &r in &rows {
        out.extend(cols.iter().map(|&c| r + c));
    }
    Ok(out)
}

fn check_count(field: &str, n: usize, what: &str) -> Result<(), EngineError> {
    check_count_of(field, n, ("entry", what))
}

/// At least one and at most `MAX_PREPARED_ENTRIES` (`(one, many)`: what the errors call them).
fn check_count_of(field: &str, n: usize, (one, many): (&str, &str)) -> Result<(), EngineError> {
    if n == 0 {
        return Err(EngineError::invalid(format!(
            "{field}: at least one {one} is required"
        )));
    }
    if n > MAX_PREPARED_ENTRIES {
        return Err(EngineError::invalid(format!(
            "{field}: {n} {many} exceed the limit of {MAX_PREPARED_ENTRIES}"
        )));
    }
    Ok(())
}

fn prepared_pb(p: PreparedInfo) -> pb::PreparedBlocks {
    pb::PreparedBlocks {
        prepared_id: p.id,
        entries: p.entries,
        blocks: p.blocks,
    }
}

impl DaemonState {
    /// PrepareBlocks: local lists, or one other node's tokens (pairing with it first when
    /// needed, by `deadline`).
    pub(crate) async fn prepare_blocks(
        &self,
        r: pb::PrepareBlocksRequest,
        deadline: Instant,
    ) -> Result<pb::PreparedBlocks, Status> {
        let (reattach, claim) = self.reattach_prepared(r.reattach_id)?;
        let mut remote_node = None;
        let info = match (r.local_list_ids.is_empty(), r.remote_tokens.is_empty()) {
            (false, true) => {
                if r.local_list_ids.len() > MAX_PREPARED_LISTS {
                    return Err(Status::invalid_argument(format!(
                        "local_list_ids: {} lists exceed the limit of {MAX_PREPARED_LISTS}",
                        r.local_list_ids.len()
                    )));
                }
                let entries = entries(&r.entries).map_err(status)?;
                let lists = r.local_list_ids;
                self.ask(|reply| Command::PrepareLocal {
                    reattach,
                    lists,
                    entries,
                    reply,
                })
                .await?
                .map_err(status)?
            }
            (true, false) => {
                if r.remote_tokens.len() > MAX_PREPARED_LISTS {
                    return Err(Status::invalid_argument(format!(
                        "remote_tokens: {} tokens exceed the limit of {MAX_PREPARED_LISTS}",
                        r.remote_tokens.len()
                    )));
                }
                let entries = entries(&r.entries).map_err(status)?;
                let tokens = self.one_node_tokens(&r.remote_tokens)?;
                if tokens[0].node_id == self.node_id {
                    // Other clients' lists of this daemon: their transfers are copied here.
                    let lists = tokens.into_iter().map(remote_list).collect();
                    let info = self
                        .ask(|reply| Command::PrepareSameNode {
                            lists,
                            entries,
                            reply,
                        })
                        .await?
                        .map_err(status)?;
                    self.same_node.prepared(info.id);
                    return Ok(prepared_pb(info));
                }
                self.reach_token("remote_tokens[0]", &tokens[0], deadline).await?;
                remote_node = Some(tokens[0].clone());
                let peer = self.peer_of("remote_tokens[0]", &tokens[0].node_id)?;
                let lists = tokens.into_iter().map(remote_list).collect();
                self.ask(|reply| Command::PrepareRemote {
                    reattach,
                    peer,
                    lists,
                    entries,
                    reply,
                })
                .await?
                .map_err(status)?
            }
            _ => {
                return Err(Status::invalid_argument(
                    "local_list_ids, remote_tokens: set exactly one of them",
                ));
            }
        };
        if let Some(token) = remote_node {
            self.remote_prepared
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(info.id, token);
        }
        if let Err(e) = self.journal_record(Space::Prepared, info.id, Record::Prepared) {
            let _ = self.release_prepared(info.id).await;
            return Err(e);
        }
        claim.keep();
        tracing::debug!(
            prepared = info.id,
            entries = info.entries,
            blocks = info.blocks,
            "prepared list"
        );
        Ok(prepared_pb(info))
    }

    /// Parses tokens that must all name one other node; the error names the first that does not.
    fn one_node_tokens(&self, raw: &[String]) -> Result<Vec<BlockToken>, Status> {
        let mut tokens: Vec<BlockToken> = Vec::with_capacity(raw.len());
        for (i, t) in raw.iter().enumerate() {
            let field = format!("remote_tokens[{i}]");
            let token = BlockToken::parse(&field, t).map_err(status)?;
            if let Some(first) = tokens.first()
                && first.node_id != token.node_id
            {
                return Err(Status::invalid_argument(format!(
                    "{field}: names node {}, but remote_tokens[0] names node {} (all tokens must be of one node)",
                    token.node_id, first.node_id
                )));
            }
            tokens.push(token);
        }
        Ok(tokens)
    }

    pub(crate) async fn release_prepared(&self, id: u64) -> Result<(), Status> {
        self.same_node.released(id);
        self.ask(|reply| Command::ReleasePrepared { id, reply })
            .await?
            .map_err(status)?;
        self.journal_forget(Space::Prepared, id);
        self.remote_prepared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        Ok(())
    }

    /// Releases the prepared lists a session prepared (it ended); those released already are
    /// skipped.
    pub(crate) async fn release_prepared_owned(&self, ids: Vec<u64>) {
        for id in ids {
            if *self.stopping.borrow() {
                return; // kept in the state directory for the next instance
            }
            self.same_node.released(id);
            match self.ask(|reply| Command::ReleasePrepared { id, reply }).await {
                Ok(Ok(())) => {
                    self.journal_forget(Space::Prepared, id);
                    self.remote_prepared
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                    tracing::debug!(prepared = id, "released with the session that prepared it")
                }
                Ok(Err(_)) => {}  // released by the client already
                Err(_) => return, // the daemon is shutting down
            }
        }
    }

    /// Starts a WRITE or READ by prepared entries.
    pub(crate) async fn start_prepared(
        &self,
        kind: TransferKind,
        transfer: Result<PreparedTransfer, EngineError>,
        deadline: Instant,
    ) -> Result<Started, Status> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.in");
        let transfer = transfer.map_err(status)?;
        if self.same_node.is_prepared(transfer.remote) {
            let op = match kind {
                TransferKind::Write => crate::metrics::Op::Write,
                TransferKind::Read => crate::metrics::Op::Read,
            };
            return self.same_node_prepared(op, transfer, deadline).await;
        }
        let (mut transfer, mut retries) = (transfer, 0);
        loop {
            // The other node may have restarted, or its pairing closed when idle, since: pair
            // with it again (nothing to do, and nothing copied, while its pairing is up).
            let token = {
                let remote = self.remote_prepared.lock().unwrap_or_else(|e| e.into_inner());
                remote
                    .get(&transfer.remote)
                    .filter(|t| {
                        self.peers
                            .by_node(&t.node_id)
                            .is_none_or(|p| !matches!(*p.link.borrow(), crate::poller::PeerLink::Up))
                    })
                    .cloned()
            };
            if let Some(token) = token {
                self.reach_token("remote_prepared_id", &token, deadline).await?;
            }
            let asked = self
                .ask(|reply| Command::StartPrepared {
                    kind,
                    transfer,
                    deadline,
                    reply,
                })
                .await?;
            match asked {
                Ok((id, rx, total)) => return Ok(self.started(id, rx, total)),
                Err(refused) => transfer = self.start_again(refused, &mut retries, deadline).await?,
            }
        }
    }

    /// The unary PrepareBlocks.
    pub(crate) async fn prepare_blocks_call(
        &self,
        req: Request<pb::PrepareBlocksRequest>,
    ) -> Result<Response<pb::PreparedBlocks>, Status> {
        let deadline = self.deadline(&req, 0);
        Ok(Response::new(
            self.prepare_blocks(req.into_inner(), deadline).await?,
        ))
    }

    /// The unary WritePrepared, as `write_call`.
    pub(crate) async fn write_prepared_call(
        &self,
        req: Request<pb::WritePreparedRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let deadline = self.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        let wait = r.wait;
        let started = self
            .start_prepared(TransferKind::Write, write_transfer(r, &self.buffers), deadline)
            .await?;
        self.answer(started, wait).await
    }

    /// The unary ReadPrepared, as `read_call`.
    pub(crate) async fn read_prepared_call(
        &self,
        req: Request<pb::ReadPreparedRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let deadline = self.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        let wait = r.wait;
        let started = self
            .start_prepared(TransferKind::Read, read_transfer(r, &self.buffers), deadline)
            .await?;
        self.answer(started, wait).await
    }
}

/// A token as the engine's remote list.
fn remote_list(t: BlockToken) -> RemoteList {
    RemoteList {
        list_id: t.list_id,
        access_key: t.key,
        blocks: t.blocks,
        block_len: t.block_len,
    }
}

/// A WritePrepared request's transfer, its index arrays unpacked (outer sums expanded, windows
/// read).
pub fn write_transfer(
    r: pb::WritePreparedRequest,
    buffers: &BufferRegistry,
) -> Result<PreparedTransfer, EngineError> {
    let local = SideIndices::local(&r.local_indices, r.local_outer.as_ref(), r.local_window.as_ref());
    let remote = SideIndices::remote(
        &r.remote_indices,
        r.remote_outer.as_ref(),
        r.remote_window.as_ref(),
    );
    transfer(
        r.local_prepared_id,
        local,
        r.remote_prepared_id,
        remote,
        r.notification,
        buffers,
    )
}

/// A ReadPrepared request's transfer, as [`write_transfer`] (the two requests carry the same
/// fields).
pub fn read_transfer(
    r: pb::ReadPreparedRequest,
    buffers: &BufferRegistry,
) -> Result<PreparedTransfer, EngineError> {
    let local = SideIndices::local(&r.local_indices, r.local_outer.as_ref(), r.local_window.as_ref());
    let remote = SideIndices::remote(
        &r.remote_indices,
        r.remote_outer.as_ref(),
        r.remote_window.as_ref(),
    );
    transfer(
        r.local_prepared_id,
        local,
        r.remote_prepared_id,
        remote,
        r.notification,
        buffers,
    )
}

/// A prepared transfer from its two prepared ids, their sides' indices as given, and the
/// notification.
fn transfer(
    local: u64,
    local_side: SideIndices,
    remote: u64,
    remote_side: SideIndices,
    notification: Vec<u8>,
    buffers: &BufferRegistry,
) -> Result<PreparedTransfer, EngineError> {
    Ok(PreparedTransfer {
        local,
        local_indices: local_side.resolve(buffers)?,
        remote,
        remote_indices: remote_side.resolve(buffers)?,
        notification,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn entries_and_indices_are_unpacked_and_their_shape_named() {
        assert_eq!(
            entries(&le(&[1, 2, 3, 0, 9, 1])).unwrap(),
            vec![
                PreparedEntry {
                    list: 1,
                    first: 2,
                    count: 3
                },
                PreparedEntry {
                    list: 0,
                    first: 9,
                    count: 1
                }
            ]
        );
        let e = entries(&[0; 13]).unwrap_err();
        assert_eq!(
            e.message,
            "entries: 13 bytes are not a whole number of 12-byte entries (three little-endian u32s each)"
        );
        assert_eq!(
            entries(&[]).unwrap_err().message,
            "entries: at least one entry is required"
        );
        let big = vec![0u8; (MAX_PREPARED_ENTRIES + 1) * 4];
        assert_eq!(
            indices("remote_indices", &big).unwrap_err().message,
            "remote_indices: 4194305 entries exceed the limit of 4194304"
        );
        assert_eq!(indices("local_indices", &le(&[7, 8])).unwrap(), vec![7, 8]);
        assert!(
            indices("local_indices", &[0; 6])
                .unwrap_err()
                .message
                .starts_with("local_indices: 6 bytes are not a whole number of 4-byte")
        );
    }

    fn outer(rows: &[u32], cols: &[u32]) -> pb::OuterIndices {
        pb::OuterIndices {
            rows: le(rows),
            cols: le(cols),
        }
    }

    #[test]
    fn outer_sums_expand_row_by_row() {
        let o = outer(&[0, 4096, 8192], &[7, 3, 4095]);
        assert_eq!(
            outer_indices("local_outer", &o).unwrap(),
            vec![7, 3, 4095, 4103, 4099, 8191, 8199, 8195, 12287]
        );
        // vLLM's pull: 64 regions of 4,096 blocks, 512 block ids.
        let rows: Vec<u32> = (0..64).map(|r| r * 4096).collect();
        let cols: Vec<u32> = (0..512).map(|c| (c * 7) % 4096).collect();
        let got = outer_indices("remote_outer", &outer(&rows, &cols)).unwrap();
        assert_eq!(got.len(), 32_768);
        for (r, row) in rows.iter().enumerate() {
            for (c, col) in cols.iter().enumerate() {
                assert_eq!(got[r * 512 + c], row + col);
            }
        }
        let top = outer_indices("x", &outer(&[u32::MAX - 5], &[0, 5])).unwrap();
        assert_eq!(top, vec![u32::MAX - 5, u32::MAX]);
    }

    fn side<'a>(
        packed: &'a [u8],
        o: Option<&'a pb::OuterIndices>,
        w: Option<&'a pb::IndexWindow>,
    ) -> SideIndices<'a> {
        SideIndices::remote(packed, o, w)
    }

    /// A registry with one host buffer of `size` bytes holding `fill` from offset 0, its id.
    fn host_buffer(size: u64, fill: &[u8]) -> (BufferRegistry, u64) {
        let reg = BufferRegistry::new("node-a", 1 << 30);
        let entry = reg.allocate_host(size, "ring").unwrap();
        entry.host_region().unwrap().write(0, fill).unwrap();
        let id = entry.id;
        reg.publish(entry).unwrap();
        (reg, id)
    }

    #[test]
    fn side_indices_take_one_form_and_name_the_fields() {
        let (reg, id) = host_buffer(4096, &le(&[9, 8, 7, 6, 5]));
        let o = outer(&[10], &[1, 2]);
        let w = pb::IndexWindow {
            buffer_id: id,
            offset: 4,
            count: 3,
        };
        let got = |s: SideIndices| s.resolve(&reg);
        assert_eq!(got(side(&le(&[3, 1]), None, None)).unwrap(), vec![3, 1]);
        assert_eq!(got(side(&[], Some(&o), None)).unwrap(), vec![11, 12]);
        assert_eq!(got(side(&[], None, Some(&w))).unwrap(), vec![8, 7, 6]);
        let msg = |s: SideIndices| got(s).unwrap_err().message;
        assert_eq!(
            msg(side(&le(&[1]), Some(&o), None)),
            "remote_indices, remote_outer: set one of them, not both"
        );
        assert_eq!(
            msg(side(&[], Some(&o), Some(&w))),
            "remote_outer, remote_window: set one of them, not both"
        );
        assert_eq!(
            msg(side(&le(&[1]), Some(&o), Some(&w))),
            "remote_indices, remote_outer, remote_window: set one of them, not several"
        );
        assert_eq!(
            msg(side(&[], None, None)),
            "remote_indices: at least one entry is required"
        );
    }

    #[test]
    fn hostile_windows_are_refused_naming_the_field_and_the_limit() {
        let (reg, id) = host_buffer(4096, &le(&[1, 2, 3]));
        let read = |buffer_id: u64, offset: u64, count: u32| {
            window_indices(
                "local_window",
                &pb::IndexWindow {
                    buffer_id,
                    offset,
                    count,
                },
                &reg,
            )
        };
        assert_eq!(read(id, 0, 3).unwrap(), vec![1, 2, 3]);
        assert_eq!(read(id, 4092, 1).unwrap(), vec![0]);
        assert_eq!(
            read(id, 0, 0).unwrap_err().message,
            "local_window.count: at least one entry is required"
        );
        assert_eq!(
            read(id, 0, (MAX_PREPARED_ENTRIES + 1) as u32)
                .unwrap_err()
                .message,
            "local_window.count: 4194305 indices exceed the limit of 4194304"
        );
        let e = read(id + 1, 0, 1).unwrap_err();
        assert_eq!(e.code, crate::engine::Code::NotFound);
        assert_eq!(
            e.message,
            format!("local_window.buffer_id: buffer {} does not exist", id + 1)
        );
        assert_eq!(
            read(id, 4093, 1).unwrap_err().message,
            format!(
                "local_window: 1 indices (4 bytes) at offset 4093 run past the end of buffer {id} (4096 bytes)"
            )
        );
        assert_eq!(
            read(id, u64::MAX - 2, 1).unwrap_err().message,
            format!(
                "local_window: 1 indices (4 bytes) at offset {} run past the end of buffer {id} (4096 bytes)",
                u64::MAX - 2
            )
        );
        assert_eq!(
            read(id, 0, 1025).unwrap_err().message,
            format!(
                "local_window: 1025 indices (4100 bytes) at offset 0 run past the end of buffer {id} (4096 bytes)"
            )
        );
    }

    #[test]
    fn hostile_outer_sums_are_refused_before_anything_is_allocated() {
        let msg = |o: pb::OuterIndices| outer_indices("local_outer", &o).unwrap_err().message;
        assert_eq!(
            msg(pb::OuterIndices {
                rows: vec![0; 5],
                cols: le(&[1])
            }),
            "local_outer.rows: 5 bytes are not a whole number of 4-byte little-endian values"
        );
        assert_eq!(
            msg(outer(&[1], &[])),
            "local_outer.cols: at least one value is required"
        );
        assert_eq!(
            msg(outer(&[], &[1])),
            "local_outer.rows: at least one value is required"
        );
        assert_eq!(
            msg(pb::OuterIndices {
                rows: le(&[0]),
                cols: vec![0; (MAX_PREPARED_ENTRIES + 1) * 4]
            }),
            "local_outer.cols: 4194305 values exceed the limit of 4194304"
        );
        // 4,096 × 2,048 = 8,388,608: refused from the two lengths alone.
        assert_eq!(
            msg(pb::OuterIndices {
                rows: vec![0; 4096 * 4],
                cols: vec![0; 2048 * 4]
            }),
            "local_outer: 4096 rows x 2048 cols = 8388608 entries exceed the limit of 4194304"
        );
        assert_eq!(
            msg(outer(&[5, u32::MAX - 2], &[0, 3])),
            format!(
                "local_outer: the largest row ({}) plus the largest col (3) exceed the u32 limit of {}",
                u32::MAX - 2,
                u32::MAX
            )
        );
    }
}

//! Prepared lists through the client API (docs/BLOCKS.md, "Prepared lists"): PrepareBlocks over
//! local lists or one other node's tokens, ReleasePrepared, and WritePrepared / ReadPrepared,
//! which name two prepared lists and two packed arrays of entry indices.
//!
//! Only the request's shape is checked here (packed arrays of whole values, counts within the
//! limits before anything is unpacked, tokens of one node, the peer); the entries and indices are
//! the engine's to check, once, naming the field.

use std::time::Instant;

use tonic::{Request, Response, Status};

use super::proto::v1 as pb;
use super::state::{DaemonState, status};
use super::transfers::Started;
use crate::block_token::BlockToken;
use crate::engine::{
    EngineError, MAX_PREPARED_ENTRIES, MAX_PREPARED_LISTS, PreparedEntry, PreparedInfo, RemoteList,
    TransferKind,
};
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
    if bytes.len() % 4 != 0 {
        return Err(EngineError::invalid(format!(
            "{field}: {} bytes are not a whole number of 4-byte little-endian indices",
            bytes.len()
        )));
    }
    check_count(field, bytes.len() / 4, "entries")?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

fn check_count(field: &str, n: usize, what: &str) -> Result<(), EngineError> {
    if n == 0 {
        return Err(EngineError::invalid(format!(
            "{field}: at least one entry is required"
        )));
    }
    if n > MAX_PREPARED_ENTRIES {
        return Err(EngineError::invalid(format!(
            "{field}: {n} {what} exceed the limit of {MAX_PREPARED_ENTRIES}"
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
                self.reach_token("remote_tokens[0]", &tokens[0], deadline).await?;
                let peer = self.peer_of("remote_tokens[0]", &tokens[0].node_id)?;
                let lists = tokens
                    .into_iter()
                    .map(|t| RemoteList {
                        list_id: t.list_id,
                        access_key: t.key,
                        blocks: t.blocks,
                        block_len: t.block_len,
                    })
                    .collect();
                self.ask(|reply| Command::PrepareRemote {
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
            if token.node_id == self.node_id {
                return Err(Status::invalid_argument(format!(
                    "{field}: names a list of this node ({}); a remote prepared list names another node's lists",
                    self.node_id
                )));
            }
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
        self.ask(|reply| Command::ReleasePrepared { id, reply })
            .await?
            .map_err(status)
    }

    /// Releases the prepared lists a session prepared (it ended); those released already are
    /// skipped.
    pub(crate) async fn release_prepared_owned(&self, ids: Vec<u64>) {
        for id in ids {
            match self.ask(|reply| Command::ReleasePrepared { id, reply }).await {
                Ok(Ok(())) => tracing::debug!(prepared = id, "released with the session that prepared it"),
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
        let (id, rx, total) = self
            .ask(|reply| Command::StartPrepared {
                kind,
                transfer,
                deadline,
                reply,
            })
            .await?
            .map_err(status)?;
        Ok(self.started(id, rx, total))
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
            .start_prepared(TransferKind::Write, write_transfer(r), deadline)
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
            .start_prepared(TransferKind::Read, read_transfer(r), deadline)
            .await?;
        self.answer(started, wait).await
    }
}

/// A WritePrepared request's transfer, its index arrays unpacked.
pub fn write_transfer(r: pb::WritePreparedRequest) -> Result<PreparedTransfer, EngineError> {
    Ok(PreparedTransfer {
        local: r.local_prepared_id,
        local_indices: indices("local_indices", &r.local_indices)?,
        remote: r.remote_prepared_id,
        remote_indices: indices("remote_indices", &r.remote_indices)?,
        notification: r.notification,
    })
}

/// A ReadPrepared request's transfer, its index arrays unpacked.
pub fn read_transfer(r: pb::ReadPreparedRequest) -> Result<PreparedTransfer, EngineError> {
    Ok(PreparedTransfer {
        local: r.local_prepared_id,
        local_indices: indices("local_indices", &r.local_indices)?,
        remote: r.remote_prepared_id,
        remote_indices: indices("remote_indices", &r.remote_indices)?,
        notification: r.notification,
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
}

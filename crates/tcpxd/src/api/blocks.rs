//! Block lists and block transfers through the client API (docs/BLOCKS.md): registering a list
//! (its layout from packed bytes), its token, and starting WRITE and READ transfers that name a
//! local list, a remote list's token and an index array for each.
//!
//! Only the request's shape is checked here (packed arrays of whole entries, a token, the
//! peer); the lists, indices and pair lengths are the engine's to check, once, naming the field.

use std::time::Instant;

use tonic::{Request, Response, Status};

use super::proto::v1 as pb;
use super::same_node::BlockPairs;
use super::state::{DaemonState, status};
use super::transfers::Started;
use crate::block_token::BlockToken;
use crate::engine::blocks::{BlockError, IndexArray, IndexEncoding, Layout, MAX_LIST_BLOCKS};
use crate::engine::{BlockSpec, EngineError, RemoteBlocks};
use crate::journal::{Record, Space};
use crate::metrics::Op;
use crate::poller::{Command, ListFacts};

fn invalid(e: BlockError) -> Status {
    status(EngineError::from(e))
}

/// Splits packed little-endian integers of `N` bytes, naming `field` when the bytes are not a
/// whole number of them or more than a list may hold.
fn unpack<const N: usize>(field: &str, bytes: &[u8]) -> Result<Vec<[u8; N]>, Status> {
    if bytes.len() % N != 0 {
        return Err(Status::invalid_argument(format!(
            "{field}: {} bytes are not a whole number of {N}-byte little-endian values",
            bytes.len()
        )));
    }
    let count = bytes.len() / N;
    if count > MAX_LIST_BLOCKS as usize {
        return Err(Status::invalid_argument(format!(
            "{field}: {count} blocks exceed the limit of {MAX_LIST_BLOCKS}"
        )));
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|c| c.try_into().expect("chunks_exact"))
        .collect())
}

fn offsets(field: &str, bytes: &[u8]) -> Result<Vec<u64>, Status> {
    Ok(unpack::<8>(field, bytes)?
        .into_iter()
        .map(u64::from_le_bytes)
        .collect())
}

/// A registration's layout, stored as compactly as the blocks allow (a uniform list whose offsets
/// step evenly is kept as strided).
pub(crate) fn layout(r: Option<pb::register_blocks_request::Layout>) -> Result<Layout, Status> {
    use pb::register_blocks_request::Layout as L;
    match r {
        Some(L::Strided(s)) => Ok(Layout::Strided {
            first: s.first,
            stride: s.stride,
            len: s.length,
            count: s.count,
        }),
        Some(L::Uniform(u)) => {
            let offsets = offsets("uniform.offsets", &u.offsets)?;
            Layout::compact(offsets, &[u64::from(u.length)]).map_err(invalid)
        }
        Some(L::Explicit(e)) => {
            let offsets = offsets("explicit.offsets", &e.offsets)?;
            let lens: Vec<u64> = unpack::<4>("explicit.lengths", &e.lengths)?
                .into_iter()
                .map(|b| u64::from(u32::from_le_bytes(b)))
                .collect();
            if lens.len() != offsets.len() {
                return Err(Status::invalid_argument(format!(
                    "explicit.lengths: {} lengths for {} offsets (give one per offset)",
                    lens.len(),
                    offsets.len()
                )));
            }
            Layout::compact(offsets, &lens).map_err(invalid)
        }
        None => Err(Status::invalid_argument(
            "layout: set one of strided, uniform, explicit",
        )),
    }
}

/// A transfer's indices on one side (`field`: `local_indices` or `remote_indices`).
pub(crate) fn indices(field: &str, r: Option<pb::BlockIndices>) -> Result<IndexArray, Status> {
    let r = r.unwrap_or_default();
    let encoding = match pb::IndexEncoding::try_from(r.encoding) {
        Ok(pb::IndexEncoding::U32) => IndexEncoding::U32Le,
        Ok(pb::IndexEncoding::Ranges) => IndexEncoding::Ranges,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "{field}.encoding: {} is not an IndexEncoding (0: u32, 1: ranges)",
                r.encoding
            )));
        }
    };
    IndexArray::parse(encoding, r.data, field).map_err(invalid)
}

impl DaemonState {
    /// The API's view of a list: its id, buffer, token, count and block length.
    pub(crate) fn block_list_pb(&self, f: &ListFacts) -> pb::BlockList {
        let addresses = self
            .buffers
            .get(f.buffer)
            .map(|b| self.buffers.descriptor(&b).addresses)
            .unwrap_or_default();
        let token = BlockToken {
            node_id: self.node_id.clone(),
            list_id: f.id,
            blocks: f.count,
            block_len: f.block_len,
            key: f.key,
            addresses,
        };
        pb::BlockList {
            id: f.id,
            buffer_id: f.buffer,
            token: token.encode(),
            count: f.count,
            block_length: f.block_len,
        }
    }

    pub(crate) async fn register_blocks(
        &self,
        r: pb::RegisterBlocksRequest,
    ) -> Result<pb::BlockList, Status> {
        self.buffers.get_as("buffer_id", r.buffer_id).map_err(status)?;
        let layout = layout(r.layout)?;
        let buffer = r.buffer_id;
        let (reattach, claim) = self.reattach_list(r.reattach_id, buffer)?;
        let facts = self
            .ask(|reply| Command::RegisterBlocks {
                buffer,
                layout,
                reattach,
                reply,
            })
            .await?
            .map_err(status)?;
        if let Err(e) = self.journal_record(Space::List, facts.id, Record::List { buffer }) {
            let _ = self.release_blocks(facts.id).await;
            return Err(e);
        }
        claim.keep();
        tracing::info!(
            list = facts.id,
            buffer,
            blocks = facts.count,
            "block list registered"
        );
        Ok(self.block_list_pb(&facts))
    }

    pub(crate) async fn release_blocks(&self, list: u64) -> Result<(), Status> {
        self.ask(|reply| Command::ReleaseBlocks { list, reply })
            .await?
            .map_err(status)?;
        self.journal_forget(Space::List, list);
        Ok(())
    }

    pub(crate) async fn describe_blocks(&self, list: u64) -> Result<pb::BlockList, Status> {
        let facts = self
            .ask(|reply| Command::DescribeBlocks { list, reply })
            .await?
            .map_err(status)?;
        Ok(self.block_list_pb(&facts))
    }

    /// Parses a transfer's remote token and indices and its local indices, pairing with the
    /// token's node first when needed.
    async fn block_spec(
        &self,
        local_list: u64,
        local: Option<pb::BlockIndices>,
        token: &str,
        remote: Option<pb::BlockIndices>,
        deadline: Instant,
    ) -> Result<BlockSpec, Status> {
        let token = BlockToken::parse("remote_token", token).map_err(status)?;
        if token.node_id == self.node_id {
            // `same_node_token` sends those elsewhere first.
            return Err(Status::internal(format!(
                "remote_token: names a list of this node ({}), which the block path does not carry",
                self.node_id
            )));
        }
        let local_indices = indices("local_indices", local)?;
        let remote_indices = indices("remote_indices", remote)?;
        self.reach_token("remote_token", &token, deadline).await?;
        let peer = self.peer_of("remote_token", &token.node_id)?;
        Ok(BlockSpec {
            local_list,
            local_indices,
            peer,
            remote: RemoteBlocks {
                list_id: token.list_id,
                access_key: token.key,
                blocks: token.blocks,
                block_len: token.block_len,
                indices: remote_indices,
            },
        })
    }

    /// Starts a block WRITE (waiting for the client's ready event first, if any).
    pub(crate) async fn start_write_blocks(
        &self,
        mut r: pb::WriteBlocksRequest,
        deadline: Instant,
    ) -> Result<Started, Status> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.in");
        let same_node = self.same_node_token(&r.remote_token);
        let spec = match same_node {
            Some(_) => None,
            None => Some(
                self.block_spec(
                    r.local_list_id,
                    r.local_indices.take(),
                    &r.remote_token,
                    r.remote_indices.take(),
                    deadline,
                )
                .await?,
            ),
        };
        if !r.ready_event_ipc_handle.is_empty() {
            let list = r.local_list_id;
            let facts = self
                .ask(|reply| Command::DescribeBlocks { list, reply })
                .await?
                .map_err(|e| {
                    Status::new(
                        tonic::Code::from_i32(e.code as i32),
                        e.message.replacen("list_id", "local_list_id", 1),
                    )
                })?;
            self.wait_ready_event(&r.ready_event_ipc_handle, std::iter::once(facts.buffer), deadline)
                .await?;
        }
        let Some(spec) = spec else {
            let token = same_node.expect("no spec: a same-node token");
            return self
                .same_node_blocks(
                    Op::Write,
                    BlockPairs {
                        local_list: r.local_list_id,
                        local_indices: indices("local_indices", r.local_indices)?,
                        token,
                        remote_indices: indices("remote_indices", r.remote_indices)?,
                    },
                    r.notification,
                    deadline,
                )
                .await;
        };
        let (mut spec, mut retries) = (spec, 0);
        loop {
            let asked = self
                .ask(|reply| Command::WriteBlocks {
                    spec,
                    notification: r.notification.clone(),
                    deadline,
                    reply,
                })
                .await?;
            match asked {
                Ok((id, rx, total)) => return Ok(self.started(id, rx, total)),
                Err(refused) => {
                    spec = self.start_again(refused, &mut retries, deadline).await?;
                    self.pair_again(&mut spec, &r.remote_token, deadline).await?;
                }
            }
        }
    }

    /// A block transfer's pairing closed when idle before it started: its node reached anew
    /// (`reach_token`), the spec names the new pairing.
    async fn pair_again(&self, spec: &mut BlockSpec, token: &str, deadline: Instant) -> Result<(), Status> {
        let token = BlockToken::parse("remote_token", token).map_err(status)?;
        self.reach_token("remote_token", &token, deadline).await?;
        spec.peer = self.peer_of("remote_token", &token.node_id)?;
        Ok(())
    }

    /// Starts a block READ.
    pub(crate) async fn start_read_blocks(
        &self,
        r: pb::ReadBlocksRequest,
        deadline: Instant,
    ) -> Result<Started, Status> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.in");
        if let Some(token) = self.same_node_token(&r.remote_token) {
            return self
                .same_node_blocks(
                    Op::Read,
                    BlockPairs {
                        local_list: r.local_list_id,
                        local_indices: indices("local_indices", r.local_indices)?,
                        token,
                        remote_indices: indices("remote_indices", r.remote_indices)?,
                    },
                    Vec::new(),
                    deadline,
                )
                .await;
        }
        let mut spec = self
            .block_spec(
                r.local_list_id,
                r.local_indices,
                &r.remote_token,
                r.remote_indices,
                deadline,
            )
            .await?;
        let mut retries = 0;
        loop {
            match self
                .ask(|reply| Command::ReadBlocks {
                    spec,
                    deadline,
                    reply,
                })
                .await?
            {
                Ok((id, rx, total)) => return Ok(self.started(id, rx, total)),
                Err(refused) => {
                    spec = self.start_again(refused, &mut retries, deadline).await?;
                    self.pair_again(&mut spec, &r.remote_token, deadline).await?;
                }
            }
        }
    }

    /// The unary WriteBlocks, as `write_call`.
    pub(crate) async fn write_blocks_call(
        &self,
        req: Request<pb::WriteBlocksRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let deadline = self.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        let wait = r.wait;
        let started = self.start_write_blocks(r, deadline).await?;
        self.answer(started, wait).await
    }

    /// The unary ReadBlocks, as `read_call`.
    pub(crate) async fn read_blocks_call(
        &self,
        req: Request<pb::ReadBlocksRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let deadline = self.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        let wait = r.wait;
        let started = self.start_read_blocks(r, deadline).await?;
        self.answer(started, wait).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::register_blocks_request::Layout as L;

    fn le64(v: &[u64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn layouts_are_read_from_packed_bytes_and_stored_compactly() {
        let strided = layout(Some(L::Uniform(pb::UniformBlocks {
            offsets: le64(&[100, 300, 500]),
            length: 64,
        })))
        .unwrap();
        assert_eq!(
            strided,
            Layout::Strided {
                first: 100,
                stride: 200,
                len: 64,
                count: 3
            }
        );
        let uniform = layout(Some(L::Uniform(pb::UniformBlocks {
            offsets: le64(&[0, 4096, 1024]),
            length: 512,
        })))
        .unwrap();
        assert_eq!(
            uniform,
            Layout::Uniform {
                offsets: vec![0, 4096, 1024],
                len: 512
            }
        );
        let explicit = layout(Some(L::Explicit(pb::ExplicitBlocks {
            offsets: le64(&[0, 10]),
            lengths: [5u32, 7].iter().flat_map(|x| x.to_le_bytes()).collect(),
        })))
        .unwrap();
        assert_eq!(
            explicit,
            Layout::Explicit {
                offsets: vec![0, 10],
                lens: vec![5, 7]
            }
        );
        for (bad, want) in [
            (None, "layout: set one of"),
            (
                Some(L::Uniform(pb::UniformBlocks {
                    offsets: vec![0; 12],
                    length: 1,
                })),
                "uniform.offsets: 12 bytes are not a whole number of 8-byte",
            ),
            (
                Some(L::Explicit(pb::ExplicitBlocks {
                    offsets: le64(&[0, 8]),
                    lengths: vec![1, 0, 0, 0],
                })),
                "explicit.lengths: 1 lengths for 2 offsets",
            ),
            (
                Some(L::Explicit(pb::ExplicitBlocks {
                    offsets: le64(&[0]),
                    lengths: vec![1, 0, 0],
                })),
                "explicit.lengths: 3 bytes are not a whole number of 4-byte",
            ),
        ] {
            let e = layout(bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(want), "{}", e.message());
        }
    }

    #[test]
    fn indices_name_their_field_and_encoding() {
        let a = indices(
            "local_indices",
            Some(pb::BlockIndices {
                encoding: pb::IndexEncoding::Ranges as i32,
                data: [3u32, 4].iter().flat_map(|x| x.to_le_bytes()).collect(),
            }),
        )
        .unwrap();
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![3, 4, 5, 6]);
        let e = indices("remote_indices", None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().starts_with("remote_indices: at least one block"),
            "{}",
            e.message()
        );
        let e = indices(
            "local_indices",
            Some(pb::BlockIndices {
                encoding: 7,
                data: vec![0; 4],
            }),
        )
        .unwrap_err();
        assert!(
            e.message().starts_with("local_indices.encoding: 7"),
            "{}",
            e.message()
        );
        let e = indices(
            "remote_indices",
            Some(pb::BlockIndices {
                encoding: 0,
                data: vec![0; 5],
            }),
        )
        .unwrap_err();
        assert!(
            e.message().starts_with("remote_indices: 5 bytes"),
            "{}",
            e.message()
        );
    }
}

//! The block-list subcommands: `blocks register|describe|release`, `write-blocks` and
//! `read-blocks` (docs/BLOCKS.md). Indices are written as ranges (`0-99,200`) or `@FILE`, and
//! travel in whichever encoding is smaller.

use serde_json::json;

use super::transfer::{after_start, apply_timeout, one_call, timeout_ms, waited};
use crate::cli::args::{BlocksCommand, BlocksRegisterArgs, ReadBlocksArgs, WriteBlocksArgs};
use crate::cli::error::{CliError, print_json, rpc};
use crate::client::{ApiClient, pack_indices, parse_size};
use tcpxd::api::proto::v1::{
    self as pb, BlockIndices, DescribeBlocksRequest, ReadBlocksRequest, RegisterBlocksRequest,
    ReleaseBlocksRequest, WriteBlocksRequest, register_blocks_request::Layout,
};
use tcpxd::engine::blocks::{IndexArray, MAX_TRANSFER_BLOCKS};

/// The text of an option: itself, or the file `@FILE` names.
fn text_of(option: &str, value: &str) -> Result<String, CliError> {
    match value.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|source| CliError::Io {
            what: format!("{option}: reading {path}"),
            source,
        }),
        None => Ok(value.to_string()),
    }
}

fn items(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
}

/// Parses block indices (`0-99,200,300-310`; ranges inclusive) into (start, count) runs, adjacent
/// runs merged. Errors name the item and why.
pub fn parse_indices(text: &str) -> Result<Vec<(u32, u32)>, String> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    let mut total = 0u64;
    for item in items(text) {
        let num = |s: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("{item:?}: {s:?} is not a block index (0 to {})", u32::MAX))
        };
        let (start, end) = match item.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let i = num(item)?;
                (i, i)
            }
        };
        if end < start {
            return Err(format!("{item:?}: the range ends before it starts"));
        }
        let count = u64::from(end - start) + 1;
        total += count;
        if total > MAX_TRANSFER_BLOCKS {
            return Err(format!(
                "more than {MAX_TRANSFER_BLOCKS} blocks (the most one transfer may move)"
            ));
        }
        let count = count as u32;
        match runs.last_mut() {
            Some((s, n)) if u64::from(*s) + u64::from(*n) == u64::from(start) => *n += count,
            _ => runs.push((start, count)),
        }
    }
    if runs.is_empty() {
        return Err("no block indices given".into());
    }
    Ok(runs)
}

/// Indices as they travel: ranges when that is smaller than a u32 each.
pub fn pack_runs(runs: &[(u32, u32)]) -> BlockIndices {
    let total: u64 = runs.iter().map(|&(_, n)| u64::from(n)).sum();
    let a = if runs.len() as u64 * 2 <= total {
        IndexArray::from_ranges(runs)
    } else {
        let flat: Vec<u32> = runs.iter().flat_map(|&(s, n)| s..s + n).collect();
        IndexArray::from_indices(&flat)
    };
    pack_indices(&a)
}

fn indices(option: &str, value: &str) -> Result<BlockIndices, CliError> {
    let text = text_of(option, value)?;
    parse_indices(&text)
        .map(|r| pack_runs(&r))
        .map_err(|e| CliError::Usage(format!("{option}: {e}")))
}

/// SIZE values, comma/space/newline separated.
fn sizes(option: &str, value: &str) -> Result<Vec<u64>, CliError> {
    let text = text_of(option, value)?;
    items(&text)
        .enumerate()
        .map(|(i, s)| parse_size(s).map_err(|e| CliError::Usage(format!("{option}[{i}]: {e}"))))
        .collect()
}

fn u32_len(option: &str, v: u64) -> Result<u32, CliError> {
    u32::try_from(v).map_err(|_| {
        CliError::Usage(format!(
            "{option}: {v} bytes exceed the limit of {} per block",
            u32::MAX
        ))
    })
}

/// The layout a `blocks register` asks for. `buffer_size`: for tiling the whole buffer.
async fn layout(client: &mut ApiClient, a: &BlocksRegisterArgs) -> Result<Layout, CliError> {
    let le64 = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    if let Some(offsets) = &a.offsets {
        let offsets = sizes("--offsets", offsets)?;
        return Ok(match (&a.lengths, a.block_size) {
            (Some(lengths), _) => {
                let lengths = sizes("--lengths", lengths)?;
                let mut packed = Vec::with_capacity(lengths.len() * 4);
                for l in lengths {
                    packed.extend_from_slice(&u32_len("--lengths", l)?.to_le_bytes());
                }
                Layout::Explicit(pb::ExplicitBlocks {
                    offsets: le64(&offsets),
                    lengths: packed,
                })
            }
            (None, Some(bs)) => Layout::Uniform(pb::UniformBlocks {
                offsets: le64(&offsets),
                length: u32_len("--block-size", bs)?,
            }),
            (None, None) => {
                return Err(CliError::Usage(
                    "--offsets: give --block-size or --lengths".into(),
                ));
            }
        });
    }
    let bs = a
        .block_size
        .ok_or_else(|| CliError::Usage("--block-size is required without --offsets".into()))?;
    let length = u32_len("--block-size", bs)?;
    let count = match a.count {
        Some(n) => n,
        None => {
            let b = client
                .describe_buffer(pb::DescribeBufferRequest { buffer_id: a.buffer })
                .await
                .map_err(rpc("describing the buffer"))?
                .into_inner();
            let n = b.size / bs.max(1);
            u32::try_from(n).map_err(|_| {
                CliError::Usage(format!(
                    "--block-size: the buffer holds {n} blocks of it, over a list's limit"
                ))
            })?
        }
    };
    Ok(Layout::Strided(pb::StridedBlocks {
        first: a.first.unwrap_or(0),
        stride: a.stride.unwrap_or(bs),
        length,
        count,
    }))
}

fn print_list(json: bool, l: &pb::BlockList) -> Result<(), CliError> {
    if json {
        print_json(&json!({
            "id": l.id,
            "buffer_id": l.buffer_id,
            "count": l.count,
            "block_length": l.block_length,
            "token": l.token,
        }))?;
    } else {
        let len = if l.block_length > 0 {
            crate::client::format_bytes(u64::from(l.block_length))
        } else {
            "mixed lengths".into()
        };
        outln!(
            "list {} in buffer {}: {} blocks, {len}",
            l.id,
            l.buffer_id,
            l.count
        );
        outln!("token: {}", l.token);
    }
    Ok(())
}

pub(super) async fn blocks(client: &mut ApiClient, json: bool, cmd: BlocksCommand) -> Result<(), CliError> {
    match cmd {
        BlocksCommand::Register(a) => {
            let layout = layout(client, &a).await?;
            let l = client
                .register_blocks(RegisterBlocksRequest {
                    reattach_id: Default::default(),
                    buffer_id: a.buffer,
                    layout: Some(layout),
                })
                .await
                .map_err(rpc("registering the list"))?
                .into_inner();
            if a.quiet {
                outln!("{}", l.token);
                Ok(())
            } else {
                print_list(json, &l)
            }
        }
        BlocksCommand::Describe(a) => {
            let l = client
                .describe_blocks(DescribeBlocksRequest { list_id: a.list_id })
                .await
                .map_err(rpc(format!("describing list {}", a.list_id)))?
                .into_inner();
            print_list(json, &l)
        }
        BlocksCommand::Release(a) => {
            client
                .release_blocks(ReleaseBlocksRequest { list_id: a.list_id })
                .await
                .map_err(rpc(format!("releasing list {}", a.list_id)))?;
            if json {
                print_json(&json!({"list_id": a.list_id, "released": true}))?;
            } else {
                outln!("list {} released", a.list_id);
            }
            Ok(())
        }
    }
}

pub(super) async fn write_blocks(
    client: &mut ApiClient,
    json: bool,
    args: WriteBlocksArgs,
) -> Result<(), CliError> {
    let mut request = tonic::Request::new(WriteBlocksRequest {
        local_list_id: args.list,
        local_indices: Some(indices("--indices", &args.indices)?),
        remote_token: args.remote.clone(),
        remote_indices: Some(indices("--remote-indices", &args.remote_indices)?),
        notification: args.notify.clone().map(String::into_bytes).unwrap_or_default(),
        timeout_ms: timeout_ms(&args.wait),
        ready_event_ipc_handle: Vec::new(),
        wait: one_call(json, &args.wait),
    });
    let deadline = apply_timeout(&mut request, &args.wait);
    if request.get_ref().wait {
        let mut caller = client.clone();
        return waited(
            client,
            caller.write_blocks(request),
            json,
            "write-blocks",
            deadline,
        )
        .await;
    }
    let started = client
        .write_blocks(request)
        .await
        .map_err(rpc("write-blocks"))?
        .into_inner();
    after_start(client, json, "write-blocks", started, &args.wait, deadline).await
}

pub(super) async fn read_blocks(
    client: &mut ApiClient,
    json: bool,
    args: ReadBlocksArgs,
) -> Result<(), CliError> {
    let mut request = tonic::Request::new(ReadBlocksRequest {
        remote_token: args.remote.clone(),
        remote_indices: Some(indices("--remote-indices", &args.remote_indices)?),
        local_list_id: args.list,
        local_indices: Some(indices("--indices", &args.indices)?),
        timeout_ms: timeout_ms(&args.wait),
        wait: one_call(json, &args.wait),
    });
    let deadline = apply_timeout(&mut request, &args.wait);
    if request.get_ref().wait {
        let mut caller = client.clone();
        return waited(client, caller.read_blocks(request), json, "read-blocks", deadline).await;
    }
    let started = client
        .read_blocks(request)
        .await
        .map_err(rpc("read-blocks"))?
        .into_inner();
    after_start(client, json, "read-blocks", started, &args.wait, deadline).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_parse_as_merged_runs_and_pack_compactly() {
        assert_eq!(parse_indices("0-99,200").unwrap(), vec![(0, 100), (200, 1)]);
        assert_eq!(parse_indices("5 6\n7,9-9").unwrap(), vec![(5, 3), (9, 1)]);
        let p = pack_runs(&[(0, 100), (200, 1)]);
        assert_eq!(p.encoding, pb::IndexEncoding::Ranges as i32);
        assert_eq!(p.data.len(), 16);
        let p = pack_runs(&parse_indices("3,1,2").unwrap());
        assert_eq!(p.encoding, pb::IndexEncoding::U32 as i32);
        assert_eq!(
            p.data,
            [3u32, 1, 2]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>()
        );
        for (bad, why) in [
            ("", "no block indices"),
            ("4-2", "ends before it starts"),
            ("x", "is not a block index"),
            ("-1", "is not a block index"),
            ("0-4294967295", "more than 4194304 blocks"),
        ] {
            let e = parse_indices(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}

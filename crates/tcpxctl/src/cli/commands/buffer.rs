//! `tcpxctl buffer ...`: registering, listing, describing, re-keying, releasing, filling,
//! reading and checksumming buffers.

use std::io::Write as _;

use serde_json::json;

use crate::cli::args::{BufferCommand, BufferReadArgs, ChecksumArgs, FillArgs, RegisterArgs};
use crate::cli::error::{CliError, emit, print_json, rpc};
use crate::cli::output::{buffer_json, buffer_text, buffers_table, hexdump};
use crate::client::{ApiClient, format_bytes};
use tcpxd::api::proto::v1::register_buffer_request::Source;
use tcpxd::api::proto::v1::{
    Buffer, ChecksumBufferRequest, CudaAllocation, DescribeBufferRequest, FillBufferRequest, HostAllocation,
    ListBuffersRequest, ReadBufferRequest, RegisterBufferRequest, ReleaseBufferRequest, fill_buffer_request,
};

/// The most ReadBuffer returns per call.
const READ_BUFFER_MAX: u64 = 1 << 20;

pub(super) async fn buffer(client: &mut ApiClient, json: bool, cmd: BufferCommand) -> Result<(), CliError> {
    match cmd {
        BufferCommand::Register(args) => register(client, json, args).await,
        BufferCommand::List => {
            let buffers = client
                .list_buffers(ListBuffersRequest {})
                .await
                .map_err(rpc("listing buffers"))?
                .into_inner()
                .buffers;
            if json {
                print_json(&json!(buffers.iter().map(buffer_json).collect::<Vec<_>>()))?;
            } else if buffers.is_empty() {
                outln!("no buffers");
            } else {
                out!("{}", buffers_table(&buffers));
            }
            Ok(())
        }
        BufferCommand::Describe(args) => {
            let b = client
                .describe_buffer(DescribeBufferRequest { buffer_id: args.id })
                .await
                .map_err(rpc(format!("describing buffer {}", args.id)))?
                .into_inner();
            show(&b, json, args.quiet)
        }
        BufferCommand::Rekey(args) => {
            let b = client
                .rekey_buffer(tcpxd::api::proto::v1::RekeyBufferRequest { buffer_id: args.id })
                .await
                .map_err(rpc(format!("re-keying buffer {}", args.id)))?
                .into_inner();
            show(&b, json, args.quiet)
        }
        BufferCommand::Release(args) => {
            client
                .release_buffer(ReleaseBufferRequest { buffer_id: args.id })
                .await
                .map_err(rpc(format!("releasing buffer {}", args.id)))?;
            if json {
                print_json(&json!({"released": args.id}))?;
            } else {
                outln!("buffer {} released", args.id);
            }
            Ok(())
        }
        BufferCommand::Fill(args) => fill(client, json, args).await,
        BufferCommand::Read(args) => read_buffer(client, json, args).await,
        BufferCommand::Checksum(args) => checksum(client, json, args).await,
    }
}

async fn register(client: &mut ApiClient, json: bool, args: RegisterArgs) -> Result<(), CliError> {
    let cuda = args.cuda().map_err(CliError::Usage)?;
    let source = match (args.host, cuda) {
        (Some(size), _) => Source::Host(HostAllocation { size }),
        (None, Some((device, size))) => Source::Cuda(CudaAllocation { device, size }),
        (None, None) => return Err(CliError::Usage("give --host SIZE or --cuda DEVICE SIZE".into())),
    };
    let b = client
        .register_buffer(RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
            source: Some(source),
            label: args.label,
        })
        .await
        .map_err(rpc("registering a buffer"))?
        .into_inner();
    show(&b, json, args.quiet)
}

/// A buffer as JSON, as `key: value` lines, or (`quiet`) its descriptor alone.
fn show(b: &Buffer, json: bool, quiet: bool) -> Result<(), CliError> {
    if quiet {
        outln!("{}", b.descriptor);
    } else if json {
        print_json(&buffer_json(b))?;
    } else {
        out!("{}", buffer_text(b));
    }
    Ok(())
}

async fn fill(client: &mut ApiClient, json: bool, args: FillArgs) -> Result<(), CliError> {
    let (pattern, text) = match (args.pattern.byte, args.pattern.seed, args.pattern.repeat) {
        (Some(b), _, _) => (
            fill_buffer_request::Pattern::Byte(u32::from(b)),
            format!("byte 0x{b:02x}"),
        ),
        (_, Some(s), _) => (fill_buffer_request::Pattern::Seed(s), format!("seed {s}")),
        (_, _, Some(r)) => {
            let text = format!("pattern 0x{} ({} bytes)", hex::encode(&r.0), r.0.len());
            (fill_buffer_request::Pattern::Repeat(r.0), text)
        }
        _ => return Err(CliError::Usage("give --byte, --seed or --repeat".into())),
    };
    client
        .fill_buffer(FillBufferRequest {
            buffer_id: args.id,
            offset: args.offset,
            length: args.length,
            pattern: Some(pattern),
        })
        .await
        .map_err(rpc(format!("filling buffer {}", args.id)))?;
    let range = if args.length == 0 {
        format!("from {} to the end", args.offset)
    } else {
        format!("{}..{}", args.offset, args.offset.saturating_add(args.length))
    };
    if json {
        print_json(&json!({"buffer_id": args.id, "offset": args.offset, "length": args.length}))?;
    } else {
        outln!("buffer {} {range} filled with {text}", args.id);
    }
    Ok(())
}

async fn read_buffer(client: &mut ApiClient, json: bool, args: BufferReadArgs) -> Result<(), CliError> {
    if args.length == 0 {
        return Err(CliError::Usage("--length must be at least 1 byte".into()));
    }
    let end = args
        .offset
        .checked_add(args.length)
        .ok_or_else(|| CliError::Usage("--offset + --length overflows".into()))?;
    if args.length > READ_BUFFER_MAX {
        // Several requests: check the whole range first, so a bad one prints nothing.
        let b = client
            .describe_buffer(DescribeBufferRequest { buffer_id: args.id })
            .await
            .map_err(rpc(format!("describing buffer {}", args.id)))?
            .into_inner();
        if end > b.size {
            return Err(CliError::Usage(format!(
                "range {}..{end} is past the end of buffer {} ({} bytes)",
                args.offset, args.id, b.size
            )));
        }
    }
    let mut file = match &args.out {
        Some(path) => Some(std::fs::File::create(path).map_err(|source| CliError::Io {
            what: format!("creating {}", path.display()),
            source,
        })?),
        None => None,
    };
    let mut all_hex = String::new();
    let mut pos = args.offset;
    while pos < end {
        let length = (end - pos).min(READ_BUFFER_MAX);
        let data = client
            .read_buffer(ReadBufferRequest {
                buffer_id: args.id,
                offset: pos,
                length,
            })
            .await
            .map_err(rpc(format!("reading buffer {} at {pos}", args.id)))?
            .into_inner()
            .data;
        if data.is_empty() {
            return Err(CliError::Usage(format!(
                "buffer {} returned no data at offset {pos}",
                args.id
            )));
        }
        let io = |source| CliError::Io {
            what: "writing the output".to_string(),
            source,
        };
        match (&mut file, json) {
            (Some(f), _) => f.write_all(&data).map_err(io)?,
            (None, true) => all_hex.push_str(&hex::encode(&data)),
            (None, false) => emit(&hexdump(&data, pos))?,
        }
        pos += data.len() as u64;
    }
    if let (Some(path), true) = (&args.out, json) {
        print_json(
            &json!({"buffer_id": args.id, "offset": args.offset, "length": args.length, "out": path.display().to_string()}),
        )?;
    } else if json {
        print_json(
            &json!({"buffer_id": args.id, "offset": args.offset, "length": args.length, "data_hex": all_hex}),
        )?;
    } else if let Some(path) = &args.out {
        eprintln!("wrote {} to {}", format_bytes(args.length), path.display());
    }
    Ok(())
}

async fn checksum(client: &mut ApiClient, json: bool, args: ChecksumArgs) -> Result<(), CliError> {
    let r = client
        .checksum_buffer(ChecksumBufferRequest {
            buffer_id: args.id,
            offset: args.offset,
            length: args.length,
        })
        .await
        .map_err(rpc(format!("checksum of buffer {}", args.id)))?
        .into_inner();
    if json {
        print_json(&json!({
            "buffer_id": args.id,
            "offset": args.offset,
            "length": r.length,
            "crc32c": format!("{:08x}", r.crc32c),
        }))?;
    } else {
        outln!(
            "crc32c {:08x}  length {} ({})",
            r.crc32c,
            r.length,
            format_bytes(r.length)
        );
    }
    Ok(())
}

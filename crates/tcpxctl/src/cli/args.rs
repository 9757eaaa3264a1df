//! tcpxctl's client subcommands and options (clap derive), and the value parsers they use.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args, Subcommand};

use crate::bench::{DEFAULT_STEP, Op};
use crate::client::{DEFAULT_ENDPOINT, parse_size};

/// How SIZE values are written, shown under the help of the commands that take them.
pub const SIZE_HELP: &str = "SIZE values are bytes, optionally with a unit: 4096, 0x1000, 4K, 4KiB, 1.5M, 1G, 2T. \
Every unit is 1024-based: K, KB and KiB all mean 1024 bytes.";

/// Options every client subcommand understands (given before or after the subcommand).
#[derive(Args, Debug, Clone)]
pub struct GlobalOpts {
    /// The daemon's client API: unix:/path, /path, host:port or http://host:port.
    #[arg(
        long,
        global = true,
        env = "TCPXD_ENDPOINT",
        default_value = DEFAULT_ENDPOINT,
        value_name = "ENDPOINT"
    )]
    pub endpoint: String,
    /// Print machine-readable JSON instead of tables and progress bars.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The subcommands that talk to a daemon (and `demo`, which starts two).
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Register, inspect, fill, read, checksum and release buffers.
    #[command(after_help = SIZE_HELP)]
    #[command(subcommand)]
    Buffer(BufferCommand),
    /// Connect to and list peer daemons.
    #[command(subcommand)]
    Peer(PeerCommand),
    /// Describe the daemon's node: id, the peer addresses its descriptors carry, version,
    /// plugin, network devices, GPUs.
    Describe,
    /// WRITE a local range into a remote buffer, and follow it to the end.
    #[command(after_help = SIZE_HELP)]
    Write(WriteArgs),
    /// READ a remote range into a local buffer, and follow it to the end.
    #[command(after_help = SIZE_HELP)]
    Read(ReadArgs),
    /// Register, describe and release block lists (blocks inside a buffer, moved by index).
    #[command(after_help = SIZE_HELP)]
    #[command(subcommand)]
    Blocks(BlocksCommand),
    /// WRITE blocks of a local list into blocks of a remote list (its token), pair by pair.
    #[command(after_help = INDICES_HELP)]
    WriteBlocks(WriteBlocksArgs),
    /// READ blocks of a remote list (its token) into blocks of a local list, pair by pair.
    #[command(after_help = INDICES_HELP)]
    ReadBlocks(ReadBlocksArgs),
    /// Follow a transfer's progress until it finishes.
    Watch(TransferIdArgs),
    /// Wait for a transfer's final status (no progress bar).
    Wait(TransferIdArgs),
    /// Cancel a transfer on both sides.
    Cancel(TransferIdArgs),
    /// Print notifications other nodes attach to transfers into this node's buffers.
    Subscribe(SubscribeArgs),
    /// Counters per peer and lane, and transfer totals and latencies.
    Stats(StatsArgs),
    /// Ask the daemon's gRPC health service whether the client API serves (exit 0 when SERVING,
    /// 1 otherwise): for readiness probes, and with --wait for scripts that start a daemon.
    Health(HealthArgs),
    /// Start two local daemons on the emulation plugin and move data between them.
    #[command(after_help = SIZE_HELP)]
    Demo(DemoArgs),
    /// Measure transfers: through two daemons, or through the plugin directly.
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// Sizes accept K, M, G and T suffixes; all are 1024-based (K = KB = KiB = 1024 bytes).
#[derive(Subcommand, Debug)]
pub enum BufferCommand {
    /// Register a buffer and print its id, size and descriptor.
    #[command(after_help = SIZE_HELP)]
    Register(RegisterArgs),
    /// List every registered buffer.
    List,
    /// Describe one buffer, descriptor included.
    Describe(BufferShowArgs),
    /// Release a buffer (fails while transfers use it).
    Release(BufferIdArgs),
    /// Give a buffer a new access key and print its new descriptor: every descriptor handed out
    /// before stops working.
    Rekey(BufferShowArgs),
    /// Fill a range with a byte, a seeded pseudo-random stream or a repeated hex pattern.
    #[command(after_help = SIZE_HELP)]
    Fill(FillArgs),
    /// Read a range: a hexdump to stdout (as xxd prints it), or the raw bytes to a file.
    #[command(after_help = SIZE_HELP)]
    Read(BufferReadArgs),
    /// CRC-32C (Castagnoli) of a range.
    #[command(after_help = SIZE_HELP)]
    Checksum(ChecksumArgs),
}

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("memory").required(true).multiple(false).args(["host", "cuda"])))]
pub struct RegisterArgs {
    /// Daemon-allocated host memory of SIZE bytes (K, M, G, T: 1024-based).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub host: Option<u64>,
    /// Daemon-allocated CUDA memory on DEVICE (needs the daemon's GPU data path).
    #[arg(long, num_args = 2, value_names = ["DEVICE", "SIZE"])]
    pub cuda: Option<Vec<String>>,
    /// A label shown in listings (at most 128 bytes).
    #[arg(long, default_value = "")]
    pub label: String,
    /// Print only the buffer's descriptor (for `D=$(tcpxctl buffer register ... --quiet)`).
    #[arg(long, short)]
    pub quiet: bool,
}

impl RegisterArgs {
    /// The `--cuda DEVICE SIZE` pair, parsed.
    pub fn cuda(&self) -> Result<Option<(u32, u64)>, String> {
        let Some(values) = &self.cuda else {
            return Ok(None);
        };
        let [device, size] = values.as_slice() else {
            return Err("--cuda takes DEVICE and SIZE".to_string());
        };
        let device: u32 = device
            .parse()
            .map_err(|_| format!("--cuda: bad device ordinal {device:?}"))?;
        let size = parse_size(size).map_err(|e| format!("--cuda: {e}"))?;
        Ok(Some((device, size)))
    }
}

#[derive(Args, Debug)]
pub struct BufferIdArgs {
    /// The buffer's id.
    pub id: u64,
}

/// A buffer to describe (or re-key) and print.
#[derive(Args, Debug)]
pub struct BufferShowArgs {
    /// The buffer's id.
    pub id: u64,
    /// Print only the buffer's descriptor (for `D=$(tcpxctl buffer rekey 1 --quiet)`).
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct FillArgs {
    /// The buffer's id.
    pub id: u64,
    /// Where the range starts.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub offset: u64,
    /// Bytes to fill; 0 (the default) means to the end of the buffer.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub length: u64,
    #[command(flatten)]
    pub pattern: FillPattern,
}

#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct FillPattern {
    /// Every byte set to B (0..255, decimal or 0x hex).
    #[arg(long, value_name = "B", value_parser = parse_byte)]
    pub byte: Option<u8>,
    /// A deterministic pseudo-random stream seeded by S; byte i depends only on S and offset+i.
    #[arg(long, value_name = "S", value_parser = parse_u64)]
    pub seed: Option<u64>,
    /// This hex sequence repeated, e.g. deadbeef or 0xde_ad_be_ef (1 byte to 1 MiB).
    #[arg(long, value_name = "HEX", value_parser = parse_hex_pattern)]
    pub repeat: Option<HexBytes>,
}

#[derive(Args, Debug)]
pub struct BufferReadArgs {
    /// The buffer's id.
    pub id: u64,
    /// Where the range starts.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub offset: u64,
    /// Bytes to read (read in 1 MiB requests when larger).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub length: u64,
    /// Write the raw bytes to FILE instead of a hexdump to stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ChecksumArgs {
    /// The buffer's id.
    pub id: u64,
    /// Where the range starts.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub offset: u64,
    /// Bytes to checksum; 0 (the default) means to the end of the buffer.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub length: u64,
}

#[derive(Subcommand, Debug)]
pub enum PeerCommand {
    /// Connect to another node's daemon (its peer address, host:port) and open the data lanes.
    Connect(PeerConnectArgs),
    /// List known peers with their state.
    List,
}

#[derive(Args, Debug)]
pub struct PeerConnectArgs {
    /// The peer daemon's peer-service address, e.g. 10.0.0.2:50052.
    pub address: String,
}

/// Deadline and waiting, shared by `write` and `read`.
#[derive(Args, Debug, Clone)]
pub struct WaitOpts {
    /// The transfer's deadline in seconds (becomes the call's gRPC deadline); else the daemon's
    /// default.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub timeout: Option<Duration>,
    /// Print the transfer id and return at once instead of following the transfer.
    #[arg(long)]
    pub no_wait: bool,
}

#[derive(Args, Debug)]
pub struct WriteArgs {
    /// The local source: a buffer id, optionally with an offset (`7`, `7:4K`).
    #[arg(long, value_name = "ID[:OFFSET]", value_parser = parse_local_ref)]
    pub local: LocalRef,
    /// The remote buffer's descriptor (its `Buffer.descriptor` on the other node).
    #[arg(long, value_name = "DESCRIPTOR")]
    pub remote: String,
    /// Offset in the remote buffer.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub remote_offset: u64,
    /// Bytes to move.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub length: u64,
    /// Text delivered to the remote node's subscribers once the data has landed.
    #[arg(long, value_name = "TEXT")]
    pub notify: Option<String>,
    #[command(flatten)]
    pub wait: WaitOpts,
}

#[derive(Args, Debug)]
pub struct ReadArgs {
    /// The remote buffer's descriptor (its `Buffer.descriptor` on the other node).
    #[arg(long, value_name = "DESCRIPTOR")]
    pub remote: String,
    /// Offset in the remote buffer.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "0")]
    pub remote_offset: u64,
    /// The local destination: a buffer id, optionally with an offset (`7`, `7:4K`).
    #[arg(long, value_name = "ID[:OFFSET]", value_parser = parse_local_ref)]
    pub local: LocalRef,
    /// Bytes to move.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub length: u64,
    #[command(flatten)]
    pub wait: WaitOpts,
}

/// How block indices are written, shown under the help of the commands that take them.
pub const INDICES_HELP: &str = "INDICES are block indices and inclusive ranges, comma-separated \
(0-99,200,300-310), or @FILE: a file of the same, separated by commas, spaces or newlines. They \
travel as (start, count) ranges when that is smaller. Block k of one side's indices is copied \
into block k of the other's: both name as many blocks, pairs equal in length.";

#[derive(Subcommand, Debug)]
pub enum BlocksCommand {
    /// Register a list of blocks inside a buffer and print its id, count and token. The blocks:
    /// --block-size alone tiles the whole buffer; with --count (and --first, --stride) they are
    /// strided; with --offsets of one size (uniform) or --lengths each (explicit).
    #[command(after_help = SIZE_HELP)]
    Register(BlocksRegisterArgs),
    /// Describe a list: its count, block length and token (with its buffer's current key).
    Describe(ListIdArgs),
    /// Release a list (its token stops working).
    Release(ListIdArgs),
}

#[derive(Args, Debug)]
pub struct BlocksRegisterArgs {
    /// The buffer the blocks lie in.
    #[arg(long, value_name = "ID")]
    pub buffer: u64,
    /// Every block's length (strided, uniform, or tiling the buffer).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, required_unless_present = "lengths")]
    pub block_size: Option<u64>,
    /// Strided: the number of blocks.
    #[arg(long, value_name = "N", conflicts_with_all = ["offsets", "lengths"])]
    pub count: Option<u32>,
    /// Strided: the first block's offset.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "count")]
    pub first: Option<u64>,
    /// Strided: bytes from one block's start to the next's [default: --block-size].
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "count")]
    pub stride: Option<u64>,
    /// The blocks' offsets: comma-separated SIZE values, or @FILE of them (commas, spaces or
    /// newlines between).
    #[arg(long, value_name = "LIST|@FILE")]
    pub offsets: Option<String>,
    /// Explicit: each block's length, as --offsets.
    #[arg(
        long,
        value_name = "LIST|@FILE",
        requires = "offsets",
        conflicts_with = "block_size"
    )]
    pub lengths: Option<String>,
    /// Print only the token (for `T=$(tcpxctl blocks register ... --quiet)`).
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct ListIdArgs {
    /// The list id RegisterBlocks returned.
    pub list_id: u64,
}

#[derive(Args, Debug)]
pub struct WriteBlocksArgs {
    /// The local list (the source).
    #[arg(long, value_name = "ID")]
    pub list: u64,
    /// The local list's blocks to send.
    #[arg(long, value_name = "INDICES")]
    pub indices: String,
    /// The remote list's token (its BlockList.token on the other node).
    #[arg(long, value_name = "TOKEN")]
    pub remote: String,
    /// The remote list's blocks to fill.
    #[arg(long, value_name = "INDICES")]
    pub remote_indices: String,
    /// Text delivered to the remote node's subscribers once the data has landed.
    #[arg(long, value_name = "TEXT")]
    pub notify: Option<String>,
    #[command(flatten)]
    pub wait: WaitOpts,
}

#[derive(Args, Debug)]
pub struct ReadBlocksArgs {
    /// The remote list's token (the source).
    #[arg(long, value_name = "TOKEN")]
    pub remote: String,
    /// The remote list's blocks to read.
    #[arg(long, value_name = "INDICES")]
    pub remote_indices: String,
    /// The local list (the destination).
    #[arg(long, value_name = "ID")]
    pub list: u64,
    /// The local list's blocks to fill.
    #[arg(long, value_name = "INDICES")]
    pub indices: String,
    #[command(flatten)]
    pub wait: WaitOpts,
}

#[derive(Args, Debug)]
pub struct TransferIdArgs {
    /// The transfer id Write/Read returned.
    pub transfer_id: u64,
}

#[derive(Args, Debug)]
pub struct SubscribeArgs {
    /// Exit after N notifications (default: run until interrupted). Once subscribed, a line on
    /// stderr says so: notifications sent before it are not delivered.
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// Refresh every SECS seconds (with per-lane rates) until Ctrl-C, or --count times.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub watch: Option<Duration>,
    /// With --watch: stop after N refreshes.
    #[arg(long, value_name = "N", requires = "watch", value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
}

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// Keep asking for up to SECS seconds until the service is SERVING (a daemon still starting
    /// refuses connections): exit 0 as soon as it serves, 1 with the last answer when time runs out.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub wait: Option<Duration>,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Bytes to move each way (K, M, G, T: 1024-based).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "1GiB")]
    pub size: u64,
    /// Chunk size passed to both daemons (`tcpxd --chunk-bytes`); the daemons' default if unset.
    #[arg(long, value_name = "N", value_parser = parse_size)]
    pub chunk_bytes: Option<u64>,
    /// Keep the temporary directory (sockets, ready files, daemon logs) after a successful run;
    /// it is always kept after a failure.
    #[arg(long)]
    pub keep_dir: bool,
    /// The tcpxd binary to start (default: `tcpxd` next to tcpxctl).
    #[arg(long, value_name = "PATH")]
    pub daemon: Option<PathBuf>,
    /// Seconds to wait for each daemon's ready file.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "30")]
    pub ready_timeout: Duration,
}

/// `ID[:OFFSET]`: a local buffer and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRef {
    pub buffer_id: u64,
    pub offset: u64,
}

/// Parses `ID[:OFFSET]` (`7`, `7:4096`, `7:4K`, `7:0x1000`).
pub fn parse_local_ref(s: &str) -> Result<LocalRef, String> {
    let (id, offset) = match s.split_once(':') {
        Some((id, offset)) => (id, Some(offset)),
        None => (s, None),
    };
    let buffer_id = parse_u64(id.trim()).map_err(|_| {
        format!("bad local buffer {s:?}: expected ID or ID:OFFSET (a descriptor goes in --remote)")
    })?;
    let offset = match offset {
        Some(o) => parse_size(o).map_err(|e| format!("bad offset in {s:?}: {e}"))?,
        None => 0,
    };
    Ok(LocalRef { buffer_id, offset })
}

/// Bytes given in hex on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HexBytes(pub Vec<u8>);

/// Parses a hex byte sequence: `deadbeef`, `0xDEADBEEF`, `de_ad_be_ef`, `de:ad:be:ef`,
/// `de ad be ef`. It must hold at least one byte and an even number of digits.
pub fn parse_hex_pattern(s: &str) -> Result<HexBytes, String> {
    let t = s.trim();
    let t = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    let digits: String = t
        .chars()
        .filter(|c| !matches!(c, '_' | ':' | ' ' | '-'))
        .collect();
    if digits.is_empty() {
        return Err("empty hex pattern (give at least one byte, e.g. ab)".to_string());
    }
    if digits.len() % 2 != 0 {
        return Err(format!(
            "hex pattern {s:?} has an odd number of digits ({})",
            digits.len()
        ));
    }
    hex::decode(&digits)
        .map(HexBytes)
        .map_err(|e| format!("bad hex pattern {s:?}: {e}"))
}

/// A u64 in decimal or `0x` hex.
pub fn parse_u64(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    r.map_err(|_| format!("expected a non-negative integer, got {s:?}"))
}

/// A byte value 0..255 in decimal or `0x` hex.
pub fn parse_byte(s: &str) -> Result<u8, String> {
    let v = parse_u64(s)?;
    u8::try_from(v).map_err(|_| format!("a byte is 0..255 (0x00..0xff), got {s:?}"))
}

/// Seconds, possibly fractional (`30`, `0.5`); must be positive.
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected seconds, got {s:?}"))?;
    if v.is_nan() || v <= 0.0 {
        return Err(format!("seconds must be positive, got {s:?}"));
    }
    Duration::try_from_secs_f64(v).map_err(|e| format!("bad seconds {s:?}: {e}"))
}

// `tcpxctl bench` (run by `crate::cli::bench`).

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// WRITE or READ between two daemons through the client API, measured by the client. Without
    /// --peer-endpoint it starts two local daemons on the built-in emulation plugin (as `demo`
    /// does) and stops them at the end.
    #[command(after_help = SIZE_HELP)]
    Transfer(BenchTransferArgs),
    /// Drive the plugin directly with the daemon's chunking, windows and unpack, sender and
    /// receiver on two threads of this process: the ceiling of what the daemon can reach.
    #[command(after_help = SIZE_HELP)]
    Raw(BenchRawArgs),
}

/// What to move and how often (shared by both harnesses, so their rows line up).
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// WRITE (local into remote) or READ (remote into local).
    #[arg(long, value_enum, default_value = "write")]
    pub op: Op,
    /// Put both sides' buffers in the memory of this CUDA device; host memory by default.
    #[arg(long, value_name = "DEVICE")]
    pub cuda: Option<u32>,
    /// `bench transfer` only: put the peer daemon's buffers on this CUDA device instead of
    /// --cuda's (one daemon per GPU on a multi-GPU host).
    #[arg(long, value_name = "DEVICE", requires = "cuda")]
    pub peer_cuda: Option<u32>,
    /// Block sizes to run, comma-separated (e.g. 4K,64K,1M); replaces --min/--max/--step.
    #[arg(long, value_name = "SIZE,...", value_delimiter = ',', value_parser = parse_size,
          conflicts_with_all = ["min", "max", "step"])]
    pub sizes: Vec<u64>,
    /// The smallest block size.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "4K")]
    pub min: u64,
    /// The largest block size.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "256M")]
    pub max: u64,
    /// The factor between block sizes.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_STEP)]
    pub step: u64,
    /// Blocks per transfer: one Write/Read request for 1, a WriteBatch/ReadBatch of N entries
    /// (block i at offset i × size, per-entry status) otherwise.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub batch: u32,
    /// Measured transfers per block size.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub iters: u32,
    /// Unmeasured transfers per block size before the measured ones.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub warmup: u32,
    /// Transfers in flight at once, as a queue depth (each on its own range; the daemon bench
    /// submits them on one Session). GB/s is then over the wall time.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub concurrency: u32,
    /// Also append the rows to FILE as JSON lines (one object per block size).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// How the data path is set up: the daemons' settings of the same names.
#[derive(Args, Debug, Clone)]
pub struct PathArgs {
    /// Chunk size in bytes (4096..=4194304); else UCCL_TCPX_CHUNK_BYTES, NCCL_P2P_NET_CHUNKSIZE,
    /// else 512 KiB, as tcpxd picks it.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub chunk_bytes: Option<u64>,
    /// Data lanes per plugin device [default: 2, as tcpxd].
    #[arg(long, value_name = "N")]
    pub lanes_per_device: Option<u32>,
    /// Transfers of fewer than two chunks per lane take chunks halved down to no less than this
    /// (0: off, else 4096..=4194304), as tcpxd's `transfer.spread_min_chunk_bytes` [default: 65536, as tcpxd].
    #[arg(long, value_name = "SIZE", value_parser = parse_size, env = "TCPXD_SPREAD_MIN_CHUNK_BYTES")]
    pub spread_min_chunk_bytes: Option<u64>,
    /// Chunks per lane a spread transfer aims at (1..=16), as tcpxd's
    /// `transfer.spread_chunks_per_lane` [default: 2, as tcpxd].
    #[arg(long, value_name = "N", env = "TCPXD_SPREAD_CHUNKS_PER_LANE")]
    pub spread_chunks_per_lane: Option<u32>,
}

/// `bench transfer --via`: how the transfers reach the daemon.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Grpc,
    Local,
}

#[derive(Args, Debug)]
pub struct BenchTransferArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The peer daemon's client API (same forms as --endpoint). Without it, two local daemons
    /// are started on the built-in emulation plugin.
    #[arg(long, value_name = "ENDPOINT")]
    pub peer_endpoint: Option<String>,
    /// The peer daemon's peer-service address (host:port): connect --endpoint's daemon to it
    /// first. Without it the two must already be connected.
    #[arg(long, value_name = "HOST:PORT", requires = "peer_endpoint")]
    pub peer_address: Option<String>,
    /// Local daemons only: chunk size and lanes they are started with.
    #[command(flatten)]
    pub path: PathArgs,
    /// Move N blocks per transfer as block lists (WriteBlocks / ReadBlocks), both sides
    /// scattered by a seeded permutation, beside one contiguous transfer of the same bytes in the
    /// same run; replaces the size sweep (and --batch, --concurrency).
    #[arg(long, value_name = "N", requires = "block_size")]
    pub blocks: Option<u32>,
    /// With --blocks: each block's size.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "blocks")]
    pub block_size: Option<u64>,
    /// With --blocks: the permutations' seed.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "blocks")]
    pub seed: u64,
    /// With --blocks: which sides are scattered (`local`: the caller's, the source of a WRITE;
    /// `remote`: the peer's); the other side's blocks go in order, one run.
    #[arg(long, value_enum, default_value_t = crate::bench::blocks::Scattered::Both, requires = "blocks")]
    pub scattered: crate::bench::blocks::Scattered,
    /// With --blocks (up to 65,536): how the same pairs travel as one plain WriteBatch /
    /// ReadBatch, a third kind in the same alternation (batch ÷ blocks printed): `ranges`, one
    /// buffer pair and packed offsets (BatchRanges); `entries`, one message per pair.
    #[arg(long, value_enum, default_value_t = crate::bench::blocks::BatchForm::Ranges, requires = "blocks")]
    pub batch_form: crate::bench::blocks::BatchForm,
    /// With --blocks: leave the plain batch out.
    #[arg(long, requires = "blocks")]
    pub no_batch: bool,
    /// How the transfers reach the daemon: `grpc`, on a gRPC `Session` stream (rows `daemon`);
    /// `local`, on a framed local session on its API unix socket, the crossing the Python
    /// package's client uses (rows `daemon-local`).
    #[arg(long, value_enum, default_value_t = Via::Grpc, conflicts_with = "blocks")]
    pub via: Via,
    /// Also run the raw plugin bench (same plugin, workload, chunk size and lanes) first, and
    /// print both side by side.
    #[arg(long)]
    pub raw: bool,
    /// Local daemons and --raw only: the plugin file to load (e.g. Google's real plugin built by
    /// tools/realplugin/build.sh); default: the built-in emulation.
    #[arg(long, value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// Local daemons only: the tcpxd binary (default: `tcpxd` next to tcpxctl).
    #[arg(long, value_name = "PATH")]
    pub daemon: Option<PathBuf>,
    /// Local daemons only: keep their directory (sockets, logs) afterwards.
    #[arg(long)]
    pub keep_dir: bool,
    /// Local daemons only: seconds to wait for each daemon's ready file.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "30")]
    pub ready_timeout: Duration,
}

#[derive(Args, Debug)]
pub struct BenchRawArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub path: PathArgs,
    /// The plugin file to drive (e.g. /usr/local/tcpx/lib64/libnccl-net.so); default: the
    /// emulation plugin built into tcpxctl (what `tcpxd --builtin-emulation` drives).
    #[arg(long, value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// Plugin devices to use (repeatable); all of the plugin's by default.
    #[arg(long = "device", value_name = "N")]
    pub devices: Vec<i32>,
    /// Sends posted per lane at most (tcpxd's transfer.send_window).
    #[arg(long, value_name = "N", default_value_t = 12)]
    pub send_window: usize,
    /// Receives held per lane at most (tcpxd's transfer.recv_window).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub recv_window: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_refs() {
        let r = |id, offset| {
            Ok(LocalRef {
                buffer_id: id,
                offset,
            })
        };
        assert_eq!(parse_local_ref("7"), r(7, 0));
        assert_eq!(parse_local_ref("7:0"), r(7, 0));
        assert_eq!(parse_local_ref("7:4096"), r(7, 4096));
        assert_eq!(parse_local_ref("7:4K"), r(7, 4096));
        assert_eq!(parse_local_ref("7:0x1000"), r(7, 4096));
        assert_eq!(parse_local_ref("0x10:1M"), r(16, 1 << 20));
        for bad in [
            "",
            ":",
            "7:",
            ":4",
            "x",
            "-1",
            "7:4X",
            "7:1:2",
            "tcpxd1:node:3:abc",
        ] {
            assert!(parse_local_ref(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(parse_local_ref("node:3").unwrap_err().contains("--remote"));
    }

    #[test]
    fn hex_patterns() {
        let h = |v: &[u8]| Ok(HexBytes(v.to_vec()));
        assert_eq!(parse_hex_pattern("ab"), h(&[0xab]));
        assert_eq!(parse_hex_pattern("deadbeef"), h(&[0xde, 0xad, 0xbe, 0xef]));
        assert_eq!(parse_hex_pattern("0xDEADBEEF"), h(&[0xde, 0xad, 0xbe, 0xef]));
        assert_eq!(parse_hex_pattern("de_ad:be ef"), h(&[0xde, 0xad, 0xbe, 0xef]));
        assert_eq!(parse_hex_pattern("00"), h(&[0]));
        for bad in ["", "0x", "abc", "zz", "0xg0", "__"] {
            assert!(parse_hex_pattern(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn numbers() {
        assert_eq!(parse_u64("42"), Ok(42));
        assert_eq!(parse_u64("0x2a"), Ok(42));
        assert!(parse_u64("-1").is_err());
        assert_eq!(parse_byte("255"), Ok(255));
        assert_eq!(parse_byte("0xff"), Ok(255));
        assert!(parse_byte("256").is_err());
        assert_eq!(parse_secs("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_secs("0.5"), Ok(Duration::from_millis(500)));
        for bad in ["0", "-1", "abc", "NaN", "inf", ""] {
            assert!(parse_secs(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn cuda_pair() {
        let a = RegisterArgs {
            host: None,
            cuda: Some(vec!["1".into(), "2M".into()]),
            label: String::new(),
            quiet: false,
        };
        assert_eq!(a.cuda(), Ok(Some((1, 2 << 20))));
        let a = RegisterArgs {
            host: None,
            cuda: Some(vec!["x".into(), "2M".into()]),
            label: String::new(),
            quiet: false,
        };
        assert!(a.cuda().is_err());
    }
}

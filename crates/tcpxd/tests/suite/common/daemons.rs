//! In-process daemons on the built-in emulation plugin, each with its own poller, API and peer
//! service, for integration tests.

use std::path::PathBuf;
use std::sync::Arc;

use tcpxd::api::proto::v1::tcpxd_client::TcpxdClient;
use tcpxd::config::{Config, DaemonArgs};
use tcpxd::daemon::{self, RunningDaemon};
use tcpxd::net::Plugin;
use tonic::transport::Channel;

pub use tcpxd_testkit::ScratchDir;

pub struct TestDaemon {
    pub daemon: RunningDaemon,
    pub client: TcpxdClient<Channel>,
    /// Its socket and token; removed when the daemon is dropped, stopped or not.
    pub dir: ScratchDir,
}

/// The plugin the tests drive: the file named by `TCPXD_TEST_PLUGIN` (tools/realplugin/run.sh
/// sets it to Google's real plugin; loaded and initialised once per test process), else the
/// emulation linked into tcpxd.
pub fn plugin() -> Arc<Plugin> {
    static FILE: std::sync::OnceLock<Arc<Plugin>> = std::sync::OnceLock::new();
    match test_plugin_file() {
        Some(path) => FILE
            .get_or_init(|| {
                Plugin::load(&path).unwrap_or_else(|e| panic!("TCPXD_TEST_PLUGIN={}: {e}", path.display()))
            })
            .clone(),
        None => Plugin::builtin_emulation().expect("built-in emulation"),
    }
}

/// `TCPXD_TEST_PLUGIN`, when set: the daemons under test load that plugin file.
/// Whether this run's pairings must be routed (`TCPXD_TEST_EXPECT_ROUTED=1`: `routed_rerun`'s
/// children, whose daemons have stand-in GPUs); `None` when the run does not say.
pub fn expect_routed() -> Option<bool> {
    std::env::var("TCPXD_TEST_EXPECT_ROUTED").ok().map(|v| v == "1")
}

/// Checks a pairing is routed if and only if the run says it must be (see [`expect_routed`]).
pub fn assert_routed_as_expected(p: &pb::PeerStats) {
    if let Some(want) = expect_routed() {
        assert_eq!(p.routed, want, "routed pairing expected: {want}: {p:?}");
    }
}

pub fn test_plugin_file() -> Option<PathBuf> {
    std::env::var_os("TCPXD_TEST_PLUGIN")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// What `DescribeNode` reports as the plugin path of the daemons under test.
pub fn described_plugin_path() -> String {
    test_plugin_file().map_or("built-in emulation".to_string(), |p| p.display().to_string())
}

/// Whether the tests run on the emulation (not a plugin file): emulation-only knobs such as
/// `TCPXEMU_RATE_GBPS` take effect only then.
pub fn on_emulation() -> bool {
    test_plugin_file().is_none()
}

/// The bearer token of every test daemon's TCP API.
pub const TEST_TOKEN: &str = "test-token-0123456789abcdef";

/// A client over a daemon's unix socket.
pub async fn unix_client(path: PathBuf) -> TcpxdClient<Channel> {
    TcpxdClient::new(unix_channel(path).await)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

/// A channel to a daemon's unix socket.
pub async fn unix_channel(path: PathBuf) -> Channel {
    tonic::transport::Endpoint::from_static("http://[::]:0")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .expect("connect over the unix socket")
}

/// Starts a daemon named `node` with unix-socket and TCP (token `TEST_TOKEN`) APIs on loopback;
/// its `client` uses the unix socket.
pub async fn start(node: &str, extra: impl FnOnce(&mut DaemonArgs)) -> TestDaemon {
    let dir = std::env::temp_dir().join(format!(
        "tcpxd-test-{}-{node}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), TEST_TOKEN).unwrap();
    let mut args = DaemonArgs {
        node_id: Some(node.to_string()),
        api_socket: Some(dir.join("api.sock")),
        api_tcp: Some("127.0.0.1:0".parse().unwrap()),
        api_token_file: Some(dir.join("token")),
        peer_listen: Some("127.0.0.1:0".parse().unwrap()),
        builtin_emulation: on_emulation(),
        plugin: test_plugin_file(),
        shutdown_grace_s: Some(5),
        // The whole suite runs under either protocol: TCPXD_TRANSFER_PROTOCOL=eager|rendezvous,
        // and with spinning on or off: TCPXD_SPIN=on|off (unset: auto, off on a 2-core machine).
        transfer_protocol: std::env::var("TCPXD_TRANSFER_PROTOCOL").ok(),
        spin: std::env::var("TCPXD_SPIN").ok(),
        // And with the framed sessions read on the poller's thread: TCPXD_POLLER_SESSIONS=on.
        poller_sessions: std::env::var("TCPXD_POLLER_SESSIONS").ok(),
        // And with the send lanes' plugin calls on a lane thread: TCPXD_LANE_THREAD=on.
        lane_thread: std::env::var("TCPXD_LANE_THREAD").ok(),
        // And with them on a thread of their own: TCPXD_SESSION_THREAD=on.
        session_thread: std::env::var("TCPXD_SESSION_THREAD").ok(),
        ..Default::default()
    };
    extra(&mut args);
    let cfg = Config::resolve(&args, &|_| None).expect("config");
    let daemon = daemon::start(&cfg, plugin()).await.expect("daemon starts");
    let client = unix_client(daemon.api_socket.clone()).await;
    TestDaemon {
        daemon,
        client,
        dir: ScratchDir::new(dir),
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl TestDaemon {
    pub fn peer_addr(&self) -> String {
        self.daemon.peer_addr.to_string()
    }

    pub async fn stop(self) {
        self.daemon.shutdown().await;
        // `self.dir` goes with it.
    }
}

use tcpxd::api::proto::v1 as pb;

pub type Client = TcpxdClient<Channel>;

pub async fn host_buffer(c: &mut Client, size: u64, label: &str) -> pb::Buffer {
    c.register_buffer(pb::RegisterBufferRequest {
        reattach_id: Default::default(),
        reattach_key: Default::default(),
        source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
            size,
        })),
        label: label.to_string(),
    })
    .await
    .expect("register")
    .into_inner()
}

pub async fn fill_seed(c: &mut Client, id: u64, offset: u64, length: u64, seed: u64) {
    c.fill_buffer(pb::FillBufferRequest {
        buffer_id: id,
        offset,
        length,
        pattern: Some(pb::fill_buffer_request::Pattern::Seed(seed)),
    })
    .await
    .expect("fill");
}

pub async fn crc(c: &mut Client, id: u64, offset: u64, length: u64) -> u32 {
    c.checksum_buffer(pb::ChecksumBufferRequest {
        buffer_id: id,
        offset,
        length,
    })
    .await
    .expect("checksum")
    .into_inner()
    .crc32c
}

/// `len` bytes of buffer `id` from `offset`, through ReadBuffer.
pub async fn bytes(c: &mut Client, id: u64, offset: u64, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(tcpxd::buffers::MAX_READ_BYTES);
        let r = c
            .read_buffer(pb::ReadBufferRequest {
                buffer_id: id,
                offset: at,
                length: n,
            })
            .await
            .expect("read buffer")
            .into_inner();
        out.extend_from_slice(&r.data);
        at += n;
    }
    out
}

pub fn write_entry(
    local: &pb::Buffer,
    loff: u64,
    remote: &pb::Buffer,
    roff: u64,
    len: u64,
) -> pb::WriteEntry {
    pb::WriteEntry {
        local_buffer_id: local.id,
        local_offset: loff,
        remote_descriptor: remote.descriptor.clone(),
        remote_offset: roff,
        length: len,
    }
}

pub fn read_entry(remote: &pb::Buffer, roff: u64, local: &pb::Buffer, loff: u64, len: u64) -> pb::ReadEntry {
    pb::ReadEntry {
        remote_descriptor: remote.descriptor.clone(),
        remote_offset: roff,
        local_buffer_id: local.id,
        local_offset: loff,
        length: len,
    }
}

pub async fn write(c: &mut Client, e: pb::WriteEntry, note: &[u8]) -> Result<u64, tonic::Status> {
    c.write(pb::WriteRequest {
        entry: Some(e),
        notification: note.to_vec(),
        timeout_ms: 120_000,
        ready_event_ipc_handle: Vec::new(),
        wait: false,
    })
    .await
    .map(|r| r.into_inner().transfer_id)
}

pub async fn read(c: &mut Client, e: pb::ReadEntry) -> Result<u64, tonic::Status> {
    c.read(pb::ReadRequest {
        entry: Some(e),
        timeout_ms: 120_000,
        wait: false,
    })
    .await
    .map(|r| r.into_inner().transfer_id)
}

pub async fn wait(c: &mut Client, id: u64) -> pb::TransferEvent {
    c.wait_transfer(pb::WaitTransferRequest { transfer_id: id })
        .await
        .expect("wait")
        .into_inner()
}

/// Waits for a transfer and asserts it succeeded.
pub async fn wait_ok(c: &mut Client, id: u64) -> pb::TransferEvent {
    let e = wait(c, id).await;
    assert_eq!(e.status_code, 0, "transfer {id} failed: {}", e.status_message);
    e
}

pub async fn connect(a: &mut TestDaemon, b: &TestDaemon) -> pb::Peer {
    let addr = b.peer_addr();
    a.client
        .connect_peer(pb::ConnectPeerRequest { address: addr })
        .await
        .expect("connect peer")
        .into_inner()
}

/// Polls GetStats until nothing is in flight or queued on any lane and every eager credit is
/// back (held by the sender, posted again by the receiver), or fails after 10 s.
pub async fn assert_lanes_drain(c: &mut Client) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = c
            .get_stats(pb::GetStatsRequest {})
            .await
            .expect("stats")
            .into_inner();
        let busy: u32 = s
            .peers
            .iter()
            .flat_map(|p| &p.lanes)
            .map(|l| {
                l.sends_in_flight
                    + l.recvs_in_flight
                    + l.sends_queued
                    + l.recvs_queued
                    + (l.send_credit_limit - l.send_credits.min(l.send_credit_limit))
                    + (l.recv_credit_limit - l.recv_credits.min(l.recv_credit_limit))
            })
            .sum();
        if busy == 0 && s.active_transfers == 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "lanes never drained: {s:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Two daemons `<name>-a` and `<name>-b`, a paired with b.
pub async fn pair(name: &str) -> (TestDaemon, TestDaemon) {
    let mut a = start(&format!("{name}-a"), |_| {}).await;
    let b = start(&format!("{name}-b"), |_| {}).await;
    connect(&mut a, &b).await;
    (a, b)
}

/// A `Session` request's WRITE of one entry (60 s deadline).
pub fn write_op(e: pb::WriteEntry) -> pb::session_request::Op {
    pb::session_request::Op::Write(pb::WriteRequest {
        entry: Some(e),
        timeout_ms: 60_000,
        ..Default::default()
    })
}

/// A `Session` request's READ of one entry (60 s deadline).
pub fn read_op(e: pb::ReadEntry) -> pb::session_request::Op {
    pb::session_request::Op::Read(pb::ReadRequest {
        entry: Some(e),
        timeout_ms: 60_000,
        ..Default::default()
    })
}

//! A fake RxDM (GPUDirect-TCPX's receive-datapath manager) for running Google's TCPX plugin on a
//! machine without TCPX NICs: it listens on the unix sockets the plugin dials under its
//! `NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX` — `rx_rule_manager` (install a flow-steering rule),
//! `rx_rule_uninstall` (remove one) and `rxdm_application_registry` (register the process, with
//! `NCCL_GPUDIRECTTCPX_REPORT_LIFECYCLE=1`) — decodes each request (a big-endian u16 length, then a
//! protobuf `UnixSocketProto`), records it, and answers as RxDM does: `raw_bytes: "Ok."`, the frame
//! `00 05 0a 03 4f 6b 2e`. Told to refuse, it answers `raw_bytes: "<text>"`, which the plugin
//! reports as a failed rule.
//!
//! The messages are the plugin's `unix_socket_proto.proto` fields that the plugin sends, written
//! here with prost's derive (no protoc); their tags and types are the wire format.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prost::Message;

pub mod a3vm;
pub mod gpumem;
pub use a3vm::{Binding, Filing};

/// The flow-steering sockets and the registry, as the plugin names them.
pub const INSTALL_SOCKET: &str = "rx_rule_manager";
pub const UNINSTALL_SOCKET: &str = "rx_rule_uninstall";
pub const REGISTRY_SOCKET: &str = "rxdm_application_registry";

/// RxDM's success answer, framed: length 5, then field 1 (raw_bytes) = "Ok.".
pub const OK_FRAME: [u8; 7] = [0x00, 0x05, 0x0a, 0x03, b'O', b'k', b'.'];

/// `UnixSocketProto`: one of its payloads.
#[derive(Clone, PartialEq, Message)]
pub struct UnixSocketProto {
    #[prost(oneof = "Payload", tags = "1, 2, 3, 4, 6")]
    pub payload: Option<Payload>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    #[prost(bytes, tag = "1")]
    RawBytes(Vec<u8>),
    #[prost(message, tag = "2")]
    FlowSteerRuleRequest(FlowSteerRuleRequest),
    #[prost(message, tag = "3")]
    QueueIdQuery(QueueIdQuery),
    #[prost(message, tag = "4")]
    QueueIdResponse(QueueIdResponse),
    #[prost(message, tag = "6")]
    ApplicationRegisterRequest(ApplicationRegisterRequest),
}

#[derive(Clone, PartialEq, Message)]
pub struct QueueIdQuery {
    #[prost(string, required, tag = "1")]
    pub gpu_pci_addr: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct QueueIdResponse {
    #[prost(int32, repeated, packed = "false", tag = "1")]
    pub queue_ids: Vec<i32>,
}

#[derive(Clone, PartialEq, Message)]
pub struct FlowSteerRuleRequest {
    #[prost(message, optional, tag = "1")]
    pub flow_steer_ntuple: Option<FlowSteerNtupleProto>,
    #[prost(int32, optional, tag = "2")]
    pub queue_id: Option<i32>,
    #[prost(string, optional, tag = "3")]
    pub gpu_pci_addr: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct FlowSteerNtupleProto {
    #[prost(int32, optional, tag = "1")]
    pub flow_type: Option<i32>,
    #[prost(message, optional, tag = "2")]
    pub src: Option<SocketAddress>,
    #[prost(message, optional, tag = "3")]
    pub dst: Option<SocketAddress>,
}

#[derive(Clone, PartialEq, Message)]
pub struct SocketAddress {
    #[prost(string, optional, tag = "1")]
    pub ip_address: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pub port: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ApplicationRegisterRequest {
    #[prost(bool, optional, tag = "1")]
    pub register_client: Option<bool>,
}

/// ethtool's flow types (`linux/ethtool.h`) as the plugin sends them.
pub const TCP_V4_FLOW: i32 = 0x01;
pub const TCP_V6_FLOW: i32 = 0x05;

/// Which socket a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Socket {
    Install,
    Uninstall,
    Registry,
}

impl Socket {
    pub fn name(self) -> &'static str {
        match self {
            Socket::Install => INSTALL_SOCKET,
            Socket::Uninstall => UNINSTALL_SOCKET,
            Socket::Registry => REGISTRY_SOCKET,
        }
    }
}

/// One request as received.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub socket: Socket,
    /// The decoded message, or why the frame did not decode.
    pub message: Result<UnixSocketProto, String>,
    /// Whether it was answered "Ok.".
    pub answered_ok: bool,
    /// In `a3vm` mode, an install request's fate: the NIC it was filed under and the NIC its
    /// flow arrives on (or why it was not filed).
    pub filing: Option<Filing>,
}

impl Request {
    /// A flow-steering rule's (flow type, source, destination), when this is one.
    pub fn flow(&self) -> Option<(i32, SocketAddr, SocketAddr)> {
        let Ok(UnixSocketProto {
            payload: Some(Payload::FlowSteerRuleRequest(r)),
        }) = &self.message
        else {
            return None;
        };
        let t = r.flow_steer_ntuple.as_ref()?;
        let addr = |a: &Option<SocketAddress>| -> Option<SocketAddr> {
            let a = a.as_ref()?;
            let ip: IpAddr = a.ip_address.as_deref()?.parse().ok()?;
            Some(SocketAddr::new(ip, u16::try_from(a.port?).ok()?))
        };
        Some((t.flow_type?, addr(&t.src)?, addr(&t.dst)?))
    }

    /// One line for logs: `install tcp4 10.0.0.1:40000 -> 10.0.0.2:50000 gpu=0000:10:00.0 ok`.
    pub fn line(&self) -> String {
        let verdict = if self.answered_ok { "ok" } else { "refused" };
        let what = match &self.message {
            Err(e) => format!("undecodable ({e})"),
            Ok(UnixSocketProto {
                payload: Some(Payload::FlowSteerRuleRequest(r)),
            }) => {
                let flow = match self.flow() {
                    Some((t, s, d)) => {
                        let kind = match t {
                            TCP_V4_FLOW => "tcp4".to_string(),
                            TCP_V6_FLOW => "tcp6".to_string(),
                            other => format!("flow_type={other}"),
                        };
                        format!("{kind} {s} -> {d}")
                    }
                    None => "incomplete ntuple".to_string(),
                };
                let gpu = r.gpu_pci_addr.as_deref().unwrap_or("-");
                let q = r.queue_id.map_or("-".to_string(), |q| q.to_string());
                format!("{flow} gpu={gpu} queue={q}")
            }
            Ok(UnixSocketProto {
                payload: Some(Payload::ApplicationRegisterRequest(r)),
            }) => {
                format!("register_client={}", r.register_client.unwrap_or(false))
            }
            Ok(other) => format!("{other:?}"),
        };
        let socket = match self.socket {
            Socket::Install => "install",
            Socket::Uninstall => "uninstall",
            Socket::Registry => "registry",
        };
        match &self.filing {
            Some(f) => format!("{socket} {what} {verdict} {}", f.describe()),
            None => format!("{socket} {what} {verdict}"),
        }
    }

    /// The rule's GPU, as the request names it.
    pub fn gpu(&self) -> Option<&str> {
        match &self.message {
            Ok(UnixSocketProto {
                payload: Some(Payload::FlowSteerRuleRequest(r)),
            }) => r.gpu_pci_addr.as_deref(),
            _ => None,
        }
    }
}

/// A flow-steering rule's flow: (flow type, source, destination).
pub type Flow = (i32, SocketAddr, SocketAddr);

/// The rules real RxDM would still hold after `requests`, as its rule bank keeps them
/// (google/tcpgpudmarxd `src/rx_rule_manager.cc`: `NicRulesBank`, `ConfigFlowSteering`,
/// `DeleteFlowSteering`): one per flow; an install answered OK adds the flow's unless it has one,
/// an uninstall removes it, whoever sent either. RxDM keeps no per-client record, so the rules of
/// a client that died without uninstalling stay (docs/CONFORMANCE.md).
pub fn rules_left(requests: &[Request]) -> std::collections::BTreeSet<Flow> {
    let mut rules = std::collections::BTreeSet::new();
    for r in requests {
        let Some(flow) = r.flow() else { continue };
        match r.socket {
            Socket::Install if r.answered_ok => {
                rules.insert(flow);
            }
            Socket::Uninstall => {
                rules.remove(&flow);
            }
            _ => {}
        }
    }
    rules
}

/// A callback for each request as it is recorded.
pub type OnRequest = Box<dyn Fn(&Request) + Send + Sync>;

/// How the fake answers.
#[derive(Clone, Debug, Default)]
pub enum Answer {
    /// "Ok." to everything (RxDM's success).
    #[default]
    Ok,
    /// raw_bytes with this text to everything (a failure the plugin reports).
    Refuse(String),
}

/// Encodes one frame: the big-endian u16 length, then the message.
pub fn frame(message: &UnixSocketProto) -> Vec<u8> {
    let body = message.encode_to_vec();
    let len = u16::try_from(body.len()).expect("a RxDM message fits a u16 length");
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// The answer frame for `answer`.
pub fn answer_frame(answer: &Answer) -> Vec<u8> {
    let text = match answer {
        Answer::Ok => "Ok.".as_bytes().to_vec(),
        Answer::Refuse(t) => t.as_bytes().to_vec(),
    };
    frame(&UnixSocketProto {
        payload: Some(Payload::RawBytes(text)),
    })
}

/// Reads one frame's payload; `None` at a clean end of stream.
pub fn read_frame(stream: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 2];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut body = vec![0u8; u16::from_be_bytes(len) as usize];
    stream.read_exact(&mut body)?;
    Ok(Some(body))
}

struct Shared {
    requests: Mutex<Vec<Request>>,
    arrived: Condvar,
    answer: Mutex<Answer>,
    stopping: AtomicBool,
    /// Called with each request as it is recorded (the binary prints them).
    on_request: Option<OnRequest>,
    /// `a3vm` mode: file each install under the named GPU's NIC and record whether it matches.
    binding: Option<Binding>,
    /// `a3vm` mode: the rules filed (flow -> NIC, GPU), as written to `devmem-rules`.
    filed: Mutex<std::collections::BTreeMap<Flow, (String, String)>>,
    prefix: PathBuf,
}

/// A running fake RxDM; stops (and removes its sockets) when dropped.
pub struct FakeRxdm {
    prefix: PathBuf,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// `a3vm` mode: each GPU's receive memory (`get_gpu_fd_<pci>`, `get_gpu_metadata_<pci>`).
    gpumem: Option<gpumem::GpuMemServer>,
}

impl FakeRxdm {
    /// Listens on the three sockets under `prefix` (created if missing; stale sockets replaced).
    pub fn start(prefix: &Path, answer: Answer) -> std::io::Result<FakeRxdm> {
        Self::start_with(prefix, answer, None)
    }

    /// As [`FakeRxdm::start`], calling `on_request` with each request as it is recorded.
    pub fn start_with(
        prefix: &Path,
        answer: Answer,
        on_request: Option<OnRequest>,
    ) -> std::io::Result<FakeRxdm> {
        Self::start_bound(prefix, answer, None, on_request)
    }

    /// As [`FakeRxdm::start_with`]; with a `binding` (RxDM's `a3vm` mode) each install request
    /// is filed under the NIC serving the GPU it names, answered "Ok." (or refused, as RxDM does,
    /// when no NIC serves that GPU), and recorded with its [`Filing`].
    pub fn start_bound(
        prefix: &Path,
        answer: Answer,
        binding: Option<Binding>,
        on_request: Option<OnRequest>,
    ) -> std::io::Result<FakeRxdm> {
        std::fs::create_dir_all(prefix)?;
        let gpumem = match &binding {
            Some(b) => {
                let gpus: Vec<String> = b.gpu_to_nic.iter().map(|(g, _)| g.clone()).collect();
                Some(gpumem::GpuMemServer::start(prefix, &gpus)?)
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            requests: Mutex::new(Vec::new()),
            arrived: Condvar::new(),
            answer: Mutex::new(answer),
            stopping: AtomicBool::new(false),
            on_request,
            binding,
            filed: Mutex::new(std::collections::BTreeMap::new()),
            prefix: prefix.to_path_buf(),
        });
        if let Some(b) = &shared.binding {
            a3vm::write_rules(prefix, b, &std::collections::BTreeMap::new())?;
        }
        let mut threads = Vec::new();
        for socket in [Socket::Install, Socket::Uninstall, Socket::Registry] {
            let path = prefix.join(socket.name());
            let _ = std::fs::remove_file(&path);
            let listener = UnixListener::bind(&path)?;
            let shared = shared.clone();
            threads.push(std::thread::spawn(move || accept_loop(listener, socket, shared)));
        }
        Ok(FakeRxdm {
            prefix: prefix.to_path_buf(),
            shared,
            threads,
            gpumem,
        })
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Changes the answer for requests from now on.
    pub fn set_answer(&self, answer: Answer) {
        *self.shared.answer.lock().unwrap_or_else(|e| e.into_inner()) = answer;
    }

    /// Waits until at least `n` requests arrived on `socket`; their count when it returns.
    pub fn wait_for(&self, socket: Socket, n: usize, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut reqs = self.shared.requests.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let have = reqs.iter().filter(|r| r.socket == socket).count();
            let left = deadline.saturating_duration_since(Instant::now());
            if have >= n || left.is_zero() {
                return have;
            }
            reqs = self
                .shared
                .arrived
                .wait_timeout(reqs, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The socket paths' folder.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// Stops listening and removes the sockets (what "RxDM gone" looks like to the plugin).
    pub fn stop(mut self) -> Vec<Request> {
        self.shutdown();
        self.requests()
    }

    fn shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        for socket in [Socket::Install, Socket::Uninstall, Socket::Registry] {
            let path = self.prefix.join(socket.name());
            // Wake the acceptor with a connection of our own, then remove the socket file.
            let _ = UnixStream::connect(&path);
            let _ = std::fs::remove_file(&path);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(g) = &mut self.gpumem {
            g.stop();
        }
    }
}

impl Drop for FakeRxdm {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: UnixListener, socket: Socket, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let shared = shared.clone();
        // One thread per connection: the plugin opens one per request and closes it after the answer.
        std::thread::spawn(move || serve(conn, socket, &shared));
    }
}

fn serve(mut conn: UnixStream, socket: Socket, shared: &Shared) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    while let Ok(Some(body)) = read_frame(&mut conn) {
        let message =
            UnixSocketProto::decode(body.as_slice()).map_err(|e| format!("{e}; {} bytes", body.len()));
        let mut answer = shared.answer.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut request = Request {
            socket,
            message,
            answered_ok: false,
            filing: None,
        };
        if let (Some(b), Socket::Install) = (&shared.binding, socket) {
            let dst = request.flow().map(|(_, _, d)| d.ip());
            let filing = b.file(request.gpu(), dst);
            if let (Filing::Refused(why), Answer::Ok) = (&filing, &answer) {
                answer = Answer::Refuse(why.clone());
            }
            request.filing = Some(filing);
        }
        request.answered_ok = matches!(answer, Answer::Ok);
        if let Some(b) = &shared.binding {
            file_for_the_shim(shared, b, &request);
        }
        if let Some(f) = &shared.on_request {
            f(&request);
        }
        shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request);
        shared.arrived.notify_all();
        if conn.write_all(&answer_frame(&answer)).is_err() {
            return;
        }
    }
}

/// `a3vm` mode: keeps the rules RxDM holds (per flow, the NIC it was filed under and its GPU) in
/// `devmem-rules` for the devmem shim, before the plugin hears the answer (so its first receive
/// on the flow finds the rule).
fn file_for_the_shim(shared: &Shared, binding: &Binding, request: &Request) {
    let Some(flow) = request.flow() else { return };
    let mut filed = shared.filed.lock().unwrap_or_else(|e| e.into_inner());
    match (request.socket, &request.filing) {
        (Socket::Install, Some(Filing::Filed { nic, .. })) if request.answered_ok => {
            let gpu = request.gpu().unwrap_or_default().to_ascii_lowercase();
            filed.insert(flow, (nic.clone(), gpu));
        }
        (Socket::Uninstall, _) => {
            filed.remove(&flow);
        }
        _ => return,
    }
    if let Err(e) = a3vm::write_rules(&shared.prefix, binding, &filed) {
        eprintln!(
            "fake-rxdm: writing {}: {e}",
            shared.prefix.join(a3vm::RULES_FILE).display()
        );
    }
}

#[cfg(test)]
mod tests;

//! Assembling a daemon: the poller thread, the client API (unix socket, optional TCP) with
//! reflection and health (the unix socket also speaking the framed local session), the peer service on TCP, and an orderly shutdown that drains
//! in-flight transfers for a grace period.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, watch};
use tokio::task::JoinHandle;

use crate::api::peer_service::PeerService;
use crate::api::proto::{self, peer::tcpxd_peer_server::TcpxdPeerServer, v1::tcpxd_server::TcpxdServer};
use crate::api::service::ClientService;
use crate::api::state::DaemonState;
use crate::buffers::BufferRegistry;
use crate::config::Config;
use crate::engine::{EngineConfig, LaneLayout};
use crate::headroom::Headroom;
use crate::net::Plugin;
use crate::peers::{CONTROL_CONNECTION_WINDOW, CONTROL_STREAM_WINDOW, MAX_CONTROL_MESSAGE, Peers};
use crate::poller::{Command, DrainReport, PollerConfig, PollerHandle};

/// Largest client request or answer: a block transfer of 1,000,000 scattered blocks a side (4 MB
/// of indices each), a list of 1,000,000 explicit blocks (12 MB); clients raise theirs to match.
pub const MAX_API_MESSAGE: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("device {0} is not one of the plugin's devices (it has {1})")]
    NoSuchDevice(i32, usize),
    #[error("the plugin reports no devices")]
    NoDevices,
    #[error("{0}")]
    Topology(#[from] crate::engine::topology::TopologyError),
    #[error(
        "{devices} devices x ({per_device} lanes per device: plugin.lanes_per_device{eager}) make {lanes} lanes per peer; a pairing carries at most {max}"
    )]
    TooManyLanes {
        devices: usize,
        per_device: u32,
        eager: &'static str,
        lanes: usize,
        max: usize,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("another daemon already listens on {0}")]
    SocketInUse(PathBuf),
    #[error("gRPC reflection: {0}")]
    Reflection(String),
    #[error("api.tcp {0}: the TCP listener requires a bearer token (api.token_file)")]
    TcpWithoutToken(SocketAddr),
    #[error("peer service TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    Auth(#[from] crate::auth::AuthError),
    #[error("{0}")]
    Advertise(String),
    #[error("runtime.state_dir: {0}")]
    Journal(#[from] crate::journal::JournalError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
}

/// A daemon serving in this process.
pub struct RunningDaemon {
    pub node_id: String,
    pub api_socket: PathBuf,
    pub api_tcp: Option<SocketAddr>,
    pub peer_addr: SocketAddr,
    /// The peer addresses descriptors carry (`peer.advertise`, else derived from `peer_addr`).
    pub peer_addresses: Vec<String>,
    /// Where the Prometheus endpoint serves, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    state: Arc<DaemonState>,
    poller: Option<PollerHandle>,
    stop_servers: watch::Sender<bool>,
    servers: Vec<JoinHandle<Result<(), tonic::transport::Error>>>,
    health: tonic_health::server::HealthReporter,
    grace: Duration,
}

/// Accepted TCP connections with TCP_NODELAY. `Server::tcp_nodelay` does not reach a listener
/// served through `serve_with_incoming`: without this, a small control message written while the
/// previous one is unacknowledged waits for the peer's delayed ACK (40 ms on Linux).
fn nodelay(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Starts a daemon: binds every listener and serves. The plugin is already loaded and initialised.
pub async fn start(cfg: &Config, plugin: Arc<Plugin>) -> Result<RunningDaemon, DaemonError> {
    let ndev = plugin.devices().len();
    if ndev == 0 {
        return Err(DaemonError::NoDevices);
    }
    let devices = match &cfg.devices {
        Some(list) => {
            for &d in list {
                if d < 0 || d as usize >= ndev {
                    return Err(DaemonError::NoSuchDevice(d, ndev));
                }
            }
            list.clone()
        }
        None => (0..ndev as i32).collect(),
    };
    let mut engine = EngineConfig {
        chunk_bytes: cfg.chunk_bytes,
        send_window: cfg.send_window,
        gather_ahead: cfg.gather_ahead,
        host_gather_ahead: cfg.host_gather_ahead,
        recv_window: cfg.recv_window,
        scatter_ahead: cfg.scatter_ahead,
        protocol: cfg.protocol.engine(),
        credits: cfg.recv_window as u32,
        devices: devices.len() as u32,
        lanes_per_device: cfg.lanes_per_device,
        eager_lanes: cfg.eager_lanes,
        eager_max_bytes: cfg.eager_max_bytes,
        credit_budget_bytes: cfg.credit_budget_bytes,
        spread_min_chunk: cfg.spread_min_chunk_bytes,
        spread_chunks_per_lane: cfg.spread_chunks_per_lane,
        inline_max_bytes: cfg.inline.max_bytes,
        inline_window_bytes: cfg.inline.window_bytes,
        inline_gpu: cfg.inline.gpu,
        inline_gpu_in_flight: cfg.inline.gpu_in_flight,
        lane_idle_close: cfg.lane_idle_close,
        pairing_idle_close: cfg.pairing_idle_close,
        // The peer answers a LaneOpen at once; the connect and accept after it are bounded by
        // the connect timeout too.
        lane_open_timeout: cfg.peer_connect_timeout,
        ..EngineConfig::default()
    };
    // The handshake carries at most MAX_LANES lanes: refuse here rather than at every pairing.
    let layout = LaneLayout::of(&engine);
    let lanes = layout.lanes() as usize;
    if lanes > crate::peers::MAX_LANES {
        return Err(DaemonError::TooManyLanes {
            devices: devices.len(),
            per_device: layout.per_device(),
            eager: if layout.eager_per_device > 0 {
                " + transfer.eager_lanes"
            } else {
                ""
            },
            lanes,
            max: crate::peers::MAX_LANES,
        });
    }
    let metrics = Arc::new(crate::metrics::Metrics::new());
    // Secrets are read once, here; only their files' paths are ever logged.
    let secret = cfg
        .peer_secret_file
        .as_deref()
        .map(crate::auth::ClusterSecret::load)
        .transpose()?;
    let token = cfg
        .api_token_file
        .as_deref()
        .map(crate::auth::ApiToken::load)
        .transpose()?;
    let tls = match &cfg.peer_tls {
        Some((cert, key, ca)) => Some(crate::auth::PeerTls::load(cert, key, ca)?),
        None => None,
    };
    if secret.is_none() && tls.is_none() {
        tracing::warn!(
            "peers are not authenticated: set peer.secret_file (the same secret on every node) and/or peer.tls_* (mutual TLS), or keep the peer port on a trusted network"
        );
    }
    // The peer service's listener first: descriptors carry the address it is bound to (port 0
    // picks one) unless peer.advertise says otherwise.
    let peer_listener = tokio::net::TcpListener::bind(cfg.peer_listen)
        .await
        .map_err(io(format!("binding the peer service to {}", cfg.peer_listen)))?;
    let peer_addr = peer_listener.local_addr().map_err(io("peer listener address"))?;
    let peer_addresses = crate::advertise::advertised(
        &cfg.peer_advertise,
        peer_addr,
        &crate::config::hostname().unwrap_or_default(),
    )
    .map_err(DaemonError::Advertise)?;
    // The topology: which NIC(s) serve each GPU; every comm is opened under a GPU its NIC serves.
    let topology = {
        let (plugin, devices, spec) = (plugin.clone(), devices.clone(), cfg.topology.clone());
        tokio::task::spawn_blocking(move || crate::topology::discover(&plugin, &devices, &spec))
            .await
            .map_err(|e| DaemonError::Io {
                what: "finding the topology".into(),
                source: std::io::Error::other(e.to_string()),
            })??
    };
    let topology = Arc::new(topology);
    // Credit receives in GPU memory (auto: on a node with a GPU): resolved once, here.
    engine.gpu_credits = cfg.gpu_credits.resolve(cfg.protocol, topology.gpus.len());
    if engine.gpu_credits {
        tracing::info!(
            budget_bytes = cfg.credit_budget_bytes,
            eager_lanes = engine.eager_lanes,
            "credit receives land in GPU memory: transfers into this node's GPU buffers take credits at any size"
        );
    }
    let mut node = crate::api::node::NodeFacts::new(
        &plugin,
        &devices,
        topology.clone(),
        peer_addresses.clone(),
        cfg.lanes_per_device,
        cfg.chunk_bytes,
        crate::config::ProtocolSettings {
            protocol: cfg.protocol,
            eager_lanes: cfg.eager_lanes,
            eager_max_bytes: cfg.eager_max_bytes,
            gpu_credits: cfg.gpu_credits,
            credit_budget_bytes: cfg.credit_budget_bytes,
            spread_min_chunk_bytes: cfg.spread_min_chunk_bytes,
            spread_chunks_per_lane: cfg.spread_chunks_per_lane,
        },
    );
    node.inline = cfg.inline;
    // The state directory: ids never reused, registrations kept for their clients to re-attach.
    let journal = match &cfg.state_dir {
        Some(dir) => Some(Arc::new(crate::journal::Journal::open(dir, &cfg.node_id)?)),
        None => None,
    };
    if journal.is_some() {
        node.reattach_grace_s = cfg.reattach_grace.as_secs() as u32;
    }
    // The flow-steering rules a previous instance left in RxDM (it died with comms open): removed
    // before this one accepts anything (src/rx_rules.rs).
    let rx_rules = match &cfg.state_dir {
        Some(dir) => {
            let (book, left) = crate::rx_rules::RuleBook::open(dir);
            let b = book.clone();
            let prefix = crate::rx_rules::rxdm_prefix();
            let removed =
                tokio::task::spawn_blocking(move || crate::rx_rules::remove_stale(&b, &prefix, left))
                    .await
                    .unwrap_or(0);
            metrics.stale_rx_rules_removed(removed);
            Some(book)
        }
        None => None,
    };
    let (notify_tx, _) = broadcast::channel(4096);
    let (stop_tx, stop_rx) = watch::channel(false);
    // runtime.spin: the poller (and the threads it starts) linger while traffic flows, and
    // (runtime.warm_worker, on with spin unless turned off) an async worker is kept awake too.
    let warmth = cfg.spin.then(crate::idle::Warmth::new);
    if let Some(w) = warmth.as_ref().filter(|_| cfg.warm_worker) {
        tokio::spawn(w.clone().keep_warm(stop_rx.clone()));
    }
    let poller = PollerHandle::start(
        plugin,
        PollerConfig {
            unpack_impl: cfg.unpack_impl,
            engine,
            devices,
            topology: topology.clone(),
            connect_timeout: cfg.peer_connect_timeout,
            metrics: metrics.clone(),
            warmth: warmth.clone(),
            rx_rules,
            host_copy_threads: cfg.host_copy_threads,
            host_copy: cfg.host_copy,
            serve_sessions: cfg.poller_sessions,
            lane_thread: cfg.lane_thread,
            session_thread: cfg.session_thread,
        },
        notify_tx.clone(),
    )
    .map_err(io("starting the poller thread"))?;
    let mut buffers = BufferRegistry::new(&cfg.node_id, cfg.max_buffer_bytes)
        .with_headroom(Headroom::system(cfg.host_memory_reserve))
        .with_advertise(peer_addresses.clone());
    if let (Some(j), Some(dir)) = (&journal, &cfg.state_dir) {
        use crate::journal::Space;
        buffers = buffers.with_host_dir(dir.join("host"));
        buffers.start_ids_at(j.first_id(Space::Buffer));
        // Daemon-allocated CUDA memory outlives the process where its fd can (src/cuda_kept.rs).
        let store = match &cfg.fd_keeper {
            Some(socket) => Some(crate::fd_store::FdStore::keeper(socket)),
            None => crate::fd_store::FdStore::from_env(),
        };
        match store {
            Some(store) => {
                tracing::info!(
                    max = store.max,
                    "daemon-allocated CUDA memory outlives restarts: its descriptors are kept in {}",
                    store.describe()
                );
                buffers = buffers.with_cuda_store(store);
            }
            None => tracing::info!(
                "daemon-allocated CUDA memory does not outlive this process: no descriptor store (systemd's \
                 NOTIFY_SOCKET with FDSTORE, or runtime.fd_keeper; docs/OPERATIONS.md, \"Restarts\")"
            ),
        }
        let _ = poller.sender().send(Command::StartIdsAt {
            lists: j.first_id(Space::List),
            prepared: j.first_id(Space::Prepared),
        });
    }
    let state = Arc::new(DaemonState {
        node_id: cfg.node_id.clone(),
        buffers,
        poller: poller.sender(),
        peers: Arc::new(
            Peers::new(
                &cfg.node_id,
                poller.sender(),
                cfg.peer_connect_timeout,
                crate::peers::Heartbeat {
                    interval: cfg.heartbeat_interval,
                    timeout: cfg.heartbeat_timeout,
                },
            )
            .with_secret(secret)
            .with_tls(tls.as_ref().map(|t| t.client.clone()))
            // Plain TCP: never under mutual TLS (docs/OPERATIONS.md, "Peer security").
            .with_direct_control(cfg.direct_control && tls.is_none())
            .with_topology(&topology, cfg.lanes_per_device),
        ),
        notifications: notify_tx,
        transfers: crate::api::transfer_index::TransferIndex::new(
            cfg.finished_retention,
            cfg.finished_kept_max,
        ),
        default_timeout: cfg.default_timeout,
        stopping: stop_rx.clone(),
        metrics,
        node,
        same_node: Arc::new(crate::api::same_node_registry::SameNode::with_threads(
            cfg.host_copy_threads,
        )),
        journal,
        remote_prepared: Mutex::new(HashMap::new()),
        shared_completions: cfg.shared_completions,
        request_ring: cfg.request_ring,
    });
    let restored = crate::api::reattach::restore(&state, cfg.reattach_grace, stop_rx.clone()).await;
    let stopped = move |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut servers = Vec::new();

    // Peer service.
    state.peers.set_listen_port(peer_addr.port());
    let peer_svc = TcpxdPeerServer::new(PeerService { state: state.clone() })
        .max_decoding_message_size(MAX_CONTROL_MESSAGE)
        .max_encoding_message_size(MAX_CONTROL_MESSAGE);
    let mut peer_server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(CONTROL_STREAM_WINDOW)
        .initial_connection_window_size(CONTROL_CONNECTION_WINDOW);
    if let Some(t) = &tls {
        peer_server = peer_server
            .tls_config(t.server.clone())
            .map_err(|e| DaemonError::Tls(e.to_string()))?;
    }
    let peer_server = peer_server.add_service(peer_svc);
    if cfg.direct_control && tls.is_none() {
        // One port for gRPC and direct control connections, told apart by their first bytes.
        let (incoming, accepting) =
            crate::peers::incoming::listen(peer_listener, state.peers.direct_acceptor(), stop_rx.clone());
        servers.push(tokio::spawn(async move {
            accepting.await;
            Ok(())
        }));
        servers.push(tokio::spawn(
            peer_server.serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone())),
        ));
    } else {
        servers.push(tokio::spawn(peer_server.serve_with_incoming_shutdown(
            nodelay(peer_listener),
            stopped(stop_rx.clone()),
        )));
    }

    // Client API: the service, reflection and health, on a unix socket and optionally TCP.
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<TcpxdServer<ClientService>>().await;
    // Reflection on both `grpc.reflection.v1` and `v1alpha` (which Python's
    // ProtoReflectionDescriptorDatabase and many older tools still ask for).
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder()
        .build_v1()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection_builder()
        .build_v1alpha()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    let api = || {
        tonic::transport::Server::builder()
            .add_service(
                TcpxdServer::new(ClientService { state: state.clone() })
                    .max_decoding_message_size(MAX_API_MESSAGE)
                    .max_encoding_message_size(MAX_API_MESSAGE),
            )
            .add_service(reflection.clone())
            .add_service(reflection_v1alpha.clone())
            .add_service(health_svc.clone())
    };
    // The unix socket also speaks the framed local session: its accept path tells the two apart
    // by each connection's first bytes and hands tonic the gRPC ones.
    let unix = bind_unix(&cfg.api_socket, cfg.api_socket_mode).await?;
    let (grpc_incoming, accepting) =
        crate::api::local::listener::listen(unix, state.clone(), stop_rx.clone());
    servers.push(tokio::spawn(async move {
        accepting.await;
        Ok(())
    }));
    servers.push(tokio::spawn(
        api().serve_with_incoming_shutdown(grpc_incoming, stopped(stop_rx.clone())),
    ));
    let api_tcp = match (cfg.api_tcp, token) {
        (Some(addr), Some(token)) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(io(format!("binding the client API to {addr}")))?;
            let bound = l.local_addr().map_err(io("API listener address"))?;
            // Every call on TCP (the API, reflection, health) must carry the bearer token.
            let gate = tonic::service::InterceptorLayer::new(move |req: tonic::Request<()>| {
                token.check(&req).map(|_| req)
            });
            let tcp_api = tonic::transport::Server::builder()
                .layer(gate)
                .add_service(
                    TcpxdServer::new(ClientService { state: state.clone() })
                        .max_decoding_message_size(MAX_API_MESSAGE)
                        .max_encoding_message_size(MAX_API_MESSAGE),
                )
                .add_service(reflection.clone())
                .add_service(reflection_v1alpha.clone())
                .add_service(health_svc.clone());
            servers.push(tokio::spawn(
                tcp_api.serve_with_incoming_shutdown(nodelay(l), stopped(stop_rx.clone())),
            ));
            Some(bound)
        }
        (Some(addr), None) => return Err(DaemonError::TcpWithoutToken(addr)),
        (None, _) => None,
    };

    // Prometheus metrics over HTTP.
    let metrics_addr = match cfg.metrics_listen {
        Some(addr) => {
            let l = crate::metrics::bind(addr)
                .await
                .map_err(io(format!("binding the metrics endpoint to {addr}")))?;
            let bound = l.local_addr().map_err(io("metrics listener address"))?;
            let st = state.clone();
            tokio::spawn(crate::metrics::serve(
                l,
                move || {
                    let st = st.clone();
                    async move { st.render_metrics().await.map_err(|s| s.message().to_string()) }
                },
                stop_rx.clone(),
            ));
            Some(bound)
        }
        None => None,
    };

    // Forget finished transfers after their retention, and past `transfer.finished_kept_max`: each
    // tick costs what it forgets (`api::transfer_index`).
    let prune = state.clone();
    let mut prune_stop = stop_rx.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => prune.prune_finished(Instant::now()),
                _ = prune_stop.wait_for(|s| *s) => return,
            }
        }
    });

    tracing::info!(
        node = %cfg.node_id,
        api = %cfg.api_socket.display(),
        api_tcp = ?api_tcp,
        peer = %peer_addr,
        advertise = ?peer_addresses,
        metrics = ?metrics_addr,
        chunk_bytes = cfg.chunk_bytes,
        spread_min_chunk_bytes = cfg.spread_min_chunk_bytes,
        spread_chunks_per_lane = cfg.spread_chunks_per_lane,
        spin = cfg.spin,
        async_workers = cfg.async_workers,
        poller_sessions = cfg.poller_sessions,
        session_thread = cfg.session_thread,
        lane_thread = cfg.lane_thread,
        host_copy_threads = cfg.host_copy_threads,
        instance = %state.node.instance_id,
        state_dir = ?cfg.state_dir,
        restored,
        "tcpxd serving"
    );
    Ok(RunningDaemon {
        node_id: cfg.node_id.clone(),
        api_socket: cfg.api_socket.clone(),
        api_tcp,
        peer_addr,
        peer_addresses,
        metrics_addr,
        state,
        poller: Some(poller),
        stop_servers: stop_tx,
        servers,
        health,
        grace: cfg.shutdown_grace,
    })
}

/// Binds the API's unix socket: creates its directory, replaces a stale socket file (refusing
/// one a live daemon still answers on), and sets its mode.
async fn bind_unix(path: &Path, mode: u32) -> Result<tokio::net::UnixListener, DaemonError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(DaemonError::Io {
                what: format!("{} exists and is not a socket", path.display()),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            });
        }
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(DaemonError::SocketInUse(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(io(format!("removing the stale socket {}", path.display())))?;
    }
    let l = tokio::net::UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("setting the mode of {}", path.display())))?;
    Ok(l)
}

impl RunningDaemon {
    pub fn state(&self) -> &Arc<DaemonState> {
        &self.state
    }

    /// Stops accepting transfers, lets in-flight ones finish for the grace period, fails the
    /// rest with UNAVAILABLE, then stops serving.
    pub async fn shutdown(mut self) -> DrainReport {
        self.health.set_not_serving::<TcpxdServer<ClientService>>().await;
        let deadline = Instant::now() + self.grace;
        let (tx, rx) = oneshot::channel();
        let none = DrainReport {
            finished_in_grace: 0,
            failed_at_deadline: 0,
        };
        let sent = self
            .state
            .poller
            .send(Command::Drain { deadline, reply: tx })
            .is_ok();
        // The poller's transfers and the same-node copies (which the daemon runs itself) drain
        // together, under the same deadline.
        let (poller, copies) = tokio::join!(
            async {
                match sent {
                    true => rx.await.unwrap_or(none),
                    false => none,
                }
            },
            self.state.same_node.drain(deadline)
        );
        let report = DrainReport {
            finished_in_grace: poller.finished_in_grace + copies.finished_in_grace,
            failed_at_deadline: poller.failed_at_deadline + copies.failed_at_deadline,
        };
        // Give watchers a moment to read the final statuses.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = self.stop_servers.send(true);
        for s in self.servers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
        }
        let _ = std::fs::remove_file(&self.api_socket);
        if let Some(p) = self.poller.take() {
            let _ = tokio::task::spawn_blocking(move || p.join()).await;
        }
        // Nothing registers any more: the lists kept in their buffers' records get their own
        // records too, for an older daemon started on the directory next (docs/OPERATIONS.md).
        if let Some(j) = self.state.journal.clone() {
            let n = tokio::task::spawn_blocking(move || j.write_list_records())
                .await
                .unwrap_or(0);
            tracing::debug!(
                lists = n,
                "state directory: list records written for older daemons"
            );
        }
        // Over the daemon's life, the transfers this node started (as tcpxd_transfers_total),
        // then what the drain did with those still in flight at the stop.
        let (ok, failed) = self.state.metrics.summary().ok_and_failed();
        tracing::info!(
            transfers_ok = ok,
            transfers_failed = failed,
            in_flight_finished = report.finished_in_grace,
            in_flight_failed = report.failed_at_deadline,
            "tcpxd stopped: transfers started here, over its life: {ok} ok, {failed} failed; of those in flight at the stop, {} finished within the grace period, {} failed at its end",
            report.finished_in_grace,
            report.failed_at_deadline
        );
        report
    }
}

/// The JSON a `--ready-file` receives once the daemon serves.
pub fn ready_json(d: &RunningDaemon) -> String {
    serde_json::json!({
        "node_id": d.node_id,
        "api_socket": d.api_socket,
        "api_tcp": d.api_tcp.map(|a| a.to_string()),
        "peer_address": d.peer_addr.to_string(),
        "peer_addresses": d.peer_addresses,
        "metrics": d.metrics_addr.map(|a| a.to_string()),
        "pid": std::process::id(),
        "instance_id": d.state.node.instance_id,
    })
    .to_string()
}

//! The daemon's GPU data path without a GPU: two `tcpxd` processes on the CUDA stand-in
//! (tools/realplugin/cudastub as their `libcuda.so.1`: eight "GPUs" over host memory with A3's
//! PCI bus ids, `tcpxd_testkit::cudastub`), the built-in emulation in its CUDA mode, and the
//! `d2d` and `host` unpackers (the stand-in runs no kernels). CUDA buffers on different GPUs of
//! the two nodes, WRITE and READ between them and host memory, every byte compared through
//! ReadBuffer.
//!
//! The emulation models A3's GPU <-> NIC binding (docs/EMULATION.md): with four NICs and its
//! default map each NIC serves two GPUs, and a daemon whose comms are not opened under a GPU
//! their NIC serves (main before issue #37's topology) has its CUDA receives failed with "rx no
//! cmsg". These runs use one NIC (which serves all eight GPUs), four with the binding off
//! (`TCPXEMU_GPUS=all`), and four with the binding on: the daemon opens every lane under a GPU
//! its NIC serves (docs/OPERATIONS.md, "The topology").

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::daemons::{Client, fill_seed, unix_client};
use crate::common::gpus::{Compare, Trip, cuda_buffer, host_to_and_from_gpus, write_and_read_back};
use tcpxd::api::proto::v1 as pb;
use tcpxd_testkit::ScratchDir;

/// A daemon process, killed when dropped.
pub(crate) struct Daemon {
    child: Child,
    pub(crate) client: Client,
}

impl Daemon {
    /// The daemon's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A daemon on `nics` emulated NICs; `binding`: the emulation's default GPU map, else
/// `TCPXEMU_GPUS=all` (every NIC serves every GPU).
pub(crate) async fn start(dir: &ScratchDir, node: &str, unpacker: &str, nics: u32, binding: bool) -> Daemon {
    start_with(dir, node, unpacker, nics, binding, &[]).await
}

/// [`start`] with more environment for the daemon.
pub(crate) async fn start_with(
    dir: &ScratchDir,
    node: &str,
    unpacker: &str,
    nics: u32,
    binding: bool,
    env: &[(&str, &str)],
) -> Daemon {
    start_logged(dir, node, unpacker, nics, binding, env, Stdio::inherit()).await
}

/// [`start_with`], the daemon's log (stderr) going to `log`.
pub(crate) async fn start_logged(
    dir: &ScratchDir,
    node: &str,
    unpacker: &str,
    nics: u32,
    binding: bool,
    env: &[(&str, &str)],
    log: Stdio,
) -> Daemon {
    let sock = dir.join(format!("{node}.sock"));
    let ready = dir.join(format!("{node}.ready"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
        .args([
            "--node-id",
            node,
            "--builtin-emulation",
            "--peer-listen",
            "127.0.0.1:0",
        ])
        .arg("--api-socket")
        .arg(&sock)
        .arg("--ready-file")
        .arg(&ready)
        .envs(tcpxd_testkit::cudastub::child_env(8))
        .envs([
            ("RUST_LOG", "warn"),
            ("UCCL_TCPX_UNPACK_IMPL", unpacker),
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "2048"),
        ])
        .env("TCPXEMU_DEVICES", nics.to_string())
        .envs((!binding).then_some(("TCPXEMU_GPUS", "all")))
        // These tests follow GPU bytes on the lanes and credits: GPU memory inline (on by
        // default) is daemon_inline's, which passes `TCPXD_INLINE_GPU` in `env`.
        .env("TCPXD_INLINE_GPU", "off")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("tcpxd starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "{node}: no ready file");
        assert!(child.try_wait().unwrap().is_none(), "{node}: tcpxd exited early");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = unix_client(sock).await;
    Daemon { child, client }
}

async fn gpu_to_gpu_on_the_stand_in(unpacker: &str, nics: u32, binding: bool) {
    let dir = ScratchDir::fresh("tcpxd-stub-gpus", unpacker);
    std::fs::create_dir_all(&*dir).unwrap();
    let mut a = start(&dir, "stub-a", unpacker, nics, binding).await;
    let mut b = start(&dir, "stub-b", unpacker, nics, binding).await;
    let node = a
        .client
        .describe_node(pb::DescribeNodeRequest {})
        .await
        .expect("describe")
        .into_inner();
    let ids: Vec<&str> = node.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    assert_eq!(
        ids,
        tcpxd_cudastub_ids(),
        "the daemon sees the stand-in's eight A3 GPUs"
    );
    const MIB: u64 = 1 << 20;
    let size = 4 * MIB;
    let src = cuda_buffer(&mut a.client, 3, size).await;
    let dst = cuda_buffer(&mut b.client, 5, size).await;
    let back = cuda_buffer(&mut a.client, 0, size).await;
    fill_seed(&mut a.client, src.id, 0, 0, 77).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    for (k, len) in [1u64, 4097, 3 * MIB + 5].into_iter().enumerate() {
        let at = [k as u64 * 7, 4096 + k as u64 * 3, 0];
        let what = format!("{unpacker}: GPU 3 -> GPU 5 -> GPU 0");
        write_and_read_back(&mut a.client, &mut b.client, trip, at, len, Compare::Bytes, &what).await;
    }
    // Host to GPU and GPU to host on the same pairing.
    host_to_and_from_gpus(&mut a.client, &mut b.client, &src, &dst, 2 * MIB, Compare::Bytes).await;
}

/// A3's GPU bus ids in ordinal order (RxDM's a3vm preset), as the stand-in presents them.
fn tcpxd_cudastub_ids() -> Vec<&'static str> {
    vec![
        "0000:04:00.0",
        "0000:05:00.0",
        "0000:0a:00.0",
        "0000:0b:00.0",
        "0000:84:00.0",
        "0000:85:00.0",
        "0000:8a:00.0",
        "0000:8b:00.0",
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_on_the_cuda_stand_in_d2d_unpacker_one_nic() {
    gpu_to_gpu_on_the_stand_in("d2d", 1, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_on_the_cuda_stand_in_host_unpacker_four_nics_unbound() {
    gpu_to_gpu_on_the_stand_in("host", 4, false).await;
}

/// Four NICs, each serving two GPUs as on A3: every lane's comms are opened under a GPU their NIC
/// serves, so no CUDA receive fails (the GPU 5 buffer's chunks land in the bounce memory of the
/// GPU each lane was listened under and are unpacked from there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_on_the_cuda_stand_in_d2d_unpacker_four_bound_nics() {
    gpu_to_gpu_on_the_stand_in("d2d", 4, true).await;
}

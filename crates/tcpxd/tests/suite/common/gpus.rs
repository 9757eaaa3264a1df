//! CUDA buffers and the round trips the GPU tests share, on a real GPU (`daemon_gpu`,
//! `daemon_gpu_credits`) and on the CUDA stand-in (`daemon_stub_gpus`, `daemon_stub_gpus_credits`,
//! `topology`): a WRITE then a READ back of one range, host memory to and from GPU buffers, and a
//! coalesced batch of scattered entries, every one waited for and its bytes compared.

use tcpxd::api::proto::v1 as pb;
use tcpxd::config::DaemonArgs;

use super::daemons::{
    Client, bytes, crc, fill_seed, host_buffer, read, read_entry, wait_ok, write, write_entry,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// A CUDA allocation of `size` bytes on GPU `device`, registered.
pub async fn cuda_buffer(c: &mut Client, device: u32, size: u64) -> pb::Buffer {
    c.register_buffer(pb::RegisterBufferRequest {
        reattach_id: Default::default(),
        reattach_key: Default::default(),
        source: Some(pb::register_buffer_request::Source::Cuda(pb::CudaAllocation {
            device,
            size,
        })),
        label: String::new(),
    })
    .await
    .expect("CUDA buffer")
    .into_inner()
}

/// For `daemons::start`: the daemon reads its config from a file holding `toml` (named by `tag`).
pub fn with_config(tag: &str, toml: &str) -> impl FnOnce(&mut DaemonArgs) + use<> {
    let path = std::env::temp_dir().join(format!("tcpxd-{tag}-{}.toml", std::process::id()));
    std::fs::write(&path, toml).unwrap();
    move |args| args.config = Some(path)
}

/// How a test compares a range on one daemon with a range on another.
#[derive(Clone, Copy, Debug)]
pub enum Compare {
    /// The daemons' CRC32C of each (fast at any size: the real-GPU tests' gigabytes).
    Crc,
    /// Every byte, read through ReadBuffer (the source must not be all zeros), naming the first
    /// that differs.
    Bytes,
}

/// Asserts that `len` bytes of buffer `x.0` on `a` at offset `x.1` equal those of `y` on `b`.
pub async fn assert_equal(
    how: Compare,
    a: &mut Client,
    x: (u64, u64),
    b: &mut Client,
    y: (u64, u64),
    len: u64,
    what: &str,
) {
    match how {
        Compare::Crc => assert_eq!(crc(a, x.0, x.1, len).await, crc(b, y.0, y.1, len).await, "{what}"),
        Compare::Bytes => assert_same(a, x, b, y, len, what).await,
    }
}

/// [`Compare::Bytes`].
pub async fn assert_same(a: &mut Client, x: (u64, u64), b: &mut Client, y: (u64, u64), len: u64, what: &str) {
    let want = bytes(a, x.0, x.1, len).await;
    assert!(want.iter().any(|&v| v != 0), "{what}: the source is all zeros");
    let got = bytes(b, y.0, y.1, len).await;
    if let Some(i) = want.iter().zip(&got).position(|(p, q)| p != q) {
        panic!("{what}: byte {i} of {len} differs");
    }
}

/// A round trip's buffers: `src` and `back` on the first daemon, `dst` on the second.
#[derive(Clone, Copy)]
pub struct Trip<'a> {
    pub src: &'a pb::Buffer,
    pub dst: &'a pb::Buffer,
    pub back: &'a pb::Buffer,
}

/// A WRITE of `len` bytes from `t.src` at `at[0]` into `t.dst` at `at[1]`, then a READ of them
/// back into `t.back` at `at[2]`, each waited for and compared; `what` names the trip in failures.
pub async fn write_and_read_back(
    a: &mut Client,
    b: &mut Client,
    t: Trip<'_>,
    [soff, doff, boff]: [u64; 3],
    len: u64,
    how: Compare,
    what: &str,
) {
    let id = write(a, write_entry(t.src, soff, t.dst, doff, len), b"")
        .await
        .unwrap();
    wait_ok(a, id).await;
    let written = format!("{what}: WRITE of {len} bytes");
    assert_equal(how, a, (t.src.id, soff), b, (t.dst.id, doff), len, &written).await;
    let id = read(a, read_entry(t.dst, doff, t.back, boff, len)).await.unwrap();
    wait_ok(a, id).await;
    let read_back = format!("{what}: READ of {len} bytes");
    assert_equal(how, b, (t.dst.id, doff), a, (t.back.id, boff), len, &read_back).await;
}

/// Host memory into GPU buffer `dst` (on `b`) and GPU buffer `src` (on `a`) into host memory, one
/// WRITE of `len` bytes each from offset 0 on the same pairing, compared.
pub async fn host_to_and_from_gpus(
    a: &mut Client,
    b: &mut Client,
    src: &pb::Buffer,
    dst: &pb::Buffer,
    len: u64,
    how: Compare,
) {
    let host = host_buffer(a, len, "").await;
    fill_seed(a, host.id, 0, 0, 5).await;
    let id = write(a, write_entry(&host, 0, dst, 0, len), b"").await.unwrap();
    wait_ok(a, id).await;
    assert_equal(how, a, (host.id, 0), b, (dst.id, 0), len, "host -> GPU").await;
    let hb = host_buffer(b, len, "").await;
    let id = write(a, write_entry(src, 0, &hb, 0, len), b"").await.unwrap();
    wait_ok(a, id).await;
    assert_equal(how, a, (src.id, 0), b, (hb.id, 0), len, "GPU -> host").await;
}

/// A coalesced batch of 48 scattered 1 KiB entries (48 KiB: eager) from `src` (on `a`) from 1 MiB
/// into `dst` (on `b`) from 2 MiB, in reverse order and spaced differently on each side; every
/// entry compared.
pub async fn scattered_batch(
    a: &mut Client,
    b: &mut Client,
    src: &pb::Buffer,
    dst: &pb::Buffer,
    how: Compare,
) {
    let at = |k: u64| (MIB + k * 3 * KIB, 2 * MIB + (47 - k) * 2 * KIB);
    let entries: Vec<pb::WriteEntry> = (0..48u64)
        .map(|k| write_entry(src, at(k).0, dst, at(k).1, KIB))
        .collect();
    let id = a
        .write_batch(pb::WriteBatchRequest {
            entries,
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    wait_ok(a, id).await;
    for k in 0..48u64 {
        let (s, d) = at(k);
        assert_equal(
            how,
            a,
            (src.id, s),
            b,
            (dst.id, d),
            KIB,
            &format!("batch entry {k}"),
        )
        .await;
    }
}

/// In flight together: one WRITE of `large` bytes from `t.src` into `t.dst` (both at 0), one READ
/// of `read.1` bytes from `t.dst` at `read.0` into `t.back` at 0, and `small.0` WRITEs of 4 KiB
/// each from `small.1` on, `small.2` apart (the same offset on both sides); all complete and are
/// compared. A large transfer does not starve small ones.
pub async fn large_and_small_in_flight(
    a: &mut Client,
    b: &mut Client,
    t: Trip<'_>,
    large: u64,
    read_at: (u64, u64),
    small: (u64, u64, u64),
    how: Compare,
) {
    let large_write = write(a, write_entry(t.src, 0, t.dst, 0, large), b"")
        .await
        .unwrap();
    let large_read = read(a, read_entry(t.dst, read_at.0, t.back, 0, read_at.1))
        .await
        .unwrap();
    let mut smalls = Vec::new();
    for k in 0..small.0 {
        let at = small.1 + k * small.2;
        let id = write(a, write_entry(t.src, at, t.dst, at, 4 * KIB), b"")
            .await
            .unwrap();
        smalls.push((id, at));
    }
    for &(id, _) in &smalls {
        wait_ok(a, id).await;
    }
    wait_ok(a, large_write).await;
    wait_ok(a, large_read).await;
    assert_equal(how, a, (t.src.id, 0), b, (t.dst.id, 0), large, "the large WRITE").await;
    let (at, len) = read_at;
    assert_equal(how, b, (t.dst.id, at), a, (t.back.id, 0), len, "the large READ").await;
    for (_, at) in smalls {
        let what = format!("a small WRITE at {at}");
        assert_equal(how, a, (t.src.id, at), b, (t.dst.id, at), 4 * KIB, &what).await;
    }
}

/// Eight WRITEs of `len` bytes from `src` into `dst` in flight at once (the k-th at `k * 2 * len
/// + shift`, landing `dst_gap` bytes further on), each waited for, then the eight READs of them
/// back into `back` in flight at once, then every range compared both ways.
pub async fn eight_writes_then_reads(
    a: &mut Client,
    b: &mut Client,
    (src, back, dst): (&pb::Buffer, &pb::Buffer, &pb::Buffer),
    len: u64,
    shift: u64,
    dst_gap: u64,
    what: &str,
) {
    let mut ats = Vec::new();
    let mut ids = Vec::new();
    for k in 0..8u64 {
        let at = k * 2 * len + shift;
        ids.push(
            write(a, write_entry(src, at, dst, at + dst_gap, len), b"")
                .await
                .unwrap(),
        );
        ats.push(at);
    }
    for id in ids.drain(..) {
        wait_ok(a, id).await;
    }
    for &at in &ats {
        ids.push(
            read(a, read_entry(dst, at + dst_gap, back, at, len))
                .await
                .unwrap(),
        );
    }
    for id in ids {
        wait_ok(a, id).await;
    }
    for &at in &ats {
        let what = format!("{what}: {len} bytes at {at}, 8 in flight");
        assert_same(a, (src.id, at), b, (dst.id, at + dst_gap), len, &what).await;
        let mut again = a.clone();
        assert_same(a, (src.id, at), &mut again, (back.id, at), len, &what).await;
    }
}

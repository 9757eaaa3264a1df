//! Cases about devices and comms: the plugin's properties, connect/accept, memory registration,
//! and closing (with requests outstanding, by the peer, a listener gone before the connect).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::harness::{Ctx, Pair, TestBuf, err, exchange};
use tcpxd::net::{NetError, Plugin, RecvComm, Region, abi};

pub(super) fn check_properties(plugin: &Plugin) -> Result<String, String> {
    let devs = plugin.devices();
    if devs.is_empty() {
        return Err("the plugin reports no devices".into());
    }
    let mut problems = Vec::new();
    for d in devs {
        if d.name.is_empty() {
            problems.push(format!("dev {}: empty name", d.dev));
        }
        if d.max_recvs != 1 {
            problems.push(format!(
                "dev {}: maxRecvs {} (TCPX reports 1)",
                d.dev, d.max_recvs
            ));
        }
        if !d.uses_unpack() {
            problems.push(format!(
                "dev {}: netDeviceType {} (TCPX reports UNPACK = 1)",
                d.dev, d.net_device_type
            ));
        }
        if !(d.supports_host() && d.supports_cuda()) {
            problems.push(format!(
                "dev {}: ptrSupport {:#x} (TCPX reports HOST|CUDA)",
                d.dev, d.ptr_support
            ));
        }
        if d.speed_mbps <= 0 || d.max_comms <= 0 {
            problems.push(format!(
                "dev {}: speed {} / maxComms {}",
                d.dev, d.speed_mbps, d.max_comms
            ));
        }
    }
    let chunk = std::env::var("NCCL_DYNAMIC_CHUNK_SIZE").unwrap_or_default();
    if chunk.parse::<u64>().unwrap_or(0) == 0 {
        problems.push("NCCL_DYNAMIC_CHUNK_SIZE is not set to a positive value".into());
    }
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    let list: Vec<String> = devs
        .iter()
        .map(|d| {
            format!(
                "{}={} {}Mbps ptr={:#x}",
                d.dev, d.name, d.speed_mbps, d.ptr_support
            )
        })
        .collect();
    Ok(format!(
        "{} device(s) [{}], unpack v{:#x}, maxRecvs 1, NCCL_DYNAMIC_CHUNK_SIZE={chunk}",
        devs.len(),
        list.join(", "),
        devs[0].net_device_version
    ))
}

pub(super) fn case_connect_accept(ctx: &Ctx) -> Result<String, String> {
    let start = Instant::now();
    let mut listen = ctx.plugin.listen(ctx.dev).map_err(err("listen"))?;
    let handle = listen.handle();
    let used = handle.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let mut connector = ctx.plugin.connector(ctx.dev, &handle).map_err(err("connector"))?;
    let first_connect = connector.step().map_err(err("first connect call"))?;
    let first_accept = listen.accept_step().map_err(err("first accept call"))?;
    if first_connect.is_some() || first_accept.is_some() {
        return Err(format!(
            "connect/accept are not non-blocking: first calls returned a comm (connect: {}, accept: {})",
            first_connect.is_some(),
            first_accept.is_some()
        ));
    }
    let deadline = Instant::now() + ctx.opts.connect_timeout;
    let (mut send, mut recv) = (None, None);
    let mut calls = 1;
    while send.is_none() || recv.is_none() {
        if Instant::now() > deadline {
            return Err(format!("not connected after {:?}", ctx.opts.connect_timeout));
        }
        if send.is_none() {
            send = connector.step().map_err(err("connect"))?;
        }
        if recv.is_none() {
            recv = listen.accept_step().map_err(err("accept"))?;
        }
        calls += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    let recv: RecvComm = recv.expect("set");
    let dh = recv
        .device_handle()
        .ok_or("accept left the device handle empty")?;
    if (
        dh.netDeviceType,
        dh.netDeviceVersion,
        dh.size,
        dh.needsProxyProgress,
    ) != (
        abi::NCCL_NET_DEVICE_UNPACK,
        abi::NCCL_NET_DEVICE_UNPACK_VERSION,
        24,
        1,
    ) || dh.handle.is_null()
    {
        return Err(format!(
            "device handle is {dh:?}, expected {{1, 7, <ptr>, 24, 1}}"
        ));
    }
    let ring = match recv.unpack_ring() {
        Ok(r) if r.bounce_is_host_readable() => "unpack ring and bounce buffer in host memory",
        Ok(_) => "unpack ring host-mapped, bounce buffer in GPU memory",
        Err(_) => "unpack handle in device memory",
    };
    Ok(format!(
        "non-blocking on both sides, ready after {calls} rounds in {:.1} ms; handle uses {used} of 128 bytes; device handle {{1, 7, ptr, 24, 1}}; {ring}",
        start.elapsed().as_secs_f64() * 1e3
    ))
}

pub(super) fn case_host_registration(ctx: &Ctx) -> Result<String, String> {
    let p = ctx.pair(1 << 20)?;
    // A second registration of the same memory on each side, dropped (deregistered) at once.
    let again = p
        .send
        .register(p.src.region())
        .map_err(err("second regMr on the send comm"))?;
    drop(again);
    let again = p
        .recv
        .register(p.dst.region())
        .map_err(err("second regMr on the recv comm"))?;
    drop(again);
    let small: Arc<dyn Region> = TestBuf::new(&ctx.mem, 1)?.region();
    let small_mh = p.send.register(small).map_err(err("regMr of a 1-byte region"))?;
    drop(small_mh);
    let mut p = p;
    exchange(&mut p, &[(0, 4096, 1, 1)], ctx.opts.case_timeout).map(|_| {
        "regMr/deregMr of host memory on send and recv comms; data moves through the registrations".into()
    })
}

pub(super) fn case_close_outstanding(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(16 * 65536)?;
    for k in 0..8 {
        p.send
            .isend(&p.smh, k * 65536, 65536, 0)
            .map_err(err("isend"))?
            .ok_or("deferred")?;
    }
    for k in 0..4 {
        p.recv
            .irecv(&p.rmh, k * 65536, 65536, 0)
            .map_err(err("irecv"))?
            .ok_or("deferred")?;
    }
    // Let some data move, then close both sides with requests outstanding.
    for _ in 0..50 {
        if let Some(id) = p.send.oldest() {
            let _ = p.send.test(id);
        }
        if let Some(id) = p.recv.oldest_pending() {
            let _ = p.recv.test(id);
        }
    }
    let (so, ro) = (p.send.outstanding(), p.recv.outstanding());
    let start = Instant::now();
    let Pair {
        send, recv, smh, rmh, ..
    } = p;
    drop(smh);
    drop(send);
    drop(rmh);
    drop(recv);
    Ok(format!(
        "closed with {so} sends and {ro} receives outstanding in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    ))
}

pub(super) fn case_peer_close(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(65536)?;
    let rid = p
        .recv
        .irecv(&p.rmh, 0, 65536, 0)
        .map_err(err("irecv"))?
        .ok_or("deferred")?;
    let Pair {
        send, smh, mut recv, ..
    } = p;
    drop(smh);
    drop(send);
    let start = Instant::now();
    let deadline = start + ctx.opts.connect_timeout;
    loop {
        match recv.test(rid) {
            Err(e) => {
                return Ok(format!(
                    "pending receive failed {:.1} ms after the sender closed: {e}",
                    start.elapsed().as_secs_f64() * 1e3
                ));
            }
            Ok(Some(_)) => return Err("a receive completed although the sender sent nothing".into()),
            Ok(None) if Instant::now() > deadline => {
                return Err(format!(
                    "a pending receive still waits {:?} after its sender closed",
                    ctx.opts.connect_timeout
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

pub(super) fn case_dead_listener(ctx: &Ctx) -> Result<String, String> {
    let listen = ctx.plugin.listen(ctx.dev).map_err(err("listen"))?;
    let handle = listen.handle();
    drop(listen);
    let timeout = ctx.opts.connect_timeout.min(Duration::from_secs(15));
    let start = Instant::now();
    let r = ctx.plugin.connect(ctx.dev, &handle, timeout);
    let took = start.elapsed();
    match r {
        Ok(_) => Err("connect to a closed listener succeeded".into()),
        Err(NetError::Timeout { .. }) => Ok(format!(
            "the plugin kept retrying; tcpxd's connect timeout ended it after {:.1} s",
            took.as_secs_f64()
        )),
        Err(e) => Ok(format!("failed in {:.1} ms: {e}", took.as_secs_f64() * 1e3)),
    }
}

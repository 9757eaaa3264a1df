//! The verdict for a comm made under a GPU: does its NIC serve that GPU (RxDM's binding, as
//! `topology.rs` resolves it from the configuration)? Asked by `ffi.rs` at `listen` (a comm
//! whose GPU is not served fails its CUDA receives with the real plugin's "rx no cmsg") and at
//! `connect` (logged only: sends are not bound); and, at a comm's close, whether its own GPU is
//! the one current (logged only).

use crate::config::{Config, Device};
use crate::cuda::Ctx;

/// CUDA mode: is the comm's GPU (`ctx`'s device, i.e. the CUDA device current at listen or
/// connect, as the real plugin's `gpu_current_dev`) one that device `d` serves? Logs the verdict;
/// returns why not when it is not.
pub(crate) fn verdict(cfg: &Config, d: &Device, ctx: Option<&Ctx>, what: &str) -> Option<String> {
    let (ctx, b) = (ctx?, cfg.binding.as_ref()?);
    let gpu = b.describe(ctx.device());
    let nic = format!(
        "dev{} {} ({})",
        d.index,
        d.ifname.to_string_lossy(),
        d.pci_path
            .map_or("no pciPath".into(), |p| p.to_string_lossy().into_owned())
    );
    let served = b.serves(d.index, ctx.device());
    if what == "connect" {
        // Sends are not bound: a NIC sends from any GPU's memory.
        info!(
            "tcpxemu: connect on {nic} under GPU {gpu} ({} by this NIC; sends are not bound)",
            if served { "served" } else { "not served" }
        );
        return None;
    }
    if served {
        info!("tcpxemu: {what} on {nic} under GPU {gpu}: served by this NIC");
        return None;
    }
    let why = format!(
        "GPU {gpu} is not served by {nic}, which serves {}: on A3, RxDM files this comm's \
         flow-steering rules under another NIC and its data lands in host memory",
        b.served_list(d.index)
    );
    info!("tcpxemu: {what} on {nic} under GPU {gpu}: NOT served by this NIC; {why}");
    Some(why)
}

/// CUDA mode: logs which GPU is current as a comm made under GPU `gpu` closes. Google's plugin
/// frees a comm's device queue under the comm's own GPU (`__tcpxNetDeviceQueueFree` pushes it)
/// and its CUDA-runtime build leaves that GPU current on the closing thread; a caller that closes
/// each comm with its own GPU current sees no such change. Logged only, each verdict on its own
/// line (the first of "not its own GPU" always logged by a caller limiting per line), as nothing
/// fails.
pub(crate) fn closed(what: &str, label: &str, gpu: Option<i32>) {
    let Some(own) = gpu else { return };
    let Some(cfg) = crate::config::get() else { return };
    let Ok(cur) = Ctx::current_or_primary(cfg.cuda_device) else {
        return;
    };
    if cur.device() == own {
        info!("tcpxemu: {what} comm closed under its own GPU {own} ({label})");
    } else {
        info!(
            "tcpxemu: {what} comm closed under GPU {}, not its own GPU {own} ({label})",
            cur.device()
        );
    }
}

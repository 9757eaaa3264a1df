//! The GPU <-> NIC binding RxDM imposes on A3 (reference/TCPX_PLUGIN_ABI.md §8): a receive comm
//! listened for under a GPU its NIC does not serve gets its data in host memory, so its CUDA
//! receives fail ("rx no cmsg"; the shipped plugin then calls `exit(1)`, §5), while its
//! host-memory receives are plain receives and work.
//!
//! Which GPUs a NIC serves is RxDM's `a3vm` table, scaled to the GPUs and devices present (as the
//! emulation's default and the daemon's even spread): with G GPUs and D devices, G >= D: GPU i is
//! served by device floor(i*D/G); G < D: device j serves GPU ceil((j+1)*G/D) - 1.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::harness::{Ctx, err, pattern};
use tcpxd::gpu::Gpu;
use tcpxd::net::{self, HostRegion, Region};

/// Does device `dev` of `d` serve GPU `gpu` of `g` under the scaled `a3vm` table?
pub(super) fn a3vm_serves(dev: usize, gpu: usize, g: usize, d: usize) -> bool {
    if g == 0 || d == 0 {
        return false;
    }
    if g >= d {
        gpu * d / g == dev
    } else {
        ((dev + 1) * g).div_ceil(d) - 1 == gpu
    }
}

/// A GPU that device `dev` does not serve, if there is one.
pub(super) fn unserved_gpu(dev: usize, gpus: usize, devices: usize) -> Option<usize> {
    (0..gpus).find(|&g| !a3vm_serves(dev, g, gpus, devices))
}

/// `misbound_gpu`: connect and accept on `ctx.dev` with a GPU current that the device does not
/// serve; a host-memory receive must land byte-exact, the CUDA receive must fail.
pub(super) fn case_misbound_gpu(ctx: &Ctx) -> Result<String, String> {
    let gpus = Gpu::device_count().map_err(|e| e.to_string())?;
    let devices = ctx.plugin.devices().len();
    let dev = usize::try_from(ctx.dev).map_err(|_| format!("device {}", ctx.dev))?;
    let g = unserved_gpu(dev, gpus, devices)
        .ok_or_else(|| format!("every one of the {gpus} GPU(s) is served by device {dev}"))?;
    let gpu = Gpu::open(g).map_err(|e| e.to_string())?;
    let bus = tcpxd::gpu::list_devices()
        .ok()
        .and_then(|l| l.into_iter().find(|s| s.ordinal == g))
        .map(|s| s.pci_bus_id)
        .unwrap_or_default();
    // listen, connect and accept all run on this thread, under GPU g.
    gpu.bind_to_thread().map_err(|e| e.to_string())?;
    let (mut send, mut recv) =
        net::loopback_pair(&ctx.plugin, ctx.dev, ctx.opts.connect_timeout).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + ctx.opts.case_timeout.min(Duration::from_secs(60));

    // A host-memory receive: a plain receive, on A3 too.
    let len = 65536 + 123;
    let want = pattern(0xB1D, len);
    let hsrc = Arc::new(HostRegion::new(len).map_err(|e| e.to_string())?);
    let hdst = Arc::new(HostRegion::new(len).map_err(|e| e.to_string())?);
    hsrc.write(0, &want).map_err(|e| e.to_string())?;
    let smh = send
        .register(hsrc.clone() as Arc<dyn Region>)
        .map_err(err("regMr host"))?;
    let rmh = recv
        .register(hdst.clone() as Arc<dyn Region>)
        .map_err(err("regMr host"))?;
    let r = recv
        .irecv(&rmh, 0, len, 0)
        .map_err(err("irecv"))?
        .ok_or("irecv deferred")?;
    send.isend(&smh, 0, len, 0)
        .map_err(err("isend"))?
        .ok_or("isend deferred")?;
    loop {
        if Instant::now() > deadline {
            return Err("the host-memory receive did not complete".into());
        }
        if let Some(id) = send.oldest() {
            send.test(id).map_err(err("send test"))?;
        }
        if recv
            .test(r)
            .map_err(err("host receive on a mis-bound comm"))?
            .is_some()
        {
            break;
        }
        std::thread::yield_now();
    }
    if !recv.fragments(r).map_err(err("fragment list"))?.is_empty() {
        recv.unpack_host(r).map_err(err("host unpack"))?;
    }
    recv.consume(r).map_err(err("irecvConsumed"))?;
    if hdst.to_vec(0, len).map_err(|e| e.to_string())? != want {
        return Err("the host-memory receive on the mis-bound comm landed wrong bytes".into());
    }

    // A CUDA receive: the plugin finds no devmem control message.
    let clen = 1 << 20;
    let csrc = Arc::new(gpu.alloc(clen).map_err(|e| e.to_string())?);
    let cdst = Arc::new(gpu.alloc(clen).map_err(|e| e.to_string())?);
    csrc.write(0, &pattern(0xC0DA, clen)).map_err(|e| e.to_string())?;
    let smh = send
        .register(csrc.clone() as Arc<dyn Region>)
        .map_err(err("regMr CUDA"))?;
    let rmh = recv
        .register(cdst.clone() as Arc<dyn Region>)
        .map_err(err("regMr CUDA"))?;
    let r = recv
        .irecv(&rmh, 0, clen, 0)
        .map_err(err("irecv"))?
        .ok_or("irecv deferred")?;
    send.isend(&smh, 0, clen, 0)
        .map_err(err("isend"))?
        .ok_or("isend deferred")?;
    let failure = loop {
        if Instant::now() > deadline {
            return Err(format!(
                "a CUDA receive on dev{dev} under GPU {g} ({bus}), which it does not serve, neither \
                 failed nor completed"
            ));
        }
        if let Some(id) = send.oldest() {
            // The sender may fail too once the receiver gives up; only the receive is judged.
            let _ = send.test(id);
        }
        match recv.test(r) {
            Ok(Some(_)) => {
                return Err(format!(
                    "a CUDA receive on dev{dev} under GPU {g} ({bus}), which it does not serve, \
                     completed; on A3 its data lands in host memory and the plugin fails (rx no cmsg)"
                ));
            }
            Ok(None) => std::thread::yield_now(),
            Err(e) => break e.to_string(),
        }
    };
    if !failure.contains("no cmsg") {
        return Err(format!(
            "the CUDA receive failed, but not with the plugin's words (\"rx no cmsg\"): {failure}"
        ));
    }
    Ok(format!(
        "dev{dev} under GPU {g} ({bus}, not served): host receive byte-exact, CUDA receive failed \
         with \"rx no cmsg\""
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scaled_table_is_a3vm_and_leaves_a_gpu_unserved() {
        let served: Vec<Vec<usize>> = (0..4)
            .map(|d| (0..8).filter(|&g| a3vm_serves(d, g, 8, 4)).collect())
            .collect();
        assert_eq!(served, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(unserved_gpu(0, 8, 4), Some(2));
        assert_eq!(unserved_gpu(2, 8, 4), Some(0));
        assert_eq!(unserved_gpu(0, 1, 4), None);
        assert_eq!(unserved_gpu(1, 2, 2), Some(0));
    }
}

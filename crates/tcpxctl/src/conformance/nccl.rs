//! Conformance cases about the plugin under NCCL rather than under tcpxd (issue #14).
//!
//! `nccl_ring` (per device): the traffic of NCCL's Simple-protocol ring collectives, which
//! send/recv never produces — see [`case_ring_traffic`].
//!
//! `nccl_pat` (global): NCCL 2.24 and later lost the guard that keeps its PAT algorithm away from
//! device-unpack net plugins (`comm->netDeviceType` is never assigned, so `ncclPatEnable`'s
//! `!= NCCL_NET_DEVICE_HOST` test never fires). At one GPU per NCCL node — which includes one host
//! whose GPUs cannot use P2P or SHM — AllGather and ReduceScatter then run PAT, whose primitives
//! never unpack and never advance the unpack head: their results are wrong, and so is every
//! later collective on the same connections (issue #14, `docs/EMULATION.md`, "NCCL and the PAT
//! algorithm"). The case passes when NCCL jobs in this environment cannot pick PAT: the plugin
//! does not use device unpack, `NCCL_PAT_ENABLE=0` is set (by the operator, or by the emulation's
//! init), or `NCCL_ALGO` is a plain list of algorithms without PAT.

use tcpxd::net::Plugin;

/// The `nccl_pat` case (global: the environment after the plugin's `init`).
pub(super) fn check_pat(plugin: &Plugin) -> Result<String, String> {
    if !plugin.devices().iter().any(|d| d.uses_unpack()) {
        return Ok("no device uses device unpack: PAT is safe with this plugin".into());
    }
    let pat = std::env::var("NCCL_PAT_ENABLE").ok();
    let algo = std::env::var("NCCL_ALGO").ok();
    verdict(pat.as_deref(), algo.as_deref())
}

/// `NCCL_ALGO` as a plain list (`Ring`, `Ring,Tree`): no exclusions (`^…`), no per-collective
/// filters (`allgather:…`), PAT not named.
fn algo_excludes_pat(algo: &str) -> bool {
    let a = algo.trim().to_ascii_lowercase();
    !a.is_empty() && !a.contains('^') && !a.contains(':') && !a.split(',').any(|x| x.trim() == "pat")
}

fn verdict(pat: Option<&str>, algo: Option<&str>) -> Result<String, String> {
    if pat.map(str::trim) == Some("0") {
        return Ok("NCCL_PAT_ENABLE=0 after the plugin's init: NCCL will not run PAT over it".into());
    }
    if let Some(a) = algo.filter(|a| algo_excludes_pat(a)) {
        return Ok(format!("NCCL_ALGO={a} leaves PAT out"));
    }
    Err(format!(
        "NCCL_PAT_ENABLE is {} and NCCL_ALGO {}: NCCL 2.24+ runs PAT for AllGather/ReduceScatter at one GPU \
         per node even over a device-unpack plugin (its netDeviceType guard is dead); PAT never unpacks, so \
         those results are wrong and later collectives on the same connections read the wrong fragment \
         lists. Export NCCL_PAT_ENABLE=0 for NCCL jobs on this node (the emulation sets it in its init)",
        pat.map(|v| format!("{v:?}")).unwrap_or_else(|| "unset".into()),
        algo.map(|v| format!("is {v:?}"))
            .unwrap_or_else(|| "is unset".into()),
    ))
}

/// Bytes of one Simple-protocol slice of NCCL's ring collectives (2 steps of 512 KiB with 4 MiB
/// buffers: `proxyOp->nbytes = stepSize*sliceSteps`): every receive is posted this large.
const SLICE: usize = 1 << 20;
/// Receives NCCL keeps posted ahead per connection (`NCCL_STEPS / sliceSteps`), and sends.
const DEPTH: usize = 4;
/// Slices per connection: six laps of the 16-slot unpack ring.
const SLICES: usize = 96;

/// What a two-rank ring sends per slice: tiny and zero-byte slices (small counts; the empty
/// second slice of a chunk), odd sizes, full and half slices.
fn slice_size(i: usize) -> usize {
    const LAP: [usize; 16] = [
        4,
        0,
        0,
        0,
        12,
        0,
        SLICE,
        SLICE / 2,
        999_983,
        0,
        68,
        4096,
        4097,
        SLICE - 1,
        262_148,
        0,
    ];
    LAP[i % LAP.len()]
}

/// One direction of the ring: a connection and where its slices stand.
struct Lane {
    p: super::harness::Pair,
    seed: u64,
    sends_posted: usize,
    sends_done: usize,
    send_ids: std::collections::VecDeque<tcpxd::net::RequestId>,
    recvs_posted: usize,
    pending: std::collections::VecDeque<(tcpxd::net::RequestId, usize)>,
    unconsumed: std::collections::VecDeque<(tcpxd::net::RecvCompletion, usize)>,
    consumed: usize,
    fragments: usize,
}

impl Lane {
    fn expect(&self, i: usize) -> Vec<u8> {
        super::harness::pattern(self.seed << 32 | i as u64, slice_size(i))
    }

    /// One pass of NCCL's proxy over this connection, then its kernel's consumption, which
    /// lags: a completed receive is unpacked and released only once the next one completed too
    /// (or nothing else is pending).
    fn step(&mut self) -> Result<(), String> {
        use super::harness::err;
        while self.recvs_posted < SLICES && self.recvs_posted < self.consumed + DEPTH {
            let i = self.recvs_posted;
            let off = (i % DEPTH) * SLICE;
            self.p.dst.write(off, &vec![0xEE; SLICE])?;
            match self
                .p
                .recv
                .irecv(&self.p.rmh, off, SLICE, 1)
                .map_err(err("irecv"))?
            {
                Some(id) => self.pending.push_back((id, i)),
                None => break,
            }
            self.recvs_posted += 1;
        }
        while self.sends_posted < SLICES && self.sends_posted < self.sends_done + DEPTH {
            let i = self.sends_posted;
            let off = (i % DEPTH) * SLICE;
            self.p.src.write(off, &self.expect(i))?;
            match self
                .p
                .send
                .isend(&self.p.smh, off, slice_size(i), 0)
                .map_err(err("isend"))?
            {
                Some(id) => self.send_ids.push_back(id),
                None => break,
            }
            self.sends_posted += 1;
        }
        if let Some(&id) = self.send_ids.front() {
            if self.p.send.test(id).map_err(err("send test"))? {
                self.send_ids.pop_front();
                self.sends_done += 1;
            }
        }
        if let Some(&(id, i)) = self.pending.front() {
            if let Some(c) = self.p.recv.test(id).map_err(err("recv test"))? {
                self.pending.pop_front();
                self.unconsumed.push_back((c, i));
            }
        }
        if self.unconsumed.len() >= 2 || (self.pending.is_empty() && !self.unconsumed.is_empty()) {
            if let Some((c, i)) = self.unconsumed.pop_front() {
                let landed = super::harness::land_and_check(&self.p, c, (i % DEPTH) * SLICE, &self.expect(i))
                    .map_err(|e| format!("slice {i} ({} bytes): {e}", slice_size(i)))?;
                self.fragments += landed.fragments;
                self.p.recv.consume(c.id).map_err(err("irecvConsumed"))?;
                self.consumed += 1;
            }
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.consumed == SLICES && self.sends_done == SLICES
    }
}

/// The `nccl_ring` case: the traffic of NCCL's Simple-protocol ring collectives between two
/// ranks, which send/recv (and the other cases) never produce: two connections, one per
/// direction, driven from one thread as NCCL's proxy drives them; every receive posted as a
/// 1 MiB slice into the slot of a 4 MiB buffer, up to 4 ahead, while the sender sends what the
/// slice holds (0 bytes to 1 MiB, odd sizes, several chunks); each fragment list read by the
/// consumer's own receive count, after the next receive completed, then released in order.
pub(super) fn case_ring_traffic(ctx: &super::harness::Ctx) -> Result<String, String> {
    let start = std::time::Instant::now();
    let mut lanes = Vec::with_capacity(2);
    for seed in 1..=2u64 {
        lanes.push(Lane {
            p: ctx.pair(DEPTH * SLICE)?,
            seed,
            sends_posted: 0,
            sends_done: 0,
            send_ids: Default::default(),
            recvs_posted: 0,
            pending: Default::default(),
            unconsumed: Default::default(),
            consumed: 0,
            fragments: 0,
        });
    }
    let deadline = start + ctx.opts.case_timeout.mul_f32(0.8);
    while !lanes.iter().all(Lane::finished) {
        if std::time::Instant::now() > deadline {
            let at: Vec<String> = lanes
                .iter()
                .map(|l| format!("{} sent, {} consumed", l.sends_done, l.consumed))
                .collect();
            return Err(format!("ring traffic not done in time ({})", at.join("; ")));
        }
        for l in &mut lanes {
            l.step()?;
        }
        std::thread::yield_now();
    }
    for l in &lanes {
        super::harness::expect_empty(&l.p)?;
    }
    let bytes: usize = (0..SLICES).map(slice_size).sum::<usize>() * lanes.len();
    Ok(format!(
        "{} slices each way ({} MB in all), receives posted as 1 MiB slices {DEPTH} ahead, released one \
         completion late; {} fragments, every byte in place, slots back to zero, {:.1?}",
        SLICES,
        bytes / 1_000_000,
        lanes.iter().map(|l| l.fragments).sum::<usize>(),
        start.elapsed()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pat_verdicts() {
        assert!(verdict(Some("0"), None).is_ok());
        assert!(verdict(None, Some("Ring")).is_ok());
        assert!(verdict(None, Some("ring, tree")).is_ok());
        let e = verdict(None, None).unwrap_err();
        assert!(e.contains("NCCL_PAT_ENABLE is unset"), "{e}");
        assert!(
            verdict(Some("1"), Some("Ring")).is_ok(),
            "a plain list without PAT wins"
        );
        assert!(verdict(Some("1"), None).is_err());
        assert!(verdict(None, Some("Ring,PAT")).is_err());
        assert!(verdict(None, Some("^Tree")).is_err());
        assert!(verdict(None, Some("allreduce:ring")).is_err());
    }
}

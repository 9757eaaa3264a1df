//! The receive comm's socket threads: the ctrl reader, which queues the sender's headers for
//! `test` to match, and one data reader per socket, which takes the chunk tasks `test` hands it and
//! lands their bytes straight in the destination (direct receives) or in shuffled bounce pages,
//! appending each fragment to the unpack ring (bounce receives; in CUDA mode through the pinned
//! mirror, uploaded before any entry is appended).

use super::{Landing, RecvShared};
use crate::abi::{self, NET_UNPACK_MAX_SLICE_PAGES, SLICE_PAGE_SIZE, loadMeta};
use crate::config::Fragments;
use crate::memory::RecvStaging;
use crate::rng::SplitMix64;
use crate::sockio;
use crate::sync::lock;
use crate::wire::{self, HEADER_LEN, Header};
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

/// Fragments per receive call into host bounce pages: 128 pages, one 512 KiB
/// `NCCL_DYNAMIC_CHUNK_SIZE` chunk per `recvmsg` in page mode.
const BATCH: usize = 128;
/// Pages of the blocks one batch may take (a batch's last block may be partly used).
const BATCH_PAGES: usize = BATCH + crate::memory::CUDA_BLOCK_PAGES as usize;

/// The control socket's reader: decodes each header and queues it for `test` to match.
pub(super) fn ctrl_reader(sh: &RecvShared) {
    let fd = sh.ctrl.as_raw_fd();
    loop {
        let mut b = [0u8; HEADER_LEN];
        if let Err(e) = sockio::recv_exact(fd, b.as_mut_ptr(), b.len()) {
            if !sh.health.closing() {
                if !sockio::is_peer_closed(&e) {
                    warn!("tcpxemu: control read failed: {e} ({})", sh.label);
                }
                sh.ctrl_eof.store(true, Ordering::Release);
            }
            return;
        }
        match Header::decode(&b) {
            Ok(h) => lock(&sh.headers).push_back(h),
            Err(why) => {
                sh.health.fail(
                    abi::NCCL_INTERNAL_ERROR,
                    format!(
                        "tcpxemu: protocol error on the control socket: {why} ({})",
                        sh.label
                    ),
                );
                return;
            }
        }
    }
}

/// The real plugin's flow string for a receive socket: `<local><-<peer> rx`.
fn flow_str(s: &TcpStream) -> String {
    let side = |a: io::Result<std::net::SocketAddr>| a.map_or_else(|_| "?".to_string(), |a| a.to_string());
    format!("{}<-{} rx", side(s.local_addr()), side(s.peer_addr()))
}

/// One fragment's shape: (offset inside its page, length).
fn fragment_shape(mode: Fragments, rng: &mut SplitMix64, remaining: u64) -> (u32, u32) {
    let page = SLICE_PAGE_SIZE as u64;
    match mode {
        Fragments::Page => (0, remaining.min(page) as u32),
        Fragments::Odd => {
            let want = if rng.below(16) == 0 {
                rng.range_incl(1, 64)
            } else {
                rng.range_incl(page / 2 + 1, page)
            };
            let len = want.min(remaining);
            let off = rng.below(page - len + 1);
            (off as u32, len as u32)
        }
    }
}

/// One data socket's reader. `staging` (CUDA mode) is the stream that uploads the pinned
/// mirror's blocks to the device pages; the thread binds the comm's context for its whole life.
pub(super) fn data_thread(sh: &RecvShared, me: usize, mut rng: SplitMix64, staging: Option<RecvStaging>) {
    let _bound = match staging.as_ref().map(RecvStaging::bind) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => {
            sh.health.fatal(
                abi::NCCL_UNHANDLED_CUDA_ERROR,
                format!(
                    "tcpxemu: cannot make the CUDA context current on a receive thread: {e} ({})",
                    sh.label
                ),
            );
            return;
        }
    };
    let fd = sh.data[me].as_raw_fd();
    let nsocks = sh.queues.len();
    if sh.populate {
        // Each socket thread faults in its share of the pool, off the accept path; a receive
        // that comes sooner takes whatever page is drawn (populating never writes a byte).
        let started = std::time::Instant::now();
        match sh.pool.populate_part(me, nsocks) {
            Ok(pages) => trace!(
                "tcpxemu: {pages} bounce pages populated in {:?} ({}, socket {me})",
                started.elapsed(),
                sh.label
            ),
            Err(e) => info!(
                "tcpxemu: bounce pages not populated ({e}); they fault on first use ({}, socket {me})",
                sh.label
            ),
        }
    }
    let mut scratch = vec![0u8; 64 * 1024];
    let mut blocks = [0u32; BATCH];
    let mut pages = [0u32; BATCH_PAGES];
    let bp = sh.pool.block_pages().max(1) as usize;
    let mut metas = [loadMeta::default(); BATCH];
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; BATCH];
    let stop = || sh.health.stop();
    while let Some(t) = sh.queues[me].pop(&sh.health) {
        let slot = &sh.slots[t.q];
        let total = wire::nchunks(t.size, t.chunk);
        let mut k = wire::first_chunk_for(t.start, me, nsocks);
        while k < total {
            let off = k * u64::from(t.chunk);
            let len = (u64::from(t.size) - off).min(u64::from(t.chunk));
            match t.landing {
                Landing::Direct => {
                    let land = len.min(u64::from(t.posted).saturating_sub(off));
                    if land > 0 {
                        // SAFETY: off + land ≤ posted, inside the destination irecv checked
                        // against its memory handle.
                        let p = unsafe { t.dst.0.add(off as usize) };
                        if let Err(e) = sockio::recv_exact(fd, p, land as usize) {
                            sh.socket_error(&e);
                            return;
                        }
                    }
                    let mut rest = (len - land) as usize;
                    while rest > 0 {
                        let n = rest.min(scratch.len());
                        if let Err(e) = sockio::recv_exact(fd, scratch.as_mut_ptr(), n) {
                            sh.socket_error(&e);
                            return;
                        }
                        rest -= n;
                    }
                    slot.bytes.fetch_add(len, Ordering::Release);
                }
                Landing::Bounce if sh.misbound.is_some() && len > 0 => {
                    // The real plugin's recvmsg finds the bytes in host memory with no devmem
                    // control message: "fatal, <flow> no cmsg" and exit(1) (src/sock/tcpx.h).
                    let flow = flow_str(&sh.data[me]);
                    sh.health.fatal(
                        abi::NCCL_SYSTEM_ERROR,
                        format!(
                            "tcpxemu: fatal, {flow} no cmsg (a CUDA receive on a comm whose {}; {})",
                            sh.misbound.as_deref().unwrap_or_default(),
                            sh.label
                        ),
                    );
                    return;
                }
                Landing::Bounce => {
                    let mut pos = off;
                    let end = off + len;
                    while pos < end {
                        let remaining = end - pos;
                        let per = match sh.fragments {
                            Fragments::Page => SLICE_PAGE_SIZE as u64,
                            Fragments::Odd => (SLICE_PAGE_SIZE / 2) as u64,
                        };
                        let want = (remaining.div_ceil(per) as usize).clamp(1, BATCH);
                        let got = sh.pool.take(&mut blocks[..want.div_ceil(bp)], &stop);
                        if got == 0 {
                            return;
                        }
                        // The pages of the blocks taken; with several pages per block (CUDA
                        // mode) they are shuffled, so fragment lists stay unordered.
                        let mut npages = 0;
                        for &b in &blocks[..got] {
                            for pg in sh.pool.block_range(b) {
                                if npages < BATCH_PAGES {
                                    pages[npages] = pg;
                                    npages += 1;
                                }
                            }
                        }
                        if bp > 1 {
                            for i in (1..npages).rev() {
                                let j = rng.below(i as u64 + 1) as usize;
                                pages.swap(i, j);
                            }
                        }
                        let mut used = 0;
                        let mut bytes = 0u64;
                        while used < npages.min(BATCH) && pos < end {
                            let (in_page, flen) = fragment_shape(sh.fragments, &mut rng, end - pos);
                            let page = pages[used];
                            // Host pool: straight into the page. Device pool: into the page's
                            // pinned mirror, uploaded below.
                            let land = sh.pool.host_page(page).map(|p| {
                                // SAFETY: in_page + flen ≤ 4096, inside page `page` (or its mirror).
                                unsafe { p.add(in_page as usize) }
                            });
                            let Some(base) = land else {
                                sh.pool.give_back(blocks[..got].iter().copied());
                                sh.health.fail(
                                    abi::NCCL_INTERNAL_ERROR,
                                    format!(
                                        "tcpxemu: internal error: no landing place for a fragment ({})",
                                        sh.label
                                    ),
                                );
                                return;
                            };
                            iov[used] = libc::iovec {
                                iov_base: base.cast(),
                                iov_len: flen as usize,
                            };
                            metas[used] = loadMeta {
                                src_off: page * SLICE_PAGE_SIZE as u32 + in_page,
                                len: flen,
                                dst_off: pos,
                            };
                            pos += u64::from(flen);
                            bytes += u64::from(flen);
                            used += 1;
                        }
                        // Keep the blocks holding a used page (first, in order); return the rest.
                        let kept = if bp == 1 {
                            // One page per block: blocks[i] is pages[i], the first `used` are used.
                            used
                        } else {
                            let mut keep = [false; BATCH];
                            for &pg in &pages[..used] {
                                let b = pg / bp as u32;
                                if let Some(i) = blocks[..got].iter().position(|&x| x == b) {
                                    keep[i] = true;
                                }
                            }
                            let mut kept = 0;
                            for (i, k) in keep.iter().enumerate().take(got) {
                                if *k {
                                    blocks.swap(kept, i);
                                    kept += 1;
                                }
                            }
                            kept
                        };
                        if kept < got {
                            sh.pool.give_back(blocks[kept..got].iter().copied());
                        }
                        if let Err(e) = sockio::readv_all(fd, &mut iov[..used]) {
                            sh.pool.give_back(blocks[..kept].iter().copied());
                            sh.socket_error(&e);
                            return;
                        }
                        // Every byte reaches the device before any entry is appended.
                        if let Some(s) = &staging {
                            blocks[..kept].sort_unstable();
                            if let Err(e) = s.upload(&sh.pool, &blocks[..kept]) {
                                sh.pool.give_back(blocks[..kept].iter().copied());
                                sh.health.fatal(
                                    abi::NCCL_UNHANDLED_CUDA_ERROR,
                                    format!(
                                        "tcpxemu: copying received bytes to the device bounce buffer failed: \
                                         {e} ({})",
                                        sh.label
                                    ),
                                );
                                return;
                            }
                        }
                        // One atomic step each reserves consecutive block and entry indices.
                        let first_block = slot.nblocks.fetch_add(kept as u32, Ordering::AcqRel) as usize;
                        for (i, &b) in blocks[..kept].iter().enumerate() {
                            match slot.blocks.get(first_block + i) {
                                Some(cell) => cell.store(b, Ordering::Relaxed),
                                None => sh.pool.give_back(std::iter::once(b)),
                            }
                        }
                        let first = slot.frags.fetch_add(used as u32, Ordering::AcqRel) as usize;
                        for (i, meta) in metas[..used].iter().enumerate() {
                            let idx = first + i;
                            if idx >= NET_UNPACK_MAX_SLICE_PAGES {
                                sh.health.fatal(
                                    abi::NCCL_INTERNAL_ERROR,
                                    format!(
                                        "tcpxemu: request too many pages: a {}-byte receive needs more \
                                         than {} fragments (the real plugin exits the process here: TCPXEMU_FAILSTOP=exit; {})",
                                        t.size, NET_UNPACK_MAX_SLICE_PAGES, sh.label
                                    ),
                                );
                                return;
                            }
                            sh.ring.write_entry(t.q, idx, *meta);
                        }
                        slot.bytes.fetch_add(bytes, Ordering::Release);
                    }
                }
            }
            k += nsocks as u64;
        }
    }
}

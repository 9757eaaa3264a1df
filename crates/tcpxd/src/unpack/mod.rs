//! Unpacking: copying each completed receive's fragments from the plugin's GPU bounce buffer to
//! the destination, as one batch of GPU work per poller pass, and telling without blocking when
//! a batch has finished (only then may the poller call `irecvConsumed`).
//!
//! The poller's use, per pass:
//! 1. [`Unpacker::push`] every receive that completed (in ring order),
//! 2. [`Unpacker::submit`] once: the batch is launched asynchronously and a [`Ticket`] returned,
//! 3. on later passes [`Unpacker::is_done`] with the oldest ticket; once done, consume that
//!    batch's receives in ring order.
//!
//! Every implementation runs on one stream of its own, so batches finish in submission order: a
//! ticket that is done means every earlier ticket is done too.
//!
//! Three implementations, picked by `UCCL_TCPX_UNPACK_IMPL` ([`UnpackImpl`]):
//! [`KernelUnpacker`] (`kernel`, the default: one kernel launch per batch;
//! `kernel-mapped` (the default: the ring read in place), `kernel-packed-mapped`,
//! `kernel-packed-device`, `kernel-params` and `kernel-device` pick where and how it reads the
//! fragment lists, see [`FragSource`]; `kernel-persistent` keeps a grid resident),
//! [`D2dUnpacker`] (`d2d`: one device-to-device copy per fragment) and [`HostUnpacker`] (`host`:
//! through pinned host memory; a debug fallback). Measurements: docs/GPU.md.

pub mod block_batch;
pub(crate) mod completions;
mod d2d;
mod host;
mod kernel;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

pub use d2d::D2dUnpacker;
pub use host::HostUnpacker;
pub use kernel::{FragSource, KernelUnpacker};

pub use crate::gpu::FragmentList;
use crate::gpu::{DeviceSpan, Event, Gpu, GpuError, GpuResult, Stream};
use crate::net::abi::{NET_UNPACK_MAX_SLICE_PAGES, loadMeta};

/// The environment variable that picks the implementation.
pub const UNPACK_IMPL_ENV: &str = "UCCL_TCPX_UNPACK_IMPL";

/// Errors of the unpack stage.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// A fragment would read or write out of bounds; nothing of the job was queued.
    #[error("fragment {index} of {count} (src_off {src_off}, len {len}, dst_off {dst_off}) {reason}")]
    Fragment {
        index: usize,
        count: usize,
        src_off: u32,
        len: u32,
        dst_off: u64,
        reason: String,
    },
    /// More fragments than one TCPX request can carry.
    #[error("{count} fragments in one receive (at most {NET_UNPACK_MAX_SLICE_PAGES})")]
    TooManyFragments { count: usize },
    /// The fragments of an exact job do not add up to its destination's size.
    #[error(
        "the fragments add up to {landed} bytes, the receive was posted for {expected} (the sender sent a different size)"
    )]
    Short { landed: u64, expected: u64 },
    /// The kernel's own bounds guard skipped a fragment: a list read in place, which the host
    /// did not check before the launch (or a host check that missed it).
    #[error("the unpack kernel skipped out-of-bounds fragment {fragment} of task {task} in this batch")]
    DeviceRejected { task: u32, fragment: u32 },
    /// The lengths the kernel read of an exact receive's list (read in place, not on the host)
    /// do not add up to its size; `task` counts the batch's receives in push order.
    #[error(
        "the fragments of receive {task} of this batch add up to {landed} bytes, the receive was posted for {expected} (the sender sent a different size)"
    )]
    DeviceShort { task: u32, landed: u64, expected: u64 },
    /// The unpack stream went idle without the persistent grid's completion signal for a batch.
    #[error(
        "the unpack stream finished without the persistent grid signalling batch {batch} (last signalled: {signalled})"
    )]
    NoSignal { batch: u64, signalled: u64 },
    /// A ticket this unpacker never issued.
    #[error("unknown unpack ticket {0:?}")]
    UnknownTicket(Ticket),
    /// An unknown `UCCL_TCPX_UNPACK_IMPL` value.
    #[error(
        "unknown unpack implementation {0:?} (kernel, kernel-persistent, kernel-packed-mapped, kernel-packed-device, kernel-params, kernel-device, kernel-mapped, d2d or host)"
    )]
    UnknownImpl(String),
    /// A bad value of one of the unpack stage's environment settings.
    #[error("{name}={value:?}: {why}")]
    BadSetting {
        name: &'static str,
        value: String,
        why: String,
    },
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// The persistent grid's linger in microseconds (`kernel-persistent` only).
pub const PERSIST_LINGER_ENV: &str = "TCPXD_UNPACK_LINGER_US";
/// The persistent grid's worker blocks (`kernel-persistent` only; 0: one per multiprocessor).
pub const PERSIST_BLOCKS_ENV: &str = "TCPXD_UNPACK_BLOCKS";

impl UnpackError {
    /// Whether the error belongs to the batch's data (a fragment list that was out of bounds or
    /// did not add up) rather than to the unpack stage: the batch's other receives were unpacked,
    /// and later batches are unaffected.
    pub fn is_data(&self) -> bool {
        matches!(
            self,
            UnpackError::Fragment { .. }
                | UnpackError::TooManyFragments { .. }
                | UnpackError::Short { .. }
                | UnpackError::DeviceRejected { .. }
                | UnpackError::DeviceShort { .. }
        )
    }
}

/// One completed receive to unpack: fragments from `bounce` to `dst` (`dst_off` relative to
/// `dst`'s byte 0, refused past `dst.len()`).
#[derive(Debug, Clone, Copy)]
pub struct UnpackJob<'a> {
    pub frags: FragmentList<'a>,
    pub bounce: DeviceSpan,
    pub dst: DeviceSpan,
    /// The fragments must fill `dst` exactly: their lengths add up to `dst.len()` (a receive of
    /// a known size, as the poller's are; [`UnpackError::Short`] otherwise). Off, the fragments
    /// may leave parts of `dst` unwritten.
    pub exact: bool,
}

/// A submitted batch. Tickets of one unpacker complete in the order they were issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket {
    unpacker: u32,
    seq: u64,
}

impl Ticket {
    /// The batch's sequence number (1, 2, ... per unpacker).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// The unpack stage, behind which the three implementations sit.
pub trait Unpacker: Send {
    fn name(&self) -> &'static str;
    /// Queues one completed receive for this pass. Validates every fragment against `dst.len()`
    /// and `bounce.len()` first, and an exact job's total (the error names the fragment;
    /// nothing of a refused job is queued). The exception is a list the kernel unpacker reads
    /// in place (`kernel-mapped`, a list with a device view): nothing of it is read on the host,
    /// the kernel skips any fragment out of bounds and adds the lengths up, and `is_done` fails
    /// the batch ([`UnpackError::DeviceRejected`], [`UnpackError::DeviceShort`]; the batch's
    /// other receives are unpacked whole). Who wants the receive named runs [`validate`] on the
    /// batch's lists then (before consuming them).
    fn push(&mut self, job: &UnpackJob<'_>) -> Result<(), UnpackError>;
    /// Launches everything queued since the last submit as one batch (asynchronously) and
    /// returns its ticket; `None` when nothing needed GPU work (empty receives only), in which
    /// case what was pushed is already complete.
    fn submit(&mut self) -> Result<Option<Ticket>, UnpackError>;
    /// Non-blocking: has that batch (and so every earlier one) finished on the GPU?
    fn is_done(&mut self, t: &Ticket) -> Result<bool, UnpackError>;
    /// Blocks until that batch has finished (tests, shutdown).
    fn wait(&mut self, t: &Ticket) -> Result<(), UnpackError>;
    /// The stream the batches run on (to order other work after them, or time them).
    fn stream(&self) -> &Stream;
}

/// Which unpacker to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnpackImpl {
    Kernel(FragSource),
    /// The kernel on a grid that stays resident while batches come (`kernel-persistent`).
    Persistent(crate::gpu::PersistConfig),
    D2d,
    Host,
}

impl Default for UnpackImpl {
    fn default() -> Self {
        UnpackImpl::Kernel(FragSource::default())
    }
}

impl std::str::FromStr for UnpackImpl {
    type Err = UnpackError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "kernel" => Ok(UnpackImpl::Kernel(FragSource::default())),
            "kernel-mapped" => Ok(UnpackImpl::Kernel(FragSource::Mapped)),
            "kernel-device" => Ok(UnpackImpl::Kernel(FragSource::DeviceCopy)),
            "kernel-params" => Ok(UnpackImpl::Kernel(FragSource::Params)),
            "kernel-packed-mapped" => Ok(UnpackImpl::Kernel(FragSource::PackedMapped)),
            "kernel-packed-device" => Ok(UnpackImpl::Kernel(FragSource::PackedDevice)),
            "kernel-persistent" => Ok(UnpackImpl::Persistent(crate::gpu::PersistConfig::default())),
            "d2d" => Ok(UnpackImpl::D2d),
            "host" => Ok(UnpackImpl::Host),
            _ => Err(UnpackError::UnknownImpl(s.to_string())),
        }
    }
}

impl UnpackImpl {
    /// From `UCCL_TCPX_UNPACK_IMPL` (the kernel when unset), and for `kernel-persistent`
    /// `TCPXD_UNPACK_LINGER_US` and `TCPXD_UNPACK_BLOCKS`.
    pub fn from_env() -> Result<UnpackImpl, UnpackError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`UnpackImpl::from_env`], reading settings through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<UnpackImpl, UnpackError> {
        let imp = match get(UNPACK_IMPL_ENV) {
            Some(v) => v.parse()?,
            None => UnpackImpl::default(),
        };
        let UnpackImpl::Persistent(mut config) = imp else {
            return Ok(imp);
        };
        let number = |name: &'static str, max: u64| -> Result<Option<u64>, UnpackError> {
            let Some(v) = get(name) else { return Ok(None) };
            match v.trim().parse::<u64>() {
                Ok(n) if n <= max => Ok(Some(n)),
                _ => Err(UnpackError::BadSetting {
                    name,
                    value: v,
                    why: format!("a whole number from 0 to {max}"),
                }),
            }
        };
        if let Some(us) = number(PERSIST_LINGER_ENV, 10_000_000)? {
            config.linger = std::time::Duration::from_micros(us);
        }
        if let Some(b) = number(PERSIST_BLOCKS_ENV, 65_534)? {
            config.blocks = b as u32;
        }
        Ok(UnpackImpl::Persistent(config))
    }

    /// Builds the unpacker (its stream, events and staging are all allocated here, once).
    pub fn build(self, gpu: &Arc<Gpu>) -> Result<Box<dyn Unpacker>, UnpackError> {
        let u: Box<dyn Unpacker> = match self {
            UnpackImpl::Kernel(src) => Box::new(KernelUnpacker::new(gpu, src)?),
            UnpackImpl::Persistent(config) => Box::new(KernelUnpacker::persistent(gpu, config)?),
            UnpackImpl::D2d => Box::new(D2dUnpacker::new(gpu)?),
            UnpackImpl::Host => Box::new(HostUnpacker::new(gpu)?),
        };
        tracing::info!(unpacker = u.name(), gpu = gpu.ordinal(), "unpack stage ready");
        Ok(u)
    }
}

/// Checks a job: at most 2048 fragments, each inside `bounce` and `dst`, and for an exact job
/// adding up to `dst.len()`. Returns the bytes.
pub fn validate(job: &UnpackJob<'_>) -> Result<u64, UnpackError> {
    validate_list(job.frags.as_slice(), job.bounce.len(), job.dst.len(), job.exact)
}

/// [`validate`] for a list alone: fragments read from a `bounce_len`-byte bounce buffer into a
/// `dst_len`-byte destination (`exact`: filling it).
pub fn validate_list(
    frags: &[loadMeta],
    bounce_len: u64,
    dst_len: u64,
    exact: bool,
) -> Result<u64, UnpackError> {
    if frags.len() > NET_UNPACK_MAX_SLICE_PAGES {
        return Err(UnpackError::TooManyFragments { count: frags.len() });
    }
    // Fast path: one branch-free pass over the list (the poller validates every receive); the
    // slow pass below runs only to name the offending fragment.
    let (dst_end, src_end, total) = frags.iter().fold((0u64, 0u64, 0u64), |(d, s, t), f| {
        let len = u64::from(f.len);
        (
            d.max(f.dst_off.saturating_add(len)),
            s.max(u64::from(f.src_off) + len),
            t + len,
        )
    });
    if dst_end <= dst_len && src_end <= bounce_len {
        return exact_sum(total, dst_len, exact);
    }
    let mut total = 0u64;
    for (index, f) in frags.iter().enumerate() {
        let len = u64::from(f.len);
        let bad = |reason: String| UnpackError::Fragment {
            index,
            count: frags.len(),
            src_off: f.src_off,
            len: f.len,
            dst_off: f.dst_off,
            reason,
        };
        if f.dst_off.checked_add(len).is_none_or(|e| e > dst_len) {
            return Err(bad(format!(
                "lands outside the {}-byte destination (the sender sent more than was posted)",
                dst_len
            )));
        }
        if u64::from(f.src_off) + len > bounce_len {
            return Err(bad(format!(
                "reads outside the {}-byte bounce buffer",
                bounce_len
            )));
        }
        total += len;
    }
    exact_sum(total, dst_len, exact)
}

/// `total`, unless the job is exact and `total` is not its destination's size.
pub(crate) fn exact_total(job: &UnpackJob<'_>, total: u64) -> Result<u64, UnpackError> {
    exact_sum(total, job.dst.len(), job.exact)
}

fn exact_sum(total: u64, dst_len: u64, exact: bool) -> Result<u64, UnpackError> {
    if exact && total != dst_len {
        return Err(UnpackError::Short {
            landed: total,
            expected: dst_len,
        });
    }
    Ok(total)
}

static NEXT_UNPACKER_ID: AtomicU32 = AtomicU32::new(1);

/// The batches one unpacker has issued: which batch each of its slots holds, the next batch's
/// number, and how far batches are known to be done. Batches run on one stream, so they complete
/// in issue order, and a slot is reused only once the batch holding it is done. How completion
/// is observed (an event per slot, or the kernel's done word) is the owner's business.
pub(crate) struct TicketBook {
    id: u32,
    seqs: Vec<u64>,
    next: u64,
    done_upto: u64,
    stalls: u64,
}

impl TicketBook {
    pub(crate) fn new(slots: usize) -> TicketBook {
        TicketBook {
            id: NEXT_UNPACKER_ID.fetch_add(1, Ordering::Relaxed),
            seqs: vec![0; slots],
            next: 1,
            done_upto: 0,
            stalls: 0,
        }
    }

    /// The number the next batch will get.
    pub(crate) fn next_seq(&self) -> u64 {
        self.next
    }

    /// The newest batch issued (0: none).
    pub(crate) fn last_seq(&self) -> u64 {
        self.next - 1
    }

    /// The slot the next batch will use, and the batch holding it now (0: none).
    pub(crate) fn next_slot(&self) -> (usize, u64) {
        let slot = (self.next % self.seqs.len() as u64) as usize;
        (slot, self.seqs[slot])
    }

    /// The next batch has been issued into its slot.
    pub(crate) fn issue(&mut self) -> Ticket {
        let (slot, _) = self.next_slot();
        self.seqs[slot] = self.next;
        let t = Ticket {
            unpacker: self.id,
            seq: self.next,
        };
        self.next += 1;
        t
    }

    pub(crate) fn known(&self, t: &Ticket) -> Result<(), UnpackError> {
        if t.unpacker != self.id || t.seq == 0 || t.seq >= self.next {
            return Err(UnpackError::UnknownTicket(*t));
        }
        Ok(())
    }

    /// The slot a ticket's batch used, if it still holds it.
    pub(crate) fn slot_of(&self, t: &Ticket) -> Option<usize> {
        let slot = (t.seq % self.seqs.len() as u64) as usize;
        (self.seqs[slot] == t.seq).then_some(slot)
    }

    /// Whether batch `seq` is known to be done.
    pub(crate) fn is_known_done(&self, seq: u64) -> bool {
        seq <= self.done_upto
    }

    /// Batch `seq` (and so every earlier one) is done; clamped to what was issued.
    pub(crate) fn mark_done(&mut self, seq: u64) {
        self.done_upto = self.done_upto.max(seq.min(self.last_seq()));
    }

    pub(crate) fn done_upto(&self) -> u64 {
        self.done_upto
    }

    /// Counts a wait for a free slot.
    pub(crate) fn stalled(&mut self) {
        self.stalls += 1;
        tracing::debug!(
            stalls = self.stalls,
            "unpack: every batch slot is in flight; waiting"
        );
    }

    pub(crate) fn stalls(&self) -> u64 {
        self.stalls
    }
}

/// A ring of completion events, one per batch in flight (the d2d and host unpackers).
pub(crate) struct BatchEvents {
    book: TicketBook,
    events: Vec<Event>,
}

impl BatchEvents {
    pub(crate) fn new(gpu: &Arc<Gpu>, slots: usize) -> GpuResult<BatchEvents> {
        let events = (0..slots)
            .map(|_| Event::new(gpu))
            .collect::<GpuResult<Vec<_>>>()?;
        Ok(BatchEvents {
            book: TicketBook::new(events.len()),
            events,
        })
    }

    /// The slot the next batch will use, once its previous batch is done (waits if not:
    /// back-pressure when more batches are in flight than there are slots).
    pub(crate) fn reserve(&mut self) -> GpuResult<usize> {
        let (slot, prev) = self.book.next_slot();
        if !self.book.is_known_done(prev) {
            if !self.events[slot].is_done()? {
                self.book.stalled();
                self.events[slot].synchronize()?;
            }
            self.book.mark_done(prev);
        }
        Ok(slot)
    }

    /// Records the next batch's event after the work queued on `stream`.
    pub(crate) fn record(&mut self, stream: &Stream) -> GpuResult<Ticket> {
        let (slot, _) = self.book.next_slot();
        stream.record(&self.events[slot])?;
        Ok(self.book.issue())
    }

    pub(crate) fn is_done(&mut self, t: &Ticket) -> Result<bool, UnpackError> {
        self.book.known(t)?;
        if self.book.is_known_done(t.seq) {
            return Ok(true);
        }
        match self.book.slot_of(t) {
            // Overwritten: a slot is reused only after its batch completed.
            None => Ok(true),
            Some(slot) => {
                let done = self.events[slot].is_done()?;
                if done {
                    self.book.mark_done(t.seq);
                }
                Ok(done)
            }
        }
    }

    pub(crate) fn wait(&mut self, t: &Ticket) -> Result<(), UnpackError> {
        self.book.known(t)?;
        if self.book.is_known_done(t.seq) {
            return Ok(());
        }
        if let Some(slot) = self.book.slot_of(t) {
            self.events[slot].synchronize()?;
        }
        self.book.mark_done(t.seq);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::abi::loadMeta;

    fn span(len: u64) -> DeviceSpan {
        DeviceSpan::for_validation_tests(0x1000_0000, len)
    }

    fn lm(src_off: u32, len: u32, dst_off: u64) -> loadMeta {
        loadMeta {
            src_off,
            len,
            dst_off,
        }
    }

    #[test]
    fn validation_names_the_fragment() {
        let frags = [lm(0, 4096, 0), lm(4096, 4096, 4096), lm(8192, 10, 8190)];
        let job = UnpackJob {
            frags: FragmentList::host(&frags[..2]),
            bounce: span(1 << 20),
            dst: span(8192),
            exact: false,
        };
        assert_eq!(validate(&job).unwrap(), 8192);
        let job = UnpackJob {
            frags: FragmentList::host(&frags),
            ..job
        };
        let e = validate(&job).unwrap_err().to_string();
        assert!(e.contains("fragment 2 of 3"), "{e}");
        assert!(e.contains("8192-byte destination"), "{e}");
        let wrap = [lm(0, 16, u64::MAX - 4)];
        let job = UnpackJob {
            frags: FragmentList::host(&wrap),
            ..job
        };
        assert!(validate(&job).is_err());
        let src = [lm(u32::MAX, 16, 0)];
        let job = UnpackJob {
            frags: FragmentList::host(&src),
            ..job
        };
        assert!(validate(&job).unwrap_err().to_string().contains("bounce"));
        let many = vec![lm(0, 1, 0); NET_UNPACK_MAX_SLICE_PAGES + 1];
        let job = UnpackJob {
            frags: FragmentList::host(&many),
            ..job
        };
        assert!(matches!(
            validate(&job),
            Err(UnpackError::TooManyFragments { .. })
        ));
    }

    #[test]
    fn exact_jobs_must_add_up_to_the_destination() {
        let frags = [lm(0, 4096, 4096), lm(8192, 4000, 0)];
        let job = UnpackJob {
            frags: FragmentList::host(&frags),
            bounce: span(1 << 20),
            dst: span(8192),
            exact: false,
        };
        // Not exact: a gap is allowed.
        assert_eq!(validate(&job).unwrap(), 8096);
        let exact = UnpackJob { exact: true, ..job };
        let e = validate(&exact).unwrap_err();
        assert!(
            matches!(
                e,
                UnpackError::Short {
                    landed: 8096,
                    expected: 8192
                }
            ),
            "{e:?}"
        );
        assert!(e.is_data());
        assert!(
            e.to_string().contains("8096 bytes") && e.to_string().contains("8192"),
            "{e}"
        );
        let full = [lm(0, 4096, 4096), lm(8192, 4096, 0)];
        let exact = UnpackJob {
            frags: FragmentList::host(&full),
            ..exact
        };
        assert_eq!(validate(&exact).unwrap(), 8192);
        // Out of bounds is named first, even when the total is also wrong.
        let past = [lm(0, 4096, 8000)];
        let exact = UnpackJob {
            frags: FragmentList::host(&past),
            ..exact
        };
        assert!(matches!(
            validate(&exact),
            Err(UnpackError::Fragment { index: 0, .. })
        ));
        assert!(
            !UnpackError::NoSignal {
                batch: 1,
                signalled: 0
            }
            .is_data()
        );
    }

    #[test]
    fn persistent_settings_come_from_the_environment() {
        use std::collections::HashMap;
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |k: &str| m.get(k).cloned()
        };
        assert_eq!(UnpackImpl::from_lookup(env(&[])).unwrap(), UnpackImpl::default());
        // The grid settings are ignored by the launch modes.
        assert_eq!(
            UnpackImpl::from_lookup(env(&[(PERSIST_LINGER_ENV, "junk")])).unwrap(),
            UnpackImpl::default()
        );
        let got = UnpackImpl::from_lookup(env(&[
            (UNPACK_IMPL_ENV, "kernel-persistent"),
            (PERSIST_LINGER_ENV, "1000"),
            (PERSIST_BLOCKS_ENV, "16"),
        ]))
        .unwrap();
        assert_eq!(
            got,
            UnpackImpl::Persistent(crate::gpu::PersistConfig {
                blocks: 16,
                linger: std::time::Duration::from_millis(1),
            })
        );
        let e = UnpackImpl::from_lookup(env(&[
            (UNPACK_IMPL_ENV, "kernel-persistent"),
            (PERSIST_BLOCKS_ENV, "-1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("TCPXD_UNPACK_BLOCKS") && e.contains("0 to 65534"),
            "{e}"
        );
    }

    #[test]
    fn impl_names_parse() {
        assert_eq!("kernel".parse::<UnpackImpl>().unwrap(), UnpackImpl::default());
        assert_eq!("D2D".parse::<UnpackImpl>().unwrap(), UnpackImpl::D2d);
        assert_eq!("host".parse::<UnpackImpl>().unwrap(), UnpackImpl::Host);
        assert_eq!(
            "kernel-device".parse::<UnpackImpl>().unwrap(),
            UnpackImpl::Kernel(FragSource::DeviceCopy)
        );
        assert!("gpu".parse::<UnpackImpl>().is_err());
    }
}

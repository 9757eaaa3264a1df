//! A plain batch of one buffer pair, packed (the API's `BatchRanges`, issue 38 point 4): entry k
//! moves range k of the peer's buffer to or from `local_offsets[k]` of one local buffer.
//!
//! It is started without an engine entry per range: the local offsets and the remote ranges stay
//! the packed little-endian arrays the client sent, are checked in one pass each
//! (`check_packed`), planned as one coalesced stream like a block list's runs, and go on the
//! wire as they are (`Ranges::Packed`, `ReadPairs::Packed`). The transfer reports one status
//! for all its entries (`Engine::report_one_status`). Field names in errors are the API's
//! (`ranges.local_offsets[k]`, …).

use super::coalesce::Places;
use super::*;

/// A packed plain batch of one buffer pair (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    pub local_buffer: u64,
    /// A little-endian `u64` per entry, as many as `remote`'s ranges.
    pub local_offsets: Vec<u8>,
    pub peer: PeerIdx,
    /// The peer's buffer and key, each entry's offset there and the lengths (both sides').
    pub remote: PackedRanges,
}

impl PackedBatch {
    /// Entries.
    pub fn len(&self) -> usize {
        self.local_offsets.len() / 8
    }

    /// No entries (refused when started).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn local_offset(&self, k: usize) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&self.local_offsets[k * 8..k * 8 + 8]);
        u64::from_le_bytes(a)
    }

    /// (local offset, length) of every entry, in order.
    fn local_spans(&self) -> impl ExactSizeIterator<Item = (u64, u64)> + Clone + '_ {
        (0..self.len()).map(|k| (self.local_offset(k), self.remote.length(k)))
    }

    /// The local side as ranges of the local buffer under `key` (a READ's destinations, as the
    /// holder's offer must carry them back): the offsets moved, the lengths shared.
    fn local_ranges(&mut self, key: [u8; 16]) -> PackedRanges {
        PackedRanges {
            buffer_id: self.local_buffer,
            access_key: key,
            offsets: std::mem::take(&mut self.local_offsets),
            lengths: self.remote.lengths.clone(),
        }
    }
}

impl Engine {
    /// Checks a packed batch against the local buffer, the limits and the peer; returns the
    /// total bytes. One pass over the arrays; field names formatted only for an error.
    fn check_packed(&self, b: &PackedBatch, notification: usize) -> EngineResult<u64> {
        if b.local_offsets.len() % 8 != 0 {
            return Err(EngineError::invalid(format!(
                "ranges.local_offsets: {} bytes is not a whole number of 8-byte little-endian values",
                b.local_offsets.len()
            )));
        }
        let (n, limit) = (b.len(), self.cfg.max_entries);
        if n == 0 {
            return Err(EngineError::invalid(
                "ranges.local_offsets: at least one entry is required",
            ));
        }
        if n > limit {
            return Err(EngineError::invalid(format!(
                "ranges.local_offsets: {n} entries exceed the limit of {limit}"
            )));
        }
        self.check_common(n, notification)?;
        if b.remote.len() != b.len() {
            return Err(EngineError::invalid(format!(
                "ranges.remote_offsets: {} offsets, but local_offsets has {}",
                b.remote.len(),
                b.len()
            )));
        }
        let size = self
            .buffers
            .get(&b.local_buffer)
            .ok_or_else(|| {
                EngineError::not_found(format!(
                    "ranges.local_buffer_id: buffer {} does not exist",
                    b.local_buffer
                ))
            })?
            .size;
        let length_field = |k: usize| match b.remote.lengths {
            RangeLengths::Uniform(_) => "ranges.uniform_length".to_string(),
            RangeLengths::Each(_) => format!("ranges.lengths[{k}]"),
        };
        let mut total = 0u64;
        for (k, ((lo, len), ro)) in b
            .local_spans()
            .zip((0..b.len()).map(|k| b.remote.offset(k)))
            .enumerate()
        {
            if len == 0 {
                return Err(EngineError::invalid(format!(
                    "{}: must be at least 1 byte",
                    length_field(k)
                )));
            }
            if range_end(lo, len).is_none_or(|end| end > size) {
                check_bounds(
                    &format!("ranges.local_offsets[{k}]"),
                    &length_field(k),
                    &format!("buffer {}", b.local_buffer),
                    size,
                    lo,
                    len,
                )?;
            }
            if range_end(ro, len).is_none() {
                return Err(EngineError::invalid(format!(
                    "ranges.remote_offsets[{k}]: {ro} + length {len} overflows 64 bits"
                )));
            }
            total = total.checked_add(len).ok_or_else(|| {
                EngineError::invalid(format!(
                    "{}: the batch's total overflows 64 bits",
                    length_field(k)
                ))
            })?;
        }
        self.live_peer("ranges.remote_descriptor", b.peer)?;
        Ok(total)
    }

    /// A packed batch's transfer: one status for all its entries, no entry statuses kept.
    fn new_packed_transfer(&mut self, kind: TransferKind, total: u64, deadline: Instant) -> TransferId {
        let id = self.new_transfer(kind, total, 0, deadline);
        self.report_one_status(id);
        id
    }

    /// Starts a WRITE of a packed batch: checked first (on error nothing changed), then one
    /// offer (or eager header) whose ranges are the batch's remote arrays as they came.
    pub fn start_write_packed(
        &mut self,
        b: PackedBatch,
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        let total = self.check_packed(&b, notification.len())?;
        let id = self.new_packed_transfer(TransferKind::Write, total, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        let offer_id = self.next_offer;
        self.next_offer += 1;
        let src = self.packed_sources(b.local_buffer, b.local_spans(), &b.remote);
        let peer = b.peer;
        self.make_offer(
            peer,
            offer_id,
            0,
            Some(id),
            Vec::new(),
            src,
            Ranges::Packed(b.remote),
            None,
            notification,
            deadline_ms,
            false,
        );
        self.add_part(id, offer_id, peer);
        self.announce(id, total);
        Ok(id)
    }

    /// Starts a READ of a packed batch: checked first (on error nothing changed), then one read
    /// request of two packed arrays (the sources as they came, the destinations from the local
    /// offsets under the local buffer's key).
    pub fn start_read_packed(
        &mut self,
        mut b: PackedBatch,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        let total = self.check_packed(&b, 0)?;
        let key = self.buffers[&b.local_buffer].key;
        let host_dests = self.memory_of(b.local_buffer) == crate::topology::Memory::Host;
        let id = self.new_packed_transfer(TransferKind::Read, total, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        let read_id = self.next_read;
        self.next_read += 1;
        let dest = b.local_ranges(key);
        self.reads.insert(
            read_id,
            ReadPart {
                peer: b.peer,
                transfer: id,
                entries: Vec::new(),
                dests: Ranges::Packed(dest.clone()),
                blocks: None,
                offer: None,
                cancelled: false,
            },
        );
        self.actions.push_back(Action::Control {
            peer: b.peer,
            msg: PeerMsg::ReadRequest {
                read_id,
                pairs: ReadPairs::Packed {
                    source: b.remote,
                    dest,
                },
                deadline_ms,
                blocks: None,
                host_dests,
            },
        });
        self.add_part(id, read_id, b.peer);
        self.announce(id, total);
        Ok(id)
    }

    /// Where a packed side's chunks come from: one coalesced stream of `spans` in `buffer` when
    /// the entries are shorter than a chunk on average (every batch of many small entries), else
    /// a place per entry.
    pub(super) fn packed_sources(
        &self,
        buffer: u64,
        spans: impl ExactSizeIterator<Item = (u64, u64)> + Clone,
        remote: &PackedRanges,
    ) -> Places {
        let n = spans.len() as u64;
        let coalesced = n > 1
            && remote
                .total()
                .is_some_and(|t| t < n.saturating_mul(u64::from(self.cfg.chunk_bytes)));
        if coalesced {
            Places::coalesced(buffer, spans)
        } else {
            let (places, lengths) = spans.map(|(o, l)| ((buffer, o), l)).unzip();
            Places::ranges(places, lengths)
        }
    }
}

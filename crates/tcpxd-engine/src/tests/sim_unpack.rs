//! The simulated driver's unpack of a completed plain or scatter receive (the daemon's
//! bounce-pages path): only while the engine says the receive lands (`Engine::recv_lands`).

use super::*;

impl Sim {
    /// The driver's unpack of a completed plain or scatter receive on node `at`: nothing for an
    /// emptied chunk or one posted into the lane's own place, nor for one whose transfer ended
    /// here since it was posted (`Engine::recv_lands`); else its bytes go to the destination.
    pub(super) fn unpack(&mut self, at: usize, r: &Post, data: &[u8]) {
        let n = &mut self.nodes[at];
        n.unpacked += 1;
        if data.is_empty() {
            let offer = r.scatter.map(|(o, _)| o).or(r.offer);
            if r.buffer != DROPPED && offer.is_some_and(|o| n.eng.recv_lands(P, o)) {
                n.emptied_live += 1;
            }
            return;
        }
        if r.buffer == DROPPED {
            n.dropped += 1;
            return;
        }
        match (r.scatter, r.offer) {
            (Some((offer, wire)), _) => {
                if !n.eng.recv_lands(P, offer) {
                    n.dropped += 1;
                    return;
                }
                let pieces = n
                    .eng
                    .recv_pieces(P, offer, wire, r.len)
                    .expect("pieces of a live offer");
                let dst = n.bufs.get_mut(&r.buffer).unwrap();
                n.pieces.pieces += scatter(dst, pieces, data);
            }
            (None, Some(offer)) => {
                if !n.eng.recv_lands(P, offer) {
                    n.dropped += 1;
                    return;
                }
                let dst = n.bufs.get_mut(&r.buffer).unwrap();
                dst[r.offset as usize..][..data.len()].copy_from_slice(data);
            }
            (None, None) => panic!("a plain receive without its offer: {r:?}"),
        }
    }
}

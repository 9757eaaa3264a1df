//! A lane's eager credits, each side as a type (the protocol: [`crate::credits`]).
//!
//! - [`SendCredits`]: a send lane's share of the receives the peer posted on it. One is spent
//!   per posted send and never below zero; the peer's `Credits` message gives them back, never
//!   above what its `ReceiveMode` announced (more is refused, and changes nothing). Towards a
//!   peer with GPU credits (`crate::streams`) each send also spends its length from the lane's
//!   byte budget, and a returned credit gives back the length of the oldest send not returned.
//! - [`RecvCredits`]: a receive lane's credit receives that are posted and hold no data, and
//!   the credits of those posted again that are still owed to the peer.

/// A send lane's credits towards a peer's eager receives.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SendCredits {
    /// Sends the peer's posted receives can still take.
    held: u32,
    /// What the peer announced for this lane (0 on its rendezvous lanes): the most ever held.
    limit: u32,
    /// Bytes of sends not yet returned the lane may have (0: no byte budget).
    budget: u64,
    /// Bytes of the sends spent and not returned yet.
    bytes_out: u64,
    /// Their lengths, oldest first (kept only with a byte budget).
    spent: std::collections::VecDeque<u32>,
}

/// A peer returned more credits than it was given: it broke the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{returned} credits returned with {held} held of {limit}")]
pub(crate) struct ExcessCredits {
    pub(crate) returned: u32,
    pub(crate) held: u32,
    pub(crate) limit: u32,
}

impl SendCredits {
    /// The peer's `ReceiveMode`: `n` receives posted on the lane, every one held.
    pub(crate) fn granted(n: u32) -> Self {
        Self {
            held: n,
            limit: n,
            ..Self::default()
        }
    }

    /// The peer's byte budget for the lane (`GpuCredits`; 0: none).
    pub(crate) fn set_budget(&mut self, budget: u64) {
        self.budget = budget;
    }

    /// Bytes of sends spent and not returned.
    pub(crate) fn bytes_out(&self) -> u64 {
        self.bytes_out
    }

    /// Whether `len` more bytes fit the budget with `ahead` bytes out or waiting before them:
    /// always when nothing is (a chunk larger than the budget still goes, alone).
    fn fits(&self, ahead: u64, len: u32) -> bool {
        self.budget == 0 || ahead == 0 || ahead + u64::from(len) <= self.budget
    }

    /// Room for a chunk of `len` bytes of a large (streamed) transfer behind `queued` chunks of
    /// `queued_bytes` waiting on the lane: a quarter of the lane's credits and of its byte budget
    /// stays free for small transfers (`crate::streams`).
    pub(crate) fn room_for_large(&self, queued: usize, queued_bytes: u64, len: u32) -> bool {
        let free = u64::from(self.held).saturating_sub(queued as u64);
        if free <= u64::from(self.limit / 4) {
            return false;
        }
        let ahead = self.bytes_out + queued_bytes;
        ahead == 0 || self.fits(ahead + self.budget / 4, len)
    }

    /// Credits held now.
    pub(crate) fn held(&self) -> u32 {
        self.held
    }

    /// Every credit the peer granted is back: none of its receives holds a send of ours.
    pub(crate) fn all_back(&self) -> bool {
        self.held == self.limit
    }

    /// Spends one (and `len` bytes of the budget) for a send; with none held or the bytes over
    /// budget, nothing changes and the send waits (false).
    pub(crate) fn spend(&mut self, len: u32) -> bool {
        if self.held == 0 || !self.fits(self.bytes_out, len) {
            return false;
        }
        self.held -= 1;
        if self.budget > 0 {
            self.bytes_out += u64::from(len);
            self.spent.push_back(len);
        }
        true
    }

    /// Whether the peer may return `n` credits now: never more than it was given.
    pub(crate) fn check_return(&self, n: u32) -> Result<(), ExcessCredits> {
        if u64::from(self.held) + u64::from(n) > u64::from(self.limit) {
            return Err(ExcessCredits {
                returned: n,
                held: self.held,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// Takes back `n` credits the peer returned; more than it was given is refused and
    /// changes nothing.
    pub(crate) fn take_back(&mut self, n: u32) -> Result<(), ExcessCredits> {
        self.check_return(n)?;
        self.held += n;
        for _ in 0..n {
            self.bytes_out -= self.spent.pop_front().map_or(0, u64::from);
        }
        Ok(())
    }
}

/// A receive lane's credit receives (eager lanes only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RecvCredits {
    /// Credit receives posted and holding no data.
    posted: u32,
    /// Credit receives posted again after their data was consumed, whose credits the peer has
    /// not been sent yet.
    owed: u32,
    /// The lengths of the chunks those receives held: what the peer's byte budget has out for
    /// them (`crate::credits`, "Liveness").
    owed_bytes: u64,
}

impl RecvCredits {
    /// Credit receives posted and holding no data.
    pub(crate) fn posted(&self) -> u32 {
        self.posted
    }

    /// The lane's first `n` credit receives were posted (nothing owed: the peer holds them
    /// from the `ReceiveMode`).
    pub(crate) fn posted_all(&mut self, n: u32) {
        self.posted = n;
    }

    /// A posted receive completed with data; false, and nothing changes, when none was posted.
    pub(crate) fn land(&mut self) -> bool {
        match self.posted.checked_sub(1) {
            Some(p) => {
                self.posted = p;
                true
            }
            None => false,
        }
    }

    /// A consumed receive (its chunk `len` bytes) was posted again: its credit is owed to the
    /// peer.
    pub(crate) fn repost(&mut self, len: u32) {
        self.posted += 1;
        self.owed += 1;
        self.owed_bytes += u64::from(len);
    }

    /// Credits owed to the peer.
    pub(crate) fn owed(&self) -> u32 {
        self.owed
    }

    /// The bytes of the chunks whose credits are owed.
    pub(crate) fn owed_bytes(&self) -> u64 {
        self.owed_bytes
    }

    /// The credits owed, now being returned: none are owed after.
    pub(crate) fn take_owed(&mut self) -> u32 {
        self.owed_bytes = 0;
        std::mem::take(&mut self.owed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_spends_one_credit_and_none_below_zero() {
        let mut c = SendCredits::granted(2);
        assert_eq!(c.held(), 2);
        assert!(c.spend(1));
        assert!(c.spend(1));
        assert_eq!(c.held(), 0);
        assert!(!c.spend(1), "no credit: the send waits");
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn a_lane_with_no_grant_holds_nothing() {
        let mut c = SendCredits::default();
        assert!(!c.spend(1));
        assert_eq!(SendCredits::granted(0), c);
        assert_eq!(
            c.take_back(1),
            Err(ExcessCredits {
                returned: 1,
                held: 0,
                limit: 0
            }),
            "a rendezvous lane grants none"
        );
    }

    #[test]
    fn returned_credits_come_back_up_to_the_grant() {
        let mut c = SendCredits::granted(3);
        for _ in 0..3 {
            assert!(c.spend(1));
        }
        assert_eq!(c.take_back(2), Ok(()));
        assert_eq!(c.held(), 2);
        assert_eq!(c.take_back(0), Ok(()), "a lane with nothing to return");
        assert_eq!(c.take_back(1), Ok(()));
        assert_eq!(c.held(), 3, "all back");
    }

    #[test]
    fn more_returned_than_given_is_refused_and_changes_nothing() {
        let mut c = SendCredits::granted(3);
        assert!(c.spend(1));
        let excess = ExcessCredits {
            returned: 2,
            held: 2,
            limit: 3,
        };
        assert_eq!(c.check_return(2), Err(excess));
        assert_eq!(c.take_back(2), Err(excess));
        assert_eq!(c.held(), 2, "unchanged");
        assert_eq!(
            excess.to_string(),
            "2 credits returned with 2 held of 3",
            "the violation's words"
        );
        assert_eq!(c.check_return(1), Ok(()));
    }

    #[test]
    fn a_return_past_u32_is_refused_not_wrapped() {
        let mut c = SendCredits::granted(u32::MAX);
        assert!(c.spend(1));
        assert!(c.take_back(u32::MAX).is_err());
        assert_eq!(c.take_back(1), Ok(()));
        assert_eq!(c.held(), u32::MAX);
    }

    #[test]
    fn a_byte_budget_holds_sends_until_their_bytes_come_back() {
        let mut c = SendCredits::granted(16);
        c.set_budget(10);
        assert!(c.spend(6));
        assert!(!c.spend(5), "6 + 5 bytes over a 10-byte budget: the send waits");
        assert!(c.spend(4));
        assert_eq!((c.held(), c.bytes_out()), (14, 10));
        assert_eq!(c.take_back(1), Ok(()), "the oldest send's 6 bytes come back");
        assert_eq!(c.bytes_out(), 4);
        assert!(c.spend(5));
        assert_eq!(c.take_back(2), Ok(()));
        assert_eq!((c.held(), c.bytes_out()), (16, 0), "every credit and byte back");
        assert!(c.spend(64), "a chunk larger than the budget goes alone");
        assert!(!c.spend(1));
    }

    #[test]
    fn a_large_transfer_leaves_a_quarter_of_the_lane_to_small_ones() {
        let mut c = SendCredits::granted(16);
        c.set_budget(1000);
        // Credits: 12 of 16 may go to large chunks (queued or posted), never the last 4.
        assert!(c.room_for_large(11, 0, 0));
        assert!(!c.room_for_large(12, 0, 0));
        for _ in 0..12 {
            assert!(c.spend(0));
        }
        assert!(!c.room_for_large(0, 0, 0), "4 left: the reserve");
        assert!(c.spend(0), "a small send takes the reserve");
        let mut c = SendCredits::granted(16);
        c.set_budget(1000);
        // Bytes: 750 of 1000 for large chunks; the first one always fits.
        assert!(
            c.room_for_large(0, 0, 2000),
            "nothing ahead: one chunk goes, whatever its size"
        );
        assert!(c.room_for_large(0, 500, 250));
        assert!(!c.room_for_large(0, 500, 251));
        assert!(c.spend(700));
        assert!(!c.room_for_large(0, 0, 100));
        assert!(c.spend(300), "small sends may fill the budget");
        // No budget: credits only.
        let c = SendCredits::granted(3);
        assert!(c.room_for_large(2, 1 << 40, u32::MAX) && !c.room_for_large(3, 0, 0));
    }

    #[test]
    fn a_receive_lane_lands_reposts_and_owes_each_credit_once() {
        let mut c = RecvCredits::default();
        assert!(!c.land(), "nothing posted: nothing lands");
        c.posted_all(3);
        assert_eq!((c.posted(), c.owed()), (3, 0));
        assert!(c.land());
        assert!(c.land());
        assert_eq!((c.posted(), c.owed()), (1, 0), "landed, not consumed");
        c.repost(100);
        assert_eq!((c.posted(), c.owed(), c.owed_bytes()), (2, 1, 100));
        c.repost(28);
        assert_eq!(c.owed_bytes(), 128);
        assert_eq!(c.take_owed(), 2);
        assert_eq!(c.owed_bytes(), 0, "their bytes with them");
        assert_eq!(
            (c.posted(), c.owed()),
            (3, 0),
            "every receive posted, nothing owed"
        );
        assert_eq!(c.take_owed(), 0, "returned once");
    }

    #[test]
    fn a_landing_without_a_posted_receive_changes_nothing() {
        let mut c = RecvCredits::default();
        c.posted_all(1);
        assert!(c.land());
        assert!(!c.land());
        assert_eq!((c.posted(), c.owed()), (0, 0));
    }
}

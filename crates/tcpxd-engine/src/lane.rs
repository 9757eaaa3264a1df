//! A lane's queue and window: chunks wait in `queue`, in the order both sides agreed on, and
//! move to `posted` while the window has room and, on a peer's eager lane, a credit is held. A
//! posted chunk leaves the window when the driver reports it (a send done, a receive consumed).

#[cfg(test)]
use super::SendCredits;
use super::{Item, Lane};

impl Lane {
    /// The next chunk to post: the oldest queued one, once the lane is ready, fewer than
    /// `window` requests are posted and, with `credit`, a credit is held (spent here).
    pub(crate) fn post_next(&mut self, window: usize, credit: bool) -> Option<Item> {
        if !self.ready || self.posted.len() >= window || self.queue.is_empty() {
            return None;
        }
        if credit && !self.send_credits.spend() {
            return None;
        }
        let item = self.queue.pop_front()?;
        self.posted.push_back(item);
        Some(item)
    }

    /// Counts the start of each stretch in which the window is full and chunks wait.
    pub(crate) fn note_window(&mut self) {
        let stalled = self.ready && !self.queue.is_empty();
        if stalled && !self.stalled {
            self.window_full += 1;
        }
        self.stalled = stalled;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(queued: u64) -> Lane {
        let mut l = Lane::default();
        for offer in 0..queued {
            l.queue.push_back(Item {
                offer,
                buffer: 1,
                offset: offer * 10,
                len: 10,
                pieces: false,
            });
        }
        l
    }

    fn drain(l: &mut Lane, window: usize, credit: bool) -> Vec<u64> {
        std::iter::from_fn(|| l.post_next(window, credit))
            .map(|i| i.offer)
            .collect()
    }

    #[test]
    fn nothing_is_posted_before_the_lane_is_ready() {
        let mut l = lane(3);
        assert!(l.post_next(16, false).is_none());
        assert_eq!(l.queue.len(), 3);
    }

    #[test]
    fn the_window_bounds_what_is_posted_and_a_completion_makes_room_in_order() {
        let mut l = lane(5);
        l.ready = true;
        assert_eq!(drain(&mut l, 3, false), [0, 1, 2]);
        assert_eq!(l.posted.len(), 3);
        l.posted.pop_front(); // the head completed
        assert_eq!(drain(&mut l, 3, false), [3]);
        l.posted.clear();
        assert_eq!(drain(&mut l, 3, false), [4]);
        assert!(l.queue.is_empty());
    }

    #[test]
    fn an_eager_send_spends_a_credit_and_waits_without_one() {
        let mut l = lane(4);
        l.ready = true;
        l.send_credits = SendCredits::granted(2);
        assert_eq!(drain(&mut l, 12, true), [0, 1], "two credits, two sends");
        assert_eq!(l.send_credits.held(), 0);
        l.send_credits.take_back(1).unwrap(); // one came back
        assert_eq!(drain(&mut l, 12, true), [2]);
        assert_eq!(l.send_credits.held(), 0);
        assert_eq!(l.queue.len(), 1);
    }

    #[test]
    fn an_empty_queue_spends_no_credit() {
        let mut l = lane(1);
        l.ready = true;
        l.send_credits = SendCredits::granted(2);
        assert_eq!(drain(&mut l, 12, true), [0]);
        assert_eq!(l.send_credits.held(), 1, "one send, one credit");
    }

    #[test]
    fn a_full_window_counts_once_per_stretch() {
        let mut l = lane(4);
        l.ready = true;
        drain(&mut l, 2, false);
        l.note_window();
        l.note_window();
        assert_eq!(l.window_full, 1, "one stretch");
        l.posted.clear();
        drain(&mut l, 2, false);
        l.note_window();
        assert_eq!(l.window_full, 1, "the queue emptied: no stretch");
        l.queue.push_back(Item {
            offer: 9,
            buffer: 1,
            offset: 0,
            len: 1,
            pieces: false,
        });
        l.note_window();
        assert_eq!(l.window_full, 2, "a new stretch");
    }
}

//! A lane's queue and window: chunks wait in `queue`, in the order both sides agreed on, and
//! move to `posted` while the window has room and, on a peer's eager lane, a credit is held. A
//! posted chunk leaves the window when the driver reports it (a send done, a receive consumed).
//! A chunk in pieces (`Item::pieces`: gathered before it is sent) has `ahead` more room, so its
//! gather can run while the sends before it are still in flight; the head decides, so the lane
//! stays in order.

#[cfg(test)]
use super::SendCredits;
use super::{Item, Lane};

impl Lane {
    /// The next chunk to post: the oldest queued one, once the lane is ready, fewer than
    /// `window` requests are posted (`window + ahead` when that chunk is in pieces) and, with
    /// `credit`, a credit is held (spent here).
    pub(crate) fn post_next(&mut self, window: usize, ahead: usize, credit: bool) -> Option<Item> {
        self.post_next_by(window, |_| ahead, credit)
    }

    /// As [`Lane::post_next`], the room beyond `window` for a chunk in pieces told by `ahead`
    /// (of that chunk: host and GPU memory have their own).
    pub(crate) fn post_next_by(
        &mut self,
        window: usize,
        ahead: impl Fn(&Item) -> usize,
        credit: bool,
    ) -> Option<Item> {
        let head = self.queue.front()?;
        let limit = if head.pieces {
            window.saturating_add(ahead(head))
        } else {
            window
        };
        if !self.ready || self.posted.len() >= limit {
            return None;
        }
        if credit && !self.send_credits.spend(head.len) {
            return None;
        }
        let item = self.queue.pop_front()?;
        self.posted.push_back(item);
        self.touch();
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
        drain_ahead(l, window, 0, credit)
    }

    fn drain_ahead(l: &mut Lane, window: usize, ahead: usize, credit: bool) -> Vec<u64> {
        std::iter::from_fn(|| l.post_next(window, ahead, credit))
            .map(|i| i.offer)
            .collect()
    }

    /// A ready lane with these chunks queued, in order: `true` for a chunk in pieces.
    fn mixed(pieces: &[bool]) -> Lane {
        let mut l = Lane {
            ready: true,
            ..Lane::default()
        };
        for (offer, &p) in pieces.iter().enumerate() {
            l.queue.push_back(Item {
                offer: offer as u64,
                buffer: 1,
                offset: offer as u64 * 10,
                len: 10,
                pieces: p,
            });
        }
        l
    }

    #[test]
    fn nothing_is_posted_before_the_lane_is_ready() {
        let mut l = lane(3);
        assert!(l.post_next(16, 0, false).is_none());
        assert!(mixed(&[true]).post_next(16, 4, false).is_some());
        let mut staged = mixed(&[true]);
        staged.ready = false;
        assert!(staged.post_next(16, 4, false).is_none());
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

    #[test]
    fn chunks_in_pieces_get_the_window_and_the_gathers_ahead() {
        let mut l = mixed(&[true; 10]);
        assert_eq!(drain_ahead(&mut l, 3, 4, false), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(l.posted.len(), 7, "window 3 + 4 ahead");
        l.posted.pop_front(); // the oldest send completed: one more
        assert_eq!(drain_ahead(&mut l, 3, 4, false), [7]);
        l.posted.clear();
        assert_eq!(drain_ahead(&mut l, 3, 4, false), [8, 9]);
    }

    #[test]
    fn plain_chunks_keep_the_window_whatever_is_ahead() {
        let mut l = lane(10);
        l.ready = true;
        assert_eq!(drain_ahead(&mut l, 3, 4, false), [0, 1, 2]);
        assert_eq!(l.queue.len(), 7);
    }

    #[test]
    fn the_head_decides_so_mixed_lanes_stay_in_order() {
        // Two staged, one plain, three staged: window 2, 3 ahead.
        let mut l = mixed(&[true, true, false, true, true, true]);
        assert_eq!(
            drain_ahead(&mut l, 2, 3, false),
            [0, 1],
            "the plain head waits for the window"
        );
        l.posted.pop_front();
        assert_eq!(
            drain_ahead(&mut l, 2, 3, false),
            [2, 3, 4, 5],
            "staged ones behind it go ahead"
        );
        assert_eq!(l.posted.len(), 5);
        assert!(l.queue.is_empty());
        // A plain chunk behind a full staged window waits until the window itself has room.
        let mut l = mixed(&[true, true, true, false]);
        assert_eq!(drain_ahead(&mut l, 1, 2, false), [0, 1, 2]);
        l.posted.pop_front();
        assert!(
            l.post_next(1, 2, false).is_none(),
            "two posted, window 1: the plain head waits"
        );
        l.posted.pop_front();
        assert_eq!(drain_ahead(&mut l, 1, 2, false), [], "still one posted");
        l.posted.pop_front();
        assert_eq!(drain_ahead(&mut l, 1, 2, false), [3]);
    }

    #[test]
    fn no_gathers_ahead_is_the_plain_window() {
        let pattern = [true, false, true, true, false, false, true, true, true, false];
        for window in 1..5 {
            let (mut a, mut b) = (mixed(&pattern), mixed(&pattern));
            b.queue.iter_mut().for_each(|i| i.pieces = false);
            loop {
                let (x, y) = (
                    drain_ahead(&mut a, window, 0, false),
                    drain(&mut b, window, false),
                );
                assert_eq!(x, y, "window {window}");
                if a.posted.is_empty() {
                    break;
                }
                a.posted.pop_front();
                b.posted.pop_front();
            }
            assert!(a.queue.is_empty() && b.queue.is_empty());
        }
    }

    #[test]
    fn a_staged_eager_send_still_needs_a_credit() {
        let mut l = mixed(&[true; 4]);
        l.send_credits = SendCredits::granted(2);
        assert_eq!(drain_ahead(&mut l, 1, 8, true), [0, 1], "two credits, two sends");
        assert_eq!(l.queue.len(), 2);
    }
}

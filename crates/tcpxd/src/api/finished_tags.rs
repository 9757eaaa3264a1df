//! A session's recently finished transfers and ended subscriptions by tag, so that a `cancel_tag`
//! of one answers that it already finished (`FAILED_PRECONDITION`, with how it ended) rather than
//! that no request has the tag (`NOT_FOUND`): the client may not have read the transfer's event
//! yet when it cancels, or may cancel its subscription twice. Bounded: the last [`KEPT`] finished
//! tags of the session; an older one is `NOT_FOUND` again.

use std::collections::{HashMap, VecDeque};

use tonic::{Code, Status};

use super::state::DaemonState;
use crate::engine::TransferId;

/// Finished tags a session remembers.
pub const KEPT: usize = 4096;

/// What a finished tag named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// A transfer, which finished (its final event went, or is going, out).
    Transfer(TransferId),
    /// The session's notification subscription, cancelled by the `cancel_tag` of tag `by`.
    Subscription { by: u64 },
}

/// The last [`KEPT`] tags whose transfer finished or whose subscription ended, with what each
/// named then (a tag may come again once it finished: the latest wins).
#[derive(Default)]
pub(crate) struct FinishedTags {
    by_tag: HashMap<u64, Ended>,
    order: VecDeque<(u64, Ended)>,
}

impl FinishedTags {
    /// Records that `tag`'s transfer `id` finished (its final event went, or is going, out).
    pub(crate) fn record(&mut self, tag: u64, id: TransferId) {
        self.push(tag, Ended::Transfer(id));
    }

    /// Records that the subscription under `tag` ended, cancelled by the `cancel_tag` of tag `by`.
    pub(crate) fn record_unsubscribed(&mut self, tag: u64, by: u64) {
        self.push(tag, Ended::Subscription { by });
    }

    fn push(&mut self, tag: u64, ended: Ended) {
        if self.order.len() == KEPT
            && let Some((old, old_ended)) = self.order.pop_front()
            && self.by_tag.get(&old) == Some(&old_ended)
        {
            self.by_tag.remove(&old);
        }
        self.by_tag.insert(tag, ended);
        self.order.push_back((tag, ended));
    }

    /// The answer to a `cancel_tag` of `tag` that names nothing open, if the tag is still
    /// remembered as finished: FAILED_PRECONDITION, saying how it ended; nothing changes.
    pub(crate) fn refusal(&self, state: &DaemonState, tag: u64) -> Option<Status> {
        Some(match *self.by_tag.get(&tag)? {
            Ended::Transfer(id) => already_finished(state, tag, id),
            Ended::Subscription { by } => Status::new(
                Code::FailedPrecondition,
                format!(
                    "cancel_tag: tag {tag} already finished (a subscription, cancelled by tag {by}); \
                     nothing was cancelled"
                ),
            ),
        })
    }

    #[cfg(test)]
    fn get(&self, tag: u64) -> Option<TransferId> {
        match self.by_tag.get(&tag)? {
            Ended::Transfer(id) => Some(*id),
            Ended::Subscription { .. } => None,
        }
    }
}

/// The answer to a `cancel_tag` of `tag`, whose transfer `id` already finished: it changes
/// nothing and says how the transfer ended, while the daemon still knows
/// (`transfer.finished_retention`).
pub(crate) fn already_finished(state: &DaemonState, tag: u64, id: TransferId) -> Status {
    let how = state.transfer(id.0).ok().and_then(|rx| {
        rx.borrow().outcome.as_ref().map(|o| match o.code {
            crate::engine::Code::Ok => " (OK)".to_string(),
            code => format!(
                " ({}: {})",
                crate::metrics::status_label(code).to_ascii_uppercase(),
                o.message
            ),
        })
    });
    Status::new(
        Code::FailedPrecondition,
        format!(
            "cancel_tag: tag {tag} already finished{}; nothing was cancelled",
            how.unwrap_or_default()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_kept_tags_are_remembered_and_a_reused_tag_names_its_latest_transfer() {
        let mut f = FinishedTags::default();
        f.record(1, TransferId(10));
        f.record(2, TransferId(20));
        f.record(1, TransferId(11));
        assert_eq!(f.get(1), Some(TransferId(11)));
        assert_eq!(f.get(2), Some(TransferId(20)));
        assert_eq!(f.get(3), None);
        // KEPT more: the first entry of tag 1 leaves without taking tag 1's latest with it.
        for t in 0..KEPT as u64 - 1 {
            f.record(100 + t, TransferId(1000 + t));
        }
        assert_eq!(f.get(2), None, "the oldest went");
        assert_eq!(f.get(1), Some(TransferId(11)));
        f.record(7, TransferId(70));
        assert_eq!(f.get(1), None);
        assert_eq!(f.order.len(), KEPT);
        assert!(f.by_tag.len() <= KEPT);
    }

    #[test]
    fn an_ended_subscriptions_tag_is_remembered_until_the_tag_comes_again() {
        let mut f = FinishedTags::default();
        f.record_unsubscribed(7, 9);
        assert_eq!(f.by_tag.get(&7), Some(&Ended::Subscription { by: 9 }));
        assert_eq!(f.get(7), None, "not a transfer");
        f.record(7, TransferId(70));
        assert_eq!(f.get(7), Some(TransferId(70)), "the latest wins");
        f.record_unsubscribed(7, 11);
        assert_eq!(f.by_tag.get(&7), Some(&Ended::Subscription { by: 11 }));
        for t in 0..KEPT as u64 {
            f.record(100 + t, TransferId(1000 + t));
        }
        assert_eq!(f.by_tag.get(&7), None, "forgotten with the oldest");
    }
}

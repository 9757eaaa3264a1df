//! One pairing per node, however many handshakes race: the rule a caller applies once the
//! handshake's answer names the node, and the locks and the counter that make its view of the
//! node's pairing current.
//!
//! Every change to a node's pairing happens under that node's lock: the callee's check-accept-
//! record in `Handshake`, and the caller's check-connect-record once the answer named the node.
//! So a callee answers session 0 ("use the pairing you have") to every handshake after the first
//! from a node, and a caller sees every pairing its own daemon made or accepted before deciding.
//! Two daemons dialling each other at once each accept the other's handshake before either
//! answer arrives; both then hold a pairing the other dialled and a fresh session of their own,
//! and the one with the lower node id keeps the pairing it dialled (`Settle::Replace`), the other
//! uses the pairing it accepted (`Settle::Join`): both pick the same one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// Who dialled a pairing: this daemon (the caller side) or the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialled {
    Here,
    There,
}

/// What a caller does with a handshake's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settle {
    /// No pairing with the node: connect the lanes, record the pairing.
    Complete,
    /// Connect the lanes, record this pairing and fail the existing one, which the peer no
    /// longer has (it answered a new session) or gives up (both dialled at once, and this
    /// daemon's node id is the lower).
    Replace,
    /// Close this handshake's lanes and use the existing pairing.
    Join,
    /// The peer has a pairing with this daemon that is not recorded yet: another of this
    /// daemon's dials got the session and has not recorded it. Wait for the other dials.
    WaitForOthers,
}

/// The rule: `session` is the callee's answer (0: it has a pairing with this node already),
/// `existing` the usable pairing this daemon has with `node`, if any.
pub(super) fn after_handshake(me: &str, node: &str, session: u64, existing: Option<Dialled>) -> Settle {
    match (session, existing) {
        (0, Some(_)) => Settle::Join,
        (0, None) => Settle::WaitForOthers,
        (_, None) => Settle::Complete,
        // The peer accepted a new session: the pairing this daemon dialled before is gone there.
        (_, Some(Dialled::Here)) => Settle::Replace,
        // Both dialled at once: the pairing the lower node id dialled stays.
        (_, Some(Dialled::There)) if me < node => Settle::Replace,
        (_, Some(Dialled::There)) => Settle::Join,
    }
}

/// Keys (addresses, node ids) each with the async lock its holders take in turn.
pub(super) type LockMap = Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>;

/// One key's place in a [`LockMap`]: its lock, and the entry removed when the last call holding
/// or waiting for it goes (cancelled calls included).
pub(super) struct Slot {
    map: LockMap,
    key: String,
    pub(super) lock: Arc<tokio::sync::Mutex<()>>,
}

impl Slot {
    pub(super) fn take(map: &LockMap, key: &str) -> Slot {
        let lock = map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_string())
            .or_default()
            .clone();
        Slot {
            map: map.clone(),
            key: key.to_string(),
            lock,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        // The map's reference and this one: nobody else holds or waits for this key.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.key);
        }
    }
}

/// A dial between its handshake and the moment it recorded, joined or gave up a pairing, counted
/// in `Peers::dialing` (the count drops when settled or dropped).
pub(super) struct Dialing<'a>(Option<&'a watch::Sender<usize>>);

impl<'a> Dialing<'a> {
    pub(super) fn start(count: &'a watch::Sender<usize>) -> Dialing<'a> {
        count.send_modify(|n| *n += 1);
        Dialing(Some(count))
    }

    pub(super) fn settle(&mut self) {
        if let Some(count) = self.0.take() {
            count.send_modify(|n| *n -= 1);
        }
    }
}

impl Drop for Dialing<'_> {
    fn drop(&mut self) {
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule() {
        use Dialled::*;
        use Settle::*;
        assert_eq!(after_handshake("a", "b", 7, None), Complete);
        assert_eq!(after_handshake("a", "b", 0, Some(Here)), Join);
        assert_eq!(after_handshake("a", "b", 0, Some(There)), Join);
        assert_eq!(after_handshake("a", "b", 0, None), WaitForOthers);
        assert_eq!(after_handshake("a", "b", 7, Some(Here)), Replace);
        assert_eq!(after_handshake("b", "a", 7, Some(Here)), Replace);
        assert_eq!(after_handshake("a", "b", 7, Some(There)), Replace);
        assert_eq!(after_handshake("b", "a", 7, Some(There)), Join);
    }

    /// Two daemons in the model: what each records per peer (pairing id = the dial that made
    /// it, and who dialled it), and the halves of each pairing still alive.
    #[derive(Clone, Default)]
    struct Node {
        by_node: Option<(usize, Dialled)>,
        /// Pairings with a live half here (caller halves connected, callee halves accepted).
        alive: Vec<usize>,
    }

    #[derive(Clone)]
    struct World {
        nodes: [Node; 2],
        names: [&'static str; 2],
        /// Per dial: the session its handshake was answered with (`None`: not answered yet).
        answered: Vec<Option<u64>>,
        /// Dials that must wait for the others before looking again.
        waiting: Vec<usize>,
    }

    impl World {
        /// `dial` (from node `from`) reaches the other node: its callee half, under its lock.
        fn handshake(&mut self, dial: usize, from: usize) {
            let callee = &mut self.nodes[1 - from];
            let session = match callee.by_node {
                Some(_) => 0,
                None => {
                    callee.by_node = Some((dial, Dialled::There));
                    callee.alive.push(dial);
                    dial as u64 + 1
                }
            };
            self.answered[dial] = Some(session);
        }

        /// `dial`'s answer back at `from`, under its lock.
        fn answer(&mut self, dial: usize, from: usize) {
            let session = self.answered[dial].expect("answered before it arrives");
            let (me, peer) = (self.names[from], self.names[1 - from]);
            let node = &mut self.nodes[from];
            match after_handshake(me, peer, session, node.by_node.map(|(_, d)| d)) {
                Settle::Complete => {
                    node.by_node = Some((dial, Dialled::Here));
                    node.alive.push(dial);
                }
                Settle::Replace => {
                    let (old, _) = node.by_node.expect("replaces one");
                    node.alive.retain(|&p| p != old);
                    node.by_node = Some((dial, Dialled::Here));
                    node.alive.push(dial);
                }
                // The handshake's callee half on the other side is left to the other side.
                Settle::Join => {}
                Settle::WaitForOthers => self.waiting.push(from),
            }
        }
    }

    /// Every order of two dials from each node (each handshake before its answer): both nodes
    /// end with the same pairing, alive on both sides, and no dial that waited finds nothing.
    #[test]
    fn every_interleaving_of_four_dials_settles_on_one_pairing() {
        for names in [["a", "b"], ["b", "a"]] {
            // Dials 0, 1 from node 0; 2, 3 from node 1. Events: (dial, is_answer).
            let from = |d: usize| d / 2;
            let mut orders = Vec::new();
            let mut order = Vec::new();
            fn walk(done: &mut [u8; 4], order: &mut Vec<(usize, bool)>, out: &mut Vec<Vec<(usize, bool)>>) {
                if order.len() == 8 {
                    out.push(order.clone());
                    return;
                }
                for d in 0..4 {
                    if done[d] < 2 {
                        order.push((d, done[d] == 1));
                        done[d] += 1;
                        walk(done, order, out);
                        done[d] -= 1;
                        order.pop();
                    }
                }
            }
            walk(&mut [0; 4], &mut order, &mut orders);
            assert_eq!(orders.len(), 2520);
            for order in orders {
                let mut w = World {
                    nodes: Default::default(),
                    names,
                    answered: vec![None; 4],
                    waiting: Vec::new(),
                };
                for &(d, is_answer) in &order {
                    if is_answer {
                        w.answer(d, from(d));
                    } else {
                        w.handshake(d, from(d));
                    }
                }
                let (x, y) = (&w.nodes[0], &w.nodes[1]);
                let (px, _) = x
                    .by_node
                    .unwrap_or_else(|| panic!("{order:?}: node 0 has no pairing"));
                let (py, _) = y
                    .by_node
                    .unwrap_or_else(|| panic!("{order:?}: node 1 has no pairing"));
                assert_eq!(px, py, "{order:?}: the two sides keep different pairings");
                assert!(
                    x.alive.contains(&px) && y.alive.contains(&py),
                    "{order:?}: the pairing kept is gone on one side"
                );
                // Nothing else is left half-made on either side (lanes nobody uses).
                for (n, node) in w.nodes.iter().enumerate() {
                    assert_eq!(node.alive, vec![px], "{order:?}: node {n} keeps other pairings");
                }
                assert!(w.waiting.iter().all(|&n| w.nodes[n].by_node.is_some()));
            }
        }
    }
}

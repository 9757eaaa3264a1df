//! The simulated driver carrying out the engines' actions (`Sim::drain`): control messages onto
//! the other node's queue, sends, receives and credits posted on the simulated lanes, lanes
//! opened and closed, and what the engine reports (outcomes, notifications, progress, the
//! pairing's life), each engine's windows checked after; then the simulated plugin: at most
//! `send_window` sends a lane handed to it (gathers ahead held back), heads matched FIFO with the
//! posted receives and their bytes moved.

use super::*;

impl Sim {
    /// Executes every pending action of both engines.
    pub(super) fn drain(&mut self) {
        for i in 0..2 {
            while let Some(a) = self.nodes[i].eng.poll_action() {
                match a {
                    Action::Control { peer, msg } => {
                        assert_eq!(peer, P);
                        self.ctrl[1 - i].push_back(msg);
                    }
                    Action::PostSend {
                        lane,
                        buffer,
                        offset,
                        len,
                        ..
                    } => self.wires[i][lane as usize]
                        .deferred
                        .push_back(Post::plain(buffer, offset, len)),
                    Action::PostRecv {
                        lane,
                        buffer,
                        offset,
                        len,
                        offer,
                        ..
                    } => self.wires[1 - i][lane as usize].recvs.push_back(Post {
                        offer: Some(offer),
                        ..Post::plain(buffer, offset, len)
                    }),
                    Action::PostDropRecv { lane, len, .. } => {
                        self.nodes[i].drop_posts += 1;
                        self.wires[1 - i][lane as usize]
                            .recvs
                            .push_back(Post::plain(DROPPED, 0, len))
                    }
                    Action::PostCredit { lane, len, .. } => self.wires[1 - i][lane as usize]
                        .recvs
                        .push_back(Post::plain(LANDING, 0, len)),
                    Action::PostGatherSend {
                        lane,
                        buffer,
                        offer,
                        wire,
                        len,
                        ..
                    } => {
                        let n = &mut self.nodes[i];
                        let pieces = n
                            .eng
                            .send_pieces(offer, wire, len)
                            .expect("a gather for a live offer");
                        let (data, count) = gather(&n.bufs[&buffer], pieces, len);
                        n.pieces.gathers += 1;
                        n.pieces.pieces += count;
                        self.wires[i][lane as usize].deferred.push_back(Post {
                            staged: Some(data),
                            ..Post::plain(buffer, wire, len)
                        });
                    }
                    Action::PostScatterRecv {
                        lane,
                        buffer,
                        offer,
                        wire,
                        len,
                        ..
                    } => {
                        self.nodes[i].pieces.scatters += 1;
                        self.wires[1 - i][lane as usize].recvs.push_back(Post {
                            scatter: Some((offer, wire)),
                            ..Post::plain(buffer, wire, len)
                        });
                    }
                    Action::LandScatter {
                        lane,
                        buffer,
                        offer,
                        wire,
                        len,
                        ..
                    } => {
                        let w = &mut self.wires[1 - i][lane as usize];
                        let data = w.held.pop_front().expect("a Land with no landed receive");
                        w.consume_pending += 1;
                        let n = &mut self.nodes[i];
                        n.pieces.land_scatters += 1;
                        // An emptied chunk (its sender cancelled) brings nothing.
                        if !data.is_empty() {
                            assert_eq!(data.len(), len as usize, "a chunk landed with another size");
                            let pieces = n
                                .eng
                                .recv_pieces(P, offer, wire, len)
                                .expect("a scatter for a live offer");
                            let dst = n.bufs.get_mut(&buffer).expect("Land into a known buffer");
                            n.pieces.pieces += scatter(dst, pieces, &data);
                        }
                    }
                    Action::Land {
                        lane,
                        buffer,
                        offset,
                        len,
                        ..
                    } => {
                        let w = &mut self.wires[1 - i][lane as usize];
                        let data = w.held.pop_front().expect("a Land with no landed receive");
                        w.consume_pending += 1;
                        if buffer.is_none() && !data.is_empty() {
                            self.nodes[i].dropped += 1;
                        }
                        if buffer.is_some() && data.is_empty() {
                            self.nodes[i].emptied_live += 1;
                        }
                        if let Some(b) = buffer {
                            // An emptied chunk (its sender cancelled) brings nothing.
                            if !data.is_empty() {
                                assert_eq!(data.len(), len as usize, "a chunk landed with another size");
                                let dst = self.nodes[i].bufs.get_mut(&b).expect("Land into a known buffer");
                                dst[offset as usize..][..data.len()].copy_from_slice(&data);
                            }
                        }
                    }
                    Action::Progress {
                        transfer,
                        bytes_done,
                        total,
                        ..
                    } => {
                        assert!(bytes_done <= total);
                        let prev = self.nodes[i].progress.insert(transfer, bytes_done).unwrap_or(0);
                        assert!(bytes_done >= prev, "progress never goes back");
                    }
                    Action::Finished { transfer, outcome } => {
                        assert!(
                            self.nodes[i].finished.insert(transfer, outcome).is_none(),
                            "finished twice"
                        );
                    }
                    Action::Notify {
                        payload,
                        transfer_id,
                        buffers,
                        ..
                    } => {
                        self.nodes[i].notes.push((transfer_id, payload));
                        self.nodes[i].noted_buffers.push(buffers);
                    }
                    // Lanes opened on first use (`lane_life.rs`): listened for and accepted at
                    // once; the handle is the lane's number (the other side checks it).
                    Action::ListenLane { lane, .. } => {
                        self.ctrl[1 - i].push_back(PeerMsg::LaneListening {
                            lane,
                            handle: lane.to_le_bytes().to_vec(),
                        });
                        self.nodes[i].eng.on_lane_ready(P, lane, false);
                        self.opened[i] += 1;
                    }
                    Action::ConnectLane { lane, handle, .. } => {
                        assert_eq!(handle, lane.to_le_bytes().to_vec(), "the handle of lane {lane}");
                        self.nodes[i].eng.on_lane_ready(P, lane, true);
                    }
                    Action::CloseLane { lane, send, .. } => {
                        // Nothing of a transfer may be in flight on a comm that closes; a receive
                        // lane's idle credit receives go with it.
                        let w = if send {
                            &mut self.wires[i][lane as usize]
                        } else {
                            &mut self.wires[1 - i][lane as usize]
                        };
                        if send {
                            assert!(
                                w.deferred.is_empty() && w.sends.is_empty(),
                                "lane {lane} closed with sends"
                            );
                        } else {
                            assert!(
                                w.recvs.iter().all(|r| r.buffer == LANDING)
                                    && w.held.is_empty()
                                    && w.arrived.is_empty(),
                                "lane {lane} closed with receives"
                            );
                            assert!(w.sends.is_empty(), "lane {lane} closed with data in flight");
                            w.recvs.clear();
                            self.closed_lanes[i] += 1;
                        }
                    }
                    Action::ClosePeer { reason, .. } => self.nodes[i].closed.push(reason),
                    Action::Pairing { life, .. } => {
                        if life == PairLife::Closed {
                            // Closed when idle: nothing of a transfer may be on its comms; a
                            // receive lane's idle credit receives go with them.
                            for w in &self.wires[i] {
                                assert!(w.deferred.is_empty() && w.sends.is_empty(), "closed with sends");
                            }
                            for w in &mut self.wires[1 - i] {
                                assert!(
                                    w.recvs.iter().all(|r| r.buffer == LANDING) && w.held.is_empty(),
                                    "closed with receives"
                                );
                                w.recvs.clear();
                            }
                        }
                        self.nodes[i].pairing.push(life);
                    }
                    Action::ReleasePeer { peer } => panic!("{peer:?} released: a pair's only pairing"),
                    Action::BufferIdle { buffer } => self.nodes[i].idle.push(buffer),
                }
            }
            let c = self.nodes[i].eng.peer_counters(P).unwrap();
            let cfg = self.nodes[i].eng.config();
            for l in &c.send {
                assert!(
                    l.posted <= cfg.send_window + cfg.gather_ahead,
                    "send window (and gathers ahead) exceeded: {}",
                    l.posted
                );
                assert!(l.credits <= l.credit_limit, "more credits held than granted");
            }
            for l in &c.recv {
                assert!(
                    l.posted <= self.cfg.recv_window + self.cfg.scatter_ahead,
                    "recv window (and scatters ahead) exceeded: {}",
                    l.posted
                );
            }
        }
        // The driver hands the plugin at most `send_window` sends per lane; the plugin matches
        // heads FIFO and moves the bytes.
        for from in 0..2 {
            let window = self.nodes[from].eng.config().send_window;
            for lane in 0..self.wires[from].len() {
                let w = &mut self.wires[from][lane];
                while w.sends.len() + w.send_done_pending < window
                    && let Some(post) = w.deferred.pop_front()
                {
                    w.sends.push_back(post);
                }
                assert!(
                    w.sends.len() + w.send_done_pending <= window,
                    "the plugin holds more than send_window sends of a lane"
                );
                loop {
                    let w = &mut self.wires[from][lane];
                    let (Some(s), Some(r)) = (w.sends.front().cloned(), w.recvs.front().cloned()) else {
                        break;
                    };
                    w.sends.pop_front();
                    w.recvs.pop_front();
                    w.send_done_pending += 1;
                    w.recv_done_pending += 1;
                    w.done_credit.push_back(r.buffer == LANDING);
                    assert!(
                        s.len <= r.len,
                        "sender sent {} bytes into a {}-byte receive: orders disagree",
                        s.len,
                        r.len
                    );
                    let src = match s.staged {
                        Some(data) => data,
                        None if s.len > 0 => {
                            self.nodes[from].bufs[&s.buffer][s.offset as usize..][..s.len as usize].to_vec()
                        }
                        None => Vec::new(),
                    };
                    if r.buffer == LANDING {
                        self.wires[from][lane].held.push_back(src);
                    } else {
                        assert!(
                            s.len == 0 || s.len == r.len,
                            "a live chunk met a receive of another size: orders disagree"
                        );
                        // In the bounce pages until its completion is reported (`step`).
                        self.wires[from][lane].arrived.push_back((r, src));
                    }
                }
                // Eager lanes: every send the sender posted finds a receive posted for it
                // (credits).
                let eager = self.nodes[1 - from].eng.recv_lane_is_eager(P, lane as u32);
                assert!(
                    !eager || self.wires[from][lane].sends.is_empty(),
                    "a send was posted with no credit receive to meet it"
                );
            }
        }
    }
}

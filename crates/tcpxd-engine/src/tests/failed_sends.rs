//! `Engine::fail_posted_send`: a posted send whose bytes the driver could not read (a buffer
//! registered by address whose client's memory is gone) fails its offer — the local WRITE, or
//! the peer's READ it serves — with the driver's reason, and every slot comes back.

use super::*;

const SIZE: usize = 1 << 16;

#[test]
fn a_failed_send_fails_its_write_or_the_peers_read_naming_why() {
    every_mode(a_failed_send_in_mode);
}

fn a_failed_send_in_mode() {
    for read in [false, true] {
        let mut s = Sim::new(1, small_chunks(), 70 + u64::from(read));
        s.buffer(0, 1, SIZE, 5);
        s.buffer(1, 2, SIZE, 6);
        // The sender: node 0 for a WRITE of its buffer 1, node 1 serving node 0's READ of its
        // buffer 2.
        let (t, sender, buffer) = if read {
            (s.read(0, 2, 0, 1, 0, SIZE as u64), 1, 2)
        } else {
            (s.write(0, 1, 0, 2, 0, SIZE as u64), 0, 1)
        };
        s.hold_data = true;
        s.run();
        let why = "buffer 9 (\"kv\", registered by address): process 4242 is gone";
        assert!(
            s.nodes[sender].eng.fail_posted_send(P, 0, buffer, 0, why),
            "{:?} read {read}: no posted send at offset 0",
            mode_now()
        );
        // A send nobody posted: nothing to fail.
        assert!(!s.nodes[sender].eng.fail_posted_send(P, 0, buffer, 12345, why));
        s.hold_data = false;
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::FailedPrecondition, "{:?} read {read}", mode_now());
        assert!(
            o.message.contains("process 4242 is gone"),
            "{:?} read {read}: {}",
            mode_now(),
            o.message
        );
        s.assert_idle();
        // The pairing goes on: the same transfer again completes.
        let t = if read {
            s.read(0, 2, 0, 1, 0, SIZE as u64)
        } else {
            s.write(0, 1, 0, 2, 0, SIZE as u64)
        };
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{:?} read {read}", mode_now());
        assert!(s.same((0, 1, 0), (1, 2, 0), SIZE as u64));
        s.assert_idle();
    }
}

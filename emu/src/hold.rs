//! The hold gate (`TCPXEMU_HOLD_FILE`, `TCPXEMU_HOLD_AFTER_BYTES`), a test knob: while a file
//! exists, the process's send comms write at most a budget of payload bytes more, then wait until
//! it is gone. A test that must catch a transfer in flight creates the file before posting it:
//! the transfer moves its first bytes, and then cannot end whatever the machine's load, until
//! the test removes the file (`crates/tcpxd/tests/suite/common/hold.rs`). Without it, a test
//! that reacts to the first bytes races the transfer's end.

use crate::sync::{Health, lock};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The budget when `TCPXEMU_HOLD_AFTER_BYTES` is unset: enough for a few chunks on every lane of
/// a pairing (512 KiB chunks, a few lanes), far below the 128 MiB the hold tests move.
pub(crate) const DEFAULT_AFTER_BYTES: u64 = 16 << 20;

/// How often a held writer looks at the file again.
const POLL: Duration = Duration::from_millis(1);

#[derive(Debug)]
pub(crate) struct HoldGate {
    pub(crate) file: PathBuf,
    pub(crate) after: u64,
    /// The file's contents when its budget was granted (each creation writes new contents, so
    /// a file removed and created again between two looks still gets a fresh budget), and the
    /// bytes left of that budget.
    state: Mutex<Option<(Vec<u8>, u64)>>,
}

impl HoldGate {
    pub(crate) fn new(file: PathBuf, after: u64) -> HoldGate {
        HoldGate {
            file,
            after,
            state: Mutex::new(None),
        }
    }

    /// Waits until `len` more payload bytes may be written; false when the comm stopped first.
    /// A chunk goes whole or not at all.
    pub(crate) fn admit(&self, len: u64, health: &Health) -> bool {
        if len == 0 {
            return true;
        }
        loop {
            let Ok(generation) = std::fs::read(&self.file) else {
                *lock(&self.state) = None;
                return true;
            };
            {
                let mut st = lock(&self.state);
                let fresh = !matches!(&*st, Some((g, _)) if *g == generation);
                if fresh {
                    *st = Some((generation, self.after));
                }
                if let Some((_, left)) = st.as_mut()
                    && *left >= len
                {
                    *left -= len;
                    return true;
                }
            }
            if !health.sleep_until(Instant::now() + POLL) {
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn the_gate_lets_its_budget_through_then_waits_until_the_file_goes_or_changes() {
        let file = std::env::temp_dir().join(format!("tcpxemu-hold-{}", std::process::id()));
        let _ = std::fs::remove_file(&file);
        let gate = Arc::new(HoldGate::new(file.clone(), 10));
        let health = Arc::new(Health::default());
        // No file: anything goes, and zero-length chunks always do.
        assert!(gate.admit(1 << 20, &health));
        std::fs::write(&file, "1").unwrap();
        assert!(gate.admit(0, &health));
        assert!(gate.admit(4, &health) && gate.admit(6, &health), "the budget");
        // Past it: waits, until the file goes.
        let through = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (gate, health, through) = (gate.clone(), health.clone(), through.clone());
            std::thread::spawn(move || {
                let ok = gate.admit(1, &health);
                through.store(true, Ordering::SeqCst);
                ok
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!through.load(Ordering::SeqCst), "held while the file is there");
        std::fs::remove_file(&file).unwrap();
        assert!(waiter.join().unwrap());
        // New contents: a fresh budget; a comm that stops ends the wait (false).
        std::fs::write(&file, "2").unwrap();
        assert!(gate.admit(10, &health));
        health.begin_close();
        assert!(!gate.admit(1, &health));
        std::fs::write(&file, "3").unwrap();
        assert!(gate.admit(10, &Health::default()), "another generation");
        let _ = std::fs::remove_file(&file);
    }
}

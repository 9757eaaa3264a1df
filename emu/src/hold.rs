//! The hold gate (`TCPXEMU_HOLD_FILE`, `TCPXEMU_HOLD_AFTER_BYTES`), a test knob: while a file
//! exists, the process's send comms write at most a budget of payload bytes more, then wait until
//! it is gone. A test that must catch a transfer in flight creates the file before posting it:
//! the transfer moves its first bytes, and then cannot end whatever the machine's load, until
//! the test removes the file (`crates/tcpxd/tests/suite/common/hold.rs`). Without it, a test
//! that reacts to the first bytes races the transfer's end.
//!
//! The gate only answers whether a chunk may go now; its writer waits (`send.rs`, as for the
//! pacer), so this file imports nothing of the crate.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// The budget when `TCPXEMU_HOLD_AFTER_BYTES` is unset: enough for a few chunks on every lane of
/// a pairing (512 KiB chunks, a few lanes), far below the 128 MiB the hold tests move.
pub(crate) const DEFAULT_AFTER_BYTES: u64 = 16 << 20;

/// How often a held writer looks at the file again.
pub(crate) const POLL: Duration = Duration::from_millis(1);

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

    /// Whether `len` more payload bytes may be written now, taking them from the budget: true
    /// while the file is absent or its budget holds them (a chunk goes whole or not at all),
    /// false while the writer must wait (it looks again after [`POLL`], as long as its comm
    /// lives: the waiting is the writer's, `send.rs`, as the pacer's is).
    pub(crate) fn try_admit(&self, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Ok(generation) = std::fs::read(&self.file) else {
            *st = None;
            return true;
        };
        let fresh = !matches!(&*st, Some((g, _)) if *g == generation);
        if fresh {
            *st = Some((generation, self.after));
        }
        match st.as_mut() {
            Some((_, left)) if *left >= len => {
                *left -= len;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_lets_its_budget_through_then_holds_until_the_file_goes_or_changes() {
        let file = std::env::temp_dir().join(format!("tcpxemu-hold-{}", std::process::id()));
        let _ = std::fs::remove_file(&file);
        let gate = HoldGate::new(file.clone(), 10);
        // No file: anything goes, and zero-length chunks always do.
        assert!(gate.try_admit(1 << 20));
        std::fs::write(&file, "1").unwrap();
        assert!(gate.try_admit(0));
        assert!(gate.try_admit(4) && gate.try_admit(6), "the budget");
        // Past it: held (a chunk goes whole or not at all), until the file goes.
        assert!(!gate.try_admit(1));
        assert!(!gate.try_admit(1), "held while the file is there");
        assert!(gate.try_admit(0));
        std::fs::remove_file(&file).unwrap();
        assert!(gate.try_admit(1 << 20));
        // New contents: a fresh budget.
        std::fs::write(&file, "2").unwrap();
        assert!(!gate.try_admit(11), "larger than the whole budget");
        assert!(gate.try_admit(10));
        assert!(!gate.try_admit(1));
        std::fs::write(&file, "3").unwrap();
        assert!(gate.try_admit(10), "another generation");
        let _ = std::fs::remove_file(&file);
    }
}

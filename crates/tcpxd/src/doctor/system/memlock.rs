//! `memlock`: RLIMIT_MEMLOCK.

use crate::doctor::{Check, Host};

/// Below this the daemon's pinned staging and registrations fail early.
pub const MEMLOCK_FAIL_BELOW: u64 = 1 << 30;

fn fmt_limit(l: Option<u64>) -> String {
    match l {
        None => "unlimited".into(),
        Some(b) if b >= 1 << 30 => format!("{} GiB", b >> 30),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{} KiB", b >> 10),
    }
}

/// `memlock`: RLIMIT_MEMLOCK (unlimited is ok).
pub fn check_memlock(host: &Host) -> Check {
    const NAME: &str = "memlock";
    const FIX: &str =
        "systemd: LimitMEMLOCK=infinity; containers: add IPC_LOCK and raise the runtime's memlock ulimit";
    let (soft, hard) = match (host.memlock)() {
        Ok(l) => l,
        Err(e) => return Check::warn(NAME, format!("cannot read RLIMIT_MEMLOCK: {e}"), FIX),
    };
    let detail = format!(
        "RLIMIT_MEMLOCK soft {}, hard {}",
        fmt_limit(soft),
        fmt_limit(hard)
    );
    match soft {
        None => Check::ok(NAME, detail),
        Some(b) if b < MEMLOCK_FAIL_BELOW => Check::fail(NAME, detail, FIX),
        Some(_) => Check::warn(NAME, detail + "; buffers pinned beyond it will fail", FIX),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{FakeRunner, TempRoot, host};

    #[test]
    fn memlock_ok_warn_fail() {
        let root = TempRoot::new("memlock");
        let r = Arc::new(FakeRunner::default());
        let c = check_memlock(&host(&root, &[], r.clone(), (None, None)));
        assert_eq!(c.level, Level::Ok);
        assert!(c.detail.contains("soft unlimited"));
        let c = check_memlock(&host(&root, &[], r.clone(), (Some(64 << 30), None)));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        let c = check_memlock(&host(&root, &[], r.clone(), (Some(8 << 20), Some(8 << 20))));
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("soft 8 MiB") && c.fix.contains("LimitMEMLOCK=infinity"));
    }
}

//! What the emulation does for NCCL's sake: keep NCCL 2.24 and later off its PAT algorithm,
//! which cannot work with a device-unpack net plugin (the real TCPX plugin or this one).
//!
//! NCCL's tuner means to refuse PAT with such a plugin (`src/graph/tuning.cc`, `ncclPatEnable`:
//! `if (comm->netDeviceType != NCCL_NET_DEVICE_HOST) return 0; // PAT doesn't support net device
//! offload`), but since NCCL 2.24.3 nothing assigns `comm->netDeviceType` (2.23 did, in
//! `src/graph/topo.cc`), so the guard never fires. Wherever NCCL sees one GPU per node — two
//! hosts with one GPU each, or one host whose GPUs cannot reach each other by P2P or SHM
//! (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` trims every GPU into a node of its own) — it runs
//! PAT for AllGather and ReduceScatter with the Simple protocol. PAT's primitives
//! (`prims_simple.h`, `primsModePatAg/Rs`, `patCopy`/`patReduce`) never call
//! `ncclNetDeviceUnpack` and never advance the unpack head, while NCCL's proxy still posts one
//! receive (one unpack-ring slot) per step. The PAT operation reads bytes that never reached its
//! buffer, and every later operation on those connections reads the fragment list of the wrong
//! ring slot. `docs/EMULATION.md` ("NCCL and the PAT algorithm") has the details.
//!
//! So at the first `init`, unless `TCPXEMU_PAT_GUARD=0` or the user set `NCCL_PAT_ENABLE`
//! already, the emulation sets `NCCL_PAT_ENABLE=0` (whatever `NCCL_ALGO` says: harmless there) (NCCL reads it after the net plugin's
//! `init`, when it tunes the first communicator). The real plugin does not do this: with it,
//! export `NCCL_PAT_ENABLE=0` (or an `NCCL_ALGO` without PAT) yourself.

/// Log lines (level, message) for the caller to emit once the logger is set.
pub(crate) type Lines = Vec<(i32, String)>;

/// Apply the PAT guard (once per process, from the first `init`).
pub(crate) fn guard_pat() -> Lines {
    let guard = std::env::var("TCPXEMU_PAT_GUARD").ok();
    let pat = std::env::var("NCCL_PAT_ENABLE").ok();
    decide(guard.as_deref(), pat.as_deref(), |v| {
        // SAFETY: environment writes race only with concurrent C `getenv` calls. This runs in the
        // plugin's first `init`, which NCCL calls while it creates its first communicator and
        // before it reads NCCL_PAT_ENABLE (NCCL_PARAM reads a variable at its first use); NCCL's
        // own initEnv sets variables the same way. Rust-side readers are serialised by std's
        // environment lock.
        unsafe { std::env::set_var("NCCL_PAT_ENABLE", v) };
    })
}

/// The decision, apart from the environment (unit-tested).
fn decide(guard: Option<&str>, pat: Option<&str>, set: impl FnOnce(&str)) -> Lines {
    const WHY: &str = "NCCL 2.24 and later may run its PAT algorithm for AllGather/ReduceScatter \
                       at one GPU per node even with a device-unpack (TCPX) net plugin, because its own \
                       guard (comm->netDeviceType) is never set; PAT never unpacks, so those results are \
                       wrong and every later collective on the same connections reads the wrong \
                       fragment lists";
    let info = crate::abi::NCCL_LOG_INFO;
    let warn = crate::abi::NCCL_LOG_WARN;
    let guard_on = match guard {
        None | Some("1") | Some("") => true,
        Some("0") => false,
        Some(other) => {
            return vec![(
                warn,
                format!(
                    "tcpxemu: TCPXEMU_PAT_GUARD={other:?} is neither 0 nor 1; leaving NCCL_PAT_ENABLE alone"
                ),
            )];
        }
    };
    match pat {
        Some("0") => Vec::new(),
        Some(v) => vec![(warn, format!("tcpxemu: NCCL_PAT_ENABLE={v} keeps PAT on: {WHY}"))],
        None if guard_on => {
            set("0");
            vec![(
                info,
                format!(
                    "tcpxemu: set NCCL_PAT_ENABLE=0 (TCPXEMU_PAT_GUARD=0 leaves it unset, as the real plugin \
                     does): {WHY}"
                ),
            )]
        }
        None => vec![(
            warn,
            format!("tcpxemu: TCPXEMU_PAT_GUARD=0 and NCCL_PAT_ENABLE unset: {WHY}; set NCCL_PAT_ENABLE=0"),
        )],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(guard: Option<&str>, pat: Option<&str>) -> (Option<String>, Lines) {
        let mut set = None;
        let lines = decide(guard, pat, |v| set = Some(v.to_string()));
        (set, lines)
    }

    #[test]
    fn unset_pat_is_turned_off_by_default() {
        let (set, lines) = run(None, None);
        assert_eq!(set.as_deref(), Some("0"));
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].0, crate::abi::NCCL_LOG_INFO);
        assert!(lines[0].1.contains("NCCL_PAT_ENABLE=0"));
    }

    #[test]
    fn a_user_choice_is_kept() {
        assert_eq!(run(None, Some("0")), (None, Vec::new()));
        let (set, lines) = run(None, Some("1"));
        assert_eq!(set, None);
        assert_eq!(lines[0].0, crate::abi::NCCL_LOG_WARN);
        assert!(lines[0].1.contains("NCCL_PAT_ENABLE=1 keeps PAT on"));
    }

    #[test]
    fn guard_off_leaves_the_environment_alone_and_warns() {
        let (set, lines) = run(Some("0"), None);
        assert_eq!(set, None);
        assert_eq!(lines[0].0, crate::abi::NCCL_LOG_WARN);
        let (set, lines) = run(Some("yes"), None);
        assert_eq!(set, None);
        assert!(lines[0].1.contains("neither 0 nor 1"));
    }
}

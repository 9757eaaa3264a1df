//! Conformance cases about the plugin under NCCL rather than under tcpxd.
//!
//! `nccl_pat`: NCCL 2.24 and later lost the guard that keeps its PAT algorithm away from
//! device-unpack net plugins (`comm->netDeviceType` is never assigned, so `ncclPatEnable`'s
//! `!= NCCL_NET_DEVICE_HOST` test never fires). At one GPU per NCCL node — which includes one host
//! whose GPUs cannot use P2P or SHM — AllGather and ReduceScatter then run PAT, whose primitives
//! never unpack and never advance the unpack head: their results are wrong, and so is every
//! later collective on the same connections (issue #14, `docs/EMULATION.md`, "NCCL and the PAT
//! algorithm"). The case passes when NCCL jobs in this environment cannot pick PAT: the plugin
//! does not use device unpack, `NCCL_PAT_ENABLE=0` is set (by the operator, or by the emulation's
//! init), or `NCCL_ALGO` is a plain list of algorithms without PAT.

use crate::net::Plugin;

/// The `nccl_pat` case (global: the environment after the plugin's `init`).
pub(super) fn check_pat(plugin: &Plugin) -> Result<String, String> {
    if !plugin.devices().iter().any(|d| d.uses_unpack()) {
        return Ok("no device uses device unpack: PAT is safe with this plugin".into());
    }
    let pat = std::env::var("NCCL_PAT_ENABLE").ok();
    let algo = std::env::var("NCCL_ALGO").ok();
    verdict(pat.as_deref(), algo.as_deref())
}

/// `NCCL_ALGO` as a plain list (`Ring`, `Ring,Tree`): no exclusions (`^…`), no per-collective
/// filters (`allgather:…`), PAT not named.
fn algo_excludes_pat(algo: &str) -> bool {
    let a = algo.trim().to_ascii_lowercase();
    !a.is_empty() && !a.contains('^') && !a.contains(':') && !a.split(',').any(|x| x.trim() == "pat")
}

fn verdict(pat: Option<&str>, algo: Option<&str>) -> Result<String, String> {
    if pat.map(str::trim) == Some("0") {
        return Ok("NCCL_PAT_ENABLE=0 after the plugin's init: NCCL will not run PAT over it".into());
    }
    if let Some(a) = algo.filter(|a| algo_excludes_pat(a)) {
        return Ok(format!("NCCL_ALGO={a} leaves PAT out"));
    }
    Err(format!(
        "NCCL_PAT_ENABLE is {} and NCCL_ALGO {}: NCCL 2.24+ runs PAT for AllGather/ReduceScatter at one GPU \
         per node even over a device-unpack plugin (its netDeviceType guard is dead); PAT never unpacks, so \
         those results are wrong and later collectives on the same connections read the wrong fragment \
         lists. Export NCCL_PAT_ENABLE=0 for NCCL jobs on this node (the emulation sets it in its init)",
        pat.map(|v| format!("{v:?}")).unwrap_or_else(|| "unset".into()),
        algo.map(|v| format!("is {v:?}"))
            .unwrap_or_else(|| "is unset".into()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pat_verdicts() {
        assert!(verdict(Some("0"), None).is_ok());
        assert!(verdict(None, Some("Ring")).is_ok());
        assert!(verdict(None, Some("ring, tree")).is_ok());
        let e = verdict(None, None).unwrap_err();
        assert!(e.contains("NCCL_PAT_ENABLE is unset"), "{e}");
        assert!(
            verdict(Some("1"), Some("Ring")).is_ok(),
            "a plain list without PAT wins"
        );
        assert!(verdict(Some("1"), None).is_err());
        assert!(verdict(None, Some("Ring,PAT")).is_err());
        assert!(verdict(None, Some("^Tree")).is_err());
        assert!(verdict(None, Some("allreduce:ring")).is_err());
    }
}

//! `gpus`: the NVIDIA driver's GPUs and version, and what CUDA sees.

use crate::doctor::{Check, Host, read_trim};

/// The PCI bus ids of the GPUs the NVIDIA driver lists under /proc/driver/nvidia/gpus.
pub fn proc_gpus(host: &Host) -> std::io::Result<Vec<String>> {
    let mut ids: Vec<String> = std::fs::read_dir(host.path("/proc/driver/nvidia/gpus"))?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ids.sort();
    Ok(ids)
}

/// `gpus`: the driver's GPUs and version (and, on the real root, what CUDA sees).
pub fn check_gpus(host: &Host) -> Check {
    const NAME: &str = "gpus";
    let version = read_trim(&host.path("/proc/driver/nvidia/version"))
        .ok()
        .and_then(|v| {
            // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 …"
            v.lines()
                .next()
                .and_then(|l| {
                    l.split_whitespace()
                        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
                })
                .map(String::from)
        });
    let gpus = match proc_gpus(host) {
        Ok(g) if !g.is_empty() => g,
        Ok(_) | Err(_) => {
            let cuda = cuda_summary(host);
            return Check::fail(
                NAME,
                format!("no NVIDIA GPUs: /proc/driver/nvidia/gpus is absent or empty{cuda}"),
                "install the NVIDIA driver (535+ for A3) or run on a GPU node",
            );
        }
    };
    let models: Vec<String> = gpus
        .iter()
        .map(|id| {
            let info =
                std::fs::read_to_string(host.path(format!("/proc/driver/nvidia/gpus/{id}/information")))
                    .unwrap_or_default();
            let model = info
                .lines()
                .find_map(|l| l.strip_prefix("Model:"))
                .map(str::trim)
                .unwrap_or("?");
            format!("{id} {model}")
        })
        .collect();
    let cuda = cuda_summary(host);
    let detail = format!(
        "{} GPU(s), driver {}: {}{cuda}",
        gpus.len(),
        version.as_deref().unwrap_or("unknown"),
        models.join(", ")
    );
    let major = version
        .as_deref()
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse::<u32>().ok());
    match major {
        None => Check::warn(
            NAME,
            detail,
            "/proc/driver/nvidia/version is unreadable: check the driver installation",
        ),
        Some(m) if m < 535 => Check::warn(
            NAME,
            detail,
            "GPUDirect-TCPX on A3 needs driver 535 or newer: upgrade the driver",
        ),
        Some(_) if cuda.contains("CUDA unavailable") => Check::warn(
            NAME,
            detail,
            "the kernel driver is loaded but libcuda.so.1 does not initialise: check LD_LIBRARY_PATH and the user-space driver",
        ),
        Some(_) => Check::ok(NAME, detail),
    }
}

fn cuda_summary(host: &Host) -> String {
    if !host.probe_cuda {
        return String::new();
    }
    match crate::gpu::Gpu::device_count() {
        Ok(n) => format!("; CUDA sees {n} device(s)"),
        Err(e) => format!("; CUDA unavailable: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{TempRoot, simple_host};

    pub(crate) fn gpu(root: &TempRoot, bus: &str) {
        root.write(
            &format!("/proc/driver/nvidia/gpus/{bus}/information"),
            "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 100\n",
        );
    }

    #[test]
    fn gpus_ok_warn_fail() {
        let root = TempRoot::new("gpus");
        let h = simple_host(&root, &[]);
        let c = check_gpus(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        gpu(&root, "0000:04:00.0");
        let c = check_gpus(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("driver unknown"));
        root.write(
            "/proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  525.60.13  Wed Nov 30 06:39:21 UTC 2022\n",
        );
        assert_eq!(check_gpus(&h).level, Level::Warn);
        root.write(
            "/proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n",
        );
        let c = check_gpus(&h);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(
            c.detail
                .contains("1 GPU(s), driver 535.104.05: 0000:04:00.0 NVIDIA H100 80GB HBM3")
        );
    }
}

//! `kernel.devmem`: what the kernel log says about devmem TCP.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;

use crate::doctor::{Check, Host};

/// Reads the kernel log: `<root>/dev/kmsg` without blocking, else `dmesg`.
fn kernel_log(host: &Host) -> Result<String, String> {
    let kmsg = host.path("/dev/kmsg");
    let from_kmsg = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&kmsg)
        .and_then(|mut f| {
            // /dev/kmsg hands out one record per read and EAGAIN at the end; a file just ends.
            let mut text = String::new();
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match f.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // A record overwritten while reading: skip on.
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                    Err(e) => return Err(e),
                }
                if text.len() > 64 << 20 {
                    break;
                }
            }
            Ok(text)
        });
    let kmsg_err = match from_kmsg {
        Ok(t) => return Ok(t),
        Err(e) => format!("{}: {e}", kmsg.display()),
    };
    match host.runner.run("dmesg", &[]) {
        Ok(o) if o.success => Ok(o.stdout),
        Ok(o) => Err(format!("{kmsg_err}; dmesg: {}", o.stderr.trim())),
        Err(e) => Err(format!("{kmsg_err}; dmesg: {e}")),
    }
}

/// `kernel.devmem`: the kernel log mentions devmem TCP (and no devmem errors).
pub fn check_kernel_log(host: &Host) -> Check {
    const NAME: &str = "kernel.devmem";
    let log = match kernel_log(host) {
        Ok(l) => l,
        Err(why) => {
            return Check::warn(
                NAME,
                format!("kernel log unreadable: {why}"),
                "run the doctor as root (or with CAP_SYSLOG) to read the kernel log",
            );
        }
    };
    let hits: Vec<&str> = log
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("devmem") || l.contains("gpudirect") || l.contains("tcpx")
        })
        .collect();
    let errors: Vec<&str> = hits
        .iter()
        .copied()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("fail") || l.contains("error")
        })
        .collect();
    let clean = |l: &str| -> String {
        // /dev/kmsg records are "prio,seq,time,flags;message".
        l.split_once(';').map(|(_, m)| m).unwrap_or(l).trim().to_string()
    };
    if let Some(e) = errors.first() {
        return Check::fail(
            NAME,
            format!("{} devmem error line(s), first: {}", errors.len(), clean(e)),
            "check the gVNIC driver and kernel support GPUDirect-TCPX (A3 images: COS or the TCPX-enabled Ubuntu)",
        );
    }
    match hits.first() {
        Some(first) => Check::ok(
            NAME,
            format!(
                "{} line(s) mention devmem/TCPX, first: {}",
                hits.len(),
                clean(first)
            ),
        ),
        None => Check::warn(
            NAME,
            "the kernel log does not mention devmem TCP (it may have rotated)",
            "use an A3 image whose kernel supports GPUDirect-TCPX; check RxDM's log for its set-up",
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{FakeRunner, TempRoot, host};

    #[test]
    fn kernel_log_ok_warn_fail() {
        let root = TempRoot::new("kmsg");
        let runner = Arc::new(FakeRunner::default());
        let h = host(&root, &[], runner.clone(), (None, None));
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(
            c.detail.contains("unreadable") && c.detail.contains("dmesg"),
            "{}",
            c.detail
        );
        // dmesg as the fallback.
        runner.answer("dmesg", true, "[ 1.0] gve 0000:06:00.0: devmem TCP enabled\n");
        assert_eq!(check_kernel_log(&h).level, Level::Ok);
        // /dev/kmsg first, in its record format.
        root.write("/dev/kmsg", "6,100,1000,-;eth1: something else\n");
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("does not mention"));
        root.write(
            "/dev/kmsg",
            "6,100,1000,-;gve: devmem TCP rx queue 3 bound\n3,101,1001,-;gve: devmem bind failed: -22\n",
        );
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("gve: devmem bind failed: -22"), "{}", c.detail);
        root.write("/dev/kmsg", "6,100,1000,-;gve: devmem TCP rx queue 3 bound\n");
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Ok);
        assert!(
            c.detail.contains("first: gve: devmem TCP rx queue 3 bound"),
            "{}",
            c.detail
        );
    }
}

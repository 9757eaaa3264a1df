//! `TCPXEMU_FAILSTOP=exit`: where the real plugin calls `exit(1)` ("request too many pages" here),
//! the emulation logs the plugin's words and exits the process with status 1. The test re-runs
//! itself as a child process with the setting (the environment is read once per process) and
//! checks the child's exit status and its log.

mod common;
use common::*;
use std::process::Command;

const CHILD: &str = "TCPXEMU_FAILSTOP_TEST_CHILD";

/// In the child: a receive of 2049 pages (more than the 2048 entries a request may have).
fn child() -> ! {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "65536"),
        ("TCPXEMU_BOUNCE", "host"),
        ("TCPXEMU_BOUNCE_PAGES", "4096"),
        ("TCPXEMU_FAILSTOP", "exit"),
        ("TCPXEMU_TEST_ECHO", "1"),
    ]);
    let mut p = pair(0);
    let size = (8 << 20) + 4096;
    let mut sb = reg(p.send, vec![7u8; size]);
    let mut rb = reg(p.recv, vec![0u8; size]);
    let s = isend(&p, &mut sb, size, 0).unwrap();
    let (r, _) = irecv(&mut p, &mut rb, size, 0).unwrap();
    let start = std::time::Instant::now();
    while start.elapsed() < DEADLINE {
        let _ = test_once(s);
        if let Err(e) = test_once(r) {
            eprintln!("child: the receive failed with {e} instead of exiting the process");
            std::process::exit(3);
        }
    }
    eprintln!("child: nothing happened within the deadline");
    std::process::exit(4)
}

#[test]
fn exit_setting_exits_the_process_with_the_plugins_words() {
    if std::env::var_os(CHILD).is_some() {
        child();
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "exit_setting_exits_the_process_with_the_plugins_words",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "child stderr:\n{stderr}");
    assert!(stderr.contains("request too many pages"), "{stderr}");
    assert!(
        stderr.contains("exit(1), as the real plugin does here (TCPXEMU_FAILSTOP=exit)"),
        "{stderr}"
    );
    assert!(stderr.contains("failstop=exit"), "{stderr}");
}

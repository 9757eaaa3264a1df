//! The bench binary runs end to end on small sizes (every mode, 1 and 4 sockets) and writes its
//! JSON lines; the bytes are verified by the bench itself. No timing assertions.

use std::process::Command;

#[test]
fn bench_runs_every_mode_and_verifies_bytes() {
    let json = std::env::temp_dir().join(format!("tcpxemu-bench-smoke-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let out = Command::new(env!("CARGO_BIN_EXE_tcpxemu-bench"))
        .args([
            "--bytes",
            "6m",
            "--msg-size",
            "64k,1m",
            "--sockets",
            "1,4",
            "--chunk",
            "128k",
        ])
        .args(["--timeout-s", "60", "--json-out"])
        .arg(&json)
        .output()
        .expect("run tcpxemu-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // A header and 3 modes × 2 socket counts × 2 sizes.
    assert_eq!(stdout.lines().count(), 1 + 12, "{stdout}");
    for mode in ["bounce", "bounce-gather", "direct"] {
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.split_whitespace().next() == Some(mode))
                .count(),
            4,
            "{stdout}"
        );
    }
    let lines = std::fs::read_to_string(&json).expect("json output");
    let _ = std::fs::remove_file(&json);
    assert_eq!(lines.lines().count(), 12, "{lines}");
    for l in lines.lines() {
        assert!(l.starts_with("{\"bench\":\"tcpxemu\"") && l.ends_with('}'), "{l}");
        assert!(l.contains("\"verified\":true"), "{l}");
        // 6 MiB in 64 KiB messages is 96; in 1 MiB messages 6.
        assert!(l.contains("\"msgs\":96,") || l.contains("\"msgs\":16,"), "{l}");
    }
}

#[test]
fn bench_rejects_bad_arguments() {
    for args in [
        &["--msg-size", "9m"][..],
        &["--sockets", "12"],
        &["--modes", "sideways"],
        &["--window", "17"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tcpxemu-bench"))
            .args(args)
            .output()
            .expect("run tcpxemu-bench");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage:"),
            "{args:?}"
        );
    }
}

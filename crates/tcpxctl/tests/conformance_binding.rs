//! The `misbound_gpu` conformance case against the emulation in CUDA mode on the CUDA stand-in's
//! eight A3 GPUs (tools/realplugin/cudastub), as CI runs it without a GPU: on each of four NICs a
//! receive comm listened for under a GPU the NIC does not serve takes host-memory receives and
//! fails its CUDA receive with "rx no cmsg". With `TCPXEMU_FAILSTOP=exit` the process ends with
//! status 1 after the plugin's words, as it does on A3 with Google's plugin.

use std::process::{Command, Output};

fn conformance(extra: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tcpxctl"))
        .args([
            "conformance",
            "--builtin-emulation",
            "--cuda",
            "0",
            "--filter",
            "misbound_gpu",
            "--json",
        ])
        .envs(tcpxd_testkit::cudastub::child_env(8))
        .envs([
            ("TCPXEMU_DEVICES", "4"),
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "1024"),
            ("RUST_LOG", "warn"),
        ])
        .envs(extra.iter().copied())
        .output()
        .expect("run tcpxctl conformance")
}

#[test]
fn misbound_gpu_fails_its_cuda_receives_on_every_nic() {
    let out = conformance(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let cases: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(cases.len(), 4, "{stdout}");
    for (dev, c) in cases.iter().enumerate() {
        assert_eq!(c["case"], "misbound_gpu");
        assert_eq!(c["dev"], dev as i64);
        assert_eq!(c["passed"], true, "{c}");
        assert!(
            c["detail"]
                .as_str()
                .unwrap()
                .contains("CUDA receive failed with \"rx no cmsg\""),
            "{c}"
        );
    }
}

#[test]
fn misbound_gpu_with_failstop_exit_ends_the_process_as_on_a3() {
    let out = conformance(&[("TCPXEMU_FAILSTOP", "exit")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(stderr.contains("rx no cmsg"), "{stderr}");
    assert!(
        stderr.contains("exit(1), as the real plugin does here"),
        "{stderr}"
    );
}

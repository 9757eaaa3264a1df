//! The `credit_landing` conformance case against the emulation in CUDA mode on the CUDA
//! stand-in (tools/realplugin/cudastub), as CI runs it without a GPU: credit receives of 4 MiB
//! naming a one-page CUDA registration take chunks of 4 MiB down to 1 byte from the bounce pages,
//! byte-exact (the `d2d` unpacker), and the registration is never written.

use std::process::Command;

#[test]
fn a_credit_receive_may_name_a_one_page_registration_and_a_4_mib_posted_size() {
    let out = Command::new(env!("CARGO_BIN_EXE_tcpxctl"))
        .args([
            "conformance",
            "--builtin-emulation",
            "--cuda",
            "0",
            "--filter",
            "credit_landing",
            "--json",
        ])
        .envs(tcpxd_testkit::cudastub::child_env(1))
        .envs([
            ("TCPXEMU_DEVICES", "1"),
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "4096"),
            ("UCCL_TCPX_UNPACK_IMPL", "d2d"),
            ("RUST_LOG", "warn"),
        ])
        .output()
        .expect("run tcpxctl conformance");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let cases: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(cases.len(), 1, "{stdout}");
    assert_eq!(cases[0]["case"], "credit_landing");
    assert_eq!(cases[0]["passed"], true, "{}", cases[0]);
    assert!(
        cases[0]["detail"]
            .as_str()
            .unwrap()
            .contains("registration untouched"),
        "{}",
        cases[0]
    );
}

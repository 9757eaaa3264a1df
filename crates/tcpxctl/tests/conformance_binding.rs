//! The `misbound_gpu` conformance case against the emulation in CUDA mode on the CUDA stand-in's
//! eight A3 GPUs (tools/realplugin/cudastub), as CI runs it without a GPU: on each of four NICs a
//! receive comm listened for under a GPU the NIC does not serve takes host-memory receives and
//! fails its CUDA receive with "rx no cmsg". With `TCPXEMU_FAILSTOP=exit` the process ends with
//! status 1 after the plugin's words, as it does on A3 with Google's plugin.

use std::process::{Command, Output};

fn conformance(extra: &[(&str, &str)]) -> Output {
    run(&["--cuda", "0", "--filter", "misbound_gpu"], extra)
}

/// `tcpxctl conformance --builtin-emulation --json ARGS…` on the stand-in's eight GPUs and four
/// emulated NICs in CUDA mode (the daemon's `pci` map spreads them as `a3vm` does: GPUs 2k and
/// 2k+1 on NIC k, which is also the emulation's binding).
fn run(args: &[&str], extra: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tcpxctl"))
        .args(["conformance", "--builtin-emulation", "--json"])
        .args(args)
        .envs(tcpxd_testkit::cudastub::child_env(8))
        .envs([
            ("TCPXEMU_DEVICES", "4"),
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "1024"),
            ("UCCL_TCPX_UNPACK_IMPL", "d2d"),
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
    let cases = case_lines(&stdout);
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

/// `credit_landing` posts four 4 MiB receives: 16 MiB of bounce pages per receive comm.
const PAGES: (&str, &str) = ("TCPXEMU_BOUNCE_PAGES", "4096");

/// The JSON lines of cases (not notes).
fn case_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .filter(|v| v.get("case").is_some())
        .collect()
}

fn note_lines(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("note").and_then(|n| n.as_str()).map(String::from))
        .collect()
}

/// With `--cuda G` the data cases (here `credit_landing`: CUDA receives through the `d2d` unpacker) run only on the NIC that serves GPU G, with G current; every
/// other NIC is left out with a note naming the GPUs it serves. Before, every NIC ran them under
/// G — and with the failstop the real plugin has, the process ended at NIC 1's first CUDA receive.
#[test]
fn cuda_cases_run_only_on_the_nics_that_serve_the_test_gpu() {
    for gpu in ["0", "5"] {
        let out = run(
            &["--cuda", gpu, "--filter", "credit_landing"],
            &[("TCPXEMU_FAILSTOP", "exit"), PAGES],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "GPU {gpu}: stdout:\n{stdout}\nstderr:\n{stderr}"
        );
        let cases = case_lines(&stdout);
        let serving: i64 = if gpu == "0" { 0 } else { 2 };
        assert_eq!(cases.len(), 1, "{stdout}");
        assert_eq!(cases[0]["case"], "credit_landing");
        assert_eq!(cases[0]["dev"], serving);
        assert_eq!(cases[0]["passed"], true, "{}", cases[0]);
        let notes = note_lines(&stdout);
        assert_eq!(notes.len(), 3, "{stdout}");
        assert!(
            notes
                .iter()
                .all(|n| n.contains(&format!("does not serve GPU {gpu}")) && n.contains("rx no cmsg")),
            "{notes:?}"
        );
    }
}

/// A NIC named with `--device` that does not serve the test GPU fails `gpu_binding` (naming the
/// GPU to test it with) and runs no data case: on A3 its comms would end the process.
#[test]
fn a_named_device_that_does_not_serve_the_test_gpu_fails_gpu_binding() {
    let out = run(
        &["--cuda", "0", "--device", "2", "--filter", "credit_landing"],
        &[("TCPXEMU_FAILSTOP", "exit"), PAGES],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let cases = case_lines(&stdout);
    assert_eq!(cases.len(), 1, "{stdout}");
    assert_eq!(cases[0]["case"], "gpu_binding");
    assert_eq!(cases[0]["dev"], 2);
    assert_eq!(cases[0]["passed"], false);
    let detail = cases[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("does not serve GPU 0") && detail.contains("--cuda 4"),
        "{detail}"
    );
    // The same NIC with a GPU it serves runs its cases.
    let out = run(
        &["--cuda", "4", "--device", "2", "--filter", "credit_landing"],
        &[PAGES],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(case_lines(&stdout)[0]["passed"], true, "{stdout}");
}

/// A map that is not one is refused before anything runs, naming the flag.
#[test]
fn a_bad_topology_map_is_refused_naming_the_flag() {
    let out = run(&["--cuda", "0", "--topology", "nonsense"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--topology"), "{stderr}");
}

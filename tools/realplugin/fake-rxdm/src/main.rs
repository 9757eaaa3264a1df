//! `tcpxd-fake-rxdm --prefix DIR [--log FILE] [--refuse TEXT] [--gpu-nic-preset a3vm | --gpu-nic NIC=GPU[,GPU]...]... [--nic NAME=IP]...]`:
//! serves the TCPX plugin's RxDM sockets under DIR until SIGTERM or SIGINT, printing one line per
//! request (and appending it to FILE), then a count of what it saw on stderr.
//! tools/realplugin/run.sh starts and stops it.
//!
//! `--gpu-nic-preset a3vm` does what RxDM does with that preset: each rule is filed under the NIC
//! serving the GPU it names (eth1: GPUs 04/05, eth2: 0a/0b, eth3: 84/85, eth4: 8a/8b), and its
//! line says whether that NIC is the one the flow's destination address belongs to
//! (`nic=eth1 dst_nic=eth3 MISMATCH`). The NICs' addresses: `--nic eth1=10.1.1.1` (repeatable),
//! else those of eth1..eth4 in this network namespace. `--gpu-nic NIC=GPU,…` (repeatable) files
//! rules by that table instead of the preset's (e.g. `--gpu-nic lo=0000:04:00.0 --nic
//! lo=127.0.0.1` on loopback, for the devmem shim; docs/CONFORMANCE.md).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tcpxd_fake_rxdm::{Answer, Binding, FakeRxdm, Filing, Request, Socket, rules_left};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Release);
}

fn usage() -> ! {
    eprintln!(
        "usage: tcpxd-fake-rxdm --prefix DIR [--log FILE] [--refuse TEXT] [--gpu-nic-preset a3vm | --gpu-nic NIC=GPU[,GPU]...]... [--nic NAME=IP]..."
    );
    std::process::exit(2)
}

fn main() {
    let mut prefix: Option<PathBuf> = None;
    let mut log: Option<PathBuf> = None;
    let mut answer = Answer::Ok;
    let mut preset = false;
    let mut nics: Vec<(String, std::net::IpAddr)> = Vec::new();
    let mut table: Vec<(String, String)> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--gpu-nic-preset" => match args.next().as_deref() {
                Some("a3vm") => preset = true,
                _ => usage(),
            },
            "--gpu-nic" => {
                let v = args.next().unwrap_or_else(|| usage());
                let (nic, gpus) = v.split_once('=').unwrap_or_else(|| usage());
                for g in gpus.split(',').filter(|g| !g.is_empty()) {
                    table.push((g.to_ascii_lowercase(), nic.to_string()));
                }
                preset = true;
            }
            "--nic" => {
                let v = args.next().unwrap_or_else(|| usage());
                let (name, ip) = v.split_once('=').unwrap_or_else(|| usage());
                nics.push((name.to_string(), ip.parse().unwrap_or_else(|_| usage())));
            }
            "--prefix" => prefix = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--log" => log = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--refuse" => answer = Answer::Refuse(args.next().unwrap_or_else(|| usage())),
            _ => usage(),
        }
    }
    let Some(prefix) = prefix else { usage() };
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let sink = log.map(|p| {
        std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .unwrap_or_else(|e| panic!("--log {}: {e}", p.display())),
        )
    });
    let print = move |r: &Request| {
        let line = r.line();
        println!("fake-rxdm: {line}");
        let _ = std::io::stdout().flush();
        if let Some(f) = &sink {
            let _ = writeln!(f.lock().unwrap_or_else(|e| e.into_inner()), "{line}");
        }
    };
    let binding = preset.then(|| {
        if nics.is_empty() {
            nics = tcpxd_fake_rxdm::a3vm::interface_addrs(&["eth1", "eth2", "eth3", "eth4"])
                .unwrap_or_else(|e| panic!("reading eth1..eth4's addresses: {e}"));
        }
        let mut b = Binding::a3vm(nics.clone());
        if !table.is_empty() {
            b.gpu_to_nic = table.clone();
        }
        b
    });
    let rxdm = FakeRxdm::start_bound(&prefix, answer, binding, Some(Box::new(print)))
        .unwrap_or_else(|e| panic!("--prefix {}: {e}", prefix.display()));
    eprintln!("fake-rxdm: listening under {}", prefix.display());
    if preset {
        let list: Vec<String> = nics.iter().map(|(n, a)| format!("{n}={a}")).collect();
        let how = if table.is_empty() {
            "a3vm preset"
        } else {
            "--gpu-nic table"
        };
        eprintln!("fake-rxdm: {how}, NICs {}", list.join(" "));
    }
    while !STOP.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let reqs = rxdm.stop();
    let count = |s: Socket| reqs.iter().filter(|r| r.socket == s).count();
    eprintln!(
        "fake-rxdm: {} install, {} uninstall, {} registry; {} refused, {} undecodable; {} rules left installed",
        count(Socket::Install),
        count(Socket::Uninstall),
        count(Socket::Registry),
        reqs.iter().filter(|r| !r.answered_ok).count(),
        reqs.iter().filter(|r| r.message.is_err()).count(),
        rules_left(&reqs).len(),
    );
    if preset {
        let filed: Vec<&Filing> = reqs.iter().filter_map(|r| r.filing.as_ref()).collect();
        let matched = filed.iter().filter(|f| f.matches()).count();
        let refused = filed.iter().filter(|f| matches!(f, Filing::Refused(_))).count();
        eprintln!(
            "fake-rxdm: a3vm: {} rules, {matched} filed under the NIC their flow arrives on, {} mismatched, {refused} not filed",
            filed.len(),
            filed.len() - matched - refused,
        );
    }
}

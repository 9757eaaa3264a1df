//! `tcpxd-fake-rxdm --prefix DIR [--log FILE] [--refuse TEXT]`: serves the TCPX plugin's RxDM
//! sockets under DIR until SIGTERM or SIGINT, printing one line per request (and appending it to
//! FILE), then a count of what it saw on stderr. tools/realplugin/run.sh starts and stops it.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tcpxd_fake_rxdm::{Answer, FakeRxdm, Request, Socket, rules_left};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Release);
}

fn usage() -> ! {
    eprintln!("usage: tcpxd-fake-rxdm --prefix DIR [--log FILE] [--refuse TEXT]");
    std::process::exit(2)
}

fn main() {
    let mut prefix: Option<PathBuf> = None;
    let mut log: Option<PathBuf> = None;
    let mut answer = Answer::Ok;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
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
    let rxdm = FakeRxdm::start_with(&prefix, answer, Some(Box::new(print)))
        .unwrap_or_else(|e| panic!("--prefix {}: {e}", prefix.display()));
    eprintln!("fake-rxdm: listening under {}", prefix.display());
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
}

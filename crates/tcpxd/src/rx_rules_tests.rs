use super::*;

use tcpxd_fake_rxdm as fake;
use tcpxd_testkit::ScratchDir;

fn flow(src: &str, dst: &str) -> Flow {
    Flow {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        gpu: Some("0000:04:00.0".into()),
    }
}

/// What the dead instance's plugin sent RxDM at each accept.
fn install(prefix: &Path, f: &Flow) {
    let addr = |a: &SocketAddr| fake::SocketAddress {
        ip_address: Some(a.ip().to_string()),
        port: Some(i32::from(a.port())),
    };
    let msg = fake::UnixSocketProto {
        payload: Some(fake::Payload::FlowSteerRuleRequest(fake::FlowSteerRuleRequest {
            flow_steer_ntuple: Some(fake::FlowSteerNtupleProto {
                flow_type: Some(fake::TCP_V4_FLOW),
                src: Some(addr(&f.src)),
                dst: Some(addr(&f.dst)),
            }),
            queue_id: None,
            gpu_pci_addr: f.gpu.clone(),
        })),
    };
    let mut s = UnixStream::connect(prefix.join(fake::INSTALL_SOCKET)).unwrap();
    s.write_all(&fake::frame(&msg)).unwrap();
    assert!(fake::read_frame(&mut s).unwrap().is_some(), "answered");
}

#[test]
fn a_restarted_daemon_removes_the_rules_its_previous_instance_left() {
    let rxdm_dir = ScratchDir::fresh("rx-rules", "rxdm");
    let state = ScratchDir::fresh("rx-rules", "state");
    std::fs::create_dir_all(&state).unwrap();
    let rxdm = fake::FakeRxdm::start(&rxdm_dir, fake::Answer::Ok).unwrap();
    // The previous instance: two receive comms accepted (their rules installed by the plugin),
    // one closed cleanly (the plugin removed its rules: the record goes), then a SIGKILL.
    let (book, left) = RuleBook::open(&state);
    assert!(left.is_empty());
    let kept = vec![
        flow("10.0.1.2:40001", "10.0.1.1:50000"),
        flow("10.0.1.2:40002", "10.0.1.1:50000"),
    ];
    let closed = vec![flow("10.0.1.2:40003", "10.0.1.1:50001")];
    for f in kept.iter().chain(&closed) {
        install(&rxdm_dir, f);
    }
    let held = book.record(kept.clone());
    let gone = book.record(closed.clone());
    uninstall(&rxdm_dir, &closed[0]).unwrap(); // the plugin's close
    drop(gone);
    std::mem::forget(held); // killed: the comm never closed
    drop(book);
    assert_eq!(
        fake::rules_left(&rxdm.requests()).len(),
        2,
        "the dead instance's rules stay"
    );

    // The next instance, at start-up: the two are removed, nothing is left recorded.
    let (book, left) = RuleBook::open(&state);
    assert_eq!(left, kept);
    assert_eq!(remove_stale(&book, &rxdm_dir, left), 2);
    assert!(
        fake::rules_left(&rxdm.requests()).is_empty(),
        "RxDM holds none of them"
    );
    let (_, left) = RuleBook::open(&state);
    assert!(left.is_empty(), "the file says so too");
    let uninstalls: Vec<_> = rxdm
        .requests()
        .into_iter()
        .filter(|r| r.socket == fake::Socket::Uninstall)
        .map(|r| r.line())
        .collect();
    assert_eq!(uninstalls.len(), 3);
    assert!(
        uninstalls[1].contains("10.0.1.2:40001 -> 10.0.1.1:50000 gpu=0000:04:00.0"),
        "{uninstalls:?}"
    );
}

#[test]
fn rules_rxdm_could_not_be_told_of_are_kept_for_the_next_start() {
    let rxdm_dir = ScratchDir::fresh("rx-rules", "rxdm-down");
    let state = ScratchDir::fresh("rx-rules", "state-down");
    std::fs::create_dir_all(&state).unwrap();
    let (book, _) = RuleBook::open(&state);
    std::mem::forget(book.record(vec![flow("10.0.1.2:40001", "10.0.1.1:50000")]));
    // No RxDM listening: kept.
    let (book, left) = RuleBook::open(&state);
    assert_eq!(remove_stale(&book, &rxdm_dir, left.clone()), 0);
    assert_eq!(book.recorded(), left);
    // RxDM refusing: kept too.
    let rxdm = fake::FakeRxdm::start(&rxdm_dir, fake::Answer::Refuse("busy".into())).unwrap();
    let (book, again) = RuleBook::open(&state);
    assert_eq!(again, left);
    assert_eq!(remove_stale(&book, &rxdm_dir, again), 0);
    // Back to normal: removed.
    rxdm.set_answer(fake::Answer::Ok);
    let (book, again) = RuleBook::open(&state);
    assert_eq!(remove_stale(&book, &rxdm_dir, again), 1);
    assert!(RuleBook::open(&state).1.is_empty());
}

#[test]
fn the_plugins_listen_handle_names_its_data_address_and_the_emulations_does_not() {
    let mut h = [0u8; 128];
    h[0..2].copy_from_slice(&2u16.to_ne_bytes());
    h[2..4].copy_from_slice(&50000u16.to_be_bytes());
    h[4..8].copy_from_slice(&[10, 100, 1, 1]);
    assert_eq!(data_listen_addr(&h), Some("10.100.1.1:50000".parse().unwrap()));
    let mut h6 = [0u8; 128];
    h6[0..2].copy_from_slice(&10u16.to_ne_bytes());
    h6[2..4].copy_from_slice(&443u16.to_be_bytes());
    h6[8..24].copy_from_slice(&"fd00::1".parse::<Ipv6Addr>().unwrap().octets());
    assert_eq!(data_listen_addr(&h6), Some("[fd00::1]:443".parse().unwrap()));
    let mut emu = [0u8; 128];
    emu[0..4].copy_from_slice(b"TXEM");
    assert_eq!(data_listen_addr(&emu), None);
    assert_eq!(data_listen_addr(&[0u8; 128]), None);
    assert_eq!(plugin_pci("00000000:8A:00.0"), "0000:8a:00.0");
    assert_eq!(plugin_pci("0000:04:00.0"), "0000:04:00.0");
}

#[test]
fn connections_accepted_on_a_listening_address_are_found_among_the_processs_sockets() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let c1 = std::net::TcpStream::connect(at).unwrap();
    let c2 = std::net::TcpStream::connect(at).unwrap();
    let c3 = std::net::TcpStream::connect(other.local_addr().unwrap()).unwrap();
    let accepted: Vec<_> = (0..2).map(|_| listener.accept().unwrap().0).collect();
    let _o = other.accept().unwrap();
    let found = accepted_on(at);
    let mut want = vec![(c1.local_addr().unwrap(), at), (c2.local_addr().unwrap(), at)];
    want.sort();
    assert_eq!(
        found, want,
        "the two accepted here, not the other listener's, not the clients' own"
    );
    drop(accepted);
    drop(c3);
}

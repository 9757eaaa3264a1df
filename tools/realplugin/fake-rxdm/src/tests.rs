use super::*;

use tcpxd_testkit::ScratchDir;

/// A test's socket directory, removed when the test ends (passed or not).
fn tmp(name: &str) -> ScratchDir {
    ScratchDir::fresh("fake-rxdm", name)
}

fn rule(src: &str, dst: &str, gpu: Option<&str>) -> UnixSocketProto {
    let addr = |s: &str| {
        let a: SocketAddr = s.parse().unwrap();
        SocketAddress {
            ip_address: Some(a.ip().to_string()),
            port: Some(a.port() as i32),
        }
    };
    UnixSocketProto {
        payload: Some(Payload::FlowSteerRuleRequest(FlowSteerRuleRequest {
            flow_steer_ntuple: Some(FlowSteerNtupleProto {
                flow_type: Some(TCP_V4_FLOW),
                src: Some(addr(src)),
                dst: Some(addr(dst)),
            }),
            queue_id: None,
            gpu_pci_addr: gpu.map(str::to_string),
        })),
    }
}

fn ask(prefix: &Path, socket: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = UnixStream::connect(prefix.join(socket)).unwrap();
    s.write_all(bytes).unwrap();
    read_frame(&mut s)
        .unwrap()
        .map(|body| {
            let mut f = (body.len() as u16).to_be_bytes().to_vec();
            f.extend(body);
            f
        })
        .expect("an answer")
}

#[test]
fn the_ok_frame_is_raw_bytes_ok() {
    assert_eq!(answer_frame(&Answer::Ok), OK_FRAME.to_vec());
    let decoded = UnixSocketProto::decode(&OK_FRAME[2..]).unwrap();
    assert_eq!(decoded.payload, Some(Payload::RawBytes(b"Ok.".to_vec())));
}

#[test]
fn install_and_uninstall_are_answered_ok_and_recorded_decoded() {
    let dir = tmp("rules");
    let rxdm = FakeRxdm::start(&dir, Answer::Ok).unwrap();
    let install = frame(&rule("10.0.0.1:40000", "10.0.0.2:50000", Some("0000:10:00.0")));
    assert_eq!(ask(&dir, INSTALL_SOCKET, &install), OK_FRAME.to_vec());
    let uninstall = frame(&rule("10.0.0.1:40000", "10.0.0.2:50000", None));
    assert_eq!(ask(&dir, UNINSTALL_SOCKET, &uninstall), OK_FRAME.to_vec());
    assert_eq!(rxdm.wait_for(Socket::Uninstall, 1, Duration::from_secs(5)), 1);
    let reqs = rxdm.stop();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].socket, Socket::Install);
    let (kind, src, dst) = reqs[0].flow().unwrap();
    assert_eq!(kind, TCP_V4_FLOW);
    assert_eq!(src, "10.0.0.1:40000".parse().unwrap());
    assert_eq!(dst, "10.0.0.2:50000".parse().unwrap());
    assert_eq!(
        reqs[0].line(),
        "install tcp4 10.0.0.1:40000 -> 10.0.0.2:50000 gpu=0000:10:00.0 queue=- ok"
    );
    assert_eq!(reqs[1].socket, Socket::Uninstall);
    assert!(reqs[1].answered_ok);
    assert!(!dir.join(INSTALL_SOCKET).exists(), "stop removes the sockets");
    assert!(
        UnixStream::connect(dir.join(INSTALL_SOCKET)).is_err(),
        "nobody listens after stop"
    );
}

#[test]
fn a_frame_split_across_writes_is_one_request() {
    let dir = tmp("split");
    let rxdm = FakeRxdm::start(&dir, Answer::Ok).unwrap();
    let bytes = frame(&rule("[fe80::1]:1", "[fe80::2]:2", None));
    let mut s = UnixStream::connect(dir.join(INSTALL_SOCKET)).unwrap();
    for b in &bytes {
        s.write_all(std::slice::from_ref(b)).unwrap();
        s.flush().unwrap();
    }
    let body = read_frame(&mut s).unwrap().unwrap();
    assert_eq!(body, OK_FRAME[2..].to_vec());
    assert_eq!(rxdm.wait_for(Socket::Install, 1, Duration::from_secs(5)), 1);
    let (_, src, _) = rxdm.requests()[0].flow().unwrap();
    assert_eq!(src, "[fe80::1]:1".parse().unwrap());
}

#[test]
fn refusing_answers_other_text_and_records_the_refusal() {
    let dir = tmp("refuse");
    let rxdm = FakeRxdm::start(&dir, Answer::Refuse("no queue for gpu".into())).unwrap();
    let answer = ask(
        &dir,
        INSTALL_SOCKET,
        &frame(&rule("10.0.0.1:1", "10.0.0.2:2", None)),
    );
    let decoded = UnixSocketProto::decode(&answer[2..]).unwrap();
    assert_eq!(
        decoded.payload,
        Some(Payload::RawBytes(b"no queue for gpu".to_vec()))
    );
    rxdm.set_answer(Answer::Ok);
    assert_eq!(
        ask(
            &dir,
            INSTALL_SOCKET,
            &frame(&rule("10.0.0.1:1", "10.0.0.2:2", None))
        ),
        OK_FRAME.to_vec()
    );
    let reqs = rxdm.stop();
    assert_eq!(
        reqs.iter().map(|r| r.answered_ok).collect::<Vec<_>>(),
        vec![false, true]
    );
    assert!(reqs[0].line().ends_with("refused"));
}

#[test]
fn garbage_is_recorded_as_undecodable_and_still_answered() {
    let dir = tmp("garbage");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let rxdm = FakeRxdm::start_with(
        &dir,
        Answer::Ok,
        Some(Box::new(move |r: &Request| sink.lock().unwrap().push(r.line()))),
    )
    .unwrap();
    // Field 2 announced as a 100-byte message with 2 bytes present.
    assert_eq!(
        ask(&dir, INSTALL_SOCKET, &[0x00, 0x04, 0x12, 0x64, 0x01, 0x02]),
        OK_FRAME.to_vec()
    );
    let reg = UnixSocketProto {
        payload: Some(Payload::ApplicationRegisterRequest(ApplicationRegisterRequest {
            register_client: Some(true),
        })),
    };
    assert_eq!(ask(&dir, REGISTRY_SOCKET, &frame(&reg)), OK_FRAME.to_vec());
    let reqs = rxdm.stop();
    assert!(reqs[0].message.is_err());
    assert!(reqs[0].flow().is_none());
    assert!(
        reqs[0].line().starts_with("install undecodable"),
        "{}",
        reqs[0].line()
    );
    assert_eq!(reqs[1].line(), "registry register_client=true ok");
    assert_eq!(seen.lock().unwrap().len(), 2, "the callback saw each request");
}

#[test]
fn a_stale_socket_file_is_replaced() {
    let dir = tmp("stale");
    std::fs::create_dir_all(&dir).unwrap();
    drop(UnixListener::bind(dir.join(INSTALL_SOCKET)).unwrap());
    let rxdm = FakeRxdm::start(&dir, Answer::Ok).unwrap();
    assert_eq!(
        ask(
            &dir,
            INSTALL_SOCKET,
            &frame(&rule("10.0.0.1:1", "10.0.0.2:2", None))
        ),
        OK_FRAME.to_vec()
    );
    drop(rxdm);
    assert!(!dir.join(UNINSTALL_SOCKET).exists());
}

#[test]
fn rules_left_are_what_rxdms_bank_keeps() {
    let dir = tmp("bank");
    let rxdm = FakeRxdm::start(&dir, Answer::Ok).unwrap();
    let (a, b) = (
        ("10.0.0.1:40000", "10.0.0.2:50000"),
        ("10.0.0.1:40001", "10.0.0.2:50000"),
    );
    for (socket, (src, dst)) in [
        (INSTALL_SOCKET, a),
        (INSTALL_SOCKET, a), // a flow that has a rule: RxDM answers OK and keeps the one
        (INSTALL_SOCKET, b),
        (UNINSTALL_SOCKET, a),
    ] {
        assert_eq!(
            ask(&dir, socket, &frame(&rule(src, dst, Some("0000:10:00.0")))),
            OK_FRAME.to_vec()
        );
    }
    assert_eq!(rxdm.wait_for(Socket::Uninstall, 1, Duration::from_secs(5)), 1);
    let reqs = rxdm.stop();
    let left: Vec<Flow> = rules_left(&reqs).into_iter().collect();
    assert_eq!(
        left,
        vec![(TCP_V4_FLOW, b.0.parse().unwrap(), b.1.parse().unwrap())]
    );
    // A refused install leaves nothing.
    let dir = tmp("bank-refused");
    let rxdm = FakeRxdm::start(&dir, Answer::Refuse("no".into())).unwrap();
    ask(&dir, INSTALL_SOCKET, &frame(&rule(a.0, a.1, None)));
    assert_eq!(rxdm.wait_for(Socket::Install, 1, Duration::from_secs(5)), 1);
    assert!(rules_left(&rxdm.stop()).is_empty());
}

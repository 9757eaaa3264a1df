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
fn a3vm_mode_files_under_the_named_gpus_nic_and_records_the_mismatch() {
    let dir = tmp("a3vm");
    let nics = (1..=4)
        .map(|i| (format!("eth{i}"), IpAddr::from([10, 0, i as u8, 1])))
        .collect();
    let rxdm = FakeRxdm::start_bound(&dir, Answer::Ok, Some(Binding::a3vm(nics)), None).unwrap();
    // A flow arriving on eth3 (its destination is eth3's address), rule naming GPU 4 (eth3's).
    let ok = frame(&rule("10.0.1.2:40000", "10.0.3.1:50000", Some("0000:84:00.0")));
    assert_eq!(ask(&dir, INSTALL_SOCKET, &ok), OK_FRAME.to_vec());
    // The same flow, rule naming GPU 0: RxDM files it under eth1 and still answers "Ok.".
    let bad = frame(&rule("10.0.1.2:40001", "10.0.3.1:50001", Some("0000:04:00.0")));
    assert_eq!(ask(&dir, INSTALL_SOCKET, &bad), OK_FRAME.to_vec());
    // A GPU no NIC serves: refused with RxDM's words.
    let unknown = frame(&rule("10.0.1.2:40002", "10.0.3.1:50002", Some("0000:10:00.0")));
    let answer = ask(&dir, INSTALL_SOCKET, &unknown);
    let decoded = UnixSocketProto::decode(&answer[2..]).unwrap();
    assert!(
        matches!(&decoded.payload, Some(Payload::RawBytes(t)) if String::from_utf8_lossy(t).contains("NOT_FOUND: 0000:10:00.0 not found in gpu_to_ifname_map_")),
        "{decoded:?}"
    );
    let reqs = rxdm.stop();
    let lines: Vec<String> = reqs.iter().map(Request::line).collect();
    assert!(lines[0].ends_with("ok nic=eth3 dst_nic=eth3 match"), "{lines:?}");
    assert!(
        lines[1].ends_with("ok nic=eth1 dst_nic=eth3 MISMATCH"),
        "{lines:?}"
    );
    assert!(lines[2].contains("refused not filed"), "{lines:?}");
    assert!(reqs[0].filing.as_ref().unwrap().matches());
    assert!(!reqs[1].filing.as_ref().unwrap().matches());
}

#[test]
fn a3vm_mode_keeps_the_rules_it_holds_for_the_devmem_shim() {
    let dir = tmp("a3vm-rules");
    let nics = vec![
        ("eth1".to_string(), IpAddr::from([10, 0, 1, 1])),
        ("eth3".to_string(), IpAddr::from([10, 0, 3, 1])),
    ];
    let rxdm = FakeRxdm::start_bound(&dir, Answer::Ok, Some(Binding::a3vm(nics)), None).unwrap();
    let read = || std::fs::read_to_string(dir.join(a3vm::RULES_FILE)).unwrap();
    assert_eq!(read(), "nic eth1 10.0.1.1\nnic eth3 10.0.3.1\n");
    // Written before the answer: once the plugin hears "Ok.", the shim finds the rule. Filed
    // under the named GPU's NIC, whatever NIC the flow arrives on; refused ones are not held.
    let (a, b) = (("10.0.1.2:1", "10.0.3.1:2"), ("10.0.1.2:3", "10.0.3.1:4"));
    ask(
        &dir,
        INSTALL_SOCKET,
        &frame(&rule(a.0, a.1, Some("0000:84:00.0"))),
    );
    ask(
        &dir,
        INSTALL_SOCKET,
        &frame(&rule(b.0, b.1, Some("0000:04:00.0"))),
    );
    ask(
        &dir,
        INSTALL_SOCKET,
        &frame(&rule("10.0.1.2:5", "10.0.3.1:6", Some("0000:10:00.0"))),
    );
    assert_eq!(
        read(),
        "nic eth1 10.0.1.1\nnic eth3 10.0.3.1\n\
         rule eth3 0000:84:00.0 10.0.1.2 1 10.0.3.1 2\n\
         rule eth1 0000:04:00.0 10.0.1.2 3 10.0.3.1 4\n"
    );
    ask(&dir, UNINSTALL_SOCKET, &frame(&rule(a.0, a.1, None)));
    assert_eq!(
        read(),
        "nic eth1 10.0.1.1\nnic eth3 10.0.3.1\nrule eth1 0000:04:00.0 10.0.1.2 3 10.0.3.1 4\n"
    );
    rxdm.stop();
}

#[test]
fn a3vm_mode_serves_each_gpus_receive_memory_as_rxdm_does() {
    use std::os::fd::AsRawFd;
    let dir = tmp("gpumem");
    let rxdm = FakeRxdm::start_bound(&dir, Answer::Ok, Some(Binding::a3vm(Vec::new())), None).unwrap();
    let ask_raw = |name: &str| {
        let mut s = UnixStream::connect(dir.join(name)).unwrap();
        s.write_all(&frame(&UnixSocketProto {
            payload: Some(Payload::RawBytes(b"0000:8a:00.0".to_vec())),
        }))
        .unwrap();
        s
    };
    // The fd: one byte with SCM_RIGHTS.
    let s = ask_raw("get_gpu_fd_0000:8a:00.0");
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; 8];
    // SAFETY: a zeroed msghdr over stack buffers alive for the call; the received fd is closed below.
    let fd = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        assert_eq!(libc::recvmsg(s.as_raw_fd(), &mut msg, 0), 1);
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        assert!(!cmsg.is_null());
        assert_eq!((*cmsg).cmsg_type, libc::SCM_RIGHTS);
        std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>())
    };
    // SAFETY: fstat of the fd we were sent, then closed once.
    let size = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(fd, &mut st), 0);
        libc::close(fd);
        st.st_size as usize
    };
    assert_eq!(size, gpumem::GPU_MEM_BYTES);
    // The metadata: {fd, size, align} as raw bytes.
    let mut s = ask_raw("get_gpu_metadata_0000:8a:00.0");
    let body = read_frame(&mut s).unwrap().unwrap();
    let m = UnixSocketProto::decode(body.as_slice()).unwrap();
    assert_eq!(
        m.payload,
        Some(Payload::RawBytes(gpumem::metadata_bytes(
            gpumem::GPU_MEM_BYTES,
            gpumem::GPU_MEM_ALIGN
        )))
    );
    rxdm.stop();
    assert!(!dir.join("get_gpu_fd_0000:8a:00.0").exists());
    assert!(!gpumem::pool_path(&dir, "0000:8a:00.0").exists());
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

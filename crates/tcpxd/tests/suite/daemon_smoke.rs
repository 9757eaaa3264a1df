use crate::common::daemons;
use tcpxd::api::proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_between_two_daemons() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("smoke-a", |_| {}).await;
    let mut b = daemons::start("smoke-b", |_| {}).await;
    let size = 8u64 << 20;
    let host = |size| pb::RegisterBufferRequest {
        reattach_id: Default::default(),
        reattach_key: Default::default(),
        source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
            size,
        })),
        label: String::new(),
    };
    let src = a.client.register_buffer(host(size)).await.unwrap().into_inner();
    let dst = b.client.register_buffer(host(size)).await.unwrap().into_inner();
    a.client
        .fill_buffer(pb::FillBufferRequest {
            buffer_id: src.id,
            offset: 0,
            length: 0,
            pattern: Some(pb::fill_buffer_request::Pattern::Seed(42)),
        })
        .await
        .unwrap();
    let peer = a
        .client
        .connect_peer(pb::ConnectPeerRequest {
            address: b.peer_addr(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(peer.node_id, "smoke-b");
    let started = a
        .client
        .write(pb::WriteRequest {
            entry: Some(pb::WriteEntry {
                local_buffer_id: src.id,
                local_offset: 0,
                remote_descriptor: dst.descriptor.clone(),
                remote_offset: 0,
                length: size,
            }),
            notification: vec![],
            timeout_ms: 30_000,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
        })
        .await
        .unwrap()
        .into_inner();
    let done = a
        .client
        .wait_transfer(pb::WaitTransferRequest {
            transfer_id: started.transfer_id,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.status_code, 0, "{}", done.status_message);
    let crc = |c: &mut tcpxd::api::proto::v1::tcpxd_client::TcpxdClient<_>, id| {
        let mut c = c.clone();
        async move {
            c.checksum_buffer(pb::ChecksumBufferRequest {
                buffer_id: id,
                offset: 0,
                length: 0,
            })
            .await
            .unwrap()
            .into_inner()
            .crc32c
        }
    };
    assert_eq!(crc(&mut a.client, src.id).await, crc(&mut b.client, dst.id).await);
    a.stop().await;
    b.stop().await;
}

//! A generic client, as grpcurl is: it learns the API through server reflection and calls methods
//! with messages built at run time from the fetched descriptors (no compiled stubs).

use crate::common::daemons;
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, Value};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

#[derive(Clone)]
struct DynamicCodec(MessageDescriptor);
struct DynamicEncoder;
struct DynamicDecoder(MessageDescriptor);

impl Codec for DynamicCodec {
    type Encode = DynamicMessage;
    type Decode = DynamicMessage;
    type Encoder = DynamicEncoder;
    type Decoder = DynamicDecoder;
    fn encoder(&mut self) -> DynamicEncoder {
        DynamicEncoder
    }
    fn decoder(&mut self) -> DynamicDecoder {
        DynamicDecoder(self.0.clone())
    }
}

impl Encoder for DynamicEncoder {
    type Item = DynamicMessage;
    type Error = tonic::Status;
    fn encode(&mut self, item: DynamicMessage, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        item.encode(dst)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

impl Decoder for DynamicDecoder {
    type Item = DynamicMessage;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<DynamicMessage>, tonic::Status> {
        DynamicMessage::decode(self.0.clone(), src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

async fn reflect(channel: Channel, req: MessageRequest) -> MessageResponse {
    let mut client = ServerReflectionClient::new(channel);
    let mut stream = client
        .server_reflection_info(tokio_stream::once(ServerReflectionRequest {
            host: String::new(),
            message_request: Some(req),
        }))
        .await
        .expect("reflection call")
        .into_inner();
    stream
        .message()
        .await
        .expect("reflection answer")
        .expect("one message")
        .message_response
        .expect("a response")
}

/// Fetches the files defining `symbol` (with their dependencies) into a descriptor pool.
async fn pool_for(channel: Channel, symbol: &str) -> DescriptorPool {
    let MessageResponse::FileDescriptorResponse(files) =
        reflect(channel, MessageRequest::FileContainingSymbol(symbol.to_string())).await
    else {
        panic!("no file descriptors for {symbol}");
    };
    let file = files
        .file_descriptor_proto
        .iter()
        .map(|b| prost_types::FileDescriptorProto::decode(b.as_slice()).expect("a file descriptor"))
        .collect();
    DescriptorPool::from_file_descriptor_set(prost_types::FileDescriptorSet { file })
        .expect("a consistent pool")
}

async fn call(
    channel: Channel,
    pool: &DescriptorPool,
    method: &str,
    input: DynamicMessage,
) -> DynamicMessage {
    let (service, name) = method.rsplit_once('.').unwrap();
    let m = pool
        .get_service_by_name(service)
        .unwrap_or_else(|| panic!("service {service}"))
        .methods()
        .find(|m| m.name() == name)
        .unwrap_or_else(|| panic!("method {method}"));
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = PathAndQuery::try_from(format!("/{service}/{name}")).unwrap();
    grpc.unary(tonic::Request::new(input), path, DynamicCodec(m.output()))
        .await
        .unwrap_or_else(|s| panic!("{method}: {s}"))
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generic_client_lists_services_and_calls_methods_without_stubs() {
    tcpxd::logging::init("warn");
    let d = daemons::start("reflect-a", |_| {}).await;
    let channel = daemons::unix_channel(d.daemon.api_socket.clone()).await;

    let MessageResponse::ListServicesResponse(list) =
        reflect(channel.clone(), MessageRequest::ListServices(String::new())).await
    else {
        panic!("no service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in [
        "tcpxd.v1.Tcpxd",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
    }

    // RegisterBuffer{host: {size: 65536}, label: "via-reflection"}, built from descriptors.
    let pool = pool_for(channel.clone(), "tcpxd.v1.Tcpxd").await;
    let req_desc = pool
        .get_message_by_name("tcpxd.v1.RegisterBufferRequest")
        .unwrap();
    let host_desc = pool.get_message_by_name("tcpxd.v1.HostAllocation").unwrap();
    let mut host = DynamicMessage::new(host_desc);
    host.set_field_by_name("size", Value::U64(65536));
    let mut req = DynamicMessage::new(req_desc);
    req.set_field_by_name("host", Value::Message(host));
    req.set_field_by_name("label", Value::String("via-reflection".into()));
    let buffer = call(channel.clone(), &pool, "tcpxd.v1.Tcpxd.RegisterBuffer", req).await;
    assert_eq!(buffer.get_field_by_name("size").unwrap().as_u64(), Some(65536));
    let descriptor = buffer
        .get_field_by_name("descriptor")
        .unwrap()
        .as_str()
        .unwrap()
        .to_string();
    assert!(descriptor.starts_with("tcpxd1:reflect-a:"), "{descriptor}");

    // The standard health check answers SERVING.
    let health = pool_for(channel.clone(), "grpc.health.v1.Health").await;
    let check = DynamicMessage::new(
        health
            .get_message_by_name("grpc.health.v1.HealthCheckRequest")
            .unwrap(),
    );
    let resp = call(channel.clone(), &health, "grpc.health.v1.Health.Check", check).await;
    assert_eq!(
        resp.get_field_by_name("status").unwrap().as_enum_number(),
        Some(1),
        "SERVING"
    );

    d.stop().await;
}

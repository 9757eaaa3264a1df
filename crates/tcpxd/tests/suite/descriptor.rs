//! python/src/tcpxd/tcpxd_v1.binpb (the descriptor set the Python package loads) stays in step with
//! proto/tcpxd/v1/tcpxd.proto. `TCPXD_BLESS=1 cargo test -p tcpxd --test suite descriptor::` rewrites it from the
//! compiled proto (protox, as build.rs compiles it; source info dropped, as `make_descriptor.sh`
//! would produce with grpc_tools).

use std::path::Path;

use prost::Message;
use prost_reflect::{DescriptorPool, MessageDescriptor};

fn fields(m: &MessageDescriptor) -> Vec<(u32, String, String, bool)> {
    let mut f: Vec<_> = m
        .fields()
        .map(|f| {
            (
                f.number(),
                f.name().to_string(),
                format!("{:?}", f.kind()),
                f.is_list(),
            )
        })
        .collect();
    f.sort();
    f
}

#[test]
fn the_python_packages_descriptor_set_matches_the_proto() {
    let mut fds = prost_types::FileDescriptorSet::decode(tcpxd::api::proto::FILE_DESCRIPTOR_SET).unwrap();
    fds.file.retain(|f| f.name() == "tcpxd/v1/tcpxd.proto");
    assert_eq!(fds.file.len(), 1);
    for f in &mut fds.file {
        f.source_code_info = None;
    }
    let want = fds.encode_to_vec();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/src/tcpxd/tcpxd_v1.binpb");
    if std::env::var("TCPXD_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &want).unwrap();
    }
    let shipped = std::fs::read(&path).unwrap();
    let a = DescriptorPool::decode(want.as_slice()).unwrap();
    let b = DescriptorPool::decode(shipped.as_slice()).expect("python/src/tcpxd/tcpxd_v1.binpb decodes");
    let stale = "python/src/tcpxd/tcpxd_v1.binpb is stale: regenerate it (TCPXD_BLESS=1 cargo test -p tcpxd --test suite descriptor::, or python/make_descriptor.sh)";
    assert_eq!(a.all_messages().count(), b.all_messages().count(), "{stale}");
    for m in a.all_messages() {
        let n = b
            .get_message_by_name(m.full_name())
            .unwrap_or_else(|| panic!("{}: {stale}", m.full_name()));
        assert_eq!(fields(&m), fields(&n), "{}: {stale}", m.full_name());
    }
    for s in a.services() {
        let t = b.get_service_by_name(s.full_name()).expect(stale);
        let names = |s: &prost_reflect::ServiceDescriptor| {
            s.methods().map(|m| m.name().to_string()).collect::<Vec<_>>()
        };
        assert_eq!(names(&s), names(&t), "{stale}");
    }
}

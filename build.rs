use std::path::PathBuf;

use prost::Message;

fn main() {
    println!("cargo:rerun-if-changed=src/net/logger.c");
    cc::Build::new()
        .file("src/net/logger.c")
        .warnings(true)
        .compile("tcpxd_logger");

    // The API, compiled with protox (a pure-Rust protoc): no system protoc needed.
    println!("cargo:rerun-if-changed=proto");
    let files = ["proto/tcpxd/v1/tcpxd.proto", "proto/tcpxd/peer/v1/peer.proto"];
    let fds = protox::compile(files, ["proto"]).expect("compiling proto/tcpxd/v1");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // Served by gRPC reflection, so grpcurl works without the .proto files.
    std::fs::write(out.join("tcpxd_descriptor.bin"), fds.encode_to_vec())
        .expect("writing the descriptor set");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("generating the gRPC code");
}

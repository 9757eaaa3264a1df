use std::path::PathBuf;

use prost::Message;

fn main() {
    kernels();

    println!("cargo:rerun-if-changed=src/net/logger.c");
    cc::Build::new()
        .file("src/net/logger.c")
        .warnings(true)
        .compile("tcpxd_logger");

    // The API, compiled with protox (a pure-Rust protoc): no system protoc needed.
    // The .proto files stay at the workspace root: the Python client compiles the same ones.
    println!("cargo:rerun-if-changed=../../proto");
    let files = [
        "../../proto/tcpxd/v1/tcpxd.proto",
        "../../proto/tcpxd/peer/v1/peer.proto",
    ];
    let fds = protox::compile(files, ["../../proto"]).expect("compiling proto/tcpxd/v1");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // Served by gRPC reflection, so grpcurl works without the .proto files.
    std::fs::write(out.join("tcpxd_descriptor.bin"), fds.encode_to_vec())
        .expect("writing the descriptor set");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("generating the gRPC code");
}

/// The GPU kernels: compiled to PTX here when nvcc is found (`$NVCC`, `nvcc` on PATH,
/// `/usr/local/cuda/bin/nvcc`), and embedded with `cfg(tcpxd_ptx)`; otherwise only the CUDA
/// sources are embedded and the daemon compiles them with NVRTC at start-up (src/gpu/module.rs).
fn kernels() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rustc-check-cfg=cfg(tcpxd_ptx)");
    let Some(nvcc) = find_nvcc() else {
        // No nvcc: nothing to say (the NVRTC path is the normal one on such machines).
        return;
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    for name in ["unpack", "checksum"] {
        let src = format!("kernels/{name}.cu");
        let ptx = out.join(format!("{name}.ptx"));
        let status = std::process::Command::new(&nvcc)
            .args(["-ptx", "-arch=sm_90", "-O3", "-lineinfo", "-o"])
            .arg(&ptx)
            .arg(&src)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{} failed on {src} ({s})", nvcc.display()),
            Err(e) => panic!("could not run {}: {e}", nvcc.display()),
        }
    }
    println!("cargo:rustc-cfg=tcpxd_ptx");
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| Some(PathBuf::from("/usr/local/cuda/bin/nvcc")).filter(|p| p.is_file()))
}

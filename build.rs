fn main() {
    println!("cargo:rerun-if-changed=src/net/logger.c");
    cc::Build::new()
        .file("src/net/logger.c")
        .warnings(true)
        .compile("tcpxd_logger");
}

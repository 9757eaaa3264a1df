//! Loading errors name what is wrong: a missing file, a file that is no library (with dlerror's
//! text), a library without `ncclNetPlugin_v7`.

use tcpxd::net::{NetError, Plugin};

#[test]
fn missing_file_is_named() {
    let e = Plugin::load("/nonexistent/libnccl-net.so").unwrap_err();
    assert!(matches!(e, NetError::FileMissing { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/libnccl-net.so"), "{e}");
}

#[test]
fn non_library_carries_dlerror_text() {
    let dir = std::env::temp_dir().join(format!("tcpxd-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("libnot-a-plugin.so");
    std::fs::write(&path, b"this is not an ELF file").unwrap();
    let e = Plugin::load(&path).unwrap_err();
    assert!(matches!(e, NetError::NotLoadable { .. }), "{e}");
    // dlerror says why, e.g. "invalid ELF header" or "file too short".
    let text = e.to_string();
    assert!(text.contains("ELF") || text.contains("too short"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn library_without_the_v7_symbol_is_refused() {
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("libm present on Linux");
    let e = Plugin::load(libm).unwrap_err();
    assert!(matches!(e, NetError::SymbolMissing { .. }), "{e}");
    assert!(e.to_string().contains("ncclNetPlugin_v7"), "{e}");
}

#[test]
fn the_emulation_library_exports_its_table() {
    let path = tcpxd_testkit::emulation_plugin_path();
    let plugin = Plugin::load(&path).expect("emulation loads");
    assert!(!plugin.devices().is_empty());
    assert!(
        plugin
            .devices()
            .iter()
            .all(|d| d.uses_unpack() && d.net_device_version == 7)
    );
}

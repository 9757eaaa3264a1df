//! Loading a `ncclNetPlugin_v7` (from a shared library with libloading, or an in-process table),
//! initialising it once, and querying its devices.

use std::ffi::{CStr, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::abi::{self, ncclNet_v7_t, ncclNetProperties_v7_t};
use super::error::{NetError, NetResult};
use super::logger;

/// The plugin-internal chunk size GCP uses; set before `init` when the environment has none,
/// because the plugin's effective default (0) makes nothing progress.
pub const DEFAULT_DYNAMIC_CHUNK_SIZE: &str = "524288";

/// Where a plugin's table came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginSource {
    /// A shared library loaded by path.
    Library(PathBuf),
    /// A table linked into this process (the built-in emulation).
    InProcess(&'static str),
}

impl std::fmt::Display for PluginSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PluginSource::Library(p) => write!(f, "{}", p.display()),
            PluginSource::InProcess(name) => write!(f, "in-process {name}"),
        }
    }
}

/// What a device reports through `getProperties`, owned.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProperties {
    pub dev: i32,
    pub name: String,
    pub pci_path: Option<String>,
    pub guid: u64,
    pub ptr_support: i32,
    pub speed_mbps: i32,
    pub port: i32,
    pub latency: f32,
    pub max_comms: i32,
    pub max_recvs: i32,
    pub net_device_type: i32,
    pub net_device_version: i32,
}

impl DeviceProperties {
    pub fn supports_host(&self) -> bool {
        self.ptr_support & abi::NCCL_PTR_HOST != 0
    }
    pub fn supports_cuda(&self) -> bool {
        self.ptr_support & abi::NCCL_PTR_CUDA != 0
    }
    /// True when received CUDA data lands in a bounce buffer and must be unpacked.
    pub fn uses_unpack(&self) -> bool {
        self.net_device_type == abi::NCCL_NET_DEVICE_UNPACK
    }
}

/// An initialised plugin. Comms keep it alive through an `Arc`.
pub struct Plugin {
    pub(super) table: ncclNet_v7_t,
    name: String,
    source: PluginSource,
    devices: Vec<DeviceProperties>,
    // Kept last so it unloads after everything above; `None` for in-process tables.
    _library: Option<libloading::Library>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.name)
            .field("source", &self.source)
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl Plugin {
    /// Loads the plugin at `path`, checks its table, applies [`PLUGIN_DEFAULTS`] where unset,
    /// calls `init` with tcpxd's logger and reads every device's properties.
    pub fn load(path: impl AsRef<Path>) -> NetResult<Arc<Plugin>> {
        let path = path.as_ref().to_path_buf();
        if !path.exists() {
            return Err(NetError::FileMissing { path });
        }
        // SAFETY: loading a shared library runs its initialisers; that is the point of a plugin
        // path the operator named. Nothing else in the process is touched.
        let library = unsafe { libloading::Library::new(&path) }.map_err(|e| NetError::NotLoadable {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        // SAFETY: `ncclNetPlugin_v7` is a data symbol of type `ncclNet_v7_t`; we take its address.
        let table_ptr: *const ncclNet_v7_t =
            unsafe { library.get::<*const ncclNet_v7_t>(abi::PLUGIN_SYMBOL_V7) }
                .map(|sym| *sym)
                .map_err(|e| NetError::SymbolMissing {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
        if table_ptr.is_null() {
            return Err(NetError::SymbolMissing {
                path,
                reason: "the symbol's address is NULL".into(),
            });
        }
        // SAFETY: the symbol points at the plugin's static table, valid while `library` is loaded;
        // we copy it (19 pointers) and keep the library loaded as long as the copy lives.
        let table = unsafe { *table_ptr };
        Self::start(table, PluginSource::Library(path), Some(library))
    }

    /// Uses a table linked into this process.
    pub fn from_table(table: &'static ncclNet_v7_t, label: &'static str) -> NetResult<Arc<Plugin>> {
        Self::start(*table, PluginSource::InProcess(label), None)
    }

    /// The emulation plugin linked into tcpxd (the same code as `libnccl_net_tcpxemu.so`).
    pub fn builtin_emulation() -> NetResult<Arc<Plugin>> {
        // A line the logger would drop unformatted (`logger.rs`, `tcpxd_plugin_log_skip`: a
        // trace line while nothing records them) is not formatted by the emulation either.
        nccl_net_tcpxemu::set_log_gate(Some(super::logger::keeps));
        // One ABI crate serves both sides: the emulation's table is this `ncclNet_v7_t`.
        Self::from_table(nccl_net_tcpxemu::plugin_table(), "tcpxemu")
    }

    fn start(
        table: ncclNet_v7_t,
        source: PluginSource,
        library: Option<libloading::Library>,
    ) -> NetResult<Arc<Plugin>> {
        let name = if table.name.is_null() {
            "(unnamed)".to_string()
        } else {
            // SAFETY: the table's `name` is a static NUL-terminated string of the plugin's.
            unsafe { CStr::from_ptr(table.name) }
                .to_string_lossy()
                .into_owned()
        };
        check_table(&table, &name)?;
        apply_plugin_defaults();

        let mut plugin = Plugin {
            table,
            name,
            source,
            devices: Vec::new(),
            _library: library,
        };
        let init = plugin.table.init.expect("checked");
        let mark = logger::mark();
        // SAFETY: `init` takes the logger function pointer; our shim is valid for the process.
        let rc = unsafe { init(logger::logger_fn()) };
        plugin.check(rc, "init", mark)?;

        let mut ndev: c_int = 0;
        let mark = logger::mark();
        // SAFETY: `devices` writes one int through the pointer we pass.
        let rc = unsafe { plugin.table.devices.expect("checked")(&mut ndev) };
        plugin.check(rc, "devices", mark)?;
        for dev in 0..ndev {
            let props = plugin.query_properties(dev)?;
            if props.uses_unpack() && props.net_device_version != abi::NCCL_NET_DEVICE_UNPACK_VERSION {
                return Err(NetError::DeviceVersion {
                    plugin: plugin.name.clone(),
                    dev,
                    found: props.net_device_version,
                    expected: abi::NCCL_NET_DEVICE_UNPACK_VERSION,
                });
            }
            plugin.devices.push(props);
        }
        tracing::info!(
            plugin = %plugin.name,
            source = %plugin.source,
            devices = plugin.devices.len(),
            "net plugin initialised"
        );
        Ok(Arc::new(plugin))
    }

    fn query_properties(&self, dev: i32) -> NetResult<DeviceProperties> {
        let mut raw = std::mem::MaybeUninit::<ncclNetProperties_v7_t>::zeroed();
        let mark = logger::mark();
        // SAFETY: `getProperties` fills the 56-byte struct we pass; it starts zeroed.
        let rc = unsafe { self.table.getProperties.expect("checked")(dev, raw.as_mut_ptr()) };
        self.check(rc, "getProperties", mark)?;
        // SAFETY: zero-initialised and then written by the plugin; every field is plain data.
        let raw = unsafe { raw.assume_init() };
        Ok(DeviceProperties {
            dev,
            name: c_string(raw.name).unwrap_or_default(),
            pci_path: c_string(raw.pciPath),
            guid: raw.guid,
            ptr_support: raw.ptrSupport,
            speed_mbps: raw.speed,
            port: raw.port,
            latency: raw.latency,
            max_comms: raw.maxComms,
            max_recvs: raw.maxRecvs,
            net_device_type: raw.netDeviceType,
            net_device_version: raw.netDeviceVersion,
        })
    }

    /// The plugin's own name (`ncclNet_v7_t::name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn source(&self) -> &PluginSource {
        &self.source
    }

    /// Properties of every device, indexed by device number.
    pub fn devices(&self) -> &[DeviceProperties] {
        &self.devices
    }

    pub fn device(&self, dev: i32) -> NetResult<&DeviceProperties> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| {
                NetError::InvalidArgument(format!(
                    "device {dev} does not exist (the plugin has {} devices)",
                    self.devices.len()
                ))
            })
    }

    /// Turns a plugin return code into a result carrying the lines logged since `mark`.
    pub(super) fn check(&self, rc: abi::ncclResult_t, call: &'static str, mark: u64) -> NetResult<()> {
        if rc == abi::NCCL_SUCCESS {
            Ok(())
        } else {
            Err(NetError::Plugin {
                call,
                code: rc,
                lines: logger::lines_since(mark),
            })
        }
    }
}

fn check_table(table: &ncclNet_v7_t, plugin: &str) -> NetResult<()> {
    let required: [(&'static str, bool); 16] = [
        ("init", table.init.is_some()),
        ("devices", table.devices.is_some()),
        ("getProperties", table.getProperties.is_some()),
        ("listen", table.listen.is_some()),
        ("connect", table.connect.is_some()),
        ("accept", table.accept.is_some()),
        ("regMr", table.regMr.is_some()),
        ("deregMr", table.deregMr.is_some()),
        ("isend", table.isend.is_some()),
        ("irecv", table.irecv.is_some()),
        ("test", table.test.is_some()),
        ("closeSend", table.closeSend.is_some()),
        ("closeRecv", table.closeRecv.is_some()),
        ("closeListen", table.closeListen.is_some()),
        ("irecvConsumed", table.irecvConsumed.is_some()),
        ("name", !table.name.is_null()),
    ];
    match required.iter().find(|(_, present)| !present) {
        Some((function, _)) => Err(NetError::MissingFunction {
            plugin: plugin.to_string(),
            function,
        }),
        None => Ok(()),
    }
}

/// GCP's recommended TCPX settings, as shipped in deploy/systemd/tcpx.env (what `tcpxd doctor`
/// checks the environment against).
pub const RECOMMENDED_ENV: &str = include_str!("../../../../deploy/systemd/tcpx.env");

/// GCP's recommended TCPX plugin settings that tcpxd applies before `init` when the environment
/// has no value (deploy/systemd/tcpx.env has the same values): the plugin's own defaults make no
/// progress (`NCCL_DYNAMIC_CHUNK_SIZE` 0) or halve the throughput (one socket per comm).
pub const PLUGIN_DEFAULTS: [(&str, &str); 3] = [
    ("NCCL_DYNAMIC_CHUNK_SIZE", DEFAULT_DYNAMIC_CHUNK_SIZE),
    ("NCCL_NSOCKS_PERTHREAD", "4"),
    ("NCCL_SOCKET_NTHREADS", "1"),
];

/// The [`PLUGIN_DEFAULTS`] that `var` (an environment lookup) has no value for.
pub fn missing_plugin_defaults(
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Vec<(&'static str, &'static str)> {
    PLUGIN_DEFAULTS
        .iter()
        .copied()
        .filter(|(k, _)| var(k).is_none())
        .collect()
}

/// Sets each of [`PLUGIN_DEFAULTS`] the environment has no value for, and says which it set.
fn apply_plugin_defaults() {
    let missing = missing_plugin_defaults(|k| std::env::var_os(k));
    for (k, v) in &missing {
        // SAFETY: environment writes race only with concurrent C `getenv` calls; this runs before
        // the plugin's `init`, i.e. before any plugin thread exists, and tcpxd loads its plugin at
        // start-up. Rust-side readers are serialised by std's environment lock.
        unsafe { std::env::set_var(k, v) };
    }
    if !missing.is_empty() {
        let set: Vec<String> = missing.iter().map(|(k, v)| format!("{k}={v}")).collect();
        tracing::info!(
            "TCPX plugin settings were unset; applied GCP's recommendation: {}",
            set.join(", ")
        );
    }
}

fn c_string(p: *mut std::ffi::c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: the plugin hands out NUL-terminated strings that outlive the call.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// Keeps raw `*mut c_void` comm pointers nameable in this module's children.
pub(super) type RawComm = *mut c_void;

#[cfg(test)]
mod tests {
    use std::ffi::c_char;

    use super::*;
    use crate::net::abi::*;

    static INIT_FAILS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    unsafe extern "C" fn init(log: ncclDebugLogger_t) -> ncclResult_t {
        if INIT_FAILS.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: calling the logger the way a C plugin does: a format and matching arguments.
            unsafe {
                log.expect("logger")(
                    NCCL_LOG_WARN,
                    NCCL_NET,
                    c"fake.cc".as_ptr(),
                    42,
                    c"cannot reach RxDM at %s (errno %d)".as_ptr(),
                    c"/run/tcpx".as_ptr(),
                    111 as c_int,
                )
            };
            return NCCL_SYSTEM_ERROR;
        }
        NCCL_SUCCESS
    }
    unsafe extern "C" fn devices(n: *mut c_int) -> ncclResult_t {
        // SAFETY: the loader passes a valid int.
        unsafe { *n = 1 };
        NCCL_SUCCESS
    }
    unsafe extern "C" fn properties_v6(_dev: c_int, p: *mut ncclNetProperties_v7_t) -> ncclResult_t {
        // SAFETY: the loader passes a zeroed properties struct.
        unsafe {
            (*p).name = c"fake0".as_ptr() as *mut c_char;
            (*p).netDeviceType = NCCL_NET_DEVICE_UNPACK;
            (*p).netDeviceVersion = 6;
            (*p).maxRecvs = 1;
        }
        NCCL_SUCCESS
    }
    unsafe extern "C" fn properties_v7(dev: c_int, p: *mut ncclNetProperties_v7_t) -> ncclResult_t {
        // SAFETY: as above.
        unsafe {
            properties_v6(dev, p);
            (*p).netDeviceVersion = NCCL_NET_DEVICE_UNPACK_VERSION;
        }
        NCCL_SUCCESS
    }
    unsafe extern "C" fn listen(_: c_int, _: *mut c_void, _: *mut *mut c_void) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn connect(
        _: c_int,
        _: *mut c_void,
        _: *mut *mut c_void,
        _: *mut *mut ncclNetDeviceHandle_v7_t,
    ) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn accept(
        _: *mut c_void,
        _: *mut *mut c_void,
        _: *mut *mut ncclNetDeviceHandle_v7_t,
    ) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn reg_mr(
        _: *mut c_void,
        _: *mut c_void,
        _: c_int,
        _: c_int,
        _: *mut *mut c_void,
    ) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn dereg_mr(_: *mut c_void, _: *mut c_void) -> ncclResult_t {
        NCCL_SUCCESS
    }
    unsafe extern "C" fn isend(
        _: *mut c_void,
        _: *mut c_void,
        _: c_int,
        _: c_int,
        _: *mut c_void,
        _: *mut *mut c_void,
    ) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn irecv(
        _: *mut c_void,
        _: c_int,
        _: *mut *mut c_void,
        _: *mut c_int,
        _: *mut c_int,
        _: *mut *mut c_void,
        _: *mut *mut c_void,
    ) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn test(_: *mut c_void, _: *mut c_int, _: *mut c_int) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }
    unsafe extern "C" fn close(_: *mut c_void) -> ncclResult_t {
        NCCL_SUCCESS
    }
    unsafe extern "C" fn consumed(_: *mut c_void, _: c_int, _: *mut c_void) -> ncclResult_t {
        NCCL_INTERNAL_ERROR
    }

    fn table(props: GetPropertiesFn) -> ncclNet_v7_t {
        ncclNet_v7_t {
            name: c"fake_v7".as_ptr(),
            init: Some(init),
            devices: Some(devices),
            getProperties: Some(props),
            listen: Some(listen),
            connect: Some(connect),
            accept: Some(accept),
            regMr: Some(reg_mr),
            regMrDmaBuf: None,
            deregMr: Some(dereg_mr),
            isend: Some(isend),
            irecv: Some(irecv),
            iflush: None,
            test: Some(test),
            closeSend: Some(close),
            closeRecv: Some(close),
            closeListen: Some(close),
            getDeviceMr: None,
            irecvConsumed: Some(consumed),
        }
    }

    fn leak(t: ncclNet_v7_t) -> &'static ncclNet_v7_t {
        Box::leak(Box::new(t))
    }

    // One test drives the fake plugin through every outcome in sequence, because `init`'s failure
    // switch is process-wide.
    #[test]
    fn fake_tables_are_checked_and_init_errors_carry_the_plugin_words() {
        let p = Plugin::from_table(leak(table(properties_v7)), "fake").expect("a good table loads");
        assert_eq!(p.name(), "fake_v7");
        assert_eq!(p.devices().len(), 1);
        assert_eq!(p.devices()[0].name, "fake0");
        assert!(p.device(1).is_err());

        let e = Plugin::from_table(leak(table(properties_v6)), "fake").unwrap_err();
        assert!(
            matches!(
                e,
                NetError::DeviceVersion {
                    found: 6,
                    expected: 7,
                    ..
                }
            ),
            "{e}"
        );

        let mut t = table(properties_v7);
        t.irecvConsumed = None;
        let e = Plugin::from_table(leak(t), "fake").unwrap_err();
        assert!(
            matches!(
                e,
                NetError::MissingFunction {
                    function: "irecvConsumed",
                    ..
                }
            ),
            "{e}"
        );

        INIT_FAILS.store(true, std::sync::atomic::Ordering::SeqCst);
        let e = Plugin::from_table(leak(table(properties_v7)), "fake").unwrap_err();
        INIT_FAILS.store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(e.plugin_code(), Some(NCCL_SYSTEM_ERROR));
        let text = e.to_string();
        assert!(text.contains("init failed with ncclSystemError"), "{text}");
        assert!(
            text.contains("cannot reach RxDM at /run/tcpx (errno 111)"),
            "{text}"
        );
    }

    #[test]
    fn plugin_defaults_fill_only_what_is_unset() {
        let env = |set: &'static [(&'static str, &'static str)]| {
            move |k: &str| set.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).into())
        };
        assert_eq!(missing_plugin_defaults(env(&[])), PLUGIN_DEFAULTS.to_vec());
        assert_eq!(
            missing_plugin_defaults(env(&[
                ("NCCL_NSOCKS_PERTHREAD", "2"),
                ("NCCL_DYNAMIC_CHUNK_SIZE", "1")
            ])),
            vec![("NCCL_SOCKET_NTHREADS", "1")]
        );
        let all: &'static [(&'static str, &'static str)] = &PLUGIN_DEFAULTS;
        assert!(missing_plugin_defaults(env(all)).is_empty());
        // The values are GCP's, as deploy/systemd/tcpx.env writes them.
        let rec = RECOMMENDED_ENV;
        for (k, v) in PLUGIN_DEFAULTS {
            assert!(
                rec.lines().any(|l| l == format!("{k}={v}")),
                "{k}={v} not in tcpx.env"
            );
        }
    }
}

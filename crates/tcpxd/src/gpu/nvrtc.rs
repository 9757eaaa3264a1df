//! A minimal NVRTC binding loaded with libloading. cudarc's own loader panics when the library
//! is missing and looks only for CUDA 12 and older file names; this one tries the names CUDA
//! 11–13 install and reports a missing library as an error.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use super::error::{GpuError, GpuResult};

type Program = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// What NVRTC produced.
pub(crate) enum Output {
    Ptx,
    Cubin,
}

fn candidates() -> Vec<String> {
    let names = [
        "libnvrtc.so",
        "libnvrtc.so.13",
        "libnvrtc.so.12",
        "libnvrtc.so.11.2",
    ];
    let mut dirs: Vec<String> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            dirs.push(format!("{d}/lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    let mut out: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    for d in dirs {
        out.extend(names.iter().map(|n| format!("{d}/{n}")));
    }
    out
}

/// Compiles `source` (no headers) for `arch` (`compute_90` for PTX, `sm_90` for a cubin).
pub(crate) fn compile(source: &str, name: &str, arch: &str, output: Output) -> GpuResult<(Vec<u8>, String)> {
    let lib = candidates()
        .into_iter()
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        .find_map(|c| unsafe { libloading::Library::new(&c) }.ok().map(|l| (l, c)));
    let Some((lib, path)) = lib else {
        return Err(GpuError::Kernels(format!(
            "no embedded PTX (built without nvcc) and NVRTC not found (tried {}); \
             install the CUDA toolkit's libnvrtc or build tcpxd where nvcc is available",
            candidates().join(", ")
        )));
    };
    let sym = |n: &[u8]| -> GpuResult<*const c_void> {
        // SAFETY: looks a symbol up by name; used below with the signature NVRTC documents.
        unsafe { lib.get::<*const c_void>(n) }
            .map(|s| *s)
            .map_err(|e| GpuError::Kernels(format!("{path}: {e}")))
    };
    // SAFETY: each symbol is the NVRTC function of that name, whose C signature the types mirror.
    let (create, compile, ptx_size, ptx, log_size, log, destroy, version) = unsafe {
        let (size_name, get_name): (&[u8], &[u8]) = match output {
            Output::Ptx => (b"nvrtcGetPTXSize\0", b"nvrtcGetPTX\0"),
            Output::Cubin => (b"nvrtcGetCUBINSize\0", b"nvrtcGetCUBIN\0"),
        };
        (
            std::mem::transmute::<*const c_void, CreateFn>(sym(b"nvrtcCreateProgram\0")?),
            std::mem::transmute::<*const c_void, CompileFn>(sym(b"nvrtcCompileProgram\0")?),
            std::mem::transmute::<*const c_void, SizeFn>(sym(size_name)?),
            std::mem::transmute::<*const c_void, GetFn>(sym(get_name)?),
            std::mem::transmute::<*const c_void, SizeFn>(sym(b"nvrtcGetProgramLogSize\0")?),
            std::mem::transmute::<*const c_void, GetFn>(sym(b"nvrtcGetProgramLog\0")?),
            std::mem::transmute::<*const c_void, DestroyFn>(sym(b"nvrtcDestroyProgram\0")?),
            std::mem::transmute::<*const c_void, VersionFn>(sym(b"nvrtcVersion\0")?),
        )
    };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { version(&mut major, &mut minor) };
    let src = CString::new(source).map_err(|_| GpuError::Kernels("kernel source contains NUL".into()))?;
    let cname = CString::new(name).expect("static name");
    let opts: Vec<CString> = [
        format!("-arch={arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
        "-lineinfo".into(),
    ]
    .into_iter()
    .map(|o| CString::new(o).expect("static option"))
    .collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; no headers.
    let rc = unsafe {
        create(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(GpuError::Kernels(format!("nvrtcCreateProgram failed ({rc})")));
    }
    // SAFETY: a live program and valid option strings.
    let rc = unsafe { compile(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let read = |size_fn: SizeFn, get_fn: GetFn| -> Vec<u8> {
        let mut n = 0usize;
        // SAFETY: writes one size for a live program.
        unsafe { size_fn(prog, &mut n) };
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
            unsafe { get_fn(prog, buf.as_mut_ptr().cast()) };
        }
        buf
    };
    let log_bytes = read(log_size, log);
    let log_text = CStr::from_bytes_until_nul(&log_bytes)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    let result = if rc != 0 {
        Err(GpuError::Kernels(format!(
            "NVRTC {major}.{minor} ({path}) could not compile {name} for {arch}: {}",
            log_text.trim()
        )))
    } else {
        Ok((read(ptx_size, ptx), format!("NVRTC {major}.{minor} ({path})")))
    };
    // SAFETY: destroys the program created above, once.
    unsafe { destroy(&mut prog) };
    result
}

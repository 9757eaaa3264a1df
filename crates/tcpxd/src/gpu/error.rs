//! Errors of the GPU layer.

use cudarc::driver::sys;

/// What went wrong in the GPU layer. Every CUDA failure names the call that failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No CUDA driver library on this machine.
    #[error("CUDA driver not found (libcuda.so): the GPU data path is unavailable on this machine")]
    DriverNotFound,
    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code}): {message}")]
    Driver {
        call: &'static str,
        code: i32,
        name: String,
        message: String,
    },
    /// The ordinal names no device.
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice { ordinal: usize, count: usize },
    /// The kernels could not be built or loaded.
    #[error("GPU kernels: {0}")]
    Kernels(String),
    /// A caller's argument is out of range (the message names it).
    #[error("{0}")]
    InvalidArgument(String),
}

pub type GpuResult<T> = Result<T, GpuError>;

/// The name and description the driver gives for `code`.
fn describe(code: sys::CUresult) -> (String, String) {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string owned by the driver (or leave
    // it NULL for an unknown code); the strings are read once, below, while the library is loaded.
    unsafe {
        sys::cuGetErrorName(code, &mut name);
        sys::cuGetErrorString(code, &mut text);
    }
    let read = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::from("unknown CUDA error")
        } else {
            // SAFETY: a non-NULL result is a NUL-terminated static string of the driver.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        }
    };
    (read(name), read(text))
}

/// Turns a driver status into a result naming `call`.
pub(crate) fn check(call: &'static str, code: sys::CUresult) -> GpuResult<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, message) = describe(code);
    Err(GpuError::Driver {
        call,
        code: code as i32,
        name,
        message,
    })
}

impl GpuError {
    /// The driver's status code, for a driver failure.
    pub fn driver_code(&self) -> Option<i32> {
        match self {
            GpuError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

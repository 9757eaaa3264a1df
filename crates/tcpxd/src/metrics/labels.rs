//! The label values of the event series (op, size class, status, plugin error code) and the
//! histograms' buckets.

use crate::engine::Code;

/// Which way a transfer moves data, from the initiator's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

/// The `size_class` label of a transfer of `bytes`.
pub fn size_class(bytes: u64) -> &'static str {
    SIZE_CLASSES[size_class_index(bytes)]
}

/// Every `size_class` label, smallest first.
pub const SIZE_CLASSES: [&str; 5] = ["lt_64k", "64k_1m", "1m_16m", "16m_256m", "ge_256m"];

/// Where [`size_class`]'s label of `bytes` stands in [`SIZE_CLASSES`].
pub fn size_class_index(bytes: u64) -> usize {
    match bytes {
        b if b < 64 << 10 => 0,
        b if b < 1 << 20 => 1,
        b if b < 16 << 20 => 2,
        b if b < 256 << 20 => 3,
        _ => 4,
    }
}

/// The `status` label of an outcome code.
pub fn status_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
    }
}

/// Every outcome code, for the series exported from 0.
pub(super) const ALL_CODES: [Code; 12] = [
    Code::Ok,
    Code::Cancelled,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::Internal,
    Code::Unavailable,
];

/// The `code` labels of `tcpxd_plugin_errors_total`: the ncclResult_t errors, a timeout, other.
pub(super) const PLUGIN_ERROR_CODES: [&str; 8] = [
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidArgument",
    "ncclInvalidUsage",
    "ncclRemoteError",
    "timeout",
    "other",
];

/// Transfer latency buckets, seconds: 100 µs to ~100 s.
pub(super) const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 100.0,
];
/// Per-chunk buckets, seconds: 1 µs to 1 s.
pub(super) const CHUNK_BUCKETS: &[f64] = &[
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.1, 1.0,
];

//! The engine's error type: a status code (the gRPC code set, mapped 1:1 at the API edge) and a
//! message that names the field at fault and the limit it broke.

/// Status codes the engine produces (google.rpc.Code numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    Internal = 13,
    Unavailable = 14,
}

impl Code {
    pub fn from_i32(v: i32) -> Code {
        match v {
            0 => Code::Ok,
            1 => Code::Cancelled,
            3 => Code::InvalidArgument,
            4 => Code::DeadlineExceeded,
            5 => Code::NotFound,
            6 => Code::AlreadyExists,
            7 => Code::PermissionDenied,
            8 => Code::ResourceExhausted,
            9 => Code::FailedPrecondition,
            10 => Code::Aborted,
            14 => Code::Unavailable,
            _ => Code::Internal,
        }
    }
}

/// A failed request or transfer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EngineError {
    pub code: Code,
    pub message: String,
    /// Refused only because the pairing with this node closed when idle or is closing
    /// (`pair_life.rs`): the caller pairs with the node again and retries (a transfer never
    /// fails because its pairing had been closed).
    pub closed_pairing: Option<String>,
}

impl EngineError {
    pub fn new(code: Code, message: impl Into<String>) -> EngineError {
        EngineError {
            code,
            message: message.into(),
            closed_pairing: None,
        }
    }
    /// UNAVAILABLE, refused because the pairing with `node` closed when idle (or is closing).
    pub fn pairing_closed(node: &str, message: impl Into<String>) -> EngineError {
        EngineError {
            closed_pairing: Some(node.to_string()),
            ..Self::new(Code::Unavailable, message)
        }
    }
    pub fn invalid(message: impl Into<String>) -> EngineError {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> EngineError {
        Self::new(Code::NotFound, message)
    }
}

pub type EngineResult<T> = Result<T, EngineError>;

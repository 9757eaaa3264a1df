//! Connecting to a tcpxd daemon's client API, and the size/rate and index helpers the CLI shares.
//!
//! Endpoints come in two families:
//!
//! * a unix domain socket: `unix:/path`, `unix:///path`, `unix:relative/path` or a plain path
//!   (`/path`, `./path`, `../path`);
//! * TCP: `http://host:port`, `https://host:port` or a bare `host:port` (taken as `http://`).
//!
//! The default is [`DEFAULT_ENDPOINT`]; [`endpoint_from_env`] reads `TCPXD_ENDPOINT` first.
//!
//! A daemon's TCP listener requires a bearer token: calls over TCP carry the token read from the
//! file named by `TCPXD_API_TOKEN_FILE` (the same setting the daemon reads).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Uri};

use tcpxd::api::proto::v1::tcpxd_client::TcpxdClient;
use tcpxd::api::proto::v1::{self as pb, BlockIndices};
use tcpxd::engine::blocks::{IndexArray, IndexEncoding};

/// An index array as the API's message (block transfers: the CLI's commands and the bench).
pub fn pack_indices(a: &IndexArray) -> BlockIndices {
    BlockIndices {
        encoding: match a.encoding() {
            IndexEncoding::U32Le => pb::IndexEncoding::U32,
            IndexEncoding::Ranges => pb::IndexEncoding::Ranges,
        } as i32,
        data: a.bytes().to_vec(),
    }
}

/// Where the daemon serves its client API unless told otherwise.
pub const DEFAULT_ENDPOINT: &str = "unix:/run/tcpxd/tcpxd.sock";

/// The environment variable that overrides [`DEFAULT_ENDPOINT`].
pub const ENDPOINT_ENV: &str = "TCPXD_ENDPOINT";

/// The file holding the bearer token for TCP endpoints.
pub const TOKEN_FILE_ENV: &str = "TCPXD_API_TOKEN_FILE";

/// Puts the bearer token, when there is one, on every call.
#[derive(Clone, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A client of a daemon's API, as [`connect`] makes it.
pub type ApiClient = TcpxdClient<InterceptedService<Channel, BearerToken>>;

/// How long a TCP connect may take before [`connect`] gives up.
const TCP_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why [`connect`] failed. Every variant names the endpoint it was given.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint string is not one of the accepted forms.
    #[error("invalid endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    /// The token file named by `TCPXD_API_TOKEN_FILE` is unusable.
    #[error("{endpoint}: {reason}")]
    Token { endpoint: String, reason: String },
    /// The endpoint parsed but the connection failed.
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect {
        endpoint: String,
        /// The whole error chain, flattened into one line.
        reason: String,
        source: tonic::transport::Error,
    },
}

impl ClientError {
    /// The endpoint the error is about.
    pub fn endpoint(&self) -> &str {
        match self {
            ClientError::InvalidEndpoint { endpoint, .. }
            | ClientError::Connect { endpoint, .. }
            | ClientError::Token { endpoint, .. } => endpoint,
        }
    }
}

/// A parsed endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A unix domain socket path.
    Unix(PathBuf),
    /// A TCP endpoint, as an `http://` or `https://` URI.
    Tcp(String),
}

impl Endpoint {
    /// Parses one of the accepted endpoint forms (see the module docs).
    pub fn parse(endpoint: &str) -> Result<Endpoint, ClientError> {
        let invalid = |reason: &str| ClientError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            reason: reason.to_string(),
        };
        let s = endpoint.trim();
        if s.is_empty() {
            return Err(invalid("empty"));
        }
        if let Some(rest) = s.strip_prefix("unix:") {
            // gRPC naming: unix:path (relative or absolute) and unix:///absolute.
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(invalid("no socket path after unix:"));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if s.starts_with('/') || s.starts_with("./") || s.starts_with("../") {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        let uri = if s.starts_with("http://") || s.starts_with("https://") {
            s.to_string()
        } else if s.contains("://") {
            return Err(invalid(
                "unknown scheme (use unix:/path, /path, host:port, http://host:port or https://host:port)",
            ));
        } else {
            format!("http://{s}")
        };
        let parsed: Uri = uri
            .parse()
            .map_err(|e| invalid(&format!("not a valid URI: {e}")))?;
        if parsed.host().is_none_or(str::is_empty) {
            return Err(invalid("no host"));
        }
        if parsed.port_u16().is_none() {
            return Err(invalid(
                "no port (use host:port; a path needs unix: or a leading /)",
            ));
        }
        Ok(Endpoint::Tcp(uri))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "unix:{}", path.display()),
            Endpoint::Tcp(uri) => f.write_str(uri),
        }
    }
}

/// The endpoint to use when none was given: `TCPXD_ENDPOINT`, else [`DEFAULT_ENDPOINT`].
pub fn endpoint_from_env() -> String {
    match std::env::var(ENDPOINT_ENV) {
        Ok(v) if !v.trim().is_empty() => v,
        _ => DEFAULT_ENDPOINT.to_string(),
    }
}

/// Connects to a daemon's client API. The connection is made eagerly, so a daemon that is not
/// there is reported here, with the endpoint named.
pub async fn connect(endpoint: &str) -> Result<ApiClient, ClientError> {
    let (channel, token) = connect_channel(endpoint).await?;
    Ok(TcpxdClient::with_interceptor(channel, token)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

/// Largest message either way, as the daemon's own limit (64 MiB): a block transfer naming
/// 1,000,000 scattered blocks a side fits.
pub const MAX_MESSAGE: usize = 64 << 20;

/// Connects to a daemon's client API endpoint and returns the channel with the bearer token
/// that must go on every call over TCP (for other services on it, such as gRPC health).
pub async fn connect_channel(endpoint: &str) -> Result<(Channel, BearerToken), ClientError> {
    let parsed = Endpoint::parse(endpoint)?;
    let mut token = BearerToken::default();
    if let (Endpoint::Tcp(_), Some(path)) = (&parsed, std::env::var_os(TOKEN_FILE_ENV)) {
        let bad = |reason: String| ClientError::Token {
            endpoint: endpoint.to_string(),
            reason,
        };
        let t = tcpxd::auth::ApiToken::load(std::path::Path::new(&path))
            .map_err(|e| bad(format!("{TOKEN_FILE_ENV}: {e}")))?;
        token = BearerToken(Some(
            t.header_value()
                .map_err(|e| bad(format!("{TOKEN_FILE_ENV}: {e}")))?,
        ));
    }
    let connected = match parsed {
        Endpoint::Unix(path) => {
            let path = Arc::new(path);
            // The URI is required by tonic but unused: the connector ignores it.
            tonic::transport::Endpoint::from_static("http://[::]:50051")
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = Arc::clone(&path);
                    async move {
                        let stream = tokio::net::UnixStream::connect(path.as_path()).await?;
                        Ok::<_, std::io::Error>(TokioIo::new(stream))
                    }
                }))
                .await
        }
        Endpoint::Tcp(uri) => {
            let ep =
                tonic::transport::Endpoint::from_shared(uri).map_err(|e| ClientError::InvalidEndpoint {
                    endpoint: endpoint.to_string(),
                    reason: error_chain(&e),
                })?;
            ep.connect_timeout(TCP_CONNECT_TIMEOUT).connect().await
        }
    };
    let channel = connected.map_err(|source| ClientError::Connect {
        endpoint: endpoint.to_string(),
        reason: error_chain(&source),
        source,
    })?;
    Ok((channel, token))
}

/// An error and its sources on one line (`a: b: c`), skipping a source that repeats its parent.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut last = out.clone();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        if !s.is_empty() && !last.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        last = s;
        cur = e.source();
    }
    out
}

/// The canonical gRPC name of a status code (`INVALID_ARGUMENT`, as grpcurl prints it).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The name of a google.rpc.Code number as carried in `TransferEvent.status_code`; an unknown
/// number prints as `CODE_<n>`.
pub fn code_number_name(code: i32) -> String {
    if (0..=16).contains(&code) {
        code_name(tonic::Code::from_i32(code)).to_string()
    } else {
        format!("CODE_{code}")
    }
}

/// `CODE: message` for a gRPC status (just `CODE` when the message is empty).
pub fn status_line(status: &tonic::Status) -> String {
    code_and_message(code_name(status.code()), status.message())
}

/// `CODE: message`, or `CODE` alone when the message is empty.
pub fn code_and_message(code: &str, message: &str) -> String {
    if message.is_empty() {
        code.to_string()
    } else {
        format!("{code}: {message}")
    }
}

/// Parses a byte count: a plain number (`4096`), hex (`0x1000`), or a number with a unit
/// (`4K`, `4k`, `4KiB`, `4KB`, `1.5M`, `2 GiB`, `1T`). Every unit is 1024-based: K, KB and KiB
/// all mean 1024 bytes. Fractions are allowed when the result is a whole number of bytes.
/// `_` may separate digits.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty size".to_string());
    }
    if let Some(hex) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        let digits: String = hex.chars().filter(|&c| c != '_').collect();
        return u64::from_str_radix(&digits, 16).map_err(|e| format!("bad hex size {s:?}: {e}"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "bad size {s:?}: unknown unit {other:?} (use B, K, M, G or T, all 1024-based)"
            ));
        }
    };
    let number: String = number.chars().filter(|&c| c != '_').collect();
    let (int, frac) = number.split_once('.').unwrap_or((&number, ""));
    if int.is_empty() && frac.is_empty() {
        return Err(format!("bad size {s:?}: no number"));
    }
    if frac.contains('.') {
        return Err(format!("bad size {s:?}: more than one '.'"));
    }
    let too_big = || format!("size {s:?} does not fit in 64 bits");
    let int_value: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_big())?
    };
    let mut total = int_value.checked_mul(multiplier).ok_or_else(too_big)?;
    if !frac.is_empty() {
        if frac.len() > 18 {
            return Err(format!("bad size {s:?}: too many decimals"));
        }
        let frac_value: u128 = frac.parse().map_err(|_| format!("bad size {s:?}"))?;
        let scale = 10u128.pow(frac.len() as u32);
        let scaled = frac_value * u128::from(multiplier);
        if scaled % scale != 0 {
            return Err(format!("bad size {s:?}: not a whole number of bytes"));
        }
        let extra = u64::try_from(scaled / scale).map_err(|_| too_big())?;
        total = total.checked_add(extra).ok_or_else(too_big)?;
    }
    Ok(total)
}

/// A byte count in binary units with two decimals: `512 B`, `4.00 KiB`, `1.00 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    // Move up while the value would print as 1024.00 or more.
    while value >= 1024.0 - 0.005 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// A throughput in decimal units with three significant digits, as nccl-tests and nixlbench
/// print it: `12.3 GB/s`, `950 MB/s`, `1.23 GB/s`. A zero duration prints as `n/a`.
pub fn format_rate(bytes: u64, elapsed: Duration) -> String {
    const UNITS: [&str; 5] = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        return "n/a".to_string();
    }
    let mut value = bytes as f64 / secs;
    let mut unit = 0;
    while value >= 999.5 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    let text = if value >= 99.95 {
        format!("{value:.0}")
    } else if value >= 9.995 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    };
    format!("{text} {}", UNITS[unit])
}

/// Seconds with millisecond precision: `0.512 s`, `12.034 s`.
pub fn format_duration(elapsed: Duration) -> String {
    format!("{:.3} s", elapsed.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_plain_and_hex() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 4096 "), Ok(4096));
        assert_eq!(parse_size("1_048_576"), Ok(1 << 20));
        assert_eq!(parse_size("0x1000"), Ok(4096));
        assert_eq!(parse_size("0X10_00"), Ok(4096));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn sizes_with_units_are_binary() {
        for s in [
            "4K", "4k", "4KiB", "4kib", "4KB", "4kb", "4 KiB", "4096B", "4096b",
        ] {
            assert_eq!(parse_size(s), Ok(4096), "{s}");
        }
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("1MB"), Ok(1 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("64G"), Ok(64 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert_eq!(parse_size("0.5M"), Ok(512 << 10));
        assert_eq!(parse_size(".5K"), Ok(512));
        assert_eq!(parse_size("2."), Ok(2));
    }

    #[test]
    fn sizes_rejected() {
        for s in [
            "",
            " ",
            "K",
            "-1",
            "4X",
            "4 KiBs",
            "1.5",
            "0.1K",
            "1.2.3K",
            "0xZZ",
            "abc",
            "18446744073709551616",
            "16777216T",
            "1e3",
        ] {
            assert!(parse_size(s).is_err(), "{s:?} should be rejected");
        }
        let e = parse_size("4X").unwrap_err();
        assert!(e.contains("1024-based"), "{e}");
    }

    #[test]
    fn bytes_formatting() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1024), "1.00 KiB");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(1 << 20), "1.00 MiB");
        assert_eq!(format_bytes(1 << 30), "1.00 GiB");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
        assert_eq!(format_bytes((1 << 20) - 1), "1.00 MiB");
        assert_eq!(format_bytes(1 << 40), "1.00 TiB");
        assert_eq!(format_bytes(u64::MAX), "16.00 EiB");
    }

    #[test]
    fn rate_formatting() {
        let s = Duration::from_secs(1);
        assert_eq!(format_rate(0, s), "0.00 B/s");
        assert_eq!(format_rate(999, s), "999 B/s");
        assert_eq!(format_rate(12_300_000_000, s), "12.3 GB/s");
        assert_eq!(format_rate(1_230_000_000, s), "1.23 GB/s");
        assert_eq!(format_rate(123_000_000_000, s), "123 GB/s");
        assert_eq!(format_rate(950_000_000, s), "950 MB/s");
        assert_eq!(format_rate(1 << 30, Duration::from_millis(500)), "2.15 GB/s");
        assert_eq!(format_rate(5_000_000_000_000_000, s), "5000 TB/s");
        assert_eq!(format_rate(1, Duration::ZERO), "n/a");
        assert_eq!(format_duration(Duration::from_micros(512_300)), "0.512 s");
    }

    #[test]
    fn endpoints() {
        let unix = |p: &str| Ok(Endpoint::Unix(PathBuf::from(p)));
        assert_eq!(
            Endpoint::parse("unix:/run/tcpxd/tcpxd.sock").map_err(|e| e.to_string()),
            unix("/run/tcpxd/tcpxd.sock")
        );
        assert_eq!(
            Endpoint::parse("unix:///run/x.sock").map_err(|e| e.to_string()),
            unix("/run/x.sock")
        );
        assert_eq!(
            Endpoint::parse("unix:rel.sock").map_err(|e| e.to_string()),
            unix("rel.sock")
        );
        assert_eq!(
            Endpoint::parse("/tmp/a.sock").map_err(|e| e.to_string()),
            unix("/tmp/a.sock")
        );
        assert_eq!(
            Endpoint::parse("./a.sock").map_err(|e| e.to_string()),
            unix("./a.sock")
        );
        let tcp = |u: &str| Ok(Endpoint::Tcp(u.to_string()));
        assert_eq!(
            Endpoint::parse("localhost:50051").map_err(|e| e.to_string()),
            tcp("http://localhost:50051")
        );
        assert_eq!(
            Endpoint::parse("10.0.0.2:50051").map_err(|e| e.to_string()),
            tcp("http://10.0.0.2:50051")
        );
        assert_eq!(
            Endpoint::parse("[::1]:50051").map_err(|e| e.to_string()),
            tcp("http://[::1]:50051")
        );
        assert_eq!(
            Endpoint::parse("http://h:1").map_err(|e| e.to_string()),
            tcp("http://h:1")
        );
        assert_eq!(
            Endpoint::parse("https://h:443").map_err(|e| e.to_string()),
            tcp("https://h:443")
        );
        for bad in [
            "",
            "unix:",
            "unix://",
            "localhost",
            "ftp://h:1",
            "http://:80",
            "h:notaport",
        ] {
            let err = Endpoint::parse(bad).expect_err(bad);
            assert_eq!(err.endpoint(), bad);
            assert!(err.to_string().contains("invalid endpoint"), "{err}");
        }
        assert_eq!(Endpoint::parse("unix:///a").unwrap().to_string(), "unix:/a");
        assert_eq!(Endpoint::parse("h:1").unwrap().to_string(), "http://h:1");
    }

    #[test]
    fn endpoint_default() {
        // Only the fallback is checked: tests must not mutate the process environment.
        if std::env::var_os(ENDPOINT_ENV).is_none() {
            assert_eq!(endpoint_from_env(), DEFAULT_ENDPOINT);
        }
        assert!(Endpoint::parse(DEFAULT_ENDPOINT).is_ok());
    }

    #[tokio::test]
    async fn connect_names_the_endpoint() {
        let dir = std::env::temp_dir().join(format!("tcpxd-client-test-{}", std::process::id()));
        let sock = dir.join("missing.sock");
        let endpoint = format!("unix:{}", sock.display());
        let err = connect(&endpoint).await.expect_err("nothing listens there");
        assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&endpoint), "{text}");
        assert!(text.contains("No such file"), "{text}");
        let err = connect("nohost").await.expect_err("invalid");
        assert!(matches!(err, ClientError::InvalidEndpoint { .. }));
    }

    #[test]
    fn code_names() {
        assert_eq!(code_name(tonic::Code::InvalidArgument), "INVALID_ARGUMENT");
        assert_eq!(code_number_name(0), "OK");
        assert_eq!(code_number_name(4), "DEADLINE_EXCEEDED");
        assert_eq!(code_number_name(16), "UNAUTHENTICATED");
        assert_eq!(code_number_name(99), "CODE_99");
        let st = tonic::Status::invalid_argument("entries[0].length: must be at least 1 byte");
        assert_eq!(
            status_line(&st),
            "INVALID_ARGUMENT: entries[0].length: must be at least 1 byte"
        );
        assert_eq!(status_line(&tonic::Status::not_found("")), "NOT_FOUND");
    }
}

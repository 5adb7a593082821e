//! Connect RPC with the JSON codec, by hand on serde types: what the `e2b` SDK speaks to envd.
//! Unary calls are `application/json` both ways; server streams are `application/connect+json`,
//! a request of one envelope and a response of envelopes (1 flag byte, 4-byte big-endian
//! length, the JSON message), closed by an end-of-stream envelope (flag `0x02`) whose JSON
//! carries the error, if any. An error before the stream starts is a plain Connect error:
//! `{"code": "not_found", "message": …}` with the matching HTTP status.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

pub const UNARY_CONTENT_TYPE: &str = "application/json";
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";
/// Largest request message taken: envd's requests are a path or a command line.
pub const MAX_REQUEST: usize = 1 << 20;
/// Longest `Connect-Timeout-Ms` honoured: a day, E2B's longest sandbox timeout. Longer
/// deadlines are held to it.
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;
/// Messages buffered for one stream before its producer waits for the client: a few, so a slow
/// reader slows the command's output pump rather than growing memory.
const STREAM_BUFFER: usize = 16;

/// Connect's error codes (those envd's clients act on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// A failed envd call: a Connect code and a message, answered with the code's HTTP status
/// unless `status` says otherwise (a gone sandbox is a 502, as E2B's proxy answers).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct RpcError {
    pub code: Code,
    pub message: String,
    pub status: Option<StatusCode>,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError { code, message: message.into(), status: None }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// The sandbox is gone or never was: E2B's proxy answers 502 with "… was not found", which
    /// the SDK turns into `SandboxNotRunningException` (and `is_running()` into False).
    pub fn sandbox_gone(id: &str, why: &str) -> Self {
        RpcError {
            code: Code::Unavailable,
            message: format!("sandbox `{id}` was not found: {why}"),
            status: Some(StatusCode::BAD_GATEWAY),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.status.unwrap_or_else(|| self.code.http_status())
    }

    fn body(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        (self.status(), [(header::CONTENT_TYPE, UNARY_CONTENT_TYPE)], body).into_response()
    }
}

/// The request message of a unary call (plain JSON) or of a server stream (one envelope).
/// Unknown fields are ignored, as the SDK's own codec does: a newer SDK may send fields this
/// server does not know, and refusing them would break it for nothing.
pub fn decode<T: DeserializeOwned>(body: &[u8], stream: bool) -> Result<T, RpcError> {
    let json = if stream {
        let (head, rest) =
            body.split_at_checked(5).ok_or_else(|| RpcError::invalid("the request is not a Connect envelope"))?;
        if head[0] & 0x01 != 0 {
            return Err(RpcError::new(Code::Unimplemented, "compressed request messages are not supported"));
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if rest.len() != len {
            return Err(RpcError::invalid(format!(
                "the request envelope says {len} bytes but carries {}; send exactly one message",
                rest.len()
            )));
        }
        rest
    } else {
        body
    };
    let json: &[u8] = if json.is_empty() { b"{}" } else { json };
    serde_json::from_slice(json).map_err(|e| RpcError::invalid(format!("bad request message: {e}")))
}

/// One envelope: `flags`, the length, the bytes.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + json.len());
    buf.put_u8(flags);
    buf.put_u32(u32::try_from(json.len()).unwrap_or(u32::MAX));
    buf.put_slice(json);
    buf.freeze()
}

/// The end-of-stream envelope, with the error that ended the stream, if one did.
pub fn end_of_stream(error: Option<&RpcError>) -> Bytes {
    let json = match error {
        Some(e) => serde_json::json!({"error": e.body()}),
        None => serde_json::json!({}),
    };
    envelope(0x02, &serde_json::to_vec(&json).unwrap_or_default())
}

/// The `Connect-Timeout-Ms` of a request, held to [`MAX_TIMEOUT_MS`]; none when absent.
pub fn timeout_ms(headers: &HeaderMap) -> Result<Option<u64>, RpcError> {
    let Some(v) = headers.get("connect-timeout-ms") else { return Ok(None) };
    let text = v.to_str().unwrap_or_default();
    // Connect's limit: at most 10 digits.
    if text.is_empty() || text.len() > 10 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RpcError::invalid(format!("Connect-Timeout-Ms `{text}` is not 1 to 10 digits")));
    }
    let ms: u64 = text.parse().map_err(|_| RpcError::invalid(format!("bad Connect-Timeout-Ms `{text}`")))?;
    Ok(Some(ms.min(MAX_TIMEOUT_MS)))
}

/// The sending half of a server stream: messages go out as they are sent, each its own body
/// frame, never held back.
#[derive(Debug)]
pub struct StreamTx {
    tx: mpsc::Sender<Bytes>,
}

impl StreamTx {
    /// Sends one message; false once the client is gone.
    pub async fn send<T: Serialize>(&self, message: &T) -> bool {
        let json = serde_json::to_vec(message).unwrap_or_default();
        self.tx.send(envelope(0, &json)).await.is_ok()
    }

    /// Ends the stream, with `error` in its trailer when one ended it.
    pub async fn end(&self, error: Option<RpcError>) {
        let _ = self.tx.send(end_of_stream(error.as_ref())).await;
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// A server-stream response and the sender feeding it.
pub fn stream() -> (StreamTx, Response) {
    let (tx, rx) = mpsc::channel::<Bytes>(STREAM_BUFFER);
    let body =
        futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx)) },
        );
    let resp = (StatusCode::OK, [(header::CONTENT_TYPE, STREAM_CONTENT_TYPE)], Body::from_stream(body)).into_response();
    (StreamTx { tx }, resp)
}

/// A unary answer.
pub fn unary<T: Serialize>(message: &T) -> Response {
    let body = serde_json::to_vec(message).unwrap_or_default();
    (StatusCode::OK, [(header::CONTENT_TYPE, UNARY_CONTENT_TYPE)], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_request_is_one_envelope() {
        #[derive(serde::Deserialize)]
        struct P {
            path: String,
        }
        let env = envelope(0, br#"{"path":"/tmp","new":1}"#);
        let p: P = decode(&env, true).unwrap_or(P { path: String::new() });
        assert_eq!(p.path, "/tmp");
        let mut two = env.to_vec();
        two.extend_from_slice(&env);
        assert!(decode::<P>(&two, true).is_err());
        assert_eq!(decode::<P>(b"{", true).err().map(|e| e.code), Some(Code::InvalidArgument));
    }

    #[test]
    fn the_end_of_stream_carries_the_error() {
        let e = end_of_stream(Some(&RpcError::new(Code::DeadlineExceeded, "slow")));
        assert_eq!(e[0], 0x02);
        let len = u32::from_be_bytes([e[1], e[2], e[3], e[4]]) as usize;
        let v: serde_json::Value = serde_json::from_slice(&e[5..5 + len]).unwrap_or_default();
        assert_eq!(v["error"]["code"], "deadline_exceeded");
        assert_eq!(&end_of_stream(None)[5..], b"{}");
    }

    #[test]
    fn timeouts_are_digits_and_bounded() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout_ms(&h).ok(), Some(None));
        h.insert("connect-timeout-ms", http::HeaderValue::from_static("1500"));
        assert_eq!(timeout_ms(&h).ok(), Some(Some(1500)));
        h.insert("connect-timeout-ms", http::HeaderValue::from_static("9999999999"));
        assert_eq!(timeout_ms(&h).ok(), Some(Some(MAX_TIMEOUT_MS)));
        h.insert("connect-timeout-ms", http::HeaderValue::from_static("-1"));
        assert!(timeout_ms(&h).is_err());
        h.insert("connect-timeout-ms", http::HeaderValue::from_static("12345678901"));
        assert!(timeout_ms(&h).is_err());
    }

    #[test]
    fn a_gone_sandbox_is_a_502_saying_was_not_found() {
        let e = RpcError::sandbox_gone("sb-1", "released");
        assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
        assert!(e.message.contains("was not found"));
    }
}

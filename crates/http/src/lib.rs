//! HTTP pieces the daemon and the server share: [`extract`] parses bodies and query strings into
//! typed requests and answers bad input with the wire error body; [`ndjson`] streams events;
//! [`serve`] serves a router with the edge limits (header-read timeout, connection limit);
//! [`constant_time_eq`] checks tokens; [`holding`] keeps something alive while a body streams.

pub mod extract;
pub mod ndjson;
pub mod serve;
mod sys;
pub mod unix;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sandman_wire::{ErrorBody, ErrorCode};

/// An error answer with the wire body and the status of its code.
pub fn error_response(code: ErrorCode, message: impl Into<String>, reason: Option<&str>) -> Response {
    let status = StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body = ErrorBody::new(code, message);
    if let Some(r) = reason {
        body = body.with_reason(r);
    }
    (status, axum::Json(body)).into_response()
}

/// Compares two byte strings in time that depends only on their lengths, never on where they
/// differ, so that a token cannot be guessed byte by byte from response times.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// `body`, keeping `held` until it has been sent in full or dropped (its client gone): a guard
/// that marks a call as under way lives as long as the call's answer streams. The body's length
/// stays known, so an answer of known size keeps its `content-length` (a chunked answer over
/// TCP waits out Nagle's algorithm and the peer's delayed ACK: 40 ms a call).
pub fn holding<T: Send + Unpin + 'static>(body: axum::body::Body, held: T) -> axum::body::Body {
    axum::body::Body::new(Holding { body, _held: held })
}

struct Holding<T> {
    body: axum::body::Body,
    _held: T,
}

impl<T: Unpin> hyper::body::Body for Holding<T> {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The token of an `Authorization: Bearer <token>` header value, if that is what it is.
pub fn bearer(header: Option<&axum::http::HeaderValue>) -> &str {
    header.and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[tokio::test]
    async fn what_a_body_holds_lives_until_the_body_is_done() {
        use http_body_util::BodyExt;
        let held = std::sync::Arc::new(());
        let body = holding(axum::body::Body::from("answer"), std::sync::Arc::clone(&held));
        assert_eq!(std::sync::Arc::strong_count(&held), 2);
        // Regression: wrapped, the answer lost its length and went out chunked, 40 ms slower.
        assert_eq!(hyper::body::Body::size_hint(&body).exact(), Some(6));
        let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        assert_eq!(&bytes[..], b"answer");
        assert_eq!(std::sync::Arc::strong_count(&held), 1, "released once the body was read and dropped");
    }

    #[test]
    fn bearer_header() {
        let v = axum::http::HeaderValue::from_static("Bearer abc");
        assert_eq!(bearer(Some(&v)), "abc");
        let basic = axum::http::HeaderValue::from_static("Basic abc");
        assert_eq!(bearer(Some(&basic)), "");
        assert_eq!(bearer(None), "");
    }
}

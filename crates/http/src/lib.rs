//! HTTP pieces the daemon and the server share: [`extract`] parses bodies and query strings into
//! typed requests and answers bad input with the wire error body; [`ndjson`] streams events;
//! [`serve`] serves a router with the edge limits (header-read timeout, connection limit);
//! [`constant_time_eq`] checks tokens.

pub mod extract;
pub mod ndjson;
pub mod serve;

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

    #[test]
    fn bearer_header() {
        let v = axum::http::HeaderValue::from_static("Bearer abc");
        assert_eq!(bearer(Some(&v)), "abc");
        let basic = axum::http::HeaderValue::from_static("Basic abc");
        assert_eq!(bearer(Some(&basic)), "");
        assert_eq!(bearer(None), "");
    }
}

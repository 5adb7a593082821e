//! The one error body of every API and its stable codes, mapped to HTTP statuses here and only here.

use serde::{Deserialize, Serialize};

/// A stable, machine-readable error code. Clients turn these into exception classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidArgument,
    Unauthorized,
    Forbidden,
    NotFound,
    Gone,
    Conflict,
    /// The sandbox is paused: resume it (`POST /v1/sandboxes/{id}/resume`) or create it with
    /// `auto_resume`.
    Paused,
    TooLarge,
    Timeout,
    QuotaExceeded,
    Unavailable,
    Internal,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::InvalidArgument,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::Gone,
        ErrorCode::Conflict,
        ErrorCode::Paused,
        ErrorCode::TooLarge,
        ErrorCode::Timeout,
        ErrorCode::QuotaExceeded,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];

    /// The HTTP status this code is answered with.
    pub const fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Timeout => 408,
            ErrorCode::Conflict | ErrorCode::Paused => 409,
            ErrorCode::Gone => 410,
            ErrorCode::TooLarge => 413,
            ErrorCode::QuotaExceeded => 429,
            ErrorCode::Internal => 500,
            ErrorCode::Unavailable => 503,
        }
    }

    /// The code as it appears on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Gone => "gone",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Paused => "paused",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Timeout => "timeout",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `{"error": {...}}`: the body of every non-2xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    /// A sentence for people; never parse it.
    pub message: String,
    /// A machine-readable reason where one applies (for `gone`, why the sandbox ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody { error: ErrorDetail { code, message: message.into(), reason: None } }
    }

    pub fn with_reason(mut self, reason: impl Into<String>) -> Self {
        self.error.reason = Some(reason.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_their_wire_names() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap_or_default();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            let back: ErrorCode = serde_json::from_str(&json).unwrap_or(ErrorCode::Internal);
            assert_eq!(back, code);
        }
    }

    #[test]
    fn every_code_maps_to_an_error_status() {
        for code in ErrorCode::ALL {
            assert!((400..600).contains(&code.http_status()), "{code}");
        }
    }

    #[test]
    fn reason_is_omitted_when_absent() {
        let body = ErrorBody::new(ErrorCode::NotFound, "no such file");
        let json = serde_json::to_value(&body).unwrap_or_default();
        assert_eq!(json, serde_json::json!({"error": {"code": "not_found", "message": "no such file"}}));
        let gone = ErrorBody::new(ErrorCode::Gone, "released").with_reason("released");
        assert_eq!(serde_json::to_value(&gone).unwrap_or_default()["error"]["reason"], "released");
    }
}

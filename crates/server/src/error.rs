//! `ServerError`, every way a server call fails, and its one mapping onto the wire error body.

use axum::response::{IntoResponse, Response};
use sandman_provider::ProviderError;
use sandman_wire::ErrorCode;
use sandman_wire::server::Reason;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("sandbox `{id}` is gone ({reason}){}", message.as_ref().map(|m| format!(": {m}")).unwrap_or_default())]
    Gone { id: String, reason: Reason, message: Option<String> },
    #[error("{0}")]
    Conflict(String),
    /// A call on a paused sandbox created without `auto_resume`.
    #[error(
        "sandbox `{0}` is paused; resume it first (`POST /v1/sandboxes/{0}/resume`, `sandman resume {0}`), or create it with `auto_resume` so that calls resume it"
    )]
    Paused(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    QuotaExceeded(String),
    /// The admission queue is at its bound: 429 with `Retry-After`.
    #[error(
        "the admission queue is full: {queued} creates are waiting, its bound (`--max-queue`); retry in {retry_after_s} s"
    )]
    QueueFull { queued: usize, retry_after_s: u64 },
    /// A body the server had to read (to merge a claim's environment into it) was refused.
    #[error("{0}")]
    Body(#[source] sandman_http::extract::BadRequest),
    #[error("{0}")]
    Unavailable(String),
    /// A sandbox failed to come up; the reason says why.
    #[error("sandbox `{id}` failed ({reason}): {message}")]
    Failed { id: String, reason: Reason, message: String },
    #[error("the provider refused: {0}")]
    Provider(#[source] ProviderError),
    #[error("{0}")]
    Internal(String),
}

pub type ServerResult<T> = Result<T, ServerError>;

impl ServerError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ServerError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            ServerError::Unauthorized => ErrorCode::Unauthorized,
            ServerError::NotFound(_) => ErrorCode::NotFound,
            ServerError::Gone { .. } => ErrorCode::Gone,
            ServerError::Conflict(_) => ErrorCode::Conflict,
            ServerError::Paused(_) => ErrorCode::Paused,
            ServerError::Timeout(_) => ErrorCode::Timeout,
            ServerError::QuotaExceeded(_) | ServerError::QueueFull { .. } => ErrorCode::QuotaExceeded,
            ServerError::Body(e) => e.code(),
            ServerError::Unavailable(_) => ErrorCode::Unavailable,
            ServerError::Failed { reason, .. } => match reason {
                Reason::ReadyTimeout | Reason::QueueTimeout => ErrorCode::Timeout,
                Reason::ImagePullFailed | Reason::SetupFailed => ErrorCode::InvalidArgument,
                // No room on the nodes (`unschedulable`), as on one machine
                // (`resource_exhausted`): a valid request the service could not hold now, which
                // may succeed once others release theirs or nodes are added.
                _ => ErrorCode::Unavailable,
            },
            ServerError::Provider(ProviderError::Unsupported(_)) => ErrorCode::InvalidArgument,
            ServerError::Provider(ProviderError::NotFound(_)) => ErrorCode::NotFound,
            ServerError::Provider(_) => ErrorCode::Unavailable,
            ServerError::Internal(_) => ErrorCode::Internal,
        }
    }

    fn reason(&self) -> Option<Reason> {
        match self {
            ServerError::Gone { reason, .. } | ServerError::Failed { reason, .. } => Some(*reason),
            _ => None,
        }
    }
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        let code = self.code();
        if code == ErrorCode::Internal {
            tracing::error!(error = %self, "internal error");
        }
        let reason = self.reason();
        let message = match &self {
            ServerError::Provider(e) => e.to_string(),
            other => other.to_string(),
        };
        let mut resp = sandman_http::error_response(code, message, reason.map(Reason::as_str));
        if let ServerError::QueueFull { retry_after_s, .. } = self
            && let Ok(v) = http::HeaderValue::from_str(&retry_after_s.max(1).to_string())
        {
            resp.headers_mut().insert(http::header::RETRY_AFTER, v);
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_names_its_reason() {
        let e = ServerError::Gone { id: "sb-1".into(), reason: Reason::LeaseExpired, message: None };
        assert_eq!(e.to_string(), "sandbox `sb-1` is gone (lease_expired)");
        assert_eq!(e.code(), ErrorCode::Gone);
        assert_eq!(e.reason(), Some(Reason::LeaseExpired));
    }

    #[test]
    fn provider_refusals_are_the_callers_problem() {
        let e = ServerError::Provider(ProviderError::Unsupported("image `x` needs docker".into()));
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
        let f = ServerError::Failed { id: "s".into(), reason: Reason::ReadyTimeout, message: "slow".into() };
        assert_eq!(f.code(), ErrorCode::Timeout);
    }

    /// A create no node had room for came back `400 invalid_argument`: a client error for a
    /// valid request. It is a capacity failure, as the process provider's `resource_exhausted`.
    #[test]
    fn unschedulable_is_a_capacity_failure_not_a_bad_request() {
        for reason in [Reason::Unschedulable, Reason::ResourceExhausted] {
            let e = ServerError::Failed { id: "s".into(), reason, message: "0/1 nodes are available".into() };
            assert_eq!(e.code(), ErrorCode::Unavailable, "{reason:?}");
            let resp = e.into_response();
            assert_eq!(resp.status().as_u16(), 503, "{reason:?}");
        }
    }

    #[test]
    fn a_full_queue_is_429_with_retry_after() {
        let resp = ServerError::QueueFull { queued: 10, retry_after_s: 7 }.into_response();
        assert_eq!(resp.status().as_u16(), 429);
        assert_eq!(resp.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("7"));
    }
}

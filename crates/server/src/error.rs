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
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    QuotaExceeded(String),
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
            ServerError::Timeout(_) => ErrorCode::Timeout,
            ServerError::QuotaExceeded(_) => ErrorCode::QuotaExceeded,
            ServerError::Unavailable(_) => ErrorCode::Unavailable,
            ServerError::Failed { reason, .. } => match reason {
                Reason::ReadyTimeout => ErrorCode::Timeout,
                Reason::ImagePullFailed | Reason::Unschedulable => ErrorCode::InvalidArgument,
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
        sandman_http::error_response(code, message, reason.map(Reason::as_str))
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
}

//! `DaemonError`, every way a daemon call can fail, and its mapping onto the wire error body:
//! the one place where errors become HTTP statuses.

use std::io;

use axum::response::{IntoResponse, Response};
use sandman_wire::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    /// Refused to this caller whatever it sends.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    /// An upload or extraction would write past the sandbox's disk (`--disk-limit`).
    #[error("{what} would write more than the sandbox's disk limit of {limit} bytes; nothing past it was written")]
    DiskLimit { limit: u64, what: String },
    /// A compressed upload unpacks to more than `--max-expansion-ratio` times its size.
    #[error(
        "the archive unpacks to more than {ratio} times its compressed size (the daemon's --max-expansion-ratio); the extraction was stopped"
    )]
    Expansion { ratio: u64 },
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
    #[error("{what} `{path}`: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    /// The request body stopped coming midway.
    #[error("{0}")]
    Stalled(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

pub type DaemonResult<T> = Result<T, DaemonError>;

impl DaemonError {
    /// An I/O failure on `path` while doing `what`; its code follows the OS error.
    pub fn io(what: &'static str, path: impl Into<String>, source: io::Error) -> Self {
        DaemonError::Io { what, path: path.into(), source }
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            DaemonError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            DaemonError::Unauthorized => ErrorCode::Unauthorized,
            DaemonError::Forbidden(_) => ErrorCode::Forbidden,
            DaemonError::NotFound(_) => ErrorCode::NotFound,
            DaemonError::Conflict(_) => ErrorCode::Conflict,
            DaemonError::TooLarge { .. } | DaemonError::DiskLimit { .. } | DaemonError::Expansion { .. } => {
                ErrorCode::TooLarge
            }
            DaemonError::Spawn { source, .. } => io_code(source, ErrorCode::InvalidArgument),
            DaemonError::Io { source, .. } => io_code(source, ErrorCode::Internal),
            DaemonError::Stalled(_) => ErrorCode::Timeout,
            DaemonError::Unavailable(_) => ErrorCode::Unavailable,
            DaemonError::Internal(_) => ErrorCode::Internal,
        }
    }
}

/// The code an OS error maps to; `fallback` for the errors that say nothing about the request.
fn io_code(err: &io::Error, fallback: ErrorCode) -> ErrorCode {
    match err.kind() {
        io::ErrorKind::NotFound => ErrorCode::NotFound,
        io::ErrorKind::PermissionDenied => ErrorCode::Forbidden,
        io::ErrorKind::AlreadyExists | io::ErrorKind::DirectoryNotEmpty => ErrorCode::Conflict,
        io::ErrorKind::InvalidInput
        | io::ErrorKind::NotADirectory
        | io::ErrorKind::IsADirectory
        | io::ErrorKind::InvalidFilename
        | io::ErrorKind::CrossesDevices => ErrorCode::InvalidArgument,
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::FileTooLarge => ErrorCode::TooLarge,
        _ => fallback,
    }
}

impl IntoResponse for DaemonError {
    fn into_response(self) -> Response {
        let code = self.code();
        if code == ErrorCode::Internal {
            tracing::error!(error = %self, "internal error");
        }
        sandman_http::error_response(code, self.to_string(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_map_by_kind_not_by_text() {
        let missing = DaemonError::io("read", "/x", io::Error::from(io::ErrorKind::NotFound));
        assert_eq!(missing.code(), ErrorCode::NotFound);
        let denied = DaemonError::io("read", "/x", io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(denied.code(), ErrorCode::Forbidden);
        let spawn = DaemonError::Spawn { program: "nope".into(), source: io::Error::from(io::ErrorKind::NotFound) };
        assert_eq!(spawn.code(), ErrorCode::NotFound);
        assert_eq!(DaemonError::TooLarge { limit: 1 }.code().http_status(), 413);
    }
}

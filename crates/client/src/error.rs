//! [`ClientError`]: an API error carrying the wire [`ErrorBody`], or the step of the call that failed.

use std::io;
use std::path::PathBuf;

use sandman_wire::{ErrorBody, ErrorCode};

/// Why a call failed. [`ClientError::Api`] is the server's (or the daemon's) answer; every other
/// variant names the step on this side that failed: reaching the server, reading or decoding
/// its answer, encoding the request, or finding the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error body.
    #[error("{}", api_message(body))]
    Api { status: u16, body: ErrorBody },

    /// The server answered with an error status and a body that is not an error body (a proxy
    /// in between, or something that is not a Sandman server).
    #[error("the server answered HTTP {status} without an error body: {snippet}")]
    UnexpectedStatus { status: u16, snippet: String },

    #[error("`{url}` is not a valid server URL")]
    InvalidUrl {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },

    #[error("`{url}` is not a server URL: only `http://host:port` URLs are supported")]
    UnsupportedUrl { url: String },

    /// The token cannot be sent in a header (it holds a newline or another control character).
    #[error("the token is not a valid header value")]
    InvalidToken {
        #[source]
        source: http::header::InvalidHeaderValue,
    },

    #[error("no token: SANDMAN_TOKEN is unset and there is no token file at `{}`", path.display())]
    NoToken { path: PathBuf },

    #[error("could not read the token file `{}`", path.display())]
    TokenFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The request could not be put together (a part of it was refused by `http`).
    #[error("could not build the request {call}")]
    BuildRequest {
        call: String,
        #[source]
        source: http::Error,
    },

    /// The request could not be sent, or no answer came (connection refused, reset, ...).
    #[error("could not reach the server at {url}")]
    Request {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },

    /// The connection broke while the answer's body was being read.
    #[error("the connection broke while reading the answer to {call}")]
    Body {
        call: String,
        #[source]
        source: hyper::Error,
    },

    #[error("could not decode the answer to {call}")]
    Decode {
        call: String,
        #[source]
        source: serde_json::Error,
    },

    /// A stream ended before its last event (a followed output before `exit`): the connection
    /// or the sandbox went away.
    #[error("the answer to {call} ended before its last event")]
    StreamEnded { call: String },

    /// One NDJSON line grew past the limit without a newline.
    #[error("a line of the answer to {call} is longer than {limit} bytes")]
    LineTooLong { call: String, limit: usize },

    #[error("could not encode the request body of {call}")]
    EncodeBody {
        call: String,
        #[source]
        source: serde_json::Error,
    },

    #[error("could not encode the query of {call}")]
    EncodeQuery {
        call: String,
        #[source]
        source: serde_urlencoded::ser::Error,
    },

    /// A setting of the environment (`SANDMAN_RETRIES`, ...) that is not what it should be.
    #[error("{name}=`{value}` is not {expected}")]
    InvalidSetting { name: &'static str, value: String, expected: &'static str },

    /// The call failed without an answer, or was shed, however many times it was sent (see
    /// [`crate::RetryPolicy`]); `last` is the last attempt's error. `not_idempotent`: it was not
    /// sent again because the last attempt may have run and the call is not idempotent. Codes,
    /// statuses and kinds are the last error's.
    #[error("{}", retried_message(call, *attempts, *not_idempotent))]
    Retried {
        call: String,
        attempts: u32,
        not_idempotent: bool,
        #[source]
        last: Box<ClientError>,
    },
}

fn retried_message(call: &str, attempts: u32, not_idempotent: bool) -> String {
    if not_idempotent {
        let sent = if attempts == 1 { "it was sent".to_owned() } else { format!("attempt {attempts} was sent") };
        format!(
            "{call} failed after {sent}, and was not sent again: it is not idempotent, and the server may have run it"
        )
    } else if attempts == 1 {
        format!("{call} failed (1 attempt)")
    } else {
        format!("{call} failed after {attempts} attempts")
    }
}

/// `message (reason)`, so that a gone sandbox reads `sandbox `sb-42` is gone (lease_expired)`;
/// a message that already names its reason is shown as it is (this is display only: behaviour
/// goes by `code()` and `reason()`).
fn api_message(body: &ErrorBody) -> String {
    match &body.error.reason {
        Some(reason) if !body.error.message.contains(reason.as_str()) => format!("{} ({reason})", body.error.message),
        _ => body.error.message.clone(),
    }
}

impl ClientError {
    /// The error itself, or for [`ClientError::Retried`] the last attempt's.
    pub fn last(&self) -> &ClientError {
        match self {
            ClientError::Retried { last, .. } => last.last(),
            other => other,
        }
    }

    /// How many times the call was sent: [`ClientError::Retried`]'s count, else 1.
    pub fn attempts(&self) -> u32 {
        match self {
            ClientError::Retried { attempts, .. } => *attempts,
            _ => 1,
        }
    }

    /// The wire error code, for an API error.
    pub fn code(&self) -> Option<ErrorCode> {
        self.body().map(|b| b.error.code)
    }

    /// The machine-readable reason of an API error (for `gone`, why the sandbox ended).
    pub fn reason(&self) -> Option<&str> {
        self.body().and_then(|b| b.error.reason.as_deref())
    }

    /// The error body, for an API error.
    pub fn body(&self) -> Option<&ErrorBody> {
        match self.last() {
            ClientError::Api { body, .. } => Some(body),
            _ => None,
        }
    }

    /// The HTTP status of an error answer.
    pub fn status(&self) -> Option<u16> {
        match self.last() {
            ClientError::Api { status, .. } | ClientError::UnexpectedStatus { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether nothing listens at the server's address: walks the chain of sources down to the
    /// connect's `io::Error`.
    pub fn is_connection_refused(&self) -> bool {
        self.io_kind() == Some(io::ErrorKind::ConnectionRefused)
    }

    /// Whether the request never reached a server: it could not connect.
    pub fn is_connect(&self) -> bool {
        matches!(self.last(), ClientError::Request { source, .. } if source.is_connect())
    }

    /// Whether the connection broke rather than the server refusing the call: no answer came,
    /// the answer's body broke off, or a stream ended early. A call that reads from an offset
    /// (a followed output) may be sent again.
    pub fn is_broken_connection(&self) -> bool {
        matches!(self.last(), ClientError::Request { .. } | ClientError::Body { .. } | ClientError::StreamEnded { .. })
    }

    /// The kind of the first `io::Error` in the chain of sources.
    fn io_kind(&self) -> Option<io::ErrorKind> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(err) = next {
            if let Some(io) = err.downcast_ref::<io::Error>() {
                return Some(io.kind());
            }
            next = err.source();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_errors_show_their_reason() {
        let gone = ClientError::Api {
            status: 410,
            body: ErrorBody::new(ErrorCode::Gone, "sandbox `sb-42` is gone").with_reason("lease_expired"),
        };
        assert_eq!(gone.to_string(), "sandbox `sb-42` is gone (lease_expired)");
        assert_eq!(gone.code(), Some(ErrorCode::Gone));
        assert_eq!(gone.reason(), Some("lease_expired"));
        assert_eq!(gone.status(), Some(410));
        let named = ClientError::Api {
            status: 410,
            body: ErrorBody::new(ErrorCode::Gone, "sandbox `sb-42` is gone (released)").with_reason("released"),
        };
        assert_eq!(named.to_string(), "sandbox `sb-42` is gone (released)");
        let plain = ClientError::Api { status: 401, body: ErrorBody::new(ErrorCode::Unauthorized, "bad token") };
        assert_eq!(plain.to_string(), "bad token");
        assert_eq!(plain.reason(), None);
    }

    #[test]
    fn a_retried_error_says_how_often_it_was_sent_and_keeps_the_last_ones_code() {
        let shed = ClientError::Api { status: 503, body: ErrorBody::new(ErrorCode::Unavailable, "busy") };
        let err = ClientError::Retried {
            call: "GET /v1/pools".into(),
            attempts: 4,
            not_idempotent: false,
            last: shed.into(),
        };
        assert_eq!(err.to_string(), "GET /v1/pools failed after 4 attempts");
        assert_eq!((err.code(), err.status(), err.attempts()), (Some(ErrorCode::Unavailable), Some(503), 4));
        assert_eq!(std::error::Error::source(&err).map(|e| e.to_string()).as_deref(), Some("busy"));
    }

    #[test]
    fn other_errors_have_no_code() {
        let err = ClientError::UnexpectedStatus { status: 502, snippet: "Bad Gateway".into() };
        assert_eq!(err.code(), None);
        assert_eq!(err.status(), Some(502));
        assert!(!err.is_connection_refused());
    }
}

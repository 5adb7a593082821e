//! Sandman's wire contract: every request, response, stream event and error body that crosses
//! a socket, as plain serde types with no I/O. Start at [`error`] for the error body, then
//! [`daemon`] for the in-sandbox daemon API; [`bounds`] holds the range of every number a caller
//! sends, [`cgroup`] the kernel's limit files both sides of a sandbox read,
//! [`state_dir`] where the server keeps its state.

pub mod bounds;
pub mod cgroup;
pub mod daemon;
pub mod error;
pub mod fork_server;
pub mod mode;
pub mod server;
pub mod snapshots;
pub mod state_dir;

pub use error::{ErrorBody, ErrorCode, ErrorDetail};

/// The version of the wire contract served under `/v1`.
pub const API_VERSION: &str = "v1";

/// Header carrying the bearer token: `Authorization: Bearer <token>`.
pub const AUTHORIZATION_SCHEME: &str = "Bearer";

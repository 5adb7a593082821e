//! A typed async client of the Sandman server: start at [`Client`] (`Client::from_env()`), whose
//! calls take and answer the types of [`sandman_wire`]; failures are [`ClientError`]s. Calls
//! are sent again where that is safe, as its [`RetryPolicy`] says.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sandman_client::ClientError> {
//! use sandman_client::Client;
//! use sandman_wire::daemon::ExecRequest;
//! use sandman_wire::server::CreateSandbox;
//!
//! let client = Client::from_env()?;
//! let sandbox = client.create(&CreateSandbox { image: "host".into(), wait: true, ..Default::default() }).await?;
//! let req = ExecRequest { argv: Some(vec!["echo".into(), "hi".into()]), ..Default::default() };
//! let result = client.exec(&sandbox.id, &req).await?;
//! assert_eq!(result.stdout, "hi\n");
//! client.release(&sandbox.id).await?;
//! # Ok(()) }
//! ```

mod body;
mod client;
pub mod env;
mod error;
pub mod retry;
mod sandbox;
mod snapshots;

pub use body::{ByteStream, MAX_LINE_BYTES, NdjsonStream, UploadBody};
pub use client::Client;
pub use env::default_state_dir;
pub use error::ClientError;
pub use retry::RetryPolicy;
pub use sandbox::OutputFollow;
pub use sandman_wire as wire;

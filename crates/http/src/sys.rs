//! This crate's only `unsafe`: handing a Unix socket to tokio's reactor with an interest of its
//! own ([`register`]), which tokio marks unsafe because it cannot check that the descriptor stays
//! the same while registered.
#![allow(unsafe_code)]

use std::io;
use std::os::unix::net::UnixStream;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// `stream` registered with the runtime for `interest` only. Must be called within a tokio
/// runtime with I/O enabled.
pub fn register(stream: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    // SAFETY: a `UnixStream` keeps its descriptor open and returns the same one from `as_raw_fd`
    // for as long as it is owned, here by the `AsyncFd`.
    unsafe { AsyncFd::register_with_interest(stream, interest) }.map_err(io::Error::from)
}

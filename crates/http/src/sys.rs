//! This crate's only `unsafe`: handing a Unix socket to tokio's reactor with an interest of its
//! own ([`register`]), which tokio marks unsafe because it cannot check that the descriptor stays
//! the same while registered, and reading into a buffer's uninitialised part ([`read_into`]),
//! which saves zeroing it first (hyper's read buffer grows to 400 KiB on a large transfer).
#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use tokio::io::unix::AsyncFd;
use tokio::io::{Interest, ReadBuf};

/// `stream` registered with the runtime for `interest` only. Must be called within a tokio
/// runtime with I/O enabled.
pub fn register(stream: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    // SAFETY: a `UnixStream` keeps its descriptor open and returns the same one from `as_raw_fd`
    // for as long as it is owned, here by the `AsyncFd`.
    unsafe { AsyncFd::register_with_interest(stream, interest) }.map_err(io::Error::from)
}

/// Reads from `stream` into `buf`'s unfilled part, marking what was read filled: the bytes read.
pub fn read_into(stream: &UnixStream, buf: &mut ReadBuf<'_>) -> io::Result<usize> {
    // SAFETY: `unfilled_mut` hands out possibly uninitialised memory that must not be
    // de-initialised; `read` only writes to it.
    let unfilled = unsafe { buf.unfilled_mut() };
    // SAFETY: the pointer and length are those of `unfilled`, valid and writable for the call;
    // the descriptor is `stream`'s, open while it is borrowed.
    let n = unsafe { libc::read(stream.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    // SAFETY: the kernel initialised the first `n` bytes of the unfilled part.
    unsafe { buf.assume_init(n) };
    buf.advance(n);
    Ok(n)
}

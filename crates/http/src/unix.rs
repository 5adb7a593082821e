//! A Unix stream socket watched for readability only, which the daemon serves on and the server
//! dials daemons with. Start at [`QuietUnixStream`].
//!
//! Why: tokio registers every socket for reads and writes, edge-triggered, and a Unix socket
//! signals its writer that there is room again each time its reader takes data (Linux's
//! `unix_write_space` wakes on every read, not only after the buffer was full, as TCP's does). So
//! in a request and its answer each side is woken once for nothing: the side that sent is asleep
//! waiting for the answer when the other reads what it sent. On a small call (a 1 KiB file write
//! through the server) that was a context switch more for the server and for the daemon each.
//! Here writes go straight to the socket; only a write that finds the buffer full registers
//! (a duplicate of the descriptor) for writability, and that registration is kept for the rest of
//! the connection.

use std::io::{self, IoSlice, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::sys;

/// A connected Unix stream socket: see the [module](self).
#[derive(Debug)]
pub struct QuietUnixStream {
    /// Registered for readability only; also what writes go through while there is room.
    read: AsyncFd<UnixStream>,
    /// A duplicate of the descriptor registered for writability, made by the first write that
    /// found the socket's buffer full.
    write: Option<AsyncFd<UnixStream>>,
}

impl QuietUnixStream {
    /// Takes over a connected socket (made non-blocking here). Must be called within a tokio
    /// runtime with I/O enabled.
    pub fn new(stream: UnixStream) -> io::Result<QuietUnixStream> {
        stream.set_nonblocking(true)?;
        Ok(QuietUnixStream { read: sys::register(stream, Interest::READABLE)?, write: None })
    }

    /// Takes over a socket tokio registered (its registration is dropped first).
    pub fn from_tokio(stream: tokio::net::UnixStream) -> io::Result<QuietUnixStream> {
        QuietUnixStream::new(stream.into_std()?)
    }

    /// The registration writes wait on, made when first needed.
    fn writable(&mut self) -> io::Result<&AsyncFd<UnixStream>> {
        match self.write {
            Some(ref write) => Ok(write),
            None => {
                let dup = self.read.get_ref().try_clone()?;
                Ok(self.write.insert(sys::register(dup, Interest::WRITABLE)?))
            }
        }
    }

    /// Runs `op` (a write) on the socket: straight away while there is room, then waiting for
    /// room on the write registration.
    fn poll_write_with<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut op: impl FnMut(&UnixStream) -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        if self.write.is_none() {
            match op(self.read.get_ref()) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                done => return Poll::Ready(done),
            }
        }
        let write = self.writable()?;
        loop {
            let mut guard = ready!(write.poll_write_ready(cx))?;
            if let Ok(done) = guard.try_io(|s| op(s.get_ref())) {
                return Poll::Ready(done);
            }
        }
    }
}

impl AsyncRead for QuietUnixStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let mut guard = ready!(this.read.poll_read_ready(cx))?;
            let wanted = buf.remaining();
            match guard.try_io(|s| sys::read_into(s.get_ref(), buf)) {
                Ok(Ok(n)) => {
                    // A short read emptied the socket: the next read would only find that out.
                    if n > 0 && n < wanted {
                        guard.clear_ready();
                    }
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for QuietUnixStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_with(cx, |s| (&*s).write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_with(cx, |s| (&*s).write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.read.get_ref().shutdown(Shutdown::Write))
    }
}

/// A Unix listener whose connections are [`QuietUnixStream`]s, for [`crate::serve::serve`],
/// each with who connected ([`UnixPeer`]).
#[derive(Debug)]
pub struct QuietUnixListener(pub tokio::net::UnixListener);

/// Who is at the other end of an accepted connection, as the kernel recorded it when the peer
/// connected (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnixPeer {
    /// The peer's pid as this process's pid namespace numbers it: 0 when the peer runs in a
    /// namespace this one does not contain (outside a container whose init this process is);
    /// none when the kernel did not say.
    pub pid: Option<i32>,
}

impl UnixPeer {
    /// Whether the peer is a process of this process's own pid namespace (or one below it).
    pub fn in_my_pid_namespace(&self) -> bool {
        self.pid.is_some_and(|p| p > 0)
    }
}

impl axum::serve::Listener for QuietUnixListener {
    type Io = QuietUnixStream;
    type Addr = UnixPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // axum's own accept, with its handling of accept errors.
            let (stream, _) = axum::serve::Listener::accept(&mut self.0).await;
            let peer = UnixPeer { pid: stream.peer_cred().ok().and_then(|c| c.pid()) };
            match QuietUnixStream::from_tokio(stream) {
                Ok(stream) => return (stream, peer),
                Err(e) => tracing::warn!(error = %e, "cannot take over an accepted connection: it is closed"),
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(UnixPeer { pid: Some(i32::try_from(std::process::id()).unwrap_or(0)) })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A connection's peer is known from the kernel's record of who connected: a process of
    /// this pid namespace by its pid (a daemon's sandbox's own processes, seen from the daemon),
    /// where one outside it would be 0.
    #[tokio::test]
    async fn an_accepted_connection_names_its_peer() {
        let dir = std::env::temp_dir().join(format!("sandman-http-peer-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let mut listener =
            QuietUnixListener(tokio::net::UnixListener::bind(&path).unwrap_or_else(|e| panic!("bind: {e}")));
        let client = tokio::net::UnixStream::connect(&path).await.unwrap_or_else(|e| panic!("connect: {e}"));
        let (_conn, peer) = axum::serve::Listener::accept(&mut listener).await;
        assert_eq!(peer.pid, Some(std::process::id() as i32));
        assert!(peer.in_my_pid_namespace());
        assert!(!UnixPeer { pid: Some(0) }.in_my_pid_namespace(), "pid 0: a process of another pid namespace");
        drop(client);
        let _ = std::fs::remove_dir_all(&dir);
    }

    const EPOLLIN: u32 = 0x1;
    const EPOLLOUT: u32 = 0x4;

    /// The events every epoll instance of this process watches `fd` for (from
    /// `/proc/self/fdinfo`).
    fn watched_for(fd: i32) -> Vec<u32> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fd").into_iter().flatten().flatten() {
            let is_epoll =
                std::fs::read_link(entry.path()).is_ok_and(|l| l.to_string_lossy() == "anon_inode:[eventpoll]");
            if !is_epoll {
                continue;
            }
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", entry.file_name().to_string_lossy()))
                .unwrap_or_default();
            for line in info.lines() {
                let mut words = line.split_whitespace();
                if words.next() == Some("tfd:")
                    && words.next().and_then(|n| n.parse::<i32>().ok()) == Some(fd)
                    && words.next() == Some("events:")
                    && let Some(events) = words.next().and_then(|e| u32::from_str_radix(e, 16).ok())
                {
                    found.push(events);
                }
            }
        }
        found
    }

    #[tokio::test]
    async fn a_call_and_its_answer_leave_the_socket_watched_for_reads_only() {
        let (ours, theirs) = UnixStream::pair().unwrap_or_else(|e| panic!("socketpair: {e}"));
        let mut ours = QuietUnixStream::new(ours).unwrap_or_else(|e| panic!("register: {e}"));
        let mut theirs = tokio::net::UnixStream::from_std({
            theirs.set_nonblocking(true).unwrap_or_else(|e| panic!("{e}"));
            theirs
        })
        .unwrap_or_else(|e| panic!("{e}"));
        ours.write_all(&[b'x'; 1024]).await.unwrap_or_else(|e| panic!("write: {e}"));
        let mut got = vec![0; 1024];
        theirs.read_exact(&mut got).await.unwrap_or_else(|e| panic!("read: {e}"));
        theirs.write_all(b"answer").await.unwrap_or_else(|e| panic!("write: {e}"));
        let mut answer = [0; 6];
        ours.read_exact(&mut answer).await.unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!((&got[..], &answer), (&[b'x'; 1024][..], b"answer"));

        let fd = ours.read.get_ref().as_raw_fd();
        let events = watched_for(fd);
        assert!(!events.is_empty(), "fd {fd} is not watched by any epoll instance");
        for e in events {
            assert!(e & EPOLLIN != 0 && e & EPOLLOUT == 0, "fd {fd} is watched for {e:#x}, not reads only");
        }
        assert!(ours.write.is_none(), "a write that found room registered for writability");
    }

    #[tokio::test]
    async fn a_write_that_fills_the_buffer_waits_for_room_and_loses_nothing() {
        let (ours, theirs) = UnixStream::pair().unwrap_or_else(|e| panic!("socketpair: {e}"));
        let mut ours = QuietUnixStream::new(ours).unwrap_or_else(|e| panic!("register: {e}"));
        // Far more than a socket's buffer, read slowly by another thread.
        let sent: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
        let reader = std::thread::spawn(move || {
            let mut theirs = theirs;
            let mut got = Vec::new();
            let mut chunk = vec![0; 64 << 10];
            loop {
                std::thread::sleep(std::time::Duration::from_micros(200));
                match theirs.read(&mut chunk) {
                    Ok(0) => return got,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                    Err(e) => panic!("read: {e}"),
                }
            }
        });
        ours.write_all(&sent).await.unwrap_or_else(|e| panic!("write: {e}"));
        let write_fd = ours.write.as_ref().map(|w| w.get_ref().as_raw_fd());
        ours.shutdown().await.unwrap_or_else(|e| panic!("shutdown: {e}"));
        let got = reader.join().unwrap_or_else(|_| panic!("the reader panicked"));
        assert!(got == sent, "got {} bytes, not the {} sent in order", got.len(), sent.len());
        let write_fd = write_fd.unwrap_or_else(|| panic!("a write into a full buffer made no write registration"));
        assert!(watched_for(write_fd).iter().all(|e| e & EPOLLOUT != 0));
    }

    #[tokio::test]
    async fn a_read_fills_only_what_it_read_of_an_uninitialised_buffer() {
        let (ours, theirs) = UnixStream::pair().unwrap_or_else(|e| panic!("socketpair: {e}"));
        let mut ours = QuietUnixStream::new(ours).unwrap_or_else(|e| panic!("register: {e}"));
        (&theirs).write_all(b"hello").unwrap_or_else(|e| panic!("write: {e}"));
        // hyper hands over its read buffer's spare capacity uninitialised, up to 400 KiB of it on
        // a large transfer: zeroing it before each read would cost more than the read.
        let mut space = vec![std::mem::MaybeUninit::<u8>::uninit(); 64 << 10];
        let mut buf = ReadBuf::uninit(&mut space);
        std::future::poll_fn(|cx| Pin::new(&mut ours).poll_read(cx, &mut buf))
            .await
            .unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(buf.filled(), b"hello");
        assert_eq!(buf.initialized().len(), 5, "the read initialised more than it read");
    }

    #[tokio::test]
    async fn the_peers_close_reads_as_the_end() {
        let (ours, theirs) = UnixStream::pair().unwrap_or_else(|e| panic!("socketpair: {e}"));
        let mut ours = QuietUnixStream::new(ours).unwrap_or_else(|e| panic!("register: {e}"));
        (&theirs).write_all(b"last").unwrap_or_else(|e| panic!("write: {e}"));
        drop(theirs);
        let mut got = Vec::new();
        ours.read_to_end(&mut got).await.unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(got, b"last");
        let refused = ours.write_all(b"more").await;
        assert!(refused.is_err(), "a write to a closed peer succeeded");
    }
}

//! `sandmand fork-server`: started once by the process provider, it starts each isolated
//! sandbox's daemon by forking itself, instead of the provider executing the binary anew.
//!
//! An exec of this static binary costs CPU before the daemon's own work: the exec itself, the
//! relocation of a position-independent binary, and C library start-up, which on a virtual
//! machine pays for dozens of `cpuid` instructions the hypervisor must trap (measured on this
//! project's: about 5 us each, 0.45 ms a start; an exec that only prints the version, 1.05 ms,
//! against 0.27 ms for a fork and exit). A fork of this small single-threaded process skips all
//! of it: the child is as the exec'd daemon would be once its `main` began.
//!
//! The child is made with `CLONE_PARENT`: it is the provider's child, not this server's, exactly
//! as a daemon the provider executes, so the provider's watcher waits for it, reaps it and learns
//! its exit status as before. The child then puts itself in a process group of its own, takes
//! `/dev/null` for stdin and stdout and the log it was handed for stderr, enters its working
//! directory, takes the environment it was given (this server's own is empty) and the command
//! line an exec would have shown, and runs the daemon's entry point with its arguments.
//!
//! The socket is stdin, one end of a `SOCK_SEQPACKET` pair whose other end only the provider
//! holds: nothing else can ask. The server says `ready` first, and ends when the provider closes
//! its end.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use sandman_wire::fork_server::{ForkRequest, MAX_REQUEST, READY};

use crate::sys;

/// How [`serve`] returned.
#[derive(Debug)]
pub enum Served {
    /// The provider closed its end: the server is done.
    Closed,
    /// This is a forked child, ready to run the daemon with these arguments.
    Daemon(Vec<OsString>),
    /// The server cannot go on (or this child could not become the daemon).
    Failed(io::Error),
}

/// Serves fork requests on stdin until it closes. Returns in the server when it is done, and in
/// each child, which is to run the daemon.
pub fn serve() -> Served {
    let stdin = io::stdin();
    let sock = stdin.as_fd();
    let mut buf = vec![0u8; MAX_REQUEST];
    // A child's command line is set with `PR_SET_MM_MAP`, which a kernel built without
    // checkpoint/restore lacks: tried here first on this process (its own line again), so that
    // such a kernel refuses once, here, rather than every daemon failing to start.
    let own: Vec<OsString> = std::env::args_os().collect();
    if let Err(e) = sys::forks::set_cmdline(&own) {
        let _ =
            sys::forks::send(sock, format!("error: cannot set a child's command line (PR_SET_MM_MAP): {e}").as_bytes());
        return Served::Failed(e);
    }
    // Whoever started it learns it serves (an older binary without `fork-server` fails instead).
    if let Err(e) = sys::forks::send(sock, READY) {
        return Served::Failed(e);
    }
    loop {
        let (n, log) = match sys::forks::recv_with_fd(sock, &mut buf) {
            Ok((0, _)) => return Served::Closed,
            Ok(got) => got,
            Err(e) => return Served::Failed(e),
        };
        let decoded = ForkRequest::decode(&buf[..n]);
        let answer = match (decoded, log) {
            (Ok(req), Some(log)) => match sys::ns::clone_into(libc::CLONE_PARENT) {
                Ok(None) => {
                    return match become_daemon(&req, log) {
                        Ok(()) => Served::Daemon(req.daemon_argv()),
                        Err(e) => Served::Failed(e),
                    };
                }
                Ok(Some(pid)) => pid.to_string(),
                Err(e) => format!("error: cannot fork: {e}"),
            },
            (Ok(_), None) => "error: the request carried no log descriptor".to_string(),
            (Err(why), _) => format!("error: {why}"),
        };
        if let Err(e) = sys::forks::send(sock, answer.as_bytes()) {
            return Served::Failed(e);
        }
    }
}

/// In the child: what an exec of the daemon would have given it.
fn become_daemon(req: &ForkRequest, log: OwnedFd) -> io::Result<()> {
    sys::forks::own_process_group()?;
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
    // Stdin was the socket: the daemon holds no way to ask for forks.
    sys::forks::dup_onto(null.as_fd(), 0)?;
    sys::forks::dup_onto(null.as_fd(), 1)?;
    sys::forks::dup_onto(log.as_fd(), 2)?;
    drop((null, log));
    std::env::set_current_dir(&req.cwd)?;
    sys::forks::replace_env(&req.env)?;
    sys::forks::set_cmdline(&req.argv)
}

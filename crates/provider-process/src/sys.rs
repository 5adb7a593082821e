//! The process provider's only `unsafe`: `pidfd_open` (and handing the pidfd to tokio), `waitpid`,
//! `kill`, `pidfd_send_signal`, `geteuid`, `access`, `unshare(CLONE_FILES)`, `close_range`,
//! `gettid`, `ppoll` (for a cgroup's events), `statfs`, `mount` and `umount2` (for the records'
//! tmpfs), a `SOCK_SEQPACKET` pair and `sendmsg` with a descriptor (for the fork server) and (in
//! tests) `setns`, which std does not expose.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A pidfd for `pid`: it becomes readable when that process exits, and it keeps naming that
/// process even after its pid is reused.
fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    if pid <= 0 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: pidfd_open takes a pid and flags, no pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::PIDFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A pidfd for `pid` registered with the runtime: `readable()` resolves when the process exits.
/// Must be called within a tokio runtime.
pub fn async_pidfd(pid: i32) -> io::Result<AsyncFd<OwnedFd>> {
    let fd = pidfd_open(pid)?;
    // SAFETY: an `OwnedFd` keeps its descriptor open and returns the same one from `as_raw_fd`
    // for as long as it is owned, here by the `AsyncFd`.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(io::Error::from)
}

/// SIGKILLs `pid` if `still_ours()` holds once a pidfd pins it: checked after opening, so a pid
/// reused between a listing and the kill is never signalled unless it is ours too. One that is
/// gone already is fine.
pub fn kill_pinned(pid: i32, still_ours: impl FnOnce() -> bool) -> io::Result<()> {
    let fd = match pidfd_open(pid) {
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(()),
        other => other?,
    };
    if !still_ours() {
        return Ok(());
    }
    // SAFETY: `fd` is an open pidfd owned here; a null siginfo and no flags are allowed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    let err = io::Error::last_os_error();
    if r == 0 || err.raw_os_error() == Some(libc::ESRCH) { Ok(()) } else { Err(err) }
}

/// Reaps our exited child `pid` without blocking: its wait status, or `None` when it has not
/// exited yet. Called once its pidfd is readable; until then the zombie keeps the pid ours.
pub fn reap(pid: i32) -> io::Result<Option<std::process::ExitStatus>> {
    use std::os::unix::process::ExitStatusExt;
    let mut status = 0;
    loop {
        // SAFETY: `waitpid` writes one int that lives on this stack frame.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        match r {
            0 => return Ok(None),
            r if r == pid => return Ok(Some(std::process::ExitStatus::from_raw(status))),
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
}

/// Sends `signal` to `pid` (a process group when `group`). One that is gone already is fine.
/// Refuses pids 0, 1 and negative ones, which would address far more than one sandbox.
pub fn kill(pid: i32, signal: i32, group: bool) -> io::Result<()> {
    if pid <= 1 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let target = if group { -pid } else { pid };
    // SAFETY: `kill` takes no pointers.
    if unsafe { libc::kill(target, signal) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) { Ok(()) } else { Err(err) }
}

/// Gives the calling thread a descriptor table of its own, a copy of the process's
/// (`unshare(CLONE_FILES)`): descriptors opened or closed by either afterwards are not the
/// other's.
pub fn unshare_files() -> io::Result<()> {
    // SAFETY: `unshare` takes flags only.
    if unsafe { libc::unshare(libc::CLONE_FILES) } == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Closes every descriptor from `first` up in the calling thread's table (`close_range`, Linux
/// 5.9). Only for a table of its own ([`unshare_files`]): in the shared one it would close
/// descriptors other code owns.
pub fn close_from(first: u32) -> io::Result<()> {
    // SAFETY: `close_range` takes two descriptor numbers and flags, no pointers.
    if unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A connected pair of `SOCK_SEQPACKET` Unix sockets, close-on-exec: messages keep their
/// bounds, and a reader learns the other end closed.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `socketpair` writes two descriptors into the live array.
    let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both were just made by `socketpair` and are owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends `bytes` as one message with a copy of `fd` beside it (`SCM_RIGHTS`); `EPIPE`, never
/// `SIGPIPE`, when the peer is gone.
pub fn send_with_fd(sock: BorrowedFd<'_>, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    // Room for one descriptor's control message, aligned as `cmsghdr` is.
    let mut control = [0u64; 4];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // SAFETY: an all-zero `msghdr` is valid (no name, no buffers); its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic on a length.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as usize;
    // SAFETY: the control buffer holds CMSG_SPACE(one int) (checked by the assertion), so the
    // first header and its data lie within it; `msg` and what it points at live through
    // `sendmsg`, which only reads `iov`'s bytes.
    let sent = unsafe {
        assert!(msg.msg_controllen <= size_of_val(&control));
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as usize;
        libc::CMSG_DATA(c).cast::<libc::c_int>().write_unaligned(fd.as_raw_fd());
        libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// The calling thread's id.
#[cfg(test)]
pub fn gettid() -> i32 {
    // SAFETY: `gettid` takes no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// The effective uid of the server.
pub fn euid() -> u32 {
    // SAFETY: `geteuid` takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether this process may write into `dir` (`access(W_OK)`: also false on a read-only mount,
/// which permission bits do not show to root).
pub fn writable(dir: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    unsafe { libc::access(path.as_ptr(), libc::W_OK) == 0 }
}

/// Waits up to `timeout` for a change of a kernfs file `fd` is open on (a cgroup's
/// `cgroup.events`), which the kernel signals as `POLLPRI`: true when it changed (or the wait
/// was interrupted), false when the time ran out. Read the file before each wait: a change since
/// the last read ends the wait at once, so none is missed.
pub fn wait_changed(fd: &impl AsRawFd, timeout: std::time::Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: `pfd` is one valid `pollfd` and `ts` one valid `timespec`, both outliving the
    // call; the count says one; no signal mask is passed.
    let r = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    match r {
        0 => Ok(false),
        r if r > 0 => Ok(true),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted { Ok(true) } else { Err(e) }
        }
    }
}

fn c_path(path: &std::path::Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Whether `path` is on a tmpfs (`statfs`'s `f_type`).
pub fn on_tmpfs(path: &std::path::Path) -> io::Result<bool> {
    let path = c_path(path)?;
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string and `st` a `statfs` the kernel writes, both
    // outliving the call.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type == libc::TMPFS_MAGIC)
}

/// Mounts a tmpfs named `source` on `target` (`nosuid,nodev,noexec`) with the options `data`.
pub fn mount_tmpfs(source: &str, target: &std::path::Path, data: &str) -> io::Result<()> {
    let (source, target) = (std::ffi::CString::new(source)?, c_path(target)?);
    let (fstype, data) = (c"tmpfs", std::ffi::CString::new(data)?);
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let r = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast()) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Detaches the mount on `target` (`umount2(MNT_DETACH)`): gone from the tree at once, freed
/// when nothing uses it any more.
pub fn umount_detach(target: &std::path::Path) -> io::Result<()> {
    let target = c_path(target)?;
    // SAFETY: `target` is a NUL-terminated string that outlives the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

pub const SIGKILL: i32 = libc::SIGKILL;
pub const SIGSTOP: i32 = libc::SIGSTOP;

/// The soft limit on this process's open files (`RLIMIT_NOFILE`), read without opening a file.
pub fn open_files_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `getrlimit` writes one plain C struct that lives on this stack frame.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 0;
    }
    limit.rlim_cur
}

/// Moves the calling thread into the network namespace `ns` (an open `/run/netns/<name>` or
/// `/proc/<pid>/ns/net`).
#[cfg(test)]
pub fn setns_net(ns: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: `setns` takes a descriptor and a flag, no pointers.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_signals_init_or_everyone() {
        assert!(kill(1, SIGKILL, false).is_err());
        assert!(kill(0, SIGKILL, true).is_err());
        assert!(kill(-5, SIGKILL, false).is_err());
    }

    #[test]
    fn a_pidfd_of_this_process_opens() {
        assert!(pidfd_open(std::process::id() as i32).is_ok());
        assert!(pidfd_open(0).is_err());
    }
}

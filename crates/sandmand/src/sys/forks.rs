//! What the fork server (`crate::fork_server`) needs beyond std: a message with a descriptor on
//! a `SOCK_SEQPACKET` socket, and a child's own process group, descriptors, environment and
//! command line.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

/// Receives one message into `buf`, with the one descriptor it may carry (`SCM_RIGHTS`, opened
/// close-on-exec; any more are closed). `Ok((0, None))` once the peer has closed its end.
/// A message longer than `buf` is an error, never cut short.
pub fn recv_with_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    // Room for a control message of a few descriptors, aligned as `cmsghdr` is.
    let mut control = [0u64; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero `msghdr` is valid (no name, no buffers); its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control);
    let n = loop {
        // SAFETY: `msg` points at `iov` (over `buf`) and `control`, all live and writable for the
        // whole call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: `msg` is the header `recvmsg` filled; the CMSG_* macros walk its control buffer
    // within `msg_controllen`, and each SCM_RIGHTS payload is descriptors the kernel just
    // installed in this process, owned from here on (read unaligned: the payload need not be).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<libc::c_int>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a message longer than the fork server takes"));
    }
    Ok((n, fds.into_iter().next()))
}

/// Sends one message (no `SIGPIPE` when the peer is gone: `EPIPE` instead).
pub fn send(sock: BorrowedFd<'_>, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: the pointer and length describe a live byte slice.
    let n = unsafe { libc::send(sock.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Makes descriptor `target` a copy of `fd` (not close-on-exec), closing what `target` was.
pub fn dup_onto(fd: BorrowedFd<'_>, target: i32) -> io::Result<()> {
    // SAFETY: `dup2` takes two descriptor numbers and no pointers.
    let rc = unsafe { libc::dup2(fd.as_raw_fd(), target) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Puts this process in a process group of its own.
pub fn own_process_group() -> io::Result<()> {
    // SAFETY: `setpgid` takes two integers and no pointers.
    let rc = unsafe { libc::setpgid(0, 0) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Replaces this process's environment with `vars`. Only for a single-threaded process (a
/// fork server's child before it starts anything): no other thread can read the environment
/// meanwhile.
pub fn replace_env(vars: &[(OsString, OsString)]) -> io::Result<()> {
    super::single_threaded()?;
    for (key, _) in std::env::vars_os() {
        // SAFETY: the process is single-threaded (checked above), so nothing reads the
        // environment while it changes.
        unsafe { std::env::remove_var(key) };
    }
    for (key, value) in vars {
        // SAFETY: as above.
        unsafe { std::env::set_var(key, value) };
    }
    Ok(())
}

/// The kernel's `struct prctl_mm_map` (linux/prctl.h), for `PR_SET_MM_MAP`.
#[repr(C)]
#[derive(Debug)]
struct MmMap {
    start_code: u64,
    end_code: u64,
    start_data: u64,
    end_data: u64,
    start_brk: u64,
    brk: u64,
    start_stack: u64,
    arg_start: u64,
    arg_end: u64,
    env_start: u64,
    env_end: u64,
    auxv: *mut u64,
    auxv_size: u32,
    exe_fd: u32,
}

const PR_SET_MM_MAP: libc::c_ulong = 14;

/// Points this process's command line (what `/proc/<pid>/cmdline` and `ps` show) at `argv`, as
/// an exec of it would have set it: a fork server's child shows the server's otherwise. The
/// bytes are leaked, as a command line lives as long as its process.
///
/// Through `PR_SET_MM_MAP`, which takes `CAP_CHECKPOINT_RESTORE` (or `CAP_SYS_ADMIN`), not
/// `CAP_SYS_RESOURCE` as the single `PR_SET_MM_ARG_*` do: every other field is this process's
/// own, as `/proc/self/stat` and `brk` say.
pub fn set_cmdline(argv: &[OsString]) -> io::Result<()> {
    let mut line = Vec::new();
    for arg in argv {
        line.extend_from_slice(arg.as_bytes());
        line.push(0);
    }
    let line: &'static mut [u8] = Box::leak(line.into_boxed_slice());
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let field = |n: usize| {
        super::ns::stat_field(&stat, n)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no field {n} in /proc/self/stat")))
    };
    // SAFETY: `brk(0)` changes nothing and answers the current break.
    let brk = unsafe { libc::syscall(libc::SYS_brk, 0 as libc::c_ulong) } as u64;
    let map = MmMap {
        start_code: field(26)?,
        end_code: field(27)?,
        start_stack: field(28)?,
        start_data: field(45)?,
        end_data: field(46)?,
        start_brk: field(47)?,
        brk,
        arg_start: line.as_ptr() as u64,
        arg_end: line.as_ptr() as u64 + line.len() as u64,
        env_start: field(50)?,
        env_end: field(51)?,
        auxv: std::ptr::null_mut(),
        auxv_size: 0,
        exe_fd: u32::MAX,
    };
    // SAFETY: the pointer and size describe `map`, a live `prctl_mm_map`; its one pointer (auxv)
    // is null with size 0, which the kernel leaves alone, as it does the exe link for fd -1. The
    // new command line is leaked memory, alive as long as the process.
    let rc = unsafe {
        libc::prctl(libc::PR_SET_MM, PR_SET_MM_MAP, std::ptr::from_ref(&map), size_of::<MmMap>() as libc::c_ulong, 0)
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

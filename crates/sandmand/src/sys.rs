//! The daemon's only `unsafe`: thin wrappers over the system calls std does not expose
//! (`wait4` with resource usage, signals to process groups, the child subreaper flag, rlimits,
//! namespaces and mounts for `--isolate`).
#![allow(unsafe_code)]

pub mod forks;
pub mod netlink;
pub mod ns;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use sandman_wire::daemon::Usage;

/// What `wait4` reported for one child.
#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    pub pid: i32,
    /// The raw wait status.
    pub status: i32,
    pub usage: Usage,
}

impl Reaped {
    pub fn exit_code(&self) -> Option<i32> {
        libc::WIFEXITED(self.status).then(|| libc::WEXITSTATUS(self.status))
    }

    pub fn signal(&self) -> Option<i32> {
        libc::WIFSIGNALED(self.status).then(|| libc::WTERMSIG(self.status))
    }
}

/// Reaps one exited child of any pid without blocking. `Ok(None)` when none has exited (or
/// there are no children at all).
pub fn reap_any() -> io::Result<Option<Reaped>> {
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live, writable locals of the right types.
    let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut ru) };
    match pid {
        0 => Ok(None),
        p if p > 0 => Ok(Some(Reaped { pid: p, status, usage: usage_of(&ru) })),
        _ => {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ECHILD) { Ok(None) } else { Err(err) }
        }
    }
}

/// The summed usage of every child reaped so far, and their largest peak RSS.
pub fn children_usage() -> io::Result<Usage> {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pointer is to a live, writable local of the right type.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usage_of(&ru))
}

fn usage_of(ru: &libc::rusage) -> Usage {
    let ms = |tv: libc::timeval| (tv.tv_sec as u64) * 1000 + (tv.tv_usec as u64) / 1000;
    Usage { cpu_user_ms: ms(ru.ru_utime), cpu_system_ms: ms(ru.ru_stime), max_rss_kib: ru.ru_maxrss as u64 }
}

/// Sends `signal` to every process of the group `pgid`. A group that is already gone is not
/// an error.
pub fn kill_group(pgid: i32, signal: i32) -> io::Result<()> {
    if pgid <= 1 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: `kill` takes no pointers; a negative pid addresses the process group.
    ok_unless_gone(unsafe { libc::kill(-pgid, signal) })
}

/// Sends `signal` to one process. A process that is already gone is not an error.
pub fn kill_pid(pid: i32, signal: i32) -> io::Result<()> {
    if pid <= 1 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: `kill` takes no pointers.
    ok_unless_gone(unsafe { libc::kill(pid, signal) })
}

/// Sends `signal` to every process this one may signal but itself: used as PID 1 of a sandbox,
/// where that is exactly the sandbox's processes.
pub fn kill_all_others(signal: i32) -> io::Result<()> {
    // SAFETY: `kill` takes no pointers; pid -1 means every process we may signal but ourselves.
    ok_unless_gone(unsafe { libc::kill(-1, signal) })
}

fn ok_unless_gone(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) { Ok(()) } else { Err(err) }
}

/// Makes orphaned descendants of this process re-parent to it rather than to init, so that the
/// daemon reaps them and can find them to kill them even when it is not PID 1.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument and no pointers.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The effective uid of the daemon.
pub fn euid() -> u32 {
    // SAFETY: `geteuid` takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

/// The effective gid of the daemon.
pub fn egid() -> u32 {
    // SAFETY: `getegid` takes no arguments and cannot fail.
    unsafe { libc::getegid() }
}

/// Flushes the whole file system holding `file` to disk (`syncfs(2)`): one call for everything
/// an archive extraction wrote, rather than one `fsync` per file.
pub fn syncfs(file: &std::fs::File) -> io::Result<()> {
    // SAFETY: syncfs takes a file descriptor, which `file` keeps open for the call.
    if unsafe { libc::syncfs(file.as_raw_fd()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Swaps the entries at `a` and `b`, both of which must exist, in one step
/// (`renameat2(RENAME_EXCHANGE)`): each name shows one of the two files at every moment.
pub fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    let (a, b) = (c_path(a)?, c_path(b)?);
    // SAFETY: both are NUL-terminated paths that live across the call; AT_FDCWD takes them as
    // they are, relative to the working directory.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The type of the file system holding `path` (`statfs(2)`'s `f_type`, a `*_MAGIC` number).
pub fn fs_type(path: &Path) -> io::Result<i64> {
    let path = c_path(path)?;
    // SAFETY: an all-zero `statfs` is a valid value of the plain C struct the call fills.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` a valid, writable struct, both live across the
    // call.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type)
}

/// Fills `buf` from the kernel's random source (no `/dev/urandom` needed in the image).
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the pointer and length describe the live, writable slice `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

/// A random 128-bit value as 32 hex digits.
pub fn random_hex() -> String {
    let mut buf = [0u8; 16];
    if random_bytes(&mut buf).is_err() {
        // getrandom(2) only fails on kernels older than 3.17; fall back to time and pid.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        buf[..8].copy_from_slice(&(now.as_nanos() as u64).to_le_bytes());
        buf[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// Number of signal by its name (`TERM`, `SIGTERM`, case-insensitive).
pub fn signal_by_name(name: &str) -> Option<i32> {
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    let n = match bare {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "ABRT" => libc::SIGABRT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "PIPE" => libc::SIGPIPE,
        "ALRM" => libc::SIGALRM,
        "TERM" => libc::SIGTERM,
        "CONT" => libc::SIGCONT,
        "STOP" => libc::SIGSTOP,
        "TSTP" => libc::SIGTSTP,
        "WINCH" => libc::SIGWINCH,
        _ => return None,
    };
    Some(n)
}

/// Whether `n` is a signal number this system knows.
pub fn is_valid_signal(n: i32) -> bool {
    (1..=64).contains(&n)
}

/// Resource limits set on every child the daemon starts (never on the daemon itself).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rlimits {
    /// `RLIMIT_AS`: bytes of virtual address space per process.
    pub address_space: Option<u64>,
    /// `RLIMIT_FSIZE`: the largest file a process may write, in bytes.
    pub file_size: Option<u64>,
    /// `RLIMIT_NOFILE`: open file descriptors per process.
    pub open_files: Option<u64>,
}

impl Rlimits {
    pub fn is_empty(&self) -> bool {
        self.address_space.is_none() && self.file_size.is_none() && self.open_files.is_none()
    }
}

/// Sets the daemon's own `RLIMIT_FSIZE` (soft and hard, never above the hard limit it has) to
/// `bytes`, with SIGXFSZ ignored, so that the daemon's own writes past it fail with `EFBIG`
/// instead of killing it. Every child inherits the limit without setting it between fork and exec,
/// so that a plain command still starts with `posix_spawn`; the caller has children reset
/// SIGXFSZ to its default, so that a command writing past the limit is stopped as it would be
/// with the limit set in it. Nothing the daemon writes for itself comes near a sandbox's disk.
pub fn hold_file_size(bytes: u64) -> io::Result<()> {
    // SAFETY: SIG_IGN is a valid disposition for SIGXFSZ, which no handler of ours uses.
    if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    apply_rlimits(Rlimits { file_size: Some(bytes), ..Rlimits::default() })
}

/// Makes `cmd` set `limits` (soft and hard) in the child just before it execs.
pub fn set_rlimits_on_exec(cmd: &mut Command, limits: Rlimits) {
    if limits.is_empty() {
        return;
    }
    // SAFETY: the closure runs in the forked child before exec; it only calls getrlimit and
    // setrlimit, which are async-signal-safe, and allocates nothing (an OS error is a plain code).
    unsafe {
        cmd.pre_exec(move || apply_rlimits(limits));
    }
}

fn apply_rlimits(limits: Rlimits) -> io::Result<()> {
    let wanted = [
        (libc::RLIMIT_AS, limits.address_space),
        (libc::RLIMIT_FSIZE, limits.file_size),
        (libc::RLIMIT_NOFILE, limits.open_files),
    ];
    for (resource, value) in wanted {
        let Some(value) = value else { continue };
        let mut current = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: the pointer is to a live, writable local of the right type.
        if unsafe { libc::getrlimit(resource, &mut current) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Never above the hard limit we inherited: raising it needs privileges, and the limit is
        // already tighter than asked.
        let v: libc::rlim_t = value.min(current.rlim_max);
        let limit = libc::rlimit { rlim_cur: v, rlim_max: v };
        // SAFETY: the pointer is to a live local of the right type.
        if unsafe { libc::setrlimit(resource, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Namespaces `--isolate` asks for.
pub const NS_MOUNT: i32 = libc::CLONE_NEWNS;
pub const NS_PID: i32 = libc::CLONE_NEWPID;
pub const NS_IPC: i32 = libc::CLONE_NEWIPC;
pub const NS_UTS: i32 = libc::CLONE_NEWUTS;
pub const NS_NET: i32 = libc::CLONE_NEWNET;

/// Moves this process into new namespaces (`NS_*` flags); a new pid namespace applies to the
/// children forked afterwards.
pub fn unshare(flags: i32) -> io::Result<()> {
    // SAFETY: `unshare` takes one integer and no pointers.
    if unsafe { libc::unshare(flags) } == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The number of threads of this process, from `/proc/self/task`.
fn thread_count() -> io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

/// Fails unless this process has one thread, as a fork needs.
fn single_threaded() -> io::Result<()> {
    match thread_count()? {
        1 => Ok(()),
        n => Err(io::Error::other(format!("cannot fork: the process has {n} threads, not 1"))),
    }
}

/// Forks. `Ok(None)` in the child, `Ok(Some(pid))` in the parent. Refuses unless the process is
/// single-threaded: a fork of a threaded process may inherit a lock held by a thread that does
/// not exist in the child.
pub fn fork() -> io::Result<Option<i32>> {
    single_threaded()?;
    // SAFETY: the process is single-threaded (checked above), so the child inherits no lock held
    // by another thread and may go on running ordinary Rust code.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Some(pid)),
    }
}

/// A set of signals, for blocking and waiting.
fn sigset(signals: &[i32]) -> io::Result<libc::sigset_t> {
    // SAFETY: an all-zero `sigset_t` is a valid value to hand to `sigemptyset`.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: the pointer is to a live, writable local.
    unsafe { libc::sigemptyset(&mut set) };
    for &sig in signals {
        // SAFETY: the pointer is to a live, writable local; a bad number is reported as -1.
        if unsafe { libc::sigaddset(&mut set, sig) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(set)
}

/// Blocks (`block: true`) or unblocks `signals` for the calling thread.
pub fn mask_signals(signals: &[i32], block: bool) -> io::Result<()> {
    let set = sigset(signals)?;
    let how = if block { libc::SIG_BLOCK } else { libc::SIG_UNBLOCK };
    // SAFETY: `set` is a live, initialised sigset; the old mask is not asked for (null).
    let rc = unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
    if rc == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(rc)) }
}

/// Waits for one of `signals`, which must be blocked; returns its number.
pub fn wait_signal(signals: &[i32]) -> io::Result<i32> {
    let set = sigset(signals)?;
    loop {
        // SAFETY: `set` is a live sigset; a null siginfo pointer is allowed.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        if sig >= 0 {
            return Ok(sig);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// How a child ended, without blocking: `Ok(None)` while it runs.
pub fn try_wait_pid(pid: i32) -> io::Result<Option<i32>> {
    let mut status: libc::c_int = 0;
    // SAFETY: the pointer is to a live, writable local.
    match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
        0 => Ok(None),
        -1 => Err(io::Error::last_os_error()),
        _ => Ok(Some(status)),
    }
}

/// The exit code a shell would report for a raw wait status: the code, or 128 + the signal.
pub fn exit_code_of(status: i32) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

/// Has the kernel send `signal` to this process when its parent dies.
pub fn set_parent_death_signal(signal: i32) -> io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes one integer argument and no pointers.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Whether the write end of the pipe whose read end is `fd` has been closed everywhere (used to
/// learn, without blocking, that a parent is already gone).
pub fn is_hung_up(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one live, writable pollfd; a zero timeout never blocks.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pfd.revents & libc::POLLHUP != 0)
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn mount(source: Option<&Path>, target: &Path, fstype: Option<&str>, flags: libc::c_ulong) -> io::Result<()> {
    let source = source.map(c_path).transpose()?;
    let target = c_path(target)?;
    let fstype =
        fstype.map(|f| CString::new(f).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))).transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a live NUL-terminated string owned by this frame; the
    // data argument is null.
    let rc = unsafe { libc::mount(ptr(&source), target.as_ptr(), ptr(&fstype), flags, std::ptr::null()) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Stops mount events propagating between this mount namespace and the one it came from.
pub fn make_mounts_private() -> io::Result<()> {
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE)
}

/// Mounts a fresh `proc` on `/proc`, showing the current pid namespace.
pub fn mount_proc() -> io::Result<()> {
    mount(Some(Path::new("proc")), Path::new("/proc"), Some("proc"), libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC)
}

/// Bind-mounts `source` onto `target`.
pub fn bind_mount(source: &Path, target: &Path) -> io::Result<()> {
    mount(Some(source), target, None, libc::MS_BIND | libc::MS_REC)
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: `socket` takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: an all-zero `ifreq` (name and union) is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `req` is a live, writable ifreq naming an interface; SIOCGIFFLAGS fills its flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS set the `ifru_flags` member of the union, so reading it is defined.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: `req` is a live ifreq with the name and the new flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What a child does between fork and exec: default signal dispositions and an empty signal mask
/// when the daemon ignores signals (one started by `cmd &` inherits SIGINT and SIGQUIT ignored, and
/// ignored signals survive exec; std itself empties the mask and resets SIGPIPE), on a terminal a
/// session of its own with that terminal as its controlling one, and the `--rlimit-*` limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChildSetup {
    pub rlimits: Rlimits,
    /// Start a new session (`setsid`) and make stdin, a terminal, its controlling terminal.
    pub controlling_tty: bool,
    /// Reset every signal to its default: the daemon ignores some ([`ignored_signals`]).
    pub reset_signals: bool,
}

/// A set of signals (1 to 64), small enough to copy into every launch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SignalSet(u64);

impl SignalSet {
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// This set and `sig` (outside 1 to 64: this set).
    #[must_use]
    pub fn with(self, sig: i32) -> SignalSet {
        match sig {
            1..=64 => SignalSet(self.0 | 1 << (sig - 1)),
            _ => self,
        }
    }

    #[must_use]
    pub fn union(self, other: SignalSet) -> SignalSet {
        SignalSet(self.0 | other.0)
    }
}

/// The C library's own real-time signals, below `SIGRTMIN` (32 and 33 under glibc): no program
/// sees them through `sigaction`, and glibc's `posix_spawn` leaves them ignored in every child
/// unless told to set them to their default.
fn reserved_signals() -> SignalSet {
    (32..libc::SIGRTMIN()).fold(SignalSet::default(), SignalSet::with)
}

/// The signals this process ignores (SIG_IGN), which its children would inherit through exec:
/// SIGPIPE aside, which the Rust runtime ignores in every program and every start of a child
/// resets. A daemon started by a Rust program (std's `Command` is glibc's `posix_spawn`) has one
/// of glibc's own signals ignored ([`reserved_signals`]).
pub fn ignored_signals() -> SignalSet {
    let mut out = SignalSet::default();
    for sig in 1..65 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || sig == libc::SIGPIPE {
            continue;
        }
        // The kernel's `struct sigaction`: handler, flags, restorer, 8-byte mask.
        let mut old = [0u64; 4];
        // SAFETY: a null new action only reads the current one into `old`, a live local the
        // size of the kernel's struct.
        let rc =
            unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, std::ptr::null::<u64>(), old.as_mut_ptr(), 8usize) };
        if rc == 0 && old[0] == libc::SIG_IGN as u64 {
            out = out.with(sig);
        }
    }
    out
}

/// Makes `cmd` run `setup` in the child just before it execs. Without anything to do there
/// (no terminal, no limits, no ignored signal), the spawn keeps std's fast path (no `pre_exec`).
pub fn set_child_setup_on_exec(cmd: &mut Command, setup: ChildSetup) {
    if !setup.controlling_tty && !setup.reset_signals && setup.rlimits.is_empty() {
        return;
    }
    // SAFETY: the closure runs in the forked child before exec; it only calls sigprocmask,
    // sigaction, setsid, ioctl, getrlimit and setrlimit, which are async-signal-safe, and
    // allocates nothing (an OS error is a plain code).
    unsafe {
        cmd.pre_exec(move || {
            if setup.reset_signals {
                reset_signals();
            }
            if setup.controlling_tty {
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            apply_rlimits(setup.rlimits)
        });
    }
}

/// What [`posix_spawn`] starts.
#[derive(Debug)]
pub struct SpawnPlan<'a> {
    /// The program's path (with a `/`; PATH was searched already).
    pub program: &'a Path,
    pub argv: &'a [String],
    pub env: &'a crate::spawn::Env,
    pub cwd: &'a Path,
    /// The child's stdin, stdout and stderr, each duplicated onto 0, 1 and 2.
    pub stdio: [BorrowedFd<'a>; 3],
    /// Signals the child sets back to their default action (SIGPIPE always is): those the
    /// daemon inherited ignored ([`ignored_signals`]).
    pub reset_signals: SignalSet,
}

/// Starts a process with the C library's `posix_spawn`: a vfork-style start
/// (`clone(CLONE_VM|CLONE_VFORK)`) that lends the child the daemon's memory until it execs,
/// rather than a fork, which copies the daemon's page tables, then pays for copy-on-write faults
/// and TLB shootdowns on every thread, and for tearing the copy down at the exec. The child gets a
/// process group of its own, an empty signal mask, SIGPIPE, the C library's own signals and
/// `reset_signals` at their default action (the daemon ignores SIGPIPE, as every Rust program
/// does, and a command must not inherit that: `yes | head -1` would end in `Broken pipe` errors), `stdio` as 0, 1 and 2 (every other
/// descriptor of the daemon is close-on-exec), and `cwd`. Answers its pid once it has exec'd; a failed exec
/// is this call's error.
pub fn posix_spawn(plan: &SpawnPlan<'_>) -> io::Result<i32> {
    let nul = || io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a command's argv, environment or cwd");
    let program = CString::new(plan.program.as_os_str().as_bytes()).map_err(|_| nul())?;
    let cwd = CString::new(plan.cwd.as_os_str().as_bytes()).map_err(|_| nul())?;
    let argv = CStrings::pack(plan.argv.iter().map(|a| [a.as_bytes()])).ok_or_else(nul)?;
    let envp = CStrings::pack(plan.env.iter().map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()])).ok_or_else(nul)?;
    let (argv_ptrs, envp_ptrs) = (argv.pointers(), envp.pointers());
    let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(rc)) };
    // SAFETY: `attr` and `actions` are initialised by their `_init` calls before any other use
    // and destroyed once, below, whatever happens between; every pointer passed is to a live
    // local (the packed strings and the NULL-terminated pointer arrays outlive the call), and
    // posix_spawn only reads them. The descriptors in `stdio` are borrowed, so open, for the call.
    // A `sigset_t` is at least one aligned 64-bit word (128 bytes under glibc), so writing its
    // first word stays inside the live local.
    unsafe {
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        check(libc::posix_spawnattr_init(&mut attr))?;
        let mut actions: libc::posix_spawn_file_actions_t = std::mem::zeroed();
        if let Err(e) = check(libc::posix_spawn_file_actions_init(&mut actions)) {
            libc::posix_spawnattr_destroy(&mut attr);
            return Err(e);
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        let mut to_default: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut to_default);
        // The kernel's layout, which glibc's is: signal n is bit n - 1 of the first word. Set
        // directly, because `sigaddset` refuses glibc's own signals, which its `posix_spawn`
        // would otherwise leave ignored in the child.
        *(&raw mut to_default).cast::<u64>() |= plan.reset_signals.with(libc::SIGPIPE).union(reserved_signals()).0;
        let flags =
            (libc::POSIX_SPAWN_SETPGROUP | libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF) as libc::c_short;
        let mut pid: libc::pid_t = 0;
        let result = check(libc::posix_spawnattr_setpgroup(&mut attr, 0))
            .and_then(|()| check(libc::posix_spawnattr_setsigmask(&mut attr, &empty)))
            .and_then(|()| check(libc::posix_spawnattr_setsigdefault(&mut attr, &to_default)))
            .and_then(|()| check(libc::posix_spawnattr_setflags(&mut attr, flags)))
            .and_then(|()| {
                for (target, fd) in plan.stdio.iter().enumerate() {
                    check(libc::posix_spawn_file_actions_adddup2(&mut actions, fd.as_raw_fd(), target as libc::c_int))?;
                }
                check(libc::posix_spawn_file_actions_addchdir_np(&mut actions, cwd.as_ptr()))
            })
            .and_then(|()| {
                check(libc::posix_spawn(
                    &mut pid,
                    program.as_ptr(),
                    &actions,
                    &attr,
                    argv_ptrs.as_ptr(),
                    envp_ptrs.as_ptr(),
                ))
            });
        libc::posix_spawn_file_actions_destroy(&mut actions);
        libc::posix_spawnattr_destroy(&mut attr);
        result.map(|()| pid)
    }
}

/// Which end of a pipe the daemon keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepEnd {
    Read,
    Write,
}

/// A pipe between the daemon and a command it starts: the daemon's end (`keep`) non-blocking,
/// for the event loop, and the command's blocking, as programs expect of their stdio; both
/// close-on-exec. Answers (the daemon's end, the command's end). Two system calls, where
/// `std::io::pipe` and tokio's checked conversion take five.
pub fn pipe_for_child(keep: KeepEnd) -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a live array of the two ints pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made by pipe2 and are owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let (ours, theirs) = match keep {
        KeepEnd::Read => (read, write),
        KeepEnd::Write => (write, read),
    };
    // A fresh pipe end has no status flag but its access mode, which F_SETFL leaves alone.
    // SAFETY: F_SETFL takes an int by value.
    if unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((ours, theirs))
}

/// NUL-terminated strings packed in one buffer: two allocations for an environment of dozens of
/// variables, rather than two per variable.
#[derive(Debug)]
struct CStrings {
    buf: Vec<u8>,
    starts: Vec<usize>,
}

impl CStrings {
    /// Each item's parts joined, then a NUL; `None` when a part holds a NUL.
    fn pack<'a, const N: usize>(items: impl Iterator<Item = [&'a [u8]; N]>) -> Option<CStrings> {
        let mut out = CStrings { buf: Vec::new(), starts: Vec::with_capacity(items.size_hint().0) };
        for parts in items {
            out.starts.push(out.buf.len());
            for part in parts {
                if part.contains(&0) {
                    return None;
                }
                out.buf.extend_from_slice(part);
            }
            out.buf.push(0);
        }
        Some(out)
    }

    /// The NULL-terminated array of pointers to each string that exec wants; valid while `self`
    /// is alive and unchanged.
    fn pointers(&self) -> Vec<*mut libc::c_char> {
        let base = self.buf.as_ptr();
        let mut ptrs: Vec<*mut libc::c_char> =
            self.starts.iter().map(|&i| base.wrapping_add(i).cast::<libc::c_char>().cast_mut()).collect();
        ptrs.push(std::ptr::null_mut());
        ptrs
    }
}

/// Where `program` is, as `execvp` would find it: as it is when it holds a `/`, else the first
/// executable regular file of that name in `path`'s directories (relative ones from `cwd`).
pub fn find_program(program: &str, path: &str, cwd: &Path) -> io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Ok(std::path::PathBuf::from(program));
    }
    for dir in path.split(':') {
        let dir = if dir.is_empty() { Path::new(".") } else { Path::new(dir) };
        let candidate = cwd.join(dir).join(program);
        if std::fs::metadata(&candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0) {
            return Ok(candidate);
        }
    }
    Err(io::Error::from_raw_os_error(libc::ENOENT))
}

/// Empties the signal mask and sets every signal's disposition to its default. Handlers are reset
/// by exec anyway; ignored signals are not. The raw system call reaches the two real-time signals
/// the C library keeps for itself (and refuses through `sigaction`), which can be inherited
/// ignored too.
fn reset_signals() {
    // The kernel's `struct sigaction` with SIG_DFL (0), no flags, no restorer, an empty mask.
    let default = [0u64; 4];
    // SAFETY: an all-zero `sigset_t` is a valid value; every pointer is to a live local, and
    // rt_sigaction reads `default` as the kernel's sigaction (handler, flags, restorer, 8-byte
    // mask), whose every field is zero for SIG_DFL.
    unsafe {
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        for sig in 1..65 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::syscall(libc::SYS_rt_sigaction, sig, default.as_ptr(), std::ptr::null_mut::<u64>(), 8usize);
            }
        }
    }
}

/// Opens a new pseudo-terminal of `rows` × `cols`: the master (non-blocking, close-on-exec) and
/// the slave (close-on-exec; the child gets its own copies as stdin, stdout and stderr). Opens
/// `/dev/ptmx`, else `/dev/pts/ptmx`; the slave comes from `TIOCGPTPEER` where the kernel has it
/// (no path lookup), else from `/dev/pts/N`.
pub fn open_pty(rows: u16, cols: u16) -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK;
    let mut master = None;
    let mut last = io::Error::from(io::ErrorKind::NotFound);
    for path in [c"/dev/ptmx", c"/dev/pts/ptmx"] {
        // SAFETY: the path is a NUL-terminated literal; `open` takes no other pointer.
        let fd = unsafe { libc::open(path.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: `fd` was just opened and is owned by nothing else.
            master = Some(unsafe { OwnedFd::from_raw_fd(fd) });
            break;
        }
        last = io::Error::last_os_error();
    }
    let master = master.ok_or(last)?;
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int from the live local.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK as _, &unlock) } != 0 {
        return Err(io::Error::last_os_error());
    }
    set_pty_size(master.as_fd(), rows, cols)?;
    let peer_flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor.
    let fd = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER as _, peer_flags) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by the kernel and is owned by nothing else.
        return Ok((master, unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes one unsigned int into the live local.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTN as _, &mut n) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let path = CString::new(format!("/dev/pts/{n}")).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `path` is a live NUL-terminated string.
    let fd = unsafe { libc::open(path.as_ptr(), peer_flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok((master, unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Sets a terminal's size; the kernel sends SIGWINCH to its foreground process group.
pub fn set_pty_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    let size = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the live local.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ as _, &size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub const SIGKILL: i32 = libc::SIGKILL;
pub const SIGTERM: i32 = libc::SIGTERM;
pub const SIGINT: i32 = libc::SIGINT;
pub const SIGCHLD: i32 = libc::SIGCHLD;
pub const SIGXFSZ: i32 = libc::SIGXFSZ;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_names_last_parenthesis() {
        // A name may hold spaces and a `)`: field 3 is the state, 4 the parent.
        let stat = "42 (a) b (c)) S 7 42 42 0 -1";
        assert_eq!(ns::stat_field(stat, 4), Some(7));
        assert_eq!(ns::stat_field(stat, 5), Some(42));
        assert_eq!(ns::stat_field(stat, 3), None, "the state is no number");
        assert_eq!(ns::stat_field(stat, 2), None);
        assert_eq!(ns::stat_field(stat, 40), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ns::stat_field(&own, 1), None, "fields before the name are not counted");
        assert_eq!(ns::stat_field(&own, 4), Some(u64::from(std::os::unix::process::parent_id())));
    }

    #[test]
    fn signal_names_with_and_without_prefix() {
        assert_eq!(signal_by_name("TERM"), Some(15));
        assert_eq!(signal_by_name("sigkill"), Some(9));
        assert_eq!(signal_by_name("BOGUS"), None);
    }

    #[test]
    fn exchange_swaps_two_names_and_needs_both() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "new").unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&b, "old").unwrap_or_else(|e| panic!("{e}"));
        exchange(&a, &b).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read_to_string(&b).ok().as_deref(), Some("new"));
        assert_eq!(std::fs::read_to_string(&a).ok().as_deref(), Some("old"));
        let missing = exchange(&a, &dir.path().join("c")).err().map(|e| e.kind());
        assert_eq!(missing, Some(io::ErrorKind::NotFound));
    }

    #[test]
    fn random_hex_is_fresh_each_time() {
        let a = random_hex();
        assert_eq!(a.len(), 32);
        assert_ne!(a, random_hex());
    }

    #[test]
    fn rlimits_apply_to_the_child_only() {
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "ulimit -v; ulimit -f; ulimit -n"]).stdout(std::process::Stdio::piped());
        set_rlimits_on_exec(
            &mut cmd,
            Rlimits { address_space: Some(256 << 20), file_size: Some(1 << 20), open_files: Some(64) },
        );
        // Read the output to its end rather than waiting for the child: another test in this binary
        // runs the daemon's reaper, which may reap it first (regression: `No child processes`).
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{e}"));
        let mut text = String::new();
        if let Some(mut out) = child.stdout.take() {
            io::Read::read_to_string(&mut out, &mut text).unwrap_or_else(|e| panic!("{e}"));
        }
        let _ = child.wait();
        // `ulimit -v` is in KiB, `ulimit -f` in 512- or 1024-byte blocks depending on the shell.
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.first().copied(), Some("262144"), "{text}");
        assert!(matches!(lines.get(1).copied(), Some("2048" | "1024")), "{text}");
        assert_eq!(lines.get(2).copied(), Some("64"), "{text}");
        let mut mine = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: the pointer is to a live, writable local.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut mine) }, 0);
        assert_ne!(mine.rlim_cur, 256 << 20, "the test process itself was limited");
    }

    #[test]
    fn packed_c_strings_point_at_each_string_and_refuse_nul() {
        let env = [("A", "1"), ("PATH", "/bin")];
        let packed = CStrings::pack(env.iter().map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()]))
            .unwrap_or_else(|| panic!("refused"));
        let ptrs = packed.pointers();
        assert_eq!(ptrs.len(), 3);
        assert!(ptrs[2].is_null());
        // SAFETY: each pointer is into `packed`, alive, and NUL-terminated by `pack`.
        let strs: Vec<&std::ffi::CStr> = ptrs[..2].iter().map(|&p| unsafe { std::ffi::CStr::from_ptr(p) }).collect();
        assert_eq!(strs, [c"A=1", c"PATH=/bin"]);
        assert!(CStrings::pack([[b"a\0b".as_slice()]].into_iter()).is_none());
    }

    #[test]
    fn refuses_to_signal_init_or_everyone_by_group() {
        assert!(kill_group(1, SIGKILL).is_err());
        assert!(kill_pid(0, SIGKILL).is_err());
    }
}

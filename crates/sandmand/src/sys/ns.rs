//! The system calls of `--isolate`: a fork into new namespaces, joining a user namespace, the
//! mounts that build the sandbox's root, switching to it, ids, capabilities and Landlock.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Namespace flags for [`clone_into`] and [`super::unshare`].
pub const NS_USER: i32 = libc::CLONE_NEWUSER;
pub const NS_CGROUP: i32 = libc::CLONE_NEWCGROUP;

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn c_str(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Forks into new namespaces (`NS_*` flags), as `fork` does but with `clone`'s flags: with a new
/// pid namespace the child is its PID 1. `Ok(None)` in the child. Refuses unless the process is
/// single-threaded, like [`super::fork`].
pub fn clone_into(flags: i32) -> io::Result<Option<i32>> {
    super::single_threaded()?;
    let flags = (flags as libc::c_ulong) | libc::SIGCHLD as libc::c_ulong;
    // SAFETY: with a null stack `clone` behaves as `fork` (the child runs on a copy of this
    // stack); the process is single-threaded (checked above), so the child inherits no lock held
    // by another thread. No pointer arguments are passed (parent/child tid and tls are null).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_int>(),
            std::ptr::null_mut::<libc::c_int>(),
            0 as libc::c_ulong,
        )
    };
    match rc {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Some(pid as i32)),
    }
}

/// Moves this (single-threaded) process into the namespace `fd` names.
pub fn setns(fd: BorrowedFd<'_>, nstype: i32) -> io::Result<()> {
    // SAFETY: `setns` takes a descriptor and a flag, no pointers.
    check(unsafe { libc::setns(fd.as_raw_fd(), nstype) })
}

/// `mount(2)` with its data string.
pub fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(c_path).transpose()?;
    let target = c_path(target)?;
    let fstype = fstype.map(c_str).transpose()?;
    let data = data.map(c_str).transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a live NUL-terminated string owned by this frame.
    check(unsafe { libc::mount(ptr(&source), target.as_ptr(), ptr(&fstype), flags, ptr(&data).cast()) })
}

/// Makes `new_root` the root of this mount namespace, the old one mounted at `put_old` (a
/// directory under `new_root`).
pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let (new_root, put_old) = (c_path(new_root)?, c_path(put_old)?);
    // SAFETY: both pointers are live NUL-terminated strings.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, new_root.as_ptr(), put_old.as_ptr()) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Makes `path` this process's root directory.
pub fn chroot(path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    // SAFETY: `path` is a live NUL-terminated string.
    check(unsafe { libc::chroot(path.as_ptr()) })
}

/// Detaches the mount at `target` and everything under it.
pub fn umount_detach(target: &Path) -> io::Result<()> {
    let target = c_path(target)?;
    // SAFETY: `target` is a live NUL-terminated string.
    check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) })
}

/// Becomes uid and gid 0 of the current user namespace, with no supplementary groups.
pub fn become_root() -> io::Result<()> {
    // SAFETY: a zero-length list with a null pointer is allowed.
    check(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: plain integer arguments.
    check(unsafe { libc::setresgid(0, 0, 0) })?;
    // SAFETY: plain integer arguments.
    check(unsafe { libc::setresuid(0, 0, 0) })
}

/// Sets `no_new_privs`: nothing this process or its children exec gains privileges (setuid bits,
/// file capabilities).
pub fn no_new_privs() -> io::Result<()> {
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integers only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) })
}

/// Makes this process undumpable: no core dumps, no `/proc/<pid>/mem` or ptrace by processes of
/// the same uid. Reset by `execve`, so the commands the daemon starts are unaffected.
pub fn not_dumpable() -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes integers only.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) })
}

/// Drops every capability but `keep` from the bounding set, so no process started from here on
/// can hold them.
pub fn drop_bounding_caps(keep: &[u32]) -> io::Result<()> {
    let last: u32 =
        std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(40);
    for cap in (0..=last).filter(|c| !keep.contains(c)) {
        // SAFETY: PR_CAPBSET_DROP takes integers only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            // A capability this kernel does not know.
            if err.raw_os_error() != Some(libc::EINVAL) {
                return Err(err);
            }
        }
    }
    Ok(())
}

/// Linux capability numbers (`linux/capability.h`).
pub mod cap {
    pub const CHOWN: u32 = 0;
    pub const DAC_OVERRIDE: u32 = 1;
    pub const FOWNER: u32 = 3;
    pub const FSETID: u32 = 4;
    pub const KILL: u32 = 5;
    pub const SETGID: u32 = 6;
    pub const SETUID: u32 = 7;
    pub const SETPCAP: u32 = 8;
    pub const NET_BIND_SERVICE: u32 = 10;
    pub const NET_RAW: u32 = 13;
    pub const SYS_CHROOT: u32 = 18;
    pub const MKNOD: u32 = 27;
    pub const AUDIT_WRITE: u32 = 29;
    pub const SETFCAP: u32 = 31;
}

/// `struct landlock_ruleset_attr` up to `scoped` (Landlock ABI 6).
#[repr(C)]
struct LandlockRulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
const LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1;
const LANDLOCK_SCOPE_SIGNAL: u64 = 2;

/// The Landlock ABI version this kernel offers; `None` without Landlock.
pub fn landlock_abi() -> Option<i64> {
    // SAFETY: a null attribute with size 0 and the VERSION flag only asks for the version.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<LandlockRulesetAttr>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then_some(v)
}

/// Confines this process and everything it starts to its own abstract Unix sockets and signals:
/// nothing inside may connect to an abstract socket made outside, or signal a process outside
/// (Landlock scopes, ABI 6). Needs `no_new_privs` first.
pub fn landlock_scope() -> io::Result<()> {
    let attr = LandlockRulesetAttr {
        handled_access_fs: 0,
        handled_access_net: 0,
        scoped: LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL,
    };
    // SAFETY: `attr` is a live, initialised struct of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const LandlockRulesetAttr,
            size_of::<LandlockRulesetAttr>(),
            0 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor, and nothing else owns it.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    // SAFETY: a ruleset descriptor and no flags.
    let rc = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd.as_raw_fd(), 0 as libc::c_uint) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Sets this process's hostname (of its UTS namespace).
pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe a live byte string.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// `chown` without following a last symlink.
pub fn lchown(path: &Path, uid: u32, gid: u32) -> io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
}

/// Opens the directory `path` and keeps it open at descriptor `at` (close-on-exec) for the rest of
/// the process's life, replacing whatever `at` was.
pub fn keep_dir_at(path: &Path, at: i32) -> io::Result<()> {
    use std::os::fd::IntoRawFd;
    let dir = std::fs::File::open(path)?;
    if !dir.metadata()?.is_dir() {
        return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    let fd = dir.into_raw_fd();
    if fd == at {
        return Ok(());
    }
    // SAFETY: `fd` is a descriptor this function owns (just opened) and `at` a number; dup3 makes
    // `at` a copy of it, then `fd` is closed and never used again.
    let duped = unsafe { libc::dup3(fd, at, libc::O_CLOEXEC) };
    let err = io::Error::last_os_error();
    // SAFETY: as above, `fd` is owned here and not used after.
    unsafe { libc::close(fd) };
    if duped < 0 { Err(err) } else { Ok(()) }
}

/// Makes an overlay whiteout at `path`: a character device numbered 0/0, which an overlay's upper
/// layer holds in place of a lower layer's file or directory to say it is not there.
pub fn whiteout(path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    // SAFETY: `path` is a live NUL-terminated string; the mode and device are integers.
    check(unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) })
}

/// Field `n` of a `/proc/<pid>/stat` line (numbered from 1, as proc(5) does), as a number. The
/// name in field 2 may hold spaces and parentheses, so the fields after it are counted from its
/// last `)`.
pub fn stat_field(stat: &str, n: usize) -> Option<u64> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
}

/// Overwrites this process's command line in place (what `/proc/<pid>/cmdline` reads, which any
/// process of its pid namespace may) with `name` and NULs, as `setproctitle` does: its arguments
/// name host paths. Only this process's copy changes; a parent forked from keeps its own. The
/// arguments must have been parsed into owned values already.
pub fn overwrite_cmdline(name: &str) -> io::Result<()> {
    use std::io::{Seek, Write};
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields 48 and 49: `arg_start`, `arg_end`.
    let (Some(start), Some(end)) = (stat_field(&stat, 48), stat_field(&stat, 49)) else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "no arg_start and arg_end in /proc/self/stat"));
    };
    let len = usize::try_from(end.saturating_sub(start)).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    let mut line = vec![0u8; len];
    let keep = name.len().min(len.saturating_sub(1));
    line[..keep].copy_from_slice(&name.as_bytes()[..keep]);
    // This process's own memory, through the file the kernel offers for it: no pointer needed.
    let mut mem = std::fs::OpenOptions::new().write(true).open("/proc/self/mem")?;
    mem.seek(io::SeekFrom::Start(start))?;
    mem.write_all(&line)
}

/// Mounts a copy of the directory `source` at `target`, read-only, its files' owners and groups
/// seen through the user namespace `userns` (an idmapped mount: a file the host's uid 0 owns is
/// the namespace's root's). One directory on disk so serves every sandbox, whatever its ids.
pub fn mount_idmapped(source: &Path, target: &Path, userns: BorrowedFd<'_>) -> io::Result<()> {
    // From the kernel's uapi (linux/mount.h).
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let (source, target) = (c_path(source)?, c_path(target)?);
    let empty = c_str("")?;
    // SAFETY: `source` is a live NUL-terminated string; the flags are integers.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            source.as_ptr(),
            (OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint) as libc::c_ulong,
        )
    };
    if tree < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `open_tree` just returned this descriptor, owned by nothing else.
    let tree = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(tree as libc::c_int) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: the pointers are to a live empty string and a live `mount_attr` whose size is
    // passed with it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &raw const attr,
            size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the pointers are to live NUL-terminated strings; the descriptor is open.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

pub const MS_RDONLY: libc::c_ulong = libc::MS_RDONLY;
pub const MS_MOVE: libc::c_ulong = libc::MS_MOVE;
pub const MS_NOSUID: libc::c_ulong = libc::MS_NOSUID;
pub const MS_NODEV: libc::c_ulong = libc::MS_NODEV;
pub const MS_NOEXEC: libc::c_ulong = libc::MS_NOEXEC;
pub const MS_BIND: libc::c_ulong = libc::MS_BIND;
pub const MS_REC: libc::c_ulong = libc::MS_REC;
pub const MS_REMOUNT: libc::c_ulong = libc::MS_REMOUNT;
pub const MS_PRIVATE: libc::c_ulong = libc::MS_PRIVATE;

/// Ends this process at once, running no destructors or exit handlers: for a forked helper.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` takes an integer and never returns.
    unsafe { libc::_exit(code) }
}

/// Waits for child `pid` to end (blocking); its raw wait status.
pub fn wait_pid(pid: i32) -> io::Result<i32> {
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: the pointer is to a live, writable local.
        if unsafe { libc::waitpid(pid, &mut status, 0) } >= 0 {
            return Ok(status);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

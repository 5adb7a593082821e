//! `--isolate`: moves the daemon into new namespaces before its runtime starts, forking so that
//! the daemon is PID 1 of its own pid namespace while a tiny single-threaded waiter stays outside
//! to forward signals and report its exit code. Start at [`enter`].

use std::io::{PipeReader, PipeWriter};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crate::sys;

/// What `--isolate` asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Isolation {
    /// A network namespace too (`--isolate-net`), with only `lo`, brought up.
    pub net: bool,
    /// Bind-mounted onto `/tmp` (`--isolate-tmp`), so the sandbox's `/tmp` is its own.
    pub tmp: Option<PathBuf>,
}

/// Why isolation could not be set up. The daemon does not start without it.
#[derive(Debug, thiserror::Error)]
pub enum IsolateError {
    #[error("cannot create the sandbox's namespaces (unshare needs root or CAP_SYS_ADMIN)")]
    Unshare(#[source] std::io::Error),
    #[error("cannot block signals for the waiter")]
    Signals(#[source] std::io::Error),
    #[error("cannot fork the sandbox's init")]
    Fork(#[source] std::io::Error),
    #[error("cannot set the parent-death signal")]
    DeathSignal(#[source] std::io::Error),
    #[error("the waiting parent exited before the daemon started")]
    ParentGone,
    #[error("cannot make the mount tree private")]
    PrivateMounts(#[source] std::io::Error),
    #[error("cannot mount a fresh /proc for the new pid namespace")]
    Proc(#[source] std::io::Error),
    #[error("cannot bind-mount `{path}` onto /tmp")]
    Tmp {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bring the loopback interface up")]
    Loopback(#[source] std::io::Error),
    #[error("`{path}` is under /tmp, which --isolate-tmp replaces; keep the daemon's socket and workdir elsewhere")]
    UnderTmp { path: PathBuf },
}

/// Which side of the fork this process is on.
#[derive(Debug)]
pub enum Role {
    /// PID 1 of the new pid namespace, with its mounts in place: go on and serve.
    Daemon,
    /// Outside: wait for the daemon with [`Waiter::wait`] and exit with its code.
    Waiter(Waiter),
}

/// The parent left outside the pid namespace.
#[derive(Debug)]
pub struct Waiter {
    child: i32,
    /// Held open for the waiter's whole life: the child learns the waiter is gone when this end
    /// closes (the parent-death signal covers the time after the child set it, this the time
    /// before).
    _lifeline: PipeWriter,
}

/// Signals the waiter handles: the two it forwards, and SIGCHLD for the daemon's exit.
const WAITED: [i32; 3] = [sys::SIGTERM, sys::SIGINT, sys::SIGCHLD];

/// Unshares the namespaces and forks. Must be called while the process is single-threaded
/// (before the async runtime starts). `keep_visible` are paths the daemon uses after isolating
/// (its socket, its workdir): they must not lie under `/tmp` when `/tmp` is replaced.
pub fn enter(iso: &Isolation, keep_visible: &[&Path]) -> Result<Role, IsolateError> {
    if iso.tmp.is_some() {
        for path in keep_visible {
            let resolved = resolve(path);
            if resolved.starts_with("/tmp") {
                return Err(IsolateError::UnderTmp { path: resolved });
            }
        }
    }
    let mut flags = sys::NS_MOUNT | sys::NS_PID | sys::NS_IPC | sys::NS_UTS;
    if iso.net {
        flags |= sys::NS_NET;
    }
    sys::unshare(flags).map_err(IsolateError::Unshare)?;
    // Blocked before the fork so that a signal arriving before the waiter waits is kept pending,
    // not lost; the child unblocks them at once.
    sys::mask_signals(&WAITED, true).map_err(IsolateError::Signals)?;
    let (reader, writer) = std::io::pipe().map_err(IsolateError::Fork)?;
    match sys::fork().map_err(IsolateError::Fork)? {
        Some(child) => {
            drop(reader);
            Ok(Role::Waiter(Waiter { child, _lifeline: writer }))
        }
        None => {
            drop(writer);
            become_init(iso, reader)?;
            Ok(Role::Daemon)
        }
    }
}

/// The child's half: die with the waiter, then mount the sandbox's view of the system.
fn become_init(iso: &Isolation, lifeline: PipeReader) -> Result<(), IsolateError> {
    sys::mask_signals(&WAITED, false).map_err(IsolateError::Signals)?;
    sys::set_parent_death_signal(sys::SIGKILL).map_err(IsolateError::DeathSignal)?;
    // The waiter may have died between the fork and the line above, when no signal was set.
    if sys::is_hung_up(lifeline.as_fd()).map_err(IsolateError::DeathSignal)? {
        return Err(IsolateError::ParentGone);
    }
    drop(lifeline);
    sys::make_mounts_private().map_err(IsolateError::PrivateMounts)?;
    sys::mount_proc().map_err(IsolateError::Proc)?;
    if let Some(tmp) = &iso.tmp {
        sys::bind_mount(tmp, Path::new("/tmp")).map_err(|source| IsolateError::Tmp { path: tmp.clone(), source })?;
    }
    if iso.net {
        sys::loopback_up().map_err(IsolateError::Loopback)?;
    }
    Ok(())
}

impl Waiter {
    /// Forwards SIGTERM and SIGINT to the daemon until it exits; returns its exit code (128 +
    /// the signal when it was killed by one).
    pub fn wait(self) -> i32 {
        loop {
            // Reap first: the daemon may have exited before we got here, its SIGCHLD pending.
            match sys::try_wait_pid(self.child) {
                Ok(Some(status)) => return sys::exit_code_of(status),
                Ok(None) => {}
                Err(err) => {
                    eprintln!("error: cannot wait for the isolated daemon: {err}");
                    return 2;
                }
            }
            match sys::wait_signal(&WAITED) {
                Ok(sys::SIGCHLD) => {}
                Ok(sig) => {
                    let _ = sys::kill_pid(self.child, sig);
                }
                Err(err) => {
                    eprintln!("error: cannot wait for signals: {err}");
                    let _ = sys::kill_pid(self.child, sys::SIGKILL);
                }
            }
        }
    }
}

/// `path` with symlinks resolved as far as it exists (a socket path does not exist yet).
fn resolve(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => resolve(parent).join(name),
        _ => std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_under_tmp_are_refused_when_tmp_is_replaced() {
        let iso = Isolation { net: false, tmp: Some(PathBuf::from("/var/empty")) };
        let err = enter(&iso, &[Path::new("/tmp/sandbox/d.sock")]).err();
        assert!(matches!(err, Some(IsolateError::UnderTmp { .. })), "{err:?}");
    }

    #[test]
    fn resolve_keeps_missing_tails() {
        assert_eq!(resolve(Path::new("/proc/self/../no/such")), PathBuf::from("/proc/no/such"));
    }
}

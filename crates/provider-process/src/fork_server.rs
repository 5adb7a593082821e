//! Starting isolated daemons through `sandmand fork-server` (see that module in `sandmand`): one
//! long-lived process of the daemon's binary, which forks a daemon per request, as this
//! provider's child, instead of this provider executing the binary for each sandbox. What that
//! saves is the daemon's start-up before its `main` (the exec, the relocation of a static
//! position-independent binary, the C library's `cpuid`s, each trapped by the hypervisor on a
//! virtual machine): about 0.6 ms of CPU a sandbox on this project's machine.
//!
//! The fork server lives on the spawner thread ([`crate::spawner`]): its socket is in that
//! thread's descriptor table only, so it is made, used and closed there, and nowhere else. Should
//! the server die (killed by hand, or by the OOM killer), the next start makes a new one; a
//! request the old one may have taken is not sent again (it may have forked the daemon already)
//! and fails that create, whose cleanup kills whatever runs in the sandbox's cgroups.

use std::cell::RefCell;
use std::ffi::OsString;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sandman_wire::fork_server::{ForkRequest, READY};

use crate::sys;

/// How long a fork (or the server's start) may take before the server is taken for hung.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// A running fork server: its process and the provider's end of its socket. One per spawner
/// thread, and so per provider, whose daemon binary does not change.
#[derive(Debug)]
struct ForkServer {
    child: Child,
    sock: UnixStream,
}

thread_local! {
    /// The spawner thread's fork server; none on any other thread.
    static SERVER: RefCell<Option<ForkServer>> = const { RefCell::new(None) };
    /// Set once a fork server said it cannot serve on this kernel: daemons are executed from then on.
    static UNSUPPORTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl ForkServer {
    fn start(daemon_bin: &Path, daemon_args: &[OsString]) -> io::Result<ForkServer> {
        let (ours, theirs) = sys::seqpacket_pair()?;
        let child = Command::new(daemon_bin)
            .args(daemon_args)
            .arg("fork-server")
            .env_clear()
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            // Its own failures go where the server's log goes; each daemon's stderr is its log.
            .stderr(Stdio::inherit())
            // Its own group: a ^C to the server's group does not reach it.
            .process_group(0)
            .spawn()?;
        let sock = UnixStream::from(ours);
        sock.set_read_timeout(Some(ANSWER_WAIT))?;
        let mut server = ForkServer { child, sock };
        let mut first = [0u8; 512];
        match server.sock.read(&mut first) {
            Ok(n) if &first[..n] == READY => Ok(server),
            // It runs, but cannot serve on this kernel: it says why.
            Ok(n) if first[..n].starts_with(b"error: ") => {
                let said = String::from_utf8_lossy(&first["error: ".len()..n]).into_owned();
                Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("`{} fork-server`: {said}", daemon_bin.display()),
                ))
            }
            outcome => {
                let _ = server.child.kill();
                let status = server.child.wait();
                // `server` is dropped here: its socket closes, its process is reaped already. A
                // binary that exits rather than serving (one older than the fork server) is
                // executed for each daemon instead.
                Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "`{} fork-server` did not start ({}): {}",
                        daemon_bin.display(),
                        status.map_or_else(|e| e.to_string(), |s| s.to_string()),
                        match outcome {
                            Ok(n) => format!("it said {:?}", String::from_utf8_lossy(&first[..n])),
                            Err(e) => e.to_string(),
                        }
                    ),
                ))
            }
        }
    }

    /// Sends one request; `Ok(Err(_))` when the server was gone before it took it (nothing
    /// started: safe to send again to a new one).
    fn request(&mut self, req: &[u8], log: BorrowedFd<'_>) -> io::Result<Result<i32, io::Error>> {
        if let Err(e) = sys::send_with_fd(self.sock.as_fd(), req, log) {
            return match e.raw_os_error() {
                Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN) => Ok(Err(e)),
                _ => Err(e),
            };
        }
        let mut answer = [0u8; 512];
        let n = self.sock.read(&mut answer)?;
        if n == 0 {
            return Err(io::Error::other("the fork server ended while it started the daemon"));
        }
        let answer = String::from_utf8_lossy(&answer[..n]);
        match answer.strip_prefix("error: ") {
            Some(why) => Err(io::Error::other(format!("the fork server could not start the daemon: {why}"))),
            None => answer
                .parse::<i32>()
                .map(Ok)
                .map_err(|_| io::Error::other(format!("the fork server answered {answer:?}"))),
        }
    }
}

impl Drop for ForkServer {
    fn drop(&mut self) {
        // It ends by itself once its socket closes; the kill is for one that does not.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a daemon (`req`, its stderr `log`) through the calling thread's fork server, which is
/// started first when there is none yet or it has died. Answers the
/// daemon's pid: a child of this process, not yet reaped. Only on the spawner thread.
///
/// `None` when this kernel cannot have a fork server (it said why once, in a warning): the caller
/// executes the daemon instead, which starts the same daemon at the cost the fork server saves.
pub fn start_daemon(
    daemon_bin: &Path,
    daemon_args: &[OsString],
    req: &ForkRequest,
    log: BorrowedFd<'_>,
) -> Option<io::Result<i32>> {
    if UNSUPPORTED.get() {
        return None;
    }
    match forked(daemon_bin, daemon_args, req, log) {
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
            tracing::warn!(error = %e, "cannot run a fork server: each isolated daemon is executed from now on");
            UNSUPPORTED.set(true);
            None
        }
        other => Some(other),
    }
}

fn forked(daemon_bin: &Path, daemon_args: &[OsString], req: &ForkRequest, log: BorrowedFd<'_>) -> io::Result<i32> {
    let bytes = req.encode().map_err(|why| io::Error::new(io::ErrorKind::InvalidInput, why))?;
    SERVER.with(|cell| {
        let mut slot = cell.borrow_mut();
        for attempt in 0..2 {
            let alive = slot.as_mut().is_some_and(|s| matches!(s.child.try_wait(), Ok(None)));
            if !alive {
                if let Some(old) = slot.take() {
                    tracing::warn!(pid = old.child.id(), "the fork server is gone: starting another");
                }
                *slot = Some(ForkServer::start(daemon_bin, daemon_args)?);
            }
            let Some(server) = slot.as_mut() else { break };
            match server.request(&bytes, log) {
                Ok(Ok(pid)) => return Ok(pid),
                // Gone before it took the request: a new server takes it.
                Ok(Err(e)) if attempt == 0 => {
                    tracing::warn!(error = %e, "the fork server is gone");
                    *slot = None;
                }
                Ok(Err(e)) => return Err(e),
                Err(e) => {
                    // Whatever state it is in, the next start makes a new one.
                    *slot = None;
                    return Err(e);
                }
            }
        }
        Err(io::Error::other("the fork server could not be started"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn null() -> std::fs::File {
        std::fs::File::open("/dev/null").unwrap_or_else(|e| panic!("{e}"))
    }

    /// The fork server of this (test) thread.
    fn server_pid() -> Option<u32> {
        SERVER.with(|cell| cell.borrow().as_ref().map(|s| s.child.id()))
    }

    fn until(what: &str, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(started.elapsed() < Duration::from_secs(20), "{what} did not happen within 20 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stat_fields(pid: i32) -> Vec<String> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| panic!("{e}"));
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().map(String::from).collect()).unwrap_or_default()
    }

    /// A daemon started by the real `sandmand fork-server`: in a directory of its own, on a
    /// socket named relative to it, its token in its environment, its log a file there.
    fn start_real(dir: &Path) -> (ForkRequest, i32) {
        let bin = sandman_testkit::daemon_beside_tests();
        let req = ForkRequest {
            cwd: dir.to_path_buf(),
            argv: vec![bin.clone().into(), "--listen".into(), "unix:d.sock".into(), "--workdir".into(), "/".into()],
            dispatch: 0,
            env: vec![("SANDMAN_TOKEN".into(), "fork-server-test-token".into())],
        };
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap_or_else(|e| panic!("{e}"));
        let pid = start_daemon(&bin, &[], &req, log.as_fd())
            .unwrap_or_else(|| panic!("no fork server"))
            .unwrap_or_else(|e| panic!("{e}"));
        (req, pid)
    }

    /// Kills and reaps a daemon this process started: `waitpid` answers for children only.
    fn kill_and_reap(pid: i32) -> std::process::ExitStatus {
        sys::kill(pid, libc::SIGKILL, false).unwrap_or_else(|e| panic!("{e}"));
        let mut status = None;
        until("the daemon's exit", || {
            status = sys::reap(pid).unwrap_or_else(|e| panic!("cannot reap {pid}, not our child? {e}"));
            status.is_some()
        });
        status.unwrap_or_else(|| panic!("no status"))
    }

    #[test]
    fn a_forked_daemon_is_this_processs_child_as_an_exec_would_have_made_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (req, pid) = start_real(dir.path());
        // It serves on a socket named relative to its working directory, with the token from its
        // environment (without one it would have exited at once).
        until("the daemon's socket", || dir.path().join("d.sock").exists());
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            matches!(sys::reap(pid), Ok(None)),
            "the daemon exited: {}",
            std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
        );
        let fields = stat_fields(pid);
        // The provider's child (the server forked it with CLONE_PARENT), in a group of its own.
        assert_eq!(fields[1], std::process::id().to_string(), "its parent");
        assert_eq!(fields[2], pid.to_string(), "its process group");
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_else(|e| panic!("{e}"));
        let shown: Vec<&[u8]> = cmdline.strip_suffix(&[0]).unwrap_or(&cmdline).split(|b| *b == 0).collect();
        let asked: Vec<Vec<u8>> = req.argv.iter().map(|a| a.as_encoded_bytes().to_vec()).collect();
        assert_eq!(shown, asked.iter().map(Vec::as_slice).collect::<Vec<_>>(), "its command line");
        let link = |fd: u32| std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(link(0), Path::new("/dev/null"), "stdin is not the server's socket");
        assert_eq!(link(2), dir.path().join("daemon.log"));
        assert_eq!(std::fs::read_link(format!("/proc/{pid}/cwd")).ok().as_deref(), Some(dir.path()));
        let status = kill_and_reap(pid);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn a_dead_fork_server_is_replaced_by_the_next_start() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (_, first) = start_real(dir.path());
        let old = server_pid().unwrap_or_else(|| panic!("no fork server"));
        sys::kill(old as i32, libc::SIGKILL, false).unwrap_or_else(|e| panic!("{e}"));
        until("the fork server's death", || {
            std::fs::read_to_string(format!("/proc/{old}/stat")).map_or(true, |s| s.contains(") Z "))
        });
        kill_and_reap(first);
        let again = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (_, second) = start_real(again.path());
        until("the second daemon's socket", || again.path().join("d.sock").exists());
        let new = server_pid().unwrap_or_else(|| panic!("no fork server"));
        assert_ne!(new, old);
        assert!(!Path::new(&format!("/proc/{old}")).exists(), "the dead fork server was not reaped");
        kill_and_reap(second);
    }

    #[test]
    fn a_fork_server_that_cannot_serve_here_makes_daemons_executed_from_then_on() {
        // As `sandmand fork-server` answers on a kernel without PR_SET_MM_MAP.
        let args: Vec<OsString> =
            ["-c", "printf 'error: cannot set a child'\\''s command line' >&0", "sh"].iter().map(Into::into).collect();
        let req = ForkRequest { cwd: "/".into(), argv: vec!["/bin/sh".into()], dispatch: 0, env: Vec::new() };
        assert!(start_daemon(Path::new("/bin/sh"), &args, &req, null().as_fd()).is_none());
        assert!(UNSUPPORTED.get());
        assert_eq!(server_pid(), None);
        // Not asked again: even a working one is not started.
        let bin = sandman_testkit::daemon_beside_tests();
        assert!(start_daemon(&bin, &[], &req, null().as_fd()).is_none());
        assert_eq!(server_pid(), None);
    }

    #[test]
    fn a_binary_that_is_no_fork_server_makes_daemons_executed_naming_what_it_did() {
        let req = ForkRequest { cwd: "/".into(), argv: vec!["/bin/true".into()], dispatch: 0, env: Vec::new() };
        // `/bin/true fork-server` exits at once, saying nothing, as a daemon older than the fork
        // server exits on a subcommand it does not know.
        let err = forked(Path::new("/bin/true"), &[], &req, null().as_fd())
            .err()
            .unwrap_or_else(|| panic!("/bin/true was taken for a fork server"));
        assert_eq!(err.kind(), io::ErrorKind::Unsupported);
        let text = err.to_string();
        assert!(text.contains("`/bin/true fork-server` did not start (exit status: 0)"), "{text}");
        assert_eq!(server_pid(), None);
        assert!(start_daemon(Path::new("/bin/true"), &[], &req, null().as_fd()).is_none());
        assert!(UNSUPPORTED.get());
    }
}

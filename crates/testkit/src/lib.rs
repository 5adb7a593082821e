//! The end-to-end harness every test crate shares (a dev-dependency only): [`Spawned`] runs a
//! binary (a server, a daemon, a fake node) with its stderr captured to a file, kills it however
//! the test ends, and prints that file when the test fails; [`wait_healthy`] waits for an HTTP
//! health check on a TCP address or Unix socket with a deadline; [`eventually`] polls a
//! condition; [`scratch!`] is scratch space outside `/tmp`; [`http`] is a small client for what
//! the tests start, [`docker`] the Docker fixtures, [`standin::StandIn`] a daemon's stand-in
//! that proves a token to health checks and counts them.
//! Start at [`Spawned::spawn`].

pub mod docker;
pub mod http;
pub mod internet;
pub mod registry;
pub mod standin;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Scratch space for tests, outside `/tmp`: an isolated sandbox gets a `/tmp` of its own, which
/// would hide anything the test keeps under the host's `/tmp` (as the target directory is when
/// the checkout itself is under `/tmp`). Expands to [`scratch_under`] of the calling test
/// crate's `CARGO_TARGET_TMPDIR`.
#[macro_export]
macro_rules! scratch {
    () => {
        $crate::scratch_under(::std::path::Path::new(env!("CARGO_TARGET_TMPDIR")))
    };
}

/// [`scratch!`] given the target's temporary directory: that directory, made, unless it is under
/// `/tmp`, when it is `/var/tmp/sandman-tests`.
pub fn scratch_under(target_tmpdir: &Path) -> PathBuf {
    let base =
        if target_tmpdir.starts_with("/tmp") { PathBuf::from("/var/tmp/sandman-tests") } else { target_tmpdir.into() };
    std::fs::create_dir_all(&base).unwrap_or_else(|e| panic!("cannot make {}: {e}", base.display()));
    base
}

/// The `sandmand` built beside the running test (`target/<profile>/sandmand`; tests run from
/// `target/<profile>/deps/`), or `$SANDMAN_DAEMON`.
pub fn daemon_beside_tests() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDMAN_DAEMON").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no current executable: {e}"));
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join("sandmand"));
    let bin = bin.unwrap_or_else(|| panic!("the test binary `{}` has no grandparent", exe.display()));
    assert!(bin.is_file(), "no daemon at {}: build it first: cargo build -p sandmand", bin.display());
    bin
}

/// The workspace's root.
pub fn workspace() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2);
    root.unwrap_or_else(|| panic!("no workspace above {}", env!("CARGO_MANIFEST_DIR"))).to_path_buf()
}

/// The static daemon, as shipped: `$SANDMAND_STATIC` (set by scripts/test), else the one
/// `./scripts/build-daemon` leaves in `target/static/`. Fails the test when there is none.
pub fn static_daemon() -> PathBuf {
    static_daemon_built().unwrap_or_else(|| {
        panic!("no static daemon at {}: build it first: ./scripts/build-daemon", static_build_path().display())
    })
}

/// [`static_daemon`] when there is one: `$SANDMAND_STATIC`, else the build in `target/static/`
/// when it exists (a benchmark falls back to the daemon it was built with).
pub fn static_daemon_built() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SANDMAND_STATIC").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    Some(static_build_path()).filter(|bin| bin.is_file())
}

fn static_build_path() -> PathBuf {
    workspace().join("target/static/x86_64-unknown-linux-gnu/daemon/sandmand")
}

/// Whether this process runs as root (its effective uid).
pub fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_else(|e| panic!("/proc/self/status: {e}"));
    let euid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|ids| ids.split_whitespace().nth(1));
    euid.unwrap_or_else(|| panic!("no effective uid in /proc/self/status")) == "0"
}

/// Fails the test unless it runs as root.
pub fn require_root() {
    assert!(is_root(), "this test needs root for namespaces (CI and scripts/test run as root)");
}

/// Polls `f` every 20 ms until it is true or `limit` passes; then once more.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// [`eventually`] for a condition that must itself await (a call to a server): polled every
/// 50 ms.
pub async fn eventually_async(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f().await
}

/// Every process but this one whose command line mentions `needle`, with that command line (its
/// arguments joined by spaces).
pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let me = std::process::id() as i32;
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

/// Whether a process is alive (and not a zombie).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`); 0 when the process or the field is
/// gone.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(field));
    line.and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A process's resident set size, in KiB; 0 when it is gone.
pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A binary a test started: its stderr goes to a log file, it is SIGKILLed and reaped when
/// dropped, and when it is dropped by a failing test (a panic) its log is printed to the test's
/// stderr and the file kept. `SANDMAN_E2E_LOG` set prints the log of every run.
#[derive(Debug)]
pub struct Spawned {
    name: String,
    child: Child,
    log: tempfile::NamedTempFile,
}

impl Spawned {
    /// Starts `cmd` with stdin and stdout null and stderr to a new file `<name>-*.log` in
    /// `logs`. `name` says what it is in the dump (`sandman-serve`, `sandmand`).
    pub fn spawn(name: &str, cmd: &mut Command, logs: &Path) -> Spawned {
        let log = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .suffix(".log")
            .tempfile_in(logs)
            .unwrap_or_else(|e| panic!("cannot make a log file in {}: {e}", logs.display()));
        let stderr = log.reopen().unwrap_or_else(|e| panic!("cannot open {}: {e}", log.path().display()));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Spawned { name: name.to_string(), child, log }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        self.log.path()
    }

    /// What it wrote to stderr so far.
    pub fn log(&self) -> String {
        let bytes = std::fs::read(self.log.path()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Waits up to `limit` for a line of its log for which `pick` answers something, and answers
    /// that. Fails the test, with the log, when the process exits first or the time is up.
    /// Only whole lines count: a line the process is still writing (the log is read while it
    /// writes) is not shown to `pick` until its end of line is there.
    pub fn wait_for_line<T>(&mut self, limit: Duration, mut pick: impl FnMut(&str) -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(found) = whole_lines(&self.log()).find_map(&mut pick) {
                return found;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                // The log may have grown between the read and the exit; what it ends with is
                // all there will be.
                if let Some(found) = self.log().lines().find_map(&mut pick) {
                    return found;
                }
                panic!("{} exited ({status}) before it said what the test waits for", self.name);
            }
            assert!(start.elapsed() < limit, "{} did not say what the test waits for within {limit:?}", self.name);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `limit` for `GET path` at `addr` to answer 200 (see [`wait_healthy`]). Fails
    /// the test, with the log, when the process exits first or the time is up.
    pub async fn wait_healthy(&mut self, addr: Addr<'_>, path: &str, limit: Duration) {
        let start = Instant::now();
        loop {
            let Err(last) = wait_healthy(addr, path, HEALTH_ROUND).await else { return };
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{} exited ({status}) before it was healthy: {last}", self.name);
            }
            assert!(start.elapsed() < limit, "{} is not healthy within {limit:?}: {last}", self.name);
        }
    }

    /// Waits up to `limit` for it to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// SIGKILL, as a crash would, and reaped; nothing when it has exited already.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Asks the process to stop with SIGTERM, as a supervisor would, and kills it when it has
    /// not exited within `grace`: a daemon stopped this way takes its children with it, where
    /// one killed outright leaves them running.
    pub fn stop(&mut self, grace: Duration) {
        // Only while it is not reaped: its pid is still its own (a zombie holds it).
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let asked = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        if asked.is_ok_and(|s| s.success()) {
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.kill();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
        let failing = std::thread::panicking();
        if failing || std::env::var_os("SANDMAN_E2E_LOG").is_some() {
            let path = self.log.path().display();
            eprintln!(
                "---- {} (pid {}) log, {path} ----\n{}---- end of {} log ----",
                self.name,
                self.id(),
                self.log(),
                self.name
            );
        }
        if failing {
            // Kept for a look after the run.
            let _ = self.log.as_file().sync_all();
            let _ = std::fs::hard_link(self.log.path(), self.log.path().with_extension("kept.log"));
        }
    }
}

/// Removes the cgroups `sandman-<id>` that a process provider started by this process (so in
/// its cgroups) made for the sandboxes `ids`: a test that kills its server with sandboxes still
/// held, then removes the state directory, leaves them to no one. Waits a little for their
/// processes, killed just before, to be gone.
pub fn remove_sandbox_cgroups(ids: &[String]) {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let root = Path::new("/sys/fs/cgroup");
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in own.lines() {
        let mut fields = line.splitn(3, ':').skip(1);
        let (Some(controllers), Some(path)) = (fields.next(), fields.next()) else { continue };
        let mount = match controllers {
            // v2: the whole of /sys/fs/cgroup, or its `unified` beside v1 hierarchies.
            "" if root.join("cgroup.controllers").exists() => root.to_path_buf(),
            "" => root.join("unified"),
            named => root.join(named.trim_start_matches("name=")),
        };
        let own = mount.join(path.trim_start_matches('/'));
        dirs.extend(ids.iter().map(|id| own.join(format!("sandman-{id}"))).filter(|d| d.is_dir()));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dirs.is_empty() && Instant::now() < deadline {
        dirs.retain(|d| std::fs::remove_dir(d).is_err() && d.is_dir());
        if !dirs.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A temporary directory for what a test starts (a provider's state directory, where each
/// sandbox's daemon keeps its `daemon.log`) whose logs are printed when a failing test drops it.
#[derive(Debug)]
pub struct LoggedDir {
    dir: tempfile::TempDir,
}

impl LoggedDir {
    /// A new directory in `base`, named `<prefix>…` (keep it short: sockets live below it).
    pub fn new_in(base: &Path, prefix: &str) -> LoggedDir {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(base);
        LoggedDir { dir: dir.unwrap_or_else(|e| panic!("cannot make a directory in {}: {e}", base.display())) }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for LoggedDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_logs_under(self.dir.path());
        }
        unmount_records(self.dir.path());
    }
}

/// Unmounts the tmpfs an isolated process provider keeps its sandboxes' directories on
/// (`<state>/sandboxes`), so that removing the state directory removes everything: a provider
/// leaves it mounted while sandboxes may still run, and a test's server is killed, not
/// stopped. Call it once the sandboxes' processes are gone.
pub fn unmount_records(state: &Path) {
    use std::os::unix::fs::MetadataExt;
    let sandboxes = state.join("sandboxes");
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    if dev(&sandboxes).is_some() && dev(&sandboxes) != dev(state) {
        let _ = Command::new("umount").arg("--lazy").arg(&sandboxes).status();
    }
}

/// How deep below a directory [`print_logs_under`] looks (`sandboxes/<id>/daemon.log` is 3).
const LOG_DEPTH: usize = 4;
/// How much of the end of each log [`print_logs_under`] prints.
const LOG_TAIL: usize = 64 << 10;

/// Prints the end of every `*.log` file below `dir` to the test's stderr: what the daemons a
/// failing test started said.
pub fn print_logs_under(dir: &Path) {
    let mut logs = Vec::new();
    find_logs(dir, LOG_DEPTH, &mut logs);
    logs.sort();
    for log in logs {
        let bytes = std::fs::read(&log).unwrap_or_default();
        let tail = &bytes[bytes.len().saturating_sub(LOG_TAIL)..];
        eprintln!("---- {} ----\n{}---- end ----", log.display(), String::from_utf8_lossy(tail));
    }
}

fn find_logs(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else { continue };
        let path = entry.path();
        if kind.is_dir() && depth > 1 {
            find_logs(&path, depth - 1, out);
        } else if kind.is_file() && path.extension().is_some_and(|e| e == "log") {
            out.push(path);
        }
    }
}

/// How long [`Spawned::wait_healthy`] tries before it looks whether the process is still there.
const HEALTH_ROUND: Duration = Duration::from_millis(200);

/// Where a health check is sent.
#[derive(Debug, Clone, Copy)]
pub enum Addr<'a> {
    /// `host:port`.
    Tcp(&'a str),
    Unix(&'a Path),
}

/// Waits up to `limit` for `GET path` at `addr` to answer 200, trying every 10 ms; the last
/// failure when it never does.
pub async fn wait_healthy(addr: Addr<'_>, path: &str, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    loop {
        let last = match health(addr, path).await {
            Ok(200) => return Ok(()),
            Ok(status) => format!("{path} answered {status}"),
            Err(e) => e,
        };
        if start.elapsed() >= limit {
            return Err(format!("{addr:?} not healthy within {limit:?}: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The status of one `GET path` on a fresh connection.
async fn health(addr: Addr<'_>, path: &str) -> Result<u16, String> {
    let request = format!("GET {path} HTTP/1.1\r\nhost: sandman\r\nconnection: close\r\n\r\n");
    let mut answer = Vec::new();
    match addr {
        Addr::Tcp(a) => {
            let mut s = tokio::net::TcpStream::connect(a).await.map_err(|e| format!("connect {a}: {e}"))?;
            s.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
            s.read_to_end(&mut answer).await.map_err(|e| e.to_string())?;
        }
        Addr::Unix(p) => {
            let mut s =
                tokio::net::UnixStream::connect(p).await.map_err(|e| format!("connect {}: {e}", p.display()))?;
            s.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
            s.read_to_end(&mut answer).await.map_err(|e| e.to_string())?;
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let status = text.strip_prefix("HTTP/1.1 ").and_then(|rest| rest.get(..3)).and_then(|s| s.parse().ok());
    status.ok_or_else(|| format!("not an HTTP answer: {:?}", text.lines().next().unwrap_or_default()))
}

/// The lines of `log` that have their end of line: the last one may still be being written.
fn whole_lines(log: &str) -> std::str::Lines<'_> {
    log[..log.rfind('\n').map_or(0, |i| i + 1)].lines()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawned_process_logs_to_a_file_and_dies_with_its_guard() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo 'serving on http://127.0.0.1:9 now' >&2; exec sleep 600"]);
        let mut p = Spawned::spawn("sh", &mut cmd, dir.path());
        let addr = p.wait_for_line(Duration::from_secs(30), |l| {
            l.split("serving on http://").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string)
        });
        assert_eq!(addr, "127.0.0.1:9");
        let pid = p.id() as i32;
        assert!(alive(pid));
        assert!(p.log().contains("serving on"));
        drop(p);
        assert!(!alive(pid));
    }

    #[test]
    fn a_line_still_being_written_is_not_taken_for_a_whole_one() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        // The address comes a second after the words before it, as a write cut in two can.
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "printf 'serving on http://' >&2; sleep 1; echo '127.0.0.1:9 now' >&2; exec sleep 600"]);
        let mut p = Spawned::spawn("sh", &mut cmd, dir.path());
        let addr = p.wait_for_line(Duration::from_secs(30), |l| {
            l.split("serving on http://").nth(1).map(|r| r.split_whitespace().next().unwrap_or_default().to_string())
        });
        assert_eq!(addr, "127.0.0.1:9");
        assert_eq!(whole_lines("a\nb").collect::<Vec<_>>(), ["a"]);
        assert_eq!(whole_lines("a\nb\n").collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(whole_lines("partial").count(), 0);
    }

    #[test]
    fn waiting_for_a_line_fails_when_the_process_exits_without_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let outcome = std::panic::catch_unwind(|| {
            let mut p = Spawned::spawn("sh", Command::new("/bin/sh").args(["-c", "echo nope >&2"]), dir.path());
            p.wait_for_line(Duration::from_secs(30), |l| l.contains("ready").then_some(()))
        });
        let said = |o: &std::thread::Result<_>| match o {
            Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
            Ok(_) => String::new(),
        };
        // Told by the exit, not by the deadline running out.
        assert!(said(&outcome).contains("exited"), "{:?}", said(&outcome));
        let outcome = std::panic::catch_unwind(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let runtime = runtime.unwrap_or_else(|e| panic!("{e}"));
            let mut p = Spawned::spawn("sh", Command::new("/bin/sh").args(["-c", "exit 3"]), dir.path());
            let socket = dir.path().join("never.sock");
            runtime.block_on(p.wait_healthy(Addr::Unix(&socket), "/v1/health", Duration::from_secs(600)));
        });
        assert!(said(&outcome).contains("exited"), "a process that exits is never healthy: {:?}", said(&outcome));
        let kept = std::fs::read_dir(dir.path()).map(|d| d.flatten().count()).unwrap_or(0);
        assert_eq!(kept, 2, "the failing runs' logs are kept");
    }

    #[test]
    fn a_logged_dir_prints_its_logs_only_when_a_test_fails() {
        let base = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let dir = LoggedDir::new_in(base.path(), "st");
        let sandbox = dir.path().join("sandboxes/sb-1");
        std::fs::create_dir_all(&sandbox).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(sandbox.join("daemon.log"), "error: boom\n").unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(sandbox.join("record.json"), "{}").unwrap_or_else(|e| panic!("{e}"));
        let mut found = Vec::new();
        find_logs(dir.path(), LOG_DEPTH, &mut found);
        assert_eq!(found, [sandbox.join("daemon.log")]);
        let path = dir.path().to_path_buf();
        drop(dir);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn health_waits_answer_the_status_and_give_up_at_the_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        assert_eq!(wait_healthy(Addr::Tcp(&addr), "/healthz", Duration::from_secs(30)).await, Ok(()));
        let nobody = Path::new("/nonexistent/d.sock");
        let err = wait_healthy(Addr::Unix(nobody), "/v1/health", Duration::from_millis(50)).await;
        assert!(err.is_err_and(|e| e.contains("not healthy")));
    }

    #[tokio::test]
    async fn eventually_is_true_once_the_condition_holds() {
        let mut n = 0;
        assert!(
            eventually(Duration::from_secs(30), || {
                n += 1;
                n > 2
            })
            .await
        );
        assert!(!eventually(Duration::from_millis(30), || false).await);
    }
}

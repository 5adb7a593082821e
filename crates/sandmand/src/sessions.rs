//! Persistent shell sessions: one shell per session, a script per run, sentinels to end it; see [`Sessions`].

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use sandman_wire::daemon::{CreateSession, SessionInfo, SessionList, SessionRun, SessionRunResult};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::budget::OutputBudget;
use crate::children::Children;
use crate::error::{DaemonError, DaemonResult};
use crate::extract::ApiJson;
use crate::spawn::{Defaults, Launch, LaunchRequest};
use crate::state::Daemon;
use crate::sys::{self, Reaped};
use crate::tree;

/// Output kept per stream and run when the request sets no `max_output_bytes`.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 10 << 20;

/// How long a timed-out command has, after SIGINT, to stop before what it started is SIGKILLed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(1);

/// How long the shell has, once a timed-out command's processes were SIGKILLed, to print the
/// run's markers. Only a command that runs in the shell itself (a loop of builtins) keeps it
/// from them; that shell is then killed, as nothing else can stop it.
const KILL_GRACE: Duration = Duration::from_secs(1);

/// How long the end of a run is still awaited once the shell has exited or one of its pipes
/// closed: the exit and the last output arrive by different paths, in either order.
const DRAIN: Duration = Duration::from_millis(100);

/// Size of one read from the shell's pipes.
const READ_CHUNK: usize = 64 * 1024;

/// Bytes of a stream's tail kept across reads, so that a marker split between two reads is still
/// found: more than the longest marker (`\n`, 32 hex digits, a space, an `i32`, `\n`: 46 bytes).
const MARKER_WINDOW: usize = 64;

/// The first run of every session, before it is handed out. SIGINT to the shell's group then
/// kills the running command but not the shell: a trapped signal (unlike an ignored one) is reset
/// to its default in the shell's children. Until it has run, SIGINT would kill the shell itself.
const SETUP_COMMAND: &str = "trap ':' INT";

/// How long a new shell has to run `SETUP_COMMAND`: a program that is not a POSIX shell never
/// prints the markers.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Output kept from `SETUP_COMMAND`, for the error when it fails.
const SETUP_OUTPUT_BYTES: usize = 4096;

/// Every session the daemon remembers, alive or ended, until it is deleted.
#[derive(Debug)]
pub struct Sessions {
    /// Session number (the `N` of `s-N`) → session. Locked only to look up, add or remove, never
    /// across an `.await`; lock order is this table, then a session's state.
    table: Mutex<BTreeMap<u64, Arc<Session>>>,
    /// The last session number handed out.
    last_id: AtomicU64,
    /// The daemon's output budget, shared with execs and background processes: the output a
    /// run keeps until it ends is taken from it.
    budget: Arc<OutputBudget>,
}

impl Sessions {
    pub fn new(budget: Arc<OutputBudget>) -> Self {
        Sessions { table: Mutex::default(), last_id: AtomicU64::new(0), budget }
    }

    /// How many sessions the daemon remembers (ended ones included, until deleted).
    pub fn count(&self) -> usize {
        self.table().len()
    }

    /// Kills every session's shell and everything below it, and forgets them all (lease lapse,
    /// shutdown).
    pub fn kill_all(&self) {
        let all = std::mem::take(&mut *self.table());
        for session in all.values() {
            session.kill("the daemon stopped");
        }
    }

    /// Starts a shell for a new session, and returns once it is ready for runs and interrupts.
    pub async fn create(
        &self,
        defaults: &Defaults,
        children: &Arc<Children>,
        req: CreateSession,
    ) -> DaemonResult<SessionInfo> {
        let shell = req.shell.unwrap_or_else(|| defaults.shell.clone());
        if !std::path::Path::new(&shell).is_absolute() {
            return Err(DaemonError::InvalidArgument(format!("`shell` `{shell}` must be an absolute path")));
        }
        let launch = Launch::parse(
            defaults,
            LaunchRequest {
                argv: Some(vec![shell.clone()]),
                command: None,
                env: req.env,
                cwd: req.cwd,
                user: req.user,
            },
        )?;
        // The fork runs on the blocking pool, as every start does: never on the event loop.
        let (mut child, exit) =
            spawn_off_the_event_loop(children, launch.command(Stdio::piped())).await.map_err(|e| {
                DaemonError::InvalidArgument(format!(
                    "cannot start a session with `{shell}`: {e}; sessions need a shell in the sandbox (exec \
                 with `argv` works without one)"
                ))
            })?;
        let pid = child.id() as i32;
        let pipes = match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
            (Some(stdin), Some(out), Some(err)) => {
                pipe::Sender::from_owned_fd(OwnedFd::from(stdin)).and_then(|stdin| {
                    Ok((
                        stdin,
                        pipe::Receiver::from_owned_fd(OwnedFd::from(out))?,
                        pipe::Receiver::from_owned_fd(OwnedFd::from(err))?,
                    ))
                })
            }
            _ => Err(std::io::Error::other("the shell has no pipes")),
        };
        let (stdin, stdout, stderr) = pipes.map_err(|e| {
            tree::kill_tree(pid);
            DaemonError::Internal(format!("cannot watch the pipes of session shell `{shell}` (pid {pid}): {e}"))
        })?;
        let shared = Arc::new(Shared {
            state: Mutex::new(SessionState {
                phase: Phase::Idle(stdin),
                exited: None,
                killed: None,
                stdout: Capture::default(),
                stderr: Capture::default(),
            }),
            changed: watch::Sender::new(()),
        });
        let tasks = [
            AbortOnDropHandle::new(tokio::spawn(pump(Arc::clone(&shared), stdout, Stream::Stdout))),
            AbortOnDropHandle::new(tokio::spawn(pump(Arc::clone(&shared), stderr, Stream::Stderr))),
            AbortOnDropHandle::new(tokio::spawn(watch_exit(Arc::clone(&shared), exit))),
        ];
        let n = self.last_id.fetch_add(1, Ordering::Relaxed) + 1;
        // Dropped before it is in the table (a failed setup, a client that went away), the
        // session kills its shell.
        let session = Arc::new(Session {
            id: format!("s-{n}"),
            shell,
            pid,
            shared,
            budget: Arc::clone(&self.budget),
            _tasks: tasks,
        });
        session.set_up().await?;
        let info = session.info();
        self.table().insert(n, session);
        Ok(info)
    }

    /// Every session, oldest first.
    pub fn list(&self) -> Vec<SessionInfo> {
        self.table().values().map(|s| s.info()).collect()
    }

    /// Runs one command in the session's shell and waits for it.
    pub async fn run(&self, id: &str, req: SessionRun) -> DaemonResult<SessionRunResult> {
        if req.command.contains('\0') {
            return Err(DaemonError::InvalidArgument("`command` must not contain NUL bytes".into()));
        }
        let session = self.get(id)?;
        let cap = req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT_BYTES).try_into().unwrap_or(usize::MAX);
        let nonce = sys::random_hex();
        let started = Instant::now();
        let timeout = req.timeout_ms.map(Duration::from_millis);
        let mut slot = RunSlot::begin(session, &nonce, cap)?;
        // What already runs in the session (background jobs of earlier runs) is spared when this
        // run times out; looked up only when a timeout may come.
        if timeout.is_some() {
            slot.spared = tree::group_members(slot.session.pid);
        }
        let outcome = slot.wait(run_script(&req.command, &nonce, req.merge_output).as_bytes(), timeout).await;
        Ok(slot.finish(outcome, started))
    }

    /// Sends SIGINT to the session's process group: the running command stops, the shell stays.
    pub fn interrupt(&self, id: &str) -> DaemonResult<()> {
        self.get(id)?.interrupt()
    }

    /// Kills the session's shell and everything below it, and forgets the session.
    pub fn delete(&self, id: &str) -> DaemonResult<()> {
        let n = number(id).ok_or_else(|| not_found(id))?;
        let session = self.table().remove(&n).ok_or_else(|| not_found(id))?;
        session.kill("it was deleted");
        Ok(())
    }

    fn get(&self, id: &str) -> DaemonResult<Arc<Session>> {
        number(id).and_then(|n| self.table().get(&n).cloned()).ok_or_else(|| not_found(id))
    }

    fn table(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<Session>>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The number in a session id `s-N`, written exactly as the daemon writes it.
fn number(id: &str) -> Option<u64> {
    let n: u64 = id.strip_prefix("s-")?.parse().ok()?;
    (format!("s-{n}") == id).then_some(n)
}

fn not_found(id: &str) -> DaemonError {
    DaemonError::NotFound(format!("no session `{id}`"))
}

/// Starts `cmd` on the blocking pool and registers it; a shell whose caller went away meanwhile is
/// killed.
async fn spawn_off_the_event_loop(
    children: &Arc<Children>,
    mut cmd: std::process::Command,
) -> std::io::Result<(std::process::Child, oneshot::Receiver<Reaped>)> {
    let children = Arc::clone(children);
    let (tx, rx) = oneshot::channel();
    tokio::task::spawn_blocking(move || {
        if let Err(Ok((orphan, _))) = tx.send(children.spawn(&mut cmd)) {
            tree::kill_tree(orphan.id() as i32);
        }
    });
    rx.await.map_err(|_| std::io::Error::other("the thread starting the shell failed"))?
}

/// `POST /v1/sessions` → 201 with the new session.
pub async fn create(
    State(d): State<Arc<Daemon>>,
    ApiJson(req): ApiJson<CreateSession>,
) -> DaemonResult<(StatusCode, Json<SessionInfo>)> {
    let info = d.sessions.create(&d.defaults, &d.children, req).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// `GET /v1/sessions`.
pub async fn list(State(d): State<Arc<Daemon>>) -> Json<SessionList> {
    Json(SessionList { sessions: d.sessions.list() })
}

/// `POST /v1/sessions/{id}/run`. A client that goes away mid-run interrupts its command.
pub async fn run(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SessionRun>,
) -> DaemonResult<Json<SessionRunResult>> {
    req.check_bounds(d.config.limits.max_output_bytes).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
    d.sessions.run(&id, req).await.map(Json)
}

/// `POST /v1/sessions/{id}/interrupt` → 204.
pub async fn interrupt(State(d): State<Arc<Daemon>>, Path(id): Path<String>) -> DaemonResult<StatusCode> {
    d.sessions.interrupt(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /v1/sessions/{id}` → 204.
pub async fn delete(State(d): State<Arc<Daemon>>, Path(id): Path<String>) -> DaemonResult<StatusCode> {
    d.sessions.delete(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// One session: its shell and the tasks that watch it.
#[derive(Debug)]
struct Session {
    id: String,
    shell: String,
    /// The shell's pid, which also names its process group.
    pid: i32,
    shared: Arc<Shared>,
    /// Where a run's kept output is charged (the daemon's output budget).
    budget: Arc<OutputBudget>,
    /// The two output readers and the exit watcher: owned here, aborted when the session is
    /// forgotten (its shell is killed first, so they would end anyway).
    _tasks: [AbortOnDropHandle<()>; 3],
}

impl Session {
    /// Runs `SETUP_COMMAND`; a shell that cannot is killed and refused.
    async fn set_up(self: &Arc<Self>) -> DaemonResult<()> {
        let nonce = sys::random_hex();
        let started = Instant::now();
        // Refused only when the shell already ended, which the message below explains.
        let result = match RunSlot::begin(Arc::clone(self), &nonce, SETUP_OUTPUT_BYTES) {
            Ok(mut slot) => {
                let outcome = slot.wait(run_script(SETUP_COMMAND, &nonce, false).as_bytes(), Some(SETUP_TIMEOUT)).await;
                slot.finish(outcome, started)
            }
            Err(_) => SessionRunResult::default(),
        };
        // A shell that exits at once (`/bin/true`) also yields status 0, without the markers.
        if result.exit_code == Some(0) && !result.timed_out && self.shared.lock().end().is_none() {
            return Ok(());
        }
        self.kill("its shell did not start");
        let exited = self.shared.lock().exited;
        let why = match (result.timed_out, exited) {
            (true, _) => format!("it did not answer within {} s", SETUP_TIMEOUT.as_secs()),
            (false, Some(exit)) => exit.to_string(),
            (false, None) => format!("`{SETUP_COMMAND}` failed: {}", result.stderr.trim()),
        };
        Err(DaemonError::InvalidArgument(format!(
            "cannot start a session with `{}`: {why}; sessions need a POSIX shell (exec with `argv` works \
             without one)",
            self.shell
        )))
    }

    fn info(&self) -> SessionInfo {
        let alive = self.shared.lock().end().is_none();
        SessionInfo { id: self.id.clone(), shell: self.shell.clone(), pid: self.pid as u32, alive }
    }

    fn interrupt(&self) -> DaemonResult<()> {
        let st = self.shared.lock();
        // Under the lock, so that an exit recorded by the watcher is seen: the pid of a reaped
        // shell may already name another process.
        if let Some(end) = st.end() {
            return Err(ended(&self.id, &end));
        }
        sys::kill_group(self.pid, sys::SIGINT)
            .map_err(|e| DaemonError::Internal(format!("cannot interrupt session `{}`: {e}", self.id)))
    }

    /// SIGKILLs the shell's tree once, unless it already exited, and records why.
    fn kill(&self, why: &'static str) {
        let mut st = self.shared.lock();
        if st.end().is_some() {
            return;
        }
        tree::kill_tree(self.pid);
        st.killed = Some(why);
        if let Phase::Idle(_) = st.phase {
            st.phase = Phase::Ended;
        }
        drop(st);
        self.shared.changed.send_replace(());
    }
}

impl Drop for Session {
    /// A session is dropped once it is forgotten and no run holds it; its shell must not outlive
    /// it (a no-op when it was already killed or exited).
    fn drop(&mut self) {
        self.kill("it was forgotten");
    }
}

/// What a session's output readers, its exit watcher and its current run share.
#[derive(Debug)]
struct Shared {
    /// The session's lifecycle and both output streams. Held only for short updates, never across
    /// an `.await`.
    state: Mutex<SessionState>,
    /// Bumped after every change to `state` that a run waits for: output, a closed pipe, the
    /// shell's end. A watch holds one value, so it never queues; each waiter sees every change
    /// made after it last looked, so none is lost between a check and a wait.
    changed: watch::Sender<()>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug)]
struct SessionState {
    phase: Phase,
    /// How the shell exited, once the reaper reported it.
    exited: Option<ShellExit>,
    /// Why the daemon killed the shell, once it did.
    killed: Option<&'static str>,
    stdout: Capture,
    stderr: Capture,
}

/// Where a session is in its life.
#[derive(Debug)]
enum Phase {
    /// Alive and waiting for a run; holds the shell's stdin.
    Idle(pipe::Sender),
    /// A run holds the shell's stdin and waits for its markers.
    Running,
    /// The shell is gone (see `exited` and `killed`); its stdin is closed.
    Ended,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy)]
enum End {
    Exited(ShellExit),
    Killed(&'static str),
}

#[derive(Debug, Clone, Copy)]
struct ShellExit {
    code: Option<i32>,
    signal: Option<i32>,
}

impl std::fmt::Display for ShellExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code, self.signal) {
            (Some(code), _) => write!(f, "its shell exited with code {code}"),
            (None, Some(signal)) => write!(f, "its shell was killed by signal {signal}"),
            (None, None) => f.write_str("its shell exited"),
        }
    }
}

impl SessionState {
    fn end(&self) -> Option<End> {
        match (self.killed, self.exited) {
            (Some(why), _) => Some(End::Killed(why)),
            (None, Some(exit)) => Some(End::Exited(exit)),
            (None, None) => None,
        }
    }

    /// Hands the shell's stdin to a new run and arms both streams for its markers, their kept
    /// output charged to `budget`.
    fn begin_run(
        &mut self,
        id: &str,
        nonce: &str,
        cap: usize,
        budget: &Arc<OutputBudget>,
    ) -> DaemonResult<pipe::Sender> {
        let end = self.end();
        match std::mem::replace(&mut self.phase, Phase::Running) {
            Phase::Running => Err(DaemonError::Conflict(format!("session `{id}` is busy running a command"))),
            Phase::Idle(stdin) if end.is_none() => {
                // Output that arrived since the last run (background jobs) is nobody's.
                self.stdout.arm(nonce, cap, Arc::clone(budget));
                self.stderr.arm(nonce, cap, Arc::clone(budget));
                Ok(stdin)
            }
            Phase::Idle(_) | Phase::Ended => {
                self.phase = Phase::Ended;
                let end = end.unwrap_or(End::Killed("its shell is gone"));
                Err(ended(id, &end))
            }
        }
    }

    /// Gives the stdin back after a run, unless the shell ended meanwhile.
    fn end_run(&mut self, stdin: Option<pipe::Sender>) {
        self.stdout.disarm();
        self.stderr.disarm();
        self.phase = match (self.end(), stdin) {
            (None, Some(stdin)) => Phase::Idle(stdin),
            _ => Phase::Ended,
        };
    }

    fn capture(&mut self, stream: Stream) -> &mut Capture {
        match stream {
            Stream::Stdout => &mut self.stdout,
            Stream::Stderr => &mut self.stderr,
        }
    }
}

fn ended(id: &str, end: &End) -> DaemonError {
    let why = match end {
        End::Killed(why) => (*why).to_string(),
        End::Exited(exit) => exit.to_string(),
    };
    DaemonError::Conflict(format!("session `{id}` has ended: {why}; create a new one"))
}

/// A run's hold on its session. Dropped before `finish` (the client went away), it interrupts
/// the command; either way it gives the shell's stdin back to the session.
#[derive(Debug)]
struct RunSlot {
    session: Arc<Session>,
    stdin: Option<pipe::Sender>,
    /// How much of the script has reached the shell's stdin, of how much. A run abandoned in
    /// between leaves the shell half a script that would swallow the next one, so the session is
    /// killed instead.
    sent: usize,
    script_len: usize,
    finished: bool,
    /// Processes of the session that were there before the run (see [`tree::group_members`]).
    spared: Vec<i32>,
}

/// How a run ended, before its output is collected.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    exit_code: Option<i32>,
    timed_out: bool,
}

impl RunSlot {
    fn begin(session: Arc<Session>, nonce: &str, cap: usize) -> DaemonResult<RunSlot> {
        let stdin = session.shared.lock().begin_run(&session.id, nonce, cap, &session.budget)?;
        Ok(RunSlot { session, stdin: Some(stdin), sent: 0, script_len: 0, finished: false, spared: Vec::new() })
    }

    /// Writes `script` and waits for both markers, the shell's end, or the timeout.
    async fn wait(&mut self, script: &[u8], timeout: Option<Duration>) -> Outcome {
        self.script_len = script.len();
        let RunSlot { session, stdin, sent, spared, .. } = self;
        let shared = &session.shared;
        let Some(stdin) = stdin.as_mut() else { return Outcome { exit_code: None, timed_out: false } };
        // Written while output is read: a large script and a chatty command must not wait on
        // each other.
        let write = async {
            while *sent < script.len() {
                match stdin.write(&script[*sent..]).await? {
                    0 => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)),
                    n => *sent += n,
                }
            }
            Ok(())
        };
        tokio::pin!(write);
        let mut writing = true;
        let mut deadline = timeout.map(|t| Instant::now() + t);
        let mut timed_out = false;
        let mut killed_below = false;
        let mut drain_until: Option<Instant> = None;
        let mut changed = shared.changed.subscribe();
        loop {
            changed.borrow_and_update();
            {
                let st = shared.lock();
                if let (Some((_, code)), Some(_)) = (st.stdout.marker, st.stderr.marker) {
                    return Outcome { exit_code: code, timed_out };
                }
                if st.exited.is_some() && st.stdout.closed && st.stderr.closed {
                    return Outcome { exit_code: st.exited.and_then(|e| e.code), timed_out };
                }
                // Once the shell is gone or a pipe closed before its marker, the markers can
                // never come: wait briefly for the rest of the output and the exit.
                let blind = (st.stdout.closed && st.stdout.marker.is_none())
                    || (st.stderr.closed && st.stderr.marker.is_none());
                if drain_until.is_none() && (st.end().is_some() || blind) {
                    drain_until = Some(Instant::now() + DRAIN);
                }
            }
            tokio::select! {
                result = &mut write, if writing => {
                    writing = false;
                    // The shell no longer reads its stdin: it is exiting.
                    if result.is_err() && drain_until.is_none() {
                        drain_until = Some(Instant::now() + DRAIN);
                    }
                }
                // The sender lives in `shared`, which this run holds: this never fails.
                _ = changed.changed() => {}
                () = sleep_until(deadline) => {
                    if !timed_out {
                        // First SIGINT, as Ctrl-C would: the shell traps it and carries on.
                        timed_out = true;
                        let _ = sys::kill_group(session.pid, sys::SIGINT);
                        deadline = Some(Instant::now() + INTERRUPT_GRACE);
                    } else if !killed_below {
                        // Then SIGKILL to what the run started, never to the shell: the run ends
                        // with the shell's markers and the session keeps its cwd and env.
                        killed_below = true;
                        tree::kill_group_members(session.pid, spared);
                        deadline = Some(Instant::now() + KILL_GRACE);
                    } else {
                        session.kill(
                            "a command timed out while running in the shell itself (a loop of builtins), which \
                             only killing the shell stops",
                        );
                        return Outcome { exit_code: None, timed_out };
                    }
                }
                () = sleep_until(drain_until) => {
                    let exit_code = shared.lock().exited.and_then(|e| e.code);
                    // A no-op when the shell exited or was killed; otherwise it closed its
                    // output and can no longer tell where a command ends.
                    session.kill("its shell closed its output, so the end of a command can no longer be seen");
                    return Outcome { exit_code, timed_out };
                }
            }
        }
    }

    fn finish(mut self, outcome: Outcome, started: Instant) -> SessionRunResult {
        let st = self.session.shared.lock();
        let (stdout, stdout_truncated) = st.stdout.output();
        let (stderr, stderr_truncated) = st.stderr.output();
        drop(st);
        self.finished = true;
        SessionRunResult {
            exit_code: outcome.exit_code,
            stdout,
            stderr,
            stdout_truncated,
            stderr_truncated,
            timed_out: outcome.timed_out,
            duration_ms: started.elapsed().as_millis().try_into().unwrap_or(u64::MAX),
        }
    }
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        if !self.finished && 0 < self.sent && self.sent < self.script_len {
            self.session.kill("a run was abandoned before its whole command reached the shell");
        }
        let mut st = self.session.shared.lock();
        if !self.finished && st.end().is_none() {
            // Abandoned mid-run: stop the command so that the next run does not queue behind it.
            let _ = sys::kill_group(self.session.pid, sys::SIGINT);
        }
        st.end_run(self.stdin.take());
    }
}

/// Sleeps until `at`, or forever when there is no `at`.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Reads one of the shell's pipes for the session's whole life into its capture.
async fn pump(shared: Arc<Shared>, mut pipe: pipe::Receiver, stream: Stream) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        shared.lock().capture(stream).push(stream, &buf[..n]);
        shared.changed.send_replace(());
    }
    shared.lock().capture(stream).closed = true;
    shared.changed.send_replace(());
}

/// Records the shell's exit when the reaper reports it.
async fn watch_exit(shared: Arc<Shared>, exit: oneshot::Receiver<Reaped>) {
    let exit = match exit.await {
        Ok(r) => ShellExit { code: r.exit_code(), signal: r.signal() },
        // The children table was dropped: the daemon is stopping and the status is unknown.
        Err(_) => ShellExit { code: None, signal: None },
    };
    let mut st = shared.lock();
    st.exited = Some(exit);
    if let Phase::Idle(_) = st.phase {
        st.phase = Phase::Ended;
    }
    drop(st);
    shared.changed.send_replace(());
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

/// One of the shell's output streams, as the current run sees it.
#[derive(Debug, Default)]
struct Capture {
    /// The current run's nonce; `None` between runs, when output belongs to nobody and is dropped.
    nonce: Option<String>,
    /// The nonce of the last run that was abandoned before its marker came on this stream. What
    /// comes before that marker is the abandoned command's output, not the current run's.
    skip: Option<String>,
    /// At most this many bytes of the run's output are kept.
    cap: usize,
    /// The first `cap` bytes the stream carried during the run (fewer when the daemon's output
    /// budget had no more room).
    kept: Kept,
    /// How many bytes the stream carried during the run.
    seen: usize,
    /// The last bytes seen (at most `MARKER_WINDOW`), where a marker cut by a read starts.
    window: Vec<u8>,
    /// Where the run's marker starts in the stream, and the status it carries (stdout only).
    marker: Option<(usize, Option<i32>)>,
    /// The pipe reached its end: the shell and everything else holding it are gone.
    closed: bool,
}

impl Capture {
    fn arm(&mut self, nonce: &str, cap: usize, budget: Arc<OutputBudget>) {
        let skip = self.skip.take();
        // A marker being skipped may have started in the window already.
        let window = if skip.is_some() { std::mem::take(&mut self.window) } else { Vec::new() };
        *self = Capture {
            nonce: Some(nonce.to_string()),
            skip,
            cap,
            kept: Kept { buf: Vec::new(), budget: Some(budget), charged: 0 },
            window,
            closed: self.closed,
            ..Capture::default()
        };
    }

    fn disarm(&mut self) {
        let (skip, window) = match (self.nonce.take(), self.marker) {
            // Abandoned: this run's marker is still to come, after any older one.
            (Some(nonce), None) => (Some(nonce), std::mem::take(&mut self.window)),
            (Some(_), Some(_)) => (None, Vec::new()),
            (None, _) => (self.skip.take(), std::mem::take(&mut self.window)),
        };
        *self = Capture { skip, window, closed: self.closed, ..Capture::default() };
    }

    /// Takes one read's worth of output: keeps it up to the cap and looks for the marker, past
    /// the cap too.
    fn push(&mut self, stream: Stream, data: &[u8]) {
        if let Some(skip) = &self.skip {
            self.window.extend_from_slice(data);
            match find_marker(&self.window, skip, stream) {
                Some(m) => {
                    let rest = self.window.split_off(m.end);
                    self.window.clear();
                    self.skip = None;
                    self.push(stream, &rest);
                }
                None => self.trim_window(),
            }
            return;
        }
        let Some(nonce) = &self.nonce else { return };
        if self.marker.is_some() {
            // After the marker: background jobs writing after their command finished.
            return;
        }
        self.kept.push(data, self.cap);
        let window_start = self.seen - self.window.len();
        self.seen += data.len();
        self.window.extend_from_slice(data);
        match find_marker(&self.window, nonce, stream) {
            Some(m) => {
                self.marker = Some((window_start + m.at, m.status));
                self.window = Vec::new();
            }
            None => self.trim_window(),
        }
    }

    fn trim_window(&mut self) {
        let excess = self.window.len().saturating_sub(MARKER_WINDOW);
        self.window.drain(..excess);
    }

    /// The run's output (everything before the marker, or all of it when none came) as UTF-8,
    /// and whether it was cut at the cap.
    fn output(&self) -> (String, bool) {
        let len = self.marker.map_or(self.seen, |(at, _)| at);
        let kept = &self.kept.buf[..len.min(self.kept.buf.len())];
        (String::from_utf8_lossy(kept).into_owned(), len > kept.len())
    }
}

/// A run's kept output, whose capacity is taken from the daemon's output budget as it grows and
/// given back when it is dropped (the run's end, or the next run).
#[derive(Debug, Default)]
struct Kept {
    buf: Vec<u8>,
    /// The budget it is charged to; `None` between runs, when nothing is kept.
    budget: Option<Arc<OutputBudget>>,
    /// Bytes of capacity taken from the budget.
    charged: u64,
}

impl Kept {
    /// Keeps as much of `data` as `cap` and the budget allow; the rest is dropped.
    fn push(&mut self, data: &[u8], cap: usize) {
        let Some(budget) = &self.budget else { return };
        let len = self.buf.len();
        let max_len = budget.grow(&mut self.charged, len as u64, data.len() as u64, cap as u64);
        let max_len = usize::try_from(max_len).unwrap_or(usize::MAX);
        if max_len > self.buf.capacity() {
            self.buf.reserve_exact(max_len - len);
        }
        let room = max_len.saturating_sub(len).min(data.len());
        self.buf.extend_from_slice(&data[..room]);
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        if let Some(budget) = &self.budget {
            budget.give_back(self.charged);
        }
    }
}

/// `s` as one single-quoted shell word: each `'` becomes `'\''`.
fn single_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script one run writes to the shell. `command eval` keeps the shell alive through a syntax
/// error in the command, `</dev/null` keeps the command from reading the scripts that follow,
/// and the markers print the status on stdout and end stderr, each after a newline of our own.
fn run_script(command: &str, nonce: &str, merge: bool) -> String {
    format!(
        "command eval {} </dev/null{}\n__sandman_rc=$?; printf '\\n%s %d\\n' '{nonce}' \"$__sandman_rc\"; \
         printf '\\n%s\\n' '{nonce}' >&2\n",
        single_quote(command),
        if merge { " 2>&1" } else { "" }
    )
}

/// A whole marker found in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Marker {
    /// Where it starts: its leading `\n`, which the script added, so the output is exactly what
    /// comes before.
    at: usize,
    /// Just past its final `\n`.
    end: usize,
    /// The status it carries (stdout only).
    status: Option<i32>,
}

/// Finds the whole marker of `nonce` in `buf`: on stdout `\n<nonce> <status>\n`, on stderr
/// `\n<nonce>\n`. The nonce is 128 fresh random bits, so nothing a command prints can fake it.
fn find_marker(buf: &[u8], nonce: &str, stream: Stream) -> Option<Marker> {
    let nonce = nonce.as_bytes();
    for at in (0..buf.len()).filter(|&i| buf[i] == b'\n') {
        let Some(rest) = buf[at + 1..].strip_prefix(nonce) else { continue };
        let tail = at + 1 + nonce.len();
        match stream {
            Stream::Stderr if rest.first() == Some(&b'\n') => return Some(Marker { at, end: tail + 1, status: None }),
            Stream::Stdout => {
                if let Some((status, len)) = parse_status(rest) {
                    return Some(Marker { at, end: tail + len, status: Some(status) });
                }
            }
            Stream::Stderr => {}
        }
    }
    None
}

/// The ` <status>\n` after the nonce of a stdout marker, and its length.
fn parse_status(rest: &[u8]) -> Option<(i32, usize)> {
    let digits = rest.strip_prefix(b" ")?;
    let end = digits.iter().take(12).position(|&b| b == b'\n')?;
    let status = std::str::from_utf8(&digits[..end]).ok()?.parse().ok()?;
    Some((status, end + 2))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use tokio_util::sync::CancellationToken;

    use super::*;

    const NONCE: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn single_quotes_survive_quoting() {
        assert_eq!(single_quote("echo hi"), "'echo hi'");
        assert_eq!(single_quote("it's"), r"'it'\''s'");
        assert_eq!(single_quote("''"), r"''\'''\'''");
    }

    #[test]
    fn the_script_evals_the_command_then_prints_both_markers() {
        let script = run_script("echo 'a'", NONCE, false);
        assert_eq!(
            script,
            format!(
                "command eval 'echo '\\''a'\\''' </dev/null\n__sandman_rc=$?; printf '\\n%s %d\\n' '{NONCE}' \
                 \"$__sandman_rc\"; printf '\\n%s\\n' '{NONCE}' >&2\n"
            )
        );
    }

    #[test]
    fn markers_are_found_with_their_status() {
        let out = format!("hello\n\n{NONCE} 42\n");
        assert_eq!(
            find_marker(out.as_bytes(), NONCE, Stream::Stdout),
            Some(Marker { at: 6, end: out.len(), status: Some(42) })
        );
        let err = format!("oops\n{NONCE}\nafter");
        assert_eq!(
            find_marker(err.as_bytes(), NONCE, Stream::Stderr),
            Some(Marker { at: 4, end: err.len() - 5, status: None })
        );
        // Not until the marker's last newline has arrived.
        assert_eq!(find_marker(format!("\n{NONCE} 4").as_bytes(), NONCE, Stream::Stdout), None);
        assert_eq!(find_marker(format!("\n{NONCE}").as_bytes(), NONCE, Stream::Stderr), None);
    }

    #[test]
    fn printed_fake_markers_do_not_end_the_run() {
        let other = "ffffffffffffffffffffffffffffffff";
        let half = &NONCE[..16];
        let printed =
            format!("\n{other} 0\n\n{other}\n\n{half} 0\n\n{NONCE}x 1\n\n{NONCE} \n\n{NONCE} nope\nx{NONCE} 3\nrest");
        let stream = format!("{printed}\n{NONCE} 7\n");
        let found = find_marker(stream.as_bytes(), NONCE, Stream::Stdout);
        assert_eq!(found, Some(Marker { at: printed.len(), end: stream.len(), status: Some(7) }));

        let mut capture = Capture::default();
        capture.arm(NONCE, 1 << 20, unlimited());
        capture.push(Stream::Stdout, stream.as_bytes());
        assert_eq!(capture.marker.map(|(_, code)| code), Some(Some(7)));
        assert_eq!(capture.output(), (printed, false));
    }

    #[test]
    fn a_marker_split_across_reads_is_found() {
        let stream = format!("line one\nline two\n{NONCE} 0\n");
        let mut capture = Capture::default();
        capture.arm(NONCE, 1 << 20, unlimited());
        for b in stream.as_bytes() {
            assert!(capture.marker.is_none());
            capture.push(Stream::Stdout, std::slice::from_ref(b));
        }
        assert_eq!(capture.output(), ("line one\nline two".to_string(), false));
        assert_eq!(capture.marker.map(|(_, code)| code), Some(Some(0)));
    }

    #[test]
    fn output_past_the_cap_is_dropped_but_the_marker_still_found() {
        let mut capture = Capture::default();
        capture.arm(NONCE, 10, unlimited());
        for _ in 0..1000 {
            capture.push(Stream::Stderr, b"0123456789abcdef");
        }
        capture.push(Stream::Stderr, format!("\n{NONCE}").as_bytes());
        assert!(capture.marker.is_none());
        capture.push(Stream::Stderr, b"\nlater output of a background job\n");
        assert!(capture.marker.is_some());
        assert_eq!(capture.output(), ("0123456789".to_string(), true));
        assert!(capture.window.len() <= MARKER_WINDOW);
    }

    #[test]
    fn output_between_runs_is_dropped() {
        let mut capture = Capture::default();
        capture.push(Stream::Stdout, b"from a background job\n");
        capture.arm(NONCE, 100, unlimited());
        capture.push(Stream::Stdout, format!("mine\n{NONCE} 0\n").as_bytes());
        assert_eq!(capture.output(), ("mine".to_string(), false));
        capture.disarm();
        capture.push(Stream::Stdout, b"more from the background\n");
        assert_eq!(capture.seen, 0);
    }

    #[test]
    fn the_next_run_skips_what_an_abandoned_run_still_prints() {
        let old = "ffffffffffffffffffffffffffffffff";
        let mut capture = Capture::default();
        capture.arm(old, 100, unlimited());
        capture.push(Stream::Stdout, b"abandoned command's output\n");
        capture.disarm();
        capture.push(Stream::Stdout, b"more of it, between runs\n\nffff");
        capture.arm(NONCE, 100, unlimited());
        let rest = format!("ffffffffffffffffffffffffffff 130\nnext\n\n{NONCE} 0\n");
        for b in rest.as_bytes() {
            capture.push(Stream::Stdout, std::slice::from_ref(b));
        }
        assert_eq!(capture.output(), ("next\n".to_string(), false));
        assert_eq!(capture.marker.map(|(_, status)| status), Some(Some(0)));
        assert!(capture.skip.is_none());
        capture.disarm();
        assert!(capture.skip.is_none());
    }

    fn unlimited() -> Arc<OutputBudget> {
        Arc::new(OutputBudget::new(u64::MAX))
    }

    /// Before, a run kept up to its `max_output_bytes` whatever execs and background processes
    /// held: sessions were outside the daemon's output budget.
    #[test]
    fn a_runs_output_is_held_to_the_daemons_budget_and_given_back() {
        let budget = Arc::new(OutputBudget::new(1000));
        assert_eq!(budget.take(400), 400); // what the others hold
        let mut capture = Capture::default();
        capture.arm(NONCE, 10_000, Arc::clone(&budget));
        for _ in 0..100 {
            capture.push(Stream::Stdout, b"0123456789abcdef");
        }
        capture.push(Stream::Stdout, format!("\n{NONCE} 0\n").as_bytes());
        let (out, truncated) = capture.output();
        assert_eq!((out.len(), truncated), (600, true));
        assert_eq!(budget.held(), 1000);
        capture.disarm();
        assert_eq!(budget.held(), 400, "the run's share was not given back");
        // The next run has the room again.
        capture.arm(NONCE, 10_000, Arc::clone(&budget));
        capture.push(Stream::Stdout, format!("short\n{NONCE} 0\n").as_bytes());
        assert_eq!(capture.output(), ("short".to_string(), false));
        drop(capture);
        assert_eq!(budget.held(), 400);
    }

    #[test]
    fn ids_are_read_exactly_as_written() {
        assert_eq!(number("s-12"), Some(12));
        assert_eq!(number("s-012"), None);
        assert_eq!(number("12"), None);
        assert_eq!(number("s-"), None);
    }

    fn defaults() -> Defaults {
        Defaults {
            env: Arc::new(BTreeMap::from([("PATH".into(), crate::spawn::DEFAULT_PATH.into())])),
            cwd: PathBuf::from("/"),
            shell: "/bin/sh".into(),
            passwd: PathBuf::from("/etc/passwd"),
            euid: sys::euid(),
            rlimits: sys::Rlimits::default(),
            file_size_held: false,
            // As the daemon decides: a test run from a background job ignores SIGINT
            // (regression: the shell could not be interrupted there).
            ignored_signals: sys::ignored_signals(),
        }
    }

    fn cmd(command: &str) -> SessionRun {
        SessionRun { command: command.into(), ..SessionRun::default() }
    }

    async fn run_ok(sessions: &Sessions, id: &str, req: SessionRun) -> SessionRunResult {
        sessions.run(id, req).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until the session's current run has printed `text` on stdout.
    async fn printed(sessions: &Sessions, id: &str, text: &str) {
        let shared = Arc::clone(&sessions.get(id).unwrap_or_else(|e| panic!("{e}")).shared);
        let mut changed = shared.changed.subscribe();
        loop {
            changed.borrow_and_update();
            if String::from_utf8_lossy(&shared.lock().stdout.kept.buf).contains(text) {
                return;
            }
            let _ = changed.changed().await;
        }
    }

    // One test for every real-shell scenario: the reaper reaps any child of the process, so two
    // tests each with their own reaper and children table would steal each other's exits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_real_shell_session() {
        let children = Children::new();
        let cancel = CancellationToken::new();
        let reaper =
            crate::children::install_reaper(Arc::clone(&children), cancel.clone()).unwrap_or_else(|e| panic!("{e}"));
        let sessions = Sessions::new(Arc::new(OutputBudget::new(u64::MAX)));
        let d = defaults();

        state_survives_between_runs(&sessions, &d, &children).await;
        busy_sessions_refuse_a_second_run_and_interrupts_stop_the_first(&sessions, &d, &children).await;
        an_abandoned_run_is_interrupted(&sessions, &d, &children).await;
        timeouts_interrupt_then_kill(&sessions, &d, &children).await;
        exit_ends_the_session_with_its_code(&sessions, &d, &children).await;
        shells_that_cannot_run_sessions_are_refused(&sessions, &d, &children).await;
        an_interrupt_right_after_create_spares_the_shell(&sessions, &d, &children).await;

        sessions.kill_all();
        assert_eq!(sessions.count(), 0);
        cancel.cancel();
        let _ = reaper.await;
    }

    async fn state_survives_between_runs(sessions: &Sessions, d: &Defaults, children: &Arc<Children>) {
        let info = sessions.create(d, children, CreateSession::default()).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(info.alive && info.shell == "/bin/sh" && info.pid > 1);
        let id = info.id;

        let r = run_ok(sessions, &id, cmd("cd /tmp && export FOO=bar && greet() { echo \"hi $1\"; }")).await;
        assert_eq!((r.exit_code, r.stdout.as_str(), r.stderr.as_str()), (Some(0), "", ""));
        let r = run_ok(sessions, &id, cmd("pwd; echo \"$FOO\"; greet 'o'\\''brien'; echo err >&2; false")).await;
        assert_eq!(r.stdout, "/tmp\nbar\nhi o'brien\n");
        assert_eq!((r.stderr.as_str(), r.exit_code, r.timed_out), ("err\n", Some(1), false));
        let merged = SessionRun { merge_output: true, ..cmd("echo a; echo b >&2; echo c; greet x >&2") };
        let r = run_ok(sessions, &id, merged).await;
        assert_eq!((r.stdout.as_str(), r.stderr.as_str(), r.exit_code), ("a\nb\nc\nhi x\n", "", Some(0)));

        let r = run_ok(sessions, &id, cmd("printf 'no newline'; printf '\\n%s 0\\n' 0123456789abcdef0123456789abcdef"))
            .await;
        assert_eq!(r.stdout, "no newline\n0123456789abcdef0123456789abcdef 0\n");

        // A syntax error inside `eval` fails the command, not the shell.
        let r = run_ok(sessions, &id, cmd("echo 'unterminated")).await;
        assert_eq!(r.exit_code, Some(2));
        assert!(r.stderr.contains("nterminated"), "{}", r.stderr);
        let r = run_ok(sessions, &id, cmd("cat; echo \"$FOO\"")).await;
        assert_eq!((r.stdout.as_str(), r.exit_code), ("bar\n", Some(0)));

        let big = SessionRun {
            max_output_bytes: Some(1000),
            ..cmd("head -c 100000 /dev/zero | tr '\\0' a; exit_is=7; (exit $exit_is)")
        };
        let r = run_ok(sessions, &id, big).await;
        assert_eq!((r.stdout.len(), r.stdout_truncated, r.stderr_truncated, r.exit_code), (1000, true, false, Some(7)));

        // Far more than a pipe holds: written while the shell reads it.
        let r = run_ok(sessions, &id, cmd(&format!(": '{}'; echo big", "x".repeat(1 << 20)))).await;
        assert_eq!((r.stdout.as_str(), r.exit_code), ("big\n", Some(0)));

        assert!(sessions.list().iter().any(|s| s.id == id && s.alive));
        sessions.delete(&id).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(sessions.run(&id, cmd("true")).await, Err(DaemonError::NotFound(_))));
        assert!(matches!(sessions.delete(&id), Err(DaemonError::NotFound(_))));
        assert!(!sessions.list().iter().any(|s| s.id == id));
    }

    async fn busy_sessions_refuse_a_second_run_and_interrupts_stop_the_first(
        sessions: &Sessions,
        d: &Defaults,
        children: &Arc<Children>,
    ) {
        let id = sessions.create(d, children, CreateSession::default()).await.unwrap_or_else(|e| panic!("{e}")).id;
        // The child prints, then becomes `sleep`: once "ready" is seen, SIGINT cannot miss it.
        let slow = sessions.run(&id, cmd("sh -c 'echo ready; exec sleep 30'"));
        tokio::pin!(slow);
        let second = tokio::select! {
            biased;
            _ = &mut slow => panic!("`sleep 30` ended at once"),
            second = sessions.run(&id, cmd("true")) => second,
        };
        let busy = second.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(busy.contains("busy"), "{busy}");
        tokio::select! {
            _ = &mut slow => panic!("`sleep 30` ended at once"),
            () = printed(sessions, &id, "ready") => {}
        }
        sessions.interrupt(&id).unwrap_or_else(|e| panic!("{e}"));
        let r = slow.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.stdout.as_str(), r.exit_code, r.timed_out), ("ready\n", Some(130), false));
        let r = run_ok(sessions, &id, cmd("echo still here")).await;
        assert_eq!(r.stdout, "still here\n");
        assert!(matches!(sessions.interrupt("s-999"), Err(DaemonError::NotFound(_))));
        sessions.delete(&id).unwrap_or_else(|e| panic!("{e}"));
    }

    async fn an_abandoned_run_is_interrupted(sessions: &Sessions, d: &Defaults, children: &Arc<Children>) {
        let id = sessions.create(d, children, CreateSession::default()).await.unwrap_or_else(|e| panic!("{e}")).id;
        let mut abandoned = Box::pin(sessions.run(&id, cmd("sh -c 'echo ready; exec sleep 30'")));
        tokio::select! {
            _ = &mut abandoned => panic!("`sleep 30` ended at once"),
            () = printed(sessions, &id, "ready") => {}
        }
        // What axum does when the client goes away.
        drop(abandoned);
        let r = run_ok(sessions, &id, cmd("echo next")).await;
        assert_eq!((r.stdout.as_str(), r.exit_code), ("next\n", Some(0)));
        sessions.delete(&id).unwrap_or_else(|e| panic!("{e}"));
    }

    async fn timeouts_interrupt_then_kill(sessions: &Sessions, d: &Defaults, children: &Arc<Children>) {
        let id = sessions.create(d, children, CreateSession::default()).await.unwrap_or_else(|e| panic!("{e}")).id;
        let r = run_ok(sessions, &id, SessionRun { timeout_ms: Some(1000), ..cmd("echo before; sleep 30") }).await;
        assert_eq!((r.stdout.as_str(), r.exit_code, r.timed_out), ("before\n", Some(130), true));
        assert!(sessions.list().iter().any(|s| s.id == id && s.alive));

        // A command that ignores SIGINT is SIGKILLed, the shell kept with its cwd and env, and a
        // background job of an earlier run spared (regression: the session was killed).
        let r = run_ok(sessions, &id, cmd("cd /tmp; export KEEP=kept; sleep 300 & echo $!")).await;
        let background: i32 = r.stdout.trim().parse().unwrap_or_else(|e| panic!("{e}: {r:?}"));
        let stubborn = "sh -c 'trap \"\" INT; echo ready; exec sleep 30'";
        let r = run_ok(sessions, &id, SessionRun { timeout_ms: Some(300), ..cmd(stubborn) }).await;
        assert_eq!((r.stdout.as_str(), r.exit_code, r.timed_out), ("ready\n", Some(137), true));
        let r = run_ok(sessions, &id, cmd(&format!("echo \"$PWD $KEEP\"; kill -0 {background} && echo spared"))).await;
        assert_eq!(r.stdout, "/tmp kept\nspared\n");
        let _ = sys::kill_pid(background, sys::SIGKILL);

        // A loop of builtins runs in the shell itself, which SIGINT (trapped) does not stop.
        let r =
            run_ok(sessions, &id, SessionRun { timeout_ms: Some(200), ..cmd("echo spin; while :; do :; done") }).await;
        assert_eq!((r.stdout.as_str(), r.exit_code, r.timed_out), ("spin\n", None, true));
        assert!(sessions.list().iter().any(|s| s.id == id && !s.alive));
        let gone = sessions.run(&id, cmd("true")).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(gone.contains("has ended") && gone.contains("timed out"), "{gone}");
        sessions.delete(&id).unwrap_or_else(|e| panic!("{e}"));
    }

    async fn exit_ends_the_session_with_its_code(sessions: &Sessions, d: &Defaults, children: &Arc<Children>) {
        let req = CreateSession {
            env: BTreeMap::from([("GREETING".into(), "bye".into())]),
            cwd: Some("/tmp".into()),
            ..CreateSession::default()
        };
        let id = sessions.create(d, children, req).await.unwrap_or_else(|e| panic!("{e}")).id;
        let r = run_ok(sessions, &id, cmd("echo \"$GREETING from $PWD\"; exit 3")).await;
        assert_eq!((r.stdout.as_str(), r.exit_code, r.timed_out), ("bye from /tmp\n", Some(3), false));
        assert!(sessions.list().iter().any(|s| s.id == id && !s.alive));
        let gone = sessions.run(&id, cmd("true")).await.err();
        assert!(matches!(&gone, Some(DaemonError::Conflict(m)) if m.contains("exited with code 3")), "{gone:?}");
        assert!(matches!(sessions.interrupt(&id), Err(DaemonError::Conflict(_))));
        sessions.delete(&id).unwrap_or_else(|e| panic!("{e}"));
    }

    async fn shells_that_cannot_run_sessions_are_refused(sessions: &Sessions, d: &Defaults, children: &Arc<Children>) {
        let refused = |shell: &str| CreateSession { shell: Some(shell.into()), ..CreateSession::default() };
        let err = sessions.create(d, children, refused("/nonexistent/sh")).await.err();
        assert!(matches!(&err, Some(DaemonError::InvalidArgument(m)) if m.contains("need a shell")), "{err:?}");
        let err = sessions.create(d, children, refused("/bin/false")).await.err();
        assert!(matches!(&err, Some(DaemonError::InvalidArgument(m)) if m.contains("exited with code 1")), "{err:?}");
        let err = sessions.create(d, children, refused("/bin/true")).await.err();
        assert!(matches!(&err, Some(DaemonError::InvalidArgument(m)) if m.contains("exited with code 0")), "{err:?}");
        let relative = sessions.create(d, children, refused("sh")).await;
        assert!(matches!(relative, Err(DaemonError::InvalidArgument(_))));
        assert_eq!(sessions.count(), 0);
    }

    async fn an_interrupt_right_after_create_spares_the_shell(
        sessions: &Sessions,
        d: &Defaults,
        children: &Arc<Children>,
    ) {
        let id = sessions.create(d, children, CreateSession::default()).await.unwrap_or_else(|e| panic!("{e}")).id;
        sessions.interrupt(&id).unwrap_or_else(|e| panic!("{e}"));
        let r = run_ok(sessions, &id, cmd("echo alive")).await;
        assert_eq!((r.stdout.as_str(), r.exit_code), ("alive\n", Some(0)));
        sessions.delete(&id).unwrap_or_else(|e| panic!("{e}"));
    }
}

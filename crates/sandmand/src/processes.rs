//! Background processes (`/v1/processes`): started, then outliving the call that started them,
//! with bounded output retention read from any byte offset or followed, stdin, signals and wait.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use sandman_wire::daemon::{
    ExitStatus, OutputChunk, OutputEvent, OutputQuery, ProcessInfo, ProcessList, ProcessState, PtySize, ResizeRequest,
    SignalRequest, SignalSpec, StartProcess, StdinQuery, StdinWrite, StreamName, WaitRequest,
};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};

use crate::budget::OutputBudget;
use crate::error::{DaemonError, DaemonResult};
use crate::extract::{ApiJson, ApiQuery, BadRequest, MAX_JSON_BODY, read_limited};
use crate::run::{self, Io, OutputSink, Utf8Chunks, incomplete_tail};
use crate::spawn::{Launch, LaunchRequest};
use crate::state::Daemon;
use crate::{stream, sys, tree};

/// Bytes of each stream kept when the request sets no `retain_bytes`.
pub const DEFAULT_RETAIN: u64 = 1 << 20;
/// Processes remembered at once; past it the oldest exited one is forgotten.
pub const MAX_PROCESSES: usize = 1024;
/// Default and largest size of one `output` answer.
const DEFAULT_CHUNK: u64 = 1 << 20;
/// Default wait of `/wait`.
const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// Events buffered for one follower of a process's output.
const FOLLOW_EVENTS: usize = 16;
/// `TERM` of a process on a terminal whose request sets none.
pub const DEFAULT_TERM: &str = "xterm-256color";
/// What `close` writes to a terminal: Ctrl-D, end-of-file for a reader in canonical mode.
const EOF_CHAR: u8 = 0x04;

/// The last `cap` bytes of one output stream and the offset of the first of them. Its capacity
/// is taken from the daemon's output budget; when the budget has no more, new output replaces
/// the ring's own oldest.
#[derive(Debug)]
struct Ring {
    buf: VecDeque<u8>,
    /// Stream offset of `buf[0]`: everything before it was dropped.
    start: u64,
    cap: usize,
    budget: Arc<OutputBudget>,
    /// Bytes of capacity taken from the budget, given back when the ring is dropped.
    charged: u64,
}

impl Ring {
    fn new(cap: usize, budget: Arc<OutputBudget>) -> Self {
        Ring { buf: VecDeque::new(), start: 0, cap, budget, charged: 0 }
    }

    fn total(&self) -> u64 {
        self.start + self.buf.len() as u64
    }

    fn push(&mut self, data: &[u8]) {
        // Only the last `cap` bytes of `data` can stay.
        let cut = data.len().saturating_sub(self.cap);
        let data = &data[cut..];
        let len = self.buf.len();
        let max_len = self.budget.grow(&mut self.charged, len as u64, data.len() as u64, self.cap as u64) as usize;
        if max_len > self.buf.capacity() {
            self.buf.reserve_exact(max_len - len);
        }
        let keep = data.len().min(max_len);
        let skipped = data.len() - keep;
        // What may not grow the ring replaces its oldest bytes.
        let evict = (len + keep).saturating_sub(max_len).min(len);
        self.buf.drain(..evict);
        self.buf.extend(&data[skipped..]);
        self.start += (cut + evict + skipped) as u64;
    }

    /// Bytes from `offset` (or the first retained byte after it), at most `max`:
    /// `(where they start, bytes dropped before that, data)`.
    fn read(&self, offset: u64, max: u64) -> (u64, u64, Vec<u8>) {
        let from = offset.max(self.start).min(self.total());
        let dropped = from.saturating_sub(offset).min(self.start.saturating_sub(offset));
        let skip = (from - self.start) as usize;
        let take = (self.total() - from).min(max) as usize;
        (from, dropped, self.buf.iter().skip(skip).take(take).copied().collect())
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.budget.give_back(self.charged);
    }
}

#[derive(Debug)]
struct Output {
    stdout: Ring,
    stderr: Ring,
    /// Set once the process has exited and its output is complete.
    exit: Option<ExitStatus>,
}

impl Output {
    fn ring(&self, stream: StreamName) -> &Ring {
        match stream {
            StreamName::Stdout => &self.stdout,
            StreamName::Stderr => &self.stderr,
        }
    }
}

#[derive(Debug)]
pub struct Process {
    id: String,
    tag: Option<String>,
    pid: i32,
    argv: Vec<String>,
    started_at_ms: u64,
    /// Retained output and exit status, written by the driver task, read by callers; never
    /// held across `.await`.
    output: Mutex<Output>,
    /// Bumped after every change of `output`, so followers and waiters wake without polling.
    changed: watch::Sender<u64>,
    /// The stdin pipe while it is open; a tokio mutex because a write awaits the pipe.
    stdin: tokio::sync::Mutex<Option<pipe::Sender>>,
    stdin_open: AtomicBool,
    /// The terminal it runs on, when it was started with `pty`.
    pty: Option<Pty>,
}

/// A process's pseudo-terminal: its master (for `TIOCSWINSZ`) and its current size.
#[derive(Debug)]
struct Pty {
    master: OwnedFd,
    /// The size last set; read by `info`, written by `resize`, never held across `.await`.
    size: Mutex<PtySize>,
}

impl Process {
    fn lock(&self) -> std::sync::MutexGuard<'_, Output> {
        self.output.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn info(&self) -> ProcessInfo {
        let out = self.lock();
        ProcessInfo {
            id: self.id.clone(),
            tag: self.tag.clone(),
            pid: self.pid as u32,
            argv: self.argv.clone(),
            state: if out.exit.is_some() { ProcessState::Exited } else { ProcessState::Running },
            started_at_ms: self.started_at_ms,
            exit: out.exit.clone(),
            stdout_bytes: out.stdout.total(),
            stderr_bytes: out.stderr.total(),
            stdin_open: self.stdin_open.load(Ordering::Relaxed),
            pty: self.pty.as_ref().map(|p| *p.size.lock().unwrap_or_else(PoisonError::into_inner)),
        }
    }

    fn exited(&self) -> bool {
        self.lock().exit.is_some()
    }
}

/// Appends a running process's output to its rings.
struct RingSink(Arc<Process>);

impl OutputSink for RingSink {
    async fn output(&mut self, stream: StreamName, data: &[u8]) -> bool {
        {
            let mut out = self.0.lock();
            match stream {
                StreamName::Stdout => out.stdout.push(data),
                StreamName::Stderr => out.stderr.push(data),
            }
        }
        self.0.changed.send_modify(|v| *v += 1);
        true
    }
}

#[derive(Debug, Default)]
struct Table {
    by_id: BTreeMap<u64, Arc<Process>>,
    by_tag: HashMap<String, u64>,
    next: u64,
}

#[derive(Debug, Default)]
pub struct Processes {
    /// Every remembered process, by number and by tag. Held only to look up or insert.
    table: Mutex<Table>,
}

impl Processes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Finds a process by id (`p-7`) or tag.
    pub fn get(&self, key: &str) -> DaemonResult<Arc<Process>> {
        let table = self.lock();
        let n = key.strip_prefix("p-").and_then(|n| n.parse::<u64>().ok());
        n.and_then(|n| table.by_id.get(&n))
            .or_else(|| table.by_tag.get(key).and_then(|n| table.by_id.get(n)))
            .cloned()
            .ok_or_else(|| DaemonError::NotFound(format!("no process `{key}`")))
    }

    pub fn counts(&self) -> (usize, usize) {
        let table = self.lock();
        let running = table.by_id.values().filter(|p| !p.exited()).count();
        (running, table.by_id.len())
    }

    fn forget(&self, process: &Process) {
        let mut table = self.lock();
        if let Some(n) = process.id.strip_prefix("p-").and_then(|n| n.parse::<u64>().ok()) {
            table.by_id.remove(&n);
        }
        if let Some(tag) = &process.tag {
            table.by_tag.remove(tag);
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub async fn start(
    State(daemon): State<Arc<Daemon>>,
    ApiJson(req): ApiJson<StartProcess>,
) -> DaemonResult<(StatusCode, Json<ProcessInfo>)> {
    req.check_bounds().map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
    let retain = req.retain_bytes.unwrap_or(DEFAULT_RETAIN);
    if let Some(tag) = &req.tag
        && (tag.is_empty() || tag.starts_with("p-") || tag.contains('/'))
    {
        return Err(DaemonError::InvalidArgument(format!(
            "tag `{tag}` must be non-empty, without `/`, and not start with `p-`"
        )));
    }
    if let Some(size) = &req.pty {
        size.check().map_err(DaemonError::InvalidArgument)?;
        if req.merge_output {
            return Err(DaemonError::InvalidArgument(
                "`merge_output` and `pty` do not go together: a terminal has one output stream already".into(),
            ));
        }
    }
    let term_given = req.env.contains_key("TERM");
    let mut launch = Launch::parse(
        &daemon.defaults,
        LaunchRequest { argv: req.argv, command: req.command, env: req.env, cwd: req.cwd, user: req.user },
    )?;
    if req.pty.is_some() && !term_given {
        launch.env.insert("TERM".into(), DEFAULT_TERM.into());
    }
    let io = match req.pty {
        Some(size) => Io::Pty(size),
        None => Io::Pipes { stdin: req.stdin, merge: req.merge_output },
    };
    // Reserve the number and tag first, so that two starts with one tag cannot both win.
    let n = {
        let mut table = daemon.processes.lock();
        if let Some(tag) = &req.tag
            && table.by_tag.contains_key(tag)
        {
            return Err(DaemonError::Conflict(format!("a process tagged `{tag}` exists; delete it first")));
        }
        if table.by_id.len() >= MAX_PROCESSES {
            let oldest_exited = table.by_id.iter().find(|(_, p)| p.exited()).map(|(n, p)| (*n, p.tag.clone()));
            match oldest_exited {
                Some((old, tag)) => {
                    table.by_id.remove(&old);
                    if let Some(tag) = tag {
                        table.by_tag.remove(&tag);
                    }
                }
                None => {
                    return Err(DaemonError::Conflict(format!("{MAX_PROCESSES} processes are running already")));
                }
            }
        }
        table.next += 1;
        let n = table.next;
        if let Some(tag) = &req.tag {
            table.by_tag.insert(tag.clone(), n);
        }
        n
    };
    let argv = launch.argv.clone();
    let mut started = match run::start(&daemon.children, launch, io, run::Where::Pool).await {
        Ok(s) => s,
        Err(e) => {
            if let Some(tag) = &req.tag {
                daemon.processes.lock().by_tag.remove(tag);
            }
            return Err(e);
        }
    };
    let stdin = started.stdin.take();
    let pty = match (started.pty.take(), req.pty) {
        (Some(master), Some(size)) => Some(Pty { master, size: Mutex::new(size) }),
        _ => None,
    };
    let process = Arc::new(Process {
        id: format!("p-{n}"),
        tag: req.tag,
        pid: started.pid,
        argv,
        started_at_ms: now_ms(),
        output: Mutex::new(Output {
            stdout: Ring::new(retain as usize, daemon.output_budget.clone()),
            stderr: Ring::new(retain as usize, daemon.output_budget.clone()),
            exit: None,
        }),
        changed: watch::Sender::new(0),
        stdin_open: AtomicBool::new(stdin.is_some()),
        stdin: tokio::sync::Mutex::new(stdin),
        pty,
    });
    daemon.processes.lock().by_id.insert(n, process.clone());
    let timeout = req.timeout_ms.map(Duration::from_millis);
    let driven = process.clone();
    daemon.tasks.spawn(async move {
        let status = run::drive(started, timeout, &mut RingSink(driven.clone())).await;
        driven.lock().exit = Some(status);
        driven.changed.send_modify(|v| *v += 1);
    });
    Ok((StatusCode::CREATED, Json(process.info())))
}

pub async fn list(State(daemon): State<Arc<Daemon>>) -> Json<ProcessList> {
    let all: Vec<Arc<Process>> = daemon.processes.lock().by_id.values().cloned().collect();
    Json(ProcessList { processes: all.iter().map(|p| p.info()).collect() })
}

pub async fn status(State(daemon): State<Arc<Daemon>>, Path(id): Path<String>) -> DaemonResult<Json<ProcessInfo>> {
    Ok(Json(daemon.processes.get(&id)?.info()))
}

pub async fn output(
    State(daemon): State<Arc<Daemon>>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<OutputQuery>,
) -> DaemonResult<Response> {
    let process = daemon.processes.get(&id)?;
    if q.follow {
        return Ok(follow(&daemon, process, q.stream, q.offset));
    }
    let max = q.max_bytes.unwrap_or(DEFAULT_CHUNK).clamp(1, DEFAULT_CHUNK);
    let out = process.lock();
    let ring = out.ring(q.stream);
    let (from, dropped, mut data) = ring.read(q.offset, max);
    // End on a character boundary unless the stream is complete, so that no character is split
    // across two answers.
    if out.exit.is_none() || from + (data.len() as u64) < ring.total() {
        let keep = data.len() - incomplete_tail(&data);
        data.truncate(keep);
    }
    let next = from + data.len() as u64;
    let chunk = OutputChunk {
        stream: q.stream,
        offset: from,
        next_offset: next,
        dropped,
        data: String::from_utf8_lossy(&data).into_owned(),
        eof: out.exit.is_some() && next >= ring.total(),
    };
    Ok(Json(chunk).into_response())
}

/// Streams output from `offset` as it arrives, ending with the exit event. Each `data` event
/// says which bytes its text is (`offset` to `next_offset`): the end of a character cut by a
/// read is carried into the next event, so that a client resuming at `next_offset` reads on
/// exactly after the text it has.
fn follow(daemon: &Daemon, process: Arc<Process>, stream: StreamName, mut offset: u64) -> Response {
    let (tx, rx) = mpsc::channel(FOLLOW_EVENTS);
    let mut changed = process.changed.subscribe();
    daemon.tasks.spawn(async move {
        let mut utf8 = Utf8Chunks::default();
        // `offset` is where the next read starts; the bytes just before it that `utf8` carries
        // are read but in no event yet.
        let data_event =
            |start: u64, next_offset: u64, data: String| OutputEvent::Data { offset: start, next_offset, data };
        loop {
            // Mark the current version seen before reading, so a change after the read wakes us.
            changed.borrow_and_update();
            let (from, dropped, data, exit, total) = {
                let out = process.lock();
                let ring = out.ring(stream);
                let (from, dropped, data) = ring.read(offset, DEFAULT_CHUNK);
                (from, dropped, data, out.exit.clone(), ring.total())
            };
            if dropped > 0 {
                // The carried start of a character will never be finished: what was read before
                // the gap goes out as it is.
                let carried = utf8.carried() as u64;
                let tail = utf8.finish();
                if !tail.is_empty() && tx.send(data_event(offset - carried, offset, tail)).await.is_err() {
                    return;
                }
                if tx.send(OutputEvent::Dropped { offset, bytes: dropped }).await.is_err() {
                    return;
                }
            }
            if !data.is_empty() {
                let start = from - utf8.carried() as u64;
                let text = utf8.push(&data);
                offset = from + data.len() as u64;
                let next = offset - utf8.carried() as u64;
                if !text.is_empty() && tx.send(data_event(start, next, text)).await.is_err() {
                    return;
                }
                continue;
            }
            offset = offset.max(from);
            if let Some(status) = exit {
                let carried = utf8.carried() as u64;
                let tail = utf8.finish();
                if !tail.is_empty() {
                    let _ = tx.send(data_event(offset - carried, offset, tail)).await;
                }
                let _ = tx.send(OutputEvent::Exit { status, next_offset: total }).await;
                return;
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                _ = tx.closed() => return,
            }
        }
    });
    stream::ndjson(rx, || OutputEvent::Keepalive)
}

/// `POST /v1/processes/{id}/stdin`: a JSON [`StdinWrite`], or raw bytes
/// (`Content-Type: application/octet-stream`, with `?close=true` to close after them).
pub async fn write_stdin(
    State(daemon): State<Arc<Daemon>>,
    Path(id): Path<String>,
    req: Request,
) -> DaemonResult<Json<ProcessInfo>> {
    let raw = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("application/octet-stream"));
    let (data, close) = if raw {
        let (mut parts, body) = req.into_parts();
        let ApiQuery(q) = ApiQuery::<StdinQuery>::from_request_parts(&mut parts, &()).await.map_err(bad_request)?;
        (read_limited(body, MAX_JSON_BODY).await.map_err(bad_request)?.to_vec(), q.close)
    } else {
        let ApiJson(w) = ApiJson::<StdinWrite>::from_request(req, &()).await.map_err(bad_request)?;
        (w.data.into_bytes(), w.close)
    };
    let process = daemon.processes.get(&id)?;
    let mut stdin = process.stdin.lock().await;
    let Some(pipe) = stdin.as_mut() else {
        return Err(DaemonError::Conflict(format!(
            "process `{id}` has no open stdin (start it with `stdin: true`; it may have been closed)"
        )));
    };
    if !data.is_empty()
        && let Err(e) = pipe.write_all(&data).await
    {
        *stdin = None;
        process.stdin_open.store(false, Ordering::Relaxed);
        return Err(DaemonError::Conflict(format!("stdin of process `{id}` is closed: {e}")));
    }
    if close {
        if process.pty.is_some() {
            // Closing a terminal's master would hang it up (SIGHUP): send end-of-file instead.
            let _ = pipe.write_all(&[EOF_CHAR]).await;
        } else {
            *stdin = None;
            process.stdin_open.store(false, Ordering::Relaxed);
        }
    }
    drop(stdin);
    Ok(Json(process.info()))
}

fn bad_request(e: BadRequest) -> DaemonError {
    match e {
        BadRequest::TooLarge { limit } => DaemonError::TooLarge { limit },
        BadRequest::Invalid(m) => DaemonError::InvalidArgument(m),
        stalled @ BadRequest::Stalled => DaemonError::Stalled(stalled.to_string()),
    }
}

/// `POST /v1/processes/{id}/resize`: a new size for the process's terminal.
pub async fn resize(
    State(daemon): State<Arc<Daemon>>,
    Path(id): Path<String>,
    ApiJson(size): ApiJson<ResizeRequest>,
) -> DaemonResult<Json<ProcessInfo>> {
    size.check().map_err(DaemonError::InvalidArgument)?;
    let process = daemon.processes.get(&id)?;
    let Some(pty) = &process.pty else {
        return Err(DaemonError::Conflict(format!("process `{id}` has no terminal (start it with `pty`)")));
    };
    if process.exited() {
        return Err(DaemonError::Conflict(format!("process `{id}` has already exited")));
    }
    sys::set_pty_size(pty.master.as_fd(), size.rows, size.cols)
        .map_err(|e| DaemonError::Internal(format!("cannot resize the terminal of process `{id}`: {e}")))?;
    *pty.size.lock().unwrap_or_else(PoisonError::into_inner) = size;
    Ok(Json(process.info()))
}

/// Resolves a signal given by name or number.
pub fn parse_signal(spec: &SignalSpec) -> DaemonResult<i32> {
    match spec {
        SignalSpec::Number(n) if sys::is_valid_signal(*n) => Ok(*n),
        SignalSpec::Number(n) => Err(DaemonError::InvalidArgument(format!("{n} is not a signal number"))),
        SignalSpec::Name(name) => {
            sys::signal_by_name(name).ok_or_else(|| DaemonError::InvalidArgument(format!("unknown signal `{name}`")))
        }
    }
}

pub async fn signal(
    State(daemon): State<Arc<Daemon>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> DaemonResult<Json<ProcessInfo>> {
    let signal = parse_signal(&req.signal)?;
    let process = daemon.processes.get(&id)?;
    if process.exited() {
        return Err(DaemonError::Conflict(format!("process `{id}` has already exited")));
    }
    sys::kill_group(process.pid, signal)
        .map_err(|e| DaemonError::Internal(format!("cannot signal process `{id}`: {e}")))?;
    Ok(Json(process.info()))
}

pub async fn wait(
    State(daemon): State<Arc<Daemon>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<WaitRequest>,
) -> DaemonResult<Json<ProcessInfo>> {
    req.check_bounds().map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
    let process = daemon.processes.get(&id)?;
    let timeout = req.timeout_ms.map(Duration::from_millis).unwrap_or(DEFAULT_WAIT);
    let mut changed = process.changed.subscribe();
    let _ = tokio::time::timeout(timeout, changed.wait_for(|_| process.exited())).await;
    Ok(Json(process.info()))
}

pub async fn delete(State(daemon): State<Arc<Daemon>>, Path(id): Path<String>) -> DaemonResult<StatusCode> {
    let process = daemon.processes.get(&id)?;
    if !process.exited() {
        tree::kill_tree(process.pid);
    }
    daemon.processes.forget(&process);
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_tail_and_counts_what_it_dropped() {
        let mut ring = Ring::new(4, Arc::new(OutputBudget::new(1 << 20)));
        ring.push(b"abcdef");
        assert_eq!((ring.start, ring.total()), (2, 6));
        let (from, dropped, data) = ring.read(0, 100);
        assert_eq!((from, dropped, data.as_slice()), (2, 2, &b"cdef"[..]));
        let (from, dropped, data) = ring.read(3, 2);
        assert_eq!((from, dropped, data.as_slice()), (3, 0, &b"de"[..]));
        let (from, dropped, data) = ring.read(10, 2);
        assert_eq!((from, dropped, data.len()), (6, 0, 0));
    }

    #[test]
    fn rings_hold_no_more_than_the_daemons_budget_and_give_it_back() {
        let budget = Arc::new(OutputBudget::new(6));
        let mut a = Ring::new(4, budget.clone());
        let mut b = Ring::new(4, budget.clone());
        a.push(b"abcdef");
        assert_eq!((a.start, a.buf.len(), budget.held()), (2, 4, 4));
        // Two bytes left in the budget: b grows by two, then replaces its own oldest.
        b.push(b"xyz");
        assert_eq!((b.start, b.total(), budget.held()), (1, 3, 6));
        let (_, dropped, data) = b.read(0, 10);
        assert_eq!((dropped, data.as_slice()), (1, &b"yz"[..]));
        b.push(b"w");
        assert_eq!(b.read(0, 10).2, b"zw");
        drop(a);
        assert_eq!(budget.held(), 2);
        b.push(b"1234");
        assert_eq!((b.read(0, 10).2.as_slice(), budget.held()), (&b"1234"[..], 4));
    }

    #[test]
    fn signals_by_name_or_number() {
        assert_eq!(parse_signal(&SignalSpec::Name("TERM".into())).ok(), Some(15));
        assert_eq!(parse_signal(&SignalSpec::Number(9)).ok(), Some(9));
        assert!(parse_signal(&SignalSpec::Number(0)).is_err());
        assert!(parse_signal(&SignalSpec::Name("NOPE".into())).is_err());
    }
}

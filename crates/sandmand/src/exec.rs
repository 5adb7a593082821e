//! `POST /v1/exec` and `/v1/exec/stream`: run a command to completion, answering with its whole
//! (capped) output or streaming it as NDJSON events.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::Response;
use sandman_wire::daemon::{ExecEvent, ExecRequest, ExecResult, StreamName};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::budget::OutputBudget;
use crate::children::ExecRunning;
use crate::error::{DaemonError, DaemonResult};
use crate::extract::ApiJson;
use crate::run::{self, Io, OutputSink, Started, Utf8Chunks, Where};
use crate::spawn::{Launch, LaunchRequest};
use crate::state::Daemon;
use crate::stream;

/// Output kept per stream when the request sets no `max_output_bytes` (the daemon's ceiling,
/// `--max-output-bytes`, when that is lower).
pub const DEFAULT_MAX_OUTPUT: u64 = 10 << 20;

/// Events buffered between a streamed exec and its slow client before the process is throttled
/// (its pipe fills and it blocks), each at most one 64 KiB read.
const STREAM_EVENTS: usize = 16;

struct Parsed {
    launch: Launch,
    stdin: Option<String>,
    timeout: Option<Duration>,
    cap: u64,
    merge: bool,
}

/// Checks the request's numbers (`max_output_bytes` up to `output_ceiling` when the output is
/// held), then its command.
fn parse(daemon: &Daemon, req: ExecRequest, output_ceiling: Option<u64>) -> DaemonResult<Parsed> {
    req.check_bounds(output_ceiling).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
    let launch = Launch::parse(
        &daemon.defaults,
        LaunchRequest { argv: req.argv, command: req.command, env: req.env, cwd: req.cwd, user: req.user },
    )?;
    Ok(Parsed {
        launch,
        stdin: req.stdin,
        timeout: req.timeout_ms.map(Duration::from_millis),
        cap: req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT.min(output_ceiling.unwrap_or(u64::MAX))),
        merge: req.merge_output,
    })
}

/// Starts the process and feeds it its stdin from a task of its own, so that a large stdin and
/// a large output cannot deadlock each other. Answers the rest of the request.
/// `running` counts this exec: one alone in the daemon starts its command on the event loop.
async fn start(daemon: &Daemon, parsed: Parsed, running: &ExecRunning) -> DaemonResult<(Started, Options)> {
    let Parsed { launch, stdin, timeout, cap, merge } = parsed;
    let io = Io::Pipes { stdin: stdin.is_some(), merge };
    let place = if running.alone() { Where::Inline } else { Where::Pool };
    let mut started = run::start(&daemon.children, launch, io, place).await?;
    if let (Some(mut pipe), Some(text)) = (started.stdin.take(), stdin) {
        daemon.tasks.spawn(async move {
            // A command that exits without reading its stdin closes the pipe: not an error.
            let _ = pipe.write_all(text.as_bytes()).await;
        });
    }
    Ok((started, Options { timeout, cap }))
}

/// What an exec still needs once its command has started.
struct Options {
    timeout: Option<Duration>,
    cap: u64,
}

/// Collects output up to a cap per stream, and within the daemon's output budget, counting
/// what it drops.
#[derive(Debug)]
struct Capped {
    cap: u64,
    budget: Arc<OutputBudget>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    stdout_truncated: bool,
    stderr_truncated: bool,
    /// Capacity of each buffer taken from the budget, given back when dropped.
    charged: [u64; 2],
}

impl Capped {
    fn new(cap: u64, budget: Arc<OutputBudget>) -> Self {
        Capped {
            cap,
            budget,
            stdout: Vec::new(),
            stderr: Vec::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            charged: [0; 2],
        }
    }
}

impl OutputSink for Capped {
    async fn output(&mut self, stream: StreamName, data: &[u8]) -> bool {
        let (buf, truncated) = match stream {
            StreamName::Stdout => (&mut self.stdout, &mut self.stdout_truncated),
            StreamName::Stderr => (&mut self.stderr, &mut self.stderr_truncated),
        };
        let charged = &mut self.charged[stream as usize];
        let max_len = self.budget.grow(charged, buf.len() as u64, data.len() as u64, self.cap);
        let max_len = usize::try_from(max_len).unwrap_or(usize::MAX);
        if max_len > buf.capacity() {
            buf.reserve_exact(max_len - buf.len());
        }
        let keep = data.len().min(max_len.saturating_sub(buf.len()));
        if keep < data.len() {
            *truncated = true;
        }
        buf.extend_from_slice(&data[..keep]);
        true
    }
}

impl Drop for Capped {
    fn drop(&mut self) {
        self.budget.give_back(self.charged[0] + self.charged[1]);
    }
}

pub async fn exec(
    State(daemon): State<Arc<Daemon>>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> DaemonResult<Json<ExecResult>> {
    let parsed = parse(&daemon, req, Some(daemon.config.limits.max_output_bytes))?;
    let running = daemon.children.exec_running();
    let (started, opts) = start(&daemon, parsed, &running).await?;
    let mut sink = Capped::new(opts.cap, daemon.output_budget.clone());
    let status = run::drive(started, opts.timeout, &mut sink).await;
    Ok(Json(ExecResult {
        status,
        stdout: String::from_utf8_lossy(&sink.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&sink.stderr).into_owned(),
        stdout_truncated: sink.stdout_truncated,
        stderr_truncated: sink.stderr_truncated,
    }))
}

/// Forwards output as events; stops wanting it when the client has gone.
struct EventSink {
    tx: mpsc::Sender<ExecEvent>,
    cap: u64,
    sent: [u64; 2],
    truncated: [bool; 2],
    utf8: [Utf8Chunks; 2],
}

impl OutputSink for EventSink {
    async fn output(&mut self, stream: StreamName, data: &[u8]) -> bool {
        let i = stream as usize;
        let room = self.cap.saturating_sub(self.sent[i]) as usize;
        if data.len() > room {
            self.truncated[i] = true;
        }
        let data = &data[..data.len().min(room)];
        if data.is_empty() {
            return !self.tx.is_closed();
        }
        self.sent[i] += data.len() as u64;
        let text = self.utf8[i].push(data);
        if text.is_empty() {
            return true;
        }
        let event = match stream {
            StreamName::Stdout => ExecEvent::Stdout { data: text },
            StreamName::Stderr => ExecEvent::Stderr { data: text },
        };
        self.tx.send(event).await.is_ok()
    }

    fn abandoned(&self) -> impl Future<Output = ()> + Send + 'static {
        let tx = self.tx.clone();
        async move { tx.closed().await }
    }
}

pub async fn exec_stream(
    State(daemon): State<Arc<Daemon>>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> DaemonResult<Response> {
    // Streamed output is sent as it comes, never held: any `max_output_bytes` will do.
    let parsed = parse(&daemon, req, None)?;
    let running = daemon.children.exec_running();
    let (started, Options { timeout, cap }) = start(&daemon, parsed, &running).await?;
    let (tx, rx) = mpsc::channel(STREAM_EVENTS);
    let pid = started.pid as u32;
    daemon.tasks.spawn(async move {
        let _running = running;
        if tx.send(ExecEvent::Started { pid }).await.is_err() {
            crate::tree::kill_tree(pid as i32);
        }
        let mut sink = EventSink { tx, cap, sent: [0; 2], truncated: [false; 2], utf8: Default::default() };
        let status = run::drive(started, timeout, &mut sink).await;
        for (i, tail) in sink.utf8.iter_mut().map(Utf8Chunks::finish).enumerate() {
            if !tail.is_empty() {
                let event = if i == 0 { ExecEvent::Stdout { data: tail } } else { ExecEvent::Stderr { data: tail } };
                let _ = sink.tx.send(event).await;
            }
        }
        let [stdout_truncated, stderr_truncated] = sink.truncated;
        let _ = sink.tx.send(ExecEvent::Exit { status, stdout_truncated, stderr_truncated }).await;
    });
    Ok(stream::ndjson(rx, || ExecEvent::Keepalive))
}

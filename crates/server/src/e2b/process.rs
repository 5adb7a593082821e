//! `process.Process`, envd's process service, on the daemon's background processes: `Start`
//! starts one (`POST /v1/processes`) and streams its output as it comes (two followed output
//! streams, stdout and stderr, merged), `Connect` follows a running one from now on, and the
//! unary calls map onto stdin, signals and terminal size. E2B addresses a process by its pid
//! (or a tag): a pid is looked up among the daemon's running processes. As on envd, a process
//! that has exited is no longer found, and `Start` forgets it once its end is delivered.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::response::Response;
use base64::Engine;
use bytes::BytesMut;
use futures_util::StreamExt;
use http::{HeaderMap, Method};
use sandman_wire::daemon::{ExitStatus, OutputEvent, ProcessInfo, ProcessList, ProcessState, PtySize, StartProcess};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::connect::{self, Code, RpcError, StreamTx, decode};
use super::{Sbx, user_of};

/// Longest NDJSON line taken from a followed output stream.
const MAX_LINE: usize = 8 << 20;
/// How long a `SIGKILL` is waited on, so that the process is gone when the kill answers.
const KILL_WAIT_MS: u64 = 5_000;

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Size {
    cols: u32,
    rows: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Pty {
    size: Option<Size>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartRequest {
    process: Option<ProcessConfig>,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// `ProcessSelector`: a oneof of `pid` and `tag`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Selected {
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendInput {
    process: Option<Selector>,
    input: Option<Input>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendSignal {
    process: Option<Selector>,
    signal: Value,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Update {
    process: Option<Selector>,
    pty: Option<Pty>,
}

/// One call of `process.Process/<method>`.
pub async fn call(sbx: Sbx, method: &str, headers: &HeaderMap, body: &[u8]) -> Result<Response, RpcError> {
    match method {
        "Start" => start(sbx, headers, body).await,
        "Connect" => follow(sbx, body).await,
        "List" => list(&sbx).await,
        "SendInput" => send_input(&sbx, body).await,
        "CloseStdin" => close_stdin(&sbx, body).await,
        "SendSignal" => send_signal(&sbx, body).await,
        "Update" => update(&sbx, body).await,
        other => {
            Err(RpcError::new(Code::Unimplemented, format!("process.Process/{other} is not supported by Sandman")))
        }
    }
}

/// Whether a method answers with a stream (its request is one envelope).
pub fn streams(method: &str) -> bool {
    matches!(method, "Start" | "Connect")
}

fn pty_size(pty: Option<Pty>) -> Result<Option<PtySize>, RpcError> {
    let Some(pty) = pty else { return Ok(None) };
    let size = match pty.size {
        Some(s) => {
            PtySize { rows: u16::try_from(s.rows).unwrap_or(u16::MAX), cols: u16::try_from(s.cols).unwrap_or(u16::MAX) }
        }
        None => PtySize { rows: 24, cols: 80 },
    };
    size.check().map_err(RpcError::invalid)?;
    Ok(Some(size))
}

async fn start(sbx: Sbx, headers: &HeaderMap, body: &[u8]) -> Result<Response, RpcError> {
    let req: StartRequest = decode(body, true)?;
    let timeout_ms = connect::timeout_ms(headers)?;
    let user = user_of(headers)?;
    let config = req.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return Err(RpcError::invalid("`process.cmd` is required"));
    }
    let pty = pty_size(req.pty)?;
    let mut argv = vec![config.cmd];
    argv.extend(config.args);
    let start = StartProcess {
        argv: Some(argv),
        env: config.envs,
        cwd: config.cwd.filter(|c| !c.is_empty()),
        user,
        tag: req.tag.filter(|t| !t.is_empty()),
        stdin: req.stdin.unwrap_or(false),
        timeout_ms,
        pty,
        ..StartProcess::default()
    };
    let body = serde_json::to_value(&start).map_err(|e| RpcError::new(Code::Internal, e.to_string()))?;
    let info: ProcessInfo = sbx.json(Method::POST, "processes", None, Some(body)).await?;
    let (tx, resp) = connect::stream();
    let tasks = sbx.service.tasks.clone();
    tasks.spawn(async move {
        // The start event goes out at once, before any output is waited for.
        if !tx.send(&json!({"event": {"start": {"pid": info.pid}}})).await {
            return;
        }
        let ended = pump(&sbx, &info, (0, 0), &tx, timeout_ms).await;
        if ended {
            // envd forgets a process once it has exited.
            let _ = sbx.call(Method::DELETE, &format!("processes/{}", info.id), None, Body::empty(), None).await;
        }
    });
    Ok(resp)
}

/// `Connect`: the output of a running process from now on, then its end.
async fn follow(sbx: Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: Selected = decode(body, true)?;
    let info = resolve(&sbx, req.process).await?;
    // Followed before the start event goes out: once the client has it, it may end the process
    // (close its stdin), and the stream that started it would then forget it.
    let output = open_output(&sbx, &info, (info.stdout_bytes, info.stderr_bytes)).await?;
    let (tx, resp) = connect::stream();
    let tasks = sbx.service.tasks.clone();
    tasks.spawn(async move {
        if !tx.send(&json!({"event": {"start": {"pid": info.pid}}})).await {
            return;
        }
        pump_output(&info, output, &tx, None).await;
    });
    Ok(resp)
}

/// Streams a process's output from `offsets` (stdout, stderr) to `tx` as data events, then its
/// end event and the end of the stream. True when the process was seen to end.
async fn pump(sbx: &Sbx, info: &ProcessInfo, offsets: (u64, u64), tx: &StreamTx, timeout_ms: Option<u64>) -> bool {
    let output = match open_output(sbx, info, offsets).await {
        Ok(o) => o,
        Err(e) => {
            tx_end(tx, Some(e)).await;
            return false;
        }
    };
    pump_output(info, output, tx, timeout_ms).await
}

/// [`pump`] of output streams already open.
async fn pump_output(
    info: &ProcessInfo,
    output: (Lines, Option<Lines>),
    tx: &StreamTx,
    timeout_ms: Option<u64>,
) -> bool {
    match pump_inner(info, output, tx).await {
        Ok(None) => false,
        Ok(Some(status)) if status.timed_out => {
            let ms = timeout_ms.unwrap_or(status.duration_ms);
            let e = RpcError::new(Code::DeadlineExceeded, format!("the command was killed at its timeout of {ms} ms"));
            tx_end(tx, Some(e)).await;
            true
        }
        Ok(Some(status)) => {
            if tx.send(&json!({"event": {"end": end_event(&status)}})).await {
                tx_end(tx, None).await;
            }
            true
        }
        Err(e) => {
            tx_end(tx, Some(e)).await;
            false
        }
    }
}

async fn tx_end(tx: &StreamTx, e: Option<RpcError>) {
    tx.end(e).await;
}

/// The exit of a process as envd's end event says it (Go's `ProcessState`).
fn end_event(st: &ExitStatus) -> Value {
    match (st.exit_code, st.signal) {
        (Some(code), _) => json!({"exitCode": code, "exited": true, "status": format!("exit status {code}")}),
        (None, Some(sig)) => {
            json!({"exitCode": -1, "exited": false, "status": format!("signal: {}", signal_name(sig))})
        }
        (None, None) => json!({"exitCode": -1, "exited": false, "status": "unknown"}),
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        9 => "killed".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// The followed output streams of a process from `offsets` (stdout, stderr); a terminal has
/// one. Both are opened at once.
async fn open_output(sbx: &Sbx, info: &ProcessInfo, offsets: (u64, u64)) -> Result<(Lines, Option<Lines>), RpcError> {
    let open = |stream: &'static str, offset: u64| {
        let call = format!("processes/{}/output", info.id);
        async move {
            let q = format!("stream={stream}&follow=true&offset={offset}");
            sbx.call(Method::GET, &call, Some(q), Body::empty(), None).await.map(|r| Lines::new(r.into_body()))
        }
    };
    if info.pty.is_some() {
        return Ok((open("stdout", offsets.0).await?, None));
    }
    let (out, err) = tokio::join!(open("stdout", offsets.0), open("stderr", offsets.1));
    Ok((out?, Some(err?)))
}

async fn pump_inner(
    info: &ProcessInfo,
    output: (Lines, Option<Lines>),
    tx: &StreamTx,
) -> Result<Option<ExitStatus>, RpcError> {
    let pty = info.pty.is_some();
    let (mut out, mut err) = output;
    let (mut out_done, mut err_done) = (false, err.is_none());
    let mut status = None;
    while !(out_done && err_done) {
        let (ev, from_stdout) = tokio::select! {
            _ = tx.closed() => return Ok(None),
            ev = out.next::<OutputEvent>(), if !out_done => (ev, true),
            ev = next_of(&mut err), if !err_done => (ev, false),
        };
        let kind = match (from_stdout, pty) {
            (true, true) => "pty",
            (true, false) => "stdout",
            (false, _) => "stderr",
        };
        let sent = match ev {
            None => {
                if from_stdout {
                    out_done = true
                } else {
                    err_done = true
                }
                true
            }
            Some(Err(e)) => {
                return Err(RpcError::new(Code::Unavailable, format!("the process's output broke off: {e}")));
            }
            Some(Ok(OutputEvent::Data { data, .. })) => {
                let b64 = base64::engine::general_purpose::STANDARD.encode(data.as_bytes());
                tx.send(&json!({"event": {"data": {kind: b64}}})).await
            }
            Some(Ok(OutputEvent::Dropped { .. })) => true,
            Some(Ok(OutputEvent::Keepalive)) => tx.send(&json!({"event": {"keepalive": {}}})).await,
            Some(Ok(OutputEvent::Exit { status: st, .. })) => {
                status = Some(st);
                if from_stdout {
                    out_done = true
                } else {
                    err_done = true
                }
                true
            }
        };
        if !sent {
            return Ok(None);
        }
    }
    status
        .map(Some)
        .ok_or_else(|| RpcError::new(Code::Unavailable, "the process's output ended without its exit status"))
}

async fn next_of(lines: &mut Option<Lines>) -> Option<Result<OutputEvent, String>> {
    match lines {
        Some(l) => l.next().await,
        None => std::future::pending().await,
    }
}

/// NDJSON events of a streamed daemon body, one at a time.
struct Lines {
    body: axum::body::BodyDataStream,
    buf: BytesMut,
}

impl Lines {
    fn new(body: Body) -> Self {
        Lines { body: body.into_data_stream(), buf: BytesMut::new() }
    }

    /// The next event; `None` at the end of the body. Cancel-safe: what was read stays in
    /// the buffer.
    async fn next<T: DeserializeOwned>(&mut self) -> Option<Result<T, String>> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(i + 1);
                if i == 0 {
                    continue;
                }
                return Some(serde_json::from_slice(&line[..i]).map_err(|e| e.to_string()));
            }
            if self.buf.len() > MAX_LINE {
                return Some(Err(format!("an output event longer than {MAX_LINE} bytes")));
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Some(Err(e.to_string())),
                None => return None,
            }
        }
    }
}

/// The running process a selector names.
async fn resolve(sbx: &Sbx, selector: Option<Selector>) -> Result<ProcessInfo, RpcError> {
    let selector = selector.ok_or_else(|| RpcError::invalid("`process` (a pid or a tag) is required"))?;
    let running = |p: &ProcessInfo| p.state == ProcessState::Running;
    match (selector.pid, selector.tag) {
        (_, Some(tag)) if !tag.is_empty() => {
            let list: ProcessList = sbx.json(Method::GET, "processes", None, None).await?;
            list.processes
                .into_iter()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()) && running(p))
                .ok_or_else(|| RpcError::not_found(format!("process with tag `{tag}` not found")))
        }
        (Some(pid), _) => {
            let list: ProcessList = sbx.json(Method::GET, "processes", None, None).await?;
            list.processes
                .into_iter()
                .find(|p| p.pid == pid && running(p))
                .ok_or_else(|| RpcError::not_found(format!("process with pid {pid} not found")))
        }
        _ => Err(RpcError::invalid("`process` must name a pid or a tag")),
    }
}

async fn list(sbx: &Sbx) -> Result<Response, RpcError> {
    let list: ProcessList = sbx.json(Method::GET, "processes", None, None).await?;
    let processes: Vec<Value> = list
        .processes
        .iter()
        .filter(|p| p.state == ProcessState::Running)
        .map(|p| {
            let (cmd, args) = p.argv.split_first().map_or(("", &[][..]), |(c, a)| (c.as_str(), a));
            let mut v = json!({"config": {"cmd": cmd, "args": args, "envs": {}}, "pid": p.pid});
            if let Some(tag) = &p.tag {
                v["tag"] = json!(tag);
            }
            v
        })
        .collect();
    Ok(connect::unary(&json!({"processes": processes})))
}

/// Protobuf's `bytes` in JSON: base64, standard or URL-safe, padded or not.
pub fn bytes_of(text: &str) -> Result<Vec<u8>, RpcError> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let std: String = text
        .chars()
        .map(|c| {
            if c == '-' {
                '+'
            } else if c == '_' {
                '/'
            } else {
                c
            }
        })
        .collect();
    LENIENT.decode(std).map_err(|e| RpcError::invalid(format!("bad base64 input: {e}")))
}

async fn send_input(sbx: &Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: SendInput = decode(body, false)?;
    let input = req.input.unwrap_or_default();
    let data = bytes_of(input.stdin.or(input.pty).as_deref().unwrap_or_default())?;
    let info = resolve(sbx, req.process).await?;
    let call = format!("processes/{}/stdin", info.id);
    sbx.call(Method::POST, &call, None, Body::from(data), Some("application/octet-stream")).await?;
    Ok(connect::unary(&json!({})))
}

async fn close_stdin(sbx: &Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: Selected = decode(body, false)?;
    let info = resolve(sbx, req.process).await?;
    let call = format!("processes/{}/stdin", info.id);
    sbx.call(Method::POST, &call, Some("close=true".into()), Body::empty(), Some("application/octet-stream")).await?;
    Ok(connect::unary(&json!({})))
}

/// envd's `Signal` enum, by name or number: only SIGTERM and SIGKILL exist in it.
fn signal_of(v: &Value) -> Result<i32, RpcError> {
    match v {
        Value::String(s) if s == "SIGNAL_SIGKILL" => Ok(9),
        Value::String(s) if s == "SIGNAL_SIGTERM" => Ok(15),
        Value::Number(n) if n.as_i64() == Some(9) || n.as_i64() == Some(15) => Ok(n.as_i64().unwrap_or(9) as i32),
        other => Err(RpcError::invalid(format!("signal {other} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"))),
    }
}

async fn send_signal(sbx: &Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: SendSignal = decode(body, false)?;
    let signal = signal_of(&req.signal)?;
    let info = resolve(sbx, req.process).await?;
    let call = format!("processes/{}/signal", info.id);
    match sbx.json::<Value>(Method::POST, &call, None, Some(json!({"signal": signal}))).await {
        Ok(_) => {}
        // It exited (or was forgotten) since it was looked up: not found, as on envd.
        Err(e) if matches!(e.code, Code::AlreadyExists | Code::NotFound) => {
            return Err(RpcError::not_found(format!("process with pid {} not found", info.pid)));
        }
        Err(e) => return Err(e),
    }
    if signal == 9 {
        // Answer once it is gone, so that a second kill finds nothing, as on envd. The stream
        // that started it may forget it first (a regression: that 404 once answered the kill
        // itself with "not found").
        let call = format!("processes/{}/wait", info.id);
        match sbx.json::<Value>(Method::POST, &call, None, Some(json!({"timeout_ms": KILL_WAIT_MS}))).await {
            Ok(_) => {}
            Err(e) if e.code == Code::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(connect::unary(&json!({})))
}

async fn update(sbx: &Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: Update = decode(body, false)?;
    let size = pty_size(req.pty)?.ok_or_else(|| RpcError::invalid("`pty.size` is required"))?;
    let info = resolve(sbx, req.process).await?;
    let call = format!("processes/{}/resize", info.id);
    let body = serde_json::to_value(size).map_err(|e| RpcError::new(Code::Internal, e.to_string()))?;
    sbx.json::<Value>(Method::POST, &call, None, Some(body)).await?;
    Ok(connect::unary(&json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_read_as_envd_says_them() {
        let exited = ExitStatus { exit_code: Some(3), ..ExitStatus::default() };
        assert_eq!(end_event(&exited), json!({"exitCode": 3, "exited": true, "status": "exit status 3"}));
        let killed = ExitStatus { signal: Some(9), ..ExitStatus::default() };
        assert_eq!(end_event(&killed)["status"], "signal: killed");
    }

    #[test]
    fn signals_are_envds_two() {
        assert_eq!(signal_of(&json!("SIGNAL_SIGKILL")).ok(), Some(9));
        assert_eq!(signal_of(&json!(15)).ok(), Some(15));
        assert!(signal_of(&json!(2)).is_err() && signal_of(&json!("SIGINT")).is_err());
    }

    #[test]
    fn bytes_are_lenient_base64() {
        assert_eq!(bytes_of("aGk=").ok(), Some(b"hi".to_vec()));
        assert_eq!(bytes_of("aGk").ok(), Some(b"hi".to_vec()));
        assert_eq!(bytes_of("_-8").ok(), Some(vec![0xff, 0xef]));
    }
}

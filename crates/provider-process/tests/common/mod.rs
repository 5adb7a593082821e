//! Test harness: the real `sandmand` binary, process providers on state directories outside /tmp,
//! and a small HTTP/1.1 client for a sandbox's daemon over its Unix socket.
#![allow(dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use sandman_provider::Endpoint;
use sandman_provider_process::{Isolation, ProcessConfig, ProcessProvider};
use serde_json::Value;
use tokio::net::UnixStream;

/// The daemon built beside this test (`target/<profile>/sandmand`; tests run from
/// `target/<profile>/deps/`), or `$SANDMAN_DAEMON`.
pub fn daemon_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDMAN_DAEMON").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join("sandmand")).unwrap();
    assert!(bin.is_file(), "no daemon at {}: build it first: cargo build -p sandmand", bin.display());
    bin
}

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        .unwrap()
}

pub fn require_root() {
    assert!(is_root(), "this test needs root for namespaces (CI and scripts/test run as root)");
}

/// A state directory under the target's temporary directory: not under /tmp, which an isolated
/// sandbox replaces, and short enough for socket paths.
pub fn state_dir() -> tempfile::TempDir {
    let base = scratch();
    std::fs::create_dir_all(&base).unwrap();
    tempfile::Builder::new().prefix("pp").tempdir_in(base).unwrap()
}

pub fn provider(state: &Path, isolate: Isolation) -> ProcessProvider {
    ProcessProvider::new(ProcessConfig {
        state_dir: state.to_path_buf(),
        daemon_bin: daemon_bin(),
        daemon_args: Vec::new(),
        isolate,
    })
    .unwrap_or_else(|e| panic!("cannot make the provider: {e}"))
}

pub fn socket_of(endpoint: &Endpoint) -> PathBuf {
    match endpoint {
        Endpoint::Unix(p) => p.clone(),
        other => panic!("the process provider answered a non-Unix endpoint: {other:?}"),
    }
}

/// The sandbox directory of an endpoint (`<dir>/d.sock`).
pub fn dir_of(endpoint: &Endpoint) -> PathBuf {
    socket_of(endpoint).parent().unwrap().to_path_buf()
}

pub struct Resp {
    pub status: u16,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// One request on a fresh connection.
pub async fn call(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Result<Resp, String> {
    let stream = UnixStream::connect(socket).await.map_err(|e| format!("connect {}: {e}", socket.display()))?;
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder().method(method).uri(path).header("host", "sandbox");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let bytes = match body {
        Some(v) => {
            req = req.header("content-type", "application/json");
            Bytes::from(serde_json::to_vec(&v).unwrap())
        }
        None => Bytes::new(),
    };
    let resp = sender.send_request(req.body(Full::new(bytes)).unwrap()).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Resp { status, body })
}

/// Waits for the daemon's health (the provider answers before the daemon listens).
pub async fn wait_healthy(socket: &Path) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..500 {
        match call(socket, "GET", "/v1/health", None, None).await {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("health answered {}", r.status),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("daemon on {} not healthy within 10 s: {last}", socket.display()))
}

/// A ready daemon's exec of `argv`.
pub async fn exec(socket: &Path, token: &str, argv: &[&str]) -> Result<Value, String> {
    let r = call(socket, "POST", "/v1/exec", Some(token), Some(serde_json::json!({"argv": argv}))).await?;
    if r.status != 200 {
        return Err(format!("exec answered {}: {}", r.status, String::from_utf8_lossy(&r.body)));
    }
    Ok(r.json())
}

/// The conformance suite's daemon check: health, then `echo hi` with the token.
pub async fn check_daemon(endpoint: Endpoint, token: String) -> Result<(), String> {
    let socket = socket_of(&endpoint);
    wait_healthy(&socket).await?;
    let out = exec(&socket, &token, &["/bin/echo", "hi"]).await?;
    if out["exit_code"] == 0 && out["stdout"] == "hi\n" { Ok(()) } else { Err(format!("echo hi gave {out}")) }
}

/// Every process whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

/// Polls `f` every 20 ms until it is true or `limit` passes.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// Scratch space for tests, outside `/tmp`: an isolated sandbox gets a `/tmp` of its own, which
/// would hide anything the test keeps under the host's `/tmp` (as the target directory is when
/// the checkout itself is under `/tmp`).
pub fn scratch() -> PathBuf {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let base = if target.starts_with("/tmp") { PathBuf::from("/var/tmp/sandman-tests") } else { target };
    std::fs::create_dir_all(&base).unwrap_or_else(|e| panic!("cannot make {}: {e}", base.display()));
    base
}

//! Test harness: starts the real `sandmand` binary on a Unix socket in a temporary directory and
//! talks HTTP/1.1 to it with hyper.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::client::conn::http1;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

pub const TOKEN: &str = "test-token-0123456789";

pub fn daemon_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandmand"))
}

pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Daemon {
    pub async fn start() -> Daemon {
        Self::start_with(&[], None).await
    }

    /// Starts the daemon with extra flags, optionally behind a wrapper command (e.g. `unshare`).
    pub async fn start_with(extra: &[&str], wrapper: Option<&[&str]>) -> Daemon {
        Self::start_bin(&daemon_bin(), extra, wrapper).await
    }

    /// Starts a given daemon binary (the benchmark runs the static build).
    pub async fn start_bin(bin: &Path, extra: &[&str], wrapper: Option<&[&str]>) -> Daemon {
        Self::start_bin_in(bin, None, extra, wrapper).await
    }

    /// Starts the daemon with its directory (socket, cwd) made under `base` rather than the
    /// system's temporary directory (`--isolate-tmp` hides what is under /tmp).
    pub async fn start_in(base: &Path, extra: &[&str]) -> Daemon {
        Self::start_bin_in(&daemon_bin(), Some(base), extra, None).await
    }

    async fn start_bin_in(bin: &Path, base: Option<&Path>, extra: &[&str], wrapper: Option<&[&str]>) -> Daemon {
        let dir = match base {
            Some(base) => tempfile::tempdir_in(base).unwrap(),
            None => tempfile::tempdir().unwrap(),
        };
        let socket = dir.path().join("d.sock");
        let listen = format!("unix:{}", socket.display());
        let mut args: Vec<String> = Vec::new();
        let program = match wrapper {
            Some(w) => {
                args.extend(w[1..].iter().map(|s| s.to_string()));
                args.push(bin.display().to_string());
                w[0].to_string()
            }
            None => bin.display().to_string(),
        };
        args.extend(["--listen".to_string(), listen]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = Command::new(program)
            .args(&args)
            .env("SANDMAN_TOKEN", TOKEN)
            .env("SANDMAN_TEST_SECRET", "must-not-leak")
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let d = Daemon { child, socket, dir };
        d.wait_ready().await;
        d
    }

    async fn wait_ready(&self) {
        for _ in 0..500 {
            if UnixStream::connect(&self.socket).await.is_err() {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            if let Ok(r) = self.call("GET", "/v1/health", None, Body::Empty).await
                && r.status == StatusCode::OK
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("daemon did not become healthy on {}", self.socket.display());
    }

    /// Starts `daemon` (a path inside `root`) under chroot(8) in `root`, listening on `socket`
    /// (also a path inside `root`).
    pub async fn start_chrooted(root: &Path, daemon: &str, socket: &str) -> Daemon {
        let child = Command::new("/usr/sbin/chroot")
            .arg(root)
            .args([daemon, "--listen", &format!("unix:{socket}"), "--workdir", "/"])
            .env_clear()
            .env("SANDMAN_TOKEN", TOKEN)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let d = Daemon { child, socket: root.join(socket.trim_start_matches('/')), dir };
        d.wait_ready().await;
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub async fn connect(&self) -> Conn {
        Conn::open(&self.socket).await
    }

    /// One request on a fresh connection.
    pub async fn call(&self, method: &str, path: &str, token: Option<&str>, body: Body) -> hyper::Result<Resp> {
        let mut conn = Conn::open(&self.socket).await;
        conn.call(method, path, token, body).await
    }

    /// Authorised JSON request; panics on transport errors.
    pub async fn json(&self, method: &str, path: &str, body: Value) -> Resp {
        self.call(method, path, Some(TOKEN), Body::Json(body)).await.unwrap()
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.call("GET", path, Some(TOKEN), Body::Empty).await.unwrap()
    }

    pub async fn exec(&self, body: Value) -> Value {
        let r = self.json("POST", "/v1/exec", body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        r.json()
    }

    /// Waits for the daemon process to exit, up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn stderr_text(&mut self) -> String {
        use std::io::Read;
        let mut s = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub enum Body {
    Empty,
    Json(Value),
    Bytes(Vec<u8>),
    /// Raw bytes sent as `application/octet-stream`.
    Octets(Vec<u8>),
    /// Sent chunk by chunk, never whole.
    Chunks(Box<dyn Iterator<Item = Bytes> + Send>),
}

impl Body {
    /// These bytes, sent as `application/octet-stream`.
    pub fn octet_stream(self) -> Body {
        match self {
            Body::Bytes(b) => Body::Octets(b),
            other => other,
        }
    }
}

pub struct Conn {
    sender: http1::SendRequest<http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>>,
}

impl Conn {
    pub async fn open(socket: &Path) -> Conn {
        let stream = UnixStream::connect(socket).await.unwrap();
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender }
    }

    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Body,
    ) -> hyper::Result<hyper::Response<hyper::body::Incoming>> {
        let mut req = Request::builder().method(method).uri(path).header("host", "sandbox");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let body = match body {
            Body::Empty => Full::new(Bytes::new()).map_err(|e| match e {}).boxed_unsync(),
            Body::Json(v) => {
                req = req.header("content-type", "application/json");
                Full::new(Bytes::from(serde_json::to_vec(&v).unwrap())).map_err(|e| match e {}).boxed_unsync()
            }
            Body::Bytes(b) => Full::new(Bytes::from(b)).map_err(|e| match e {}).boxed_unsync(),
            Body::Octets(b) => {
                req = req.header("content-type", "application/octet-stream");
                Full::new(Bytes::from(b)).map_err(|e| match e {}).boxed_unsync()
            }
            Body::Chunks(it) => {
                let stream = futures_util::stream::iter(it.map(|b| Ok::<_, std::io::Error>(Frame::data(b))));
                StreamBody::new(stream).boxed_unsync()
            }
        };
        self.sender.ready().await?;
        self.sender.send_request(req.body(body).unwrap()).await
    }

    pub async fn call(&mut self, method: &str, path: &str, token: Option<&str>, body: Body) -> hyper::Result<Resp> {
        let resp = self.send(method, path, token, body).await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(Resp { status, headers, body })
    }
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts the wire error body with `code` and returns its message.
    pub fn error(&self, status: u16, code: &str) -> String {
        assert_eq!(self.status.as_u16(), status, "{}", self.text());
        let v = self.json();
        assert_eq!(v["error"]["code"], code, "{v}");
        v["error"]["message"].as_str().unwrap().to_string()
    }

    /// NDJSON lines as values.
    pub fn lines(&self) -> Vec<Value> {
        self.text().lines().filter(|l| !l.is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
    }
}

/// Reads the next NDJSON event from a streaming response.
pub struct Events {
    body: hyper::body::Incoming,
    buf: Vec<u8>,
}

impl Events {
    pub fn new(resp: hyper::Response<hyper::body::Incoming>) -> Self {
        Events { body: resp.into_body(), buf: Vec::new() }
    }

    pub async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            match self.body.frame().await? {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Err(_) => return None,
            }
        }
    }
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

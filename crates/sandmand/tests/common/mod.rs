//! Test harness: starts the real `sandmand` binary on a Unix socket in a temporary directory
//! (through the shared harness, `sandman_testkit`, which captures its log) and talks HTTP/1.1 to
//! it with hyper.
#![allow(unused_imports, dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::StatusCode;
pub use sandman_testkit::http::Body;
use sandman_testkit::{Addr, Spawned, http};
pub use sandman_testkit::{alive, eventually};
use serde_json::Value;

pub const TOKEN: &str = "test-token-0123456789";

/// How long a daemon may take to answer its health check.
const READY_WITHIN: Duration = Duration::from_secs(20);

pub fn daemon_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandmand"))
}

pub struct Daemon {
    /// Stopped when dropped (see [`Daemon`]'s `Drop`); its log is printed when the test fails.
    pub process: Spawned,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
}

/// How long a dropped daemon gets to stop its children after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

impl Drop for Daemon {
    /// Stops the daemon as a supervisor would, so that what it started (a web app, sleeps) goes
    /// with it rather than outliving the test.
    fn drop(&mut self) {
        self.process.stop(STOP_GRACE);
    }
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
        let mut cmd = Command::new(program);
        cmd.args(&args).env("SANDMAN_TOKEN", TOKEN).env("SANDMAN_TEST_SECRET", "must-not-leak").current_dir(dir.path());
        let process = Spawned::spawn("sandmand", &mut cmd, &scratch());
        let mut d = Daemon { process, socket, dir };
        d.wait_ready().await;
        d
    }

    async fn wait_ready(&mut self) {
        self.process.wait_healthy(Addr::Unix(&self.socket), "/v1/health", READY_WITHIN).await;
    }

    /// Starts `daemon` (a path inside `root`) under chroot(8) in `root`, listening on `socket`
    /// (also a path inside `root`).
    pub async fn start_chrooted(root: &Path, daemon: &str, socket: &str) -> Daemon {
        let mut cmd = Command::new("/usr/sbin/chroot");
        cmd.arg(root)
            .args([daemon, "--listen", &format!("unix:{socket}"), "--workdir", "/"])
            .env_clear()
            .env("SANDMAN_TOKEN", TOKEN);
        let process = Spawned::spawn("sandmand", &mut cmd, &scratch());
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon { process, socket: root.join(socket.trim_start_matches('/')), dir };
        d.wait_ready().await;
        d
    }

    pub fn pid(&self) -> u32 {
        self.process.id()
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
        self.process.wait_exit(limit)
    }

    /// What the daemon wrote to stderr so far.
    pub fn stderr_text(&mut self) -> String {
        self.process.log()
    }
}

/// One connection to the daemon: the shared harness's (its `send`), whose answers
/// [`Conn::call`] reads whole.
pub struct Conn(http::Conn);

impl std::ops::Deref for Conn {
    type Target = http::Conn;

    fn deref(&self) -> &http::Conn {
        &self.0
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut http::Conn {
        &mut self.0
    }
}

impl Conn {
    pub async fn open(socket: &Path) -> Conn {
        Conn(http::Conn::unix(socket, "sandbox").await)
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

/// Scratch space for tests, outside `/tmp` (see `sandman_testkit::scratch!`).
pub fn scratch() -> PathBuf {
    sandman_testkit::scratch!()
}

//! End-to-end harness: runs the real `sandman serve` (process provider, real `sandmand`) in a
//! temporary state directory and talks plain HTTP to it.
#![allow(dead_code, clippy::unwrap_used)]

pub mod docker;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};

pub const TOKEN: &str = "e2e-token-0123456789abcdef";

pub fn sandman_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandman"))
}

pub struct Server {
    pub child: Option<Child>,
    pub state: PathBuf,
    pub url: String,
    pub addr: String,
    /// The server's log lines (warnings and errors), as they come.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    pub fn start() -> Server {
        let dir = tempfile::tempdir_in(scratch()).unwrap();
        let state = dir.path().join("state");
        let mut s = Server::start_in(&state, &[]);
        s._dir = Some(dir);
        s
    }

    /// Starts (or restarts) a server on `state`.
    pub fn start_in(state: &Path, extra: &[&str]) -> Server {
        Server::start_bin(&sandman_bin(), state, extra)
    }

    /// Starts a server from a given `sandman` binary.
    pub fn start_bin(bin: &Path, state: &Path, extra: &[&str]) -> Server {
        Server::start_bin_env(bin, state, extra, &[], &[])
    }

    /// Starts a server with extra environment variables set and others removed.
    pub fn start_bin_env(bin: &Path, state: &Path, extra: &[&str], set: &[(&str, &str)], remove: &[&str]) -> Server {
        let mut cmd = Command::new(bin);
        for (k, v) in set {
            cmd.env(k, v);
        }
        for k in remove {
            cmd.env_remove(k);
        }
        let mut child = cmd
            .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state)
            .args(extra)
            .env("SANDMAN_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = log.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut sent = false;
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if !sent && let Some(rest) = line.split("serving on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                    sent = true;
                } else if std::env::var_os("SANDMAN_E2E_LOG").is_some() {
                    eprintln!("server: {line}");
                }
                let mut kept = kept.lock().unwrap();
                if kept.len() < 10_000 {
                    kept.push(line);
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(60)).expect("the server did not say where it listens");
        Server { child: Some(child), state: state.to_path_buf(), url: format!("http://{addr}"), addr, log, _dir: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub fn client(&self) -> Http {
        Http { addr: self.addr.clone(), token: Some(TOKEN.to_string()) }
    }

    pub fn sandbox_dirs(&self) -> Vec<String> {
        std::fs::read_dir(self.state.join("sandboxes"))
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
        // Sandboxes outlive a server on purpose; the tests end theirs.
        if let Ok(out) = Command::new("pkill").arg("-KILL").arg("-f").arg(self.state.display().to_string()).output() {
            let _ = out;
        }
    }
}

/// Plain HTTP/1.1 over TCP, one connection per call.
#[derive(Clone)]
pub struct Http {
    pub addr: String,
    pub token: Option<String>,
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

    pub fn ok(self) -> Value {
        assert!((200..300).contains(&self.status), "{}: {}", self.status, String::from_utf8_lossy(&self.body));
        self.json()
    }

    pub fn error(&self, status: u16, code: &str) -> Value {
        assert_eq!(self.status, status, "{}", String::from_utf8_lossy(&self.body));
        let v = self.json();
        assert_eq!(v["error"]["code"], code, "{v}");
        v["error"].clone()
    }
}

pub enum Body {
    Empty,
    Json(Value),
    Stream(Box<dyn Iterator<Item = Bytes> + Send>),
}

impl Http {
    pub async fn send(&self, method: &str, path: &str, body: Body) -> hyper::Response<hyper::body::Incoming> {
        let stream = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = hyper::Request::builder().method(method).uri(path).header("host", "sandman");
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let body = match body {
            Body::Empty => Full::new(Bytes::new()).map_err(|e| match e {}).boxed_unsync(),
            Body::Json(v) => {
                req = req.header("content-type", "application/json");
                Full::new(Bytes::from(serde_json::to_vec(&v).unwrap())).map_err(|e| match e {}).boxed_unsync()
            }
            Body::Stream(it) => {
                let s = futures_util::stream::iter(it.map(|b| Ok::<_, std::io::Error>(Frame::data(b))));
                StreamBody::new(s).boxed_unsync()
            }
        };
        sender.send_request(req.body(body).unwrap()).await.unwrap()
    }

    pub async fn call(&self, method: &str, path: &str, body: Body) -> Resp {
        let resp = self.send(method, path, body).await;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Resp { status, body }
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.call("GET", path, Body::Empty).await
    }

    pub async fn post(&self, path: &str, v: Value) -> Resp {
        self.call("POST", path, Body::Json(v)).await
    }

    pub async fn create(&self, v: Value) -> Value {
        self.post("/v1/sandboxes", v).await.ok()
    }

    pub async fn exec(&self, id: &str, v: Value) -> Value {
        self.post(&format!("/v1/sandboxes/{id}/exec"), v).await.ok()
    }

    pub async fn release(&self, id: &str) -> Resp {
        self.call("DELETE", &format!("/v1/sandboxes/{id}"), Body::Empty).await
    }
}

/// Processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if pid == me {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains(needle) {
            out.push(pid);
        }
    }
    out
}

pub async fn eventually(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f().await
}

pub fn host() -> Value {
    json!({"image": "host"})
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

/// Runs the `sandman` CLI against `server`, answering (exit code, stdout, stderr).
pub fn cli(server: &Server, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(sandman_bin())
        .args(args)
        .env("SANDMAN_URL", &server.url)
        .env("SANDMAN_TOKEN", TOKEN)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

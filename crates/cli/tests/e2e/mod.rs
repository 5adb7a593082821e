//! End-to-end harness: runs the real `sandman serve` (process provider, real `sandmand`) in a
//! temporary state directory, through the shared harness (`sandman_testkit`, which captures its
//! log and prints it when a test fails), and talks plain HTTP to it.
#![allow(dead_code, unused_imports, clippy::unwrap_used)]

pub mod docker;
pub mod tenant;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use sandman_testkit::Spawned;
pub use sandman_testkit::eventually_async as eventually;
pub use sandman_testkit::http::Body;
use sandman_testkit::http::Conn;
use serde_json::{Value, json};

pub const TOKEN: &str = "e2e-token-0123456789abcdef";

pub fn sandman_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandman"))
}

/// How long a server may take to say where it listens.
const LISTENING_WITHIN: Duration = Duration::from_secs(60);

pub struct Server {
    /// Killed when dropped (or by [`Server::kill9`]); its log is printed when the test fails.
    pub process: Spawned,
    pub state: PathBuf,
    pub url: String,
    pub addr: String,
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
        Server::start_from(None, bin, state, extra, set, remove)
    }

    /// Starts a server in the working directory `cwd`, `state` relative to it.
    pub fn start_relative(cwd: &Path, state: &Path) -> Server {
        Server::start_from(Some(cwd), &sandman_bin(), state, &[], &[], &[])
    }

    fn start_from(
        cwd: Option<&Path>,
        bin: &Path,
        state: &Path,
        extra: &[&str],
        set: &[(&str, &str)],
        remove: &[&str],
    ) -> Server {
        let mut cmd = Command::new(bin);
        if let Some(dir) = cwd {
            cmd.current_dir(dir);
        }
        let absolute = cwd.map_or_else(|| state.to_path_buf(), |dir| dir.join(state));
        for k in remove {
            cmd.env_remove(k);
        }
        // A docker provider's egress sandboxes on a network of this state directory's own,
        // which its `Cleanup` removes.
        let (network, bridge) = sandman_testkit::docker::test_network(&absolute);
        cmd.env("SANDMAN_DOCKER_NETWORK", network).env("SANDMAN_DOCKER_BRIDGE", bridge);
        for (k, v) in set {
            cmd.env(k, v);
        }
        let listen = extra.iter().position(|a| *a == "--listen").map_or("127.0.0.1:0", |i| extra[i + 1]);
        let extra: Vec<&str> = match extra.iter().position(|a| *a == "--listen") {
            Some(i) => extra[..i].iter().chain(&extra[i + 2..]).copied().collect(),
            None => extra.to_vec(),
        };
        cmd.args(["serve", "--listen", listen, "--state-dir"])
            .arg(state)
            .args(&extra)
            .env("SANDMAN_TOKEN", TOKEN)
            .env("RUST_LOG", "warn");
        let mut process = Spawned::spawn("sandman-serve", &mut cmd, &scratch());
        let addr = process.wait_for_line(LISTENING_WITHIN, |line| {
            line.split("serving on http://")
                .nth(1)
                .map(|rest| rest.split_whitespace().next().unwrap_or_default().to_string())
        });
        // Where it listens on every address, it is reached on loopback.
        let addr = addr.replace("0.0.0.0:", "127.0.0.1:");
        Server { process, state: absolute, url: format!("http://{addr}"), addr, _dir: None }
    }

    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        self.process.kill();
    }

    pub fn rss_kib(&self) -> u64 {
        sandman_testkit::rss_kib(self.pid())
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
        if std::thread::panicking() {
            // The sandboxes' daemons' logs; the server's own is printed as `process` drops.
            sandman_testkit::print_logs_under(&self.state);
        }
        // Sandboxes outlive a server on purpose; the tests end theirs, and the cgroups of those
        // still held, which no server will find again once the state directory goes.
        if let Ok(out) = Command::new("pkill").arg("-KILL").arg("-f").arg(self.state.display().to_string()).output() {
            let _ = out;
        }
        sandman_testkit::remove_sandbox_cgroups(&self.sandbox_dirs());
        sandman_testkit::unmount_records(&self.state);
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

impl Http {
    pub async fn send(&self, method: &str, path: &str, body: Body) -> hyper::Response<hyper::body::Incoming> {
        let mut conn = Conn::tcp(&self.addr, "sandman").await;
        conn.send(method, path, self.token.as_deref(), body).await.unwrap()
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

    /// A `PUT` of `bytes`, sent as one chunk of a body of unknown length (as a streamed upload).
    pub async fn put(&self, path: &str, bytes: impl Into<Bytes>) -> Resp {
        self.call("PUT", path, Body::Chunks(Box::new(std::iter::once(bytes.into())))).await
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
    sandman_testkit::processes_mentioning(needle).into_iter().map(|(pid, _)| pid).collect()
}

pub fn host() -> Value {
    json!({"image": "host"})
}

/// Scratch space for tests, outside `/tmp` (see `sandman_testkit::scratch!`).
pub fn scratch() -> PathBuf {
    sandman_testkit::scratch!()
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

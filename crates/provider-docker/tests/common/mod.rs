//! Test harness: the real Docker engine (which must be running: the tests fail, not skip, without
//! it), the static `sandmand`, the locally built test images, providers on state directories that
//! clean up their containers, and a small HTTP/1.1 client for a sandbox's daemon over its socket.
#![allow(dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use sandman_provider::{Endpoint, ProviderEvent};
use sandman_provider_docker::{DockerConfig, DockerProvider, OWNER_LABEL};
use serde_json::Value;
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// A busybox-static root file system: busybox's applets and nothing else (`scripts/test-images`).
pub const BUSYBOX: &str = "sandman-test/busybox:latest";
/// One static binary, `/hello`, as entry point: no shell, no libc, no /etc.
pub const NOSHELL: &str = "sandman-test/noshell:latest";
/// An image no engine has and no registry can serve.
pub const MISSING: &str = "sandman-test/does-not-exist:latest";

const START_DOCKER: &str = "start it with `dockerd > /var/log/dockerd.log 2>&1 &` (./scripts/test installs and starts \
                            it: apt-get install docker.io)";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap().to_path_buf()
}

/// Fails the test, saying how to start it, when the engine does not answer.
pub fn require_docker() {
    static CHECKED: Once = Once::new();
    CHECKED.call_once(|| {
        let out = Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]).output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => panic!(
                "the docker engine is not running ({}); these tests need it: {START_DOCKER}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => panic!("no docker CLI ({e}); these tests need docker: {START_DOCKER}"),
        }
        let images = Command::new(workspace().join("scripts/test-images")).output().unwrap();
        assert!(images.status.success(), "scripts/test-images failed: {}", String::from_utf8_lossy(&images.stderr));
    });
}

/// The static daemon: `$SANDMAND_STATIC` (set by scripts/test), else the one `./scripts/build-daemon`
/// leaves in `target/static/`.
pub fn static_daemon() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDMAND_STATIC").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let bin = workspace().join("target/static/x86_64-unknown-linux-gnu/daemon/sandmand");
    assert!(bin.is_file(), "no static daemon at {}: build it first: ./scripts/build-daemon", bin.display());
    bin
}

/// A unique sandbox id: container names are global to the engine.
pub fn id(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

/// A state directory under the target's temporary directory (short enough for socket paths),
/// whose containers are force-removed when it is dropped, whatever the test did.
pub struct State {
    pub dir: tempfile::TempDir,
}

impl State {
    pub fn new() -> State {
        require_docker();
        let base = scratch();
        std::fs::create_dir_all(&base).unwrap();
        State { dir: tempfile::Builder::new().prefix("dp").tempdir_in(base).unwrap() }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The owner label of this state directory's containers.
    pub fn owner(&self) -> String {
        std::fs::canonicalize(self.path().join("docker")).unwrap().display().to_string()
    }

    pub fn config(&self) -> DockerConfig {
        DockerConfig::new(self.path().to_path_buf(), static_daemon())
    }

    pub async fn provider(&self) -> DockerProvider {
        DockerProvider::connect(self.config()).await.unwrap_or_else(|e| panic!("cannot make the provider: {e}"))
    }

    /// This state directory's containers, running or not.
    pub fn containers(&self) -> Vec<String> {
        let Ok(owner) = std::fs::canonicalize(self.path().join("docker")) else { return Vec::new() };
        containers_with_label(&format!("{OWNER_LABEL}={}", owner.display()))
    }

    /// The sandbox directories left under `docker/`.
    pub fn sandbox_dirs(&self) -> Vec<String> {
        std::fs::read_dir(self.path().join("docker"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let left = self.containers();
        if !left.is_empty() {
            let _ = Command::new("docker").args(["rm", "-f"]).args(&left).output();
        }
    }
}

/// `docker ps -aq --filter label=<label>`.
pub fn containers_with_label(label: &str) -> Vec<String> {
    let out = docker(&["ps", "-aq", "--filter", &format!("label={label}")]);
    out.split_whitespace().map(str::to_string).collect()
}

/// Runs the docker CLI; its stdout.
pub fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap();
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `docker inspect` of a sandbox's container, as JSON.
pub fn inspect(id: &str) -> Value {
    let out = docker(&["inspect", &sandman_provider_docker::container_name(id)]);
    serde_json::from_str::<Value>(&out).unwrap()[0].clone()
}

pub fn socket_of(endpoint: &Endpoint) -> PathBuf {
    match endpoint {
        Endpoint::Unix(p) => p.clone(),
        other => panic!("the docker provider answered a non-Unix endpoint: {other:?}"),
    }
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

    pub fn ok(self) -> Resp {
        assert!((200..300).contains(&self.status), "{}: {}", self.status, String::from_utf8_lossy(&self.body));
        self
    }
}

/// One request with a raw body on a fresh connection.
pub async fn call_raw(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: Bytes,
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
    if let Some(c) = content_type {
        req = req.header("content-type", c);
    }
    let resp = sender.send_request(req.body(Full::new(body)).unwrap()).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Resp { status, body })
}

/// One JSON request on a fresh connection.
pub async fn call(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Result<Resp, String> {
    match body {
        Some(v) => {
            let bytes = Bytes::from(serde_json::to_vec(&v).unwrap());
            call_raw(socket, method, path, token, Some("application/json"), bytes).await
        }
        None => call_raw(socket, method, path, token, None, Bytes::new()).await,
    }
}

/// Waits for the daemon's health (the provider answers before the daemon listens).
pub async fn wait_healthy(socket: &Path) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..1000 {
        match call(socket, "GET", "/v1/health", None, None).await {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("health answered {}", r.status),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("daemon on {} not healthy within 20 s: {last}", socket.display()))
}

/// A ready daemon's exec of `argv`.
pub async fn exec(socket: &Path, token: &str, argv: &[&str]) -> Result<Value, String> {
    let r = call(socket, "POST", "/v1/exec", Some(token), Some(serde_json::json!({"argv": argv}))).await?;
    if r.status != 200 {
        return Err(format!("exec answered {}: {}", r.status, String::from_utf8_lossy(&r.body)));
    }
    Ok(r.json())
}

/// The conformance suite's daemon check: health, then `echo hi` with the token, over the socket.
pub async fn check_daemon(endpoint: Endpoint, token: String) -> Result<(), String> {
    let socket = socket_of(&endpoint);
    wait_healthy(&socket).await?;
    let out = exec(&socket, &token, &["/bin/echo", "hi"]).await?;
    if out["exit_code"] == 0 && out["stdout"] == "hi\n" { Ok(()) } else { Err(format!("echo hi gave {out}")) }
}

/// The next event for `id`, within 20 s.
pub async fn next_event(events: &mut mpsc::Receiver<ProviderEvent>, id: &str) -> ProviderEvent {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let e = events.recv().await.expect("event stream ended");
            if e.id == id {
                return e;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no event for {id} within 20 s"))
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

//! Test harness: the real Docker engine (which must be running: the tests fail, not skip, without
//! it), the static `sandmand`, the locally built test images, providers on state directories that
//! clean up their containers, and a small HTTP/1.1 client for a sandbox's daemon over its socket.
#![allow(unused_imports, dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::time::Duration;

use sandman_provider::ProviderEvent;
pub use sandman_provider::conformance::daemon::{Resp, call, call_raw, check_daemon, exec, socket_of, wait_healthy};
pub use sandman_provider::conformance::next_event;
use sandman_provider_docker::{DockerConfig, DockerProvider, OWNER_LABEL};
use serde_json::Value;
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

/// Scratch space for tests, outside `/tmp`: an isolated sandbox gets a `/tmp` of its own, which
/// would hide anything the test keeps under the host's `/tmp` (as the target directory is when
/// the checkout itself is under `/tmp`).
pub fn scratch() -> PathBuf {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let base = if target.starts_with("/tmp") { PathBuf::from("/var/tmp/sandman-tests") } else { target };
    std::fs::create_dir_all(&base).unwrap_or_else(|e| panic!("cannot make {}: {e}", base.display()));
    base
}

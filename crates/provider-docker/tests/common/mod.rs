//! Test harness: the real Docker engine (which must be running: the tests fail, not skip, without
//! it), the static `sandmand`, the locally built test images, providers on state directories that
//! clean up their containers, and a small HTTP/1.1 client for a sandbox's daemon over its socket.
#![allow(unused_imports, dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandman_provider::ProviderEvent;
pub use sandman_provider::conformance::daemon::{Resp, call, call_raw, check_daemon, exec, socket_of, wait_healthy};
pub use sandman_provider::conformance::next_event;
use sandman_provider_docker::{DockerConfig, DockerProvider, OWNER_LABEL};
pub use sandman_testkit::docker::{containers_with_label, docker, require_docker};
pub use sandman_testkit::static_daemon;
use serde_json::Value;
use tokio::sync::mpsc;

/// A busybox-static root file system: busybox's applets and nothing else (`scripts/test-images`).
pub const BUSYBOX: &str = "sandman-test/busybox:latest";
/// One static binary, `/hello`, as entry point: no shell, no libc, no /etc.
pub const NOSHELL: &str = "sandman-test/noshell:latest";
/// An image no engine has and no registry can serve.
pub const MISSING: &str = "sandman-test/does-not-exist:latest";

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
        // The harness cleans up by the provider's owner label.
        assert_eq!(sandman_testkit::docker::OWNER_LABEL, OWNER_LABEL);
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

    /// The provider's configuration: its egress sandboxes on a network of this state
    /// directory's own, removed with it.
    pub fn config(&self) -> DockerConfig {
        let (network, bridge) = sandman_testkit::docker::test_network(self.path());
        let egress = sandman_provider_docker::Egress { network, bridge, ..Default::default() };
        DockerConfig { egress, ..DockerConfig::new(self.path().to_path_buf(), static_daemon()) }
    }

    pub async fn provider(&self) -> DockerProvider {
        DockerProvider::connect(self.config()).await.unwrap_or_else(|e| panic!("cannot make the provider: {e}"))
    }

    /// This state directory's containers, running or not.
    pub fn containers(&self) -> Vec<String> {
        sandman_testkit::docker::containers_of_state(self.path())
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
        sandman_testkit::docker::remove_containers_of_state(self.path());
    }
}

/// `docker inspect` of a sandbox's container, as JSON.
pub fn inspect(id: &str) -> Value {
    let out = docker(&["inspect", &sandman_provider_docker::container_name(id)]);
    serde_json::from_str::<Value>(&out).unwrap()[0].clone()
}

/// Scratch space for tests, outside `/tmp` (see `sandman_testkit::scratch!`).
pub fn scratch() -> PathBuf {
    sandman_testkit::scratch!()
}

//! Docker for the tests that need it: the engine and the test images checked (the tests fail,
//! not skip, without them), the docker CLI run, each state directory's own network for egress
//! sandboxes ([`test_network`]), and a state directory's containers, network and host firewall
//! table removed however a test ends ([`Cleanup`]).

use std::path::{Path, PathBuf};

use crate::workspace;
use std::process::Command;
use std::sync::Once;

/// The label the Docker provider puts on its containers: the canonical path of its
/// `<state_dir>/docker`.
pub const OWNER_LABEL: &str = "sandman.dev/owner";

const START_DOCKER: &str = "start it with `dockerd > /var/log/dockerd.log 2>&1 &` (./scripts/test installs and starts \
                            it: apt-get install docker.io)";

/// Fails the test, saying how to start it, when the engine does not answer; builds the test
/// images (`scripts/test-images`), once per test binary.
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
        let script = workspace().join("scripts/test-images");
        let images = Command::new(&script).output().unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        assert!(images.status.success(), "scripts/test-images failed: {}", String::from_utf8_lossy(&images.stderr));
    });
}

/// Runs the docker CLI; its stdout. Fails the test when it fails.
pub fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap_or_else(|e| panic!("docker {args:?}: {e}"));
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `docker ps -aq --filter label=<label>`.
pub fn containers_with_label(label: &str) -> Vec<String> {
    let out = docker(&["ps", "-aq", "--filter", &format!("label={label}")]);
    out.split_whitespace().map(str::to_string).collect()
}

/// The containers of a state directory (the Docker provider's on `state/docker`), running or
/// not; none when it has no `docker/` yet.
pub fn containers_of_state(state: &Path) -> Vec<String> {
    let Ok(owner) = std::fs::canonicalize(state.join("docker")) else { return Vec::new() };
    containers_with_label(&format!("{OWNER_LABEL}={}", owner.display()))
}

/// The docker network and bridge interface that a test's server (or provider) on `state` gives
/// its egress sandboxes (`--docker-network`, `--docker-bridge`): one of its own, so that tests
/// neither share the default one nor leave it behind.
pub fn test_network(state: &Path) -> (String, String) {
    // FNV-1a of the path: stable, and short enough for an interface name (`smt` + 8 hex).
    let hash = state
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
    (format!("sandman-test-{hash:08x}"), format!("smt{hash:08x}"))
}

/// Where servers record their host firewall tables, each naming its server's marker directory
/// (`sandman_provider::firewall::TABLES_DIR`).
const TABLES_DIR: &str = "/run/sandman/tables";

/// Force-removes the containers of a state directory, then its test network and the host
/// firewall table its docker provider installed; never fails (it runs from `Drop`).
pub fn remove_containers_of_state(state: &Path) {
    let Ok(owner) = std::fs::canonicalize(state.join("docker")) else { return };
    let filter = format!("label={OWNER_LABEL}={}", owner.display());
    if let Ok(out) = Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output() {
        let ids: Vec<String> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect();
        if !ids.is_empty() {
            let _ = Command::new("docker").args(["rm", "-f"]).args(&ids).output();
        }
    }
    let (network, _) = test_network(state);
    let _ = Command::new("docker").args(["network", "rm", &network]).output();
    for entry in std::fs::read_dir(TABLES_DIR).into_iter().flatten().flatten() {
        if std::fs::read(entry.path()).is_ok_and(|marker| marker == owner.as_os_str().as_encoded_bytes()) {
            let table = entry.file_name().to_string_lossy().into_owned();
            let _ = Command::new("nft").args(["delete", "table", "inet", &table]).output();
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Force-removes the containers of a state directory when dropped, whatever the test did (a
/// server's sandboxes outlive it on purpose).
#[derive(Debug)]
pub struct Cleanup(pub PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_containers_of_state(&self.0);
    }
}

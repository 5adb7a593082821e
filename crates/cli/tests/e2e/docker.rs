//! Docker for the end-to-end tests: the engine and the test images checked, the static daemon
//! found, and the containers of a state directory removed however a test ends.

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap().to_path_buf()
}

/// The engine is running and the test images are built; fails saying how otherwise.
pub fn require_docker() {
    let info = Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]).output();
    assert!(
        info.is_ok_and(|o| o.status.success()),
        "the docker engine is not running; start it with `dockerd > /var/log/dockerd.log 2>&1 &` \
         (./scripts/test installs and starts it)"
    );
    let images = Command::new(workspace().join("scripts/test-images")).output().unwrap();
    assert!(images.status.success(), "scripts/test-images failed: {}", String::from_utf8_lossy(&images.stderr));
}

/// `$SANDMAND_STATIC` (scripts/test sets it), else what ./scripts/build-daemon leaves.
pub fn static_daemon() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDMAND_STATIC").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let bin = workspace().join("target/static/x86_64-unknown-linux-gnu/daemon/sandmand");
    assert!(bin.is_file(), "no static daemon at {}: build it first: ./scripts/build-daemon", bin.display());
    bin
}

pub fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap();
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn containers_of(id: &str) -> Vec<String> {
    docker(&["ps", "-aq", "--filter", &format!("label=sandman.dev/sandbox={id}")])
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Force-removes the containers of a state directory when dropped, whatever the test did (a
/// server's sandboxes outlive it on purpose).
pub struct Cleanup(pub PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Ok(owner) = std::fs::canonicalize(self.0.join("docker")) else { return };
        let filter = format!("label=sandman.dev/owner={}", owner.display());
        if let Ok(out) = Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output() {
            let ids: Vec<String> =
                String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect();
            if !ids.is_empty() {
                let _ = Command::new("docker").args(["rm", "-f"]).args(&ids).output();
            }
        }
    }
}

//! Test harness: the real `sandmand` binary and process providers on state directories outside
//! /tmp; the client for a sandbox's daemon is the conformance suite's.
#![allow(unused_imports, dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use sandman_provider::conformance::daemon::{Resp, call, call_raw, check_daemon, exec, socket_of, wait_healthy};
use sandman_provider::{Endpoint, Provider, ProviderError, SandboxSpec};
use sandman_provider_process::{Isolation, ProcessConfig, ProcessProvider};
use serde_json::Value;

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

pub fn provider(state: &Path, isolation: Isolation) -> ProcessProvider {
    ProcessProvider::new(ProcessConfig {
        state_dir: state.to_path_buf(),
        daemon_bin: daemon_bin(),
        daemon_args: Vec::new(),
        isolation,
        hide: Vec::new(),
    })
    .unwrap_or_else(|e| panic!("cannot make the provider: {e}"))
}

/// The sandbox directory of an endpoint (`<dir>/d.sock`).
pub fn dir_of(endpoint: &Endpoint) -> PathBuf {
    socket_of(endpoint).parent().unwrap().to_path_buf()
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

/// Creates the sandbox and waits for its daemon.
pub async fn ready(p: &ProcessProvider, s: &SandboxSpec) -> Endpoint {
    let endpoint = p.create(s).await.unwrap_or_else(|e| panic!("create failed: {e}"));
    wait_healthy(&socket_of(&endpoint)).await.unwrap();
    endpoint
}

/// Runs a shell script through the sandbox's daemon.
pub async fn sh(endpoint: &Endpoint, token: &str, script: &str) -> Value {
    exec(&socket_of(endpoint), token, &["/bin/sh", "-c", script]).await.unwrap()
}

/// A result's stdout.
pub fn out(v: &Value) -> String {
    v["stdout"].as_str().unwrap().to_string()
}

/// The message of a refusal; anything else fails the test.
pub fn unsupported(res: Result<Endpoint, ProviderError>) -> String {
    match res {
        Err(ProviderError::Unsupported(msg)) => msg,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

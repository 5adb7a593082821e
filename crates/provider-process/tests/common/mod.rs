//! Test harness: the real `sandmand` binary and process providers on state directories outside
//! /tmp; the client for a sandbox's daemon is the conformance suite's.
#![allow(unused_imports, dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};

pub use sandman_provider::conformance::daemon::{Resp, call, call_raw, check_daemon, exec, socket_of, wait_healthy};
use sandman_provider::{Endpoint, Provider, ProviderError, SandboxSpec};
use sandman_provider_process::{Isolation, ProcessConfig, ProcessProvider};
pub use sandman_testkit::{eventually, is_root, processes_mentioning, require_root};
use serde_json::Value;

/// The daemon built beside this test, or `$SANDMAN_DAEMON`.
pub fn daemon_bin() -> PathBuf {
    sandman_testkit::daemon_beside_tests()
}

/// A state directory under the target's temporary directory: not under /tmp, which an isolated
/// sandbox replaces, and short enough for socket paths. A failing test prints its daemons' logs.
pub fn state_dir() -> sandman_testkit::LoggedDir {
    sandman_testkit::LoggedDir::new_in(&scratch(), "pp")
}

pub fn provider(state: &Path, isolation: Isolation) -> ProcessProvider {
    ProcessProvider::new(ProcessConfig {
        state_dir: state.to_path_buf(),
        daemon_bin: daemon_bin(),
        daemon_args: Vec::new(),
        isolation,
        hide: Vec::new(),
        network: Default::default(),
        defaults: Default::default(),
        capacity: None,
        images: Some(sandman_image::StoreConfig::new(state.join("images"))),
    })
    .unwrap_or_else(|e| panic!("cannot make the provider: {e}"))
}

/// The sandbox directory of an endpoint (`<dir>/d.sock`).
pub fn dir_of(endpoint: &Endpoint) -> PathBuf {
    socket_of(endpoint).parent().unwrap().to_path_buf()
}

/// Scratch space for tests, outside `/tmp` (see `sandman_testkit::scratch!`).
pub fn scratch() -> PathBuf {
    sandman_testkit::scratch!()
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

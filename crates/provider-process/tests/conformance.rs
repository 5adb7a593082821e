//! The provider conformance suite against the real process provider and the real `sandmand`,
//! isolated (root, as CI runs) and not.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{check_daemon, dir_of, provider, require_root, state_dir};
use sandman_provider::Endpoint;
use sandman_provider::conformance::{self, spec};
use sandman_provider_process::{HOST_IMAGE, Isolation};

async fn suite(isolate: Isolation, tag: &str) {
    let state = state_dir();
    let p = provider(state.path(), isolate);
    let id = |name: &str| format!("{tag}-{name}");
    conformance::create_list_delete(&p, spec(&id("c1"), HOST_IMAGE), check_daemon).await;
    conformance::many_at_once(&p, (0..20).map(|i| spec(&id(&format!("m{i}")), HOST_IMAGE)).collect()).await;
    // An image no registry has (its host cannot be resolved) fails naming it; without
    // isolation, any image but `host` is refused.
    let (missing, says) = match isolate {
        Isolation::Full => ("sandman-registry.invalid/missing:1", "sandman-registry.invalid/missing:1"),
        Isolation::None => ("python:3.12", "needs isolation"),
    };
    conformance::refuses_clearly(&p, spec(&id("r1"), missing), says).await;
    let second = provider(state.path(), isolate);
    conformance::found_again_after_restart(&p, &second, spec(&id("f1"), HOST_IMAGE)).await;
    conformance::death_is_reported(&p, spec(&id("d1"), HOST_IMAGE), kill_daemon).await;
    if isolate == Isolation::Full {
        // Without isolation a sandbox is plain processes of the server's, in the host's tree.
        let state_path = std::fs::canonicalize(state.path()).unwrap().display().to_string();
        let paths = [state_path.clone(), format!("{state_path}/sandboxes/{}", id("h1"))];
        conformance::shows_no_host_paths(&p, spec(&id("h1"), HOST_IMAGE), &paths, run_script).await;
    }
    let left: Vec<_> =
        std::fs::read_dir(state.path().join("sandboxes")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "sandbox directories left behind: {left:?}");
}

/// Runs a shell script in the sandbox; its stdout.
async fn run_script(endpoint: Endpoint, token: String, script: &'static str) -> Result<String, String> {
    let socket = conformance::daemon::socket_of(&endpoint);
    conformance::daemon::wait_healthy(&socket).await?;
    let out = conformance::daemon::exec(&socket, &token, &["/bin/sh", "-c", script]).await?;
    out["stdout"].as_str().map(str::to_string).ok_or_else(|| format!("no stdout in {out}"))
}

/// SIGKILLs the process the provider started, behind its back.
async fn kill_daemon(endpoint: Endpoint) {
    let pid_line = std::fs::read_to_string(dir_of(&endpoint).join("daemon.pid")).unwrap();
    let pid = pid_line.split_whitespace().next().unwrap();
    let status = Command::new("kill").args(["-KILL", pid]).status().unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_provider_passes_the_suite_isolated() {
    require_root();
    let state = state_dir();
    assert_eq!(provider(state.path(), Isolation::Full).isolation_mode(), Isolation::Full);
    suite(Isolation::Full, "iso").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_provider_passes_the_suite_without_isolation() {
    suite(Isolation::None, "plain").await;
}

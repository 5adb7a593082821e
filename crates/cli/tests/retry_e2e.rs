//! The CLI against a real `sandman serve` that goes away and comes back, as a server replica
//! does in a rolling update: a call made while no server listens (connection refused) is sent
//! again until the restarted server answers it, an exec included (it never reached a server);
//! an exec cut off by the server's death is not sent again, and ran exactly once.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use e2e::{Server, TOKEN, eventually, sandman_bin};
use serde_json::json;

/// `sandman exec ID ... -- sh -c SCRIPT` through the server's Unix socket in `state`, resending
/// for up to two minutes.
fn exec(state: &std::path::Path, id: &str, script: &str) -> Child {
    let url = format!("unix:{}", state.join("sandman.sock").display());
    Command::new(sandman_bin())
        .args(["exec", id, "--url", &url, "--token", TOKEN, "--retries", "100", "--retry-deadline", "120"])
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `child` to exit, for at most `limit`.
fn finish(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the CLI did not finish within {limit:?}: {:?}", child.wait_with_output());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_resends_across_a_server_restart_but_never_an_exec_that_may_have_run() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let mut server = Server::start_in(&state, &["--memory-overcommit", "0"]);
    let http = server.client();
    let sb = http.create(json!({"image": "host", "lease_s": 600})).await;
    let id = sb["id"].as_str().unwrap().to_string();

    // An exec in flight when the server is killed: its answer is lost, and it is not sent again.
    let cut = exec(&state, &id, "echo ran >> /tmp/count; sleep 600");
    let started = eventually(Duration::from_secs(60), async || {
        http.exec(&id, json!({"command": "cat /tmp/count 2>/dev/null"})).await["stdout"] == "ran\n"
    })
    .await;
    assert!(started, "the exec never started");
    server.kill9();
    let out = finish(cut, Duration::from_secs(60));
    assert_ne!(out.status.code(), Some(0), "{out:?}");

    // A call made while nothing listens: refused, and sent again until the server is back.
    let waiting = exec(&state, &id, "echo after the restart");
    let server = Server::start_in(&state, &["--memory-overcommit", "0"]);
    let out = finish(waiting, Duration::from_secs(120));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "after the restart\n");

    // The exec that was cut off ran once: it was never sent a second time.
    let http = server.client();
    assert_eq!(http.exec(&id, json!({"command": "cat /tmp/count"})).await["stdout"], "ran\n");
    http.release(&id).await.ok();
}

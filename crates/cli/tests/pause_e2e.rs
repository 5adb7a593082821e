//! Pause and resume through the real `sandman serve` (process provider, isolated) and the CLI:
//! `sandman pause` and `sandman resume`, the `paused` error with its hint, `auto_resume`, and a
//! paused sandbox found paused by a server restarted after `kill -9`.
#![allow(clippy::unwrap_used)]

mod e2e;

use e2e::Server;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_pauses_and_resumes_and_a_call_on_a_paused_sandbox_says_what_to_do() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();

    let (code, out, err) = e2e::cli(&server, &["pause", &id]);
    assert_eq!((code, out.trim()), (0, format!("{id}: paused").as_str()), "{err}");
    let (code, _, err) = e2e::cli(&server, &["exec", &id, "--", "true"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("error: sandbox `{id}` is paused")), "{err}");
    assert!(err.contains("hint: resume it with `sandman resume ID`"), "{err}");
    let listed = http.get("/v1/sandboxes?state=paused").await.ok();
    assert_eq!(listed["sandboxes"][0]["id"], id.as_str(), "{listed}");
    let metrics = String::from_utf8_lossy(&http.get("/metrics").await.body).into_owned();
    assert!(metrics.contains("sandman_sandboxes{state=\"paused\"} 1"), "{metrics}");

    let (code, out, err) = e2e::cli(&server, &["resume", &id]);
    assert_eq!((code, out.trim()), (0, format!("{id}: ready").as_str()), "{err}");
    let r = http.exec(&id, json!({"argv": ["/bin/echo", "awake"]})).await;
    assert_eq!(r["stdout"], "awake\n", "{r}");
    let events = http.get("/v1/events").await.ok();
    let states: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["sandbox"] == id.as_str())
        .filter_map(|e| e["state"].as_str())
        .collect();
    assert!(states.ends_with(&["paused", "ready"]), "{events}");
    http.release(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_resumes_an_auto_resume_sandbox_and_a_restarted_server_finds_a_paused_one_paused() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let mut server = Server::start_in(&state, &[]);
    let http = server.client();
    let auto = http.create(json!({"image": "host", "auto_resume": true})).await;
    assert_eq!(auto["auto_resume"], true, "{auto}");
    let auto = auto["id"].as_str().unwrap().to_string();
    http.post(&format!("/v1/sandboxes/{auto}/pause"), json!({})).await.ok();
    let r = http.exec(&auto, json!({"argv": ["/bin/echo", "resumed by the call"]})).await;
    assert_eq!(r["stdout"], "resumed by the call\n", "{r}");
    assert_eq!(http.get(&format!("/v1/sandboxes/{auto}")).await.ok()["state"], "ready");

    let parked = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    http.exec(&parked, json!({"command": "echo kept > /home/user/kept"})).await;
    let paused = http.post(&format!("/v1/sandboxes/{parked}/pause"), json!({})).await.ok();
    assert_eq!(paused["state"], "paused", "{paused}");
    let refused = http.post(&format!("/v1/sandboxes/{parked}/exec"), json!({"argv": ["/bin/true"]})).await;
    refused.error(409, "paused");

    server.kill9();
    let again = Server::start_in(&state, &[]);
    let http = again.client();
    let found = http.get(&format!("/v1/sandboxes/{parked}")).await.ok();
    assert_eq!(found["state"], "paused", "{found}");
    http.post(&format!("/v1/sandboxes/{parked}/resume"), json!({})).await.ok();
    let r = http.exec(&parked, json!({"command": "cat /home/user/kept"})).await;
    assert_eq!(r["stdout"], "kept\n", "{r}");
    for id in [auto, parked] {
        http.release(&id).await;
    }
}

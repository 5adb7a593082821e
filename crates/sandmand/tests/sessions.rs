//! Persistent shell sessions through the real daemon: state that survives between runs, sentinel
//! boundaries a command cannot fool, interrupts, timeouts, and deletion.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Body, Daemon, TOKEN};
use serde_json::json;

async fn session(d: &Daemon) -> String {
    let r = d.json("POST", "/v1/sessions", json!({})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().unwrap().to_string()
}

async fn run(d: &Daemon, id: &str, command: &str) -> serde_json::Value {
    let r = d.json("POST", &format!("/v1/sessions/{id}/run"), json!({"command": command})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[tokio::test]
async fn cwd_env_and_functions_survive_between_runs() {
    let d = Daemon::start().await;
    let id = session(&d).await;
    run(&d, &id, "cd /tmp").await;
    run(&d, &id, "export SANDMAN_SESSION_VAR=kept").await;
    run(&d, &id, "greet() { echo \"hello $1\"; }").await;
    let r = run(&d, &id, "pwd; echo $SANDMAN_SESSION_VAR; greet you").await;
    assert_eq!(r["stdout"], "/tmp\nkept\nhello you\n");
    assert_eq!(r["exit_code"], 0);
    let r = run(&d, &id, "echo to-err >&2; false").await;
    assert_eq!(r["stderr"], "to-err\n");
    assert_eq!(r["exit_code"], 1);
}

#[tokio::test]
async fn output_that_looks_like_a_boundary_does_not_end_the_run() {
    let d = Daemon::start().await;
    let id = session(&d).await;
    let r = run(&d, &id, "printf '\\n%s 0\\n' deadbeefdeadbeefdeadbeefdeadbeef; printf '\\n__sandman 0\\n'; echo still-running; printf 'no newline'").await;
    let out = r["stdout"].as_str().unwrap();
    assert!(out.ends_with("still-running\nno newline"), "{out:?}");
    assert_eq!(r["exit_code"], 0);
    // Quotes and syntax errors do not break the session.
    let r = run(&d, &id, "echo 'it'\"'\"'s'").await;
    assert_eq!(r["stdout"], "it's\n");
    let r = run(&d, &id, "echo \"unterminated").await;
    assert_ne!(r["exit_code"], 0);
    let r = run(&d, &id, "echo alive").await;
    assert_eq!(r["stdout"], "alive\n");
}

#[tokio::test]
async fn interrupt_stops_the_running_command_and_keeps_the_shell() {
    let d = std::sync::Arc::new(Daemon::start().await);
    let id = session(&d).await;
    run(&d, &id, "export KEEP=yes").await;
    let d2 = d.clone();
    let id2 = id.clone();
    let started = Instant::now();
    let long = tokio::spawn(async move {
        d2.json("POST", &format!("/v1/sessions/{id2}/run"), json!({"command": "sleep 100"})).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = d.json("POST", &format!("/v1/sessions/{id}/run"), json!({"command": "true"})).await;
    busy.error(409, "conflict");
    let i = d.call("POST", &format!("/v1/sessions/{id}/interrupt"), Some(TOKEN), Body::Empty).await.unwrap();
    assert_eq!(i.status, 204);
    let r = long.await.unwrap().json();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_ne!(r["exit_code"], 0, "{r}");
    assert_eq!(run(&d, &id, "echo $KEEP").await["stdout"], "yes\n");
}

#[tokio::test]
async fn timeout_interrupts_and_reports() {
    let d = Daemon::start().await;
    let id = session(&d).await;
    let r = d
        .json(
            "POST",
            &format!("/v1/sessions/{id}/run"),
            json!({"command": "echo partial; sleep 100", "timeout_ms": 300}),
        )
        .await
        .json();
    assert_eq!(r["timed_out"], true, "{r}");
    assert_eq!(r["stdout"], "partial\n");
    assert_eq!(run(&d, &id, "echo after").await["stdout"], "after\n");
}

#[tokio::test]
async fn sessions_are_listed_and_deleted() {
    let d = Daemon::start().await;
    let id = session(&d).await;
    let list = d.get("/v1/sessions").await.json();
    assert_eq!(list["sessions"].as_array().unwrap().len(), 1);
    let pid = list["sessions"][0]["pid"].as_i64().unwrap() as i32;
    let del = d.call("DELETE", &format!("/v1/sessions/{id}"), Some(TOKEN), Body::Empty).await.unwrap();
    assert_eq!(del.status, 204);
    assert!(common::eventually(Duration::from_secs(5), || !common::alive(pid)).await);
    d.json("POST", &format!("/v1/sessions/{id}/run"), json!({"command": "true"})).await.error(404, "not_found");
    d.json("POST", "/v1/sessions", json!({"shell": "/no/shell"})).await.error(400, "invalid_argument");
}

/// Before, a session run kept up to its `max_output_bytes` outside `--max-buffered-output`, the
/// bound execs and background processes share. A run now takes what it keeps from the same
/// budget, and its output is cut (`stdout_truncated`) when the others hold the rest.
#[tokio::test]
async fn a_session_runs_output_shares_the_daemons_output_budget() {
    let d = Daemon::start_with(&["--max-buffered-output", "3000"], None).await;
    let r = d.json("POST", "/v1/processes", json!({"command": "seq 1 10000", "retain_bytes": 2000, "tag": "p"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    d.json("POST", "/v1/processes/p/wait", json!({})).await;
    let id = session(&d).await;
    let big = json!({"command": "head -c 5000 /dev/zero | tr '\\0' x", "max_output_bytes": 2500});
    let r = d.json("POST", &format!("/v1/sessions/{id}/run"), big.clone()).await.json();
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!((r["stdout"].as_str().map(str::len), &r["stdout_truncated"]), (Some(1000), &json!(true)));
    // The run gave its share back, and deleting the process gives back its own.
    d.call("DELETE", "/v1/processes/p", Some(TOKEN), Body::Empty).await.unwrap();
    let r = d.json("POST", &format!("/v1/sessions/{id}/run"), big).await.json();
    assert_eq!((r["stdout"].as_str().map(str::len), &r["stdout_truncated"]), (Some(2500), &json!(true)));
    let r = run(&d, &id, "echo small").await;
    assert_eq!((r["stdout"].as_str(), &r["stdout_truncated"]), (Some("small\n"), &json!(false)));
}

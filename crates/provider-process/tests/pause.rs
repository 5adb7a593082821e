//! Pause and resume on the process provider: the sandbox's cgroup is frozen (no CPU used, its
//! processes and their memory kept), thawed to continue where it stopped, refused without
//! isolation, and a paused sandbox is still deleted whole.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{call, eventually, provider, ready, require_root, socket_of, state_dir};
use sandman_provider::conformance::spec;
use sandman_provider::{Endpoint, Provider, ProviderError};
use sandman_provider_process::{HOST_IMAGE, Isolation, ProcessProvider};
use sandman_testkit::eventually_async;
use serde_json::json;

/// A busy loop that counts, printing every 20000th number: its output says how far it got.
const COUNTER: &str = "i=0; while :; do i=$((i+1)); [ $((i % 20000)) -eq 0 ] && echo $i; done";

async fn start_counter(ep: &Endpoint, token: &str) {
    let body = json!({"argv": ["/bin/sh", "-c", COUNTER], "tag": "counter"});
    call(&socket_of(ep), "POST", "/v1/processes", Some(token), Some(body)).await.unwrap().ok();
}

/// The numbers the counter printed so far, in order.
async fn counts(ep: &Endpoint, token: &str) -> Vec<u64> {
    let path = "/v1/processes/counter/output?offset=0&stream=stdout";
    let chunk = call(&socket_of(ep), "GET", path, Some(token), None).await.unwrap().ok().json();
    let data = chunk["data"].as_str().unwrap_or_else(|| panic!("no data: {chunk}"));
    // The last line may be half written.
    data.lines().filter(|l| !l.is_empty()).filter_map(|l| l.parse::<u64>().ok()).collect()
}

/// Whether `seen` is the counter's own sequence, 20000, 40000, … with no gap and no restart.
fn one_run(seen: &[u64]) -> bool {
    seen.iter().enumerate().all(|(k, n)| *n == (k as u64 + 1) * 20000)
}

async fn usage(p: &ProcessProvider, id: &str) -> u64 {
    p.cpu_usage_usec(id).await.unwrap_or_else(|| panic!("sandbox `{id}` has no v2 cgroup to read"))
}

#[tokio::test]
async fn a_paused_sandbox_uses_no_cpu_keeps_its_processes_and_resume_continues_them() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = spec("pause-busy", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    start_counter(&ep, &s.token).await;
    let before = usage(&p, &s.id).await;
    assert!(
        eventually_async(Duration::from_secs(30), async || !counts(&ep, &s.token).await.is_empty()).await,
        "the counter never printed"
    );
    assert!(usage(&p, &s.id).await > before, "the busy loop used no CPU while running");

    let printed = counts(&ep, &s.token).await.len();
    p.pause(&s.id).await.unwrap();
    let frozen_at = usage(&p, &s.id).await;
    // Frozen: however long it stays so, no CPU is used and the counter stands still.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(usage(&p, &s.id).await, frozen_at, "a frozen sandbox used CPU");
    // Pausing again is fine; the list says it is paused.
    p.pause(&s.id).await.unwrap();
    let listed = p.list().await.unwrap();
    assert!(listed.iter().any(|r| r.spec.id == s.id && r.paused), "{listed:?}");

    p.resume(&s.id).await.unwrap();
    assert!(!p.list().await.unwrap().iter().any(|r| r.spec.id == s.id && r.paused));
    // The same process continues from where it stopped: its memory (the count) was kept, so
    // its output is one run, never a restart from the beginning.
    assert!(
        eventually_async(Duration::from_secs(30), async || counts(&ep, &s.token).await.len() > printed + 2).await,
        "the counter did not continue after the resume"
    );
    let seen = counts(&ep, &s.token).await;
    assert!(one_run(&seen), "the counter restarted or skipped: {seen:?}");
    let status = call(&socket_of(&ep), "GET", "/v1/processes/counter", Some(&s.token), None).await.unwrap().ok().json();
    assert_eq!(status["state"], "running", "{status}");
    assert!(usage(&p, &s.id).await > frozen_at, "no CPU used after the resume");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn a_paused_sandboxs_daemon_does_not_answer_until_resumed() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = spec("pause-daemon", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    p.pause(&s.id).await.unwrap();
    let asked = tokio::time::timeout(
        Duration::from_millis(300),
        call(&socket_of(&ep), "GET", "/v1/info", Some(&s.token), None),
    )
    .await;
    assert!(asked.is_err(), "a frozen daemon answered: {asked:?}");
    p.resume(&s.id).await.unwrap();
    let info = call(&socket_of(&ep), "GET", "/v1/info", Some(&s.token), None).await.unwrap().ok().json();
    assert!(info["version"].is_string(), "{info}");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn a_paused_sandbox_is_deleted_whole() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = spec("pause-rm", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    start_counter(&ep, &s.token).await;
    p.pause(&s.id).await.unwrap();
    p.delete(&s.id).await.unwrap();
    assert!(p.list().await.unwrap().is_empty());
    assert!(eventually(Duration::from_secs(10), || !common::dir_of(&ep).exists()).await);
    assert_eq!(p.pause(&s.id).await.err().map(|e| matches!(e, ProviderError::NotFound(_))), Some(true));
}

#[tokio::test]
async fn without_isolation_pausing_is_refused_with_the_reason() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    let s = spec("pause-none", HOST_IMAGE);
    let _ep = ready(&p, &s).await;
    match p.pause(&s.id).await {
        Err(ProviderError::Unsupported(m)) => assert!(m.contains("--isolation none") && m.contains("cgroup"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    p.delete(&s.id).await.unwrap();
}

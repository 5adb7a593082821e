//! Pause and resume on the docker provider: the engine's pause freezes the container (no CPU
//! used, its processes and their memory kept), unpause continues them, and a paused sandbox is
//! still deleted whole.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{BUSYBOX, State, call, id, inspect, socket_of, wait_healthy};
use sandman_provider::conformance::spec;
use sandman_provider::{Endpoint, Provider, ProviderError};
use sandman_testkit::eventually_async;
use serde_json::json;

/// A busy loop that counts, printing every 20000th number.
const COUNTER: &str = "i=0; while :; do i=$((i+1)); [ $((i % 20000)) -eq 0 ] && echo $i; done";

async fn counts(ep: &Endpoint, token: &str) -> Vec<u64> {
    let path = "/v1/processes/counter/output?offset=0&stream=stdout";
    let chunk = call(&socket_of(ep), "GET", path, Some(token), None).await.unwrap().ok().json();
    let data = chunk["data"].as_str().unwrap_or_else(|| panic!("no data: {chunk}"));
    data.lines().filter_map(|l| l.parse::<u64>().ok()).collect()
}

/// CPU time the container's processes used, in nanoseconds or microseconds (only compared),
/// from the cgroup of its init process: v1 `cpuacct.usage`, or v2 `cpu.stat`'s `usage_usec`.
fn cpu_usage(sandbox: &str) -> u64 {
    let pid = inspect(sandbox)["State"]["Pid"].as_u64().unwrap();
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        if controllers.split(',').any(|c| c == "cpuacct") {
            let file = format!("/sys/fs/cgroup/cpuacct{path}/cpuacct.usage");
            if let Ok(text) = std::fs::read_to_string(&file) {
                return text.trim().parse().unwrap();
            }
        }
        if controllers.is_empty() {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                if let Ok(stat) = std::fs::read_to_string(format!("{root}{path}/cpu.stat")) {
                    return stat.lines().find_map(|l| l.strip_prefix("usage_usec ")).unwrap().trim().parse().unwrap();
                }
            }
        }
    }
    panic!("no cpu accounting found for the container of `{sandbox}`: {cgroups}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_container_uses_no_cpu_keeps_its_processes_and_unpause_continues_them() {
    let state = State::new();
    let p = state.provider().await;
    let s = spec(&id("pause-busy"), BUSYBOX);
    let ep = p.create(&s).await.unwrap();
    wait_healthy(&socket_of(&ep)).await.unwrap();
    let body = json!({"argv": ["/bin/sh", "-c", COUNTER], "tag": "counter"});
    call(&socket_of(&ep), "POST", "/v1/processes", Some(&s.token), Some(body)).await.unwrap().ok();
    assert!(
        eventually_async(Duration::from_secs(30), async || !counts(&ep, &s.token).await.is_empty()).await,
        "the counter never printed"
    );

    let printed = counts(&ep, &s.token).await.len();
    p.pause(&s.id).await.unwrap();
    assert_eq!(inspect(&s.id)["State"]["Paused"], true);
    let frozen_at = cpu_usage(&s.id);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(cpu_usage(&s.id), frozen_at, "a paused container used CPU");
    // Pausing again is fine; the list says it is paused, and not ended.
    p.pause(&s.id).await.unwrap();
    let listed = p.list().await.unwrap();
    assert!(listed.iter().any(|r| r.spec.id == s.id && r.paused && r.ended.is_none()), "{listed:?}");

    p.resume(&s.id).await.unwrap();
    p.resume(&s.id).await.unwrap();
    assert!(
        eventually_async(Duration::from_secs(30), async || counts(&ep, &s.token).await.len() > printed + 2).await,
        "the counter did not continue after the unpause"
    );
    let seen = counts(&ep, &s.token).await;
    assert!(seen.iter().enumerate().all(|(k, n)| *n == (k as u64 + 1) * 20000), "restarted or skipped: {seen:?}");
    assert!(cpu_usage(&s.id) > frozen_at, "no CPU used after the unpause");

    // A paused sandbox is removed whole.
    p.pause(&s.id).await.unwrap();
    p.delete(&s.id).await.unwrap();
    assert!(state.containers().is_empty(), "{:?}", state.containers());
    assert!(matches!(p.pause(&s.id).await, Err(ProviderError::NotFound(_))));
}

//! Crash-safe creation: `kill -9` of `sandman serve` (process provider, no admission limit) at
//! several moments of a burst of keyed creates, a restart, and a retry of every key. Every key
//! must end with one ready sandbox or a reason; after the job is released nothing of it may be
//! left: no process, directory, cgroup or mount.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use e2e::{Http, Server, eventually, processes_mentioning, scratch};
use serde_json::{Value, json};

/// More sandboxes at once than the machine's memory admits with the default memory limit: the
/// servers run with `--memory-overcommit 0`, since what this is about is keys, not memory.
const CREATES: usize = 300;

/// One create of the burst: the key's own label lets the test count its sandboxes.
fn request(job: &str, key: &str) -> Value {
    json!({"image": "host", "job": job, "idempotency_key": key, "labels": {"key": key}, "lease_s": 300})
}

/// What a create answered: the sandbox's id when ready, else the error.
async fn create(http: &Http, body: Value) -> Result<String, Value> {
    let resp = http.post("/v1/sandboxes", body).await;
    let v: Value = serde_json::from_slice(&resp.body).unwrap_or(Value::Null);
    if resp.status == 200 && v["state"] == "ready" { Ok(v["id"].as_str().unwrap().to_string()) } else { Err(v) }
}

/// Sandboxes of the host's cgroup hierarchies named after sandman sandboxes of `ids`.
fn cgroups_of(ids: &[String]) -> Vec<String> {
    let out = Command::new("find").args(["/sys/fs/cgroup", "-maxdepth", "5", "-name", "sandman-*"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| ids.iter().any(|id| l.ends_with(&format!("sandman-{id}"))))
        .map(str::to_string)
        .collect()
}

/// One round: the burst, a `kill -9` after `after`, a restart, the retries, the release.
async fn round(state: &Path, job: &str, after: Duration) -> BTreeMap<&'static str, usize> {
    let server = Server::start_in(state, &["--create-rate", "0", "--memory-overcommit", "0"]);
    let http = server.client();
    let keys: Vec<String> = (0..CREATES).map(|i| format!("{job}-{i}")).collect();
    let mut burst = Vec::new();
    for key in &keys {
        let (http, body) = (http.clone(), request(job, key));
        // The connection dies with the server: each create ends with whatever it got.
        burst.push(tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(60), async {
                let stream = tokio::net::TcpStream::connect(&http.addr).await.ok()?;
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
                tokio::spawn(conn);
                let req = hyper::Request::post("/v1/sandboxes")
                    .header("authorization", format!("Bearer {}", e2e::TOKEN))
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
                    .unwrap();
                sender.send_request(req).await.ok().map(|r| r.status().as_u16())
            })
            .await
            .ok()
            .flatten()
        }));
    }
    tokio::time::sleep(after).await;
    let dirs_at_kill = server.sandbox_dirs().len();
    let mut server = server;
    server.kill9();
    let mut answered_before = 0;
    for b in burst {
        if b.await.unwrap() == Some(200) {
            answered_before += 1;
        }
    }

    let server = Server::start_in(state, &["--create-rate", "0", "--memory-overcommit", "0"]);
    let http = server.client();
    let mut retries = Vec::new();
    for key in &keys {
        let (http, body) = (http.clone(), request(job, key));
        retries.push(tokio::spawn(async move { create(&http, body).await }));
    }
    let mut ready: HashMap<String, String> = HashMap::new();
    let mut reasons = 0;
    for (key, r) in keys.iter().zip(retries) {
        match r.await.unwrap() {
            Ok(id) => {
                ready.insert(key.clone(), id);
            }
            Err(e) => {
                let reason = e["error"]["reason"].as_str().unwrap_or_default();
                assert!(!reason.is_empty(), "key {key}: an error without a reason: {e}");
                reasons += 1;
            }
        }
    }
    let failed = http.get(&format!("/v1/sandboxes?job={job}&state=failed")).await.ok();
    let interrupted =
        failed["sandboxes"].as_array().unwrap().iter().filter(|s| s["reason"] == "create_interrupted").count();
    // One sandbox per key, answering; the same one on a second retry.
    let live = http.get(&format!("/v1/sandboxes?job={job}&state=ready")).await.ok();
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for sb in live["sandboxes"].as_array().unwrap() {
        *per_key.entry(sb["labels"]["key"].as_str().unwrap().to_string()).or_default() += 1;
    }
    assert!(per_key.values().all(|n| *n == 1), "a key has several live sandboxes: {per_key:?}");
    assert_eq!(per_key.len(), ready.len(), "live sandboxes and ready answers disagree");
    for (key, id) in ready.iter().take(20) {
        assert_eq!(create(&http, request(job, key)).await.as_deref(), Ok(id.as_str()), "key {key}");
        let out = http.exec(id, json!({"argv": ["/bin/echo", "alive"]})).await;
        assert_eq!(out["stdout"], "alive\n", "{out}");
    }
    // Every directory is a sandbox the server knows.
    let listed: Vec<String> = http.get("/v1/sandboxes").await.ok()["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    for dir in server.sandbox_dirs() {
        assert!(listed.contains(&dir), "a directory the server does not know: {dir}");
    }

    let deleted = http.call("DELETE", &format!("/v1/jobs/{job}"), e2e::Body::Empty).await;
    assert_eq!(deleted.status, 200, "{}", String::from_utf8_lossy(&deleted.body));
    let sandboxes = state.join("sandboxes");
    let gone = eventually(Duration::from_secs(60), async || {
        processes_mentioning(&sandboxes.display().to_string()).is_empty() && server.sandbox_dirs().is_empty()
    })
    .await;
    assert!(
        gone,
        "left after the release: processes {:?}, directories {:?}",
        processes_mentioning(&sandboxes.display().to_string()),
        server.sandbox_dirs()
    );
    let all_ids: Vec<String> = listed.into_iter().chain(ready.values().cloned()).collect();
    assert!(cgroups_of(&all_ids).is_empty(), "cgroups left: {:?}", cgroups_of(&all_ids));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    // Nothing of a sandbox's (the tmpfs its directories are on is the server's, while it runs).
    assert!(!mounts.contains(&format!("{}/", sandboxes.display())), "mounts left on the host");
    BTreeMap::from([
        ("1 answered before the kill", answered_before),
        ("2 directories at the kill", dirs_at_kill),
        ("3 found interrupted", interrupted),
        ("4 ready after the retry", ready.len()),
        ("5 answered a reason", reasons),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_a_keyed_burst_leaves_every_key_served_and_nothing_behind() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let euid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|u| u.split_whitespace().nth(1));
    assert_eq!(euid, Some("0"), "this test needs root, as CI and scripts/test have");
    // How long the whole burst takes here, then five moments across it, from before the first
    // daemon starts to near its end; a seed from the clock moves them a little on each run,
    // printed to replay one.
    let calibration = tempfile::tempdir_in(scratch()).unwrap();
    let took = {
        let server =
            Server::start_in(&calibration.path().join("state"), &["--create-rate", "0", "--memory-overcommit", "0"]);
        let http = server.client();
        let start = std::time::Instant::now();
        let burst: Vec<_> = (0..CREATES)
            .map(|i| {
                let http = http.clone();
                tokio::spawn(async move { create(&http, request("calibrate", &format!("c-{i}"))).await.is_ok() })
            })
            .collect();
        for b in burst {
            assert!(b.await.unwrap(), "a create of the calibration burst failed");
        }
        let took = start.elapsed();
        http.call("DELETE", "/v1/jobs/calibrate", e2e::Body::Empty).await;
        took
    };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_millis() as u64;
    let points: Vec<Duration> = [0.02, 0.2, 0.45, 0.7, 0.9]
        .iter()
        .enumerate()
        .map(|(i, f)| took.mul_f64(*f) + Duration::from_millis((seed * (i as u64 + 7)) % 97))
        .collect();
    eprintln!("a burst of {CREATES} takes {took:?}; kill -9 points (seed {seed}): {points:?}");
    for (i, after) in points.into_iter().enumerate() {
        let dir = tempfile::tempdir_in(scratch()).unwrap();
        let state = dir.path().join("state");
        let figures = round(&state, &format!("crash{i}"), after).await;
        eprintln!("kill -9 after {after:?}: {figures:?}");
    }
}

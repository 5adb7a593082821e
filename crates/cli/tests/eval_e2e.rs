//! Evaluation under recorded conditions through the real `sandman serve` (process provider,
//! real daemons): signed conditions records and their verification, the `eval` profile, usage
//! on every exec, and the determinism check.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::time::Duration;

use e2e::{Server, cli, eventually};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditions_are_recorded_signed_verified_and_kept_after_release() {
    let server = Server::start();
    let http = server.client();
    let sb = http.create(json!({"image": "host", "job": "cond"})).await;
    let id = sb["id"].as_str().unwrap().to_string();
    let signed = http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok();
    let record = &signed["record"];
    assert_eq!(record["sandbox"], id.as_str());
    assert_eq!((record["provider"].as_str(), record["asked"]["profile"].as_str()), (Some("process"), Some("default")));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(record["observed"]["kernel"], kernel.trim());
    assert!(!record["observed"]["daemon_version"].as_str().unwrap().is_empty());
    assert!(signed["signature"].as_str().unwrap().starts_with("hmac-sha256:"), "{signed}");
    // Asked again, the same record.
    assert_eq!(http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok(), signed);

    // Verified by the server, by the CLI through the server, and offline with the key file.
    let v = http.post("/v1/verify", signed.clone()).await.ok();
    assert_eq!(v, json!({"valid": true}));
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let file = dir.path().join("conditions.json");
    std::fs::write(&file, serde_json::to_string_pretty(&signed).unwrap()).unwrap();
    let (code, out, _) = cli(&server, &["verify", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("valid"), "{out}");
    let key = server.state.join("conditions.key");
    let (code, out, _) = cli(&server, &["verify", "--key-file", key.to_str().unwrap(), file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");

    // One changed figure and the record no longer verifies, anywhere.
    let mut tampered = signed.clone();
    tampered["record"]["observed"]["cgroup_memory_limit"] = json!(1u64 << 40);
    let bad = dir.path().join("tampered.json");
    std::fs::write(&bad, serde_json::to_string(&tampered).unwrap()).unwrap();
    let (code, out, _) = cli(&server, &["verify", bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("changed after signing"), "{out}");
    let (code, _, _) = cli(&server, &["verify", "--key-file", key.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_eq!(http.post("/v1/verify", tampered).await.ok()["valid"], false);

    // The record is kept with the accounting record after release.
    http.release(&id).await.ok();
    let accounting = server.state.join("accounting.jsonl");
    let kept = || {
        std::fs::read_to_string(&accounting)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|r| r["sandbox"] == id.as_str())
    };
    assert!(eventually(Duration::from_secs(10), async || kept().is_some()).await);
    assert_eq!(kept().unwrap()["conditions"], signed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_sandbox_runs_under_the_conditions_it_asked_for() {
    let server = Server::start();
    let http = server.client();
    let asked = json!({"cpu": 0.5, "memory": "256Mi", "pids": 128});
    let sb = http.create(json!({"image": "host", "profile": "eval", "resources": asked, "job": "ev"})).await;
    assert_eq!(sb["state"], "ready", "{sb}");
    let id = sb["id"].as_str().unwrap().to_string();
    let signed = http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok();
    let record = &signed["record"];
    assert_eq!(record["mismatches"], json!([]), "{record}");
    let observed = &record["observed"];
    assert_eq!(observed["cgroup_cpu_limit"], 0.5, "{observed}");
    assert_eq!(observed["cgroup_memory_limit"], 256u64 << 20, "{observed}");
    assert_eq!(observed["cgroup_swap_limit"], 0, "{observed}");
    assert_eq!(observed["cgroup_pids_limit"], 128, "{observed}");
    assert_eq!(observed["network_interfaces"], json!(["lo"]), "{observed}");
    assert_eq!((observed["timezone"].as_str(), observed["locale"].as_str()), (Some("UTC"), Some("C.UTF-8")));

    // Every command sees the fixed environment, and every result carries its usage.
    let env = http.exec(&id, json!({"argv": ["env"]})).await;
    let stdout = env["stdout"].as_str().unwrap();
    assert!(stdout.lines().any(|l| l == "TZ=UTC") && stdout.lines().any(|l| l == "LC_ALL=C.UTF-8"), "{stdout}");
    let busy = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo $i";
    let r = http.exec(&id, json!({"command": busy})).await;
    assert_eq!(r["stdout"], "300000\n", "{r}");
    let cpu = r["usage"]["cpu_user_ms"].as_u64().unwrap() + r["usage"]["cpu_system_ms"].as_u64().unwrap();
    assert!(cpu > 0 && r["usage"]["max_rss_kib"].as_u64().unwrap() > 0, "{r}");
    assert!(r["duration_ms"].as_u64().unwrap() > 0, "{r}");

    // A command may not change what eval fixes.
    let r =
        http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["date"], "env": {"TZ": "Asia/Tokyo"}})).await;
    assert!(r.error(400, "invalid_argument")["message"].as_str().unwrap().contains("TZ=Asia/Tokyo"));

    // What eval cannot do without is refused, naming it.
    let refused =
        http.post("/v1/sandboxes", json!({"image": "host", "profile": "eval", "resources": {"cpu": 1}})).await;
    let message = refused.error(400, "invalid_argument")["message"].as_str().unwrap().to_string();
    assert!(message.contains("memory"), "{message}");
    let refused = http
        .post(
            "/v1/sandboxes",
            json!({"image": "host", "profile": "eval", "resources": asked, "env": {"TZ": "Asia/Tokyo"}}),
        )
        .await;
    let message = refused.error(400, "invalid_argument")["message"].as_str().unwrap().to_string();
    assert!(message.contains("TZ=Asia/Tokyo"), "{message}");
    http.release(&id).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_determinism_check_flags_time_and_randomness_and_passes_a_pure_task() {
    let server = Server::start();
    let (code, out, err) = cli(&server, &["determinism", "host", "-n", "3", "--", "sh", "-c", "date +%s%N"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("differ: 3 runs gave 3 distinct results (stdout differs)"), "{out}");
    let random = "head -c 16 /dev/urandom | od -An -tx1";
    let (code, out, err) = cli(&server, &["determinism", "host", "-n", "3", "--parallel", "3", "-c", "--", random]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("differ"), "{out}");
    let (code, out, err) =
        cli(&server, &["determinism", "host", "-n", "3", "--json", "--", "sh", "-c", "echo $((6*7))"]);
    assert_eq!(code, 0, "{out}{err}");
    let verdict: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((verdict["agree"].as_bool(), verdict["distinct"].as_u64()), (Some(true), Some(1)), "{verdict}");
    let runs = verdict["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    // Each run had a sandbox of its own, and none is left.
    let ids: std::collections::HashSet<&str> = runs.iter().map(|r| r["sandbox"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 3);
    assert!(eventually(Duration::from_secs(10), async || server.sandbox_dirs().is_empty()).await);
    // Fewer than two runs compare nothing.
    let (code, _, err) = cli(&server, &["determinism", "host", "-n", "1", "--", "true"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("at least 2"), "{err}");
}

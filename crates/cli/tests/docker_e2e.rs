//! End to end through `sandman serve --provider docker`: the real server, the real Docker engine
//! and the static `sandmand`, over plain HTTP. Any image (one without a shell), the image's env and
//! workdir, a failed pull, a refusal, recovery after `kill -9`, a death, and nothing left behind.
//! Docker must be running (these tests fail without it; ./scripts/test starts it).
#![allow(clippy::unwrap_used)]

mod e2e;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::docker::{Cleanup, containers_of, docker, require_docker, static_daemon};
use e2e::{Server, eventually};
use serde_json::{Value, json};

const BUSYBOX: &str = "sandman-test/busybox:latest";
const NOSHELL: &str = "sandman-test/noshell:latest";
const MISSING: &str = "sandman-test/does-not-exist:latest";

fn start(state: &Path) -> Server {
    let daemon = static_daemon();
    Server::start_in(state, &["--provider", "docker", "--daemon", daemon.to_str().unwrap()])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandman_serve_runs_unmodified_images_through_docker() {
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let mut server = start(&state);
    let http = server.client();

    let sb = http.create(json!({"image": BUSYBOX, "job": "e2e-docker", "resources": {"memory": "64Mi"}})).await;
    assert_eq!((sb["state"].as_str(), sb["provider"].as_str()), (Some("ready"), Some("docker")), "{sb}");
    let id = sb["id"].as_str().unwrap().to_string();
    let out = http.exec(&id, json!({"argv": ["sh", "-c", "echo $FROM_IMAGE; pwd"]})).await;
    assert_eq!(out["stdout"], "busybox\n/work\n", "{out}");
    assert_eq!(containers_of(&id).len(), 1);

    // An image with no shell at all.
    let bare = http.create(json!({"image": NOSHELL})).await;
    let bare_id = bare["id"].as_str().unwrap().to_string();
    let hello = http.exec(&bare_id, json!({"argv": ["/hello"]})).await;
    assert_eq!(hello["stdout"], "hello from noshell\n", "{hello}");

    // A pull that cannot succeed fails at once with its reason; eval without fixed resources is
    // refused before anything.
    let started = Instant::now();
    let pulled = http.post("/v1/sandboxes", json!({"image": MISSING})).await;
    let err = pulled.error(400, "invalid_argument");
    assert_eq!(err["reason"], "image_pull_failed", "{err}");
    assert!(err["message"].as_str().unwrap().contains(MISSING), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "the failed pull took {:?}", started.elapsed());
    let eval = http.post("/v1/sandboxes", json!({"image": BUSYBOX, "profile": "eval"})).await;
    let message = eval.error(400, "invalid_argument")["message"].as_str().unwrap().to_string();
    assert!(message.contains("resources.cpu and resources.memory"), "{message}");

    // An eval sandbox: ready only with conditions that match, recorded, signed and verifiable.
    let resources = json!({"cpu": "500m", "memory": "64Mi", "pids": 100});
    let eval = http.create(json!({"image": BUSYBOX, "profile": "eval", "resources": resources})).await;
    let eval_id = eval["id"].as_str().unwrap().to_string();
    let signed = http.get(&format!("/v1/sandboxes/{eval_id}/conditions")).await.ok();
    let record = &signed["record"];
    assert_eq!(record["mismatches"], json!([]), "{record}");
    assert!(record["applied"]["image"].as_str().unwrap().starts_with("sha256:"), "{record}");
    assert_eq!(record["observed"]["network_interfaces"], json!(["lo"]), "{record}");
    assert_eq!(record["observed"]["cgroup_memory_limit"], 64u64 << 20, "{record}");
    assert_eq!(record["observed"]["cgroup_cpu_limit"], 0.5, "{record}");
    assert_eq!(record["observed"]["cgroup_pids_limit"], 100, "{record}");
    assert_eq!(record["observed"]["timezone"], "UTC", "{record}");
    assert_eq!(http.post("/v1/verify", signed.clone()).await.ok()["valid"], true);
    http.release(&eval_id).await.ok();

    // kill -9 of the server: a new one finds both sandboxes in the containers' labels.
    let wrote = http.exec(&id, json!({"argv": ["sh", "-c", "echo kept > /tmp/state"]})).await;
    assert_eq!(wrote["exit_code"], 0);
    server.kill9();
    let server = start(&state);
    let http = server.client();
    let again = http.get(&format!("/v1/sandboxes/{id}")).await.ok();
    assert_eq!((again["state"].as_str(), again["job"].as_str()), (Some("ready"), Some("e2e-docker")), "{again}");
    let kept = http.exec(&id, json!({"argv": ["cat", "/tmp/state"]})).await;
    assert_eq!(kept["stdout"], "kept\n");

    // A container killed behind the server's back turns its sandbox failed, with the reason.
    docker(&["kill", &format!("sandman-{bare_id}")]);
    let failed = eventually(Duration::from_secs(20), async || {
        let v: Value = http.get(&format!("/v1/sandboxes/{bare_id}")).await.json();
        v["state"] == "failed"
    })
    .await;
    assert!(failed, "the killed sandbox is not failed");
    let dead: Value = http.get(&format!("/v1/sandboxes/{bare_id}")).await.json();
    assert_eq!(dead["reason"], "provider_error", "{dead}");
    assert!(dead["message"].as_str().unwrap().contains("signal 9"), "{dead}");

    // Released: nothing is left in the engine or the state directory.
    http.release(&id).await.ok();
    assert!(containers_of(&id).is_empty(), "the released sandbox's container is left");
    assert!(containers_of(&bare_id).is_empty(), "the failed sandbox's container is left");
    let left: Vec<_> = std::fs::read_dir(state.join("docker")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "host directories left: {left:?}");
}

#[test]
fn serve_refuses_a_dynamic_daemon_for_docker_and_says_how_to_build_the_static_one() {
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    // The debug `sandman` itself: dynamically linked, like a debug `sandmand`.
    let out = Command::new(e2e::sandman_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--provider", "docker", "--state-dir"])
        .arg(dir.path())
        .arg("--daemon")
        .arg(e2e::sandman_bin())
        .env("SANDMAN_TOKEN", e2e::TOKEN)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("dynamically linked") && stderr.contains("./scripts/build-daemon"), "{stderr}");
}

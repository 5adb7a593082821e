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
use e2e::{Body, Server, eventually};
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

const BUSYBOX_USER: &str = "sandman-test/busybox-user:latest";

/// Harbor's docker backend runs as the image's `USER`: so does a docker sandbox, unless its
/// create names another user; the image's config is in the sandbox's info either way. A terminal
/// works in a container (its `/dev/pts`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_images_user_is_the_default_and_its_config_is_shown() {
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let server = start(&state);
    let http = server.client();

    let sb = http.create(json!({"image": BUSYBOX_USER})).await;
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(sb["user"], "nobody", "{sb}");
    let config = &sb["image_config"];
    assert_eq!((config["user"].as_str(), config["workdir"].as_str()), (Some("nobody"), Some("/work")), "{sb}");
    assert_eq!(config["env"]["FROM_IMAGE"], "busybox");
    assert_eq!(config["cmd"], json!(["sh"]));
    assert_eq!(http.get(&format!("/v1/sandboxes/{id}")).await.ok()["user"], "nobody");
    let out = http.exec(&id, json!({"argv": ["id", "-u"]})).await;
    assert_eq!(out["stdout"], "65534\n", "{out}");
    let root = http.exec(&id, json!({"argv": ["id", "-u"], "user": "0"})).await;
    assert_eq!(root["stdout"], "0\n", "a call's own user wins: {root}");
    let session = http.post(&format!("/v1/sandboxes/{id}/sessions"), json!({})).await.ok();
    let sid = session["id"].as_str().unwrap();
    let r = http.post(&format!("/v1/sandboxes/{id}/sessions/{sid}/run"), json!({"command": "id -u"})).await.ok();
    assert_eq!(r["stdout"], "65534\n", "{r}");
    // Files the calls write belong to the default user too, as its commands' would, and a
    // directory made by hand as well.
    let wrote = http.put(&format!("/v1/sandboxes/{id}/files?path=/work/up/f.txt"), &b"mine\n"[..]).await.ok();
    assert_eq!((wrote["uid"].as_u64(), wrote["gid"].as_u64()), (Some(65534), Some(65534)), "{wrote}");
    http.call("POST", &format!("/v1/sandboxes/{id}/dir?path=/work/made"), Body::Empty).await.ok();
    let owners =
        http.exec(&id, json!({"command": "stat -c '%u:%g' /work/up /work/made && echo more >> /work/up/f.txt"})).await;
    assert_eq!(
        (owners["stdout"].as_str(), owners["exit_code"].as_i64()),
        (Some("65534:65534\n65534:65534\n"), Some(0)),
        "{owners}"
    );

    // A terminal in the container.
    let p = http
        .post(
            &format!("/v1/sandboxes/{id}/processes"),
            json!({"argv": ["sh"], "pty": {"rows": 30, "cols": 90}, "tag": "t"}),
        )
        .await
        .ok();
    assert_eq!(p["pty"], json!({"rows": 30, "cols": 90}));
    http.post(&format!("/v1/sandboxes/{id}/processes/t/stdin"), json!({"data": "stty size; tty; exit 4\n"})).await.ok();
    let waited = http.post(&format!("/v1/sandboxes/{id}/processes/t/wait"), json!({"timeout_ms": 20000})).await.ok();
    assert_eq!(waited["exit"]["exit_code"], 4, "{waited}");
    let out = http.get(&format!("/v1/sandboxes/{id}/processes/t/output")).await.ok();
    let text = out["data"].as_str().unwrap();
    assert!(text.contains("30 90\r\n") && text.contains("/dev/pts/"), "{text:?}");

    let named = http.create(json!({"image": BUSYBOX_USER, "user": "root"})).await;
    let named_id = named["id"].as_str().unwrap().to_string();
    assert_eq!(named["user"], "root");
    assert_eq!(http.exec(&named_id, json!({"argv": ["id", "-u"]})).await["stdout"], "0\n");

    // An image with no USER runs as root, as before, with no default user shown.
    let plain = http.create(json!({"image": BUSYBOX})).await;
    assert!(plain.get("user").is_none() || plain["user"] == "root", "{plain}");
    for sandbox in [id, named_id, plain["id"].as_str().unwrap().to_string()] {
        http.release(&sandbox).await;
    }
}

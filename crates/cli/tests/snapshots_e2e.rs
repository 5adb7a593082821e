//! Snapshots and forks through the real server, on the process provider (isolated, an image
//! pulled from a registry the test starts on 127.0.0.1) and on the docker provider: the files
//! written before a snapshot are in every fork, each fork's later writes are its own, deleting
//! the source breaks none of its forks, processes are not kept, and a job's snapshots go with it.
//! Also the CLI's `snapshot` and `fork`, and the kubernetes provider's refusal.
#![allow(clippy::unwrap_used)]

mod e2e;

use e2e::docker::{Cleanup, require_docker, static_daemon};
use e2e::{Body, Http, Server, cli, scratch};
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage, busybox_layer, host_arch};
use sandman_testkit::require_root;
use serde_json::{Value, json};

fn app_image() -> TestImage {
    let app = LayerBuilder::new()
        .dir("srv")
        .dir("srv/app")
        .file("srv/app/hello.txt", b"hi\n")
        .dir("srv/old")
        .file("srv/old/stale.txt", b"stale\n")
        .build(Compression::Gzip);
    TestImage::with_config(vec![busybox_layer(), app], host_arch(), json!({"Env": ["PATH=/bin:/usr/bin"]}))
}

async fn sh(http: &Http, id: &str, command: &str) -> Value {
    let r = http.exec(id, json!({"command": command})).await;
    assert_eq!(r["exit_code"], 0, "`{command}` in {id}: {r}");
    r
}

async fn stdout(http: &Http, id: &str, command: &str) -> String {
    sh(http, id, command).await["stdout"].as_str().unwrap().to_string()
}

/// The scenario both providers pass: a source with files, deletions, a recreated directory and a
/// background process; a fork of three; each child's writes its own; the source released.
async fn forks_share_the_past_and_keep_their_own_future(http: &Http, image: &str, job: &str) -> Vec<String> {
    let source = http.create(json!({"image": image, "job": job, "labels": {"kind": "source"}})).await;
    assert_eq!(source["state"], "ready", "{source}");
    let src = source["id"].as_str().unwrap().to_string();
    sh(
        http,
        &src,
        "mkdir -p /data && echo base > /data/a.txt && head -c 300000 /dev/urandom > /data/big && \
         ln /data/a.txt /data/a-link && ln -s a.txt /data/a-sym && \
         rm -f /srv/app/hello.txt && rm -rf /srv/old && mkdir /srv/old && echo new > /srv/old/fresh.txt && \
         md5sum /data/big > /data/big.md5",
    )
    .await;
    let started =
        http.post(&format!("/v1/sandboxes/{src}/processes"), json!({"command": "sleep 1000", "tag": "bg"})).await;
    assert!(started.status < 300, "{}", String::from_utf8_lossy(&started.body));

    let forked = http.post(&format!("/v1/sandboxes/{src}/fork"), json!({"count": 3, "name": "prepared"})).await.ok();
    let snapshot = forked["snapshot"].clone();
    assert_eq!(snapshot["source"], src.as_str(), "{forked}");
    assert_eq!(snapshot["job"], job, "{forked}");
    assert_eq!(snapshot["name"], "prepared", "{forked}");
    let kids: Vec<String> =
        forked["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(kids.len(), 3, "{forked}");
    for kid in forked["sandboxes"].as_array().unwrap() {
        assert_eq!(kid["state"], "ready", "{kid}");
        assert_eq!(kid["job"], job, "the source's job: {kid}");
        assert_eq!(kid["labels"]["kind"], "source", "the source's labels: {kid}");
        assert_eq!(kid["image"], snapshot["image"], "{kid}");
    }

    // What the source wrote, deleted and replaced before the snapshot, every child has.
    for kid in &kids {
        let seen = stdout(
            http,
            kid,
            "cat /data/a.txt /data/a-sym; stat -c %h /data/a-link; md5sum -c /data/big.md5 >/dev/null && echo big-ok; \
             test -e /srv/app/hello.txt && echo hello-still-there; ls /srv/old; ls /srv/app",
        )
        .await;
        assert_eq!(seen, "base\nbase\n2\nbig-ok\nfresh.txt\n", "child {kid} sees: {seen:?}");
        // Files, not processes.
        let procs = http.get(&format!("/v1/sandboxes/{kid}/processes")).await.ok();
        assert!(!procs.to_string().contains("sleep 1000"), "a process came along: {procs}");
    }

    // Each child's writes are its own: no sibling and not the source sees them.
    for kid in &kids {
        sh(http, kid, &format!("echo {kid} > /data/own.txt && echo {kid} >> /data/a.txt")).await;
    }
    for kid in &kids {
        assert_eq!(stdout(http, kid, "cat /data/own.txt").await, format!("{kid}\n"));
        assert_eq!(stdout(http, kid, "cat /data/a.txt").await, format!("base\n{kid}\n"));
    }
    assert_eq!(stdout(http, &src, "cat /data/a.txt; ls /data").await, "base\na-link\na-sym\na.txt\nbig\nbig.md5\n");

    // The source goes; its forks live on, and new sandboxes start from the snapshot still.
    http.release(&src).await.ok();
    for kid in &kids {
        assert_eq!(stdout(http, kid, "cat /data/own.txt").await, format!("{kid}\n"));
    }
    let again = http.create(json!({"image": snapshot["image"], "job": job})).await;
    assert_eq!(again["state"], "ready", "{again}");
    let again_id = again["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(http, &again_id, "cat /data/a.txt").await, "base\n");
    let mut all = kids;
    all.push(again_id);
    all
}

/// The job's snapshot pushed to a registry as an image, and a sandbox started from that image:
/// what another machine, or the kubernetes provider, would do.
async fn an_exported_snapshot_runs_elsewhere(http: &Http, job: &str, registry: &Registry) {
    let listed = http.get(&format!("/v1/snapshots?job={job}")).await.ok();
    let snap_id = listed["snapshots"][0]["id"].as_str().unwrap().to_string();
    let reference = registry.reference("snap/exported", "1");
    let pushed = http.post(&format!("/v1/snapshots/{snap_id}/export"), json!({"reference": reference})).await.ok();
    assert!(pushed["digest"].as_str().unwrap().starts_with("sha256:"), "{pushed}");
    let elsewhere = http.create(json!({"image": reference})).await;
    assert_eq!(elsewhere["state"], "ready", "{elsewhere}");
    let id = elsewhere["id"].as_str().unwrap().to_string();
    assert_eq!(
        stdout(http, &id, "cat /data/a.txt; ls /srv/old; test -e /srv/app/hello.txt || echo gone").await,
        "base\nfresh.txt\ngone\n"
    );
    http.release(&id).await.ok();
}

/// Listed, then gone with the job: a create from it is refused with `not_found`.
async fn the_jobs_end_takes_its_snapshots(http: &Http, job: &str) {
    let listed = http.get(&format!("/v1/snapshots?job={job}")).await.ok();
    let snaps = listed["snapshots"].as_array().unwrap().clone();
    assert_eq!(snaps.len(), 1, "{listed}");
    let snap_id = snaps[0]["id"].as_str().unwrap().to_string();
    assert_eq!(http.get(&format!("/v1/snapshots/{snap_id}")).await.ok()["id"], snap_id.as_str());
    let deleted = http.call("DELETE", &format!("/v1/jobs/{job}"), Body::Empty).await.ok();
    assert!(deleted["sandboxes"].as_u64().unwrap() >= 1, "{deleted}");
    http.get(&format!("/v1/snapshots/{snap_id}")).await.error(404, "not_found");
    let refused = http.post("/v1/sandboxes", json!({"image": format!("snapshot:{snap_id}")})).await;
    let err = refused.error(404, "not_found");
    assert!(err["message"].as_str().unwrap().contains(&snap_id), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_provider_forks_share_a_snapshot_layer_and_keep_their_writes_apart() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    registry.push("test/app", "1", &app_image()).await;
    let image = registry.reference("test/app", "1");
    let server = Server::start_in(&dir.path().join("state"), &[]);
    let http = server.client();

    forks_share_the_past_and_keep_their_own_future(&http, &image, "snap-e2e").await;
    // One snapshot layer in the store, shared: the image is listed once, run by four sandboxes.
    let images = http.get("/v1/images").await.ok();
    let snap_image = images["images"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["references"].to_string().contains("sandman.snapshot/"))
        .cloned()
        .unwrap_or_else(|| panic!("no snapshot image in the store: {images}"));
    assert_eq!(snap_image["sandboxes"], 4, "{snap_image}");
    assert_eq!(snap_image["layers"], 3, "the image's two layers and the snapshot's: {snap_image}");
    an_exported_snapshot_runs_elsewhere(&http, "snap-e2e", &registry).await;

    the_jobs_end_takes_its_snapshots(&http, "snap-e2e").await;
    // With no sandbox left on it, the snapshot's image has left the store.
    let left = http.get("/v1/images").await.ok();
    assert!(!left.to_string().contains("sandman.snapshot/"), "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_takes_lists_forks_from_and_removes_snapshots() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    registry.push("test/app", "1", &app_image()).await;
    let image = registry.reference("test/app", "1");
    let server = Server::start_in(&dir.path().join("state"), &[]);
    let http = server.client();
    let src = http.create(json!({"image": image})).await["id"].as_str().unwrap().to_string();
    sh(&http, &src, "echo from-cli > /srv/app/note.txt").await;
    // The layer the daemon keeps open for snapshots is not the sandbox's to reach (its daemon is
    // undumpable): above it are the image's layers, shared by other sandboxes.
    let reach = "ls /proc/1/fd/999/ >/dev/null 2>&1 && echo reachable || echo unreachable";
    assert_eq!(stdout(&http, &src, reach).await, "unreachable\n");

    let (code, out, err) = cli(&server, &["snapshot", "create", &src, "--name", "cli"]);
    assert_eq!(code, 0, "{out}{err}");
    let snap = out.trim().to_string();
    assert!(snap.starts_with("snap-"), "{out}");
    let (code, out, err) = cli(&server, &["snapshot", "ls"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&snap) && out.contains("cli") && out.contains(&src), "{out}");
    let (code, out, err) = cli(&server, &["create", &format!("snapshot:{snap}")]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(stdout(&http, out.trim(), "cat /srv/app/note.txt").await, "from-cli\n");

    let (code, out, err) = cli(&server, &["fork", &src, "-n", "2"]);
    assert_eq!(code, 0, "{out}{err}");
    let kids: Vec<&str> = out.lines().collect();
    assert_eq!(kids.len(), 2, "{out}");
    assert!(err.contains("snapshot snap-"), "{err}");
    for kid in kids {
        assert_eq!(stdout(&http, kid, "cat /srv/app/note.txt").await, "from-cli\n");
    }

    let (code, out, err) = cli(&server, &["snapshot", "rm", &snap]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = cli(&server, &["snapshot", "get", &snap]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("no snapshot"), "{err}");
    // A snapshot of `host` is refused, saying why.
    let host = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    let refused = http.post(&format!("/v1/sandboxes/{host}/snapshots"), json!({})).await;
    let err = refused.error(400, "invalid_argument");
    assert!(err["message"].as_str().unwrap().contains("host"), "{err}");
}

/// Removes, however the test ends, the engine's images it made: the snapshots (labelled with the
/// server's owner, its docker state directory) and the exported image the engine pulled.
struct EngineImages {
    owner: std::path::PathBuf,
    pulled: String,
}

impl Drop for EngineImages {
    fn drop(&mut self) {
        let label = format!("label=sandman.dev/owner={}", self.owner.display());
        let listed = std::process::Command::new("docker").args(["images", "-q", "--filter", &label]).output();
        let mut images: Vec<String> = listed
            .map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().map(str::to_string).collect())
            .unwrap_or_default();
        images.push(self.pulled.clone());
        let _ = std::process::Command::new("docker").args(["image", "rm", "-f"]).args(&images).output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_provider_forks_share_a_committed_snapshot_and_keep_their_writes_apart() {
    require_docker();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let daemon = static_daemon();
    let server = Server::start_in(&state, &["--provider", "docker", "--daemon", daemon.to_str().unwrap()]);
    let http = server.client();
    // The busybox test image, with a directory and files of its own for the scenario to change.
    let base = http.create(json!({"image": "sandman-test/busybox:latest"})).await;
    let base_id = base["id"].as_str().unwrap().to_string();
    sh(
        &http,
        &base_id,
        "mkdir -p /srv/app /srv/old && echo hi > /srv/app/hello.txt && echo stale > /srv/old/stale.txt",
    )
    .await;
    let prepared = http.post(&format!("/v1/sandboxes/{base_id}/snapshots"), json!({})).await.ok();
    let image = prepared["image"].as_str().unwrap().to_string();
    http.release(&base_id).await.ok();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let _images = EngineImages {
        owner: std::fs::canonicalize(&state).unwrap().join("docker"),
        pulled: registry.reference("snap/exported", "1"),
    };

    let job = "snap-e2e-docker";
    forks_share_the_past_and_keep_their_own_future(&http, &image, job).await;
    // The image's own configuration, not the container's: the daemon is not its entry point.
    let listed = http.get(&format!("/v1/snapshots?job={job}")).await.ok();
    let snap_id = listed["snapshots"][0]["id"].as_str().unwrap().to_string();
    let child = http.create(json!({"image": format!("snapshot:{snap_id}"), "job": job})).await;
    assert_eq!(child["image_config"]["workdir"], "/work", "the image's working directory is lost: {child}");
    assert!(!child["image_config"].to_string().contains("sandmand"), "the container's config: {child}");
    an_exported_snapshot_runs_elsewhere(&http, job, &registry).await;
    the_jobs_end_takes_its_snapshots(&http, job).await;
    let gone = std::process::Command::new("docker")
        .args(["image", "inspect", &format!("sandman-snapshot:{snap_id}")])
        .output()
        .unwrap();
    assert!(!gone.status.success(), "the job's snapshot image is still on the engine");
    http.call("DELETE", &format!("/v1/snapshots/{}", prepared["id"].as_str().unwrap()), Body::Empty).await.ok();
}

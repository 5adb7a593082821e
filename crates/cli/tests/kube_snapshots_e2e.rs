//! Snapshots and forks on the kubernetes provider, through the real server, on a real cluster
//! whose node pulls from this machine's loopback (the local cluster: its containerd runs on this
//! host, and reaches a plain-HTTP registry on 127.0.0.1 as Docker does). Ignored by default: it
//! needs `SANDMAN_E2E_KUBECONFIG`, `kubectl`, Debian's `docker-registry` and the static daemon;
//! it holds `/tmp/sandman-e2e-kube.lock`, as every test on a real cluster does:
//!
//! ```sh
//! ./scripts/build-daemon
//! SANDMAN_E2E_KUBECONFIG=/var/lib/k8s-local/kubeconfig \
//!   cargo test -p sandman-cli --test kube_snapshots_e2e -- --ignored --nocapture
//! ```
//!
//! The test starts a registry on 127.0.0.1 (storage in a temporary directory) and pushes a
//! busybox image to it, writes a provider config (a namespace of its own, the daemon from a
//! host directory, snapshots pushed to that registry), then: a sandbox writes files in
//! `/workspace` and outside it and deletes a file of the image in `/home/user`, a snapshot naming
//! no directory is refused, a fork of two naming `/workspace` and `/home/user` starts two pods
//! from the pushed image, each sees the files (not the deleted one; the directory has the owner
//! the source gave it) and only its own later writes, and nothing outside the named
//! directories came along. The namespace is deleted however the test ends.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod e2e;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use e2e::{Http, Server, scratch};
use sandman_testkit::registry::{Auth, Registry, TestImage, busybox_layer, host_arch};
use serde_json::{Value, json};

fn kubectl() -> PathBuf {
    let cached = PathBuf::from("/var/cache/k8s-local/bin/kubectl");
    if cached.is_file() { cached } else { PathBuf::from("kubectl") }
}

/// The lock every test on a real cluster holds (see `crates/provider-kube/tests/e2e.rs`).
fn cluster_lock() -> std::fs::File {
    let path = std::env::temp_dir().join("sandman-e2e-kube.lock");
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).unwrap();
    if file.try_lock().is_err() {
        eprintln!("waiting for {} (another test on the cluster holds it)", path.display());
        file.lock().unwrap();
    }
    file
}

/// A namespace of the test's own, deleted when dropped.
struct Namespace {
    kubeconfig: PathBuf,
    name: String,
}

impl Namespace {
    fn create(kubeconfig: &Path, name: &str) -> Namespace {
        let ok = Command::new(kubectl())
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["create", "namespace", name])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kubectl create namespace {name} failed");
        Namespace { kubeconfig: kubeconfig.to_path_buf(), name: name.to_string() }
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new(kubectl())
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["delete", "namespace", &self.name, "--wait=false", "--ignore-not-found"])
            .status();
    }
}

async fn stdout(http: &Http, id: &str, command: &str) -> String {
    let r = http.exec(id, json!({"command": command})).await;
    assert_eq!(r["exit_code"], 0, "`{command}` in {id}: {r}");
    r["stdout"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster with a kubelet on this machine (SANDMAN_E2E_KUBECONFIG)"]
async fn kubernetes_forks_of_named_directories_see_the_snapshot_and_only_their_own_writes() {
    let kubeconfig = PathBuf::from(
        std::env::var_os("SANDMAN_E2E_KUBECONFIG")
            .unwrap_or_else(|| panic!("set SANDMAN_E2E_KUBECONFIG to the kubeconfig of a cluster")),
    );
    let _lock = cluster_lock();
    let dir = tempfile::tempdir_in(scratch()).unwrap();

    // The registry the node pulls from, with the task image in it.
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let image = TestImage::with_config(vec![busybox_layer()], host_arch(), json!({"Env": ["PATH=/bin:/usr/bin"]}));
    registry.push("e2e/busybox", "1", &image).await;
    let task_image = registry.reference("e2e/busybox", "1");

    // The daemon, from a host directory (the node is this machine).
    let daemon_dir = dir.path().join("daemon");
    std::fs::create_dir_all(&daemon_dir).unwrap();
    std::fs::copy(sandman_testkit::static_daemon(), daemon_dir.join("sandmand")).unwrap();
    let ns = format!("sandman-e2e-snap-{}", std::process::id());
    let _namespace = Namespace::create(&kubeconfig, &ns);
    let config = dir.path().join("kube.json");
    let snapshots = format!("{}/e2e/snapshots", registry.addr());
    std::fs::write(
        &config,
        serde_json::to_vec(&json!({
            "namespace": ns,
            "instance": ns,
            "injection": {"host_path": {"path": daemon_dir}},
            "capacity": {"enabled": false},
            "snapshots": {"registry": snapshots},
        }))
        .unwrap(),
    )
    .unwrap();
    let server = Server::start_bin_env(
        &e2e::sandman_bin(),
        &dir.path().join("state"),
        &["--provider", "kubernetes", "--kube-config", config.to_str().unwrap()],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
        &[],
    );
    let http = server.client();

    let started = Instant::now();
    let source = http.create(json!({"image": task_image, "job": "kube-snap"})).await;
    let create_s = started.elapsed().as_secs_f64();
    assert_eq!(source["state"], "ready", "{source}");
    let src = source["id"].as_str().unwrap().to_string();
    stdout(
        &http,
        &src,
        "mkdir -p /workspace/sub && echo base > /workspace/a.txt && echo deep > /workspace/sub/b.txt && \
         ln -s a.txt /workspace/link && chmod 600 /workspace/sub/b.txt && echo outside > /tmp/outside && \
         rm /home/user/.profile && echo notes > /home/user/notes && chown 1000 /home/user",
    )
    .await;

    // No directory named: refused, naming the provider and why.
    let refused = http.post(&format!("/v1/sandboxes/{src}/snapshots"), json!({})).await;
    let err = refused.error(400, "invalid_argument");
    let message = err["message"].as_str().unwrap();
    assert!(message.contains("kubernetes provider") && message.contains("container runtime"), "{message}");

    let started = Instant::now();
    let forked = http
        .post(&format!("/v1/sandboxes/{src}/fork"), json!({"count": 2, "paths": ["/workspace", "/home/user"]}))
        .await
        .ok();
    let fork_s = started.elapsed().as_secs_f64();
    let snapshot = forked["snapshot"].clone();
    assert_eq!(snapshot["paths"], json!(["/workspace", "/home/user"]), "{snapshot}");
    let pushed = snapshot["pushed"].as_str().unwrap();
    assert!(pushed.starts_with(&format!("{snapshots}:{}@sha256:", snapshot["id"].as_str().unwrap())), "{pushed}");
    let kids: Vec<String> =
        forked["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(kids.len(), 2, "{forked}");

    for kid in &kids {
        let seen = stdout(
            &http,
            kid,
            "cat /workspace/a.txt /workspace/sub/b.txt /workspace/link; stat -c %a /workspace/sub/b.txt; \
             test -e /tmp/outside && echo outside-came-along; cat /home/user/notes; \
             test -e /home/user/.profile && echo deleted-file-came-back; stat -c %u /home/user; true",
        )
        .await;
        // A named directory is as the source left it: what it deleted of the image stays deleted.
        assert_eq!(seen, "base\ndeep\nbase\n600\nnotes\n1000\n", "fork {kid} sees: {seen:?}");
    }
    // Each fork's writes are its own.
    for (i, kid) in kids.iter().enumerate() {
        stdout(&http, kid, &format!("echo {i} > /workspace/mine && echo changed-{i} > /workspace/a.txt")).await;
    }
    for (i, kid) in kids.iter().enumerate() {
        let seen = stdout(&http, kid, "cat /workspace/mine /workspace/a.txt").await;
        assert_eq!(seen, format!("{i}\nchanged-{i}\n"), "fork {kid}");
    }
    let source_sees = stdout(&http, &src, "cat /workspace/a.txt; test -e /workspace/mine && echo sibling; true").await;
    assert_eq!(source_sees, "base\n", "the source after its forks' writes");

    // Deleted: gone from the server's list (the image stays in the registry).
    let id = snapshot["id"].as_str().unwrap();
    let deleted = http.call("DELETE", &format!("/v1/snapshots/{id}"), e2e::Body::Empty).await;
    assert!(deleted.status < 300, "{}", String::from_utf8_lossy(&deleted.body));
    let listed: Value = http.get("/v1/snapshots").await.ok();
    assert!(!listed.to_string().contains(id), "{listed}");
    for sb in kids.iter().chain([&src]) {
        assert!(http.release(sb).await.status < 300);
    }
    println!(
        "kubernetes: one plain create {create_s:.2} s; a fork of 2 naming /workspace and /home/user \
         {fork_s:.2} s (a layer of {} bytes pushed, then two pods from it): {:.2}x the plain create",
        snapshot["size"],
        fork_s / create_s
    );
}

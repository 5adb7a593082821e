//! Snapshots and forks on the process provider, measured side by side in one run (as root,
//! isolated), in alternating rounds:
//!
//! - **fork**: a sandbox holding 100 MiB of changes (`SANDMAN_BENCH_CHANGES_MIB`) forked into 8
//!   (`SANDMAN_BENCH_FORKS`), until every child is ready, against 8 plain creates of its image
//!   plus the same 100 MiB uploaded into each (a tar through the server, as a harness would set a
//!   task up); the target is the fork at most half;
//! - **snapshot**: a snapshot of those 100 MiB (its layer written and committed to the image
//!   store) against `tar` of the same files on the host's disk.
//!
//! `SANDMAN_BENCH_ROUNDS` sets the rounds (default 5).
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;
mod figures;

use std::time::{Duration, Instant};

use e2e::{Body, Http, Server};
use figures::{env_usize, ms, p50_p99};
use sandman_testkit::registry::{Auth, Registry, TestImage, busybox_layer, host_arch};
use serde_json::json;

async fn sh(http: &Http, id: &str, command: &str) {
    let r = http.exec(id, json!({"command": command, "timeout_ms": 600_000})).await;
    assert_eq!(r["exit_code"], 0, "`{command}`: {r}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !sandman_testkit::is_root() {
        println!("snapshots: skipped (needs root: the process provider isolates sandboxes)");
        return;
    }
    let rounds = env_usize("SANDMAN_BENCH_ROUNDS", 5);
    let forks = env_usize("SANDMAN_BENCH_FORKS", 8);
    let mib = env_usize("SANDMAN_BENCH_CHANGES_MIB", 100);
    let dir = tempfile::tempdir_in(sandman_testkit::scratch!()).unwrap();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    registry.push("bench/base", "1", &TestImage::with_config(vec![busybox_layer()], host_arch(), json!({}))).await;
    let image = registry.reference("bench/base", "1");
    let server = Server::start_in(&dir.path().join("state"), &["--memory-overcommit", "0"]);
    let http = server.client();
    // Room for the changes in every sandbox's layer (it is memory, charged to the sandbox).
    let resources = json!({"memory": format!("{}Mi", mib * 2 + 256)});

    let source = http.create(json!({"image": image, "resources": resources})).await;
    let src = source["id"].as_str().unwrap().to_string();
    // 100 files of 1 MiB, incompressible.
    sh(
        &http,
        &src,
        &format!("mkdir /data && for i in $(seq 1 {mib}); do head -c 1048576 /dev/urandom > /data/f$i; done"),
    )
    .await;
    let tar = http.get(&format!("/v1/sandboxes/{src}/archive?path=/data")).await;
    assert_eq!(tar.status, 200);
    let tar = tar.body.to_vec();
    // The same files on the host's disk, for `tar`.
    let host_files = dir.path().join("files");
    std::fs::create_dir(&host_files).unwrap();
    let unpacked = std::process::Command::new("tar")
        .arg("-xf")
        .arg("-")
        .arg("-C")
        .arg(&host_files)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(&tar)?;
            child.wait()
        })
        .unwrap();
    assert!(unpacked.success());

    let (mut fork_t, mut plain_t, mut snap_t, mut tar_t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // Fork.
        let started = Instant::now();
        let forked =
            http.post(&format!("/v1/sandboxes/{src}/fork"), json!({"count": forks, "resources": resources})).await.ok();
        fork_t.push(started.elapsed());
        let kids: Vec<String> =
            forked["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_string()).collect();
        assert_eq!(kids.len(), forks);
        release_all(&http, &kids).await;
        let snap = forked["snapshot"]["id"].as_str().unwrap().to_string();
        http.call("DELETE", &format!("/v1/snapshots/{snap}"), Body::Empty).await.ok();

        // Plain creates, the changes uploaded into each.
        let started = Instant::now();
        let tasks: Vec<_> = (0..forks)
            .map(|_| {
                let (http, image, resources, tar) = (http.clone(), image.clone(), resources.clone(), tar.clone());
                tokio::spawn(async move {
                    let sb = http.create(json!({"image": image, "resources": resources})).await;
                    let id = sb["id"].as_str().unwrap().to_string();
                    let put =
                        http.call("PUT", &format!("/v1/sandboxes/{id}/archive?path=/data"), Body::Octets(tar)).await;
                    assert_eq!(put.status, 200, "{}", String::from_utf8_lossy(&put.body));
                    id
                })
            })
            .collect();
        let mut plain = Vec::new();
        for t in tasks {
            plain.push(t.await.unwrap());
        }
        plain_t.push(started.elapsed());
        release_all(&http, &plain).await;

        // Snapshot against tar, in turns.
        let started = Instant::now();
        let made = http.post(&format!("/v1/sandboxes/{src}/snapshots"), json!({})).await.ok();
        snap_t.push(started.elapsed());
        http.call("DELETE", &format!("/v1/snapshots/{}", made["id"].as_str().unwrap()), Body::Empty).await.ok();
        let out = dir.path().join("out.tar");
        let started = Instant::now();
        let status = std::process::Command::new("tar")
            .arg("-cf")
            .arg(&out)
            .arg("-C")
            .arg(&host_files)
            .arg(".")
            .status()
            .unwrap();
        tar_t.push(started.elapsed());
        assert!(status.success());
        std::fs::remove_file(&out).unwrap();
        println!(
            "round {round}: fork {:.0} ms, plain {:.0} ms, snapshot {:.0} ms, tar {:.0} ms",
            ms(fork_t[round]),
            ms(plain_t[round]),
            ms(snap_t[round]),
            ms(tar_t[round])
        );
    }
    let (fork50, fork99) = p50_p99(&mut fork_t);
    let (plain50, plain99) = p50_p99(&mut plain_t);
    let (snap50, snap99) = p50_p99(&mut snap_t);
    let (tar50, tar99) = p50_p99(&mut tar_t);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    println!();
    println!("{mib} MiB of changes, {forks} children, {rounds} rounds (p50 / p99, ms)");
    println!("fork into {forks}:                 {:>8.0} / {:>8.0}", ms(fork50), ms(fork99));
    println!("{forks} creates + upload each:     {:>8.0} / {:>8.0}", ms(plain50), ms(plain99));
    println!(
        "  fork / plain:                {:>8.2}x (target <= 0.5x) {}",
        ratio(fork50, plain50),
        if ratio(fork50, plain50) <= 0.5 { "met" } else { "MISSED" }
    );
    println!("snapshot of {mib} MiB:          {:>8.0} / {:>8.0}", ms(snap50), ms(snap99));
    println!("tar of the same files:         {:>8.0} / {:>8.0}", ms(tar50), ms(tar99));
    println!("  snapshot / tar:              {:>8.2}x", ratio(snap50, tar50));
    http.release(&src).await;
}

async fn release_all(http: &Http, ids: &[String]) {
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let (http, id) = (http.clone(), id.clone());
            tokio::spawn(async move { http.release(&id).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

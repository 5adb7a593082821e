//! The process provider as a sandbox runtime, measured side by side in one run (as root,
//! isolated; these machines are noisy, so every figure stands beside its floor, in alternating
//! rounds):
//!
//! - **networks**: create-to-ready and an exec round trip of `network: egress` sandboxes (a
//!   network namespace and a veth through the server's NAT) against `network: none` ones (a
//!   namespace with only loopback: what every sandbox had before it had a way out), with the
//!   target egress/none at most 1.3x at p50, and with `SANDMAN_BENCH_BASELINE=<dir>` (another
//!   build's `sandman` and `sandmand`, such as the last one whose sandboxes shared the host's
//!   network) against that build's creates in the same rounds; the kernel memory the network part
//!   costs a sandbox (held by `SANDMAN_BENCH_HELD` sandboxes of each, default 200); the create
//!   rate of a burst of `SANDMAN_BENCH_BURST` (500) on each side;
//!   and 1,000 egress sandboxes (`SANDMAN_BENCH_NETWORKS`) held at once, each with its own
//!   address, a sample of them fetching a page from a stand-in internet by name;
//! - **images**: create-to-ready from a cached multi-layer image against `host` (target at
//!   most 1.5x at p50) and against the docker provider for the same image; 64 concurrent creates
//!   of an image not in the store (one pull, every blob fetched once, all ready); and 1,000
//!   sandboxes of the image held at once (`SANDMAN_BENCH_IMAGE_SANDBOXES`), the store counted
//!   once, with disk and PSS per sandbox.
//!
//! The pull of an image against `skopeo copy` is `cargo bench -p sandman-image --bench pull`.
//! `SANDMAN_BENCH_ROUNDS` sets the alternating rounds (default 60). The docker comparison needs
//! a running engine and the static daemon (`./scripts/build-daemon`); it is left out, saying so,
//! without them.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;
mod figures;

use std::time::{Duration, Instant};

use e2e::{Http, Server};
use figures::{env_usize, ms, p50_p99, pss_kib};
use sandman_testkit::internet::StandIn;
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage, busybox_layer, host_arch};
use serde_json::{Value, json};

/// The kernel's own memory that nothing can reclaim, in KiB: unreclaimable slab, per-CPU
/// areas, kernel stacks and page tables. A sandbox's namespaces, veth, routes, firewall
/// rules and cgroups all land here; other work on a noisy machine mostly moves the page
/// cache instead, which is why `MemAvailable` is not read.
fn kernel_kib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .filter_map(|l| {
            let (key, value) = l.split_once(':')?;
            matches!(key, "SUnreclaim" | "Percpu" | "KernelStack" | "PageTables")
                .then(|| value.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
        })
        .sum()
}

/// Lets the kernel settle what it frees lazily (namespaces, RCU) before memory is read.
fn settle() {
    std::thread::sleep(Duration::from_secs(2));
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
    std::thread::sleep(Duration::from_millis(500));
}

/// Creates one sandbox of `body` and times it until ready.
async fn timed_create(http: &Http, body: &Value) -> (String, Duration) {
    let started = Instant::now();
    let sb = http.create(body.clone()).await;
    let took = started.elapsed();
    assert_eq!(sb["state"], "ready", "{sb}");
    (sb["id"].as_str().unwrap().to_string(), took)
}

/// Creates `n` sandboxes of `body`, `at_once` at a time; their ids and how long it took.
async fn create_many(http: &Http, body: &Value, n: usize, at_once: usize) -> (Vec<String>, Duration) {
    let started = Instant::now();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(at_once));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (http, body, sem) = (http.clone(), body.clone(), sem.clone());
            tokio::spawn(async move {
                let _permit = sem.acquire().await.unwrap();
                let sb = http.create(body).await;
                assert_eq!(sb["state"], "ready", "{sb}");
                sb["id"].as_str().unwrap().to_string()
            })
        })
        .collect();
    let mut ids = Vec::with_capacity(n);
    for t in tasks {
        ids.push(t.await.unwrap());
    }
    (ids, started.elapsed())
}

async fn release_all(http: &Http, ids: &[String]) {
    for chunk in ids.chunks(32) {
        let calls: Vec<_> = chunk.iter().map(|id| http.release(id)).collect();
        for c in calls {
            c.await;
        }
    }
}

/// The round trip of `exec /bin/true` (or the image's `true`), p50 over `n`.
async fn exec_p50(http: &Http, id: &str, n: usize) -> Duration {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let r = http.exec(id, json!({"argv": ["true"]})).await;
        v.push(started.elapsed());
        assert_eq!(r["exit_code"], 0, "{r}");
    }
    p50_p99(&mut v).0
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(bench());
}

async fn bench() {
    assert_eq!(std::env::var("USER").ok().as_deref().unwrap_or("root"), "root", "run as root");
    let rounds = env_usize("SANDMAN_BENCH_ROUNDS", 60);
    let mut summary: Vec<String> = Vec::new();
    println!("\nsandman runtime benchmark: the process provider's networks and images ({rounds} alternating rounds)");
    networks(rounds, &mut summary).await;
    images(rounds, &mut summary).await;
    println!("\nsummary");
    for line in &summary {
        println!("  {line}");
    }
}

async fn networks(rounds: usize, summary: &mut Vec<String>) {
    let internet = StandIn::start(40);
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let dns = internet.addr.to_string();
    let server =
        Server::start_in(&dir.path().join("state"), &["--dns", &dns, "--memory-overcommit", "0", "--create-rate", "0"]);
    let http = server.client();
    let egress = json!({"image": "host", "network": "egress"});
    let none = json!({"image": "host", "network": "none"});
    // Warm up: the first creates pay for what the kernel and the server make once.
    let (warm, _) = create_many(&http, &egress, 10, 2).await;
    release_all(&http, &warm).await;

    // With a baseline build (`SANDMAN_BENCH_BASELINE`: a directory with another build's `sandman`
    // and `sandmand`, e.g. the release before sandboxes had networks of their own, whose
    // sandboxes shared the host's network), its creates join the same rounds.
    let baseline = figures::baseline_server(&e2e::scratch());
    let mut sides: Vec<(String, Http, &Value)> = vec![
        ("egress (own namespace, veth, NAT)".into(), http.clone(), &egress),
        ("none (own namespace, loopback only)".into(), http.clone(), &none),
    ];
    if let Some((dir, server, _)) = &baseline {
        sides.push((format!("egress, baseline build {}", dir.display()), server.client(), &egress));
    }
    println!("\nnetworks: create-to-ready and exec /bin/true, {} sides in alternating rounds", sides.len());
    let mut creates: Vec<Vec<Duration>> = vec![Vec::new(); sides.len()];
    let mut execs: Vec<Vec<Duration>> = vec![Vec::new(); sides.len()];
    for round in 0..rounds {
        for k in 0..sides.len() {
            let i = (round + k) % sides.len();
            let (_, side, body) = &sides[i];
            let (id, took) = timed_create(side, body).await;
            execs[i].push(exec_p50(side, &id, 5).await);
            creates[i].push(took);
            side.release(&id).await;
        }
    }
    let mut p50 = Vec::new();
    for (i, (name, _, _)) in sides.iter().enumerate() {
        let (c50, c99) = p50_p99(&mut creates[i]);
        let x50 = p50_p99(&mut execs[i]).0;
        println!(
            "  {name:<58} create-to-ready p50 {:>6.2} ms p99 {:>6.2} ms   exec p50 {:.3} ms",
            ms(c50),
            ms(c99),
            ms(x50)
        );
        p50.push((c50.as_secs_f64(), x50.as_secs_f64()));
    }
    let verdict = |r: f64| if r <= 1.3 { "met" } else { "NOT MET" };
    let (cr, xr) = (p50[0].0 / p50[1].0, p50[0].1 / p50[1].1);
    summary.push(format!(
        "network: create-to-ready egress/none p50 {cr:.2}x (target <= 1.3: {}), exec {xr:.2}x",
        verdict(cr)
    ));
    if let Some(base) = p50.get(2) {
        let (cr, xr) = (p50[0].0 / base.0, p50[0].1 / base.1);
        summary.push(format!(
            "network: create-to-ready egress/baseline build (the host's network) p50 {cr:.2}x (target <= 1.3: {}), exec {xr:.2}x",
            verdict(cr)
        ));
    }
    // Bursts: creates 16 at a time, held until the burst ends, each side in turn.
    let burst = env_usize("SANDMAN_BENCH_BURST", 500);
    let mut rates = Vec::new();
    for (name, side, body) in &sides {
        settle();
        let (ids, took) = create_many(side, body, burst, 16).await;
        let rate = burst as f64 / took.as_secs_f64();
        println!("  a burst of {burst} creates, 16 at a time: {name:<58} {rate:>5.0}/s");
        rates.push(rate);
        release_all(side, &ids).await;
    }
    let base_rate = rates.get(2).map(|b| format!(", egress/baseline build {:.2}x", rates[0] / b)).unwrap_or_default();
    summary.push(format!("network: burst create rate egress/none {:.2}x{base_rate}", rates[0] / rates[1]));
    drop(sides);
    drop(baseline);

    // Memory of the network part: the same number of sandboxes held each way.
    let held = env_usize("SANDMAN_BENCH_HELD", 200);
    let mut per = Vec::new();
    for body in [&none, &egress] {
        settle();
        let before = kernel_kib();
        let (ids, _) = create_many(&http, body, held, 16).await;
        settle();
        let after = kernel_kib();
        per.push(after.saturating_sub(before) as f64 / held as f64);
        release_all(&http, &ids).await;
    }
    println!(
        "  kernel memory per sandbox held ({held} each): none {:.0} KiB, egress {:.0} KiB: the network part {:.0} KiB",
        per[0],
        per[1],
        per[1] - per[0]
    );
    summary.push(format!(
        "network: {:.0} KiB of kernel memory per sandbox for its namespace, veth and NAT",
        per[1] - per[0]
    ));

    // Many held at once, each with a network of its own.
    let many = env_usize("SANDMAN_BENCH_NETWORKS", 1000);
    settle();
    let before = kernel_kib();
    let (ids, took) = create_many(&http, &egress, many, 16).await;
    let mut addrs = std::collections::BTreeSet::new();
    for id in &ids {
        let r = http.exec(id, json!({"argv": ["cat", "/proc/net/fib_trie"]})).await;
        let text = r["stdout"].as_str().unwrap_or_default().to_string();
        let addr = text.lines().find(|l| l.contains("10.")).map(str::trim).unwrap_or_default().to_string();
        addrs.insert(addr);
    }
    let sample = ids.len().min(50);
    let mut fetched = 0;
    for id in ids.iter().take(sample) {
        let r = http
            .exec(id, json!({"argv": ["python3", "-c", format!("import urllib.request; print(urllib.request.urlopen('http://{}/', timeout=10).read().decode().strip())", StandIn::NAME)]}))
            .await;
        fetched += usize::from(r["stdout"].as_str().unwrap_or_default().contains("stand-in internet"));
    }
    settle();
    let after = kernel_kib();
    println!(
        "  {many} egress sandboxes held at once: made in {:.1} s ({:.0}/s), {} distinct addresses, {fetched} of {sample} fetched a page by name, {:.0} KiB of kernel memory each",
        took.as_secs_f64(),
        many as f64 / took.as_secs_f64(),
        addrs.len(),
        after.saturating_sub(before) as f64 / many as f64
    );
    summary.push(format!(
        "network: {many} egress sandboxes held at once, {fetched}/{sample} reached the stand-in internet by name"
    ));
    release_all(&http, &ids).await;
    drop(server);
}

/// A multi-layer image: busybox, then four layers of about 8 MiB each (files that do not
/// compress much, in a few directories).
fn multi_layer_image() -> TestImage {
    let mut layers = vec![busybox_layer()];
    let mut seed: u64 = 0x5a5a_1234;
    for l in 0..4 {
        let mut layer = LayerBuilder::new().dir(&format!("data{l}"));
        for f in 0..64 {
            let mut data = vec![0u8; 128 * 1024];
            for b in data.iter_mut() {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                *b = (seed >> 56) as u8;
            }
            layer = layer.file(&format!("data{l}/f{f}.bin"), &data);
        }
        layers.push(layer.build(Compression::Gzip));
    }
    TestImage::with_config(layers, host_arch(), json!({"Env": ["PATH=/bin:/usr/bin"], "WorkingDir": "/"}))
}

async fn images(rounds: usize, summary: &mut Vec<String>) {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let image = multi_layer_image();
    registry.push("bench/app", "1", &image).await;
    let reference = registry.reference("bench/app", "1");
    let server = Server::start_in(&dir.path().join("state"), &["--memory-overcommit", "0", "--create-rate", "0"]);
    let http = server.client();
    let of_image = json!({"image": reference});
    let host = json!({"image": "host"});

    println!(
        "\nimages: a {}-layer image ({:.1} MiB compressed)",
        image.layers.len(),
        image.layers.iter().map(|l| l.bytes.len()).sum::<usize>() as f64 / 1048576.0
    );
    let pulled = Instant::now();
    let (id, _) = timed_create(&http, &of_image).await;
    println!("  first create (pulls it): {:.0} ms", ms(pulled.elapsed()));
    http.release(&id).await;
    let (mut ci, mut ch) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let order: [(&Value, bool); 2] =
            if i % 2 == 0 { [(&of_image, true), (&host, false)] } else { [(&host, false), (&of_image, true)] };
        for (body, is_image) in order {
            let (id, took) = timed_create(&http, body).await;
            if is_image {
                ci.push(took)
            } else {
                ch.push(took)
            }
            http.release(&id).await;
        }
    }
    let ((ci50, ci99), (ch50, ch99)) = (p50_p99(&mut ci), p50_p99(&mut ch));
    println!(
        "  create-to-ready  cached image p50 {:.2} ms p99 {:.2} ms   host p50 {:.2} ms p99 {:.2} ms",
        ms(ci50),
        ms(ci99),
        ms(ch50),
        ms(ch99)
    );
    let r = ci50.as_secs_f64() / ch50.as_secs_f64();
    summary.push(format!(
        "images: create-to-ready cached image/host p50 {r:.2}x (target <= 1.5: {})",
        if r <= 1.5 { "met" } else { "NOT MET" }
    ));

    match docker_create_p50(&reference, rounds).await {
        Some(d) => {
            println!("  create-to-ready  the docker provider, same image: p50 {:.2} ms", ms(d));
            summary.push(format!(
                "images: create-to-ready the docker provider / the process provider, same image: {:.1}x",
                d.as_secs_f64() / ci50.as_secs_f64()
            ));
        }
        None => println!("  the docker provider: left out (no engine or no static daemon)"),
    }

    // 64 at once of an image the store does not have: one pull.
    let pruned = http.post("/v1/images/prune", json!({})).await.ok();
    assert!(pruned["images"].as_array().is_some_and(|a| !a.is_empty()), "nothing pruned: {pruned}");
    let gets_before: Vec<usize> = image.layers.iter().map(|l| registry.requests("GET", &l.digest)).collect();
    let (ids, took) = create_many(&http, &of_image, 64, 64).await;
    let fetched: Vec<usize> =
        image.layers.iter().zip(&gets_before).map(|(l, b)| registry.requests("GET", &l.digest) - b).collect();
    println!(
        "  64 creates at once of the image, not in the store: all ready in {:.2} s; each layer fetched {fetched:?} time(s)",
        took.as_secs_f64()
    );
    summary.push(format!(
        "images: 64 concurrent creates of an uncached image, all ready in {:.2} s, each blob fetched once: {}",
        took.as_secs_f64(),
        fetched.iter().all(|n| *n == 1)
    ));
    release_all(&http, &ids).await;

    // Many held at once: the store counted once.
    let many = env_usize("SANDMAN_BENCH_IMAGE_SANDBOXES", 1000);
    settle();
    let before = kernel_kib();
    let (ids, took) = create_many(&http, &of_image, many, 16).await;
    let store = http.get("/v1/images").await.ok();
    let store_bytes = store["size"].as_u64().unwrap_or(0);
    let pss: u64 = ids
        .iter()
        .filter_map(|id| {
            let pids = std::fs::read_to_string(server.state.join(format!("sandboxes/{id}/daemon.pid"))).ok()?;
            let waiter: u32 = pids.split_whitespace().next()?.parse().ok()?;
            let children = std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children")).ok()?;
            let inner: u32 = children.split_whitespace().next()?.parse().ok()?;
            Some(pss_kib(waiter) + pss_kib(inner))
        })
        .sum();
    settle();
    let after = kernel_kib();
    let upper: u64 = {
        let r = http.exec(&ids[0], json!({"argv": ["du", "-sk", "/tmp", "/root"]})).await;
        r["stdout"]
            .as_str()
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    };
    println!(
        "  {many} sandboxes of the image held at once: made in {:.1} s ({:.0}/s); the store {:.1} MiB on disk, once; per sandbox {:.1} KiB on disk (its writable layer, in memory), {:.0} KiB PSS of its processes, {:.0} KiB of kernel memory",
        took.as_secs_f64(),
        many as f64 / took.as_secs_f64(),
        store_bytes as f64 / 1048576.0,
        upper as f64,
        pss as f64 / many as f64,
        after.saturating_sub(before) as f64 / many as f64
    );
    summary.push(format!(
        "images: {many} sandboxes of one image held, its {:.1} MiB stored once",
        store_bytes as f64 / 1048576.0
    ));
    release_all(&http, &ids).await;
}

/// The docker provider's create-to-ready p50 for `reference`, after one create that pulls it;
/// `None` without an engine or the static daemon.
async fn docker_create_p50(reference: &str, rounds: usize) -> Option<Duration> {
    let ok = std::process::Command::new("docker").arg("info").output().is_ok_and(|o| o.status.success());
    let daemon = std::env::var_os("SANDMAND_STATIC")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| sandman_testkit::workspace().join("target/static/x86_64-unknown-linux-gnu/daemon/sandmand"));
    if !ok || !daemon.is_file() {
        return None;
    }
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let daemon_arg = daemon.display().to_string();
    let server = Server::start_in(&dir.path().join("state"), &["--provider", "docker", "--daemon", &daemon_arg]);
    let http = server.client();
    let body = json!({"image": reference});
    let (id, _) = timed_create(&http, &body).await;
    http.release(&id).await;
    let mut v = Vec::new();
    for _ in 0..rounds.min(30) {
        let (id, took) = timed_create(&http, &body).await;
        v.push(took);
        http.release(&id).await;
    }
    let _ = std::process::Command::new("docker").args(["image", "rm", "-f", reference]).output();
    Some(p50_p99(&mut v).0)
}

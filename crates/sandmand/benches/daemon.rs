//! Daemon benchmark: exec round trip through `sandmand` against a direct spawn, concurrent exec
//! throughput, idle RSS and binary size, all measured side by side in one run.
//!
//! `cargo bench -p sandmand --bench daemon` (set `SANDMAN_BENCH_N` for more rounds). It runs the
//! static build from `./scripts/build-daemon` when present (`SANDMAND_STATIC` overrides), else the
//! bench-profile binary.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Body, Daemon, TOKEN};
use serde_json::json;

fn daemon_binary() -> (PathBuf, &'static str) {
    match sandman_testkit::static_daemon_built() {
        Some(p) if std::env::var_os("SANDMAND_STATIC").is_some_and(|v| !v.is_empty()) => {
            (p, "static (SANDMAND_STATIC)")
        }
        Some(p) => (p, "static (scripts/build-daemon)"),
        None => (common::daemon_bin(), "bench profile, dynamic (run ./scripts/build-daemon for the shipped build)"),
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn rss_kib(pid: u32) -> (u64, u64) {
    (sandman_testkit::status_kib(pid, "VmRSS:"), sandman_testkit::status_kib(pid, "VmHWM:"))
}

fn main() {
    let rounds: usize = std::env::var("SANDMAN_BENCH_N").ok().and_then(|n| n.parse().ok()).unwrap_or(2000);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(bench(rounds));
}

async fn bench(rounds: usize) {
    let (bin, kind) = daemon_binary();
    let size = std::fs::metadata(&bin).map(|m| m.len()).unwrap_or(0);
    println!("sandmand benchmark: {rounds} rounds, binary {} ({kind})", bin.display());

    let d = Daemon::start_bin(&bin, &[], None).await;
    let (rss_fresh, _) = rss_kib(d.pid());

    let mut conn = d.connect().await;
    let body = json!({"argv": ["/bin/true"]});
    for _ in 0..100 {
        conn.call("POST", "/v1/exec", Some(TOKEN), Body::Json(body.clone())).await.unwrap();
        std::process::Command::new("/bin/true").status().unwrap();
    }
    // Interleaved in blocks of 50, so that a noisy moment hits both sides alike.
    let mut via_daemon = Vec::with_capacity(rounds);
    let mut direct = Vec::with_capacity(rounds);
    while via_daemon.len() < rounds {
        for _ in 0..50 {
            let t = Instant::now();
            let r = conn.call("POST", "/v1/exec", Some(TOKEN), Body::Json(body.clone())).await.unwrap();
            via_daemon.push(t.elapsed());
            assert_eq!(r.status, 200);
        }
        for _ in 0..50 {
            let t = Instant::now();
            let s = std::process::Command::new("/bin/true").status().unwrap();
            direct.push(t.elapsed());
            assert!(s.success());
        }
    }
    via_daemon.sort();
    direct.sort();
    let (d50, d99) = (pct(&via_daemon, 0.5), pct(&via_daemon, 0.99));
    let (s50, s99) = (pct(&direct, 0.5), pct(&direct, 0.99));
    println!();
    println!("exec round trip of /bin/true      p50 (us)   p99 (us)");
    println!("  through sandmand (unix socket)  {:>8.0}   {:>8.0}", us(d50), us(d99));
    println!("  direct spawn in this process    {:>8.0}   {:>8.0}", us(s50), us(s99));
    println!(
        "  ratio daemon / direct           {:>8.2}x  {:>8.2}x   (target <= 2x)",
        us(d50) / us(s50),
        us(d99) / us(s99)
    );

    let clients = 8;
    let per_client = (rounds / clients).max(50);
    let d = Arc::new(d);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let d = d.clone();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = d.connect().await;
            for _ in 0..per_client {
                let r = conn.call("POST", "/v1/exec", Some(TOKEN), Body::Json(body.clone())).await.unwrap();
                assert_eq!(r.status, 200);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let daemon_rate = (clients * per_client) as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..per_client {
                    std::process::Command::new("/bin/true").status().unwrap();
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    let direct_rate = (clients * per_client) as f64 / t.elapsed().as_secs_f64();
    println!();
    println!("concurrent execs, {clients} clients x {per_client}");
    println!("  through sandmand   {daemon_rate:>8.0} execs/s");
    println!("  direct spawns      {direct_rate:>8.0} execs/s");
    println!("  ratio              {:>8.2}", daemon_rate / direct_rate);

    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_idle, hwm) = rss_kib(d.pid());
    println!();
    println!("daemon memory");
    println!("  idle RSS at start          {:>6.2} MiB   (target < 4 MiB)", rss_fresh as f64 / 1024.0);
    println!("  idle RSS after the load    {:>6.2} MiB", rss_idle as f64 / 1024.0);
    println!("  peak RSS during the load   {:>6.2} MiB", hwm as f64 / 1024.0);
    println!("binary size                  {:>6.2} MiB   (target < 8 MiB)", size as f64 / (1024.0 * 1024.0));
}

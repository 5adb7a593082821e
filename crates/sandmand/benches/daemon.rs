//! Daemon benchmark: exec round trip through `sandmand` against a direct spawn, exec throughput
//! with 1 and 8 clients against as many threads spawning directly, idle RSS and binary size, all
//! measured side by side in one run.
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

/// VmRSS, VmHWM (KiB) and the number of threads of `pid`.
fn rss_kib(pid: u32) -> (u64, u64, u64) {
    let field = |name: &str| sandman_testkit::status_kib(pid, name);
    (field("VmRSS:"), field("VmHWM:"), field("Threads:"))
}

/// CPU time (user + system) of process `pid` itself and of its reaped children, from
/// `/proc/PID/stat`, whose clock ticks are always USER_HZ, 100 a second.
fn proc_cpu(pid: u32) -> (Duration, Duration) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest.split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
    let ticks = |a: usize, b: usize| Duration::from_millis(10 * (f.get(a).unwrap_or(&0) + f.get(b).unwrap_or(&0)));
    // utime, stime, cutime, cstime are fields 14 to 17, so 11 to 14 after the name.
    (ticks(11, 12), ticks(13, 14))
}

/// CPU spent per exec, by who spent it.
#[derive(Default)]
struct CpuSplit {
    /// The daemon itself, or the threads spawning directly.
    starter: Duration,
    /// This process's client side of the daemon's API (nothing when spawning directly).
    client: Duration,
    /// The commands themselves.
    commands: Duration,
}

impl CpuSplit {
    fn total(&self) -> Duration {
        self.starter + self.client + self.commands
    }
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
    let (rss_fresh, _, threads_fresh) = rss_kib(d.pid());

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

    let total: Duration = via_daemon.iter().sum();
    let daemon_rate = via_daemon.len() as f64 / total.as_secs_f64();
    let total: Duration = direct.iter().sum();
    let direct_rate = direct.len() as f64 / total.as_secs_f64();
    println!();
    println!("exec throughput, 1 client (the round trips above)");
    println!("  through sandmand   {daemon_rate:>8.0} execs/s");
    println!("  direct spawns      {direct_rate:>8.0} execs/s   (1 thread)");
    println!("  ratio              {:>8.2}", daemon_rate / direct_rate);

    // 8 clients each looping execs through the daemon, against 8 threads each looping direct
    // spawns: its floor. Alternated in short rounds, so that a noisy moment hits both sides.
    let clients = 8;
    let per_round = 25;
    let rounds_8 = (rounds / (clients * per_round)).max(4);
    let d = Arc::new(d);
    let mut conns = Vec::new();
    for _ in 0..clients {
        conns.push(Arc::new(tokio::sync::Mutex::new(d.connect().await)));
    }
    // The direct side's threads live as long as the daemon's do: each round only signals them.
    let spawners: Vec<_> = (0..clients)
        .map(|_| {
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            std::thread::spawn(move || {
                while go_rx.recv().is_ok() {
                    for _ in 0..per_round {
                        assert!(std::process::Command::new("/bin/true").status().unwrap().success());
                    }
                    done_tx.send(()).unwrap();
                }
            });
            (go_tx, done_rx)
        })
        .collect();
    let (mut daemon_time, mut direct_time) = (Duration::ZERO, Duration::ZERO);
    let mut round_ratios = Vec::with_capacity(rounds_8);
    let (mut via_cpu, mut direct_cpu) = (CpuSplit::default(), CpuSplit::default());
    for _ in 0..rounds_8 {
        let (daemon_cpu, (self_cpu, _)) = (proc_cpu(d.pid()), proc_cpu(std::process::id()));
        let t = Instant::now();
        let tasks: Vec<_> = conns
            .iter()
            .map(|conn| {
                let (conn, body) = (conn.clone(), body.clone());
                tokio::spawn(async move {
                    let mut conn = conn.lock().await;
                    for _ in 0..per_round {
                        let r = conn.call("POST", "/v1/exec", Some(TOKEN), Body::Json(body.clone())).await.unwrap();
                        assert_eq!(r.status, 200);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let through = t.elapsed();
        let (daemon_after, (self_after, _)) = (proc_cpu(d.pid()), proc_cpu(std::process::id()));
        via_cpu.starter += daemon_after.0 - daemon_cpu.0;
        via_cpu.commands += daemon_after.1 - daemon_cpu.1;
        via_cpu.client += self_after - self_cpu;
        let (self_cpu, children_cpu) = proc_cpu(std::process::id());
        let t = Instant::now();
        for (go, _) in &spawners {
            go.send(()).unwrap();
        }
        for (_, done) in &spawners {
            done.recv().unwrap();
        }
        let floor = t.elapsed();
        let (self_after, children_after) = proc_cpu(std::process::id());
        direct_cpu.starter += self_after - self_cpu;
        direct_cpu.commands += children_after - children_cpu;
        round_ratios.push(floor.as_secs_f64() / through.as_secs_f64());
        daemon_time += through;
        direct_time += floor;
    }
    let n = (rounds_8 * clients * per_round) as f64;
    let (daemon_rate, direct_rate) = (n / daemon_time.as_secs_f64(), n / direct_time.as_secs_f64());
    round_ratios.sort_by(f64::total_cmp);
    println!();
    println!("concurrent execs, {clients} clients x {per_round} execs x {rounds_8} alternating rounds");
    println!("  through sandmand   {daemon_rate:>8.0} execs/s");
    println!("  direct spawns      {direct_rate:>8.0} execs/s   ({clients} threads, posix_spawn + wait)");
    println!(
        "  ratio              {:>8.2}      (target >= 0.9; rounds: min {:.2}, median {:.2}, max {:.2})",
        daemon_rate / direct_rate,
        round_ratios[0],
        round_ratios[round_ratios.len() / 2],
        round_ratios[round_ratios.len() - 1]
    );
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n;
    println!("  CPU per exec (us)  starter   client  command    total");
    println!(
        "  through sandmand   {:>7.0}  {:>7.0}  {:>7.0}  {:>7.0}   (starter: the daemon)",
        per(via_cpu.starter),
        per(via_cpu.client),
        per(via_cpu.commands),
        per(via_cpu.total())
    );
    println!(
        "  direct spawns      {:>7.0}  {:>7.0}  {:>7.0}  {:>7.0}   (starter: the spawning threads)",
        per(direct_cpu.starter),
        per(direct_cpu.client),
        per(direct_cpu.commands),
        per(direct_cpu.total())
    );
    println!(
        "  ratio direct / through sandmand, CPU per exec: {:.2} (the throughput ratio on a saturated machine)",
        direct_cpu.total().as_secs_f64() / via_cpu.total().as_secs_f64()
    );
    drop((conns, spawners));

    // Past the blocking pool's keep-alive (1 s): the threads that started commands are gone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (rss_idle, hwm, threads_idle) = rss_kib(d.pid());
    println!();
    println!("daemon memory");
    println!(
        "  idle RSS at start          {:>6.2} MiB   (target < 4 MiB; {threads_fresh} threads)",
        rss_fresh as f64 / 1024.0
    );
    println!("  idle RSS after the load    {:>6.2} MiB   ({threads_idle} threads)", rss_idle as f64 / 1024.0);
    println!("  peak RSS during the load   {:>6.2} MiB", hwm as f64 / 1024.0);
    println!("binary size                  {:>6.2} MiB   (target < 8 MiB)", size as f64 / (1024.0 * 1024.0));
}

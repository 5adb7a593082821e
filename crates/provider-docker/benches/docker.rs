//! The Docker provider against the docker CLI, side by side in one run on the same image:
//! create-to-first-exec vs. `docker run --rm IMAGE true`, exec vs. `docker exec` of the same
//! command in the same container (p50/p99), and the idle memory of a sandbox (its daemon's RSS,
//! read from /proc of the container's init on the host, and the engine's shim beside it).
//!
//! Needs a running engine, the test images and the static daemon (`./scripts/build-daemon`):
//! `cargo bench -p sandman-provider-docker --bench docker`. `SANDMAN_BENCH_RUNS` (default 10) sets
//! how many creates and `docker run`s, `SANDMAN_BENCH_EXECS` (default 500) how many execs.
#![allow(clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{BUSYBOX, State, call, id, inspect, socket_of};
use sandman_provider::conformance::spec;
use sandman_provider::{Provider, SandboxSpec};
use sandman_provider_docker::{DockerProvider, container_name};
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn row(what: &str, mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let (p50, p99) = (quantile(&v, 0.5), quantile(&v, 0.99));
    println!("  {what:<44} p50 {:>10}   p99 {:>10}   (n={})", ms(p50), ms(p99), v.len());
    (p50, p99)
}

/// Runs the docker CLI, timing it; fails the benchmark when it fails.
fn timed_docker(args: &[&str]) -> Duration {
    let start = Instant::now();
    let out = Command::new("docker").args(args).output().unwrap();
    let took = start.elapsed();
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    took
}

/// Creates a sandbox and runs `/bin/true` in it as soon as its daemon answers.
async fn create_to_first_exec(p: &DockerProvider, name: &str) -> (Duration, SandboxSpec, PathBuf) {
    let s = spec(&id(name), BUSYBOX);
    let start = Instant::now();
    let ep = p.create(&s).await.unwrap_or_else(|e| panic!("create failed: {e}"));
    let socket = socket_of(&ep);
    loop {
        if let Ok(r) = call(&socket, "GET", "/v1/health", None, None).await
            && r.status == 200
        {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "daemon not healthy within 30 s");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let r = call(&socket, "POST", "/v1/exec", Some(&s.token), Some(json!({"argv": ["/bin/true"]}))).await.unwrap();
    assert_eq!(r.status, 200);
    (start.elapsed(), s, socket)
}

fn parent_of(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

fn comm(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(bench());
}

async fn bench() {
    let runs = env_usize("SANDMAN_BENCH_RUNS", 10).max(1);
    let execs = env_usize("SANDMAN_BENCH_EXECS", 500).max(10);
    let state = State::new();
    let p = state.provider().await;
    let version = Command::new("docker").args(["version", "--format", "{{.Server.Version}}"]).output().unwrap();
    println!(
        "docker provider vs. the docker CLI (engine {}, image {BUSYBOX}, {} cpus)",
        String::from_utf8_lossy(&version.stdout).trim(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );

    // Create to first exec, against `docker run --rm IMAGE true`; interleaved, so that a noisy
    // moment hits both.
    println!("\ncreate → first exec ({runs} runs each, interleaved)");
    let (mut sandman, mut with_delete, mut run) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let (took, s, _) = create_to_first_exec(&p, &format!("bench-c{i}")).await;
        let start = Instant::now();
        p.delete(&s.id).await.unwrap();
        sandman.push(took);
        with_delete.push(took + start.elapsed());
        run.push(tokio::task::spawn_blocking(|| timed_docker(&["run", "--rm", BUSYBOX, "/bin/true"])).await.unwrap());
    }
    let (create_p50, _) = row("sandman create → health → exec /bin/true", sandman);
    row("sandman create → exec → delete", with_delete);
    let (run_p50, _) = row("docker run --rm IMAGE /bin/true", run);
    println!(
        "  docker run / sandman create-to-first-exec at p50: {:.2}x",
        run_p50.as_secs_f64() / create_p50.as_secs_f64()
    );

    // Exec round trip in one container: the daemon over its socket vs. `docker exec`.
    println!("\nexec /bin/true in the same container");
    let (_, s, socket) = create_to_first_exec(&p, "bench-exec").await;
    let (sid, token) = (s.id, s.token);
    let body = json!({"argv": ["/bin/true"]});
    for _ in 0..20 {
        call(&socket, "POST", "/v1/exec", Some(&token), Some(body.clone())).await.unwrap();
    }
    let mut ours = Vec::with_capacity(execs);
    for _ in 0..execs {
        let start = Instant::now();
        let r = call(&socket, "POST", "/v1/exec", Some(&token), Some(body.clone())).await.unwrap();
        ours.push(start.elapsed());
        assert_eq!(r.status, 200);
    }
    let name = container_name(&sid);
    let docker_execs = (execs / 10).max(20);
    let theirs = {
        let name = name.clone();
        tokio::task::spawn_blocking(move || {
            (0..docker_execs).map(|_| timed_docker(&["exec", &name, "/bin/true"])).collect::<Vec<_>>()
        })
        .await
        .unwrap()
    };
    let (ours_p50, _) = row("sandman exec (daemon over its Unix socket)", ours);
    let (theirs_p50, _) = row("docker exec CONTAINER /bin/true", theirs);
    let ratio = theirs_p50.as_secs_f64() / ours_p50.as_secs_f64();
    println!("  docker exec / sandman exec at p50: {ratio:.1}x (target: at least 10x)");
    p.delete(&sid).await.unwrap();

    // Idle memory: sandboxes that have answered one exec and then sit.
    let idle = env_usize("SANDMAN_BENCH_IDLE", 10).max(1);
    println!("\nidle memory per sandbox ({idle} sandboxes, 2 s after their first exec)");
    let mut ids = Vec::new();
    for i in 0..idle {
        ids.push(create_to_first_exec(&p, &format!("bench-idle{i}")).await.1.id);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (mut daemon_kib, mut shim_kib, mut shim_name) = (0, 0, String::new());
    for sid in &ids {
        let pid = inspect(sid)["State"]["Pid"].as_u64().unwrap();
        daemon_kib += sandman_testkit::rss_kib(pid as u32);
        if let Some(parent) = parent_of(pid) {
            shim_kib += sandman_testkit::rss_kib(parent as u32);
            shim_name = comm(parent);
        }
    }
    let n = ids.len() as u64;
    println!("  daemon RSS (the container's PID 1)            {:>6} KiB per sandbox", daemon_kib / n);
    println!("  engine shim RSS ({shim_name:<16})            {:>6} KiB per sandbox", shim_kib / n);
    for sid in &ids {
        p.delete(sid).await.unwrap();
    }
    assert!(state.containers().is_empty(), "containers left behind: {:?}", state.containers());
}

//! Service benchmark, side by side in one run: the exec round trip through server and daemon vs
//! the daemon alone vs a direct spawn; create-to-ready of the process provider; and how many
//! sandboxes one server holds at once, each answering an exec, with memory per sandbox.
//!
//! `cargo bench -p sandman-cli --bench service` after `./scripts/build-daemon` (it runs the static
//! daemon; `SANDMAND_STATIC` overrides). `SANDMAN_BENCH_SANDBOXES` sets how many sandboxes the
//! density run holds (default 2000); `SANDMAN_BENCH_N` the rounds of the round-trip run.
//! Create-to-ready is measured isolated and with `--isolation none`, interleaved; with
//! `SANDMAN_BENCH_BASELINE=<dir>` (a directory holding another build's `sandman` and `sandmand`,
//! e.g. the previous release) that build's create-to-ready is measured in the same interleaving.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{Http, Server};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn daemon_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDMAND_STATIC") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let static_build = root.join("target/static/x86_64-unknown-linux-gnu/daemon/sandmand");
    if static_build.exists() {
        return static_build;
    }
    panic!("build the shipped daemon first: ./scripts/build-daemon (or set SANDMAND_STATIC)");
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Proportional set size: shared pages (the static daemon's code, shared by all sandboxes)
/// divided among the processes that map them.
fn pss_kib(pid: u32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    rollup
        .lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A kept-alive HTTP/1.1 connection.
struct Conn {
    sender: http1::SendRequest<Full<bytes::Bytes>>,
    token: String,
}

impl Conn {
    async fn tcp(addr: &str, token: &str) -> Conn {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        Conn::over(hyper_util::rt::TokioIo::new(s), token).await
    }

    async fn unix(path: &Path, token: &str) -> Conn {
        let s = tokio::net::UnixStream::connect(path).await.unwrap();
        Conn::over(hyper_util::rt::TokioIo::new(s), token).await
    }

    async fn over<T>(io: T, token: &str) -> Conn
    where
        T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (sender, conn) = http1::handshake(io).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender, token: token.to_string() }
    }

    async fn post(&mut self, path: &str, body: &serde_json::Value) -> u16 {
        self.sender.ready().await.unwrap();
        let req = hyper::Request::post(path)
            .header("host", "bench")
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(serde_json::to_vec(body).unwrap())))
            .unwrap();
        let resp = self.sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        resp.into_body().collect().await.unwrap();
        status
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(bench());
}

async fn bench() {
    let rounds = env_usize("SANDMAN_BENCH_N", 1000);
    let density = env_usize("SANDMAN_BENCH_SANDBOXES", 2000);
    let daemon = daemon_binary();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let daemon_arg = daemon.display().to_string();
    let server = Server::start_in(
        &state,
        // No admission limit: this measures how fast the provider itself creates.
        &[
            "--daemon",
            &daemon_arg,
            "--max-concurrent-requests",
            "16384",
            "--default-lease-s",
            "3600",
            "--create-rate",
            "0",
        ],
    );
    let http = server.client();
    println!("sandman service benchmark: daemon {}", daemon.display());

    // ---- exec round trip ----
    let sb = http.create(json!({"image": "host"})).await;
    let id = sb["id"].as_str().unwrap().to_string();
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join(format!("sandboxes/{id}/record.json"))).unwrap()).unwrap();
    let daemon_token = record["token"].as_str().unwrap().to_string();
    let mut via_server = Conn::tcp(&server.addr, e2e::TOKEN).await;
    let mut via_daemon = Conn::unix(&state.join(format!("sandboxes/{id}/d.sock")), &daemon_token).await;
    let body = json!({"argv": ["/bin/true"]});
    let server_path = format!("/v1/sandboxes/{id}/exec");
    for _ in 0..100 {
        assert_eq!(via_server.post(&server_path, &body).await, 200);
        assert_eq!(via_daemon.post("/v1/exec", &body).await, 200);
    }
    let (mut s, mut d, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    while s.len() < rounds {
        for _ in 0..50 {
            let t = Instant::now();
            via_server.post(&server_path, &body).await;
            s.push(t.elapsed());
        }
        for _ in 0..50 {
            let t = Instant::now();
            via_daemon.post("/v1/exec", &body).await;
            d.push(t.elapsed());
        }
        for _ in 0..50 {
            let t = Instant::now();
            std::process::Command::new("/bin/true").status().unwrap();
            direct.push(t.elapsed());
        }
    }
    for v in [&mut s, &mut d, &mut direct] {
        v.sort();
    }
    println!();
    println!("exec round trip of /bin/true ({rounds} rounds)   p50 (us)   p99 (us)");
    println!("  server + daemon (TCP, then unix socket)    {:>8.0}   {:>8.0}", us(pct(&s, 0.5)), us(pct(&s, 0.99)));
    println!("  daemon alone (unix socket)                 {:>8.0}   {:>8.0}", us(pct(&d, 0.5)), us(pct(&d, 0.99)));
    println!(
        "  direct spawn                               {:>8.0}   {:>8.0}",
        us(pct(&direct, 0.5)),
        us(pct(&direct, 0.99))
    );
    println!(
        "  server overhead over the daemon alone       {:>7.0}%   {:>7.0}%   (target < 30%)",
        (us(pct(&s, 0.5)) / us(pct(&d, 0.5)) - 1.0) * 100.0,
        (us(pct(&s, 0.99)) / us(pct(&d, 0.99)) - 1.0) * 100.0
    );
    http.release(&id).await.ok();

    // ---- create to ready: isolated against not isolated (and a baseline build), interleaved ----
    let plain_dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let plain = Server::start_in(
        &plain_dir.path().join("state"),
        &["--daemon", &daemon_arg, "--isolation", "none", "--create-rate", "0"],
    );
    let baseline = std::env::var_os("SANDMAN_BENCH_BASELINE").map(PathBuf::from);
    let baseline_dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let baseline = baseline.map(|dir| {
        let daemon = dir.join("sandmand").display().to_string();
        let server = Server::start_bin(
            &dir.join("sandman"),
            &baseline_dir.path().join("state"),
            &["--daemon", &daemon, "--create-rate", "0"],
        );
        (dir, server)
    });
    let mut sides: Vec<(String, Http)> =
        vec![("isolated (--isolation full)".into(), http.clone()), ("--isolation none".into(), plain.client())];
    if let Some((dir, server)) = &baseline {
        sides.push((format!("baseline {}", dir.display()), server.client()));
    }
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); sides.len()];
    for _ in 0..100 {
        for (i, (_, side)) in sides.iter().enumerate() {
            let t = Instant::now();
            let sb = side.create(json!({"image": "host"})).await;
            times[i].push(t.elapsed());
            side.release(sb["id"].as_str().unwrap()).await;
        }
    }
    let ms = |v: &[Duration], p: f64| pct(v, p).as_secs_f64() * 1e3;
    println!();
    println!("create to ready, process provider, one at a time (100 each, interleaved)");
    for (i, (name, _)) in sides.iter().enumerate() {
        times[i].sort();
        println!(
            "  {name:<40} p50 {:>6.1} ms   p99 {:>6.1} ms   ({:.2}x isolated p50)",
            ms(&times[i], 0.5),
            ms(&times[i], 0.99),
            ms(&times[i], 0.5) / ms(&times[0], 0.5)
        );
    }
    drop(plain);
    drop(baseline);

    // ---- create to ready: default and eval, interleaved ----
    let eval = json!({"image": "host", "profile": "eval", "resources": {"cpu": 0.5, "memory": "256Mi"}});
    let (mut ready, mut ready_eval, mut record) = (Vec::new(), Vec::new(), Vec::new());
    let mut ids = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let sb = http.create(json!({"image": "host"})).await;
        ready.push(t.elapsed());
        let id = sb["id"].as_str().unwrap().to_string();
        // The first ask of a default sandbox's conditions takes its record (provider + daemon).
        let t = Instant::now();
        http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok();
        record.push(t.elapsed());
        ids.push(id);
        let t = Instant::now();
        let sb = http.create(eval.clone()).await;
        ready_eval.push(t.elapsed());
        assert_eq!(sb["state"], "ready", "{sb}");
        ids.push(sb["id"].as_str().unwrap().to_string());
    }
    for v in [&mut ready, &mut ready_eval, &mut record] {
        v.sort();
    }
    println!();
    println!("create to ready, process provider, one at a time (100 each, interleaved)");
    println!("  default                         p50 {:>6.1} ms   p99 {:>6.1} ms", ms(&ready, 0.5), ms(&ready, 0.99));
    println!(
        "  eval (cgroups, netns, record)   p50 {:>6.1} ms   p99 {:>6.1} ms   ({:.2}x / {:.2}x default)",
        ms(&ready_eval, 0.5),
        ms(&ready_eval, 0.99),
        ms(&ready_eval, 0.5) / ms(&ready, 0.5),
        ms(&ready_eval, 0.99) / ms(&ready, 0.99)
    );
    println!("  conditions record, first ask    p50 {:>6.2} ms   p99 {:>6.2} ms", ms(&record, 0.5), ms(&record, 0.99));
    for id in ids.drain(..) {
        http.release(&id).await.ok();
    }

    // ---- density ----
    let server_before = rss_kib(server.pid());
    let t = Instant::now();
    let created = create_many(&http, density, 16).await;
    let create_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let answered = exec_all(&http, &created, 16).await;
    let exec_secs = t.elapsed().as_secs_f64();
    let server_after = rss_kib(server.pid());
    let mut daemon_kib = Vec::new();
    let mut daemon_pss = Vec::new();
    for id in &created {
        let pids = std::fs::read_to_string(state.join(format!("sandboxes/{id}/daemon.pid"))).unwrap_or_default();
        if let Some(pid) = pids.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()) {
            // The daemon and, when isolated, the small waiter that started it.
            let (mut rss, mut pss) = (rss_kib(pid), pss_kib(pid));
            for child in children_of(pid) {
                rss += rss_kib(child);
                pss += pss_kib(child);
            }
            daemon_kib.push(rss);
            daemon_pss.push(pss);
        }
    }
    daemon_kib.sort();
    daemon_pss.sort();
    let per_sandbox_server = (server_after.saturating_sub(server_before) * 1024) / created.len().max(1) as u64;
    println!();
    println!(
        "sandboxes held at once: {} created in {create_secs:.1} s ({:.0}/s), {answered} answered an exec in {exec_secs:.1} s",
        created.len(),
        created.len() as f64 / create_secs
    );
    let mib = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0) as f64 / 1024.0;
    println!(
        "  per sandbox, the daemon and its namespace waiter: RSS p50 {:.2} MiB (shared pages counted in full), PSS p50 {:.2} MiB, PSS max {:.2} MiB",
        mib(&daemon_kib, daemon_kib.len() / 2),
        mib(&daemon_pss, daemon_pss.len() / 2),
        mib(&daemon_pss, daemon_pss.len().saturating_sub(1))
    );
    println!(
        "  server RSS               {:.1} MiB -> {:.1} MiB, {} bytes per sandbox",
        server_before as f64 / 1024.0,
        server_after as f64 / 1024.0,
        per_sandbox_server
    );
    let t = Instant::now();
    release_all(&http, &created, 16).await;
    println!("  released all in {:.1} s", t.elapsed().as_secs_f64());
}

fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

async fn create_many(http: &Http, n: usize, width: usize) -> Vec<String> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..width {
        let http = http.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let r = http.post("/v1/sandboxes", json!({"image": "host"})).await;
                if r.status == 200 {
                    ids.push(r.json()["id"].as_str().unwrap().to_string());
                } else {
                    eprintln!("create failed: {}", String::from_utf8_lossy(&r.body));
                }
            }
            ids
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

async fn exec_all(http: &Http, ids: &[String], width: usize) -> usize {
    let chunks: Vec<Vec<String>> = ids.chunks(ids.len().div_ceil(width).max(1)).map(|c| c.to_vec()).collect();
    let mut tasks = Vec::new();
    for chunk in chunks {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for id in chunk {
                let r = http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["/bin/true"]})).await;
                if r.status == 200 && r.json()["exit_code"] == 0 {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

async fn release_all(http: &Http, ids: &[String], width: usize) {
    let chunks: Vec<Vec<String>> = ids.chunks(ids.len().div_ceil(width).max(1)).map(|c| c.to_vec()).collect();
    let mut tasks = Vec::new();
    for chunk in chunks {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            for id in chunk {
                http.release(&id).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

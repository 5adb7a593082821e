//! Pool and admission benchmark, side by side in one run:
//! 1. warm-pool claim latency against a cold create, through the real `sandman serve` with the
//!    process provider (client round trip of `POST /v1/sandboxes` on a kept-alive connection);
//! 2. the achieved create rate and the fair share under a 10,000-create burst from three jobs
//!    (weights 1, 2, 5), against the fake provider in-process (the service itself, no HTTP, no
//!    daemons), so that it measures admission and not process start-up.
//!
//! `cargo bench -p sandman-cli --bench pool`. It runs the static daemon when it is built
//! (`./scripts/build-daemon`, or `SANDMAND_STATIC`), else the one next to `sandman`.
//! `SANDMAN_BENCH_CLAIMS` sets the claims measured (default 200), `SANDMAN_BENCH_BURST` the
//! burst (default 10000), `SANDMAN_BENCH_RATE` its rate (default 2000/s).
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;
mod figures;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::Server;
use figures::{env_usize, ms, pct};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use sandman_provider::Endpoint;
use sandman_provider::fake::FakeProvider;
use sandman_server::provider::AnyProvider;
use sandman_server::service::{Daemons, Service, Settings};
use sandman_wire::server::{CreateSandbox, JobSpec, ListQuery, SandboxState};
use serde_json::{Value, json};

/// A kept-alive HTTP/1.1 connection to the server.
struct Conn {
    sender: http1::SendRequest<Full<bytes::Bytes>>,
}

impl Conn {
    async fn tcp(addr: &str) -> Conn {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        let (sender, conn) = http1::handshake(hyper_util::rt::TokioIo::new(s)).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender }
    }

    async fn call(&mut self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.sender.ready().await.unwrap();
        let bytes = body.map(|b| serde_json::to_vec(b).unwrap()).unwrap_or_default();
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "bench")
            .header("authorization", format!("Bearer {}", e2e::TOKEN))
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(bytes)))
            .unwrap();
        let resp = self.sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// A create, timed; answers the sandbox id.
    async fn create(&mut self, body: &Value) -> (String, Duration) {
        let t = Instant::now();
        let (status, sb) = self.call("POST", "/v1/sandboxes", Some(body)).await;
        let took = t.elapsed();
        assert_eq!(status, 200, "{sb}");
        (sb["id"].as_str().unwrap().to_string(), took)
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // Refills go through admission like any create: at 50/s with no burst, a run of
        // claims sets off one refill every 20 ms; unlimited, all of them at once, on the same
        // cores as the server.
        claims("50", "1").await;
        // The server's defaults.
        claims("50", "50").await;
        claims("0", "1").await;
        burst().await;
    });
}

async fn claims(rate: &str, burst: &str) {
    let n_claims = env_usize("SANDMAN_BENCH_CLAIMS", 200);
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let daemon = sandman_testkit::static_daemon_built();
    let daemon_arg = daemon.as_ref().map(|d| d.display().to_string()).unwrap_or_default();
    // Hundreds of sandboxes held, each with the default memory limit: not what the machine's
    // memory admits, which this does not measure.
    let mut args =
        vec!["--create-rate", rate, "--create-burst", burst, "--default-lease-s", "3600", "--memory-overcommit", "0"];
    if daemon.is_some() {
        args.extend(["--daemon", daemon_arg.as_str()]);
    }
    let server = Server::start_in(&state, &args);
    let mut conn = Conn::tcp(&server.addr).await;
    println!(
        "\nsandman pool benchmark: process provider, daemon {}, --create-rate {rate} (0 = unlimited) --create-burst {burst}",
        daemon.map(|d| d.display().to_string()).unwrap_or_else(|| "next to sandman".into())
    );

    // ---- cold creates (no pool yet), spaced so that none waits for a token ----
    let mut cold = Vec::new();
    for _ in 0..100 {
        let (id, took) = conn.create(&json!({"image": "host"})).await;
        cold.push(took);
        conn.call("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    cold.sort();

    // ---- claims from a warm pool, in rounds that let it refill ----
    const POOL: usize = 50;
    const PER_ROUND: usize = 40;
    let spec = json!({"image": "host", "min_ready": POOL, "max": POOL});
    assert_eq!(conn.call("PUT", "/v1/pools/warm", Some(&spec)).await.0, 200);
    let mut warm = Vec::new();
    while warm.len() < n_claims {
        let filled = Instant::now();
        while conn.call("GET", "/v1/pools/warm", None).await.1["ready"].as_u64() != Some(POOL as u64) {
            assert!(filled.elapsed() < Duration::from_secs(60), "the pool did not refill");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut ids = Vec::new();
        for _ in 0..PER_ROUND.min(n_claims - warm.len()) {
            let (id, took) = conn.create(&json!({"pool": "warm", "job": "bench", "env": {"TASK": "1"}})).await;
            warm.push(took);
            ids.push(id);
        }
        for id in ids {
            conn.call("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        }
    }
    warm.sort();
    let (_, pools) = conn.call("GET", "/v1/pools/warm", None).await;
    println!();
    println!("create latency, client round trip            p50 (ms)   p99 (ms)   n");
    println!(
        "  warm-pool claim                            {:>8.2}   {:>8.2}   {}",
        ms(pct(&warm, 0.5)),
        ms(pct(&warm, 0.99)),
        warm.len()
    );
    println!(
        "  cold create (process provider)             {:>8.2}   {:>8.2}   {}",
        ms(pct(&cold, 0.5)),
        ms(pct(&cold, 0.99)),
        cold.len()
    );
    println!(
        "  claim / cold at p50: {:.3} (target: claim p99 under 5 ms: {})",
        pct(&warm, 0.5).as_secs_f64() / pct(&cold, 0.5).as_secs_f64(),
        if pct(&warm, 0.99) < Duration::from_millis(5) { "met" } else { "NOT met" }
    );
    println!("  pool after the run: {} claims served", pools["claims"]);
    conn.call("DELETE", "/v1/pools/warm", None).await;
    conn.call("DELETE", "/v1/jobs/bench", None).await;
}

async fn burst() {
    let n = env_usize("SANDMAN_BENCH_BURST", 10_000);
    let rate = env_usize("SANDMAN_BENCH_RATE", 2000) as f64;
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    // A burst of 10 ms of the rate: the admission task's timer ticks by the millisecond, so a
    // bucket that holds less than a tick's tokens cannot reach a rate over 1,000/s.
    let burst = (rate / 100.0).max(1.0);
    let settings = Settings {
        create_rate: Some(rate),
        create_burst: burst,
        max_queue: n + 10,
        daemons: Daemons::Absent,
        ..Settings::new(dir.path().to_path_buf())
    };
    let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.path().join("none.sock"))));
    let service = Service::new(settings, provider, "t".into());
    service.start_background();
    let jobs = [("w1", 1.0), ("w2", 2.0), ("w5", 5.0)];
    for (job, weight) in jobs {
        service.put_job(job, JobSpec { weight: Some(weight), ..Default::default() }).unwrap();
    }
    let start = Instant::now();
    for i in 0..n {
        let job = jobs[i % 3].0;
        let req = CreateSandbox { image: "any".into(), job: Some(job.into()), wait: false, ..Default::default() };
        service.create(req).await.unwrap();
    }
    let submitted = start.elapsed();
    let ready_of = |s: &Arc<Service>, job: &str| {
        let q = ListQuery { job: Some(job.into()), state: Some(SandboxState::Ready), ..Default::default() };
        s.list(&q).unwrap().len()
    };
    // Sample the shares while all three still queue: the heaviest drains its third of the
    // burst at 5/8 of the rate.
    let contended_for = Duration::from_secs_f64((n as f64 / 3.0) / (rate * 5.0 / 8.0) * 0.8);
    tokio::time::sleep(contended_for.saturating_sub(start.elapsed())).await;
    let at_sample = start.elapsed();
    let shares: HashMap<&str, usize> = jobs.iter().map(|(j, _)| (*j, ready_of(&service, j))).collect();
    while jobs.iter().map(|(j, _)| ready_of(&service, j)).sum::<usize>() < n {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all = start.elapsed();
    let sampled: usize = shares.values().sum();
    println!();
    println!(
        "burst of {n} creates from 3 jobs (weights 1, 2, 5), global rate {rate}/s (bucket {burst}), fake provider in-process"
    );
    println!("  submitted in {:.2} s; all admitted and ready in {:.2} s", submitted.as_secs_f64(), all.as_secs_f64());
    println!(
        "  achieved rate {:.0}/s over the whole burst (allowed {rate}/s: {:.3} of it)",
        n as f64 / all.as_secs_f64(),
        n as f64 / all.as_secs_f64() / rate
    );
    println!("  shares after {:.2} s, while all three queued ({sampled} admitted):", at_sample.as_secs_f64());
    for (job, weight) in jobs {
        let got = shares[job] as f64 / sampled as f64;
        println!("    {job}: {:.3} of the admissions (its weight says {:.3})", got, weight / 8.0);
    }
    service.cancel.cancel();
}

//! Pause and resume on the process provider, measured side by side in one run (as root,
//! isolated), in alternating rounds:
//!
//! - `POST /v1/sandboxes/{id}/pause` and `…/resume` through the server, p50 and p99, on an idle
//!   sandbox and on one running a busy loop (target: both under 10 ms);
//! - their floors in the same rounds: the kernel's own freeze and thaw of the same cgroup
//!   (`cgroup.freeze` written, `cgroup.events` awaited with `poll`, read again every 200 µs at
//!   most, as the provider does, no server), and a
//!   `POST …/keepalive` round trip (the HTTP and server cost of any control call).
//!
//! `SANDMAN_BENCH_ROUNDS` sets the rounds (default 200).
// `poll` on `cgroup.events` for the kernel's floor, which std does not expose.
#![allow(clippy::unwrap_used, clippy::print_stdout, unsafe_code)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;
mod figures;

use std::io::{Read, Seek};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{Http, Server};
use figures::{env_usize, ms, p50_p99};
use serde_json::json;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(bench());
}

/// The v2 cgroup that freezes sandbox `id`, from its `cgroups.json` in the server's state.
fn freezer_of(state: &Path, id: &str) -> PathBuf {
    let text = std::fs::read_to_string(state.join("sandboxes").join(id).join("cgroups.json")).unwrap();
    let dirs: serde_json::Value = serde_json::from_str(&text).unwrap();
    PathBuf::from(dirs["freezer"].as_str().unwrap_or_else(|| panic!("no freezer cgroup: {dirs}")))
}

/// The kernel alone: `cgroup.freeze` written, then `cgroup.events` read and polled until it says
/// `frozen` is `want`.
fn kernel_freeze(dir: &Path, frozen: bool) -> Duration {
    let mut events = std::fs::File::open(dir.join("cgroup.events")).unwrap();
    let want = if frozen { "frozen 1" } else { "frozen 0" };
    let started = Instant::now();
    std::fs::write(dir.join("cgroup.freeze"), if frozen { "1" } else { "0" }).unwrap();
    let mut text = String::new();
    loop {
        text.clear();
        events.seek(std::io::SeekFrom::Start(0)).unwrap();
        events.read_to_string(&mut text).unwrap();
        if text.lines().any(|l| l == want) {
            return started.elapsed();
        }
        let mut pfd = libc::pollfd { fd: events.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
        // At most 200 µs, as the provider does: the kernel holds back a notification that comes
        // within 10 ms of the last one.
        let ts = libc::timespec { tv_sec: 0, tv_nsec: 200_000 };
        // SAFETY: one valid pollfd and one valid timespec, living across the call.
        unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    }
}

async fn timed(http: &Http, path: &str) -> Duration {
    let started = Instant::now();
    let resp = http.post(path, json!({})).await;
    let took = started.elapsed();
    resp.ok();
    took
}

#[derive(Default)]
struct Series {
    pause: Vec<Duration>,
    resume: Vec<Duration>,
    kernel_freeze: Vec<Duration>,
    kernel_thaw: Vec<Duration>,
}

async fn bench() {
    assert_eq!(std::env::var("USER").ok().as_deref().unwrap_or("root"), "root", "run as root");
    let rounds = env_usize("SANDMAN_BENCH_ROUNDS", 200);
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let server = Server::start_in(&state, &["--create-rate", "0"]);
    let http = server.client();
    let idle = http.create(json!({"image": "host", "lease_s": 600})).await["id"].as_str().unwrap().to_string();
    let busy = http.create(json!({"image": "host", "lease_s": 600})).await["id"].as_str().unwrap().to_string();
    let loop_body = json!({"argv": ["/bin/sh", "-c", "while :; do :; done"], "tag": "busy"});
    http.post(&format!("/v1/sandboxes/{busy}/processes"), loop_body).await.ok();
    println!("\nsandman pause benchmark: the process provider, {rounds} alternating rounds");
    let mut keepalive = Vec::with_capacity(rounds);
    let mut series = [Series::default(), Series::default()];
    let ids = [idle.clone(), busy.clone()];
    let freezers = [freezer_of(&state, &idle), freezer_of(&state, &busy)];
    // Warm up: the first calls pay for connections and caches.
    for id in &ids {
        timed(&http, &format!("/v1/sandboxes/{id}/pause")).await;
        timed(&http, &format!("/v1/sandboxes/{id}/resume")).await;
    }
    for _ in 0..rounds {
        for (k, id) in ids.iter().enumerate() {
            let s = &mut series[k];
            s.pause.push(timed(&http, &format!("/v1/sandboxes/{id}/pause")).await);
            s.resume.push(timed(&http, &format!("/v1/sandboxes/{id}/resume")).await);
            let cgroup = freezers[k].clone();
            let (f, t) =
                tokio::task::spawn_blocking(move || (kernel_freeze(&cgroup, true), kernel_freeze(&cgroup, false)))
                    .await
                    .unwrap();
            s.kernel_freeze.push(f);
            s.kernel_thaw.push(t);
        }
        keepalive.push(timed(&http, &format!("/v1/sandboxes/{idle}/keepalive")).await);
    }
    let (k50, k99) = p50_p99(&mut keepalive);
    println!("\n{:<34} {:>9} {:>9}", "", "p50 ms", "p99 ms");
    let mut verdicts = Vec::new();
    for (name, s) in ["idle sandbox", "busy sandbox (a busy loop)"].iter().zip(series.iter_mut()) {
        println!("{name}");
        for (what, v) in [
            ("  pause (server API)", &mut s.pause),
            ("  resume (server API)", &mut s.resume),
            ("  floor: kernel freeze", &mut s.kernel_freeze),
            ("  floor: kernel thaw", &mut s.kernel_thaw),
        ] {
            let (p50, p99) = p50_p99(v);
            println!("{what:<34} {:>9.3} {:>9.3}", ms(p50), ms(p99));
            if what.contains("server API") {
                let verb = what.trim().split(' ').next().unwrap_or("");
                let ok = p50 < Duration::from_millis(10) && p99 < Duration::from_millis(10);
                verdicts.push(format!(
                    "{name}: {verb} p50 {:.2} ms, p99 {:.2} ms: {} (target both under 10 ms)",
                    ms(p50),
                    ms(p99),
                    if ok { "met" } else { "NOT met" }
                ));
            }
        }
    }
    println!("{:<34} {:>9.3} {:>9.3}", "floor: keepalive round trip", ms(k50), ms(k99));
    println!("\nsummary");
    for v in verdicts {
        println!("  {v}");
    }
    for id in [idle, busy] {
        http.release(&id).await;
    }
}

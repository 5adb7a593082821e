//! Idle benchmark: calls as an RL rollout makes them, each after an idle gap (the policy
//! generating between turns), side by side in one run with its floor measured after the same gap.
//!
//! For idle gaps of 0 (a tight loop), 10 ms, 100 ms and 1 s, in rounds that interleave every
//! figure (each call waits out the gap, then is timed):
//! - exec of `/bin/true` through the server against spawning it directly;
//! - a 1 KiB file write through the server against `GET /v1/sandboxes/{id}` (the server alone);
//! - a command in a shell session through the server (`true`), against the same floors;
//! - the Python SDK's exec (`Sandbox.exec`), a raw `http.client` POST of it, and `posix_spawn` of
//!   `/bin/true` from the same Python (`sdk_idle.py`);
//! - the floor of waking alone: a byte passed through a chain of six `cat`s and back, seven
//!   processes each woken in turn, as a session command wakes client, server, daemon, shell,
//!   daemon, server and client, with no other work;
//!
//! then the daemon's RSS after 200 execs and one session, and a summary of the targets.
//!
//! `cargo bench -p sandman-cli --bench idle` after `./scripts/build-daemon` (it runs the static
//! daemon, isolated; `SANDMAND_STATIC` overrides). `SANDMAN_BENCH_N` sets the rounds after a
//! 100 ms gap (default 100; the tight loop and 10 ms run more, 1 s fewer); `SANDMAN_BENCH_GAPS`
//! the gaps in milliseconds (default `0,10,100,1000`); `SANDMAN_BENCH_PYTHON` the Python (as the
//! service benchmark). With `SANDMAN_BENCH_BASELINE=<dir>` (another build's `sandman` and
//! `sandmand`) that build's server is measured in the same rounds, so a change is compared side
//! by side with what it changes.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;
mod figures;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::Server;
use figures::{Conn, env_usize, pct, us};
use serde_json::json;

/// One server under test and the calls timed on it.
struct Side {
    name: String,
    server: Server,
    conn: Conn,
    exec: String,
    get: String,
    write: String,
    session: String,
    _state: Option<tempfile::TempDir>,
}

/// What one round times, in the order of [`Side::calls`] (and the spawn floor first).
const CALLS: [&str; 4] = ["exec", "GET", "write 1 KiB", "session"];

impl Side {
    async fn new(name: String, server: Server, state: Option<tempfile::TempDir>) -> Side {
        let http = server.client();
        let sb = http.create(json!({"image": "host"})).await;
        let id = sb["id"].as_str().unwrap().to_string();
        let mut conn = Conn::tcp(&server.addr, e2e::TOKEN).await;
        let session = conn.post_for(&format!("/v1/sandboxes/{id}/sessions"), &json!({})).await;
        let sid = session["id"].as_str().unwrap();
        Side {
            name,
            conn,
            exec: format!("/v1/sandboxes/{id}/exec"),
            get: format!("/v1/sandboxes/{id}"),
            write: format!("/v1/sandboxes/{id}/files?path=%2Ftmp%2Fidle%2Fw.txt"),
            session: format!("/v1/sandboxes/{id}/sessions/{sid}/run"),
            server,
            _state: state,
        }
    }

    /// The call `which` of [`CALLS`].
    async fn call(&mut self, which: usize) {
        match which {
            0 => {
                let r = self.conn.post_for(&self.exec, &json!({"argv": ["/bin/true"]})).await;
                assert_eq!(r["exit_code"], 0);
            }
            1 => {
                self.conn.get(&self.get).await;
            }
            2 => {
                self.conn.put(&self.write, bytes::Bytes::from(vec![b'x'; 1024]), "application/octet-stream").await;
            }
            _ => {
                let r = self.conn.post_for(&self.session, &json!({"command": "true"})).await;
                assert_eq!(r["exit_code"], 0);
            }
        }
    }
}

fn spawn_true() {
    assert!(std::process::Command::new("/bin/true").status().unwrap().success());
}

/// A chain of `cat`s a byte is passed through and back: each one woken in turn, and this
/// process last, [`RELAY_WAKES`] wakeups with no other work, the floor under a call that passes
/// through as many processes.
struct Relay {
    first: std::process::ChildStdin,
    last: std::process::ChildStdout,
    cats: Vec<std::process::Child>,
}

/// The processes a session command wakes in turn: client, server, daemon, shell, daemon, server,
/// client.
const RELAY_WAKES: usize = 7;

impl Relay {
    fn start() -> Relay {
        use std::process::{Command, Stdio};
        let mut cats: Vec<std::process::Child> = Vec::new();
        let mut first = None;
        for _ in 0..RELAY_WAKES - 1 {
            let stdin = match cats.last_mut() {
                Some(prev) => Stdio::from(prev.stdout.take().unwrap()),
                None => Stdio::piped(),
            };
            let mut cat = Command::new("cat").stdin(stdin).stdout(Stdio::piped()).spawn().unwrap();
            if first.is_none() {
                first = cat.stdin.take();
            }
            cats.push(cat);
        }
        let last = cats.last_mut().unwrap().stdout.take().unwrap();
        Relay { first: first.unwrap(), last, cats }
    }

    fn pass(&mut self) {
        use std::io::{Read, Write};
        self.first.write_all(b"x").unwrap();
        let mut back = [0u8];
        self.last.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"x");
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for cat in &mut self.cats {
            let _ = cat.kill();
            let _ = cat.wait();
        }
    }
}

/// Rounds after a gap of `gap_ms`: `base` after 100 ms, more for shorter gaps, fewer for 1 s.
fn rounds_for(gap_ms: u64, base: usize) -> usize {
    match gap_ms {
        0 => base * 3,
        1..=10 => base * 2,
        11..=100 => base,
        _ => (base / 8).max(5),
    }
}

fn p50(v: &mut [Duration]) -> Duration {
    v.sort();
    pct(v, 0.5)
}

fn main() {
    // One thread: the client is idle exactly when the gap says, with no worker of its own to wake.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(bench());
}

async fn bench() {
    let base = env_usize("SANDMAN_BENCH_N", 100);
    let gaps: Vec<u64> = std::env::var("SANDMAN_BENCH_GAPS")
        .ok()
        .map(|g| g.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![0, 10, 100, 1000]);
    let daemon = sandman_testkit::static_daemon();
    let scratch = std::env::var_os("SANDMAN_BENCH_DIR").map_or_else(e2e::scratch, PathBuf::from);
    let dir = tempfile::tempdir_in(&scratch).unwrap();
    let daemon_arg = daemon.display().to_string();
    let args = ["--daemon", &daemon_arg, "--default-lease-s", "3600", "--create-rate", "0"];
    let server = Server::start_in(&dir.path().join("state"), &args);
    println!("sandman idle benchmark: daemon {} (isolated, process provider)", daemon.display());
    let mut sides = vec![Side::new("this build".into(), server, None).await];
    if let Some((bdir, server, state)) = figures::baseline_server(&scratch) {
        sides.push(Side::new(format!("baseline {}", bdir.display()), server, Some(state)).await);
    }
    let mut relay = Relay::start();
    // Warm both: the first calls page in code and fill the pools.
    for _ in 0..50 {
        spawn_true();
        relay.pass();
        for side in &mut sides {
            for which in 0..CALLS.len() {
                side.call(which).await;
            }
        }
    }

    // times[gap][0] is the spawn floor, [1] the relay's; times[gap][FLOORS + side * CALLS + call]
    // the rest.
    const FLOORS: usize = 2;
    let width = FLOORS + sides.len() * CALLS.len();
    let mut summary = Vec::new();
    for &gap_ms in &gaps {
        let gap = Duration::from_millis(gap_ms);
        let rounds = rounds_for(gap_ms, base);
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); width];
        for round in 0..rounds {
            // Each round starts the rotation elsewhere, so no figure always follows the same one.
            for k in 0..width {
                let slot = (k + round) % width;
                // A tight loop: a block of the same call, as the other benchmarks time it.
                let repeat = if gap_ms == 0 { 10 } else { 1 };
                for _ in 0..repeat {
                    if !gap.is_zero() {
                        // The whole thread sleeps, as a client waiting on a model does.
                        std::thread::sleep(gap);
                    }
                    let t = Instant::now();
                    match slot {
                        0 => spawn_true(),
                        1 => relay.pass(),
                        _ => {
                            let (side, which) = ((slot - FLOORS) / CALLS.len(), (slot - FLOORS) % CALLS.len());
                            sides[side].call(which).await;
                        }
                    }
                    times[slot].push(t.elapsed());
                }
            }
        }
        let spawn = p50(&mut times[0]);
        let wakes = p50(&mut times[1]);
        println!();
        println!(
            "after an idle gap of {gap_ms} ms ({} calls each, interleaved)   p10 (us)   p50 (us)   p99 (us)   ratio to floor (p50)",
            times[0].len()
        );
        println!(
            "  {:<45} {:>8.0}   {:>8.0}   {:>8.0}",
            "direct spawn of /bin/true (floor)",
            us(pct(&times[0], 0.1)),
            us(spawn),
            us(pct(&times[0], 0.99))
        );
        println!(
            "  {:<45} {:>8.0}   {:>8.0}   {:>8.0}",
            format!("a byte through {} processes woken in turn", RELAY_WAKES),
            us(pct(&times[1], 0.1)),
            us(wakes),
            us(pct(&times[1], 0.99))
        );
        for (s, side) in sides.iter().enumerate() {
            let at = |which: usize| FLOORS + s * CALLS.len() + which;
            let get = p50(&mut times[at(1)]);
            for (which, name) in CALLS.iter().enumerate() {
                let v = &mut times[at(which)];
                let m = p50(v);
                let (floor, floor_name) = match which {
                    0 | 3 => (spawn, "spawn"),
                    2 => (get, "GET"),
                    _ => (Duration::ZERO, ""),
                };
                let ratio =
                    if floor.is_zero() { String::new() } else { format!("{:.2}x {floor_name}", us(m) / us(floor)) };
                println!(
                    "  {:<45} {:>8.0}   {:>8.0}   {:>8.0}   {ratio}",
                    format!("{name} ({})", side.name),
                    us(pct(v, 0.1)),
                    us(m),
                    us(pct(v, 0.99))
                );
            }
            let (exec, write, session) = (p50(&mut times[at(0)]), p50(&mut times[at(2)]), p50(&mut times[at(3)]));
            summary.push((gap_ms, s, us(exec) / us(spawn), us(write) / us(get), us(session), us(wakes)));
        }
    }

    // ---- the Python SDK after the same gaps ----
    for side in &sides {
        sdk_idle(side, &gaps, base);
    }

    // ---- the daemon's memory after 200 execs and one session ----
    println!();
    println!("daemon RSS after 200 execs and one session (a fresh sandbox)   right after   1.5 s later");
    let mut rss = Vec::new();
    for side in &mut sides {
        let http = side.server.client();
        let sb = http.create(json!({"image": "host"})).await;
        let id = sb["id"].as_str().unwrap().to_string();
        let mut conn = Conn::tcp(&side.server.addr, e2e::TOKEN).await;
        for _ in 0..200 {
            conn.post(&format!("/v1/sandboxes/{id}/exec"), &json!({"argv": ["/bin/true"]})).await;
        }
        let session = conn.post_for(&format!("/v1/sandboxes/{id}/sessions"), &json!({})).await;
        let sid = session["id"].as_str().unwrap().to_string();
        conn.post(&format!("/v1/sandboxes/{id}/sessions/{sid}/run"), &json!({"command": "true"})).await;
        let pid = inner_daemon(&side.server.state, &id).unwrap();
        let (now, threads) = (sandman_testkit::rss_kib(pid), threads_of(pid));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (later, threads_later) = (sandman_testkit::rss_kib(pid), threads_of(pid));
        println!(
            "  {:<55} {:>6.2} MiB ({threads} threads)   {:>6.2} MiB ({threads_later} threads)",
            side.name,
            now as f64 / 1024.0,
            later as f64 / 1024.0
        );
        rss.push(now);
        http.release(&id).await;
    }

    println!();
    println!(
        "summary (p50)                                     this build   target{}",
        match sides.get(1) {
            Some(_) => "   baseline",
            None => "",
        }
    );
    let line = |what: &str, pick: &dyn Fn(usize) -> Option<f64>, unit: &str, bound: f64| {
        let Some(v) = pick(0) else { return };
        let met = if v <= bound { "met" } else { "NOT MET" };
        let base = pick(1).map(|b| format!("   {b:>7.2}{unit}")).unwrap_or_default();
        println!("  {what:<47} {v:>7.2}{unit}   <= {bound}{unit} {met}{base}");
    };
    let at = |gap: u64, side: usize| summary.iter().find(|r| r.0 == gap && r.1 == side);
    line("exec via server / direct spawn, tight loop", &|s| at(0, s).map(|r| r.2), "x", 1.4);
    line("exec via server / direct spawn, after 100 ms", &|s| at(100, s).map(|r| r.2), "x", 1.5);
    line("1 KiB write / GET sandbox, after 100 ms", &|s| at(100, s).map(|r| r.3), "x", 2.0);
    line("session command, after 100 ms (ms)", &|s| at(100, s).map(|r| r.4 / 1e3), "", 0.6);
    if let Some(r) = at(100, 0) {
        println!(
            "    (waking {RELAY_WAKES} processes in turn, nothing else, after 100 ms: {:.2} ms; the session's other work: {:.2} ms)",
            r.5 / 1e3,
            (r.4 - r.5) / 1e3
        );
    }
    line("daemon RSS, 200 execs and one session (MiB)", &|s| rss.get(s).map(|k| *k as f64 / 1024.0), "", 4.0);
    for side in &sides {
        let _ = side.server.client().release(side.exec.split('/').nth(3).unwrap()).await;
    }
}

/// The in-sandbox daemon of an isolated sandbox: the child of the waiter `daemon.pid` names.
fn inner_daemon(state: &Path, id: &str) -> Option<u32> {
    let pids = std::fs::read_to_string(state.join(format!("sandboxes/{id}/daemon.pid"))).ok()?;
    let waiter: u32 = pids.split_whitespace().next()?.parse().ok()?;
    let children = std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children")).unwrap_or_default();
    Some(children.split_whitespace().next().and_then(|p| p.parse().ok()).unwrap_or(waiter))
}

fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0)
}

/// The Python SDK's exec after each gap, beside a raw `http.client` call and `posix_spawn` from
/// the same Python, from `sdk_idle.py`.
fn sdk_idle(side: &Side, gaps: &[u64], base: usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var_os("SANDMAN_BENCH_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        let venv = root.join("target/py/bin/python");
        if venv.exists() { venv } else { PathBuf::from("python3") }
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/sdk_idle.py");
    let id = side.exec.split('/').nth(3).unwrap();
    let plan: Vec<String> = gaps.iter().map(|g| format!("{g}:{}", rounds_for(*g, base).min(base))).collect();
    let out = std::process::Command::new(&python)
        .arg(&script)
        .args([&side.server.url, e2e::TOKEN, id, &plan.join(",")])
        .env("PYTHONPATH", root.join("python"))
        .output();
    println!();
    let parsed = out
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok());
    let Some(v) = parsed else {
        println!(
            "the Python SDK after idle gaps: not measured ({} cannot run {}; set SANDMAN_BENCH_PYTHON to a Python with httpx)",
            python.display(),
            script.display()
        );
        return;
    };
    println!("exec of /bin/true from Python ({}), p50 (us)    SDK   http.client  posix_spawn   SDK/spawn", side.name);
    for g in gaps {
        let f = |k: &str| v[g.to_string()][k].as_f64().unwrap_or(0.0);
        println!(
            "  after {:>4} ms ({:>3} calls each)                {:>6.0}   {:>6.0}       {:>6.0}       {:.2}x",
            g,
            v[g.to_string()]["n"].as_u64().unwrap_or(0),
            f("sdk"),
            f("raw"),
            f("spawn"),
            f("sdk") / f("spawn")
        );
    }
}

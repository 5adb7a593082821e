//! Service benchmark, side by side in one run: every figure of the service's performance
//! targets, each with its ratio to its floor, then a summary table.
//!
//! - the exec round trip through server and daemon vs the daemon alone vs a direct spawn; a
//!   1 KiB file write through the server vs that exec and vs a call the server answers itself
//!   (and the same write to the daemon alone, which shows the server's share);
//! - a 1,000-file tar uploaded through the server vs `tar -x` run directly;
//! - one daemon's throughput with 8 concurrent clients vs 8 threads spawning directly, and its
//!   idle RSS;
//! - the Python SDK's exec vs a raw `httpx` client (`sdk_exec.py`, with the worktree's SDK);
//! - create-to-ready of the process provider (isolated, `--isolation none`, eval);
//! - the floor of a create rate: bare isolated starts (one exec of /bin/true as PID 1 of a
//!   sandbox's namespaces, with a fresh /proc), the same without the exec, and bare spawns, 16 at
//!   a time as the creates, from a small process of this binary (`SANDMAN_BENCH_FLOOR`);
//! - density: `SANDMAN_BENCH_SANDBOXES` sandboxes (default 2000) held by one server at once,
//!   each answering an exec; their PSS, the server's bytes and open files per sandbox, the CPU a
//!   create costs the server, the sandbox's own processes and the whole machine (and so the most
//!   creates a second the machine's cores allow), create, list and release rates and the sandbox's CPU per create
//!   (first half vs second half, to show nothing grows worse than linearly), and a check that
//!   nothing is left after the release (process, mount, cgroup, directory).
//!
//! `cargo bench -p sandman-cli --bench service` after `./scripts/build-daemon` (it runs the static
//! daemon; `SANDMAND_STATIC` overrides). `SANDMAN_BENCH_DIR` is where the servers' state
//! directories go (default: the tests' scratch directory; the file system type is printed, as
//! file writes and creates cost what it charges). `SANDMAN_BENCH_N` sets the rounds of the round-trip
//! runs; `SANDMAN_BENCH_PYTHON` the Python with `httpx` (default `target/py/bin/python`, which
//! `./scripts/test` makes, else `python3`). Create-to-ready is measured isolated and with
//! `--isolation none`, interleaved; with `SANDMAN_BENCH_BASELINE=<dir>` (a directory holding
//! another build's `sandman` and `sandmand`, e.g. the previous release) that build's
//! create-to-ready is measured in the same interleaving.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/e2e/mod.rs"]
mod e2e;
mod figures;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{Http, Server};
use figures::{Conn, env_usize, pct, pss_kib, us};
use serde_json::json;

/// One line of the closing summary: a figure, the floor it is measured against, and the target
/// on their ratio.
struct Row {
    what: &'static str,
    value: String,
    floor: String,
    ratio: Option<f64>,
    /// The target: `(bound, true)` means the ratio must be at most `bound`, `false` at least.
    target: Option<(f64, bool)>,
}

impl Row {
    fn print(&self) {
        let ratio = self.ratio.map(|r| format!("{r:.2}x")).unwrap_or_else(|| "-".into());
        let (target, met) = match (self.target, self.ratio) {
            (Some((bound, at_most)), Some(r)) => {
                let met = if at_most { r <= bound } else { r >= bound };
                (format!("{} {bound}", if at_most { "<=" } else { ">=" }), if met { "met" } else { "NOT MET" })
            }
            _ => ("-".into(), ""),
        };
        println!("  {:<44} {:>16}  {:>18}  {:>8}  {:>8}  {met}", self.what, self.value, self.floor, ratio, target);
    }
}

fn main() {
    // The floor's runs start from a fresh process of this binary, small and single-threaded, as
    // the server's spawner is: a fork of this whole benchmark would cost more than the runs.
    if let Ok(floor) = std::env::var(FLOOR_ENV) {
        floor_runs(&floor);
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(bench());
}

fn p50_us(v: &mut [Duration]) -> f64 {
    v.sort();
    us(pct(v, 0.5))
}

/// The in-sandbox daemon of an isolated sandbox: the child of the waiter `daemon.pid` names
/// (the waiter itself without isolation).
fn inner_daemon(state: &Path, id: &str) -> Option<u32> {
    let pids = std::fs::read_to_string(state.join(format!("sandboxes/{id}/daemon.pid"))).ok()?;
    let waiter: u32 = pids.split_whitespace().next()?.parse().ok()?;
    Some(children_of(waiter).first().copied().unwrap_or(waiter))
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Nanoseconds `pid` has run, all its threads together (`/proc/<pid>/task/*/schedstat`; finer
/// than `stat`'s clock ticks, which round a short-lived daemon's start to nothing).
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| {
            std::fs::read_to_string(t.path().join("schedstat")).ok()?.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum::<u64>()
}

/// The machine's CPU time so far, in clock ticks: busy (all but idle and I/O wait) and all,
/// summed over its cores (`/proc/stat`).
fn machine_cpu() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|t| t.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let all: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((all - idle, all))
}

/// Clock ticks a second, the unit of `/proc/stat`.
#[allow(unsafe_code)]
fn clock_ticks() -> f64 {
    // SAFETY: sysconf takes a constant and reads nothing of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// Memory cgroups removed but not yet freed by the kernel (kept alive by the page cache charged
/// to them): cgroup v2's `nr_dying_descendants`, or under v1 the memory controller's cgroups less
/// the directories of its hierarchy.
fn dying_memory_cgroups() -> Option<usize> {
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if !v1.is_dir() {
        let stat = std::fs::read_to_string("/sys/fs/cgroup/cgroup.stat").ok()?;
        return stat.lines().find_map(|l| l.strip_prefix("nr_dying_descendants ")?.trim().parse().ok());
    }
    let table = std::fs::read_to_string("/proc/cgroups").ok()?;
    // `subsys_name hierarchy num_cgroups enabled`
    let total: usize = table.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        if f.next()? != "memory" {
            return None;
        }
        f.nth(1)?.parse().ok()
    })?;
    fn dirs(d: &Path) -> usize {
        std::fs::read_dir(d).map_or(0, |entries| {
            entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| 1 + dirs(&e.path())).sum()
        })
    }
    Some(total.saturating_sub(1 + dirs(v1)))
}

/// The file system type `path` lives on (the longest mount point over it in `/proc/mounts`).
fn fs_type(path: &Path) -> String {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (point, kind) = (f.nth(1)?, f.next()?);
            path.starts_with(point).then(|| (point.len(), kind.to_string()))
        })
        .max()
        .map_or_else(|| "?".into(), |(_, kind)| kind)
}

fn open_files_limit(pid: u32) -> String {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
    limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .unwrap_or("?")
        .to_string()
}

/// A tar of `n` small files (100 bytes each) in `n / 100` directories.
fn many_files_tar(n: usize) -> bytes::Bytes {
    let mut builder = tar::Builder::new(Vec::new());
    let data = [b'x'; 100];
    for i in 0..n {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(1_700_000_000);
        header.set_cksum();
        builder.append_data(&mut header, format!("d{}/f{i}.txt", i / 100), &data[..]).unwrap();
    }
    bytes::Bytes::from(builder.into_inner().unwrap())
}

/// `tar -x` of `tar` into `dir`, run directly.
fn tar_x(tar: &[u8], dir: &Path) {
    use std::io::Write;
    std::fs::create_dir_all(dir).unwrap();
    let mut child = std::process::Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(dir)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(tar).unwrap();
    assert!(child.wait().unwrap().success());
}

/// What the released sandboxes `ids` may have left: processes, mounts, cgroups, directories.
/// Only theirs: other servers on the machine may share the server's cgroup.
fn leftovers(state: &Path, server_pid: u32, ids: &[String]) -> (usize, usize, usize, usize) {
    let needle = state.display().to_string();
    // The server's own, not a sandbox's: it and the isolation template it holds while it runs.
    let template = |pid: i32| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .unwrap_or_default()
            .split(|b| *b == 0)
            .any(|a| a == b"isolation-template")
    };
    let processes =
        e2e::processes_mentioning(&needle).into_iter().filter(|p| *p as u32 != server_pid && !template(*p)).count();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounts = mounts.lines().filter(|l| l.contains(&needle)).count();
    let mut cgroups = 0;
    let own = std::fs::read_to_string(format!("/proc/{server_pid}/cgroup")).unwrap_or_default();
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let base = if controllers.is_empty() {
            PathBuf::from("/sys/fs/cgroup")
        } else if let Some(c) = ["cpu", "memory", "pids"].iter().find(|c| controllers.split(',').any(|x| x == **c)) {
            PathBuf::from("/sys/fs/cgroup").join(c)
        } else {
            continue;
        };
        let dir = base.join(path.trim_start_matches('/'));
        cgroups += ids.iter().filter(|id| dir.join(format!("sandman-{id}")).exists()).count();
    }
    let dirs = std::fs::read_dir(state.join("sandboxes")).map(|d| d.count()).unwrap_or(0);
    (processes, mounts, cgroups, dirs)
}

async fn bench() {
    let rounds = env_usize("SANDMAN_BENCH_N", 1000);
    let density = env_usize("SANDMAN_BENCH_SANDBOXES", 2000);
    let daemon = sandman_testkit::static_daemon();
    let scratch = std::env::var_os("SANDMAN_BENCH_DIR").map_or_else(e2e::scratch, PathBuf::from);
    let dir = tempfile::tempdir_in(&scratch).unwrap();
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
            // Every sandbox still gets the default memory limit (its own memory cgroup); what
            // the machine's memory would admit at once is not what this measures.
            "--memory-overcommit",
            "0",
        ],
    );
    let http = server.client();
    let mut summary: Vec<Row> = Vec::new();
    println!("sandman service benchmark: daemon {}", daemon.display());
    println!("  state directory {} ({}; sandboxes' files and records live there)", state.display(), fs_type(&state));
    if let Some(dying) = dying_memory_cgroups() {
        println!("  dying memory cgroups on the machine: {dying}");
        if dying > 100 {
            println!(
                "  warning: each memory cgroup, a dying one too, holds a slot per file system the \
                 machine has numbered, and a mount past the most ever numbered (several per isolated \
                 sandbox) grows them all: 4,000 dying ones made creates 42% slower on this project's \
                 test machine. Cached pages other work charged to them keep them; \
                 `sync; echo 1 > /proc/sys/vm/drop_caches` frees them."
            );
        }
    }

    // ---- idle daemon, before any call but readiness ----
    let idle = http.create(json!({"image": "host"})).await;
    let idle_id = idle["id"].as_str().unwrap().to_string();
    let idle_pid = inner_daemon(&state, &idle_id).unwrap();
    let idle_rss = sandman_testkit::rss_kib(idle_pid);

    // ---- round trips: exec, a call the server answers itself, 1 KiB writes ----
    let sb = http.create(json!({"image": "host"})).await;
    let id = sb["id"].as_str().unwrap().to_string();
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join(format!("sandboxes/{id}/record.json"))).unwrap()).unwrap();
    let daemon_token = record["token"].as_str().unwrap().to_string();
    let socket = state.join(format!("sandboxes/{id}/d.sock"));
    let mut via_server = Conn::tcp(&server.addr, e2e::TOKEN).await;
    let mut via_daemon = Conn::unix(&socket, &daemon_token).await;
    let body = json!({"argv": ["/bin/true"]});
    let exec_path = format!("/v1/sandboxes/{id}/exec");
    let get_path = format!("/v1/sandboxes/{id}");
    let write_path = format!("/v1/sandboxes/{id}/files?path=%2Ftmp%2Fbench%2Fw.txt");
    let fsync_path = format!("{write_path}&fsync=true");
    let daemon_write_path = "/v1/files?path=%2Ftmp%2Fbench%2Fd.txt";
    let kib = bytes::Bytes::from(vec![b'x'; 1024]);
    let octets = "application/octet-stream";
    for _ in 0..100 {
        via_server.post(&exec_path, &body).await;
        via_daemon.post("/v1/exec", &body).await;
        via_server.put(&write_path, kib.clone(), octets).await;
    }
    // A daemon from before `fsync` existed refuses it (SANDMAND_STATIC pointing at an old build).
    let fsync_rounds =
        if via_server.try_send("PUT", &fsync_path, kib.clone(), Some(octets)).await == 200 { 10 } else { 0 };
    let (mut s, mut d, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    let (mut get, mut write, mut write_fsync, mut daemon_write) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    while s.len() < rounds {
        for _ in 0..50 {
            let t = Instant::now();
            via_server.post(&exec_path, &body).await;
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
        for _ in 0..50 {
            let t = Instant::now();
            via_server.get(&get_path).await;
            get.push(t.elapsed());
        }
        for _ in 0..50 {
            let t = Instant::now();
            via_server.put(&write_path, kib.clone(), octets).await;
            write.push(t.elapsed());
        }
        for _ in 0..50 {
            let t = Instant::now();
            via_daemon.put(daemon_write_path, kib.clone(), octets).await;
            daemon_write.push(t.elapsed());
        }
        for _ in 0..fsync_rounds {
            let t = Instant::now();
            via_server.put(&fsync_path, kib.clone(), octets).await;
            write_fsync.push(t.elapsed());
        }
    }
    for v in [&mut s, &mut d, &mut direct, &mut get, &mut write, &mut write_fsync, &mut daemon_write] {
        v.sort();
    }
    let row = |name: &str, v: &[Duration]| {
        println!("  {name:<42} {:>8.0}   {:>8.0}", us(pct(v, 0.5)), us(pct(v, 0.99)));
    };
    println!();
    println!("round trips ({rounds} rounds, interleaved)          p50 (us)   p99 (us)");
    row("exec /bin/true: server + daemon", &s);
    row("exec /bin/true: daemon alone (unix socket)", &d);
    row("exec /bin/true: direct spawn", &direct);
    row("GET /v1/sandboxes/{id} (the server alone)", &get);
    row("PUT 1 KiB file through the server", &write);
    row("PUT 1 KiB file, fsync=true", &write_fsync);
    row("PUT 1 KiB file: daemon alone (unix socket)", &daemon_write);
    println!(
        "  server overhead over the daemon alone       {:>7.0}%   {:>7.0}%   (target < 30%)",
        (us(pct(&s, 0.5)) / us(pct(&d, 0.5)) - 1.0) * 100.0,
        (us(pct(&s, 0.99)) / us(pct(&d, 0.99)) - 1.0) * 100.0
    );
    let (w50, s50, g50) = (us(pct(&write, 0.5)), us(pct(&s, 0.5)), us(pct(&get, 0.5)));
    summary.push(Row {
        what: "exec via server / direct spawn (p50)",
        value: format!("{s50:.0} us"),
        floor: format!("{:.0} us", us(pct(&direct, 0.5))),
        ratio: Some(s50 / us(pct(&direct, 0.5))),
        target: None,
    });
    summary.push(Row {
        what: "1 KiB write / exec via server (p50)",
        value: format!("{w50:.0} us"),
        floor: format!("{s50:.0} us"),
        ratio: Some(w50 / s50),
        target: Some((0.5, true)),
    });
    summary.push(Row {
        what: "1 KiB write / GET sandbox (p50)",
        value: format!("{w50:.0} us"),
        floor: format!("{g50:.0} us"),
        ratio: Some(w50 / g50),
        target: Some((3.0, true)),
    });
    summary.push(Row {
        what: "1 KiB write fsync=true / GET sandbox (p50)",
        value: format!("{:.0} us", us(pct(&write_fsync, 0.5))),
        floor: format!("{g50:.0} us"),
        ratio: Some(us(pct(&write_fsync, 0.5)) / g50),
        target: None,
    });

    // ---- many small files: a 1,000-file tar through the server vs tar -x directly ----
    let tar = many_files_tar(1000);
    let direct_dir = tempfile::tempdir_in(&scratch).unwrap();
    let (mut up, mut untar) = (Vec::new(), Vec::new());
    for round in 0..7 {
        let t = Instant::now();
        via_server
            .put(&format!("/v1/sandboxes/{id}/archive?path=%2Ftmp%2Ftar{round}"), tar.clone(), "application/x-tar")
            .await;
        up.push(t.elapsed());
        let t = Instant::now();
        tar_x(&tar, &direct_dir.path().join(format!("tar{round}")));
        untar.push(t.elapsed());
    }
    let (up50, untar50) = (p50_us(&mut up), p50_us(&mut untar));
    println!();
    println!("a 1,000-file tar ({} KiB), 7 rounds interleaved, p50", tar.len() / 1024);
    println!("  through the server (PUT /archive)      {:>8.1} ms", up50 / 1e3);
    println!("  tar -x run directly                    {:>8.1} ms", untar50 / 1e3);
    summary.push(Row {
        what: "1,000-file tar upload / tar -x (p50)",
        value: format!("{:.1} ms", up50 / 1e3),
        floor: format!("{:.1} ms", untar50 / 1e3),
        ratio: Some(up50 / untar50),
        target: None,
    });

    // ---- one daemon, 8 concurrent clients vs 8 threads spawning directly ----
    let clients = 8;
    let per_client = (rounds / 4).max(50);
    let (mut daemon_secs, mut direct_secs) = (0.0, 0.0);
    for _ in 0..2 {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let (socket, token, body) = (socket.clone(), daemon_token.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::unix(&socket, &token).await;
                for _ in 0..per_client {
                    conn.post("/v1/exec", &body).await;
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        daemon_secs += t.elapsed().as_secs_f64();
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
        direct_secs += t.elapsed().as_secs_f64();
    }
    let n = (2 * clients * per_client) as f64;
    let (daemon_rate, direct_rate) = (n / daemon_secs, n / direct_secs);
    let busy_pid = inner_daemon(&state, &id).unwrap();
    println!();
    println!("concurrent execs of /bin/true, {clients} clients x {per_client}, twice, interleaved");
    println!("  one daemon (unix socket)               {daemon_rate:>8.0} execs/s");
    println!("  {clients} threads spawning directly          {direct_rate:>8.0} execs/s");
    println!(
        "  daemon RSS: idle at start {:.2} MiB, after the load {:.2} MiB",
        idle_rss as f64 / 1024.0,
        sandman_testkit::rss_kib(busy_pid) as f64 / 1024.0
    );
    summary.push(Row {
        what: "8 clients on one daemon / 8 threads direct",
        value: format!("{daemon_rate:.0}/s"),
        floor: format!("{direct_rate:.0}/s"),
        ratio: Some(daemon_rate / direct_rate),
        target: Some((0.9, false)),
    });
    summary.push(Row {
        what: "daemon idle RSS / 4 MiB",
        value: format!("{:.2} MiB", idle_rss as f64 / 1024.0),
        floor: "4 MiB".into(),
        ratio: Some(idle_rss as f64 / 4096.0),
        target: Some((1.0, true)),
    });

    // ---- the Python SDK's exec vs a raw httpx client ----
    sdk_overhead(&server, &id, rounds, &mut summary).await;
    http.release(&id).await;
    http.release(&idle_id).await;
    // ---- create to ready: isolated against not isolated (and a baseline build), interleaved ----
    let plain_dir = tempfile::tempdir_in(&scratch).unwrap();
    let plain = Server::start_in(
        &plain_dir.path().join("state"),
        &["--daemon", &daemon_arg, "--isolation", "none", "--create-rate", "0"],
    );
    let baseline = figures::baseline_server(&scratch);
    let mut sides: Vec<(String, Http)> =
        vec![("isolated (--isolation full)".into(), http.clone()), ("--isolation none".into(), plain.client())];
    if let Some((dir, server, _)) = &baseline {
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

    // ---- the floor of a create rate: bare starts, as many at a time as the creates below ----
    let floor_n = density.min(2000);
    let bare_isolated = floor_rate(Floor::Isolated, floor_n);
    let bare_forked = floor_rate(Floor::IsolatedForked, floor_n);
    let bare_spawn = floor_rate(Floor::Spawn, floor_n);

    // ---- density ----
    let server_pid = server.pid();
    let server_before = sandman_testkit::rss_kib(server_pid);
    let fds_before = open_fds(server_pid);
    let server_cpu_before = cpu_ns(server_pid);
    let machine_before = machine_cpu();
    let t = Instant::now();
    let (created, create_halves) = create_many(&http, density, 16).await;
    let create_secs = t.elapsed().as_secs_f64();
    // All the machine's CPU the creates took, whichever process (or the kernel) spent it: the
    // processes a start makes and that exit (the exec'd image before it is the waiter, the
    // user-namespace helper) count here, and not in the per-process figures below.
    let machine = machine_cpu().zip(machine_before).map(|((busy, all), (busy0, all0))| {
        let busy_ms = (busy - busy0) as f64 * 1e3 / clock_ticks();
        (busy_ms / created.len().max(1) as f64, (busy - busy0) as f64 / (all - all0).max(1) as f64)
    });
    // What a create costs the machine: the server's share, and the sandbox's own processes' (its
    // daemon's start, and when isolated its waiter's), read before any of them runs a command.
    let server_cpu = cpu_ns(server_pid).saturating_sub(server_cpu_before) as f64 / 1e6 / created.len().max(1) as f64;
    // Per sandbox, in the order their creates completed: the halves' means show whether a create
    // costs more with more sandboxes held, in CPU time, which the machine's other work skews less
    // than it does rates.
    let per_sandbox_cpu: Vec<u64> = created
        .iter()
        .map(|id| {
            inner_daemon(&state, id)
                .map_or(0, |pid| cpu_ns(pid) + children_of(pid).into_iter().map(cpu_ns).sum::<u64>())
        })
        .collect();
    let mean_ms = |v: &[u64]| v.iter().sum::<u64>() as f64 / 1e6 / v.len().max(1) as f64;
    let sandbox_cpu = mean_ms(&per_sandbox_cpu);
    let (cpu_first, cpu_second) = per_sandbox_cpu.split_at(per_sandbox_cpu.len() / 2);
    let sandbox_cpu_halves = (mean_ms(cpu_first), mean_ms(cpu_second));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let ceiling = cores * 1e3 / (server_cpu + sandbox_cpu);
    let t = Instant::now();
    let answered = exec_all(&http, &created, 16).await;
    let exec_secs = t.elapsed().as_secs_f64();
    let server_after = sandman_testkit::rss_kib(server_pid);
    let fds_after = open_fds(server_pid);
    let list_full = list_time(&http).await;
    let mut daemon_kib = Vec::new();
    let mut daemon_pss = Vec::new();
    for id in &created {
        let pids = std::fs::read_to_string(state.join(format!("sandboxes/{id}/daemon.pid"))).unwrap_or_default();
        if let Some(pid) = pids.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()) {
            // The daemon and, when isolated, the small waiter that started it.
            let (mut rss, mut pss) = (sandman_testkit::rss_kib(pid), pss_kib(pid));
            for child in children_of(pid) {
                rss += sandman_testkit::rss_kib(child);
                pss += pss_kib(child);
            }
            daemon_kib.push(rss);
            daemon_pss.push(pss);
        }
    }
    daemon_kib.sort();
    daemon_pss.sort();
    let held = created.len().max(1) as f64;
    let per_sandbox_server = (server_after.saturating_sub(server_before) * 1024) / created.len().max(1) as u64;
    let fds_per_sandbox = fds_after.saturating_sub(fds_before) as f64 / held;
    println!();
    println!(
        "sandboxes held at once: {} of {density} created in {create_secs:.1} s ({:.0}/s), {answered} answered an exec in {exec_secs:.1} s",
        created.len(),
        created.len() as f64 / create_secs
    );
    println!("  create rate: first half {:.0}/s, second half {:.0}/s", create_halves.0, create_halves.1);
    let rate = |r: Option<f64>| r.map_or("not measured (it failed)".to_string(), |r| format!("{r:.0}/s"));
    println!(
        "  floor, {floor_n} runs 16 at a time from a small process: bare isolated start (one exec of /bin/true as PID 1 of a sandbox's namespaces, with a fresh /proc) {}, the same forked without the exec {}, bare spawn of /bin/true {}",
        rate(bare_isolated),
        rate(bare_forked),
        rate(bare_spawn)
    );
    println!(
        "  CPU per create: server {server_cpu:.2} ms, the sandbox's processes {sandbox_cpu:.2} ms: at most {ceiling:.0}/s on {cores} cores"
    );
    if let Some((per_create, busy)) = machine {
        println!(
            "  the whole machine's CPU per create: {per_create:.2} ms ({:.0}% of its {cores} cores busy during the creates): at most {:.0}/s",
            busy * 100.0,
            cores * 1e3 / per_create
        );
    }
    println!(
        "  the sandbox's processes' CPU per create: first half {:.2} ms, second half {:.2} ms",
        sandbox_cpu_halves.0, sandbox_cpu_halves.1
    );
    let mib = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0) as f64 / 1024.0;
    let pss_mean = daemon_pss.iter().sum::<u64>() as f64 / daemon_pss.len().max(1) as f64 / 1024.0;
    println!(
        "  per sandbox, the daemon and its namespace waiter: RSS p50 {:.2} MiB (shared pages counted in full), PSS p50 {:.2} MiB, mean {pss_mean:.2} MiB, max {:.2} MiB",
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
    println!(
        "  server open files        {fds_before} -> {fds_after} ({fds_per_sandbox:.2} per sandbox; its limit {})",
        open_files_limit(server_pid)
    );
    // Half released, then the list again: its cost per sandbox listed should not grow with N.
    let (first, second) = created.split_at(created.len() / 2);
    let t = Instant::now();
    release_all(&http, first, 16).await;
    let release_first = first.len() as f64 / t.elapsed().as_secs_f64();
    let list_half = list_time(&http).await;
    let t = Instant::now();
    release_all(&http, second, 16).await;
    let release_second = second.len() as f64 / t.elapsed().as_secs_f64();
    let total_release =
        created.len() as f64 / (first.len() as f64 / release_first + second.len() as f64 / release_second);
    println!(
        "  release rate: first half {release_first:.0}/s, second half {release_second:.0}/s ({total_release:.0}/s overall)"
    );
    let (live_full, live_half) = (created.len() + 2, second.len() + 2);
    println!(
        "  GET /v1/sandboxes: {:.1} ms with {live_full} listed ({:.2} us each), {:.1} ms with {live_half} ({:.2} us each)",
        list_full * 1e3,
        list_full * 1e6 / live_full as f64,
        list_half * 1e3,
        list_half * 1e6 / live_half as f64
    );
    // What the releases left, polled until nothing or a deadline: deletes finish in the background.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut left = leftovers(&state, server_pid, &created);
    while left != (0, 0, 0, 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        left = leftovers(&state, server_pid, &created);
    }
    println!(
        "  left after the release: {} processes, {} mounts, {} cgroups, {} sandbox directories",
        left.0, left.1, left.2, left.3
    );
    summary.push(Row {
        what: "sandboxes held at once / asked",
        value: format!("{}", created.len()),
        floor: format!("{density}"),
        ratio: Some(answered as f64 / density as f64),
        target: Some((1.0, false)),
    });
    summary.push(Row {
        what: "create rate / 1,000 per s",
        value: format!("{:.0}/s", created.len() as f64 / create_secs),
        floor: "1000/s".into(),
        ratio: Some(created.len() as f64 / create_secs / 1000.0),
        target: Some((1.0, false)),
    });
    let create_rate = created.len() as f64 / create_secs;
    for (what, floor) in
        [("create rate / bare isolated starts", bare_isolated), ("create rate / bare isolated forks", bare_forked)]
    {
        if let Some(floor) = floor {
            summary.push(Row {
                what,
                value: format!("{create_rate:.0}/s"),
                floor: format!("{floor:.0}/s"),
                ratio: Some(create_rate / floor),
                target: None,
            });
        }
    }
    if let Some((per_create, _)) = machine {
        summary.push(Row {
            what: "create rate / what the machine's CPU allows",
            value: format!("{create_rate:.0}/s"),
            floor: format!("{:.0}/s", cores * 1e3 / per_create),
            ratio: Some(create_rate * per_create / (cores * 1e3)),
            target: None,
        });
    }
    summary.push(Row {
        what: "create rate / what its CPU allows",
        value: format!("{:.0}/s", created.len() as f64 / create_secs),
        floor: format!("{ceiling:.0}/s"),
        ratio: Some(created.len() as f64 / create_secs / ceiling),
        target: None,
    });
    summary.push(Row {
        what: "create rate, second half / first half",
        value: format!("{:.0}/s", create_halves.1),
        floor: format!("{:.0}/s", create_halves.0),
        ratio: Some(create_halves.1 / create_halves.0),
        target: None,
    });
    summary.push(Row {
        what: "sandbox CPU per create, second half / first",
        value: format!("{:.2} ms", sandbox_cpu_halves.1),
        floor: format!("{:.2} ms", sandbox_cpu_halves.0),
        ratio: Some(sandbox_cpu_halves.1 / sandbox_cpu_halves.0),
        target: None,
    });
    summary.push(Row {
        what: "release rate, second half / first half",
        value: format!("{release_second:.0}/s"),
        floor: format!("{release_first:.0}/s"),
        ratio: Some(release_second / release_first),
        target: None,
    });
    summary.push(Row {
        what: "list cost per sandbox, N / N/2",
        value: format!("{:.2} us", list_full * 1e6 / live_full as f64),
        floor: format!("{:.2} us", list_half * 1e6 / live_half as f64),
        ratio: Some((list_full / live_full as f64) / (list_half / live_half as f64)),
        target: None,
    });
    summary.push(Row {
        what: "sandbox PSS (daemon + waiter, mean)",
        value: format!("{pss_mean:.2} MiB"),
        floor: "-".into(),
        ratio: None,
        target: None,
    });
    summary.push(Row {
        what: "server bytes per sandbox",
        value: format!("{per_sandbox_server}"),
        floor: "-".into(),
        ratio: None,
        target: None,
    });
    summary.push(Row {
        what: "server open files per sandbox",
        value: format!("{fds_per_sandbox:.2}"),
        floor: "-".into(),
        ratio: None,
        target: None,
    });
    summary.push(Row {
        what: "left after release (proc, mount, cgroup, dir)",
        value: format!("{} {} {} {}", left.0, left.1, left.2, left.3),
        floor: "0 0 0 0".into(),
        ratio: None,
        target: None,
    });

    println!();
    println!("summary ({density} sandboxes)                         value               floor     ratio    target");
    for row in &summary {
        row.print();
    }
}

/// The seconds `GET /v1/sandboxes` takes (the best of three).
async fn list_time(http: &Http) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let r = http.get("/v1/sandboxes").await;
        assert_eq!(r.status, 200);
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// The Python SDK's exec against a raw `httpx` client, from `sdk_exec.py`.
async fn sdk_overhead(server: &Server, id: &str, rounds: usize, summary: &mut Vec<Row>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var_os("SANDMAN_BENCH_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        let venv = root.join("target/py/bin/python");
        if venv.exists() { venv } else { PathBuf::from("python3") }
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/sdk_exec.py");
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script).args([&server.url, e2e::TOKEN, id, &rounds.to_string()]).env("PYTHONPATH", root.join("python"));
    let out = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap();
    println!();
    let parsed = out
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok());
    let Some(v) = parsed else {
        println!(
            "the Python SDK vs raw httpx: not measured ({} cannot run {}; set SANDMAN_BENCH_PYTHON to a Python with httpx)",
            python.display(),
            script.display()
        );
        return;
    };
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    println!("exec of /bin/true from Python ({rounds} rounds, interleaved)   p50 (us)   p99 (us)");
    println!("  the SDK (sandman.Sandman, sync)                {:>8.0}   {:>8.0}", f("sdk_p50"), f("sdk_p99"));
    println!("  a raw httpx.Client                             {:>8.0}   {:>8.0}", f("raw_p50"), f("raw_p99"));
    summary.push(Row {
        what: "Python SDK exec / raw httpx (p50)",
        value: format!("{:.0} us", f("sdk_p50")),
        floor: format!("{:.0} us", f("raw_p50")),
        ratio: Some(f("sdk_p50") / f("raw_p50")),
        target: Some((1.3, true)),
    });
}

fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The environment variable that makes this binary run the floor's starts ([`floor_runs`]).
const FLOOR_ENV: &str = "SANDMAN_BENCH_FLOOR";

/// What a run of the floor starts, 16 at a time.
#[derive(Debug, Clone, Copy)]
enum Floor {
    /// One exec of /bin/true as PID 1 of a sandbox's namespaces (user, mount, pid, ipc, uts,
    /// cgroup; not its network), with a fresh /proc, and nothing else: no root of its own, no
    /// cgroups, no daemon, no server. A sandbox's start does all of it and more.
    Isolated,
    /// The same without the exec: PID 1 mounts /proc and exits. What a start that forks its
    /// daemon from a running process, rather than exec'ing one, could come down to.
    IsolatedForked,
    /// A spawn of /bin/true.
    Spawn,
}

/// Runs `n` starts of `what`, 16 at a time, from a fresh process of this binary: starts a second,
/// or `None` when they failed (not root, say).
fn floor_rate(what: Floor, n: usize) -> Option<f64> {
    let out = std::process::Command::new(std::env::current_exe().ok()?)
        .env(FLOOR_ENV, format!("{}:{n}", what as u8))
        .stderr(std::process::Stdio::inherit())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// The floor's child ([`FLOOR_ENV`] = `<kind>:<n>`): forks 16 runners, each making its share of
/// the starts one after another, and prints the starts a second (nothing when any failed).
#[allow(unsafe_code)]
fn floor_runs(spec: &str) {
    const WIDTH: usize = 16;
    let (kind, n) = spec.split_once(':').unwrap();
    let (kind, n): (u8, usize) = (kind.parse().unwrap(), n.parse().unwrap());
    // SAFETY: plain system calls with no arguments.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    // Made before any fork: after one, only system calls on data made before it.
    let (uid_map, gid_map) = (format!("0 {uid} 1\n"), format!("0 {gid} 1\n"));
    let check = |r: libc::c_int| r >= 0;
    let start = |exec: bool| -> bool {
        // SAFETY: this process is single-threaded (nothing but `main` has run), so a forked child
        // may do anything this one could; the children make system calls on data made before the
        // forks, wait, and `_exit`.
        unsafe {
            let put = |path: &std::ffi::CStr, data: &[u8]| {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                let ok = fd >= 0 && libc::write(fd, data.as_ptr().cast(), data.len()) == data.len() as isize;
                libc::close(fd);
                ok
            };
            let child = libc::fork();
            if child == 0 {
                let flags = libc::CLONE_NEWUSER
                    | libc::CLONE_NEWNS
                    | libc::CLONE_NEWPID
                    | libc::CLONE_NEWIPC
                    | libc::CLONE_NEWUTS
                    | libc::CLONE_NEWCGROUP;
                if !(check(libc::unshare(flags))
                    && put(c"/proc/self/setgroups", b"deny")
                    && put(c"/proc/self/uid_map", uid_map.as_bytes())
                    && put(c"/proc/self/gid_map", gid_map.as_bytes()))
                {
                    libc::_exit(2);
                }
                let init = libc::fork();
                if init == 0 {
                    let none = std::ptr::null();
                    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                    if !(check(libc::mount(none, c"/".as_ptr(), none, libc::MS_REC | libc::MS_PRIVATE, none.cast()))
                        && check(libc::mount(
                            c"proc".as_ptr(),
                            c"/proc".as_ptr(),
                            c"proc".as_ptr(),
                            flags,
                            none.cast(),
                        )))
                    {
                        libc::_exit(3);
                    }
                    if exec {
                        libc::execl(c"/bin/true".as_ptr(), c"true".as_ptr(), std::ptr::null::<libc::c_char>());
                        libc::_exit(4);
                    }
                    libc::_exit(0);
                }
                libc::_exit(wait_ok(init) as i32 ^ 1);
            }
            wait_ok(child)
        }
    };
    let spawn = || std::process::Command::new("/bin/true").status().is_ok_and(|s| s.success());
    let t = Instant::now();
    let mut runners = Vec::new();
    for k in 0..WIDTH {
        // SAFETY: as in `start`: single-threaded, and the runner only starts processes and exits.
        let runner = unsafe { libc::fork() };
        if runner == 0 {
            let all = (k..n).step_by(WIDTH).all(|_| match kind {
                0 => start(true),
                1 => start(false),
                _ => spawn(),
            });
            // SAFETY: ends the forked runner without running this process's exit handlers twice.
            unsafe { libc::_exit(if all { 0 } else { 1 }) };
        }
        runners.push(runner);
    }
    // Every runner waited for, whatever the others did.
    let all = runners.into_iter().map(wait_ok).collect::<Vec<_>>().into_iter().all(|ok| ok);
    if all {
        println!("{}", n as f64 / t.elapsed().as_secs_f64());
    }
}

/// Waits for child `pid`: whether it exited with 0.
#[allow(unsafe_code)]
fn wait_ok(pid: libc::pid_t) -> bool {
    let mut status = 0;
    // SAFETY: `status` is a valid, writable int for the call.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    waited == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

/// Creates `n` sandboxes, `width` at a time: their ids, and the create rates of the first and
/// the second half (by completion time).
async fn create_many(http: &Http, n: usize, width: usize) -> (Vec<String>, (f64, f64)) {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..width {
        let http = http.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut failures = 0;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let r = http.post("/v1/sandboxes", json!({"image": "host"})).await;
                if r.status == 200 {
                    ids.push((start.elapsed(), r.json()["id"].as_str().unwrap().to_string()));
                } else {
                    failures += 1;
                    if failures <= 3 {
                        eprintln!("create failed: {}", String::from_utf8_lossy(&r.body));
                    }
                }
            }
            ids
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    let half = all.len() / 2;
    let at = |i: usize| all.get(i).map(|(t, _)| t.as_secs_f64()).unwrap_or(0.0);
    let first = half as f64 / at(half.saturating_sub(1)).max(1e-9);
    let second = (all.len() - half) as f64 / (at(all.len().saturating_sub(1)) - at(half.saturating_sub(1))).max(1e-9);
    (all.into_iter().map(|(_, id)| id).collect(), (first, second))
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

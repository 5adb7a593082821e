//! At the paper's scale, on a real API server with fake nodes (`docs/kubernetes.md`, "At the
//! paper's scale"): a **hold** of 11,858 sandboxes at once, every one answering an exec, with
//! the memory of the API server, etcd and the provider before, while held and after, and a
//! release-all that leaves no pod, Secret or daemon; and a **churn soak**, 12 creates a second
//! for 30 minutes by default, each sandbox answering an exec and released after a short hold,
//! sampled every 30 s, whose counts and memory must stay flat and return to nothing.
//!
//! Both read this machine's `/proc` (the API server and etcd by process name), so they run where
//! the cluster runs. They run only with `SANDMAN_E2E_SCALE=1` (`./scripts/e2e-kube --scale` sets
//! it), so that `cargo test -- --ignored` for the rest of the suite does not start them.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use kube::core::PartialObjectMeta;
use sandman_provider_kube::Footprint;

use super::*;

/// The most sandboxes the paper held at once.
const PAPER_HOLD: usize = 11_858;
/// Sandboxes one fake node runs by default, so that no single node is the limit (each holds a
/// descriptor per running daemon, and has `ADDRESSES_PER_NODE` addresses to hand out).
const PER_FAKE_NODE: usize = 3_000;
/// Memory a held daemon takes, for the check that the machine can hold them (its own pages,
/// the binary shared; measured about 0.4 MiB), with room to spare.
const DAEMON_KIB: u64 = 1024;
/// Descriptors a fake node needs beside one per daemon (its API connections, watches, logs).
const NODE_FDS: u64 = 256;

// ---- what this machine can hold ----

/// A line of a `/proc` file whose first field is `key`, its next field parsed.
fn proc_field(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

fn proc_number(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The tasks (processes and threads) the machine runs now: `/proc/loadavg`'s `running/total`.
fn tasks_now() -> u64 {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().nth(3).and_then(|f| f.split('/').nth(1)).and_then(|t| t.parse().ok()).unwrap_or(0)
}

/// Checks, before anything is made, that this machine can run `n` daemons on `nodes` fake
/// nodes: the kernel's task limits (a daemon is one task: its blocking threads exit after a
/// second idle), the fake nodes' limit of open files (one per daemon; each node raises its soft
/// limit to the hard one), their addresses, and memory. Fails naming the limit.
fn check_machine(n: usize, nodes: u32) {
    let n64 = n as u64;
    // A daemon's command runs beside it for a moment; the fake nodes and this test have threads.
    let tasks_needed = tasks_now() + n64 + n64 / 8 + 512;
    for (limit, path) in
        [("kernel.pid_max", "/proc/sys/kernel/pid_max"), ("kernel.threads-max", "/proc/sys/kernel/threads-max")]
    {
        if let Some(max) = proc_number(path) {
            assert!(
                tasks_needed <= max,
                "this machine cannot hold {n} daemons: {limit} is {max}, and {} tasks run already \
                 ({tasks_needed} needed); raise it (sysctl -w {limit}=…) or ask for fewer (SANDMAN_E2E_SANDBOXES)",
                tasks_now()
            );
        }
    }
    let uid = proc_field("/proc/self/status", "Uid:").unwrap_or(0);
    let nproc = proc_field("/proc/self/limits", "Max processes").unwrap_or(u64::MAX);
    assert!(
        uid == 0 || tasks_needed <= nproc,
        "this machine cannot hold {n} daemons: the limit of processes (ulimit -u, RLIMIT_NPROC) is {nproc}"
    );
    let per_node = n64.div_ceil(u64::from(nodes.max(1)));
    // "Max open files  <soft>  <hard>  files": the hard limit is the second number.
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let hard_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    assert!(
        per_node + NODE_FDS <= hard_files,
        "a fake node cannot hold {per_node} daemons: the hard limit of open files (ulimit -Hn, \
         RLIMIT_NOFILE) is {hard_files} and it needs one per daemon; run more fake nodes \
         (SANDMAN_E2E_FAKE_NODES) or raise the limit"
    );
    let addresses = u64::from(ADDRESSES_PER_NODE) * 254 / 256;
    assert!(
        per_node < addresses,
        "a fake node hands out {addresses} loopback addresses, fewer than its {per_node} daemons: \
         run more fake nodes (SANDMAN_E2E_FAKE_NODES)"
    );
    let available = proc_field("/proc/meminfo", "MemAvailable:").unwrap_or(u64::MAX);
    assert!(
        n64 * DAEMON_KIB <= available,
        "this machine cannot hold {n} daemons: MemAvailable is {} MiB, and they need about {} MiB",
        available / 1024,
        n64 * DAEMON_KIB / 1024
    );
}

// ---- what this machine's /proc shows ----

/// This process's heap as glibc's allocator sees it (every arena, `mallinfo2`): KiB handed out
/// and not freed (in use), and KiB freed but kept by the allocator rather than given back to the
/// kernel, which the resident size still counts.
#[derive(Debug, Clone, Copy, Default)]
struct Heap {
    in_use_kib: u64,
    kept_free_kib: u64,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn heap() -> Heap {
    // SAFETY: mallinfo2 only reads the allocator's counters (under each arena's lock).
    let m = unsafe { libc::mallinfo2() };
    Heap { in_use_kib: ((m.uordblks + m.hblkhd) / 1024) as u64, kept_free_kib: (m.fordblks / 1024) as u64 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap() -> Heap {
    Heap::default()
}

/// Asks glibc's allocator to give the free pages it keeps back to the kernel (`malloc_trim`),
/// so that the resident size after it tells memory still in use from memory only kept.
#[allow(unsafe_code)]
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes each arena's lock and releases only free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The processes a run stands on, as `/proc` shows them at one moment.
#[derive(Debug, Clone, Default)]
struct Procs {
    /// Resident KiB of the API server, etcd, the fake nodes and this test (the provider).
    api_kib: u64,
    etcd_kib: u64,
    nodes_kib: u64,
    ours_kib: u64,
    /// This test's heap (the provider's, and the test's own records).
    ours_heap: Heap,
    /// This test's open descriptors, and how many of them are connections to the API server.
    ours_fds: usize,
    ours_api_connections: usize,
    /// The fake nodes' daemons running, and (when asked for) their proportional memory.
    daemons: usize,
    daemons_pss_kib: u64,
}

/// Reads `/proc`: the API server and etcd by name, the fake nodes by `node_pids`, their daemons
/// as their children named `sandmand` (not the daemons of anyone else's pods on this machine).
fn procs(node_pids: &[u32], with_pss: bool) -> Procs {
    let me = std::process::id();
    let mut out = Procs::default();
    let rss = |dir: &Path| proc_field(&dir.join("status").to_string_lossy(), "VmRSS:").unwrap_or(0);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let comm = &stat[open + 1..close];
        let ppid: u32 = stat[close + 1..].split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        let dir = entry.path();
        if pid == me {
            out.ours_kib = rss(&dir);
            out.ours_heap = heap();
        } else if node_pids.contains(&pid) {
            out.nodes_kib += rss(&dir);
        } else if comm == "sandmand" && node_pids.contains(&ppid) {
            out.daemons += 1;
            if with_pss {
                out.daemons_pss_kib += proc_field(&dir.join("smaps_rollup").to_string_lossy(), "Pss:").unwrap_or(0);
            }
        } else if comm == "kube-apiserver" {
            out.api_kib += rss(&dir);
        } else if comm == "etcd" {
            out.etcd_kib += rss(&dir);
        }
    }
    let (fds, api) = our_descriptors();
    out.ours_fds = fds;
    out.ours_api_connections = api;
    out
}

/// This process's open descriptors, and how many are TCP connections to port 6443 (the API
/// server's), matched by socket inode in `/proc/self/net/tcp{,6}`.
fn our_descriptors() -> (usize, usize) {
    let mut sockets = std::collections::HashSet::new();
    let mut fds = 0;
    for fd in std::fs::read_dir("/proc/self/fd").into_iter().flatten().flatten() {
        fds += 1;
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let target = target.to_string_lossy().to_string();
            if let Some(inode) = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')) {
                sockets.insert(inode.to_string());
            }
        }
    }
    let mut api = 0;
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode; 01 = ESTABLISHED.
            if f.len() > 9 && f[2].ends_with(":192B") && f[3] == "01" && sockets.contains(f[9]) {
                api += 1;
            }
        }
    }
    (fds, api)
}

/// What the API server says of itself: the watches of pods open on it (all clients, every
/// namespace), and the size of etcd's database.
async fn api_metrics(client: &Client) -> (Option<u64>, Option<u64>) {
    let Ok(req) = http::Request::get("/metrics").body(Vec::new()) else { return (None, None) };
    let Ok(text) = client.request_text(req).await else { return (None, None) };
    let mut watches = None;
    let mut db = None;
    for line in text.lines() {
        let value = || line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).map(|v| v as u64);
        if line.starts_with("apiserver_longrunning_requests{")
            && line.contains("resource=\"pods\"")
            && line.contains("verb=\"WATCH\"")
            && line.contains("subresource=\"\"")
        {
            *watches.get_or_insert(0) += value().unwrap_or(0);
        } else if line.starts_with("apiserver_storage_size_bytes") {
            db = value();
        }
    }
    (watches, db)
}

/// The namespace's sandbox pods and token Secrets (everything labelled as the provider's).
async fn counts(world: &World) -> (usize, usize) {
    let lp = ListParams::default().labels(OURS);
    let pods: Vec<PartialObjectMeta<Pod>> = world.pods().list_metadata(&lp).await.map(|l| l.items).unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), &world.namespace);
    let secrets = secrets.list_metadata(&lp).await.map(|l| l.items.len()).unwrap_or(usize::MAX);
    (pods.len(), secrets)
}

fn mib(kib: u64) -> String {
    format!("{:.0} MiB", kib as f64 / 1024.0)
}

/// Waits until `done` answers nothing left, or `limit` has passed (a leftover, which the caller
/// asserts on). Answers the last answer and how long it took.
async fn until_nothing<F, Fut>(limit: Duration, mut left: F) -> (String, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<String>>,
{
    let t0 = Instant::now();
    loop {
        match left().await {
            None => return (String::new(), t0.elapsed()),
            Some(what) if t0.elapsed() > limit => return (what, t0.elapsed()),
            Some(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// The sandboxes left anywhere (pods, Secrets, the provider's watch and tracker, the fake
/// nodes' daemons), or `None` once nothing is.
async fn leftovers(world: &World, p: &KubeProvider) -> Option<String> {
    let (pods, secrets) = counts(world).await;
    let fp = p.footprint();
    let daemons = procs(&world.node_pids(), false).daemons;
    let nothing = Footprint::default();
    if pods == 0 && secrets == 0 && fp == nothing && daemons == 0 {
        None
    } else {
        Some(format!("{pods} pods, {secrets} token Secrets, {daemons} daemons, provider {fp:?}"))
    }
}

/// A spec of this suite's, with a daemon lease of `lease_s`.
fn scale_spec(id: String, job: &str, lease_s: u64) -> SandboxSpec {
    let mut s = spec(&id, "busybox:e2e");
    s.job = Some(job.into());
    s.daemon_lease_s = lease_s;
    s
}

/// A sandbox that failed: its id, the step (`create`, `health`, `exec`, `release`) and why.
type Failure = (String, &'static str, String);

/// The failures of a run, grouped by where and why (ids and addresses left out of the why).
fn by_reason(failures: &[Failure]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for (_, stage, why) in failures {
        let general: String = why
            .split_whitespace()
            .map(|w| if w.chars().any(|c| c.is_ascii_digit()) { "…" } else { w })
            .collect::<Vec<_>>()
            .join(" ");
        *out.entry(format!("{stage}: {general}")).or_default() += 1;
    }
    out
}

// ---- the hold ----

/// The scale tests run only when `SANDMAN_E2E_SCALE=1` asks for them (`./scripts/e2e-kube
/// --scale` sets it): they take 20 to 30 minutes each, and a plain `cargo test -- --ignored`
/// for the rest of the suite must not start them. Says so loudly when it skips one.
fn scale_asked(test: &str) -> bool {
    let asked = std::env::var("SANDMAN_E2E_SCALE").is_ok_and(|v| v == "1");
    if !asked {
        // Straight to the process's stderr, not through the test harness's capture, so that a
        // run that passes still shows what it did not run.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "######## {test} SKIPPED: a test at the paper's scale; set SANDMAN_E2E_SCALE=1 (./scripts/e2e-kube --scale)"
        );
    }
    asked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes API server on this machine (SANDMAN_E2E_KUBECONFIG), SANDMAN_E2E_SCALE=1 and time: ./scripts/e2e-kube --scale"]
async fn a_hold_of_the_papers_11858_sandboxes_answers_and_release_all_leaves_nothing() {
    if !scale_asked("a_hold_of_the_papers_11858_sandboxes_answers_and_release_all_leaves_nothing") {
        return;
    }
    let _cluster = cluster_lock().await;
    let n: usize = env_or("SANDMAN_E2E_SANDBOXES", PAPER_HOLD);
    let nodes: u32 = env_or("SANDMAN_E2E_FAKE_NODES", n.div_ceil(PER_FAKE_NODE).max(2) as u32);
    let qps: f64 = env_or("SANDMAN_E2E_QPS", KubeConfig::default().write_qps);
    let burst: u32 = env_or("SANDMAN_E2E_BURST", KubeConfig::default().write_burst);
    check_machine(n, nodes);
    let world = World::with_nodes(e2e_kubeconfig(), "hold", "127.16.0.1", nodes).await;
    let state_dir = world.state_dir();
    let config = KubeConfig {
        write_qps: qps,
        write_burst: burst,
        token: TokenDelivery::SharedSecret,
        // Every create starts at once and waits its turn at the pacer: the last may wait long.
        create_timeout_s: 3600,
        ..world.config()
    };
    let log: WriteLog = Arc::default();
    let p = Arc::new(KubeProvider::new(world.client(Some(log.clone())).await, config).unwrap());
    p.wait_synced().await;
    let job = "e2e-hold";
    let (watches_before, db_before) = api_metrics(&world.client).await;
    let before = procs(&world.node_pids(), false);
    let counts_before = counts(&world).await;

    // Every create at once, as a job's burst; a line of progress every 30 s.
    let ready_count = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let progress = {
        let ready_count = ready_count.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(30)).await;
                let k = ready_count.load(Ordering::Relaxed);
                println!("hold: {k} of {n} ready after {:.0} s", started.elapsed().as_secs_f64());
            }
        })
    };
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (p, ready_count) = (p.clone(), ready_count.clone());
        let s = scale_spec(format!("h{i:05}"), job, 3600);
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let endpoint = p.create(&s).await.map_err(|e| (s.id.clone(), "create", e.to_string()))?;
            check_health(&endpoint).await.map_err(|e| (s.id.clone(), "health", e))?;
            ready_count.fetch_add(1, Ordering::Relaxed);
            Ok::<_, Failure>((s, endpoint, t0.elapsed()))
        }));
    }
    let mut ready = Vec::with_capacity(n);
    let mut failed = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => ready.push(r),
            Err(e) => failed.push(e),
        }
    }
    let create_span = started.elapsed();
    progress.abort();
    assert!(failed.is_empty(), "{} of {n} creates failed: {:?}", failed.len(), by_reason(&failed));

    // Every one answers an exec, 64 at a time.
    let exec_started = Instant::now();
    let results = futures_util::stream::iter(ready.iter().map(|(s, e, _)| check_daemon(e.clone(), s.token.clone())))
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    let exec_span = exec_started.elapsed();
    let bad: Vec<_> = results.into_iter().filter_map(Result::err).collect();
    assert!(bad.is_empty(), "{} of {n} sandboxes did not answer an exec: {:?}", bad.len(), &bad[..bad.len().min(10)]);

    let mut times: Vec<Duration> = ready.iter().map(|r| r.2).collect();
    times.sort();
    println!("hold: {n} sandboxes on {nodes} fake nodes, write limit {qps} qps (burst {burst}), shared token Secrets");
    println!(
        "created and ready     {n} in {:.1} s ({:.1}/s); create-to-ready p50 {:.1} s, p99 {:.1} s",
        create_span.as_secs_f64(),
        n as f64 / create_span.as_secs_f64(),
        pct(&times, 0.5).as_secs_f64(),
        pct(&times, 0.99).as_secs_f64()
    );
    println!(
        "exec (echo hi)        {n} answered in {:.1} s ({:.0}/s, 64 at a time)",
        exec_span.as_secs_f64(),
        n as f64 / exec_span.as_secs_f64()
    );
    let held = procs(&world.node_pids(), true);
    let counts_held = counts(&world).await;
    let fp_held = p.footprint();
    let (watches_held, db_held) = api_metrics(&world.client).await;
    assert_eq!(held.daemons, n, "daemons running while {n} sandboxes are held");
    assert_eq!(counts_held.0, n, "sandbox pods while {n} are held");
    assert_eq!(fp_held.tracked, n, "sandboxes the provider follows while {n} are held");
    // The heap without this test's own records of the sandboxes (their specs and endpoints),
    // then the resident size once the allocator has given back what it only keeps: what the
    // provider holds per sandbox, apart from what the burst left free in the heap.
    drop(ready);
    let held_heap = heap();
    trim_heap();
    let held_trimmed_kib = procs(&world.node_pids(), false).ours_kib;
    // Printed now, so that a release-all that fails still leaves the figures of the hold.
    let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / n as f64;
    println!(
        "held: provider RSS {} ({} before), heap in use {} ({} without this test's records, {} before), \
         kept free {}; RSS after malloc_trim {}; per sandbox: heap {:.1} KiB, RSS {:.1} KiB, trimmed {:.1} KiB",
        mib(held.ours_kib),
        mib(before.ours_kib),
        mib(held.ours_heap.in_use_kib),
        mib(held_heap.in_use_kib),
        mib(before.ours_heap.in_use_kib),
        mib(held.ours_heap.kept_free_kib),
        mib(held_trimmed_kib),
        per(held_heap.in_use_kib, before.ours_heap.in_use_kib),
        per(held.ours_kib, before.ours_kib),
        per(held_trimmed_kib, before.ours_kib),
    );

    // Release-all, then nothing may be left: pods, token Secrets, the provider's state, daemons.
    let release_started = Instant::now();
    let writes_before = log.lock().unwrap().len();
    let released = p.delete_job(job).await.unwrap_or_else(|e| panic!("release-all of {n}: {e}"));
    let release_call = release_started.elapsed();
    let release_writes = log.lock().unwrap().len() - writes_before;
    assert_eq!(released.len(), n, "sandboxes released");
    let (left, drained) = until_nothing(Duration::from_secs(600), || leftovers(&world, &p)).await;
    assert!(left.is_empty(), "left {:.0} s after release-all: {left}", drained.as_secs_f64());
    let after = procs(&world.node_pids(), false);
    trim_heap();
    let after_trimmed_kib = procs(&world.node_pids(), false).ours_kib;
    let counts_after = counts(&world).await;
    let (watches_after, db_after) = api_metrics(&world.client).await;

    let opt = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
    let db = |v: Option<u64>| v.map_or("?".to_string(), |v| mib(v / 1024));
    println!(
        "release-all           {release_writes} deletecollection call(s), {:.1} s; pods, Secrets and daemons gone {:.1} s later",
        release_call.as_secs_f64(),
        drained.as_secs_f64()
    );
    println!("{:<24}{:>14}{:>14}{:>14}", "", "before", "held", "after");
    let row = |name: &str, a: String, b: String, c: String| println!("{name:<24}{a:>14}{b:>14}{c:>14}");
    row("API server (RSS)", mib(before.api_kib), mib(held.api_kib), mib(after.api_kib));
    row("etcd (RSS)", mib(before.etcd_kib), mib(held.etcd_kib), mib(after.etcd_kib));
    row("etcd database", db(db_before), db(db_held), db(db_after));
    row("provider, this test", mib(before.ours_kib), mib(held.ours_kib), mib(after.ours_kib));
    row(
        "  heap in use",
        mib(before.ours_heap.in_use_kib),
        mib(held.ours_heap.in_use_kib),
        mib(after.ours_heap.in_use_kib),
    );
    row(
        "  heap kept free",
        mib(before.ours_heap.kept_free_kib),
        mib(held.ours_heap.kept_free_kib),
        mib(after.ours_heap.kept_free_kib),
    );
    row("  heap without records", "-".into(), mib(held_heap.in_use_kib), "-".into());
    row("  RSS after malloc_trim", "-".into(), mib(held_trimmed_kib), mib(after_trimmed_kib));
    row("provider descriptors", before.ours_fds.to_string(), held.ours_fds.to_string(), after.ours_fds.to_string());
    row("fake nodes (RSS)", mib(before.nodes_kib), mib(held.nodes_kib), mib(after.nodes_kib));
    row("daemons", before.daemons.to_string(), held.daemons.to_string(), after.daemons.to_string());
    row("daemons (PSS)", "-".into(), mib(held.daemons_pss_kib), "-".into());
    row("pods", counts_before.0.to_string(), counts_held.0.to_string(), counts_after.0.to_string());
    row("token Secrets", counts_before.1.to_string(), counts_held.1.to_string(), counts_after.1.to_string());
    row("pod watches (API)", opt(watches_before), opt(watches_held), opt(watches_after));
    println!(
        "per sandbox held      API server {:.1} KiB, etcd {:.1} KiB, provider {:.1} KiB, daemon {:.0} KiB (PSS)",
        per(held.api_kib, before.api_kib),
        per(held.etcd_kib, before.etcd_kib),
        per(held.ours_kib, before.ours_kib),
        held.daemons_pss_kib as f64 / n as f64
    );
    println!(
        "provider per sandbox  heap in use held {:.1} KiB ({:.1} KiB of it this test's records), after {:.2} KiB; \
         RSS held {:.1} KiB, trimmed {:.1} KiB; after {:.1} KiB, trimmed {:.1} KiB",
        per(held.ours_heap.in_use_kib, before.ours_heap.in_use_kib),
        per(held.ours_heap.in_use_kib, held_heap.in_use_kib),
        per(after.ours_heap.in_use_kib, before.ours_heap.in_use_kib),
        per(held.ours_kib, before.ours_kib),
        per(held_trimmed_kib, before.ours_kib),
        per(after.ours_kib, before.ours_kib),
        per(after_trimmed_kib, before.ours_kib)
    );

    world.tear_down().await;
    // No daemon of this run outlives its fake node (their command lines name the state dir).
    let state = state_dir.to_string_lossy().to_string();
    let strays = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(&state)))
        .count();
    assert_eq!(strays, 0, "processes of this run's fake nodes still running after they stopped");
}

// ---- the soak ----

/// One sample of the soak.
#[derive(Debug, Clone)]
struct Sample {
    /// Seconds since the soak began.
    t: f64,
    /// Creates begun so far, and sandboxes alive in this test (begun, not yet released).
    begun: usize,
    live: i64,
    pods: usize,
    secrets: usize,
    provider: Footprint,
    procs: Procs,
    watches: Option<u64>,
    db_bytes: Option<u64>,
    /// Create-to-ready p50 of the creates answered since the last sample, in seconds.
    ready_p50: Option<f64>,
}

async fn take_sample(world: &World, p: &KubeProvider, t: f64, begun: usize, live: i64, since: Vec<Duration>) -> Sample {
    let (pods, secrets) = counts(world).await;
    let (watches, db_bytes) = api_metrics(&world.client).await;
    let mut since = since;
    since.sort();
    Sample {
        t,
        begun,
        live,
        pods,
        secrets,
        provider: p.footprint(),
        procs: procs(&world.node_pids(), false),
        watches,
        db_bytes,
        ready_p50: (!since.is_empty()).then(|| pct(&since, 0.5).as_secs_f64()),
    }
}

fn print_samples(samples: &[Sample]) {
    println!(
        "{:>6} {:>7} {:>5} {:>5} {:>7} {:>8} {:>7} {:>7} {:>8} {:>7} {:>4} {:>7} {:>8} {:>8} {:>7} {:>6} {:>6}",
        "t s",
        "begun",
        "live",
        "pods",
        "secrets",
        "tracked",
        "watched",
        "daemons",
        "rss MiB",
        "fds",
        "api",
        "watches",
        "apisrv",
        "etcd",
        "etcd db",
        "nodes",
        "p50 s"
    );
    for s in samples {
        println!(
            "{:>6.0} {:>7} {:>5} {:>5} {:>7} {:>8} {:>7} {:>7} {:>8.1} {:>7} {:>4} {:>7} {:>8.0} {:>8.0} {:>7} {:>6.0} {:>6}",
            s.t,
            s.begun,
            s.live,
            s.pods,
            s.secrets,
            s.provider.tracked,
            s.provider.watched_pods,
            s.procs.daemons,
            s.procs.ours_kib as f64 / 1024.0,
            s.procs.ours_fds,
            s.procs.ours_api_connections,
            s.watches.map_or("?".into(), |w| w.to_string()),
            s.procs.api_kib as f64 / 1024.0,
            s.procs.etcd_kib as f64 / 1024.0,
            s.db_bytes.map_or("?".into(), |b| format!("{:.0}", b as f64 / 1048576.0)),
            s.procs.nodes_kib as f64 / 1024.0,
            s.ready_p50.map_or("-".into(), |v| format!("{v:.2}")),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes API server on this machine (SANDMAN_E2E_KUBECONFIG), SANDMAN_E2E_SCALE=1 and 30 minutes: ./scripts/e2e-kube --scale"]
async fn a_churn_soak_at_12_creates_a_second_stays_flat_and_leaves_nothing() {
    if !scale_asked("a_churn_soak_at_12_creates_a_second_stays_flat_and_leaves_nothing") {
        return;
    }
    let _cluster = cluster_lock().await;
    let secs: f64 = env_or("SANDMAN_E2E_SOAK_S", 1800.0);
    let rate: f64 = env_or("SANDMAN_E2E_SOAK_RATE", 12.0);
    let hold_s: f64 = env_or("SANDMAN_E2E_SOAK_HOLD_S", 10.0);
    let every: f64 = env_or("SANDMAN_E2E_SOAK_SAMPLE_S", 30.0);
    let nodes: u32 = env_or("SANDMAN_E2E_FAKE_NODES", 2);
    let qps: f64 = env_or("SANDMAN_E2E_QPS", KubeConfig::default().write_qps);
    let burst: u32 = env_or("SANDMAN_E2E_BURST", KubeConfig::default().write_burst);
    // What may be alive at once: the sandboxes held, being made and being released.
    let bound = (4.0 * rate * (hold_s + 5.0)).ceil() as usize;
    check_machine(bound, nodes);
    let total = (secs * rate).round() as usize;
    let world = World::with_nodes(e2e_kubeconfig(), "soak", "127.24.0.1", nodes).await;
    let config =
        KubeConfig { write_qps: qps, write_burst: burst, token: TokenDelivery::SharedSecret, ..world.config() };
    let p = Arc::new(KubeProvider::new(world.client(None).await, config).unwrap());
    p.wait_synced().await;
    let job = "e2e-soak";
    let hold = Duration::from_secs_f64(hold_s);
    println!(
        "soak: {rate} creates/s for {secs} s ({total} sandboxes), each held {hold_s} s after its exec; \
         {nodes} fake nodes, write limit {qps} qps; a sample every {every} s"
    );

    let live = Arc::new(AtomicI64::new(0));
    let failures: Arc<Mutex<Vec<Failure>>> = Arc::default();
    let ready_times: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let started = Instant::now();
    let mut samples = vec![take_sample(&world, &p, 0.0, 0, 0, Vec::new()).await];
    let mut episodes = tokio::task::JoinSet::new();
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut next_sample = started + Duration::from_secs_f64(every);
    for i in 0..total {
        ticker.tick().await;
        let s = scale_spec(format!("s{i:06}"), job, 300);
        live.fetch_add(1, Ordering::Relaxed);
        let (p2, live2, failures2, ready_times2) = (p.clone(), live.clone(), failures.clone(), ready_times.clone());
        episodes.spawn(async move {
            let (p, live, failures, ready_times) = (p2, live2, failures2, ready_times2);
            let t0 = Instant::now();
            let failed = match p.create(&s).await {
                Err(e) => Some(("create", e.to_string())),
                Ok(endpoint) => {
                    ready_times.lock().unwrap().push(t0.elapsed());
                    let exec = check_daemon(endpoint, s.token.clone()).await.err().map(|e| ("exec", e));
                    tokio::time::sleep(hold).await;
                    let release = p.delete(&s.id).await.err().map(|e| ("release", e.to_string()));
                    exec.or(release)
                }
            };
            if let Some((stage, why)) = failed {
                failures.lock().unwrap().push((s.id.clone(), stage, why));
            }
            live.fetch_sub(1, Ordering::Relaxed);
        });
        while episodes.try_join_next().is_some() {}
        if Instant::now() >= next_sample {
            next_sample += Duration::from_secs_f64(every);
            let since = std::mem::take(&mut *ready_times.lock().unwrap());
            let t = started.elapsed().as_secs_f64();
            let sample = take_sample(&world, &p, t, i + 1, live.load(Ordering::Relaxed), since).await;
            let s = &sample;
            println!(
                "soak: t {:.0} s, begun {}, live {}, pods {}, secrets {}, rss {:.1} MiB, fds {}, failed {}",
                s.t,
                s.begun,
                s.live,
                s.pods,
                s.secrets,
                s.procs.ours_kib as f64 / 1024.0,
                s.procs.ours_fds,
                failures.lock().unwrap().len()
            );
            samples.push(sample);
        }
    }
    let churn_span = started.elapsed();
    while episodes.join_next().await.is_some() {}
    let (left, drained) = until_nothing(Duration::from_secs(300), || leftovers(&world, &p)).await;
    let since = std::mem::take(&mut *ready_times.lock().unwrap());
    let end =
        take_sample(&world, &p, started.elapsed().as_secs_f64(), total, live.load(Ordering::Relaxed), since).await;
    samples.push(end.clone());

    print_samples(&samples);
    let failures = failures.lock().unwrap().clone();
    println!(
        "soak: {total} sandboxes in {:.0} s ({:.2} creates/s), {} failed; nothing left {:.1} s after the last release",
        churn_span.as_secs_f64(),
        total as f64 / churn_span.as_secs_f64(),
        failures.len(),
        drained.as_secs_f64()
    );
    for (why, count) in by_reason(&failures) {
        println!("  failed {count:>5}  {why}");
    }

    // Flat: the samples taken while churning, first third against last third.
    let churning: Vec<&Sample> = samples.iter().filter(|s| s.t > 0.0 && s.begun < total).collect();
    let third = churning.len() / 3;
    let flat = third >= 1;
    let first = &churning[..third];
    let last = &churning[churning.len() - third..];
    let most = |of: &[&Sample], f: &dyn Fn(&Sample) -> u64| of.iter().map(|s| f(s)).max().unwrap_or(0);
    let rss_first = most(first, &|s| s.procs.ours_kib);
    let rss_last = most(last, &|s| s.procs.ours_kib);
    let fds_first = most(first, &|s| s.procs.ours_fds as u64);
    let fds_last = most(last, &|s| s.procs.ours_fds as u64);
    println!(
        "flat: provider RSS most {} in the first third, {} in the last; descriptors {fds_first}, {fds_last}; live bound {bound}",
        mib(rss_first),
        mib(rss_last)
    );

    assert!(failures.is_empty(), "{} of {total} sandboxes failed: {:?}", failures.len(), by_reason(&failures));
    assert!(left.is_empty(), "left {:.0} s after the soak: {left}", drained.as_secs_f64());
    assert_eq!(end.live, 0);
    for s in &samples {
        let counts = [
            ("pods", s.pods),
            ("token Secrets", s.secrets),
            ("sandboxes the provider tracks", s.provider.tracked),
            ("pods in the provider's watch", s.provider.watched_pods),
            ("daemons", s.procs.daemons),
        ];
        for (what, count) in counts {
            assert!(count <= bound, "{count} {what} at {:.0} s, over the bound {bound} (4 × rate × (hold + 5 s))", s.t);
        }
    }
    assert!(flat, "too few samples ({}) to tell flat from growing: run longer than 3 samples", churning.len());
    // Memory that grows with the sandboxes made, not alive, would show here: 21,600 sandboxes
    // by the last third at the defaults.
    assert!(
        rss_last <= rss_first + rss_first / 10 + 16 * 1024,
        "the provider's memory grew: most {} in the last third against {} in the first (allowed: 10% + 16 MiB)",
        mib(rss_last),
        mib(rss_first)
    );
    assert!(
        fds_last <= fds_first + 64,
        "the provider's descriptors grew: {fds_last} in the last third against {fds_first} in the first (allowed: 64 more)"
    );
    world.tear_down().await;
}

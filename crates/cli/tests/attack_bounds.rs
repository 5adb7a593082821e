//! The attack suite of bounds, the HTTP edge, memory and disk: each test is one finding of a
//! hostile tenant against the real `sandman serve` (process provider, real daemons), named after
//! what broke, and checks it now fails to do harm with a clear 4xx. The docker variants at the
//! end run the findings that apply there (the daemon in a container); they need a running
//! engine and the static daemon, as `docker_e2e.rs` does.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod e2e;

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use e2e::docker::{Cleanup, require_docker, static_daemon};
use e2e::{Body, Server, eventually};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

/// A gzipped tar of one file of `len` zero bytes.
fn zeros_gz(len: u64) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(len);
    header.set_mode(0o644);
    header.set_cksum();
    builder.append_data(&mut header, "zeros", std::io::repeat(0).take(len)).unwrap();
    let tar = builder.into_inner().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, &tar).unwrap();
    gz.finish().unwrap()
}

/// A tar of one file whose path is `depth` directories deep.
fn deep_tar(depth: usize) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o644);
    header.set_cksum();
    builder.append_data(&mut header, "d/".repeat(depth) + "f", &b"x"[..]).unwrap();
    builder.into_inner().unwrap()
}

fn message(v: &Value) -> String {
    v["message"].as_str().unwrap_or_default().to_string()
}

/// Regression (issue 29): nothing bounded a default create's memory: a sandbox held 6 GiB and
/// the host's available memory fell by as much. A create that names no limits gets the
/// server's default (2 GiB), which its info and conditions record show, and a command that
/// passes it is killed, not the sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_sandbox_is_stopped_at_the_default_memory() {
    sandman_testkit::require_root();
    let server = Server::start();
    let http = server.client();
    let sb = http.create(json!({"image": "host"})).await;
    assert_eq!(sb["resources"]["memory"], "2Gi", "{sb}");
    let id = sb["id"].as_str().unwrap().to_string();
    // 6 GiB in 256 MiB steps, each page touched; it says how far it got.
    let grab = "import sys\nheld = []\nfor i in range(24):\n    held.append(bytearray(256 << 20))\n    print((i + 1) * 256, flush=True)\n";
    let out = http.exec(&id, json!({"argv": ["python3", "-c", grab], "timeout_ms": 120_000})).await;
    assert_eq!(out["signal"], 9, "the allocation was not stopped: {out}");
    let reached: u64 = out["stdout"].as_str().unwrap().lines().last().unwrap_or("0").parse().unwrap();
    assert!(reached < 2048, "it held {reached} MiB, past the 2 GiB default: {out}");
    assert_eq!(http.exec(&id, json!({"argv": ["echo", "alive"]})).await["stdout"], "alive\n");
    let record = http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok();
    assert_eq!(record["record"]["applied"]["memory"], 2u64 << 30, "{record}");
    http.release(&id).await;
}

/// Regression (issue 29): nothing bounded a default create's disk: 4 GiB went into `/tmp` on the
/// host's disk, and `/` was a tmpfs of half the machine's memory. Everything a sandbox writes
/// (its root, `/tmp`, its home) is one layer of the default disk (1 GiB), and no file may
/// pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_sandbox_is_stopped_at_the_default_disk() {
    sandman_testkit::require_root();
    let server = Server::start();
    let http = server.client();
    let sb = http.create(json!({"image": "host"})).await;
    assert_eq!(sb["resources"]["disk"], "1Gi", "{sb}");
    let id = sb["id"].as_str().unwrap().to_string();
    for target in ["/tmp/fill", "/fill", "/home/user/fill"] {
        let script = format!(
            "dd if=/dev/zero of={target} bs=1M count=4096 2>&1 | tail -n 1; ls -l {target} | awk '{{print $5}}'; rm -f {target}; ulimit -f"
        );
        let out = http.exec(&id, json!({"argv": ["sh", "-c", script], "timeout_ms": 120_000})).await;
        let text = out["stdout"].as_str().unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let written: u64 =
            lines.get(lines.len().saturating_sub(2)).and_then(|l| l.trim().parse().ok()).unwrap_or(u64::MAX);
        assert!(written <= 1 << 30, "{target}: {written} bytes written past the 1 GiB default: {out}");
        assert_ne!(lines.last().copied(), Some("unlimited"), "no file size limit: {out}");
    }
    assert_eq!(http.exec(&id, json!({"argv": ["echo", "alive"]})).await["stdout"], "alive\n");
    http.release(&id).await;
}

/// The machine's memory admits creates: with room for two, a third waits (told why) until one
/// is released, and one bigger than the room is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_wait_for_the_machines_memory_and_one_too_big_is_refused() {
    sandman_testkit::require_root();
    let total_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    // The room is a tenth of the machine's memory; each create asks two fifths of it.
    let room = total_kib * 1024 / 10;
    let each = (room * 2 / 5).to_string();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_in(&dir.path().join("state"), &["--memory-overcommit", "0.1"]);
    let http = server.client();
    let ask = json!({"image": "host", "resources": {"memory": each.as_str()}});
    let (a, b) = (http.create(ask.clone()).await, http.create(ask.clone()).await);
    assert_eq!((a["state"].as_str(), b["state"].as_str()), (Some("ready"), Some("ready")), "{a} {b}");
    let mut third = ask.clone();
    third["wait"] = json!(false);
    let c = http.create(third).await;
    let c_id = c["id"].as_str().unwrap().to_string();
    let told = eventually(Duration::from_secs(20), async || {
        let events = http.get("/v1/events").await.json();
        let events = events["events"].as_array().cloned().unwrap_or_default();
        events.iter().any(|e| {
            e["sandbox"] == c_id.as_str() && e["message"].as_str().unwrap_or_default().contains("waiting for memory")
        })
    })
    .await;
    assert!(told, "the waiting create was never told why it waits");
    assert_eq!(http.get(&format!("/v1/sandboxes/{c_id}")).await.ok()["state"], "creating");
    http.release(a["id"].as_str().unwrap()).await;
    let ready = eventually(Duration::from_secs(30), async || {
        http.get(&format!("/v1/sandboxes/{c_id}")).await.ok()["state"] == "ready"
    })
    .await;
    assert!(ready, "the waiting create did not start when memory was given back");
    let too_big =
        http.post("/v1/sandboxes", json!({"image": "host", "resources": {"memory": (room + 1).to_string()}})).await;
    let failed = too_big.json();
    assert!(
        failed.to_string().contains("resource_exhausted") && failed.to_string().contains("can never start here"),
        "{failed}"
    );
    http.release(b["id"].as_str().unwrap()).await;
    http.release(&c_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_of_u64_max_is_refused_naming_its_range() {
    let server = Server::start();
    let http = server.client();
    let max = u64::MAX;
    for (method, path, body, field) in [
        ("POST", "/v1/sandboxes", json!({"image": "host", "lease_s": max}), "`lease_s`"),
        ("POST", "/v1/sandboxes", json!({"image": "host", "idle_timeout_s": max}), "`idle_timeout_s`"),
        ("POST", "/v1/sandboxes", json!({"image": "host", "ttl_s": max}), "`ttl_s`"),
        ("POST", "/v1/sandboxes", json!({"image": "host", "wait_timeout_s": max}), "`wait_timeout_s`"),
        ("PUT", "/v1/jobs/attack", json!({"lease_s": max}), "`lease_s`"),
        ("PUT", "/v1/pools/attack", json!({"image": "host", "min_ready": 0, "lease_s": max}), "`lease_s`"),
    ] {
        let err = http.call(method, path, Body::Json(body.clone())).await.error(400, "invalid_argument");
        assert!(message(&err).contains(field) && message(&err).contains("it must be between"), "{body}: {err}");
    }
    // Nothing broke: listing answers, and a sandbox with the longest lease works, its daemon's
    // own lease neither wrapped nor refused.
    assert_eq!(http.get("/v1/sandboxes").await.status, 200);
    let sb = http.create(json!({"image": "host", "lease_s": 604_800})).await;
    let id = sb["id"].as_str().unwrap().to_string();
    let info = http.get(&format!("/v1/sandboxes/{id}/info")).await.ok();
    assert_eq!(info["lease_ms"], (604_800 + 60) * 1000, "{info}");
    http.release(&id).await.ok();
}

/// Before, a record with a lease no timer could hold panicked the restarted server at start,
/// and it stayed down until the sandbox's directory was removed by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_an_unrecoverable_record_reports_it_ended_and_serves() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let mut server = Server::start_in(&state, &[]);
    let http = server.client();
    let bad = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    let good = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    server.kill9();
    // What an older server wrote for `lease_s: u64::MAX` (its daemon's lease wrapped to 59).
    let record_path = state.join("sandboxes").join(&bad).join("record.json");
    let mut record: Value = serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    record["server"]["lease_s"] = json!(u64::MAX);
    record["daemon_lease_s"] = json!(59);
    std::fs::write(&record_path, serde_json::to_vec(&record).unwrap()).unwrap();

    let server = Server::start_in(&state, &[]);
    let http = server.client();
    let sb = http.get(&format!("/v1/sandboxes/{bad}")).await.ok();
    assert_eq!((sb["state"].as_str(), sb["reason"].as_str()), (Some("failed"), Some("provider_error")), "{sb}");
    assert!(sb["message"].as_str().unwrap().contains("cannot be recovered"), "{sb}");
    let list = http.get("/v1/sandboxes").await.ok();
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 2, "{list}");
    assert_eq!(http.exec(&good, json!({"argv": ["/bin/echo", "ok"]})).await["stdout"], "ok\n");
    // Its remains were removed.
    assert!(
        eventually(Duration::from_secs(10), async || !state.join("sandboxes").join(&bad).exists()).await,
        "the unrecoverable sandbox's directory is still there"
    );
    http.release(&good).await.ok();
}

/// Before, connections that sent nothing or dribbled a header were never closed, and 1,100 of
/// them starved every legitimate call. Now they are closed at the header-read timeout, the
/// connection limit holds (and says so in the log), and calls keep answering throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slowloris_connections_do_not_starve_calls() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server =
        Server::start_in(&dir.path().join("state"), &["--max-connections", "200", "--header-read-timeout-s", "2"]);
    let http = server.client();
    let id = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    let addr = server.addr.clone();
    // 300 attackers: half silent, half dribbling a request head a byte every 500 ms, each
    // reconnecting as soon as it is cut, for the whole test.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut attackers = Vec::new();
    let cut = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for i in 0..300 {
        let (addr, stop, cut) = (addr.clone(), stop.clone(), cut.clone());
        attackers.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else { continue };
                let head = b"GET /v1/sandboxes HTTP/1.1\r\nhost: x\r\nx-padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
                let mut n = 0;
                loop {
                    let wrote = if i % 2 == 0 {
                        // Silent: a read that ends only when the server closes.
                        let mut buf = [0u8; 1];
                        tokio::select! {
                            r = tokio::io::AsyncReadExt::read(&mut s, &mut buf) => r.is_ok_and(|n| n > 0),
                            () = stop.cancelled() => return,
                        }
                    } else {
                        let byte = [head[n % head.len()]];
                        n += 1;
                        if s.write_all(&byte).await.is_err() {
                            false
                        } else {
                            tokio::select! {
                                () = tokio::time::sleep(Duration::from_millis(500)) => true,
                                () = stop.cancelled() => return,
                            }
                        }
                    };
                    if !wrote {
                        cut.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        break;
                    }
                }
            }
        }));
    }
    // Legitimate calls, one after another, for 8 s (four header-read timeouts).
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(8) {
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            if n % 2 == 0 {
                http.get("/healthz").await.status
            } else {
                http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["/bin/true"]})).await.status
            }
        })
        .await;
        assert_eq!(r.ok(), Some(200), "call {n} did not answer within 10 s");
        latencies.push(t.elapsed());
        n += 1;
    }
    stop.cancel();
    for a in attackers {
        let _ = a.await;
    }
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    let max = *latencies.last().unwrap();
    let cut = cut.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "slowloris: 300 attacking connections (150 silent, 150 dribbling) against --max-connections 200, \
         --header-read-timeout-s 2: {} calls answered in 8 s, p50 {:?}, max {:?}; {cut} attacking connections cut",
        latencies.len(),
        p50,
        max
    );
    assert!(cut >= 150, "the server closed only {cut} attacking connections");
    let log = server.process.log();
    assert!(log.contains("the connection limit is reached"), "no log line about the connection limit:\n{log}");
    http.release(&id).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_while_the_server_sheds() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_in(&dir.path().join("state"), &["--max-concurrent-requests", "2"]);
    let http = server.client();
    let id = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    // Two long calls hold both slots. They are seen running from the host before the server is
    // asked anything else: a call sent while only one of them had arrived would take the second
    // slot itself and have that exec shed instead.
    let marker = "6.0172";
    let mut busy = Vec::new();
    for _ in 0..2 {
        let (http, id) = (http.clone(), id.clone());
        busy.push(tokio::spawn(async move {
            let r = http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["/bin/sleep", marker]})).await;
            (r.status, String::from_utf8_lossy(&r.body).into_owned())
        }));
    }
    let running = eventually(Duration::from_secs(30), async || {
        e2e::processes_mentioning(&format!("sleep {marker}")).len() == 2 || busy.iter().any(|b| b.is_finished())
    })
    .await;
    if let Some(i) = busy.iter().position(|b| b.is_finished()) {
        let (status, body) = busy.remove(i).await.unwrap();
        panic!("a long call ended before both were running: {status} {body}");
    }
    assert!(running, "the two long calls were not both running within 30 s");
    let shed = http.get("/v1/sandboxes").await;
    assert_eq!(shed.status, 503, "a call beside two holding both slots: {}", String::from_utf8_lossy(&shed.body));
    let health = http.get("/healthz").await;
    assert_eq!(health.status, 200, "{}", String::from_utf8_lossy(&health.body));
    for b in busy {
        let (status, body) = b.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    http.release(&id).await.ok();
}

/// Before, a 2 MB gzip tar expanded to 2 GiB through `PUT …/archive` in a sandbox whose disk is
/// 1 MB. Now extraction stops at the disk limit, and any gzip at the expansion ratio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_bomb_stops_at_the_disk_limit() {
    let server = Server::start();
    let http = server.client();
    let small = http.create(json!({"image": "host", "resources": {"disk": "1Mi"}})).await;
    let small = small["id"].as_str().unwrap().to_string();
    let bomb = zeros_gz(16 << 20);
    let r = http.put(&format!("/v1/sandboxes/{small}/archive?path=/tmp/bomb"), bomb).await;
    let err = r.error(413, "too_large");
    assert!(message(&err).contains("disk limit of 1048576 bytes"), "{err}");
    let du = http.exec(&small, json!({"command": "du -sk /tmp/bomb 2>/dev/null | cut -f1"})).await;
    let kib: u64 = du["stdout"].as_str().unwrap().trim().parse().unwrap_or(0);
    assert!(kib <= 1024, "{kib} KiB written past a 1 MiB disk");
    // Also a plain upload past the disk.
    let r = http.put(&format!("/v1/sandboxes/{small}/files?path=/tmp/big"), vec![0u8; 2 << 20]).await;
    assert!(message(&r.error(413, "too_large")).contains("disk limit"));

    // No disk limit: the expansion ratio (100x) stops a 256 MiB bomb of a quarter megabyte.
    let big = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    let bomb = zeros_gz(256 << 20);
    let compressed = bomb.len() as u64;
    let r = http.put(&format!("/v1/sandboxes/{big}/archive?path=/tmp/bomb"), bomb).await;
    let err = r.error(413, "too_large");
    assert!(message(&err).contains("100 times its compressed size"), "{err}");
    let du = http.exec(&big, json!({"command": "du -sk /tmp/bomb | cut -f1"})).await;
    let kib: u64 = du["stdout"].as_str().unwrap().trim().parse().unwrap_or(u64::MAX);
    assert!(kib * 1024 <= 100 * compressed + (2 << 20), "{kib} KiB written from {compressed} compressed bytes");
    for id in [small, big] {
        http.release(&id).await.ok();
    }
}

/// Before, a 10 KB tar with a 2,000-deep path cost 77 s of daemon CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2000_deep_tar_path_is_refused_at_once() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    let started = Instant::now();
    let r = http.put(&format!("/v1/sandboxes/{id}/archive?path=/tmp/deep"), deep_tar(2000)).await;
    let err = r.error(400, "invalid_argument");
    assert!(message(&err).contains("2001 levels deep, over the limit of 256"), "{err}");
    println!("a 2,000-deep tar path refused in {:?}", started.elapsed());
    let deep_path = format!("/tmp/{}", "d/".repeat(300));
    let r = http.get(&format!("/v1/sandboxes/{id}/stat?path={deep_path}")).await;
    assert!(message(&r.error(400, "invalid_argument")).contains("levels deep"));
    assert_eq!(http.exec(&id, json!({"argv": ["/bin/echo", "alive"]})).await["stdout"], "alive\n");
    http.release(&id).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_output_bytes_over_the_servers_ceiling_is_refused() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_in(&dir.path().join("state"), &["--max-output-bytes", "1000"]);
    let http = server.client();
    let id = http.create(json!({"image": "host"})).await["id"].as_str().unwrap().to_string();
    let r = http
        .post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["/bin/true"], "max_output_bytes": u64::MAX}))
        .await;
    let err = r.error(400, "invalid_argument");
    assert!(message(&err).contains("`max_output_bytes`") && message(&err).contains("--max-output-bytes"), "{err}");
    let session = http.post(&format!("/v1/sandboxes/{id}/sessions"), json!({})).await.ok();
    let sid = session["id"].as_str().unwrap();
    let r = http
        .post(&format!("/v1/sandboxes/{id}/sessions/{sid}/run"), json!({"command": "true", "max_output_bytes": 1001}))
        .await;
    r.error(400, "invalid_argument");
    // Within it, as before; a stream holds nothing and takes any cap.
    let ok = http.exec(&id, json!({"argv": ["/bin/echo", "fine"], "max_output_bytes": 1000})).await;
    assert_eq!(ok["stdout"], "fine\n");
    let stream = http
        .post(&format!("/v1/sandboxes/{id}/exec/stream"), json!({"argv": ["/bin/true"], "max_output_bytes": u64::MAX}))
        .await;
    assert_eq!(stream.status, 200);
    http.release(&id).await.ok();
}

/// The sandbox's daemon, found by its socket in the process provider's state.
fn daemon_rss_kib(state: &Path, id: &str) -> u64 {
    let socket = state.join("sandboxes").join(id).display().to_string();
    e2e::processes_mentioning(&socket).into_iter().map(|pid| sandman_testkit::rss_kib(pid as u32)).max().unwrap_or(0)
}

/// Before, a sandbox limited to 100 MB drove its daemon to 2.1 GB through output it asked the
/// daemon to keep. From inside, as root and as an unprivileged user, output spam now holds the
/// daemon to its buffered-output budget: a quarter of the sandbox's memory (25 MB here), so that
/// the daemon is never the one OOM-killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_spam_from_inside_a_sandbox_keeps_the_daemon_bounded() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(json!({"image": "host", "resources": {"memory": "100M"}})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    for (i, user) in ["0", "65534", "0", "65534", "0", "65534"].iter().enumerate() {
        let r = http
            .post(
                &format!("/v1/sandboxes/{id}/processes"),
                json!({"argv": ["/usr/bin/yes", "spam"], "user": user, "retain_bytes": 64 << 20, "tag": format!("spam{i}")}),
            )
            .await;
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    }
    // 6 processes x 2 streams x 64 MiB asked: 768 MiB. Wait until they have written well past
    // it, then look at the daemon.
    let written = async || {
        let list = http.get(&format!("/v1/sandboxes/{id}/processes")).await.ok();
        list["processes"].as_array().unwrap().iter().map(|p| p["stdout_bytes"].as_u64().unwrap_or(0)).sum::<u64>()
    };
    assert!(eventually(Duration::from_secs(60), async || written().await > 1 << 30).await, "the spam stalled");
    let rss = daemon_rss_kib(&server.state, &id);
    println!("daemon RSS after 1 GiB of retained-output spam in a 100 MB sandbox: {} MiB", rss / 1024);
    assert!(rss > 0 && rss < 64 * 1024, "daemon RSS {rss} KiB, over a quarter of 100 MB and its overhead");
    // An exec asking for the whole ceiling while the budget is spent is cut, not held, and the
    // daemon is alive to answer it.
    let r = http
        .exec(&id, json!({"command": "head -c 10000000 /dev/zero", "max_output_bytes": 64 << 20, "user": "65534"}))
        .await;
    assert_eq!(r["stdout_truncated"], true, "{}", r["stdout_truncated"]);
    http.release(&id).await.ok();
}

// ---- the docker provider ----

const BUSYBOX: &str = "sandman-test/busybox:latest";

/// The bounds findings where the daemon runs in a container: a lease of u64::MAX, a timeout of
/// u64::MAX (a panic that killed the whole daemon), a gzip bomb, a deep tar path, an output cap
/// over the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_sandboxes_hold_the_same_bounds() {
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let daemon = static_daemon();
    let server = Server::start_in(&state, &["--provider", "docker", "--daemon", daemon.to_str().unwrap()]);
    let http = server.client();
    let err =
        http.post("/v1/sandboxes", json!({"image": BUSYBOX, "lease_s": u64::MAX})).await.error(400, "invalid_argument");
    assert!(message(&err).contains("`lease_s`"), "{err}");
    let id = http.create(json!({"image": BUSYBOX})).await["id"].as_str().unwrap().to_string();
    let err = http
        .post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["true"], "timeout_ms": u64::MAX}))
        .await
        .error(400, "invalid_argument");
    assert!(message(&err).contains("`timeout_ms`"), "{err}");
    let err = http
        .post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["true"], "max_output_bytes": u64::MAX}))
        .await
        .error(400, "invalid_argument");
    assert!(message(&err).contains("`max_output_bytes`"), "{err}");
    let r = http.put(&format!("/v1/sandboxes/{id}/archive?path=/tmp/bomb"), zeros_gz(256 << 20)).await;
    assert!(message(&r.error(413, "too_large")).contains("times its compressed size"));
    let r = http.put(&format!("/v1/sandboxes/{id}/archive?path=/tmp/deep"), deep_tar(2000)).await;
    assert!(message(&r.error(400, "invalid_argument")).contains("levels deep"));
    assert_eq!(http.exec(&id, json!({"argv": ["echo", "alive"]})).await["stdout"], "alive\n");
    http.release(&id).await.ok();
}

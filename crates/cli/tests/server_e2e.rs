//! The whole service on one machine: the real `sandman serve` with the process provider and real
//! daemons, driven over HTTP. Covers creation at scale, the proxy (streams and large bodies),
//! idempotency, reclaiming with reasons, recovery after `kill -9`, auth and bad input.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::time::Duration;

use bytes::Bytes;
use e2e::{Body, Http, Server, eventually, host, processes_mentioning};
use http_body_util::BodyExt;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_sandboxes_at_once_each_used_then_nothing_left() {
    // A hundred at once, each with the default memory limit: more than the machine's memory
    // admits, which is not what this is about.
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_in(&dir.path().join("state"), &["--memory-overcommit", "0"]);
    let http = server.client();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            let sb = http.create(json!({"image": "host", "labels": {"n": i.to_string()}})).await;
            assert_eq!(sb["state"], "ready", "{sb}");
            let id = sb["id"].as_str().unwrap().to_string();
            let r = http.exec(&id, json!({"argv": ["/bin/echo", format!("hello {i}")]})).await;
            assert_eq!(r["stdout"], format!("hello {i}\n"));
            let put = http.put(&format!("/v1/sandboxes/{id}/files?path=/tmp/n.txt"), format!("n={i}")).await;
            assert_eq!(put.status, 200);
            let back = http.get(&format!("/v1/sandboxes/{id}/files?path=/tmp/n.txt")).await;
            assert_eq!(back.body, format!("n={i}"));
            id
        }));
    }
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.unwrap());
    }
    let list = http.get("/v1/sandboxes?state=ready").await.ok();
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 100);
    let mut releases = Vec::new();
    for id in ids {
        let http = http.clone();
        releases.push(tokio::spawn(async move { http.release(&id).await.ok() }));
    }
    for r in releases {
        assert_eq!(r.await.unwrap()["state"], "gone");
    }
    let sandboxes = server.state.join("sandboxes");
    assert!(
        eventually(Duration::from_secs(10), async || processes_mentioning(&sandboxes.display().to_string()).is_empty())
            .await,
        "daemons left: {:?}",
        processes_mentioning(&sandboxes.display().to_string())
    );
    assert!(server.sandbox_dirs().is_empty(), "directories left: {:?}", server.sandbox_dirs());
}

#[tokio::test]
async fn streamed_exec_through_the_proxy() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(host()).await["id"].as_str().unwrap().to_string();
    let resp = http
        .send(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Body::Json(json!({"command": "echo one; sleep 0.3; echo two; exit 5"})),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let mut body = resp.into_body();
    let mut text = String::new();
    let mut first_at = None;
    let t0 = std::time::Instant::now();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            text.push_str(&String::from_utf8_lossy(&data));
            if first_at.is_none() && text.contains("one") {
                first_at = Some(t0.elapsed());
            }
        }
    }
    let events: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.first().unwrap()["event"], "started");
    assert_eq!(events.last().unwrap()["event"], "exit");
    assert_eq!(events.last().unwrap()["exit_code"], 5);
    assert!(first_at.unwrap() < Duration::from_millis(250), "the first line was held back until the end");
    http.release(&id).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_upload_and_download_do_not_grow_the_server_by_their_size() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(host()).await["id"].as_str().unwrap().to_string();
    http.exec(&id, json!({"argv": ["/bin/true"]})).await;
    let before = server.rss_kib();
    const MIB: usize = 1 << 20;
    let chunks = (0..100).map(|i| Bytes::from(vec![(i % 251) as u8; MIB]));
    let put = http
        .call("PUT", &format!("/v1/sandboxes/{id}/files?path=/tmp/big.bin"), Body::Chunks(Box::new(chunks)))
        .await
        .ok();
    assert_eq!(put["size"], 100 * MIB);
    let resp = http.send("GET", &format!("/v1/sandboxes/{id}/files?path=/tmp/big.bin"), Body::Empty).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut total = 0usize;
    let mut peak = server.rss_kib();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            total += data.len();
            peak = peak.max(server.rss_kib());
        }
    }
    assert_eq!(total, 100 * MIB);
    let growth_mib = peak.saturating_sub(before) / 1024;
    assert!(growth_mib < 40, "the server grew by {growth_mib} MiB moving 100 MiB through");
    http.release(&id).await.ok();
}

#[tokio::test]
async fn idempotent_create_returns_the_same_sandbox() {
    let server = Server::start();
    let http = server.client();
    let a = http.create(json!({"image": "host", "idempotency_key": "episode-7"})).await;
    let b = http.create(json!({"image": "host", "idempotency_key": "episode-7"})).await;
    assert_eq!(a["id"], b["id"]);
    assert_eq!(http.get("/v1/sandboxes").await.ok()["sandboxes"].as_array().unwrap().len(), 1);
    http.release(a["id"].as_str().unwrap()).await.ok();
}

#[tokio::test]
async fn leases_idle_timeouts_and_job_deletion_reclaim_with_their_reasons() {
    let server = Server::start();
    let http = server.client();
    let lease = http.create(json!({"image": "host", "lease_s": 1})).await["id"].as_str().unwrap().to_string();
    let idle = http.create(json!({"image": "host", "lease_s": 60, "idle_timeout_s": 1})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    http.post("/v1/jobs/train/heartbeat", json!({})).await.error(404, "not_found");
    http.call("PUT", "/v1/jobs/train", Body::Json(json!({"lease_s": 1}))).await.ok();
    let a = http.create(json!({"image": "host", "job": "train"})).await["id"].as_str().unwrap().to_string();
    let b = http.create(json!({"image": "host", "job": "train"})).await["id"].as_str().unwrap().to_string();
    // Heartbeats keep the job's sandboxes past their 1 s lease.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let hb = http.post("/v1/jobs/train/heartbeat", json!({})).await.ok();
        assert_eq!(hb["sandboxes"], 2);
        let _ = http.post(&format!("/v1/sandboxes/{idle}/keepalive"), json!({})).await;
    }
    let state = |v: serde_json::Value| {
        (v["state"].as_str().unwrap().to_string(), v["reason"].as_str().unwrap_or("").to_string())
    };
    assert_eq!(state(http.get(&format!("/v1/sandboxes/{lease}")).await.ok()), ("gone".into(), "lease_expired".into()));
    assert_eq!(state(http.get(&format!("/v1/sandboxes/{idle}")).await.ok()), ("gone".into(), "idle_expired".into()));
    assert_eq!(state(http.get(&format!("/v1/sandboxes/{a}")).await.ok()).0, "ready");
    let err = http.post(&format!("/v1/sandboxes/{lease}/exec"), json!({"argv": ["true"]})).await.error(410, "gone");
    assert_eq!(err["reason"], "lease_expired");
    let done = http.call("DELETE", "/v1/jobs/train", Body::Empty).await.ok();
    assert_eq!(done["sandboxes"], 2);
    for id in [&a, &b] {
        assert_eq!(state(http.get(&format!("/v1/sandboxes/{id}")).await.ok()), ("gone".into(), "job_deleted".into()));
    }
    let events = http.get("/v1/events").await.ok();
    let reasons: Vec<&str> = events["events"].as_array().unwrap().iter().filter_map(|e| e["reason"].as_str()).collect();
    for r in ["lease_expired", "idle_expired", "job_deleted"] {
        assert!(reasons.contains(&r), "{r} missing from events {reasons:?}");
    }
    let metrics = http.get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("sandman_sandboxes_ended_total{reason=\"lease_expired\"} 1"), "{text}");
}

/// Before, a sandbox was reclaimed for its lease in the middle of an exec longer than the lease.
#[tokio::test]
async fn an_exec_longer_than_the_lease_keeps_its_sandbox() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(json!({"image": "host", "lease_s": 1, "idle_timeout_s": 1})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": "sleep 3; echo done"})).await.ok();
    assert_eq!((r["exit_code"].as_i64(), r["stdout"].as_str()), (Some(0), Some("done\n")), "{r}");
    assert_eq!(http.get(&format!("/v1/sandboxes/{id}")).await.ok()["state"], "ready");
    // Once the call has ended, the lease runs again.
    let gone = eventually(Duration::from_secs(10), async || {
        http.get(&format!("/v1/sandboxes/{id}")).await.ok()["reason"].as_str().is_some()
    })
    .await;
    assert!(gone, "not reclaimed after the call");
    let sb = http.get(&format!("/v1/sandboxes/{id}")).await.ok();
    assert!(matches!(sb["reason"].as_str(), Some("lease_expired" | "idle_expired")), "{sb}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_a_restarted_server_finds_everything_again() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let mut server = Server::start_in(&state, &[]);
    let http = server.client();
    let mut ids = Vec::new();
    for i in 0..5 {
        let sb = http.create(json!({"image": "host", "job": "j", "labels": {"i": i.to_string()}, "lease_s": 300, "idempotency_key": format!("k{i}")})).await;
        ids.push(sb["id"].as_str().unwrap().to_string());
    }
    http.exec(&ids[0], json!({"command": "echo kept > /tmp/mark"})).await;
    server.kill9();
    // One daemon dies while the server is away.
    let victim_pid: i32 = std::fs::read_to_string(state.join(format!("sandboxes/{}/daemon.pid", ids[4])))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    unsafe_free_kill(victim_pid);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let server = Server::start_in(&state, &[]);
    let http = server.client();
    let list = http.get("/v1/sandboxes?job=j").await.ok();
    let all = list["sandboxes"].as_array().unwrap();
    assert_eq!(all.len(), 5, "{list}");
    for (i, id) in ids.iter().enumerate().take(4) {
        let sb = http.get(&format!("/v1/sandboxes/{id}")).await.ok();
        assert_eq!(sb["state"], "ready", "{sb}");
        assert_eq!(sb["labels"]["i"], i.to_string());
        assert_eq!(sb["job"], "j");
        assert_eq!(sb["lease_s"], 300);
    }
    let dead = http.get(&format!("/v1/sandboxes/{}", ids[4])).await.ok();
    assert_eq!(dead["state"], "failed", "{dead}");
    assert!(dead["reason"].is_string());
    // Usable as before, files included.
    let r = http.exec(&ids[0], json!({"argv": ["/bin/cat", "/tmp/mark"]})).await;
    assert_eq!(r["stdout"], "kept\n");
    // The idempotency keys came back too: no duplicate.
    let again = http
        .create(json!({"image": "host", "job": "j", "labels": {"i": "1"}, "lease_s": 300, "idempotency_key": "k1"}))
        .await;
    assert_eq!(again["id"], ids[1]);
    // The same key with another request is refused, not answered with that sandbox.
    http.post("/v1/sandboxes", json!({"image": "host", "idempotency_key": "k1"})).await.error(409, "conflict");
    for id in ids.iter().take(4) {
        http.release(id).await.ok();
    }
    assert!(
        eventually(Duration::from_secs(10), async || processes_mentioning(
            &state.join("sandboxes").display().to_string()
        )
        .is_empty())
        .await,
        "daemons left after release"
    );
}

fn unsafe_free_kill(pid: i32) {
    std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
}

#[tokio::test]
async fn auth_bad_input_and_refused_images() {
    let server = Server::start();
    let anon = Http { addr: server.addr.clone(), token: None };
    assert_eq!(anon.get("/healthz").await.status, 200);
    anon.get("/v1/sandboxes").await.error(401, "unauthorized");
    anon.get("/metrics").await.error(401, "unauthorized");
    let wrong = Http { addr: server.addr.clone(), token: Some("nope".into()) };
    wrong.post("/v1/sandboxes", host()).await.error(401, "unauthorized");

    let http = server.client();
    let e = http.post("/v1/sandboxes", json!({"image": "host", "ttl": 5})).await.error(400, "invalid_argument");
    assert!(e["message"].as_str().unwrap().contains("unknown field `ttl`"));
    // A reference no registry could hold is refused before anything is made; one that no
    // registry serves (loopback's discard port refuses the connection: nothing leaves this
    // machine) fails with the registry's reason.
    let e = http.post("/v1/sandboxes", json!({"image": "Python:3.12"})).await.error(400, "invalid_argument");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("Python:3.12"), "{msg}");
    let e = http.post("/v1/sandboxes", json!({"image": "127.0.0.1:9/absent:1"})).await.error(400, "invalid_argument");
    assert_eq!(e["reason"], "image_pull_failed", "{e}");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("registry 127.0.0.1:9") && msg.contains("Connection refused"), "{msg}");
    http.get("/v1/sandboxes/sb-nope").await.error(404, "not_found");
    http.post("/v1/sandboxes/sb-nope/exec", json!({"argv": ["true"]})).await.error(404, "not_found");
    http.get("/v1/sandboxes?state=bogus").await.error(400, "invalid_argument");
    assert!(server.sandbox_dirs().is_empty());
}

#[tokio::test]
async fn the_embedded_daemon_serves_when_no_sandmand_is_installed() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let alone = dir.path().join("bin/sandman");
    std::fs::create_dir_all(alone.parent().unwrap()).unwrap();
    std::fs::copy(e2e::sandman_bin(), &alone).unwrap();
    // No `sandmand` beside it, none on PATH, none named by SANDMAN_DAEMON.
    assert!(!alone.with_file_name("sandmand").exists());
    let server = temp_env_server(&alone, &dir.path().join("state"));
    let http = server.client();
    let id = http.create(host()).await["id"].as_str().unwrap().to_string();
    let r = http.exec(&id, json!({"argv": ["/bin/echo", "embedded"]})).await;
    assert_eq!(r["stdout"], "embedded\n");
    let daemons = processes_mentioning("__sandmand");
    assert!(!daemons.is_empty(), "the sandbox does not run the embedded daemon");
    http.release(&id).await.ok();
}

fn temp_env_server(bin: &std::path::Path, state: &std::path::Path) -> Server {
    // The variables are changed for the server alone, not for this test process.
    let path = std::env::var("PATH").unwrap_or_default();
    let filtered: Vec<&str> = path.split(':').filter(|d| !std::path::Path::new(d).join("sandmand").exists()).collect();
    Server::start_bin_env(bin, state, &[], &[("PATH", &filtered.join(":"))], &["SANDMAN_DAEMON"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_drives_a_real_server() {
    let server = Server::start();
    let (code, id, err) = e2e::cli(&server, &["create", "host", "--label", "who=cli"]);
    assert_eq!(code, 0, "{err}");
    let id = id.trim().to_string();
    let (code, out, _) = e2e::cli(&server, &["exec", &id, "--", "sh", "-c", "echo out; echo err >&2; exit 3"]);
    assert_eq!((code, out.as_str()), (3, "out\n"));

    // cp in and out, a directory with a mode and a symlink.
    let local = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let src = local.path().join("proj");
    std::fs::create_dir_all(src.join("bin")).unwrap();
    std::fs::write(src.join("bin/run.sh"), "#!/bin/sh\necho run\n").unwrap();
    std::fs::set_permissions(src.join("bin/run.sh"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("bin/run.sh", src.join("latest")).unwrap();
    let (code, _, err) = e2e::cli(&server, &["cp", src.to_str().unwrap(), &format!("{id}:/tmp/proj")]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = e2e::cli(&server, &["exec", &id, "--", "/tmp/proj/latest"]);
    assert_eq!((code, out.as_str()), (0, "run\n"));
    let back = local.path().join("back");
    let (code, _, err) = e2e::cli(&server, &["cp", &format!("{id}:/tmp/proj"), back.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read_to_string(back.join("bin/run.sh")).unwrap(), "#!/bin/sh\necho run\n");
    assert_eq!(std::fs::read_link(back.join("latest")).unwrap().to_str(), Some("bin/run.sh"));

    // ps and logs of a background process started through the API.
    let http = server.client();
    http.post(&format!("/v1/sandboxes/{id}/processes"), json!({"command": "echo logged; sleep 30", "tag": "bg"}))
        .await
        .ok();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, out, _) = e2e::cli(&server, &["ps", &id]);
    assert_eq!(code, 0);
    assert!(out.contains("bg"), "{out}");
    let (code, out, _) = e2e::cli(&server, &["logs", &id, "bg"]);
    assert_eq!((code, out.as_str()), (0, "logged\n"));

    let (code, out, _) = e2e::cli(&server, &["ls", "--json"]);
    assert_eq!(code, 0);
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.as_array().map(|a| a.len()).unwrap_or_else(|| listed["sandboxes"].as_array().unwrap().len()), 1);
    let (code, _, _) = e2e::cli(&server, &["rm", &id]);
    assert_eq!(code, 0);
    let (code, _, err) = e2e::cli(&server, &["rm", &id]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("gone") && err.contains("released"), "{err}");
    let (code, out, err) = e2e::cli(&server, &["run", "host", "--", "sh", "-c", "echo ran; exit 4"]);
    assert_eq!((code, out.as_str()), (4, "ran\n"), "{err}");
}

/// Runs a background process in the sandbox and answers its output once it holds `needle`.
async fn output_with(http: &Http, id: &str, process: &str, needle: &str) -> String {
    let mut text = String::new();
    let found = eventually(Duration::from_secs(20), async || {
        let out = http.get(&format!("/v1/sandboxes/{id}/processes/{process}/output")).await.json();
        text = out["data"].as_str().unwrap_or_default().to_string();
        text.contains(needle)
    })
    .await;
    assert!(found, "`{needle}` never came: {text:?}");
    text
}

#[tokio::test]
async fn a_web_server_in_a_sandbox_answers_through_the_server_websockets_included() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(host()).await["id"].as_str().unwrap().to_string();
    let put =
        http.put(&format!("/v1/sandboxes/{id}/files?path=/tmp/site/hello.txt"), &b"served from a sandbox\n"[..]).await;
    assert_eq!(put.status, 200);
    let start =
        json!({"command": "exec python3 -u -m http.server 0 --bind 127.0.0.1 --directory /tmp/site", "tag": "site"});
    http.post(&format!("/v1/sandboxes/{id}/processes"), start).await.ok();
    let banner = output_with(&http, &id, "site", ") ...").await;
    let port: u16 = banner.split(" port ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().parse().unwrap();
    let r = http.get(&format!("/v1/sandboxes/{id}/ports/{port}/hello.txt")).await;
    assert_eq!((r.status, r.body.as_ref()), (200, &b"served from a sandbox\n"[..]));
    let listing = http.get(&format!("/v1/sandboxes/{id}/ports/{port}/")).await;
    assert!(String::from_utf8_lossy(&listing.body).contains("hello.txt"));
    // A path with percent-encoding reaches the app as the client wrote it.
    let put = http.put(&format!("/v1/sandboxes/{id}/files?path=/tmp/site/two%20words.txt"), &b"spaced\n"[..]).await;
    assert_eq!(put.status, 200);
    let r = http.get(&format!("/v1/sandboxes/{id}/ports/{port}/two%20words.txt")).await;
    assert_eq!((r.status, r.body.as_ref()), (200, &b"spaced\n"[..]), "{}", String::from_utf8_lossy(&r.body));
    let anonymous = Http { addr: http.addr.clone(), token: None };
    anonymous.get(&format!("/v1/sandboxes/{id}/ports/{port}/hello.txt")).await.error(401, "unauthorized");
    http.get(&format!("/v1/sandboxes/{id}/ports/0/")).await.error(400, "invalid_argument");

    // A WebSocket, upgraded through the server and the daemon, to an app uploaded first: the
    // checkout may lie where a sandbox cannot see (under /var/tmp, say).
    let app = include_bytes!("../../sandmand/tests/fixtures/web.py");
    let put = http.put(&format!("/v1/sandboxes/{id}/files?path=/tmp/web.py"), &app[..]).await;
    assert_eq!(put.status, 200);
    http.post(&format!("/v1/sandboxes/{id}/processes"), json!({"argv": ["python3", "/tmp/web.py"], "tag": "ws"}))
        .await
        .ok();
    let ws_port: u16 = output_with(&http, &id, "ws", "\n").await.trim().parse().unwrap();
    let mut s = tokio::net::TcpStream::connect(&http.addr).await.unwrap();
    let handshake = format!(
        "GET /v1/sandboxes/{id}/ports/{ws_port}/chat HTTP/1.1\r\nHost: sandman\r\nAuthorization: Bearer {}\r\n\
         Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        http.token.as_deref().unwrap()
    );
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(handshake.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).await.unwrap(), 1, "{}", String::from_utf8_lossy(&head));
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(head.contains("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "{head}");
    for msg in ["hello", "through two hops"] {
        let mask = [7u8, 1, 9, 3];
        let mut frame = vec![0x81, 0x80 | msg.len() as u8];
        frame.extend_from_slice(&mask);
        frame.extend(msg.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        s.write_all(&frame).await.unwrap();
        let mut h = [0u8; 2];
        s.read_exact(&mut h).await.unwrap();
        let mut data = vec![0u8; (h[1] & 0x7f) as usize];
        s.read_exact(&mut data).await.unwrap();
        assert_eq!(String::from_utf8(data).unwrap(), format!("echo: {msg}"));
    }
    http.release(&id).await;
}

/// A create's `user` is the default of every command of the sandbox that names none.
#[tokio::test]
async fn a_creates_user_runs_every_command_that_names_none() {
    let server = Server::start();
    let http = server.client();
    let sb = http.create(json!({"image": "host", "user": "65534"})).await;
    assert_eq!((sb["user"].as_str(), sb.get("image_config")), (Some("65534"), None), "{sb}");
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(http.exec(&id, json!({"argv": ["id", "-u"]})).await["stdout"], "65534\n");
    assert_eq!(http.exec(&id, json!({"argv": ["id", "-u"], "user": "0"})).await["stdout"], "0\n");
    http.post(&format!("/v1/sandboxes/{id}/processes"), json!({"argv": ["id", "-u"], "tag": "p"})).await.ok();
    http.post(&format!("/v1/sandboxes/{id}/processes/p/wait"), json!({})).await.ok();
    assert_eq!(output_with(&http, &id, "p", "\n").await, "65534\n");
    let s = http.post(&format!("/v1/sandboxes/{id}/sessions"), json!({})).await.ok();
    let r = http
        .post(&format!("/v1/sandboxes/{id}/sessions/{}/run", s["id"].as_str().unwrap()), json!({"command": "id -u"}))
        .await
        .ok();
    assert_eq!(r["stdout"], "65534\n");
    let bad = http.post("/v1/sandboxes", json!({"image": "host", "user": "a b"})).await;
    bad.error(400, "invalid_argument");
    http.release(&id).await;
}

/// Regression (issue 29): the CLI sent the server's token to whatever listened on the server's
/// TCP address, a squatter included. Without a URL it now finds a server on this machine on
/// the Unix socket in its state directory, where only the server's user can make one.
#[tokio::test]
async fn the_cli_finds_a_local_server_on_its_socket_and_a_second_server_is_refused() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let server = Server::start_in(&state, &[]);
    let socket = state.join("sandman.sock");
    let meta = std::fs::metadata(&socket).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    // No URL: the server listens on a port the CLI cannot guess, so only the socket reaches it.
    let out = std::process::Command::new(e2e::sandman_bin())
        .args(["ls", "-q"])
        .env_remove("SANDMAN_URL")
        .env("SANDMAN_STATE_DIR", &state)
        .env("SANDMAN_TOKEN", e2e::TOKEN)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A second server on the same state directory would take the first one's sandboxes for its own.
    let second = std::process::Command::new(e2e::sandman_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&state)
        .env("SANDMAN_TOKEN", e2e::TOKEN)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{said}");
    assert!(said.contains("another server runs on this state directory"), "{said}");
    drop(server);
}

/// Without isolation memory could only be an address-space limit per process, which stops a JVM
/// (it reserves 1 GiB of class space at start): a create that names no memory gets none there,
/// and the default disk still bounds the files it writes.
#[tokio::test]
async fn without_isolation_a_create_gets_the_default_disk_and_no_default_memory() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_in(&dir.path().join("state"), &["--isolation", "none"]);
    let http = server.client();
    let sb = http.create(json!({"image": "host"})).await;
    assert_eq!(sb["resources"], json!({"disk": "1Gi"}), "{sb}");
    let id = sb["id"].as_str().unwrap();
    let r = http.exec(id, json!({"argv": ["sh", "-c", "ulimit -v; ulimit -f"]})).await;
    assert_eq!(r["stdout"], format!("unlimited\n{}\n", (1u64 << 30) / 512), "{r}");
    // A create that names memory still gets it, as that limit.
    let sb = http.create(json!({"image": "host", "resources": {"memory": "3Gi"}})).await;
    let r = http.exec(sb["id"].as_str().unwrap(), json!({"argv": ["sh", "-c", "ulimit -v"]})).await;
    assert_eq!(r["stdout"], format!("{}\n", (3u64 << 30) / 1024), "{r}");
}

/// Regression: `serve --state-dir` with a relative path, as root, refused to start ("this host
/// cannot isolate sandboxes: cannot mount the writable layer at `/host/<relative path>/…`"): the
/// isolated daemon resolved the provider's paths from the root of its own mount namespace.
#[tokio::test]
async fn a_relative_state_directory_works_isolated() {
    sandman_testkit::require_root();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_relative(dir.path(), std::path::Path::new("state"));
    let http = server.client();
    let sb = http.create(json!({"image": "host"})).await;
    let id = sb["id"].as_str().unwrap();
    let out = http.exec(id, json!({"argv": ["/bin/echo", "isolated"]})).await;
    assert_eq!(out["stdout"], "isolated\n", "{out}");
    assert!(dir.path().join("state/sandboxes").join(id).is_dir());
    http.release(id).await;
}

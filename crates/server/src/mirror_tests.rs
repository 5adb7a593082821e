//! A follower replica passing a sandbox's daemon calls straight to its daemon (a real `sandmand`,
//! which must be built: `cargo build -p sandmand`), from routes the leader streams.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::StatusCode;
use http_body_util::BodyExt;
use sandman_provider::Endpoint;
use sandman_provider::fake::FakeProvider;
use tokio::sync::watch;
use tower::ServiceExt;

use super::*;
use crate::api::{Limits, router};
use crate::replicas::Replica;
use crate::service::{Daemons, Settings};

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn call(app: &Router, method: &str, uri: &str, token: &str, body: &str) -> (StatusCode, serde_json::Value) {
    let req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_else(|e| panic!("{e}"));
    let resp = app.clone().oneshot(req).await.unwrap_or_else(|e| match e {});
    let status = resp.status();
    let bytes = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    (status, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    assert!(sandman_testkit::eventually(Duration::from_secs(30), &mut f).await, "{what}: not within 30 s");
}

/// The leader's replica (serving the whole API and the routes stream), its service, and the
/// daemon socket every sandbox of its fake provider answers at.
async fn leader(dir: &std::path::Path) -> (String, Arc<Service>, std::path::PathBuf) {
    let socket = dir.join("daemon.sock");
    let settings = Settings { create_rate: None, daemons: Daemons::Absent, ..Settings::new(dir.into()) };
    let provider = crate::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(socket.clone())));
    let service = Service::new(settings, provider, "t".into());
    service.start_background();
    let app = router(service.clone(), Limits { request_timeout: Duration::from_secs(30), max_concurrent: 64 })
        .merge(leader_routes(service.clone()));
    let replica = Replica::new("127.0.0.1:2".into(), watch::channel(None).1, CancellationToken::new(), None);
    let _ = replica.leading.set((app, service.clone()));
    (serve(replica.router()).await, service, socket)
}

/// A real daemon holding `token`, listening at `socket`.
fn daemon(socket: &std::path::Path, token: &str, logs: &std::path::Path) -> sandman_testkit::Spawned {
    let mut cmd = std::process::Command::new(sandman_testkit::daemon_beside_tests());
    cmd.arg("--listen").arg(format!("unix:{}", socket.display())).env("SANDMAN_TOKEN", token);
    let d = sandman_testkit::Spawned::spawn("sandmand", &mut cmd, logs);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(std::time::Instant::now() < deadline, "the daemon never listened: {}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

fn lease_expiry(service: &Service, id: &str) -> u64 {
    service.get(id).map(|sb| sb.to_wire().lease_expires_at_ms.unwrap_or_default()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_calls_a_sandboxs_daemon_itself_and_tells_the_leader() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (leader_addr, service, socket) = leader(dir.path()).await;
    let (leader_tx, leader_rx) = watch::channel(Some(leader_addr.clone()));
    let mirror = Mirror::new("t".into(), 1 << 20);
    let follower = Replica::new("127.0.0.1:3".into(), leader_rx, CancellationToken::new(), Some(mirror.clone()));
    let stop = CancellationToken::new();
    let following = tokio::spawn(follower.clone().follow(stop.clone()));
    let app = follower.router();

    // A create through the follower goes to the leader.
    let (status, made) = call(&app, "POST", "/v1/sandboxes", "t", r#"{"image":"img","lease_s":60}"#).await;
    assert_eq!(status, StatusCode::OK, "{made}");
    let id = made["id"].as_str().unwrap_or_default().to_string();
    let token = service.get(&id).map(|sb| sb.spec.token.clone()).unwrap_or_default();
    let _daemon = daemon(&socket, &token, dir.path());
    eventually("the follower has the new sandbox's route", || mirror.len() == 1).await;

    // An exec on the follower reaches the daemon without the leader.
    let before = lease_expiry(&service, &id);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, out) = call(&app, "POST", &exec, "t", r#"{"argv":["echo","straight"]}"#).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["stdout"], "straight\n", "{out}");
    assert_eq!(mirror.direct_calls(), 1);
    assert_eq!(service.metrics.proxied.get(), 0, "the leader proxied nothing");
    // The follower's own figures, for Prometheus.
    let metrics = app
        .clone()
        .oneshot(http::Request::get("/metrics").body(Body::empty()).unwrap_or_else(|e| panic!("{e}")))
        .await
        .unwrap_or_else(|e| match e {});
    let metrics = metrics.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    assert_eq!(
        String::from_utf8_lossy(&metrics),
        "sandman_replica_leading 0\nsandman_replica_routes 1\nsandman_replica_direct_calls_total 1\n"
    );
    // The follower told the leader, which renewed the lease from then.
    eventually("the leader renews the lease from the follower's report", || {
        lease_expiry(&service, &id) >= before + 1000
    })
    .await;
    // The server's token is still needed.
    let (status, out) = call(&app, "POST", &exec, "not-t", r#"{"argv":["true"]}"#).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{out}");
    // The leader's own sandbox calls (keepalive) are passed on to it.
    let (status, out) = call(&app, "POST", &format!("/v1/sandboxes/{id}/keepalive"), "t", "").await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(mirror.direct_calls(), 1, "neither the refused exec nor the keepalive went to the daemon");

    // The leader goes away: calls to the running sandbox still go through.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
    let dead_addr = dead.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    drop(dead);
    leader_tx.send_replace(Some(dead_addr));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, out) = call(&app, "POST", &exec, "t", r#"{"argv":["echo","no leader"]}"#).await;
    assert_eq!((status, out["stdout"].as_str()), (StatusCode::OK, Some("no leader\n")), "{out}");

    // Back to the leader, which releases the sandbox: its route goes, and calls go to the
    // leader, which says it is gone.
    leader_tx.send_replace(Some(leader_addr));
    let (status, out) = call(&app, "DELETE", &format!("/v1/sandboxes/{id}"), "t", "").await;
    assert_eq!(status, StatusCode::OK, "{out}");
    eventually("the released sandbox's route goes", || mirror.is_empty()).await;
    let (status, out) = call(&app, "POST", &exec, "t", r#"{"argv":["true"]}"#).await;
    assert!(status == StatusCode::GONE || status == StatusCode::NOT_FOUND, "{status} {out}");
    stop.cancel();
    let _ = following.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_fails_its_proof_on_a_follower_is_reported_and_its_sandbox_ended() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (leader_addr, service, socket) = leader(dir.path()).await;
    let mirror = Mirror::new("t".into(), 1 << 20);
    let follower = Replica::new(
        "127.0.0.1:3".into(),
        watch::channel(Some(leader_addr)).1,
        CancellationToken::new(),
        Some(mirror.clone()),
    );
    let stop = CancellationToken::new();
    let following = tokio::spawn(follower.clone().follow(stop.clone()));
    let app = follower.router();
    let (status, made) = call(&app, "POST", "/v1/sandboxes", "t", r#"{"image":"img"}"#).await;
    assert_eq!(status, StatusCode::OK, "{made}");
    let id = made["id"].as_str().unwrap_or_default().to_string();
    // Another sandbox's daemon answers at its address.
    let _daemon = daemon(&socket, "some-other-sandboxs-token", dir.path());
    eventually("the follower has the route", || mirror.len() == 1).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, out) = call(&app, "POST", &exec, "t", r#"{"argv":["true"]}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{out}");
    assert!(out["error"]["message"].as_str().unwrap_or_default().contains("did not prove"), "{out}");
    eventually("the leader ends the sandbox once told", || service.get(&id).is_ok_and(|sb| sb.state().is_terminal()))
        .await;
    let (status, out) = call(&app, "POST", &exec, "t", r#"{"argv":["true"]}"#).await;
    assert_eq!(status, StatusCode::GONE, "{out}");
    stop.cancel();
    let _ = following.await;
}

#[test]
fn only_daemon_calls_are_taken_from_the_path() {
    use crate::proxy::daemon_call;
    assert_eq!(daemon_call("/v1/sandboxes/sb-1/ports/80/two%20words"), Some(("sb-1", "ports/80/two%20words")));
    assert_eq!(daemon_call("/v1/sandboxes/sb-1/exec"), Some(("sb-1", "exec")));
    assert_eq!(daemon_call("/v1/sandboxes/sb-1/ports/80/a/b"), Some(("sb-1", "ports/80/a/b")));
    assert_eq!(daemon_call("/v1/sandboxes/sb-1/files"), Some(("sb-1", "files")));
    for control in ["keepalive", "pause", "resume", "conditions", "snapshots", "fork"] {
        assert_eq!(daemon_call(&format!("/v1/sandboxes/sb-1/{control}")), None, "{control}");
    }
    assert_eq!(daemon_call("/v1/sandboxes/sb-1"), None);
    assert_eq!(daemon_call("/v1/sandboxes/sb-1/"), None);
    assert_eq!(daemon_call("/v1/sandboxes"), None);
    assert_eq!(daemon_call("/v1/jobs/j/usage"), None);
}

#[test]
fn a_reset_replaces_the_table_only_once_it_is_whole() {
    let mirror = Mirror::new("t".into(), 1 << 20);
    let route = |n: u8| Route {
        endpoint: Endpoint::Tcp(format!("127.0.0.{n}:7778")),
        token: format!("k{n}"),
        env: Arc::default(),
        eval: false,
        user: None,
    };
    let mut pending = None;
    mirror.apply(Line::Set { id: "a".into(), route: route(1) }, &mut pending);
    mirror.apply(Line::Set { id: "b".into(), route: route(2) }, &mut pending);
    assert_eq!(mirror.len(), 2);
    mirror.apply(Line::Reset, &mut pending);
    mirror.apply(Line::Set { id: "c".into(), route: route(3) }, &mut pending);
    mirror.apply(Line::Set { id: "a".into(), route: route(1) }, &mut pending);
    assert_eq!(mirror.len(), 2, "the old table serves until the new one is whole");
    assert!(mirror.route("b").is_some());
    mirror.apply(Line::Synced, &mut pending);
    assert!(mirror.route("a").is_some() && mirror.route("c").is_some() && mirror.route("b").is_none());
    // The daemon of a route dropped is no longer one a connection may be made to.
    assert_eq!(mirror.identities.len(), 2);
    mirror.apply(Line::Unset { id: "a".into() }, &mut pending);
    assert_eq!((mirror.len(), mirror.identities.len()), (1, 1));
    // The lines as they go over the wire.
    let line = serde_json::to_string(&Line::Unset { id: "c".into() }).unwrap_or_default();
    assert_eq!(line, r#"{"unset":{"id":"c"}}"#);
    assert_eq!(serde_json::to_string(&Line::Reset).unwrap_or_default(), r#""reset""#);
}

#[test]
fn a_report_names_each_sandbox_called_or_in_a_call_once() {
    let mirror = Mirror::new("t".into(), 1 << 20);
    let long = Called::new(mirror.clone(), "long");
    drop(Called::new(mirror.clone(), "short"));
    drop(Called::new(mirror.clone(), "short"));
    let mut first = mirror.take_report().called;
    first.sort();
    assert_eq!(first, ["long", "short"]);
    // Still in a call: named again; the short one is not.
    assert_eq!(mirror.take_report().called, ["long"]);
    drop(long);
    assert_eq!(mirror.take_report().called, ["long"], "its end is activity too");
    assert!(mirror.take_report().called.is_empty());
}

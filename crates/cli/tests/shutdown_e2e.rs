//! A server asked to stop as Kubernetes asks a pod (SIGTERM): readiness turns 503 at once while
//! every call is still served for the drain period (each answer closing its connection, so that
//! kept-alive clients go elsewhere); a second signal ends the drain, the server stops accepting,
//! a call in flight still finishes, and the process exits.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use e2e::{Body, Server, eventually};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::json;

fn sigterm(server: &Server) {
    let sent = std::process::Command::new("kill").args(["-TERM", &server.pid().to_string()]).status().unwrap();
    assert!(sent.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_turns_readiness_off_while_calls_are_served_then_in_flight_calls_finish_and_it_exits() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    // A drain far longer than the test: only the second signal ends it.
    let mut server = Server::start_in(
        &dir.path().join("state"),
        &["--shutdown-drain-s", "3600", "--shutdown-timeout-s", "600", "--memory-overcommit", "0"],
    );
    let http = server.client();
    assert_eq!(http.get("/readyz").await.ok()["status"], "ready");
    let sb = http.create(json!({"image": "host"})).await;
    let id = sb["id"].as_str().unwrap().to_string();

    sigterm(&server);
    let draining = eventually(Duration::from_secs(30), async || http.get("/readyz").await.status == 503).await;
    assert!(draining, "readiness never turned 503");
    let ready = http.get("/readyz").await;
    assert_eq!(ready.error(503, "unavailable")["reason"], "draining");
    assert_eq!(http.get("/healthz").await.ok()["status"], "ok");

    // Calls are still served, on new connections, and each answer closes its connection.
    let resp =
        http.send("POST", &format!("/v1/sandboxes/{id}/exec"), Body::Json(json!({"argv": ["echo", "hi"]}))).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("connection").and_then(|v| v.to_str().ok()), Some("close"));
    let out: serde_json::Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(out["stdout"], "hi\n");
    let another = http.create(json!({"image": "host"})).await;
    assert_eq!(another["state"], "ready");

    // An upload in flight: its head and first bytes are sent, the rest is held back.
    let stream = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let body = StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    }));
    let req = hyper::Request::put(format!("/v1/sandboxes/{id}/files?path=/tmp/late.txt"))
        .header("host", "sandman")
        .header("authorization", format!("Bearer {}", e2e::TOKEN))
        .body(body)
        .unwrap();
    let upload = tokio::spawn(async move { sender.send_request(req).await });
    tx.send(Bytes::from_static(b"written ")).await.unwrap();

    // The second signal ends the drain: no new connection is accepted...
    sigterm(&server);
    let closed =
        eventually(Duration::from_secs(30), async || tokio::net::TcpStream::connect(&server.addr).await.is_err()).await;
    assert!(closed, "still accepting after the drain ended");
    // ...but the upload in flight is finished and answered.
    tx.send(Bytes::from_static(b"after the drain")).await.unwrap();
    drop(tx);
    let answer = upload.await.unwrap().unwrap();
    assert_eq!(answer.status(), 200);
    let stat: serde_json::Value =
        serde_json::from_slice(&answer.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(stat["size"], "written after the drain".len(), "{stat}");
    let status = server.process.wait_exit(Duration::from_secs(120));
    assert!(status.is_some_and(|s| s.success()), "the server did not exit cleanly: {status:?}");
}

//! The port proxy through the real daemon: HTTP to an app listening on 127.0.0.1 inside the
//! sandbox, bodies and queries passed on, the daemon's token kept back, and a WebSocket spliced
//! through.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Body, Daemon, TOKEN};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WEB_APP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/web.py");

/// Starts the test web app in the daemon and answers the port it listens on.
async fn start_app(d: &Daemon) -> u16 {
    let r = d.json("POST", "/v1/processes", json!({"argv": ["python3", WEB_APP], "cwd": d.dir(), "tag": "web"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let mut follow = d.connect().await;
    let resp = follow.send("GET", "/v1/processes/web/output?follow=true", Some(TOKEN), Body::Empty).await.unwrap();
    let mut events = common::Events::new(resp);
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while !text.contains('\n') {
            let ev = events.next().await.expect("the web app ended before printing its port");
            if ev["event"] == "data" {
                text.push_str(ev["data"].as_str().unwrap());
            }
        }
        text.trim().parse::<u16>().unwrap()
    })
    .await
    .expect("the web app never printed its port")
}

#[tokio::test]
async fn http_to_a_port_in_the_sandbox_keeps_bodies_and_queries_but_not_the_token() {
    let d = Daemon::start().await;
    std::fs::write(d.dir().join("hello.txt"), "hello from the sandbox\n").unwrap();
    let port = start_app(&d).await;

    let r = d.get(&format!("/v1/ports/{port}/hello.txt")).await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "hello from the sandbox\n"));
    let r = d
        .call("POST", &format!("/v1/ports/{port}/echo?x=1&y=2"), Some(TOKEN), Body::Bytes(b"payload".to_vec()))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["path"], "/echo?x=1&y=2");
    assert_eq!(v["body"], "payload");
    assert_eq!(v["authorization"], serde_json::Value::Null, "the daemon's token reached the app");
    assert_eq!(v["host"], format!("127.0.0.1:{port}"));
    // The app's own answers pass through, errors included.
    assert_eq!(d.get(&format!("/v1/ports/{port}/missing.txt")).await.status, 404);
    let root = d.get(&format!("/v1/ports/{port}")).await;
    assert!(root.status == 200 && root.text().contains("hello.txt"), "{}", root.text());
    // Without the token, nothing reaches the app.
    let r = d.call("GET", &format!("/v1/ports/{port}/hello.txt"), None, Body::Empty).await.unwrap();
    r.error(401, "unauthorized");
}

#[tokio::test]
async fn bad_ports_and_silent_ports_are_clear_errors() {
    let d = Daemon::start().await;
    for bad in ["0", "65536", "http"] {
        assert!(d.get(&format!("/v1/ports/{bad}/x")).await.error(400, "invalid_argument").contains("not a port"));
    }
    // Port 1 (tcpmux) has no listener on any machine the tests run on.
    let msg = d.get("/v1/ports/1/x").await.error(503, "unavailable");
    assert!(msg.contains("nothing answers on port 1"), "{msg}");
}

#[tokio::test]
async fn a_websocket_is_spliced_through() {
    let d = Daemon::start().await;
    let port = start_app(&d).await;
    let mut s = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
    let handshake = format!(
        "GET /v1/ports/{port}/ws HTTP/1.1\r\nHost: sandbox\r\nAuthorization: Bearer {TOKEN}\r\nConnection: Upgrade\r\n\
         Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    s.write_all(handshake.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(head.to_ascii_lowercase().contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="), "{head}");
    for msg in ["hi", "second message"] {
        s.write_all(&masked_text_frame(msg.as_bytes())).await.unwrap();
        assert_eq!(read_frame(&mut s).await, format!("echo: {msg}"));
    }
}

async fn read_head(s: &mut (impl AsyncReadExt + Unpin)) -> String {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).await.unwrap(), 1, "closed in the handshake: {}", String::from_utf8_lossy(&head));
        head.push(b[0]);
    }
    String::from_utf8(head).unwrap()
}

fn masked_text_frame(data: &[u8]) -> Vec<u8> {
    let mask = [1u8, 2, 3, 4];
    let mut f = vec![0x81, 0x80 | data.len() as u8];
    f.extend_from_slice(&mask);
    f.extend(data.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

async fn read_frame(s: &mut (impl AsyncReadExt + Unpin)) -> String {
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await.unwrap();
    let mut data = vec![0u8; (head[1] & 0x7f) as usize];
    s.read_exact(&mut data).await.unwrap();
    String::from_utf8(data).unwrap()
}

//! A small HTTP/1.1 client for a sandbox's daemon over its Unix socket, and the daemon check the
//! conformance suite runs: what every provider's tests need to reach the daemons they make.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

use crate::Endpoint;

/// The socket of a Unix endpoint; any other endpoint is a failure of the provider under test.
pub fn socket_of(endpoint: &Endpoint) -> PathBuf {
    match endpoint {
        Endpoint::Unix(p) => p.clone(),
        other => panic!("the provider answered a non-Unix endpoint: {other:?}"),
    }
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn ok(self) -> Resp {
        assert!((200..300).contains(&self.status), "{}: {}", self.status, String::from_utf8_lossy(&self.body));
        self
    }
}

/// One request with a raw body on a fresh connection.
pub async fn call_raw(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: Bytes,
) -> Result<Resp, String> {
    let stream = UnixStream::connect(socket).await.map_err(|e| format!("connect {}: {e}", socket.display()))?;
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder().method(method).uri(path).header("host", "sandbox");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if let Some(c) = content_type {
        req = req.header("content-type", c);
    }
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Resp { status, body })
}

/// One JSON request (or none) on a fresh connection.
pub async fn call(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Result<Resp, String> {
    match body {
        Some(v) => {
            let bytes = serde_json::to_vec(&v).map_err(|e| e.to_string())?;
            call_raw(socket, method, path, token, Some("application/json"), Bytes::from(bytes)).await
        }
        None => call_raw(socket, method, path, token, None, Bytes::new()).await,
    }
}

/// Waits up to 20 s for the daemon's health (a provider may answer before its daemon listens).
pub async fn wait_healthy(socket: &Path) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..1000 {
        match call(socket, "GET", "/v1/health", None, None).await {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("health answered {}", r.status),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("daemon on {} not healthy within 20 s: {last}", socket.display()))
}

/// A ready daemon's exec of `argv`.
pub async fn exec(socket: &Path, token: &str, argv: &[&str]) -> Result<Value, String> {
    let r = call(socket, "POST", "/v1/exec", Some(token), Some(serde_json::json!({"argv": argv}))).await?;
    if r.status != 200 {
        return Err(format!("exec answered {}: {}", r.status, String::from_utf8_lossy(&r.body)));
    }
    Ok(r.json())
}

/// The daemon check of [`super::create_list_delete`] for providers with Unix endpoints: health,
/// then `/bin/echo hi` with the sandbox's token.
pub async fn check_daemon(endpoint: Endpoint, token: String) -> Result<(), String> {
    let socket = socket_of(&endpoint);
    wait_healthy(&socket).await?;
    let out = exec(&socket, &token, &["/bin/echo", "hi"]).await?;
    if out["exit_code"] == 0 && out["stdout"] == "hi\n" { Ok(()) } else { Err(format!("echo hi gave {out}")) }
}

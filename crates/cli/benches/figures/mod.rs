//! What the benchmarks share: their knobs from the environment, quantiles and units of the
//! durations they measure, and a kept-alive HTTP/1.1 connection to time calls on.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;

/// `name` from the environment as a number, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The `p` quantile of sorted durations; zero for none (a figure not measured).
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// p50 and p99 of `v`, sorted in place.
pub fn p50_p99(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort();
    (pct(v, 0.5), pct(v, 0.99))
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Proportional set size: shared pages (the static daemon's code, shared by all sandboxes)
/// divided among the processes that map them.
pub fn pss_kib(pid: u32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    rollup
        .lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// With `SANDMAN_BENCH_BASELINE` (a directory holding another build's `sandman` and `sandmand`),
/// a server of that build on a state directory in `scratch`, its create rate unlimited: the
/// directory, the server, and the state's directory (removed when dropped).
pub fn baseline_server(scratch: &Path) -> Option<(PathBuf, crate::e2e::Server, tempfile::TempDir)> {
    let dir = PathBuf::from(std::env::var_os("SANDMAN_BENCH_BASELINE")?);
    let state = tempfile::tempdir_in(scratch).unwrap();
    let daemon = dir.join("sandmand").display().to_string();
    let server = crate::e2e::Server::start_bin(
        &dir.join("sandman"),
        &state.path().join("state"),
        &["--daemon", &daemon, "--create-rate", "0"],
    );
    Some((dir, server, state))
}

/// A kept-alive HTTP/1.1 connection.
pub struct Conn {
    sender: http1::SendRequest<Full<bytes::Bytes>>,
    token: String,
}

impl Conn {
    pub async fn tcp(addr: &str, token: &str) -> Conn {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        Conn::over(hyper_util::rt::TokioIo::new(s), token).await
    }

    pub async fn unix(path: &Path, token: &str) -> Conn {
        let s = tokio::net::UnixStream::connect(path).await.unwrap();
        Conn::over(hyper_util::rt::TokioIo::new(s), token).await
    }

    pub async fn over<T>(io: T, token: &str) -> Conn
    where
        T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (sender, conn) = http1::handshake(io).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender, token: token.to_string() }
    }

    pub async fn send(&mut self, method: &str, path: &str, body: bytes::Bytes, content_type: Option<&str>) -> u16 {
        let status = self.try_send(method, path, body, content_type).await;
        assert!(status < 300, "{method} {path}: {status}");
        status
    }

    /// The status of one call, whatever it is.
    pub async fn try_send(&mut self, method: &str, path: &str, body: bytes::Bytes, content_type: Option<&str>) -> u16 {
        self.exchange(method, path, body, content_type).await.0
    }

    /// The status and body of one call.
    pub async fn exchange(
        &mut self,
        method: &str,
        path: &str,
        body: bytes::Bytes,
        content_type: Option<&str>,
    ) -> (u16, bytes::Bytes) {
        self.sender.ready().await.unwrap();
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "bench")
            .header("authorization", format!("Bearer {}", self.token));
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let resp = self.sender.send_request(req.body(Full::new(body)).unwrap()).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        if status >= 300 {
            eprintln!("{method} {path}: {status} {}", String::from_utf8_lossy(&body));
        }
        (status, body)
    }

    /// A JSON call that must succeed, and its answer.
    pub async fn post_for(&mut self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let body = bytes::Bytes::from(serde_json::to_vec(body).unwrap());
        let (status, answer) = self.exchange("POST", path, body, Some("application/json")).await;
        assert!(status < 300, "POST {path}: {status}");
        serde_json::from_slice(&answer).unwrap()
    }

    pub async fn post(&mut self, path: &str, body: &serde_json::Value) -> u16 {
        let body = bytes::Bytes::from(serde_json::to_vec(body).unwrap());
        self.send("POST", path, body, Some("application/json")).await
    }

    pub async fn get(&mut self, path: &str) -> u16 {
        self.send("GET", path, bytes::Bytes::new(), None).await
    }

    pub async fn put(&mut self, path: &str, body: bytes::Bytes, content_type: &str) -> u16 {
        self.send("PUT", path, body, Some(content_type)).await
    }
}

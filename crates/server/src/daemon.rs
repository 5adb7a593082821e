//! The server's HTTP client to sandbox daemons: one pooled hyper client whose connector dials the
//! daemon's Unix socket (or TCP address) named, hex-encoded, in the request's host.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandman_provider::Endpoint;
use tokio::net::{TcpStream, UnixStream};

/// A connection to a daemon, over either transport.
#[derive(Debug)]
pub enum DaemonStream {
    Unix(TokioIo<UnixStream>),
    Tcp(TokioIo<TcpStream>),
}

impl Connection for DaemonStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for DaemonStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DaemonStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            DaemonStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for DaemonStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            DaemonStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            DaemonStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DaemonStream::Unix(s) => Pin::new(s).poll_flush(cx),
            DaemonStream::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DaemonStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            DaemonStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Dials the endpoint encoded in a URI's host by [`authority`].
#[derive(Debug, Clone, Default)]
pub struct Connector;

impl tower::Service<Uri> for Connector {
    type Response = DaemonStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<DaemonStream>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(async move {
            let host = uri.host().unwrap_or_default();
            match decode(host) {
                Some(Endpoint::Unix(path)) => Ok(DaemonStream::Unix(TokioIo::new(UnixStream::connect(path).await?))),
                Some(Endpoint::Tcp(addr)) => {
                    let s = TcpStream::connect(addr).await?;
                    s.set_nodelay(true)?;
                    Ok(DaemonStream::Tcp(TokioIo::new(s)))
                }
                None => {
                    Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("not a daemon address: {host}")))
                }
            }
        })
    }
}

/// The URI host naming an endpoint: `u` or `t`, then the path or address in hex.
pub fn authority(endpoint: &Endpoint) -> String {
    let (kind, raw) = match endpoint {
        Endpoint::Unix(p) => ('u', p.as_os_str().as_encoded_bytes().to_vec()),
        Endpoint::Tcp(a) => ('t', a.as_bytes().to_vec()),
    };
    let mut s = String::with_capacity(1 + raw.len() * 2);
    s.push(kind);
    for b in raw {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn decode(host: &str) -> Option<Endpoint> {
    let (kind, hex) = host.split_at_checked(1)?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok()).collect();
    let bytes = bytes?;
    match kind {
        "u" => Some(Endpoint::Unix(std::path::PathBuf::from(String::from_utf8(bytes).ok()?))),
        "t" => Some(Endpoint::Tcp(String::from_utf8(bytes).ok()?)),
        _ => None,
    }
}

pub type DaemonClient = Client<Connector, Body>;

pub fn client() -> DaemonClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(4)
        .build(Connector)
}

/// `http://<encoded endpoint><path_and_query>`.
pub fn uri(endpoint: &Endpoint, path_and_query: &str) -> Result<Uri, http::Error> {
    Uri::builder().scheme("http").authority(authority(endpoint)).path_and_query(path_and_query).build()
}

/// One call with an empty body; the status, or the transport error as text.
pub async fn call(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    method: http::Method,
    path: &str,
) -> Result<http::StatusCode, String> {
    let uri = uri(endpoint, path).map_err(|e| e.to_string())?;
    let req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.status())
}

/// Largest daemon answer read whole by the server (setup results, info).
const MAX_ANSWER: usize = 1 << 20;

/// One call with a JSON body (or none), its JSON answer decoded; failures as text.
pub async fn call_json<B: serde::Serialize, T: serde::de::DeserializeOwned>(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    method: http::Method,
    path: &str,
    body: Option<&B>,
) -> Result<T, String> {
    use http_body_util::BodyExt;
    let uri = uri(endpoint, path).map_err(|e| e.to_string())?;
    let mut req =
        http::Request::builder().method(method).uri(uri).header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    let body = match body {
        Some(b) => {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
            Body::from(serde_json::to_vec(b).map_err(|e| e.to_string())?)
        }
        None => Body::empty(),
    };
    let req = req.body(body).map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let bytes = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    if !status.is_success() {
        let detail = serde_json::from_slice::<sandman_wire::ErrorBody>(&bytes)
            .map(|b| b.error.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        return Err(format!("the daemon answered {status}: {detail}"));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("cannot decode the daemon's answer: {e}"))
}

/// Waits until the daemon answers its health check, backing off from 5 ms to 100 ms.
pub async fn wait_healthy(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    limit: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut pause = Duration::from_millis(5);
    loop {
        let last = match call(client, endpoint, token, http::Method::GET, "/v1/health").await {
            Ok(s) if s.is_success() => return Ok(()),
            Ok(s) => format!("health answered {s}"),
            Err(e) => e,
        };
        if tokio::time::Instant::now() + pause > deadline {
            return Err(last);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_through_the_host() {
        for ep in
            [Endpoint::Unix("/var/lib/sandman/sandboxes/sb-1/d.sock".into()), Endpoint::Tcp("10.0.0.7:7778".into())]
        {
            let host = authority(&ep);
            assert!(host.chars().all(|c| c.is_ascii_alphanumeric()));
            assert_eq!(decode(&host), Some(ep.clone()));
            let u = uri(&ep, "/v1/exec?x=1").map(|u| u.to_string()).unwrap_or_default();
            assert!(u.starts_with("http://") && u.ends_with("/v1/exec?x=1"), "{u}");
        }
        assert_eq!(decode("zz"), None);
        assert_eq!(decode("u0"), None);
    }
}

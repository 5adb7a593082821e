//! The server's HTTP client to sandbox daemons: one pooled hyper client whose connector dials the
//! daemon's Unix socket (or TCP address) named, hex-encoded, in the request's host.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandman_http::unix::QuietUnixStream;
use sandman_provider::Endpoint;
use sandman_provider::identity::{self, Unproven};
use sandman_wire::daemon::Health;
use tokio::net::{TcpStream, UnixStream};

/// A connection to a daemon, over either transport, counted while it is open.
#[derive(Debug)]
pub struct DaemonStream {
    io: Transport,
    /// Whether the pool may keep it for another call: only while few enough are open.
    reusable: bool,
    _open: OpenGuard,
}

#[derive(Debug)]
enum Transport {
    Unix(TokioIo<QuietUnixStream>),
    Tcp(TokioIo<TcpStream>),
}

impl Connection for DaemonStream {
    fn connected(&self) -> Connected {
        let connected = Connected::new();
        if !self.reusable {
            // Serves its call, then is closed instead of waiting in the pool.
            connected.poison();
        }
        connected
    }
}

impl hyper::rt::Read for DaemonStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().io {
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for DaemonStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().io {
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().io {
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().io {
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Counts the connections to daemons open at once.
#[derive(Debug)]
struct OpenGuard(Arc<AtomicUsize>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Dials the endpoint encoded in a URI's host by [`authority`]. A connection made while at most
/// `keep` are open may go back to the pool for later calls; one made past that serves its call
/// and is closed. One idle connection per sandbox would, at tens of thousands of sandboxes, cost
/// as many open files as the sandboxes themselves; past `keep`, a call pays a new connection
/// (a Unix socket's is tens of microseconds) instead.
#[derive(Debug, Clone)]
pub struct Connector {
    open: Arc<AtomicUsize>,
    keep: usize,
}

impl Connector {
    pub fn new(keep: usize) -> Connector {
        Connector { open: Arc::default(), keep }
    }

    /// Connections to daemons open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

impl tower::Service<Uri> for Connector {
    type Response = DaemonStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<DaemonStream>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (open, keep) = (self.open.clone(), self.keep);
        Box::pin(async move {
            let host = uri.host().unwrap_or_default();
            let io = match decode(host) {
                Some(Endpoint::Unix(path)) => {
                    Transport::Unix(TokioIo::new(QuietUnixStream::from_tokio(UnixStream::connect(path).await?)?))
                }
                Some(Endpoint::Tcp(addr)) => {
                    let s = TcpStream::connect(addr).await?;
                    s.set_nodelay(true)?;
                    Transport::Tcp(TokioIo::new(s))
                }
                None => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("not a daemon address: {host}"),
                    ));
                }
            };
            let reusable = open.fetch_add(1, Ordering::Relaxed) < keep;
            Ok(DaemonStream { io, reusable, _open: OpenGuard(open) })
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

/// The client the server uses: connections kept for reuse up to an eighth of the open files
/// limit (see [`keep_for`]), each idle for at most 30 s.
pub fn client() -> DaemonClient {
    client_keeping(Connector::new(keep_for(crate::sys::open_files_limit())))
}

/// A client dialing through `connector`.
pub fn client_keeping(connector: Connector) -> DaemonClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(4)
        .build(connector)
}

/// Connections kept for reuse under an open files limit of `files`: an eighth of it (the rest is
/// for clients, a proxied call's connection, and the providers' per-sandbox descriptors), between
/// 16 and 8192.
pub fn keep_for(files: u64) -> usize {
    usize::try_from(files / 8).unwrap_or(usize::MAX).clamp(16, 8192)
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

/// Waits until the daemon at `endpoint` answers its health check and proves that it holds
/// `token`, for at most `limit` ([`identity::prove`]: `GET /v1/health?challenge=`, answered with
/// an HMAC of the challenge keyed with the token). The token is not sent: whatever answers at a
/// reused address learns nothing from the check, and is never taken for the sandbox's daemon.
pub async fn wait_healthy(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    limit: Duration,
) -> Result<(), Unproven> {
    let deadline = tokio::time::Instant::now() + limit;
    identity::prove(token, deadline, |challenge| health(client, endpoint, format!("/v1/health?challenge={challenge}")))
        .await
}

/// One unauthenticated health call; any answer but a 200 with a health body is an error.
async fn health(client: &DaemonClient, endpoint: &Endpoint, path: String) -> Result<Health, String> {
    use http_body_util::BodyExt;
    let req = http::Request::get(uri(endpoint, &path).map_err(|e| e.to_string())?)
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("health answered {status}"));
    }
    let bytes = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| format!("reading the health answer: {e}"))?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| format!("not a health answer: {e}"))
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

    #[test]
    fn an_eighth_of_the_open_files_limit_is_kept_for_reuse() {
        assert_eq!((keep_for(20_000), keep_for(1024), keep_for(0), keep_for(1 << 20)), (2500, 128, 16, 8192));
    }

    /// Serves HTTP/1.1 on `listener` with `answer`, counting connections in `accepted`.
    fn serve<F, Fut>(
        listener: tokio::net::UnixListener,
        accepted: Arc<AtomicUsize>,
        answer: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = http::Response<Body>> + Send + 'static,
    {
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                accepted.fetch_add(1, Ordering::SeqCst);
                let answer = answer.clone();
                let svc = hyper::service::service_fn(move |req| {
                    let answer = answer.clone();
                    async move { Ok::<_, std::convert::Infallible>(answer(req).await) }
                });
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc));
            }
        })
    }

    /// Five calls at once open five connections; with two kept for reuse, the other three are
    /// closed after their call, and the next calls reuse the two.
    #[tokio::test]
    async fn connections_past_those_kept_are_closed_after_their_call() {
        use http_body_util::BodyExt;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let socket = dir.path().join("d.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap_or_else(|e| panic!("{e}"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let together = Arc::new(tokio::sync::Barrier::new(5));
        let calls = Arc::new(AtomicUsize::new(0));
        let server = serve(listener, accepted.clone(), move |_req| {
            let (together, first_five) = (together.clone(), calls.fetch_add(1, Ordering::SeqCst) < 5);
            async move {
                // The first five answer together, so they need five connections.
                if first_five {
                    together.wait().await;
                }
                http::Response::new(Body::from("ok"))
            }
        });
        let connector = Connector::new(2);
        let client = client_keeping(connector.clone());
        let endpoint = Endpoint::Unix(socket);
        let call = || {
            let (client, endpoint) = (client.clone(), endpoint.clone());
            async move {
                let resp = client
                    .request(
                        http::Request::get(uri(&endpoint, "/v1/health").unwrap_or_else(|e| panic!("{e}")))
                            .body(Body::empty())
                            .unwrap_or_else(|e| panic!("{e}")),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                resp.into_body().collect().await.unwrap_or_else(|e| panic!("{e}"));
            }
        };
        futures_util::future::join_all((0..5).map(|_| call())).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 5);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while connector.open() > 2 {
            assert!(std::time::Instant::now() < deadline, "{} connections still open, 2 kept", connector.open());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for _ in 0..4 {
            call().await;
        }
        assert_eq!((accepted.load(Ordering::SeqCst), connector.open()), (5, 2), "the kept connections were reused");
        server.abort();
    }

    /// The daemon at the address must prove the token, which is never sent: a right proof is
    /// healthy, a wrong one or none is refused at once, and silence is reported at the limit.
    #[tokio::test]
    async fn a_daemon_is_healthy_only_once_it_proves_the_token() {
        use sandman_testkit::standin::StandIn;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let client = client_keeping(Connector::new(16));
        let at = |name: &str, token: Option<&str>| {
            let socket = dir.path().join(name);
            (StandIn::unix(&socket, token), Endpoint::Unix(socket))
        };
        let (ours, stranger, old) = (at("ours", Some("tok-a")), at("stranger", Some("tok-b")), at("old", None));
        let limit = Duration::from_secs(30);
        assert_eq!(wait_healthy(&client, &ours.1, "tok-a", limit).await, Ok(()));
        assert_eq!(wait_healthy(&client, &stranger.1, "tok-a", limit).await, Err(Unproven::Stranger));
        let Err(Unproven::NoProof { .. }) = wait_healthy(&client, &old.1, "tok-a", limit).await else {
            panic!("a daemon without a proof was taken for the sandbox's")
        };
        for (standin, _) in [&ours, &stranger, &old] {
            assert_eq!((standin.health_calls(), standin.calls_with_a_token()), (1, 0), "one call, no token sent");
        }
        let nobody = Endpoint::Unix(dir.path().join("nobody"));
        let Err(Unproven::Silent { last }) = wait_healthy(&client, &nobody, "tok-a", Duration::from_millis(50)).await
        else {
            panic!("nothing listening was found healthy")
        };
        assert!(!last.is_empty());
    }
}

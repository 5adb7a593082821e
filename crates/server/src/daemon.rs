//! The server's HTTP client to sandbox daemons: one pooled hyper client whose connector dials the
//! daemon's Unix socket (or TCP address) named, hex-encoded, in the request's host, and has the
//! daemon there prove the sandbox's token on every new connection ([`Identities`], the challenge
//! of [`identity`]) before any request, and so the token, goes out on it. A call on a connection
//! the pool keeps costs nothing more; a new connection costs one health round trip.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandman_http::unix::QuietUnixStream;
use sandman_provider::Endpoint;
use sandman_provider::identity::{self, Attempt, Unproven};
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

/// The tokens of the daemons the server may talk to, by the URI host of their endpoint
/// ([`authority`]): what a new connection's proof is checked against. A sandbox is registered
/// once its provider says where its daemon listens, and forgotten when it ends.
#[derive(Debug, Default)]
pub struct Identities {
    /// Read on every new connection, written at a sandbox's start and end; never held across an
    /// await.
    tokens: RwLock<HashMap<String, Arc<str>>>,
}

impl Identities {
    /// The daemon at `endpoint` must prove `token` on every connection the server opens to it.
    /// A later registration of the same endpoint (a reused pod IP) replaces an earlier one.
    pub fn register(&self, endpoint: &Endpoint, token: &str) {
        let mut tokens = self.tokens.write().unwrap_or_else(PoisonError::into_inner);
        tokens.insert(authority(endpoint), Arc::from(token));
    }

    /// Forgets `endpoint`, unless another sandbox (another token) has registered it since.
    pub fn forget(&self, endpoint: &Endpoint, token: &str) {
        let mut tokens = self.tokens.write().unwrap_or_else(PoisonError::into_inner);
        let host = authority(endpoint);
        if tokens.get(&host).is_some_and(|t| t.as_ref() == token) {
            tokens.remove(&host);
        }
    }

    fn token(&self, host: &str) -> Option<Arc<str>> {
        self.tokens.read().unwrap_or_else(PoisonError::into_inner).get(host).cloned()
    }

    /// Daemons registered now.
    pub fn len(&self) -> usize {
        self.tokens.read().unwrap_or_else(PoisonError::into_inner).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why the connector gave no connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The daemon could not be reached, or its answer to the challenge did not come whole: the
    /// call may be tried again.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// No sandbox's daemon is registered at that address (it ended): nothing is sent there.
    #[error("no sandbox's daemon is known at this address any more")]
    Unknown,
    /// What answered did not prove the sandbox's token: not the sandbox's daemon. Nothing was
    /// sent on the connection but the challenge; the sandbox is no longer trusted.
    #[error("the daemon's identity was not proven on a new connection")]
    Unproven(#[source] Unproven),
}

/// The [`Unproven`] in `err`'s chain of causes: a new connection to a sandbox's daemon whose
/// proof failed.
pub fn unproven<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a Unproven> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(ConnectError::Unproven(u)) = e.downcast_ref::<ConnectError>() {
            return Some(u);
        }
        cur = e.source();
    }
    None
}

/// How long a new connection's proof may take; past it the connection is given up (as a
/// daemon that does not answer, not as one that failed its proof).
const PROOF_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer to a proof's challenge read.
const MAX_PROOF_ANSWER: usize = 16 * 1024;

/// Dials the endpoint encoded in a URI's host by [`authority`], and has the daemon there prove
/// the token [`Identities`] holds for it before the connection is handed out. A connection made
/// while at most `keep` are open may go back to the pool for later calls; one made past that
/// serves its call and is closed. One idle connection per sandbox would, at tens of thousands of
/// sandboxes, cost as many open files as the sandboxes themselves; past `keep`, a call pays a new
/// connection (a Unix socket's and its proof are tens of microseconds) instead.
#[derive(Debug, Clone)]
pub struct Connector {
    open: Arc<AtomicUsize>,
    keep: usize,
    identities: Arc<Identities>,
}

impl Connector {
    pub fn new(keep: usize, identities: Arc<Identities>) -> Connector {
        Connector { open: Arc::default(), keep, identities }
    }

    /// Connections to daemons open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

impl tower::Service<Uri> for Connector {
    type Response = DaemonStream;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<DaemonStream, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (open, keep, identities) = (self.open.clone(), self.keep, self.identities.clone());
        Box::pin(async move {
            let host = uri.host().unwrap_or_default();
            let endpoint = decode(host).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("not a daemon address: {host}"))
            })?;
            let token = identities.token(host).ok_or(ConnectError::Unknown)?;
            let io = match endpoint {
                Endpoint::Unix(path) => {
                    Transport::Unix(TokioIo::new(QuietUnixStream::from_tokio(UnixStream::connect(path).await?)?))
                }
                Endpoint::Tcp(addr) => {
                    let s = TcpStream::connect(addr).await?;
                    s.set_nodelay(true)?;
                    Transport::Tcp(TokioIo::new(s))
                }
            };
            let reusable = open.fetch_add(1, Ordering::Relaxed) < keep;
            let stream = DaemonStream { io, reusable, _open: OpenGuard(open) };
            match tokio::time::timeout(PROOF_TIMEOUT, prove_on(stream, &token)).await {
                Ok(proven) => proven,
                Err(_) => Err(ConnectError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the daemon did not answer its challenge within {} s", PROOF_TIMEOUT.as_secs()),
                ))),
            }
        })
    }
}

/// Has what answers on `stream` prove `token` (`GET /v1/health?challenge=`, without the token),
/// and hands the stream back for the pool. An answer that is no proof of the token is
/// [`ConnectError::Unproven`]; a connection that breaks before a whole answer is an I/O error.
async fn prove_on(stream: DaemonStream, token: &str) -> Result<DaemonStream, ConnectError> {
    let challenge = identity::challenge().map_err(ConnectError::Unproven)?;
    let refused = |why: String| ConnectError::Unproven(Unproven::Refused(why));
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(stream).await.map_err(|e| hyper_error(&e))?;
    let req = http::Request::get(format!("/v1/health?challenge={challenge}"))
        .header(http::header::HOST, "sandbox")
        .body(Empty::new())
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    // The sender goes with the exchange, so that the connection, driven beside it, is done once
    // the answer is read, and gives its stream back.
    let exchange = async move {
        let resp = sender.send_request(req).await.map_err(|e| hyper_error(&e))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_PROOF_ANSWER).collect().await;
        let body = body.map_err(|e| match e.downcast::<http_body_util::LengthLimitError>() {
            Ok(_) => refused(format!("its answer is longer than {MAX_PROOF_ANSWER} bytes")),
            Err(e) => ConnectError::Io(std::io::Error::other(e)),
        })?;
        Ok::<_, ConnectError>((status, body.to_bytes()))
    };
    let (answer, parts) = tokio::join!(exchange, conn.without_shutdown());
    let (status, bytes) = answer?;
    if status != http::StatusCode::OK {
        let detail = serde_json::from_slice::<sandman_wire::ErrorBody>(&bytes)
            .map(|b| b.error.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned());
        return Err(refused(format!("it answered {status}: {detail}")));
    }
    let health: Health = serde_json::from_slice(&bytes).map_err(|e| refused(format!("not a health answer: {e}")))?;
    identity::check(token, &challenge, &health).map_err(ConnectError::Unproven)?;
    let parts = parts.map_err(|e| hyper_error(&e))?;
    if !parts.read_buf.is_empty() {
        return Err(refused("it sent more than its answer".into()));
    }
    Ok(parts.io)
}

/// A failure of the challenge's exchange: an answer that is not HTTP is no proof; anything
/// else (a closed connection, a reset) is the connection's.
fn hyper_error(e: &hyper::Error) -> ConnectError {
    if e.is_parse() || e.is_parse_status() || e.is_parse_too_large() {
        ConnectError::Unproven(Unproven::Refused(format!("its answer is not HTTP: {e}")))
    } else {
        ConnectError::Io(std::io::Error::other(format!("the challenge's exchange failed: {e}")))
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
/// limit (see [`keep_for`]), each idle for at most 30 s, each proven against `identities`.
pub fn client(identities: Arc<Identities>) -> DaemonClient {
    client_keeping(Connector::new(keep_for(crate::sys::open_files_limit()), identities))
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

/// Why a call the server makes to a daemon itself (setup, conditions, usage, keepalives) failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// A new connection's proof failed: what answers is not the sandbox's daemon, and the call
    /// was not sent.
    #[error("{0}")]
    Unproven(Unproven),
    /// The call failed otherwise (unreachable, an error answer, an answer that does not decode),
    /// said whole.
    #[error("{0}")]
    Failed(String),
}

impl CallError {
    fn of_client(e: &hyper_util::client::legacy::Error) -> CallError {
        match unproven(e) {
            Some(u) => CallError::Unproven(u.clone()),
            None => CallError::Failed(with_causes(e)),
        }
    }
}

impl From<String> for CallError {
    fn from(text: String) -> Self {
        CallError::Failed(text)
    }
}

/// One call with an empty body; the status, or why it failed.
pub async fn call(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    method: http::Method,
    path: &str,
) -> Result<http::StatusCode, CallError> {
    let uri = uri(endpoint, path).map_err(|e| e.to_string())?;
    let req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| CallError::of_client(&e))?;
    Ok(resp.status())
}

/// Largest daemon answer read whole by the server (setup results, info).
const MAX_ANSWER: usize = 1 << 20;

/// One call with a JSON body (or none), its JSON answer decoded; or why it failed.
pub async fn call_json<B: serde::Serialize, T: serde::de::DeserializeOwned>(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    method: http::Method,
    path: &str,
    body: Option<&B>,
) -> Result<T, CallError> {
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
    let resp = client.request(req).await.map_err(|e| CallError::of_client(&e))?;
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    if !status.is_success() {
        let detail = serde_json::from_slice::<sandman_wire::ErrorBody>(&bytes)
            .map(|b| b.error.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        return Err(CallError::Failed(format!("the daemon answered {status}: {detail}")));
    }
    serde_json::from_slice(&bytes).map_err(|e| CallError::Failed(format!("cannot decode the daemon's answer: {e}")))
}

/// A `GET` whose answer is read whole, up to `limit` bytes: `Ok(None)` when it is longer (the
/// rest is not read). A directory's archive for a snapshot.
pub async fn fetch_bytes(
    client: &DaemonClient,
    endpoint: &Endpoint,
    token: &str,
    path: &str,
    limit: u64,
) -> Result<Option<Vec<u8>>, CallError> {
    let uri = uri(endpoint, path).map_err(|e| e.to_string())?;
    let req = http::Request::builder()
        .method(http::Method::GET)
        .uri(uri)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| CallError::of_client(&e))?;
    let status = resp.status();
    if !status.is_success() {
        let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        let detail = serde_json::from_slice::<sandman_wire::ErrorBody>(&bytes)
            .map(|b| b.error.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        return Err(CallError::Failed(format!("the daemon answered {status}: {detail}")));
    }
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the answer: {}", with_causes(&e)))?;
        if let Ok(data) = frame.into_data() {
            if out.len() as u64 + data.len() as u64 > limit {
                return Ok(None);
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(Some(out))
}

/// Waits until the daemon at `endpoint` answers its health check, for at most `limit`, on a
/// connection over which it has proven the token [`Identities`] holds for it (the connector's
/// challenge: `GET /v1/health?challenge=`, answered with an HMAC of the challenge keyed with the
/// token; see [`identity`]). The token is not sent before that: whatever answers at a reused
/// address learns nothing from the check, and is never taken for the sandbox's daemon. The
/// connection goes to the pool for the sandbox's first calls.
pub async fn wait_healthy(client: &DaemonClient, endpoint: &Endpoint, limit: Duration) -> Result<(), Unproven> {
    let deadline = tokio::time::Instant::now() + limit;
    identity::until_answered(deadline, || health(client, endpoint)).await
}

/// One health call on a proven connection; an answer other than 200 is tried again.
async fn health(client: &DaemonClient, endpoint: &Endpoint) -> Result<(), Attempt> {
    let uri = uri(endpoint, "/v1/health").map_err(|e| Attempt::Again(e.to_string()))?;
    let req = http::Request::get(uri).body(Body::empty()).map_err(|e| Attempt::Again(e.to_string()))?;
    let resp = match client.request(req).await {
        Ok(resp) => resp,
        Err(e) => {
            return Err(match unproven(&e) {
                Some(u) => Attempt::Decided(u.clone()),
                None => Attempt::Again(with_causes(&e)),
            });
        }
    };
    let status = resp.status();
    let _ = resp.into_body().collect().await;
    if status.is_success() { Ok(()) } else { Err(Attempt::Again(format!("health answered {status}"))) }
}

/// An error and its causes, `: `-separated: hyper's own message (`client error (Connect)`) says
/// little without them.
pub fn with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
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
        let server = serve(listener, accepted.clone(), move |req| {
            let proof = proof_of("tok", &req);
            let (together, first_five) = (together.clone(), calls.fetch_add(1, Ordering::SeqCst) < 5);
            async move {
                if let Some(proof) = proof {
                    return proof;
                }
                // The first five answer together, so they need five connections.
                if first_five {
                    together.wait().await;
                }
                http::Response::new(Body::from("ok"))
            }
        });
        let identities = Arc::new(Identities::default());
        let connector = Connector::new(2, identities.clone());
        let client = client_keeping(connector.clone());
        let endpoint = Endpoint::Unix(socket);
        identities.register(&endpoint, "tok");
        let call = || {
            let (client, endpoint) = (client.clone(), endpoint.clone());
            async move {
                let resp = client
                    .request(
                        http::Request::get(uri(&endpoint, "/v1/info").unwrap_or_else(|e| panic!("{e}")))
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

    /// The answer to a proof's challenge made with `token`, for a health call that carries one.
    fn proof_of(token: &str, req: &http::Request<hyper::body::Incoming>) -> Option<http::Response<Body>> {
        let challenge = req.uri().query()?.strip_prefix("challenge=")?;
        let health = Health {
            status: "ok".into(),
            version: "t".into(),
            proof: Some(sandman_testkit::standin::proof(token, challenge)),
        };
        Some(http::Response::new(Body::from(serde_json::to_vec(&health).unwrap_or_default())))
    }

    /// The daemon at the address must prove the token, which is never sent before: a right proof
    /// is healthy, a wrong one or none is refused at once, and silence is reported at the limit.
    #[tokio::test]
    async fn a_daemon_is_healthy_only_once_it_proves_the_token() {
        use sandman_testkit::standin::StandIn;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let identities = Arc::new(Identities::default());
        let client = client_keeping(Connector::new(16, identities.clone()));
        let at = |name: &str, token: Option<&str>| {
            let socket = dir.path().join(name);
            let endpoint = Endpoint::Unix(socket.clone());
            identities.register(&endpoint, "tok-a");
            (StandIn::unix(&socket, token), endpoint)
        };
        let (ours, stranger, old) = (at("ours", Some("tok-a")), at("stranger", Some("tok-b")), at("old", None));
        let limit = Duration::from_secs(30);
        assert_eq!(wait_healthy(&client, &ours.1, limit).await, Ok(()));
        assert_eq!(wait_healthy(&client, &stranger.1, limit).await, Err(Unproven::Stranger));
        let Err(Unproven::NoProof { .. }) = wait_healthy(&client, &old.1, limit).await else {
            panic!("a daemon without a proof was taken for the sandbox's")
        };
        // Ours: the connection's challenge, then the health call on it; the others: the
        // challenge alone. No token anywhere.
        for ((standin, _), calls) in [(&ours, 2), (&stranger, 1), (&old, 1)] {
            assert_eq!((standin.health_calls(), standin.calls_with_a_token()), (calls, 0));
        }
        let nobody = Endpoint::Unix(dir.path().join("nobody"));
        identities.register(&nobody, "tok-a");
        let Err(Unproven::Silent { last }) = wait_healthy(&client, &nobody, Duration::from_millis(50)).await else {
            panic!("nothing listening was found healthy")
        };
        assert!(!last.is_empty());
    }

    /// Before, the server sent `Authorization: Bearer <token>` on every call to whatever
    /// answered at the daemon's address: a sandbox that moved its daemon's socket aside and
    /// served its own received every later call, token included. Now every new connection is
    /// proven first; an impostor gets the challenge and nothing else, and the failure names why.
    #[tokio::test]
    async fn an_impostor_at_the_daemons_address_gets_no_token_and_is_named() {
        use sandman_testkit::standin::StandIn;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let identities = Arc::new(Identities::default());
        let client = client_keeping(Connector::new(16, identities.clone()));
        let info = |endpoint: &Endpoint| {
            http::Request::get(uri(endpoint, "/v1/info").unwrap_or_else(|e| panic!("{e}")))
                .header(http::header::AUTHORIZATION, "Bearer tok-a")
                .body(Body::empty())
                .unwrap_or_else(|e| panic!("{e}"))
        };
        // An impostor with a token of its own, and one with none.
        for (name, token, want) in [
            ("other", Some("tok-x"), Unproven::Stranger),
            ("none", None, Unproven::NoProof { version: sandman_testkit::standin::VERSION.into() }),
        ] {
            let socket = dir.path().join(name);
            let endpoint = Endpoint::Unix(socket.clone());
            identities.register(&endpoint, "tok-a");
            let impostor = StandIn::unix(&socket, token);
            impostor.answer("/v1/info", serde_json::json!({"forged": true}));
            let err = client.request(info(&endpoint)).await.err().unwrap_or_else(|| panic!("{name}: answered"));
            assert_eq!(unproven(&err), Some(&want), "{name}: {}", with_causes(&err));
            assert_eq!((impostor.health_calls(), impostor.calls_with_a_token()), (1, 0), "{name}");
            let err = call(&client, &endpoint, "tok-a", http::Method::POST, "/v1/keepalive").await.err();
            assert!(matches!(err, Some(CallError::Unproven(ref u)) if *u == want), "{name}: {err:?}");
            assert_eq!(impostor.calls_with_a_token(), 0, "{name}");
        }
        // One that answers the challenge with an error (the sandbox's own daemon, relayed from
        // inside the sandbox, refuses it so), or with something that is not HTTP at all.
        let socket = dir.path().join("refusing");
        let endpoint = Endpoint::Unix(socket.clone());
        identities.register(&endpoint, "tok-a");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap_or_else(|e| panic!("{e}"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let with_token = Arc::new(AtomicUsize::new(0));
        let seen = with_token.clone();
        let server = serve(listener, accepted.clone(), move |req| {
            if req.headers().contains_key(http::header::AUTHORIZATION) {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            async {
                let mut resp = http::Response::new(Body::from(r#"{"error":{"code":"forbidden","message":"no"}}"#));
                *resp.status_mut() = http::StatusCode::FORBIDDEN;
                resp
            }
        });
        let err = client.request(info(&endpoint)).await.err().unwrap_or_else(|| panic!("answered"));
        assert!(matches!(unproven(&err), Some(Unproven::Refused(why)) if why.contains("403")), "{}", with_causes(&err));
        assert_eq!((accepted.load(Ordering::SeqCst), with_token.load(Ordering::SeqCst)), (1, 0));
        server.abort();
        let socket = dir.path().join("garbage");
        let endpoint = Endpoint::Unix(socket.clone());
        identities.register(&endpoint, "tok-a");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap_or_else(|e| panic!("{e}"));
        let garbage = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(b"SSH-2.0-OpenSSH\r\n\r\n").await;
            }
        });
        let err = client.request(info(&endpoint)).await.err().unwrap_or_else(|| panic!("answered"));
        assert!(matches!(unproven(&err), Some(Unproven::Refused(_))), "{}", with_causes(&err));
        garbage.abort();
        // A daemon no sandbox registers (its sandbox ended) is not even connected to.
        let gone = Endpoint::Unix(dir.path().join("other"));
        identities.forget(&gone, "tok-a");
        let err = client.request(info(&gone)).await.err().unwrap_or_else(|| panic!("answered"));
        assert!(with_causes(&err).contains("no sandbox's daemon is known"), "{}", with_causes(&err));
        assert_eq!(unproven(&err), None);
    }

    /// A registration is forgotten only by its own sandbox: a newer one at the same address (a
    /// reused pod IP) keeps its own.
    #[test]
    fn an_address_registered_again_keeps_the_newer_token() {
        let identities = Identities::default();
        let ip = Endpoint::Tcp("10.0.0.7:7778".into());
        identities.register(&ip, "old");
        identities.register(&ip, "new");
        identities.forget(&ip, "old");
        assert_eq!(identities.token(&authority(&ip)).as_deref(), Some("new"));
        identities.forget(&ip, "new");
        assert!(identities.is_empty());
    }
}

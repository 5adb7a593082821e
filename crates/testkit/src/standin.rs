//! [`StandIn`]: a sandbox daemon's stand-in for tests that need only what the server and the
//! providers ask of a daemon before its sandbox is ready: its health check, proving its token.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sandman_wire::daemon::{Health, health_proof_input};

/// The version a stand-in reports in its health answers.
pub const VERSION: &str = "0.0.1";

/// Answers `GET /v1/health?challenge=` as a daemon holding its token would (the proof that token
/// makes; none for a stand-in holding none, as a daemon too old to give one), and `GET` of any
/// path given to [`StandIn::answer`] with that JSON; anything else is a 404. Counts its health
/// calls and those that carried a token. Stops when dropped.
#[derive(Debug)]
pub struct StandIn {
    counts: Arc<Counts>,
    answers: Answers,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct Counts {
    health: AtomicUsize,
    /// Calls with an `Authorization` header.
    with_token: AtomicUsize,
}

/// Fixed answers by path: JSON, or raw bytes (an archive). Locked only to read or add one,
/// never across an await.
type Answers = Arc<Mutex<HashMap<String, Fixed>>>;

#[derive(Debug, Clone)]
enum Fixed {
    Json(serde_json::Value),
    Bytes(Bytes),
}

/// Where a stand-in listens.
enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl StandIn {
    /// Listens on 127.0.0.1 at a free port; answers with that address (`127.0.0.1:<port>`).
    /// Needs a tokio runtime.
    pub async fn tcp(token: Option<&str>) -> (StandIn, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        (StandIn::serve(token, Listener::Tcp(listener)), addr)
    }

    /// Listens on the Unix socket `socket`, made now (so a caller that cannot wait, such as a
    /// fake provider's create, can hand its path out at once). Needs a tokio runtime.
    pub fn unix(socket: &Path, token: Option<&str>) -> StandIn {
        let bind = || {
            let listener = std::os::unix::net::UnixListener::bind(socket)?;
            listener.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(listener)
        };
        let listener = bind().unwrap_or_else(|e| panic!("bind {}: {e}", socket.display()));
        StandIn::serve(token, Listener::Unix(listener))
    }

    fn serve(token: Option<&str>, listener: Listener) -> StandIn {
        let counts = Arc::new(Counts::default());
        let answers = Answers::default();
        let token: Option<Arc<str>> = token.map(Arc::from);
        let (c, a) = (counts.clone(), answers.clone());
        let task = tokio::spawn(async move {
            loop {
                let (c, a, t) = (c.clone(), a.clone(), token.clone());
                let served = match &listener {
                    Listener::Tcp(l) => l.accept().await.map(|(s, _)| serve_conn(s, c, a, t)),
                    Listener::Unix(l) => l.accept().await.map(|(s, _)| serve_conn(s, c, a, t)),
                };
                if served.is_err() {
                    return;
                }
            }
        });
        StandIn { counts, answers, task }
    }

    /// Answers `GET path` (the path alone, no query) with `body` from now on.
    pub fn answer(&self, path: &str, body: serde_json::Value) {
        self.answers.lock().unwrap_or_else(PoisonError::into_inner).insert(path.to_string(), Fixed::Json(body));
    }

    /// Answers `GET path` (the path alone, no query) with the bytes `body` from now on.
    pub fn answer_bytes(&self, path: &str, body: Bytes) {
        self.answers.lock().unwrap_or_else(PoisonError::into_inner).insert(path.to_string(), Fixed::Bytes(body));
    }

    /// How many health calls it has answered.
    pub fn health_calls(&self) -> usize {
        self.counts.health.load(Ordering::SeqCst)
    }

    /// How many calls carried a token (`Authorization`): a health check must send none.
    pub fn calls_with_a_token(&self) -> usize {
        self.counts.with_token.load(Ordering::SeqCst)
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves one connection on a task of its own.
fn serve_conn<S>(stream: S, counts: Arc<Counts>, answers: Answers, token: Option<Arc<str>>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let reply = answer(&req, &counts, &answers, token.as_deref());
        async move { Ok::<_, std::convert::Infallible>(reply) }
    });
    tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service));
}

fn answer<B>(req: &Request<B>, counts: &Counts, answers: &Answers, token: Option<&str>) -> Response<Full<Bytes>> {
    if req.headers().contains_key(hyper::header::AUTHORIZATION) {
        counts.with_token.fetch_add(1, Ordering::SeqCst);
    }
    let path = req.uri().path();
    let body = if path == "/v1/health" {
        counts.health.fetch_add(1, Ordering::SeqCst);
        let query = req.uri().query().unwrap_or_default();
        let challenge = query.split('&').find_map(|kv| kv.strip_prefix("challenge=")).unwrap_or_default();
        let proof = token.map(|t| proof(t, challenge));
        let health = Health { status: "ok".into(), version: VERSION.into(), proof };
        serde_json::to_value(health).unwrap_or_else(|e| panic!("{e}"))
    } else {
        match answers.lock().unwrap_or_else(PoisonError::into_inner).get(path) {
            Some(Fixed::Json(body)) => body.clone(),
            Some(Fixed::Bytes(bytes)) => return Response::new(Full::new(bytes.clone())),
            None => {
                let mut resp = Response::new(Full::new(Bytes::from_static(b"{}")));
                *resp.status_mut() = StatusCode::NOT_FOUND;
                return resp;
            }
        }
    };
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    resp
}

/// The proof a daemon holding `token` gives for `challenge`, made as `sandmand` makes it:
/// lowercase hex of HMAC-SHA256(token, [`health_proof_input`]).
pub fn proof(token: &str, challenge: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    hex::encode(ring::hmac::sign(&key, &health_proof_input(challenge)).as_ref())
}

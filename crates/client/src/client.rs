//! [`Client`]: the connection settings, the one place requests are sent and answers checked, and
//! the server's own calls (sandboxes, jobs, events). Daemon calls are in [`crate::sandbox`].

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, USER_AGENT};
use http::{Method, Request, Response, Uri};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sandman_wire::ErrorBody;
use sandman_wire::server::{
    CreateSandbox, Event, EventList, EventStreamItem, EventsQuery, FusionKey, ImageList, ImageQuery, ImagesRemoved,
    Job, JobAction, JobSpec, JobUsage, ListQuery, Pool, PoolList, PoolSpec, PrepareRequest, PrepareResult, Sandbox,
    SandboxList, ServerHealth, SignedConditions, Verification,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::body::{self, ByteStream, NdjsonStream, RequestBody, UploadBody};
use crate::env;
use crate::error::ClientError;
use crate::retry::{Failure, Hint, RetryPolicy};

/// How the client reaches its server.
#[derive(Clone)]
enum Transport {
    Tcp(HyperClient<HttpConnector, RequestBody>),
    Unix(HyperClient<UnixConnector, RequestBody>),
}

/// Connects to one Unix socket, whatever the request's URI names.
#[derive(Clone, Debug)]
struct UnixConnector(std::sync::Arc<std::path::PathBuf>);

impl tower_service::Service<Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send + 'static>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(&*path))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}

/// How long a connect may take before the call fails.
/// How long an idle connection is kept for reuse: under the server's header-read timeout.
const POOL_IDLE: Duration = Duration::from_secs(20);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most of an error answer read, to show it; error bodies are small.
const MAX_ERROR_BODY: usize = 64 * 1024;

const JSON: &str = "application/json";
const NDJSON: &str = "application/x-ndjson";
const OCTET_STREAM: &str = "application/octet-stream";
const TAR: &str = "application/x-tar";

/// A typed client of the Sandman server. Cheap to clone: clones share one connection pool.
///
/// Every call renews the lease of the sandbox it names. Streams ([`NdjsonStream`],
/// [`ByteStream`]) are read as the server sends them, and dropping one closes its connection.
#[derive(Clone)]
pub struct Client {
    http: Transport,
    /// `http://host:port` plus any path prefix, without a trailing slash; or `unix:/path`.
    base: String,
    /// What requests' URIs start with: `base`, or for a Unix socket `http://localhost`.
    origin: String,
    /// `Bearer <token>`, marked sensitive.
    auth: HeaderValue,
    /// Which failed calls are sent again.
    retry: RetryPolicy,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client").field("base", &self.base).finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the server at `base_url` (`http://127.0.0.1:7777`), authenticating with
    /// `token`. Nothing is sent until the first call.
    /// `base_url` may also be `unix:/path/to/sandman.sock`, the Unix socket a server on this
    /// machine serves on too.
    pub fn new(base_url: &str, token: &str) -> Result<Client, ClientError> {
        let base = base_url.trim().trim_end_matches('/').to_owned();
        let mut auth = HeaderValue::from_str(&format!("{} {token}", sandman_wire::AUTHORIZATION_SCHEME))
            .map_err(|source| ClientError::InvalidToken { source })?;
        auth.set_sensitive(true);
        // Idle connections are dropped before the server's header-read timeout (30 s by
        // default) closes them, so that a request never goes out on one being closed.
        let mut builder = HyperClient::builder(TokioExecutor::new());
        builder.pool_idle_timeout(POOL_IDLE);
        if let Some(path) = base.strip_prefix("unix:").filter(|p| p.starts_with('/')) {
            let http = Transport::Unix(builder.build(UnixConnector(std::sync::Arc::new(path.into()))));
            return Ok(Client { http, origin: "http://localhost".into(), base, auth, retry: RetryPolicy::default() });
        }
        let uri: Uri = base.parse().map_err(|source| ClientError::InvalidUrl { url: base.clone(), source })?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() || uri.query().is_some() {
            return Err(ClientError::UnsupportedUrl { url: base });
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        let http = Transport::Tcp(builder.build(connector));
        Ok(Client { http, origin: base.clone(), base, auth, retry: RetryPolicy::default() })
    }

    /// This client, sending failed calls again as `retry` says ([`RetryPolicy::none`]: never).
    /// A new client has [`RetryPolicy::default`].
    pub fn with_retry(mut self, retry: RetryPolicy) -> Client {
        self.retry = retry;
        self
    }

    /// The policy failed calls are sent again by.
    pub fn retry_policy(&self) -> RetryPolicy {
        self.retry
    }

    /// A client configured from the environment: `SANDMAN_URL` (default
    /// [`env::DEFAULT_URL`]) and `SANDMAN_TOKEN`, else the token file the server writes,
    /// `<state dir>/token` (see [`env::default_state_dir`]); `SANDMAN_RETRIES` and
    /// `SANDMAN_RETRY_DEADLINE` (see [`RetryPolicy::from_env`]).
    pub fn from_env() -> Result<Client, ClientError> {
        Ok(Client::new(&env::url_from_env(), &env::token_from_env()?)?.with_retry(RetryPolicy::from_env()?))
    }

    /// The server's URL, as given.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    // ---- the server's calls ----

    /// `GET /healthz`: whether the server is up, and which provider it runs.
    pub async fn health(&self) -> Result<ServerHealth, ClientError> {
        self.json(Req::new(Method::GET, "/healthz".into())).await
    }

    /// `POST /v1/sandboxes`: the sandbox, once ready (or at once when `wait` is false).
    ///
    /// A create without an `idempotency_key` is given a fresh one, so that it is sent again
    /// safely when its answer is lost: the server answers the sandbox made under that key.
    pub async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, ClientError> {
        let keyed;
        let req = match req.idempotency_key {
            Some(_) => req,
            None => {
                keyed = CreateSandbox { idempotency_key: Some(fresh_key()), ..req.clone() };
                &keyed
            }
        };
        self.json(Req::new(Method::POST, "/v1/sandboxes".into()).json(req)?.idempotent()).await
    }

    /// `GET /v1/sandboxes/{id}`: a sandbox, also once it has ended.
    pub async fn get(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(Req::new(Method::GET, sandbox_path(id, ""))).await
    }

    /// `GET /v1/sandboxes?job=&state=&label=`.
    pub async fn list(&self, query: &ListQuery) -> Result<Vec<Sandbox>, ClientError> {
        let list: SandboxList = self.json(Req::new(Method::GET, "/v1/sandboxes".into()).query(query)?).await?;
        Ok(list.sandboxes)
    }

    /// `DELETE /v1/sandboxes/{id}`: release the sandbox; answers it as it now is.
    pub async fn release(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(Req::new(Method::DELETE, sandbox_path(id, ""))).await
    }

    /// `POST /v1/sandboxes/{id}/keepalive`: renew the lease (the daemon's too).
    pub async fn keepalive(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/keepalive")).idempotent()).await
    }

    /// `POST /v1/sandboxes/{id}/pause`: freeze every process of the sandbox.
    pub async fn pause(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/pause")).idempotent()).await
    }

    /// `POST /v1/sandboxes/{id}/resume`: thaw a paused sandbox.
    pub async fn resume(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/resume")).idempotent()).await
    }

    /// `PUT /v1/jobs/{job}`: create or change a job's quota and defaults.
    pub async fn put_job(&self, name: &str, spec: &JobSpec) -> Result<Job, ClientError> {
        self.json(Req::new(Method::PUT, job_path(name, "")).json(spec)?).await
    }

    /// `GET /v1/jobs/{job}`: the job's quota and usage.
    pub async fn get_job(&self, name: &str) -> Result<Job, ClientError> {
        self.json(Req::new(Method::GET, job_path(name, ""))).await
    }

    /// `DELETE /v1/jobs/{job}`: release every sandbox of the job and forget it.
    pub async fn delete_job(&self, name: &str) -> Result<JobAction, ClientError> {
        self.json(Req::new(Method::DELETE, job_path(name, ""))).await
    }

    /// `POST /v1/jobs/{job}/heartbeat`: renew the lease of every sandbox of the job.
    pub async fn heartbeat(&self, name: &str) -> Result<JobAction, ClientError> {
        self.json(Req::new(Method::POST, job_path(name, "/heartbeat")).idempotent()).await
    }

    /// `POST /v1/jobs/{job}/fusion-key`: the job's SandboxFusion capability URL, made when it
    /// has none.
    pub async fn fusion_key(&self, name: &str) -> Result<FusionKey, ClientError> {
        self.json(Req::new(Method::POST, job_path(name, "/fusion-key")).idempotent()).await
    }

    /// `DELETE /v1/jobs/{job}/fusion-key`: revokes it.
    pub async fn revoke_fusion_key(&self, name: &str) -> Result<FusionKey, ClientError> {
        self.json(Req::new(Method::DELETE, job_path(name, "/fusion-key"))).await
    }

    /// `GET /v1/jobs/{job}/usage`: the sums of the job's accounting records.
    pub async fn job_usage(&self, name: &str) -> Result<JobUsage, ClientError> {
        self.json(Req::new(Method::GET, job_path(name, "/usage"))).await
    }

    /// `PUT /v1/pools/{name}`: create or change a warm pool.
    pub async fn put_pool(&self, name: &str, spec: &PoolSpec) -> Result<Pool, ClientError> {
        self.json(Req::new(Method::PUT, pool_path(name)).json(spec)?).await
    }

    /// `GET /v1/pools`: every warm pool with its sizes.
    pub async fn pools(&self) -> Result<Vec<Pool>, ClientError> {
        let list: PoolList = self.json(Req::new(Method::GET, "/v1/pools".into())).await?;
        Ok(list.pools)
    }

    /// `GET /v1/pools/{name}`.
    pub async fn pool(&self, name: &str) -> Result<Pool, ClientError> {
        self.json(Req::new(Method::GET, pool_path(name))).await
    }

    /// `DELETE /v1/pools/{name}`: forget the pool and release its unclaimed sandboxes.
    pub async fn delete_pool(&self, name: &str) -> Result<Pool, ClientError> {
        self.json(Req::new(Method::DELETE, pool_path(name))).await
    }

    /// `POST /v1/prepare`: make images ready ahead of creates; answers once each is ready or
    /// has failed.
    pub async fn prepare(&self, req: &PrepareRequest) -> Result<PrepareResult, ClientError> {
        self.json(Req::new(Method::POST, "/v1/prepare".into()).json(req)?.idempotent()).await
    }

    /// `GET /v1/images`: the process provider's image store.
    pub async fn images(&self) -> Result<ImageList, ClientError> {
        self.json(Req::new(Method::GET, "/v1/images".into())).await
    }

    /// `DELETE /v1/images?image=`: removes an image no sandbox runs (or untags a reference
    /// other references share its image with).
    pub async fn remove_image(&self, image: &str) -> Result<ImagesRemoved, ClientError> {
        let query = ImageQuery { image: image.to_string() };
        self.json(Req::new(Method::DELETE, "/v1/images".into()).query(&query)?).await
    }

    /// `POST /v1/images/prune`: removes every image no sandbox runs.
    pub async fn prune_images(&self) -> Result<ImagesRemoved, ClientError> {
        self.json(Req::new(Method::POST, "/v1/images/prune".into()).idempotent()).await
    }

    /// `GET /v1/sandboxes/{id}/conditions`: the sandbox's signed conditions record (asked,
    /// applied, observed, mismatches).
    pub async fn conditions(&self, id: &str) -> Result<SignedConditions, ClientError> {
        self.json(Req::new(Method::GET, sandbox_path(id, "/conditions"))).await
    }

    /// `POST /v1/verify`: whether a signed conditions record (any JSON, as it was kept) is
    /// intact and signed by this server.
    pub async fn verify(&self, signed: &serde_json::Value) -> Result<Verification, ClientError> {
        self.json(Req::new(Method::POST, "/v1/verify".into()).json(signed)?.idempotent()).await
    }

    /// `GET /v1/events`: the lifecycle events kept so far (`follow` is ignored).
    pub async fn events(&self, query: &EventsQuery) -> Result<Vec<Event>, ClientError> {
        let query = EventsQuery { follow: false, ..query.clone() };
        let list: EventList = self.json(Req::new(Method::GET, "/v1/events".into()).query(&query)?).await?;
        Ok(list.events)
    }

    /// `GET /v1/events?follow=true`: lifecycle events as they happen, until the stream is dropped.
    pub async fn follow_events(&self, query: &EventsQuery) -> Result<NdjsonStream<Event>, ClientError> {
        let query = EventsQuery { follow: true, ..query.clone() };
        self.ndjson(Req::new(Method::GET, "/v1/events".into()).query(&query)?, |line| {
            Ok(match serde_json::from_slice(line)? {
                EventStreamItem::Sandbox(event) => Some(*event),
                EventStreamItem::Keepalive => None,
            })
        })
        .await
    }

    // ---- transport: the one place requests are sent and answers checked ----

    /// Sends `req`, again where its retry policy says (see [`crate::retry`]); answers the
    /// response when its status is a success, the error otherwise. With `whole`, the answer's
    /// body is read too, and a body that breaks off counts as a failed attempt.
    async fn exchange(&self, req: Req, whole: bool) -> Result<(String, Answer), ClientError> {
        let call = req.call();
        // The body apart from the rest: the rest is shared with each attempt, which a streamed
        // body (`Send` but not `Sync`) could not be.
        let Req { method, path, query, body: streamed, content_type, accept, replay, idempotent } = req;
        let head = Head { method, url: format!("{}{path}{query}", self.origin), content_type, accept };
        let mut streamed = Some(streamed);
        let mut attempts = 0u32;
        let mut first_failure: Option<tokio::time::Instant> = None;
        loop {
            attempts += 1;
            let body = match &replay {
                Some(Replay::Empty) => body::empty(),
                Some(Replay::Full(bytes)) => body::full(bytes.clone()),
                // A streamed body goes once: with no `replay`, no second attempt is made.
                None => streamed.take().unwrap_or_else(body::empty),
            };
            let (err, hint) = match self.attempt(&head, &call, body).await {
                Ok(response) if whole => match read_all(&call, response.into_body()).await {
                    Ok(bytes) => return Ok((call, Answer::Whole(bytes))),
                    Err(err) => (err, Hint::None),
                },
                Ok(response) => return Ok((call, Answer::Head(response))),
                Err(failed) => failed,
            };
            let failure = Failure::of(&err, hint);
            if failure == Failure::Final {
                return Err(if attempts == 1 { err } else { retried(call, attempts, false, err) });
            }
            let since = *first_failure.get_or_insert_with(tokio::time::Instant::now);
            match self.retry.wait(failure, idempotent, replay.is_some(), attempts, since.elapsed()) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => {
                    let not_idempotent = failure == Failure::MaybeSent && !idempotent;
                    return Err(retried(call, attempts, not_idempotent, err));
                }
            }
        }
    }

    /// One attempt: the response of a success, else the error and what a 503's headers said.
    async fn attempt(
        &self,
        head: &Head,
        call: &str,
        body: RequestBody,
    ) -> Result<Response<Incoming>, (ClientError, Hint)> {
        let uri: Uri = head
            .url
            .parse()
            .map_err(|source| (ClientError::InvalidUrl { url: head.url.clone(), source }, Hint::None))?;
        let mut builder = Request::builder()
            .method(head.method.clone())
            .uri(uri)
            .header(AUTHORIZATION, self.auth.clone())
            .header(ACCEPT, head.accept)
            .header(USER_AGENT, concat!("sandman-client/", env!("CARGO_PKG_VERSION")));
        if let Some(content_type) = head.content_type {
            builder = builder.header(CONTENT_TYPE, content_type);
        }
        let request = builder
            .body(body)
            .map_err(|source| (ClientError::BuildRequest { call: call.to_owned(), source }, Hint::None))?;
        let sent = match &self.http {
            Transport::Tcp(c) => c.request(request).await,
            Transport::Unix(c) => c.request(request).await,
        };
        let response = sent.map_err(|source| (ClientError::Request { url: self.base.clone(), source }, Hint::None))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let retry_after = response
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| Duration::from_secs_f64(s.min(3600.0)));
        let hint = match retry_after {
            Some(wait) => Hint::RetryAfter(wait),
            None if response.headers().contains_key(sandman_wire::server::UNANSWERED) => Hint::Unanswered,
            None => Hint::None,
        };
        Err((error_of(call.to_owned(), response).await, hint))
    }

    /// Sends `req` (see [`Client::exchange`]) and answers the response, its body unread.
    async fn send(&self, req: Req) -> Result<(String, Response<Incoming>), ClientError> {
        match self.exchange(req, false).await? {
            (call, Answer::Head(response)) => Ok((call, response)),
            (call, Answer::Whole(_)) => Err(ClientError::StreamEnded { call }),
        }
    }

    /// Sends `req` (see [`Client::exchange`]) and answers the whole body of its answer.
    async fn send_whole(&self, req: Req) -> Result<(String, Bytes), ClientError> {
        match self.exchange(req, true).await? {
            (call, Answer::Whole(bytes)) => Ok((call, bytes)),
            (call, Answer::Head(_)) => Err(ClientError::StreamEnded { call }),
        }
    }

    pub(crate) async fn json<T: DeserializeOwned>(&self, req: Req) -> Result<T, ClientError> {
        let (call, bytes) = self.send_whole(req).await?;
        serde_json::from_slice(&bytes).map_err(|source| ClientError::Decode { call, source })
    }

    /// For calls answered with no content (204).
    pub(crate) async fn unit(&self, req: Req) -> Result<(), ClientError> {
        self.send_whole(req).await.map(drop)
    }

    pub(crate) async fn bytes(&self, req: Req) -> Result<Bytes, ClientError> {
        self.send_whole(req).await.map(|(_, bytes)| bytes)
    }

    pub(crate) async fn stream(&self, req: Req) -> Result<ByteStream, ClientError> {
        let (call, response) = self.send(req).await?;
        Ok(ByteStream::new(response.into_body(), call))
    }

    pub(crate) async fn ndjson<T>(
        &self,
        req: Req,
        decode: fn(&[u8]) -> Result<Option<T>, serde_json::Error>,
    ) -> Result<NdjsonStream<T>, ClientError> {
        let (call, response) = self.send(req.accept(NDJSON)).await?;
        Ok(NdjsonStream::new(response.into_body(), call, decode))
    }
}

/// What every attempt of a call sends but its body.
struct Head {
    method: Method,
    url: String,
    content_type: Option<&'static str>,
    accept: &'static str,
}

/// What an attempt answered: the response with its body unread, or the whole body.
enum Answer {
    Head(Response<Incoming>),
    Whole(Bytes),
}

/// The error of a call that failed without an answer (or was shed), `attempts` times.
fn retried(call: String, attempts: u32, not_idempotent: bool, last: ClientError) -> ClientError {
    ClientError::Retried { call, attempts, not_idempotent, last: Box::new(last) }
}

/// A fresh idempotency key for a create that has none: unique to this process (its id and
/// start), and to the call within it.
fn fresh_key() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let start = START.get_or_init(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
    });
    format!("sandman-client-{}-{start:x}-{}", std::process::id(), COUNT.fetch_add(1, Ordering::Relaxed))
}

async fn read_all(call: &str, body: Incoming) -> Result<Bytes, ClientError> {
    match body.collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(source) => Err(ClientError::Body { call: call.to_owned(), source }),
    }
}

/// The error of an answer with an error status: its error body, or what it said instead.
async fn error_of(call: String, response: Response<Incoming>) -> ClientError {
    let status = response.status().as_u16();
    let bytes = match Limited::new(response.into_body(), MAX_ERROR_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        // A body cut short or too long still has its status to tell.
        Err(_) => Bytes::new(),
    };
    match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(body) => ClientError::Api { status, body },
        Err(_) => {
            let text = String::from_utf8_lossy(&bytes);
            let mut snippet: String = text.trim().chars().take(200).collect();
            if snippet.is_empty() {
                snippet = format!("(empty body, {call})");
            }
            ClientError::UnexpectedStatus { status, snippet }
        }
    }
}

/// One request, built and encoded before anything is sent.
pub(crate) struct Req {
    method: Method,
    path: String,
    /// Empty, or `?` and the encoded query.
    query: String,
    body: RequestBody,
    content_type: Option<&'static str>,
    accept: &'static str,
    /// What each attempt sends when the body can be sent again; `None` for a streamed body.
    replay: Option<Replay>,
    /// Safe to send again even when an attempt may have reached the server: by HTTP's
    /// definition for GET, PUT and DELETE, and by each call's own contract for some POSTs.
    idempotent: bool,
}

/// A body that can be sent again.
#[derive(Clone)]
enum Replay {
    Empty,
    Full(Bytes),
}

impl Req {
    pub(crate) fn new(method: Method, path: String) -> Req {
        let idempotent = matches!(method, Method::GET | Method::HEAD | Method::PUT | Method::DELETE);
        Req {
            method,
            path,
            query: String::new(),
            body: body::empty(),
            content_type: None,
            accept: JSON,
            replay: Some(Replay::Empty),
            idempotent,
        }
    }

    /// Marks a POST that is safe to send twice (its second run changes nothing more).
    pub(crate) fn idempotent(mut self) -> Req {
        self.idempotent = true;
        self
    }

    /// Marks a call that may not be sent again once it may have run (a DELETE whose second
    /// run answers an error for what the first did).
    pub(crate) fn once(mut self) -> Req {
        self.idempotent = false;
        self
    }

    /// `METHOD /path`, naming the call in errors.
    fn call(&self) -> String {
        format!("{} {}", self.method, self.path)
    }

    pub(crate) fn query<Q: Serialize>(mut self, query: &Q) -> Result<Req, ClientError> {
        let encoded = serde_urlencoded::to_string(query)
            .map_err(|source| ClientError::EncodeQuery { call: self.call(), source })?;
        self.query = if encoded.is_empty() { String::new() } else { format!("?{encoded}") };
        Ok(self)
    }

    pub(crate) fn json<B: Serialize>(mut self, body: &B) -> Result<Req, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(|source| ClientError::EncodeBody { call: self.call(), source })?;
        let bytes = Bytes::from(bytes);
        self.body = body::full(bytes.clone());
        self.replay = Some(Replay::Full(bytes));
        self.content_type = Some(JSON);
        Ok(self)
    }

    pub(crate) fn upload(mut self, body: UploadBody) -> Req {
        self.replay = body.1.map(Replay::Full);
        self.body = body.0;
        self.content_type = Some(OCTET_STREAM);
        self
    }

    pub(crate) fn upload_tar(mut self, body: UploadBody) -> Req {
        self.replay = body.1.map(Replay::Full);
        self.body = body.0;
        self.content_type = Some(TAR);
        self
    }

    pub(crate) fn accept(mut self, accept: &'static str) -> Req {
        self.accept = accept;
        self
    }
}

/// `/v1/sandboxes/{id}{rest}`, the id encoded as one path segment.
pub(crate) fn sandbox_path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{}{rest}", segment(id))
}

fn job_path(name: &str, rest: &str) -> String {
    format!("/v1/jobs/{}{rest}", segment(name))
}

fn pool_path(name: &str) -> String {
    format!("/v1/pools/{}", segment(name))
}

/// `text` percent-encoded as one path segment: everything but RFC 3986's unreserved characters.
pub(crate) fn segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_encoded() {
        assert_eq!(segment("sb-42"), "sb-42");
        assert_eq!(segment("a b/c?d%"), "a%20b%2Fc%3Fd%25");
        assert_eq!(segment("é"), "%C3%A9");
        assert_eq!(sandbox_path("x/y", "/exec"), "/v1/sandboxes/x%2Fy/exec");
    }

    #[test]
    fn only_plain_http_urls_are_taken() {
        assert!(Client::new("http://127.0.0.1:7777/", "t").is_ok_and(|c| c.base_url() == "http://127.0.0.1:7777"));
        assert!(Client::new("http://proxy/sandman", "t").is_ok());
        assert!(matches!(Client::new("https://x", "t"), Err(ClientError::UnsupportedUrl { .. })));
        assert!(matches!(Client::new("127.0.0.1:7777", "t"), Err(ClientError::UnsupportedUrl { .. })));
        assert!(matches!(Client::new("http://a b", "t"), Err(ClientError::InvalidUrl { .. })));
        assert!(matches!(Client::new("http://x", "t\n"), Err(ClientError::InvalidToken { .. })));
    }

    #[test]
    fn debug_never_shows_the_token() {
        let client = Client::new("http://x", "s3cret");
        assert!(!format!("{client:?}").contains("s3cret"));
    }
}

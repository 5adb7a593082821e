//! SandboxFusion's API (`POST run_code`, `POST run_jupyter`, `GET v1/ping`) under `/fusion`, so
//! that verl's code rewards, its `SandboxFusionTool`, skyrl-agent and tinker-cookbook run on
//! Sandman unmodified (docs/sandboxfusion.md). Every call runs in a fresh sandbox of its own
//! (the configured image, no network, its own user, pid and network namespaces on the process
//! provider), made through [`Service::create`] like any other, so admission, fair shares between
//! jobs, quotas, warm pools and accounting apply; it is released once the answer is made.
//!
//! Two rules come from verl's client, which retries only HTTP 504 and scores every other failed
//! call as a wrong answer: a call is never shed (it is outside the server's load-shedding
//! layer, and waits for a slot), and a call that cannot start within its own `run_timeout`
//! answers 504. Failures of the service itself answer status `SandboxError`, never `Failed`.
//!
//! Credentials: the server's bearer token, or a job's capability URL
//! (`/fusion/job/<key>/...`, from `POST /v1/jobs/{job}/fusion-key`), for clients that send no
//! header; the calls made through it belong to that job. Start at [`router`].

pub mod lang;
pub mod model;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use http_body_util::BodyExt;
use sandman_wire::daemon::{ExecRequest, ExecResult};
use sandman_wire::server::{CreateSandbox, FusionKey, Network, Resources, SandboxState};
use serde::Serialize;
use tokio::sync::{OnceCell, Semaphore};
use tokio::time::Instant;

use crate::error::ServerError;
use crate::metrics::FusionLabel;
use crate::service::Service;
use lang::Lang;
use model::{CommandRunResult, CommandRunStatus, Invalid, RunCodeRequest, RunCodeResponse, RunJupyterRequest};
use model::{RunJupyterResponse, RunStatus};

/// The prefix the API is served under.
pub const PREFIX: &str = "/fusion";
/// The label every sandbox of a call carries.
pub const LABEL: &str = "surface";
/// Where a call's files are written and its commands run, inside its sandbox.
pub const WORKDIR: &str = "/tmp/fusion";
/// Largest request body (code and base64 files).
pub const MAX_BODY: usize = 64 << 20;
/// Largest output kept of each of a command's stdout and stderr.
pub const MAX_OUTPUT: u64 = 8 << 20;
/// Largest file fetched back.
pub const MAX_FETCH: usize = 16 << 20;
/// Calls in progress at once by default (`--fusion-max-calls`); the rest wait for a slot.
pub const DEFAULT_MAX_CALLS: usize = 1024;
/// Past its commands' own timeouts, how long a call's sandbox may live (its create, the file
/// calls), so that one a crash left behind is reclaimed soon.
const SLACK_S: u64 = 60;

/// How the API is served (`sandman serve --fusion-*`).
#[derive(Debug, Clone)]
pub struct FusionConfig {
    /// The image every call runs in.
    pub image: String,
    /// Calls in progress at once; more wait (up to their own timeout) for a slot.
    pub max_calls: usize,
    /// The server's URL as clients reach it, for the capability URLs it hands out.
    pub public_url: String,
}

impl Default for FusionConfig {
    fn default() -> Self {
        FusionConfig {
            image: "host".into(),
            max_calls: DEFAULT_MAX_CALLS,
            public_url: format!("http://{}", sandman_wire::server::DEFAULT_LISTEN),
        }
    }
}

/// What the handlers share.
pub struct Fusion {
    service: Arc<Service>,
    config: FusionConfig,
    /// One permit a call in progress; a call waits for one up to its own timeout.
    slots: Arc<Semaphore>,
    /// The languages each image has, probed once in its first call's sandbox. Locked only to
    /// find or add an image's cell; the probe runs outside.
    languages: Mutex<HashMap<String, Arc<OnceCell<BTreeSet<String>>>>>,
}

impl std::fmt::Debug for Fusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fusion").field("config", &self.config).finish_non_exhaustive()
    }
}

/// The routes under [`PREFIX`]: with the bearer token, and under `job/{key}/` without.
pub fn router(service: Arc<Service>, config: FusionConfig) -> Router {
    let slots = Arc::new(Semaphore::new(config.max_calls.max(1)));
    let state = Arc::new(Fusion { service, config, slots, languages: Mutex::new(HashMap::new()) });
    Router::new()
        .route("/fusion/run_code", post(run_code_token))
        .route("/fusion/run_jupyter", post(run_jupyter_token))
        .route("/fusion/v1/ping", get(ping_token))
        .route("/fusion/job/{key}/run_code", post(run_code_key))
        .route("/fusion/job/{key}/run_jupyter", post(run_jupyter_key))
        .route("/fusion/job/{key}/v1/ping", get(ping_key))
        .route("/v1/jobs/{job}/fusion-key", post(make_key).delete(revoke_key))
        .with_state(state)
}

/// `POST /v1/jobs/{job}/fusion-key`: the job's capability URL, made when it has none.
async fn make_key(State(fusion): State<Arc<Fusion>>, Path(job): Path<String>, headers: HeaderMap) -> Response {
    if let Err(e) = by_token(&fusion, &headers) {
        return e.into_response();
    }
    match fusion.service.fusion_key(&job) {
        Ok(key) => {
            let url = format!("{}{PREFIX}/job/{key}", fusion.config.public_url.trim_end_matches('/'));
            axum::Json(FusionKey { job, url: Some(url), revoked: false }).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/jobs/{job}/fusion-key`: revokes it.
async fn revoke_key(State(fusion): State<Arc<Fusion>>, Path(job): Path<String>, headers: HeaderMap) -> Response {
    if let Err(e) = by_token(&fusion, &headers) {
        return e.into_response();
    }
    match fusion.service.revoke_fusion_key(&job) {
        Ok(()) => axum::Json(FusionKey { job, url: None, revoked: true }).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Who a call is from: the job it belongs to (none with the server's token).
#[derive(Debug, Clone)]
struct Caller {
    job: Option<String>,
}

fn by_token(fusion: &Fusion, headers: &HeaderMap) -> Result<Caller, ServerError> {
    let presented = sandman_http::bearer(headers.get(header::AUTHORIZATION));
    if sandman_http::constant_time_eq(presented.as_bytes(), fusion.service.token.as_bytes()) {
        return Ok(Caller { job: None });
    }
    fusion.count(None, "unauthorized");
    Err(ServerError::Unauthorized)
}

fn by_key(fusion: &Fusion, key: &str) -> Result<Caller, ServerError> {
    match fusion.service.job_of_fusion_key(key) {
        Some(job) => Ok(Caller { job: Some(job) }),
        None => {
            fusion.count(None, "unauthorized");
            Err(ServerError::Unauthorized)
        }
    }
}

async fn ping_token(State(fusion): State<Arc<Fusion>>, headers: HeaderMap) -> Response {
    match by_token(&fusion, &headers) {
        Ok(_) => axum::Json("pong").into_response(),
        Err(e) => e.into_response(),
    }
}

async fn ping_key(State(fusion): State<Arc<Fusion>>, Path(key): Path<String>) -> Response {
    match by_key(&fusion, &key) {
        Ok(_) => axum::Json("pong").into_response(),
        Err(e) => e.into_response(),
    }
}

async fn run_code_token(State(fusion): State<Arc<Fusion>>, req: Request) -> Response {
    match by_token(&fusion, req.headers()) {
        Ok(caller) => fusion.run_code(caller, req).await,
        Err(e) => e.into_response(),
    }
}

async fn run_code_key(State(fusion): State<Arc<Fusion>>, Path(key): Path<String>, req: Request) -> Response {
    match by_key(&fusion, &key) {
        Ok(caller) => fusion.run_code(caller, req).await,
        Err(e) => e.into_response(),
    }
}

async fn run_jupyter_token(State(fusion): State<Arc<Fusion>>, req: Request) -> Response {
    match by_token(&fusion, req.headers()) {
        Ok(caller) => fusion.run_jupyter(caller, req).await,
        Err(e) => e.into_response(),
    }
}

async fn run_jupyter_key(State(fusion): State<Arc<Fusion>>, Path(key): Path<String>, req: Request) -> Response {
    match by_key(&fusion, &key) {
        Ok(caller) => fusion.run_jupyter(caller, req).await,
        Err(e) => e.into_response(),
    }
}

/// Why a call got no answer of SandboxFusion's models.
#[derive(Debug)]
enum Refused {
    /// The body is not a request (FastAPI's 422).
    Invalid(Vec<Invalid>),
    /// The body is larger than [`MAX_BODY`].
    TooLarge,
    /// It could not start within its own timeout: 504, the one status verl retries.
    NotStarted(String),
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Refused::Invalid(detail) => {
                #[derive(Serialize)]
                struct Detail {
                    detail: Vec<Invalid>,
                }
                (StatusCode::UNPROCESSABLE_ENTITY, axum::Json(Detail { detail })).into_response()
            }
            Refused::TooLarge => sandman_http::error_response(
                sandman_wire::ErrorCode::TooLarge,
                format!("the request is larger than {} MiB", MAX_BODY >> 20),
                None,
            ),
            Refused::NotStarted(message) => {
                let mut resp = sandman_http::error_response(sandman_wire::ErrorCode::Timeout, message, None);
                *resp.status_mut() = StatusCode::GATEWAY_TIMEOUT;
                resp
            }
        }
    }
}

/// A request body as `T`, or FastAPI's 422 naming what is wrong with it.
async fn parse<T: serde::de::DeserializeOwned>(req: Request) -> Result<T, Refused> {
    let body = http_body_util::Limited::new(req.into_body(), MAX_BODY);
    let bytes = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if sandman_http::extract::is_length_limit(e.as_ref()) => return Err(Refused::TooLarge),
        Err(e) => {
            return Err(Refused::Invalid(vec![Invalid {
                kind: "body_error",
                loc: vec!["body".into()],
                msg: format!("cannot read the body: {e}"),
                input: serde_json::Value::Null,
            }]));
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        Refused::Invalid(vec![Invalid {
            kind: "json_invalid",
            loc: vec!["body".into()],
            msg: format!("the body is not a request of this call: {e}"),
            input: serde_json::Value::Null,
        }])
    })
}

/// A call's sandbox, released (in the background) when dropped.
struct Lease {
    service: Arc<Service>,
    id: String,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let (service, id) = (self.service.clone(), std::mem::take(&mut self.id));
        self.service.tasks.spawn(async move {
            let _ = service.release(&id, sandman_wire::server::Reason::Released).await;
        });
    }
}

/// What the metric and the events need of an answer.
struct Answered {
    status: RunStatus,
    sandbox: Option<String>,
    message: String,
}

/// The outcome label of a call, for the metric.
fn outcome(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Success => "success",
        RunStatus::Failed => "failed",
        RunStatus::SandboxError => "sandbox_error",
    }
}

impl Fusion {
    fn count(&self, job: Option<&str>, outcome: &str) {
        let label = FusionLabel { job: job.unwrap_or_default().to_string(), outcome: outcome.to_string() };
        self.service.metrics.fusion_calls.get_or_create(&label).inc();
    }

    /// A failure of the service (not of the program), in the events as well as the metric.
    fn infra_failure(&self, caller: &Caller, sandbox: Option<&str>, message: &str) {
        self.service.events.emit_fusion(sandbox, caller.job.as_deref(), message.to_string());
    }

    async fn run_code(self: &Arc<Self>, caller: Caller, req: Request) -> Response {
        let resp = match parse::<RunCodeRequest>(req).await {
            Ok(r) => match r.check() {
                problems if !problems.is_empty() => Err(Refused::Invalid(problems)),
                _ => self.code(&caller, r).await,
            },
            Err(e) => Err(e),
        };
        let resp = resp.map(|r| {
            let answer =
                Answered { status: r.status, sandbox: r.executor_pod_name.clone(), message: r.message.clone() };
            (answer, axum::Json(r).into_response())
        });
        self.answer(&caller, resp)
    }

    async fn run_jupyter(self: &Arc<Self>, caller: Caller, req: Request) -> Response {
        let resp = match parse::<RunJupyterRequest>(req).await {
            Ok(r) => match r.check() {
                problems if !problems.is_empty() => Err(Refused::Invalid(problems)),
                _ => self.jupyter(&caller, r).await,
            },
            Err(e) => Err(e),
        };
        let resp = resp.map(|r| {
            let answer =
                Answered { status: r.status, sandbox: r.executor_pod_name.clone(), message: r.message.clone() };
            (answer, axum::Json(r).into_response())
        });
        self.answer(&caller, resp)
    }

    /// Counts a call's outcome (and events the service's failures), then answers it.
    fn answer(&self, caller: &Caller, resp: Result<(Answered, Response), Refused>) -> Response {
        match resp {
            Ok((answered, resp)) => {
                self.count(caller.job.as_deref(), outcome(answered.status));
                if answered.status == RunStatus::SandboxError {
                    self.infra_failure(caller, answered.sandbox.as_deref(), &answered.message);
                }
                resp
            }
            Err(e) => self.refused(caller, e),
        }
    }

    fn refused(&self, caller: &Caller, e: Refused) -> Response {
        let label = match &e {
            Refused::Invalid(_) | Refused::TooLarge => "invalid",
            Refused::NotStarted(m) => {
                self.infra_failure(caller, None, m);
                "not_started"
            }
        };
        self.count(caller.job.as_deref(), label);
        e.into_response()
    }

    /// A fresh sandbox for one call, ready within `start`: a slot first, then the server's
    /// admission, then the provider's create (which may wait for memory). Past `start` the call
    /// is refused with 504; a sandbox that failed to come up is the service's failure, answered
    /// as `SandboxError`.
    async fn sandbox(
        &self,
        caller: &Caller,
        memory_mb: i64,
        life_s: u64,
        start: Duration,
    ) -> Result<Result<(Lease, tokio::sync::OwnedSemaphorePermit), String>, Refused> {
        let deadline = Instant::now() + start;
        let late = || {
            Refused::NotStarted(format!(
                "the call could not start within its run_timeout ({:.1} s): the server is at its capacity (calls, admission or the machine's memory); retry",
                start.as_secs_f64()
            ))
        };
        let permit = tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned())
            .await
            .map_err(|_| late())?
            .map_err(|_| late())?;
        let mut resources = Resources::default();
        if memory_mb > 0 {
            resources.memory = Some(sandman_wire::server::Quantity::Text(format!("{memory_mb}Mi")));
        }
        let mut delay = Duration::from_millis(20);
        let sb = loop {
            let create = CreateSandbox {
                image: self.config.image.clone(),
                resources: resources.clone(),
                job: caller.job.clone(),
                network: Network::None,
                labels: BTreeMap::from([(LABEL.to_string(), "fusion".to_string())]),
                ttl_s: Some(life_s),
                lease_s: Some(life_s),
                wait: false,
                ..Default::default()
            };
            match self.service.create(create).await {
                Ok(sb) => break sb,
                // Turned away by a full queue or the job's quota: tried again until the
                // deadline, then a 504, which the client retries (it would score anything else
                // as a wrong answer).
                Err(ServerError::QueueFull { .. } | ServerError::QuotaExceeded(_)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(late());
                    }
                    tokio::time::sleep(delay.min(left)).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Ok(Err(format!("cannot make a sandbox of image `{}`: {e}", self.config.image))),
            }
        };
        let lease = Lease { service: self.service.clone(), id: sb.id.clone() };
        let Ok(handle) = self.service.get(&sb.id) else {
            return Ok(Err(format!("sandbox `{}` is gone before it was ready", sb.id)));
        };
        let mut state = handle.subscribe();
        // A call starts once its sandbox is ready: whatever holds it back before (admission,
        // memory on the machine, a slow create) counts against its deadline, and a call still
        // waiting then is called off (the lease's drop releases its sandbox) and answered 504.
        let started = tokio::time::timeout_at(
            deadline,
            state.wait_for(|s| !matches!(s, SandboxState::Queued | SandboxState::Creating)),
        )
        .await
        .is_ok();
        if !started {
            return Err(late());
        }
        match handle.state() {
            SandboxState::Ready => Ok(Ok((lease, permit))),
            _ => Ok(Err(format!("sandbox `{}` did not come up: {}", sb.id, handle.gone_error()))),
        }
    }

    /// The languages `image` has, probed once in the sandbox `id`.
    async fn languages(&self, id: &str) -> Result<BTreeSet<String>, String> {
        let cell = {
            let mut map = self.languages.lock().unwrap_or_else(PoisonError::into_inner);
            map.entry(self.config.image.clone()).or_default().clone()
        };
        cell.get_or_try_init(|| async {
            let probe = ExecRequest {
                argv: Some(vec!["/bin/sh".into(), "-c".into(), lang::probe_script()]),
                timeout_ms: Some(30_000),
                ..Default::default()
            };
            let out: ExecResult = self.call_json(id, Method::POST, "exec", &probe).await?;
            if out.status.exit_code != Some(0) {
                return Err(format!(
                    "cannot find out which languages image `{}` has: /bin/sh answered {:?}: {}",
                    self.config.image, out.status.exit_code, out.stderr
                ));
            }
            Ok(out.stdout.lines().map(str::to_string).collect())
        })
        .await
        .cloned()
    }

    async fn code(self: &Arc<Self>, caller: &Caller, req: RunCodeRequest) -> Result<RunCodeResponse, Refused> {
        let Some(lang) = lang::find(&req.language) else {
            return Ok(RunCodeResponse::sandbox_error(format!(
                "language `{}` is not served by this server's SandboxFusion API (it serves {})",
                req.language,
                lang::LANGS.iter().map(|l| l.name).collect::<Vec<_>>().join(", ")
            )));
        };
        let life = req.compile_timeout.ceil() as u64 + req.run_timeout.ceil() as u64 + SLACK_S;
        let start = Duration::from_secs_f64(req.run_timeout.max(1.0));
        let (lease, _permit) = match self.sandbox(caller, req.memory_limit_mb, life, start).await? {
            Ok(s) => s,
            Err(message) => return Ok(RunCodeResponse::sandbox_error(message)),
        };
        let mut resp = RunCodeResponse::sandbox_error(String::new());
        resp.executor_pod_name = Some(lease.id.clone());
        match self.code_in(&lease.id, lang, &req, &mut resp).await {
            Ok(()) => resp.settle(),
            Err(message) => {
                resp.status = RunStatus::SandboxError;
                resp.message = message;
            }
        }
        Ok(resp)
    }

    /// Runs the call in sandbox `id`: its files, the compile, the run, the files fetched back.
    async fn code_in(
        &self,
        id: &str,
        lang: &Lang,
        req: &RunCodeRequest,
        resp: &mut RunCodeResponse,
    ) -> Result<(), String> {
        let has = self.languages(id).await?;
        if !has.contains(lang.name) {
            return Err(format!(
                "language `{}` needs {}, which image `{}` does not have",
                lang.name, lang.needs, self.config.image
            ));
        }
        for (path, content) in &req.files {
            let Some(b64) = content else { continue };
            if path.contains("IGNORE_THIS_FILE") {
                continue;
            }
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| format!("file `{path}` is not base64: {e}"))?;
            self.put_file(id, path, bytes).await?;
        }
        self.put_file(id, lang.file, lang::code_for(lang, &req.code).into_bytes()).await?;
        if let Some(compile) = lang.compile {
            let r = self.command(id, compile, None, req.compile_timeout).await?;
            let ok = r.succeeded();
            resp.compile_result = Some(r);
            if !ok {
                resp.files = self.fetch(id, &req.fetch_files).await?;
                return Ok(());
            }
        }
        resp.run_result = Some(self.command(id, lang.run, req.stdin.clone(), req.run_timeout).await?);
        resp.files = self.fetch(id, &req.fetch_files).await?;
        Ok(())
    }

    async fn jupyter(self: &Arc<Self>, caller: &Caller, req: RunJupyterRequest) -> Result<RunJupyterResponse, Refused> {
        let total = req.total_timeout + 10.0;
        let life = total.ceil() as u64 + SLACK_S;
        let start = Duration::from_secs_f64(req.total_timeout.max(1.0));
        let (lease, _permit) = match self.sandbox(caller, req.memory_limit_mb, life, start).await? {
            Ok(s) => s,
            Err(message) => return Ok(RunJupyterResponse::sandbox_error(message)),
        };
        let mut resp = RunJupyterResponse::sandbox_error(String::new());
        resp.executor_pod_name = Some(lease.id.clone());
        if let Err(message) = self.jupyter_in(&lease.id, &req, total, &mut resp).await {
            resp.status = RunStatus::SandboxError;
            resp.message = message;
        }
        Ok(resp)
    }

    async fn jupyter_in(
        &self,
        id: &str,
        req: &RunJupyterRequest,
        total: f64,
        resp: &mut RunJupyterResponse,
    ) -> Result<(), String> {
        let has = self.languages(id).await?;
        if !has.contains(lang::JUPYTER) {
            return Err(format!(
                "run_jupyter needs a Python kernel (python3 with jupyter_client and ipykernel), which image `{}` does not have",
                self.config.image
            ));
        }
        for (path, b64) in &req.files {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| format!("file `{path}` is not base64: {e}"))?;
            self.put_file(id, path, bytes).await?;
        }
        let input = serde_json::json!({
            "cells": req.cells, "cell_timeout": req.cell_timeout, "total_timeout": req.total_timeout,
        });
        self.put_file(id, JUPYTER_INPUT, input.to_string().into_bytes()).await?;
        self.put_file(id, JUPYTER_DRIVER, include_bytes!("jupyter_driver.py").to_vec()).await?;
        let driver = self.command(id, &format!("python3 {JUPYTER_DRIVER}"), None, total).await?;
        let finished = driver.status == CommandRunStatus::Finished;
        resp.driver = Some(driver);
        if !finished {
            resp.status = RunStatus::Failed;
            return Ok(());
        }
        let mut fetched = self.fetch(id, &[JUPYTER_OUTPUT.to_string()]).await?;
        let Some(out) = fetched.remove(JUPYTER_OUTPUT) else {
            return Err("the Jupyter driver wrote no output: see `driver`".into());
        };
        let out = base64::engine::general_purpose::STANDARD.decode(out).map_err(|e| e.to_string())?;
        #[derive(serde::Deserialize)]
        struct Output {
            status: CommandRunStatus,
            cells: Vec<model::CellRunResult>,
        }
        let out: Output =
            serde_json::from_slice(&out).map_err(|e| format!("the Jupyter driver's output is not readable: {e}"))?;
        if out.status != CommandRunStatus::Finished {
            resp.status = RunStatus::Failed;
            return Ok(());
        }
        resp.status = RunStatus::Success;
        resp.cells = out.cells;
        resp.files = self.fetch(id, &req.fetch_files).await?;
        Ok(())
    }

    /// Runs `command` in [`WORKDIR`], within `timeout_s` (see [`argv_of`]): its exit status is
    /// its own (a signal that ends it is `-N`, as SandboxFusion's bash reports a single
    /// command's), not a shell's `128 + N`.
    async fn command(
        &self,
        id: &str,
        command: &str,
        stdin: Option<String>,
        timeout_s: f64,
    ) -> Result<CommandRunResult, String> {
        let req = ExecRequest {
            argv: Some(argv_of(command)),
            cwd: Some(WORKDIR.into()),
            stdin,
            timeout_ms: Some((timeout_s * 1000.0).round().max(1.0) as u64),
            max_output_bytes: Some(MAX_OUTPUT.min(self.service.settings.max_output_bytes)),
            ..Default::default()
        };
        let out: ExecResult = self.call_json(id, Method::POST, "exec", &req).await?;
        let s = &out.status;
        let time = Some(s.duration_ms as f64 / 1000.0);
        if s.timed_out {
            return Ok(CommandRunResult {
                status: CommandRunStatus::TimeLimitExceeded,
                execution_time: time,
                return_code: None,
                stdout: Some(out.stdout),
                stderr: Some(out.stderr),
            });
        }
        Ok(CommandRunResult {
            status: CommandRunStatus::Finished,
            execution_time: time,
            return_code: s.exit_code.or(s.signal.map(|n| -n)),
            stdout: Some(out.stdout),
            stderr: Some(out.stderr),
        })
    }

    /// Writes a file (relative paths in [`WORKDIR`]), making its parents.
    async fn put_file(&self, id: &str, path: &str, bytes: Vec<u8>) -> Result<(), String> {
        let query = form_urlencoded::Serializer::new(String::new()).append_pair("path", &in_workdir(path)).finish();
        self.call(id, Method::PUT, &format!("files?{query}"), Body::from(bytes), None, 1 << 16).await.map(drop)
    }

    /// The files asked for that exist, base64; those that do not are left out, as SandboxFusion
    /// does.
    async fn fetch(&self, id: &str, paths: &[String]) -> Result<BTreeMap<String, String>, String> {
        let mut files = BTreeMap::new();
        for path in paths {
            let query = form_urlencoded::Serializer::new(String::new()).append_pair("path", &in_workdir(path)).finish();
            match self.call(id, Method::GET, &format!("files?{query}"), Body::empty(), None, MAX_FETCH).await {
                Ok(bytes) => {
                    files.insert(path.clone(), base64::engine::general_purpose::STANDARD.encode(bytes));
                }
                Err(e) if e.starts_with(NOT_A_FILE) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(files)
    }

    async fn call_json<B: Serialize, T: serde::de::DeserializeOwned>(
        &self,
        id: &str,
        method: Method,
        call: &str,
        body: &B,
    ) -> Result<T, String> {
        let body = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        let bytes = self
            .call(id, method, call, Body::from(body), Some("application/json"), 2 * MAX_OUTPUT as usize + (1 << 20))
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| format!("the sandbox's daemon answered what is not expected: {e}"))
    }

    /// One daemon call through the server's proxy (so the call renews the sandbox's lease and
    /// is accounted like any other); the answer's body, or why it failed.
    async fn call(
        &self,
        id: &str,
        method: Method,
        call: &str,
        body: Body,
        content_type: Option<&str>,
        limit: usize,
    ) -> Result<bytes::Bytes, String> {
        let (rest, query) = match call.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (call, None),
        };
        let uri = match query {
            Some(q) => format!("/v1/sandboxes/{id}/{rest}?{q}"),
            None => format!("/v1/sandboxes/{id}/{rest}"),
        };
        let mut req = http::Request::builder().method(method).uri(uri);
        if let Some(ct) = content_type {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        let req: Request = req.body(body).map_err(|e| e.to_string())?;
        let resp = crate::proxy::forward(State(self.service.clone()), Path((id.to_string(), rest.to_string())), req)
            .await
            .map_err(|e| format!("sandbox `{id}`: {e}"))?;
        let status = resp.status();
        let bytes = http_body_util::Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| format!("sandbox `{id}`: cannot read its daemon's answer: {e}"))?
            .to_bytes();
        if status.is_success() {
            return Ok(bytes);
        }
        let (code, message) = match serde_json::from_slice::<sandman_wire::ErrorBody>(&bytes) {
            Ok(b) => (Some(b.error.code), b.error.message),
            Err(_) => (None, String::from_utf8_lossy(&bytes).into_owned()),
        };
        if code == Some(sandman_wire::ErrorCode::NotFound) || status == StatusCode::NOT_FOUND {
            return Err(format!("{NOT_A_FILE}: {message}"));
        }
        Err(format!("sandbox `{id}`: its daemon answered {status}: {message}"))
    }
}

/// How [`Fusion::call`] starts the error of a path that is not there.
const NOT_A_FILE: &str = "not found";
/// The Jupyter driver, its input and its output, in [`WORKDIR`].
const JUPYTER_DRIVER: &str = ".sandman_jupyter.py";
const JUPYTER_INPUT: &str = ".sandman_jupyter_input.json";
const JUPYTER_OUTPUT: &str = ".sandman_jupyter_output.json";

/// A path of a call's files: relative ones are in [`WORKDIR`], as SandboxFusion's are in the
/// call's temporary directory.
fn in_workdir(path: &str) -> String {
    if path.starts_with('/') { path.to_string() } else { format!("{WORKDIR}/{path}") }
}

/// The argv that runs `command`: its words when it is plain words (as every language's compile
/// and run commands are), looked up in `PATH` by the daemon; else `/bin/sh -c 'exec …'`. A
/// shell started for a plain command costs a second exec, a sixth of what starting a Python
/// program costs.
fn argv_of(command: &str) -> Vec<String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "._/-=+:,@%".contains(c);
    if !command.trim().is_empty() && command.split_whitespace().all(|w| w.chars().all(plain)) {
        return command.split_whitespace().map(String::from).collect();
    }
    vec!["/bin/sh".into(), "-c".into(), format!("exec {command}")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_commands_run_without_a_shell_and_the_rest_through_one() {
        assert_eq!(argv_of("python3 main.py"), ["python3", "main.py"]);
        assert_eq!(argv_of("g++ -std=c++17 main.cpp -o test"), ["g++", "-std=c++17", "main.cpp", "-o", "test"]);
        assert_eq!(argv_of("java -cp . -ea Main"), ["java", "-cp", ".", "-ea", "Main"]);
        for shell in ["echo $HOME", "a && b", "cat 'x y'", "a > b", "ls *", "  "] {
            assert_eq!(argv_of(shell), ["/bin/sh", "-c", &format!("exec {shell}")], "{shell}");
        }
        // Every language's commands are plain words.
        for lang in lang::LANGS {
            assert_ne!(argv_of(lang.run)[0], "/bin/sh", "{}", lang.name);
            if let Some(compile) = lang.compile {
                assert_ne!(argv_of(compile)[0], "/bin/sh", "{}", lang.name);
            }
        }
    }

    #[test]
    fn relative_paths_are_in_the_working_directory() {
        assert_eq!(in_workdir("a/b.txt"), "/tmp/fusion/a/b.txt");
        assert_eq!(in_workdir("/etc/x"), "/etc/x");
    }
}

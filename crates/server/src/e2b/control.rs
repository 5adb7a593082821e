//! E2B's control plane (REST, JSON, `X-API-KEY`) mapped onto the service: `templateID` is an
//! image or a warm pool's name (then the create is a claim), `timeout` the sandbox's lifetime
//! (`set_timeout` moves its end), `metadata` its labels (and list filters; the `sandman.job` key
//! names its job), `envVars` its environment. `pause` freezes a sandbox (Sandman's pause: its
//! processes and memory are kept, whatever the pause's `memory` mode asks), `resume` and
//! `connect` thaw it. Every error is `{"code": <status>, "message": …}`, the only shape the SDK
//! parses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::{Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{BoxError, Json, Router};
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use sandman_http::extract::ApiJson;
use sandman_provider::Provider;
use sandman_wire::ErrorCode;
use sandman_wire::server::{CreateSandbox, ListQuery, Network, Reason, Sandbox as WireSandbox, SandboxState};
use serde::Deserialize;
use tower::ServiceBuilder;

use super::{CLIENT_ID, E2b, ENVD_VERSION, JOB_KEY, TEMPLATE_LABEL, access_token, rfc3339};
use crate::error::ServerError;

/// E2B's longest sandbox timeout, a day; also the lease of the sandboxes made here, so that
/// only their timeout (or a kill) ends them, as on E2B.
pub const MAX_TIMEOUT_S: u64 = 86_400;
/// E2B's default sandbox timeout.
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Most sandboxes in one page of a list.
pub const MAX_PAGE: usize = 100;

/// A failed control call, as the SDK parses it.
#[derive(Debug)]
pub struct ControlError {
    pub status: StatusCode,
    pub message: String,
}

impl ControlError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ControlError { status, message: message.into() }
    }

    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<ServerError> for ControlError {
    fn from(e: ServerError) -> Self {
        // A sandbox that is gone is "not found" to E2B (its kill answers False, its connect
        // raises not-found); the message keeps our reason.
        let status = match e.code() {
            ErrorCode::Gone => StatusCode::NOT_FOUND,
            c => StatusCode::from_u16(c.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        };
        ControlError { status, message: e.to_string() }
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, Json(body)).into_response()
    }
}

type ControlResult<T> = Result<T, ControlError>;

pub fn router(e2b: Arc<E2b>, request_timeout: Duration) -> Router {
    Router::new()
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .merge(super::snapshots::routes())
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .layer(ServiceBuilder::new().layer(HandleErrorLayer::new(edge_error)).timeout(request_timeout))
        .route_layer(middleware::from_fn_with_state(e2b.clone(), authorize))
        .fallback(unsupported)
        .with_state(e2b)
}

async fn edge_error(err: BoxError) -> Response {
    if err.is::<tower::timeout::error::Elapsed>() {
        ControlError::new(StatusCode::REQUEST_TIMEOUT, "the request took longer than the server's request timeout")
            .into_response()
    } else {
        ControlError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("unhandled edge error: {err}")).into_response()
    }
}

/// The E2B API key is the server's token.
async fn authorize(State(e2b): State<Arc<E2b>>, req: Request, next: Next) -> Response {
    let presented = req.headers().get("x-api-key").map(|v| v.as_bytes()).unwrap_or_default();
    if !sandman_http::constant_time_eq(presented, e2b.service.token.as_bytes()) {
        return ControlError::new(StatusCode::UNAUTHORIZED, "missing or wrong X-API-KEY (the server's token)")
            .into_response();
    }
    next.run(req).await
}

/// What E2B has and Sandman does not: a clear refusal, never a hang.
pub(super) async fn unsupported(method: Method, uri: Uri) -> ControlError {
    let path = uri.path();
    let what = if path.contains("snapshot") {
        "this snapshot call is not supported by Sandman (create_snapshot, list_snapshots, delete_snapshot and fork are)"
            .to_string()
    } else if path.contains("/templates") {
        "building templates is not supported by Sandman: pass an image, or a warm pool's name, as the template"
            .to_string()
    } else {
        format!("`{method} {path}` is not part of Sandman's E2B API")
    };
    ControlError::new(StatusCode::NOT_IMPLEMENTED, what)
}

/// `POST /v2/sandboxes`. Fields Sandman has no use for are accepted when they ask for nothing
/// (false, empty); those that ask for what it cannot do are refused by name.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    #[serde(default)]
    auto_pause: bool,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    volume_mounts: Vec<serde_json::Value>,
    mcp: Option<serde_json::Value>,
    /// `{"enabled": true}`: a call on the sandbox while it is paused resumes it.
    auto_resume: Option<AutoResume>,
}

/// E2B's `autoResume`.
#[derive(Debug, Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

fn timeout_of(t: u64) -> ControlResult<Duration> {
    if (1..=MAX_TIMEOUT_S).contains(&t) {
        Ok(Duration::from_secs(t))
    } else {
        Err(ControlError::invalid(format!(
            "`timeout` is {t}; it must be between 1 and {MAX_TIMEOUT_S} seconds (a day)"
        )))
    }
}

async fn create(State(e2b): State<Arc<E2b>>, headers: HeaderMap, ApiJson(req): ApiJson<serde_json::Value>) -> Response {
    match create_inner(&e2b, &headers, req).await {
        Ok(v) => (StatusCode::CREATED, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn create_inner(e2b: &E2b, headers: &HeaderMap, raw: serde_json::Value) -> ControlResult<serde_json::Value> {
    let req: NewSandbox =
        serde_json::from_value(raw).map_err(|e| ControlError::invalid(format!("bad request: {e}")))?;
    if req.auto_pause {
        return Err(ControlError::invalid(
            "auto-pause is not supported by Sandman: a sandbox's timeout ends it; pause it yourself (`pause()`)",
        ));
    }
    if !req.volume_mounts.is_empty() {
        return Err(ControlError::invalid("volume mounts are not supported by Sandman"));
    }
    if req.mcp.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ControlError::invalid("MCP servers are not supported by Sandman"));
    }
    let timeout = timeout_of(req.timeout.unwrap_or(DEFAULT_TIMEOUT_S))?;
    let template = req.template_id.trim().to_string();
    if template.is_empty() || template.len() > 512 {
        return Err(ControlError::invalid("`templateID` must be an image or a pool's name, 1 to 512 characters"));
    }
    let service = &e2b.service;
    let is_pool = service.pool(&template).is_ok();
    let mut labels = req.metadata.clone();
    labels.insert(TEMPLATE_LABEL.to_string(), template.clone());
    let mut create = CreateSandbox {
        env: req.env_vars,
        labels,
        job: req.metadata.get(JOB_KEY).cloned(),
        ttl_s: Some(timeout.as_secs()),
        network: if req.allow_internet_access == Some(false) { Network::None } else { Network::default() },
        auto_resume: req.auto_resume.is_some_and(|a| a.enabled),
        wait: true,
        idempotency_key: headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .filter(|k| !k.is_empty() && k.len() <= 255)
            .map(|k| format!("e2b:{k}")),
        ..CreateSandbox::default()
    };
    if is_pool {
        // A claim: the pool's image, resources and lease.
        create.pool = Some(template.clone());
    } else if service.snapshot_info(&template).is_ok() {
        // `Sandbox.create(snapshot_id)`: a snapshot's files, with the create's lifetime.
        create.image = format!("{}{template}", sandman_wire::snapshots::IMAGE_PREFIX);
        create.lease_s = Some(MAX_TIMEOUT_S);
    } else {
        // E2B's default template is "base": on the process provider, this machine.
        create.image =
            if template == "base" && service.provider.name() == "process" { "host".into() } else { template.clone() };
        create.lease_s = Some(MAX_TIMEOUT_S);
    }
    create.check_bounds().map_err(|e| ControlError::invalid(e.to_string()))?;
    let sb = service.create(create).await?;
    Ok(created(&e2b.service.token, &sb, &template))
}

/// The answer of a create or a connect.
pub(super) fn created(token: &str, sb: &WireSandbox, template: &str) -> serde_json::Value {
    serde_json::json!({
        "templateID": template,
        "sandboxID": sb.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access_token(token, &sb.id),
        "domain": null,
    })
}

pub(super) fn template_of(sb: &WireSandbox) -> String {
    sb.labels.get(TEMPLATE_LABEL).cloned().unwrap_or_else(|| sb.image.clone())
}

/// A sandbox as E2B lists and describes it.
fn described(token: &str, sb: &WireSandbox) -> serde_json::Value {
    let metadata: BTreeMap<&String, &String> = sb.labels.iter().filter(|(k, _)| *k != TEMPLATE_LABEL).collect();
    let end = [sb.ttl_expires_at_ms, sb.lease_expires_at_ms, sb.idle_expires_at_ms].into_iter().flatten().min();
    let cpus = sb.resources.cpu.as_ref().and_then(|q| q.value().ok()).map(|c| c.ceil() as u64);
    let mib = |q: &Option<sandman_wire::server::Quantity>| {
        q.as_ref().and_then(|q| q.value().ok()).map_or(0, |b| (b / 1_048_576.0) as u64)
    };
    serde_json::json!({
        "templateID": template_of(sb),
        "sandboxID": sb.id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(sb.ready_at_ms.unwrap_or(sb.created_at_ms)),
        "endAt": rfc3339(end.unwrap_or(sb.created_at_ms)),
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access_token(token, &sb.id),
        "cpuCount": cpus.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64)),
        "memoryMB": mib(&sb.resources.memory),
        "diskSizeMB": mib(&sb.resources.disk),
        "state": if sb.state == SandboxState::Paused { "paused" } else { "running" },
        "metadata": metadata,
    })
}

/// A live sandbox, or 404 (gone ones included: E2B forgets them).
pub(super) fn live(e2b: &E2b, id: &str) -> ControlResult<WireSandbox> {
    let sb = e2b.service.get(id)?;
    if sb.state().is_terminal() {
        return Err(ControlError::from(sb.gone_error()));
    }
    Ok(sb.to_wire())
}

async fn detail(State(e2b): State<Arc<E2b>>, Path(id): Path<String>) -> ControlResult<Json<serde_json::Value>> {
    let sb = live(&e2b, &id)?;
    Ok(Json(described(&e2b.service.token, &sb)))
}

async fn kill(State(e2b): State<Arc<E2b>>, Path(id): Path<String>) -> ControlResult<StatusCode> {
    live(&e2b, &id)?;
    e2b.service.release(&id, Reason::Released).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

async fn set_timeout(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    ApiJson(raw): ApiJson<serde_json::Value>,
) -> ControlResult<StatusCode> {
    let body: TimeoutBody =
        serde_json::from_value(raw).map_err(|e| ControlError::invalid(format!("bad request: {e}")))?;
    let timeout = timeout_of(body.timeout)?;
    live(&e2b, &id)?;
    e2b.service.set_end_in(&id, timeout)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn refresh(State(e2b): State<Arc<E2b>>, Path(id): Path<String>) -> ControlResult<StatusCode> {
    live(&e2b, &id)?;
    e2b.service.keepalive(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ConnectBody {
    timeout: Option<u64>,
}

/// Connecting to a sandbox resumes it when it is paused (answering 201, as E2B does), and
/// extends its timeout when the one given ends later.
async fn connect(State(e2b): State<Arc<E2b>>, Path(id): Path<String>, body: bytes::Bytes) -> ControlResult<Response> {
    let body: ConnectBody = if body.iter().all(u8::is_ascii_whitespace) {
        ConnectBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ControlError::invalid(format!("bad request: {e}")))?
    };
    let mut sb = live(&e2b, &id)?;
    let resumed = sb.state == SandboxState::Paused;
    if resumed {
        sb = e2b.service.resume(&id).await?;
    }
    let answer = extend_and_answer(&e2b, &id, &sb, body.timeout)?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, answer).into_response())
}

/// `POST /sandboxes/{id}/pause`: 204, or 409 when it is paused already (the SDK's `False`).
async fn pause(State(e2b): State<Arc<E2b>>, Path(id): Path<String>) -> ControlResult<StatusCode> {
    let sb = live(&e2b, &id)?;
    if sb.state == SandboxState::Paused {
        return Err(ControlError::new(StatusCode::CONFLICT, format!("sandbox `{id}` is already paused")));
    }
    e2b.service.pause(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/resume` (E2B's older call; `connect` is the newer): 201 with the
/// sandbox, or 409 when it is not paused.
async fn resume(State(e2b): State<Arc<E2b>>, Path(id): Path<String>, body: bytes::Bytes) -> ControlResult<Response> {
    let body: ConnectBody = if body.iter().all(u8::is_ascii_whitespace) {
        ConnectBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ControlError::invalid(format!("bad request: {e}")))?
    };
    let sb = live(&e2b, &id)?;
    if sb.state != SandboxState::Paused {
        return Err(ControlError::new(StatusCode::CONFLICT, format!("sandbox `{id}` is not paused")));
    }
    let sb = e2b.service.resume(&id).await?;
    let answer = extend_and_answer(&e2b, &id, &sb, body.timeout)?;
    Ok((StatusCode::CREATED, answer).into_response())
}

/// Moves the sandbox's end to `timeout` from now when that is later, renews its lease, and
/// answers it as a create does.
fn extend_and_answer(
    e2b: &E2b,
    id: &str,
    sb: &WireSandbox,
    timeout: Option<u64>,
) -> ControlResult<Json<serde_json::Value>> {
    if let Some(t) = timeout {
        let timeout = timeout_of(t)?;
        let wanted = crate::sandbox::now_ms().saturating_add(timeout.as_secs().saturating_mul(1000));
        if sb.ttl_expires_at_ms.is_none_or(|end| wanted > end) {
            e2b.service.set_end_in(id, timeout)?;
        }
    }
    e2b.service.keepalive(id)?;
    Ok(Json(created(&e2b.service.token, sb, &template_of(sb))))
}

/// `GET /v2/sandboxes`: the query, taken leniently (the SDK sends what it has).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListParams {
    metadata: Option<String>,
    state: Option<String>,
    limit: Option<u64>,
    next_token: Option<String>,
    order: Option<String>,
    template: Option<String>,
}

/// The metadata filter: `k=v&k2=v2`, each key and value percent-encoded once more by the SDK.
fn metadata_filter(text: &str) -> BTreeMap<String, String> {
    form_urlencoded::parse(text.as_bytes())
        .map(|(k, v)| {
            let once =
                |s: &str| form_urlencoded::parse(format!("x={s}").as_bytes()).map(|(_, v)| v.into_owned()).next();
            (once(&k).unwrap_or_else(|| k.into_owned()), once(&v).unwrap_or_else(|| v.into_owned()))
        })
        .collect()
}

async fn list(State(e2b): State<Arc<E2b>>, uri: Uri) -> ControlResult<Response> {
    let params: ListParams = serde_urlencoded::from_str(uri.query().unwrap_or_default())
        .map_err(|e| ControlError::invalid(format!("bad query: {e}")))?;
    let limit = params.limit.unwrap_or(MAX_PAGE as u64);
    if !(1..=MAX_PAGE as u64).contains(&limit) {
        return Err(ControlError::invalid(format!("`limit` is {limit}; it must be between 1 and {MAX_PAGE}")));
    }
    let states: Vec<&str> = params.state.as_deref().map(|s| s.split(',').map(str::trim).collect()).unwrap_or_default();
    if let Some(bad) = states.iter().find(|s| !matches!(**s, "running" | "paused" | "")) {
        return Err(ControlError::invalid(format!("unknown state `{bad}`: running or paused")));
    }
    let (running, paused) =
        (states.is_empty() || states.contains(&"running"), states.is_empty() || states.contains(&"paused"));
    let filter = params.metadata.as_deref().map(metadata_filter).unwrap_or_default();
    let after = match params.next_token.as_deref() {
        Some(t) if t.len() <= 512 => Some(
            t.split_once('_')
                .and_then(|(ms, id)| ms.parse::<u64>().ok().map(|ms| (ms, id.to_string())))
                .ok_or_else(|| ControlError::invalid("bad `nextToken`"))?,
        ),
        Some(_) => return Err(ControlError::invalid("bad `nextToken`")),
        None => None,
    };
    let desc = match params.order.as_deref() {
        None | Some("asc") => false,
        Some("desc") => true,
        Some(o) => return Err(ControlError::invalid(format!("unknown order `{o}`: asc or desc"))),
    };
    let mut all: Vec<WireSandbox> =
        if running || paused { e2b.service.list(&ListQuery::default())? } else { Vec::new() };
    all.retain(|s| {
        !s.state.is_terminal()
            && if s.state == SandboxState::Paused { paused } else { running }
            && filter.iter().all(|(k, v)| s.labels.get(k) == Some(v))
            && params.template.as_ref().is_none_or(|t| &template_of(s) == t)
    });
    if desc {
        all.reverse();
    }
    let key = |s: &WireSandbox| (s.created_at_ms, s.id.clone());
    let start = match &after {
        Some(a) => all.iter().position(|s| if desc { key(s) < *a } else { key(s) > *a }).unwrap_or(all.len()),
        None => 0,
    };
    let page: Vec<&WireSandbox> = all[start..].iter().take(limit as usize).collect();
    let more = start + page.len() < all.len();
    let body: Vec<serde_json::Value> = page.iter().map(|s| described(&e2b.service.token, s)).collect();
    let mut resp = Json(body).into_response();
    if more
        && let Some(last) = page.last()
        && let Ok(v) = HeaderValue::from_str(&format!("{}_{}", last.created_at_ms, last.id))
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_filter_is_decoded_twice() {
        // What the SDK sends for {"a b": "c&d", "k": "v"}, once the query itself is decoded.
        let f = metadata_filter("a%2520b=c%2526d&k=v");
        assert_eq!(f.get("a b").map(String::as_str), Some("c&d"));
        assert_eq!(f.get("k").map(String::as_str), Some("v"));
    }

    #[test]
    fn timeouts_are_bounded() {
        assert!(timeout_of(0).is_err() && timeout_of(MAX_TIMEOUT_S + 1).is_err());
        assert_eq!(timeout_of(5).ok(), Some(Duration::from_secs(5)));
    }
}

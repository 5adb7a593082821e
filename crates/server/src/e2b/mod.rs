//! The E2B-compatible API: the real `e2b` SDK runs unmodified against `sandman serve` with
//! `E2B_API_URL=<server>/e2b`, `E2B_SANDBOX_URL=<server>/e2b/envd` and `E2B_API_KEY=<token>`.
//! [`control`] maps E2B's REST control plane onto [`Service`] (create, connect, list, info,
//! timeout, kill); [`envd`] serves the in-sandbox API (Connect RPC in [`process`] and [`fs`],
//! plain HTTP for files and health), routed by the `E2b-Sandbox-Id` header and carried to the
//! sandbox's daemon through the server's own proxy ([`crate::proxy::forward`]), so leases,
//! default users, claim environments and accounting apply as to any other call. Start at
//! [`router`].

pub mod connect;
pub mod control;
pub mod envd;
pub mod fs;
pub mod process;
pub mod snapshots;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;

use crate::error::ServerError;
use crate::service::Service;
use connect::{Code, RpcError};

/// The envd version reported to the SDK, which gates its features by it: 0.5.7 has stdin
/// (0.3.0), default users (0.4.0), `CloseStdin` (0.5.2) and octet-stream uploads (0.5.7);
/// file metadata (0.6.2) and watch events with entries (0.6.3) are past it, so the SDK refuses
/// those itself with a clear error.
pub const ENVD_VERSION: &str = "0.5.7";
/// The `clientID` of every sandbox.
pub const CLIENT_ID: &str = "sandman";
/// The label holding a sandbox's `templateID`; hidden from its metadata.
pub const TEMPLATE_LABEL: &str = "e2b/template";
/// The metadata key naming the sandman job a sandbox belongs to.
pub const JOB_KEY: &str = "sandman.job";
/// Sync directory watchers held at once by the server (`CreateWatcher`), all sandboxes
/// together: each holds a listing of its directory.
pub const MAX_WATCHERS: usize = 1024;

/// What the E2B handlers share: the service, and the polled watchers of the sync SDK.
pub struct E2b {
    pub service: Arc<Service>,
    /// Watchers by id. Locked briefly to take or put one back, never across a daemon call.
    pub watchers: Mutex<HashMap<String, fs::Watcher>>,
}

impl std::fmt::Debug for E2b {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2b").finish_non_exhaustive()
    }
}

impl E2b {
    pub fn watchers(&self) -> std::sync::MutexGuard<'_, HashMap<String, fs::Watcher>> {
        self.watchers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The routes under `/e2b` (control plane, with `request_timeout` as its edge timeout) and
/// `/e2b/envd` (the in-sandbox API, no edge timeout: its streams last as long as commands).
pub fn router(service: Arc<Service>, request_timeout: Duration) -> Router {
    let state = Arc::new(E2b { service, watchers: Mutex::new(HashMap::new()) });
    Router::new()
        .nest("/e2b/envd", envd::router(state.clone()))
        .nest("/e2b", control::router(state, request_timeout))
        // Bodies stream to the daemons, which hold them to their limits.
        .layer(axum::extract::DefaultBodyLimit::disable())
}

/// The access token of a sandbox's envd calls (`X-Access-Token`): an HMAC of its id under the
/// server's token, so nothing is stored and a token opens one sandbox only.
pub fn access_token(server_token: &str, id: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, server_token.as_bytes());
    hex::encode(ring::hmac::sign(&key, format!("e2b-envd:{id}").as_bytes()).as_ref())
}

/// RFC 3339 in UTC with milliseconds, from milliseconds since the Unix epoch.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem % 3600 / 60, rem % 60, ms % 1000)
}

/// One sandbox as the envd handlers reach it: calls go through the server's proxy.
#[derive(Clone)]
pub struct Sbx {
    pub service: Arc<Service>,
    pub id: String,
}

impl std::fmt::Debug for Sbx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sbx").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Sbx {
    /// A daemon call (`/v1/<call>`) through the proxy. An error answer of the daemon becomes
    /// an [`RpcError`] with the matching code; a sandbox that is gone, a 502 "was not found".
    pub async fn call(
        &self,
        method: Method,
        call: &str,
        query: Option<String>,
        body: Body,
        content_type: Option<&str>,
    ) -> Result<Response, RpcError> {
        let uri = match &query {
            Some(q) => format!("/v1/sandboxes/{}/{call}?{q}", self.id),
            None => format!("/v1/sandboxes/{}/{call}", self.id),
        };
        let mut req = http::Request::builder().method(method).uri(uri);
        if let Some(ct) = content_type {
            req = req.header(http::header::CONTENT_TYPE, ct);
        }
        let req: Request = req.body(body).map_err(|e| RpcError::new(Code::Internal, format!("bad request: {e}")))?;
        let resp = crate::proxy::forward(State(self.service.clone()), Path((self.id.clone(), call.to_string())), req)
            .await
            .map_err(|e| self.server_error(e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(daemon_error(resp).await)
    }

    /// A daemon call with a JSON body (or none), answered with JSON.
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        call: &str,
        query: Option<String>,
        body: Option<serde_json::Value>,
    ) -> Result<T, RpcError> {
        let (body, ct) = match body {
            Some(v) => (Body::from(serde_json::to_vec(&v).unwrap_or_default()), Some("application/json")),
            None => (Body::empty(), None),
        };
        let resp = self.call(method, call, query, body, ct).await?;
        let bytes = read_limited(resp.into_body(), 16 << 20).await?;
        serde_json::from_slice(&bytes).map_err(|e| {
            RpcError::new(Code::Internal, format!("the sandbox's daemon answered what is not expected: {e}"))
        })
    }

    fn server_error(&self, e: ServerError) -> RpcError {
        match e {
            ServerError::NotFound(_) => RpcError::sandbox_gone(&self.id, "no such sandbox"),
            ServerError::Gone { reason, .. } => RpcError::sandbox_gone(&self.id, reason.as_str()),
            ServerError::Conflict(m) => RpcError::new(Code::Unavailable, m),
            other => rpc_of(other.code(), other.to_string()),
        }
    }
}

/// A Connect code for each of the server's error codes.
pub fn rpc_of(code: sandman_wire::ErrorCode, message: String) -> RpcError {
    use sandman_wire::ErrorCode as E;
    let c = match code {
        E::InvalidArgument => Code::InvalidArgument,
        E::Unauthorized => Code::Unauthenticated,
        E::Forbidden => Code::PermissionDenied,
        E::NotFound => Code::NotFound,
        E::Timeout => Code::DeadlineExceeded,
        E::Conflict => Code::AlreadyExists,
        // A paused sandbox's envd: resume it (or `connect`) first.
        E::Paused => Code::FailedPrecondition,
        E::Gone => Code::Unavailable,
        E::TooLarge | E::QuotaExceeded => Code::ResourceExhausted,
        E::Unavailable => Code::Unavailable,
        E::Internal => Code::Internal,
    };
    RpcError::new(c, message)
}

async fn daemon_error(resp: Response) -> RpcError {
    let status = resp.status();
    let bytes = read_limited(resp.into_body(), 64 << 10).await.unwrap_or_default();
    match serde_json::from_slice::<sandman_wire::ErrorBody>(&bytes) {
        Ok(b) => rpc_of(b.error.code, b.error.message),
        Err(_) => RpcError::new(
            if status == StatusCode::NOT_FOUND { Code::NotFound } else { Code::Unknown },
            format!("the sandbox answered {status}: {}", String::from_utf8_lossy(&bytes)),
        ),
    }
}

/// A body read whole, up to `limit` bytes.
pub async fn read_limited(body: Body, limit: usize) -> Result<bytes::Bytes, RpcError> {
    let limited = http_body_util::Limited::new(body, limit);
    limited.collect().await.map(|c| c.to_bytes()).map_err(|e| {
        if sandman_http::extract::is_length_limit(e.as_ref()) {
            RpcError::new(Code::ResourceExhausted, format!("the message is larger than {limit} bytes"))
        } else {
            RpcError::new(Code::Unavailable, format!("cannot read the body: {e}"))
        }
    })
}

/// The sandbox an envd call is for (`E2b-Sandbox-Id`), once its `X-Access-Token` checks.
pub fn sandbox_of(e2b: &E2b, headers: &HeaderMap) -> Result<Sbx, RpcError> {
    let id = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .ok_or_else(|| RpcError::new(Code::InvalidArgument, "the `E2b-Sandbox-Id` header is missing"))?;
    let presented = headers.get("x-access-token").map(|v| v.as_bytes()).unwrap_or_default();
    let expected = access_token(&e2b.service.token, id);
    if !sandman_http::constant_time_eq(presented, expected.as_bytes()) {
        return Err(RpcError::new(Code::Unauthenticated, "missing or wrong `X-Access-Token` for this sandbox"));
    }
    Ok(Sbx { service: e2b.service.clone(), id: id.to_string() })
}

/// The user of an envd call: `Authorization: Basic base64(<user>:)`, as the SDK sends it.
pub fn user_of(headers: &HeaderMap) -> Result<Option<String>, RpcError> {
    use base64::Engine;
    let Some(v) = headers.get(http::header::AUTHORIZATION) else { return Ok(None) };
    let text = v.to_str().unwrap_or_default();
    let Some(b64) = text.strip_prefix("Basic ") else {
        return Err(RpcError::invalid("the Authorization header of an envd call names a user: `Basic base64(user:)`"));
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| RpcError::invalid("the Authorization header is not base64"))?;
    let text = String::from_utf8(raw).map_err(|_| RpcError::invalid("the user is not UTF-8"))?;
    let user = text.split_once(':').map_or(text.as_str(), |(u, _)| u);
    Ok((!user.is_empty()).then(|| user.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_798_761_599_000), "2026-12-31T23:59:59.000Z");
    }

    #[test]
    fn an_access_token_opens_one_sandbox() {
        assert_eq!(access_token("t", "a"), access_token("t", "a"));
        assert_ne!(access_token("t", "a"), access_token("t", "b"));
        assert_ne!(access_token("t", "a"), access_token("u", "a"));
    }

    #[test]
    fn the_user_comes_from_basic_auth() {
        let mut h = HeaderMap::new();
        assert_eq!(user_of(&h).ok(), Some(None));
        h.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Basic cm9vdDo="));
        assert_eq!(user_of(&h).ok(), Some(Some("root".to_string())));
        h.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Bearer x"));
        assert!(user_of(&h).is_err());
    }
}

//! The daemon's HTTP surface: the route table, bearer-token auth (which also renews the lease),
//! and the small calls (health, info, keepalive). Handlers for the rest live in their modules.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{any, get, post};
use sandman_wire::ErrorCode;
use sandman_wire::daemon::{Health, HealthQuery, Info, Keepalive, MAX_HEALTH_CHALLENGE, health_proof_input};

use sandman_http::error_response;

use crate::error::DaemonError;
use crate::extract::ApiQuery;
use crate::state::Daemon;
use crate::{archive, exec, files, ports, processes, sessions};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Every call of the daemon API as (method, path). The router below serves exactly these; the
/// OpenAPI test checks the description and the router against this table.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/v1/health"),
    ("GET", "/v1/info"),
    ("POST", "/v1/keepalive"),
    ("GET", "/v1/conditions"),
    ("POST", "/v1/exec"),
    ("POST", "/v1/exec/stream"),
    ("POST", "/v1/processes"),
    ("GET", "/v1/processes"),
    ("GET", "/v1/processes/{id}"),
    ("DELETE", "/v1/processes/{id}"),
    ("GET", "/v1/processes/{id}/output"),
    ("POST", "/v1/processes/{id}/stdin"),
    ("POST", "/v1/processes/{id}/signal"),
    ("POST", "/v1/processes/{id}/wait"),
    ("POST", "/v1/processes/{id}/resize"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions"),
    ("DELETE", "/v1/sessions/{id}"),
    ("POST", "/v1/sessions/{id}/run"),
    ("POST", "/v1/sessions/{id}/interrupt"),
    ("GET", "/v1/files"),
    ("PUT", "/v1/files"),
    ("DELETE", "/v1/files"),
    ("GET", "/v1/stat"),
    ("GET", "/v1/dir"),
    ("POST", "/v1/dir"),
    ("POST", "/v1/move"),
    ("GET", "/v1/archive"),
    ("PUT", "/v1/archive"),
    ("GET", "/v1/ports/{port}/{path}"),
    ("POST", "/v1/ports/{port}/{path}"),
    ("PUT", "/v1/ports/{port}/{path}"),
    ("PATCH", "/v1/ports/{port}/{path}"),
    ("DELETE", "/v1/ports/{port}/{path}"),
];

/// The whole daemon API.
pub fn router(daemon: Arc<Daemon>) -> Router {
    let authed = Router::new()
        .route("/v1/info", get(info))
        .route("/v1/keepalive", post(keepalive))
        .route("/v1/conditions", get(crate::observe::conditions))
        .route("/v1/exec", post(exec::exec))
        .route("/v1/exec/stream", post(exec::exec_stream))
        .route("/v1/processes", post(processes::start).get(processes::list))
        .route("/v1/processes/{id}", get(processes::status).delete(processes::delete))
        .route("/v1/processes/{id}/output", get(processes::output))
        .route("/v1/processes/{id}/stdin", post(processes::write_stdin))
        .route("/v1/processes/{id}/signal", post(processes::signal))
        .route("/v1/processes/{id}/wait", post(processes::wait))
        .route("/v1/processes/{id}/resize", post(processes::resize))
        .route("/v1/sessions", post(sessions::create).get(sessions::list))
        .route("/v1/sessions/{id}", axum::routing::delete(sessions::delete))
        .route("/v1/sessions/{id}/run", post(sessions::run))
        .route("/v1/sessions/{id}/interrupt", post(sessions::interrupt))
        .route("/v1/files", get(files::read_file).put(files::write_file).delete(files::remove))
        .route("/v1/stat", get(files::stat))
        .route("/v1/dir", get(files::list_dir).post(files::mkdir))
        .route("/v1/move", post(files::move_path))
        .route("/v1/archive", get(archive::download).put(archive::extract))
        .route("/v1/ports/{port}", any(ports::forward_root))
        .route("/v1/ports/{port}/", any(ports::forward_root))
        .route("/v1/ports/{port}/{*path}", any(ports::forward))
        .route_layer(middleware::from_fn_with_state(daemon.clone(), authorize));
    Router::new()
        .route("/v1/health", get(health))
        .merge(authed)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are limited where they are read: JSON by `ApiJson`, uploads by the upload limit.
        .layer(DefaultBodyLimit::disable())
        .with_state(daemon)
}

/// Refuses calls without the right bearer token; renews the lease on every call that has it and
/// holds it until the call's answer has been sent.
async fn authorize(State(daemon): State<Arc<Daemon>>, req: Request, next: Next) -> Response {
    let presented = sandman_http::bearer(req.headers().get(header::AUTHORIZATION));
    if !sandman_http::constant_time_eq(presented.as_bytes(), daemon.config.token.as_bytes()) {
        return axum::response::IntoResponse::into_response(DaemonError::Unauthorized);
    }
    // The lease is held while the call is under way, its answer's body included.
    let held = daemon.lease.hold();
    let (parts, body) = next.run(req).await.into_parts();
    Response::from_parts(parts, sandman_http::holding(body, held))
}

/// Who a connection comes from, where the daemon can tell: set (as a request extension) on the
/// connections of the sandbox's own processes when the daemon is its init on a Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// A process of the sandbox, in the daemon's own pid namespace.
    Inside,
}

/// Needs no token; with a `challenge`, proves the token without revealing it (see
/// [`Health::proof`]), so a caller can tell this daemon from another at the same address. A
/// caller inside the sandbox gets no proof (`403`): the only one who asks for it is the server,
/// from outside, and a process of the sandbox asking can only mean to relay it from a socket it
/// put in the daemon's place.
async fn health(
    State(daemon): State<Arc<Daemon>>,
    caller: Option<axum::Extension<Caller>>,
    ApiQuery(query): ApiQuery<HealthQuery>,
) -> Result<Json<Health>, DaemonError> {
    let proof = match query.challenge {
        Some(c) if c.len() > MAX_HEALTH_CHALLENGE => {
            return Err(DaemonError::InvalidArgument(format!("challenge is longer than {MAX_HEALTH_CHALLENGE} bytes")));
        }
        Some(_) if caller.is_some_and(|axum::Extension(c)| c == Caller::Inside) => {
            return Err(DaemonError::Forbidden(
                "a health proof is given only to callers outside the sandbox; this one is a process of the sandbox"
                    .into(),
            ));
        }
        Some(c) => Some(health_proof(&daemon.config.token, &c)),
        None => None,
    };
    Ok(Json(Health { status: "ok".into(), version: VERSION.into(), proof }))
}

/// Lowercase hex of HMAC-SHA256(token, [`health_proof_input`]).
fn health_proof(token: &str, challenge: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    let tag = ring::hmac::sign(&key, &health_proof_input(challenge));
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

async fn info(State(daemon): State<Arc<Daemon>>) -> Json<Info> {
    let (running, total) = daemon.processes.counts();
    Json(Info {
        version: VERSION.into(),
        uptime_ms: daemon.started.elapsed().as_millis() as u64,
        pid: std::process::id(),
        processes_running: running,
        processes: total,
        sessions: daemon.sessions.count(),
        lease_ms: daemon.lease.period().map(|d| d.as_millis() as u64),
        lease_remaining_ms: daemon.lease.remaining().map(|d| d.as_millis() as u64),
        children_usage: crate::sys::children_usage().ok(),
    })
}

async fn keepalive(State(daemon): State<Arc<Daemon>>) -> Json<Keepalive> {
    Json(Keepalive { lease_remaining_ms: daemon.lease.remaining().map(|d| d.as_millis() as u64) })
}

async fn not_found(uri: Uri) -> Response {
    error_response(ErrorCode::NotFound, format!("no such call: {}", uri.path()), None)
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(ErrorCode::InvalidArgument, format!("{method} is not allowed on {}", uri.path()), None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt;

    fn test_daemon() -> Arc<Daemon> {
        let config = crate::state::Config {
            token: "t".into(),
            max_upload_bytes: 0,
            limits: crate::Limits::default(),
            shutdown_grace: std::time::Duration::from_secs(1),
            listen: "test".into(),
            workdir: None,
        };
        let defaults = crate::spawn::Defaults::from_process("/bin/sh".into(), None);
        Daemon::new(config, defaults, crate::children::Children::new(), None)
    }

    async fn health_of(daemon: &Arc<Daemon>, query: &str) -> (u16, serde_json::Value) {
        let req = axum::http::Request::builder().uri(format!("/v1/health{query}")).body(Body::empty());
        let resp = router(daemon.clone()).oneshot(req.unwrap_or_default()).await.unwrap_or_else(|e| match e {});
        let status = resp.status().as_u16();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap_or_default();
        (status, serde_json::from_slice(&body).unwrap_or_default())
    }

    #[tokio::test]
    async fn health_proves_the_token_for_a_challenge_without_needing_it() {
        let daemon = test_daemon();
        let (status, plain) = health_of(&daemon, "").await;
        assert_eq!((status, plain.get("proof")), (200, None), "{plain}");

        let (status, answer) = health_of(&daemon, "?challenge=n1").await;
        assert_eq!(status, 200, "{answer}");
        let proof = answer["proof"].as_str().unwrap_or_default().to_string();
        // HMAC-SHA256 keyed with the token `t`, checked with another implementation's verify.
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"t");
        let tag: Vec<u8> =
            (0..proof.len() / 2).filter_map(|i| u8::from_str_radix(proof.get(2 * i..2 * i + 2)?, 16).ok()).collect();
        assert_eq!(tag.len(), 32, "{proof}");
        assert!(ring::hmac::verify(&key, &health_proof_input("n1"), &tag).is_ok(), "{proof}");
        // Another challenge, another proof; another token, another proof.
        let (_, other) = health_of(&daemon, "?challenge=n2").await;
        assert_ne!(other["proof"], answer["proof"]);
        assert_ne!(health_proof("u", "n1"), proof);
    }

    /// A process of the sandbox that moved the daemon's socket aside and serves one of its own
    /// there could relay the server's challenge to the daemon and its proof back, and then
    /// read the token off the server's next request. A daemon that is its sandbox's init tells
    /// its sandbox's processes from outside callers and gives them no proof.
    #[tokio::test]
    async fn a_caller_inside_the_sandbox_gets_no_proof() {
        let daemon = test_daemon();
        let inside = router(daemon.clone()).layer(axum::Extension(Caller::Inside));
        let req = axum::http::Request::builder().uri("/v1/health?challenge=n1").body(Body::empty());
        let resp = inside.clone().oneshot(req.unwrap_or_default()).await.unwrap_or_else(|e| match e {});
        assert_eq!(resp.status().as_u16(), 403);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap_or_default();
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("forbidden") && text.contains("outside the sandbox"), "{text}");
        // Its health without a challenge is still answered; outside callers get their proof.
        let req = axum::http::Request::builder().uri("/v1/health").body(Body::empty());
        let resp = inside.oneshot(req.unwrap_or_default()).await.unwrap_or_else(|e| match e {});
        assert_eq!(resp.status().as_u16(), 200);
        let (status, answer) = health_of(&daemon, "?challenge=n1").await;
        assert_eq!((status, answer["proof"].as_str().map(str::len)), (200, Some(64)), "{answer}");
    }

    #[tokio::test]
    async fn health_refuses_a_long_challenge_and_unknown_fields() {
        let daemon = test_daemon();
        let long = "x".repeat(MAX_HEALTH_CHALLENGE + 1);
        assert_eq!(health_of(&daemon, &format!("?challenge={long}")).await.0, 400);
        assert_eq!(health_of(&daemon, "?challeng=n1").await.0, 400);
    }

    #[tokio::test]
    async fn every_listed_route_is_served() {
        let app = router(test_daemon());
        for (method, path) in ROUTES {
            let uri = path.replace("{id}", "x");
            let req = axum::http::Request::builder()
                .method(*method)
                .uri(&uri)
                .header("authorization", "Bearer t")
                .body(Body::empty())
                .unwrap_or_default();
            let resp = app.clone().oneshot(req).await.unwrap_or_else(|e| match e {});
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&body);
            assert!(!text.contains("no such call") && !text.contains("is not allowed"), "{method} {path}: {text}");
        }
    }
}

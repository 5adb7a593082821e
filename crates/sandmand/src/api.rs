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
use sandman_wire::daemon::{Health, Info, Keepalive};

use sandman_http::error_response;

use crate::error::DaemonError;
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

async fn health() -> Json<Health> {
    Json(Health { status: "ok".into(), version: VERSION.into() })
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

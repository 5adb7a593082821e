//! The web dashboard at `/ui`: static assets embedded in the binary ([`assets`], served to
//! anyone: they carry no data) and the few calls of its own under `/ui/api/` (behind the
//! server's token, like every other call) that the pages need and the v1 API does not give:
//! a filtered, paged sandbox table, the overview's counts, the jobs table, a sandbox's events,
//! and prepare runs. Everything else the pages read through the v1 API and `/metrics`. The
//! computing lives in [`view`]; start there.

pub mod view;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::header;
use axum::routing::get;
use sandman_http::extract::ApiQuery;
use sandman_provider::Provider;
use sandman_wire::server::{Event, EventKind};
use serde::Serialize;

use crate::error::{ServerError, ServerResult};
use crate::events::Filter;
use crate::sandbox::now_ms;
use crate::service::Service;

use view::{JobRow, PageOf, PageQuery, PrepareRun, Summary};

const INDEX_HTML: &str = include_str!("../../ui/index.html");
const APP_JS: &str = include_str!("../../ui/app.js");
const APP_CSS: &str = include_str!("../../ui/app.css");
const ICON_SVG: &str = include_str!("../../ui/icon.svg");

/// The dashboard's assets, as (path, content type, body).
pub const ASSETS: &[(&str, &str, &str)] = &[
    ("/ui", "text/html; charset=utf-8", INDEX_HTML),
    ("/ui/", "text/html; charset=utf-8", INDEX_HTML),
    ("/ui/app.js", "text/javascript; charset=utf-8", APP_JS),
    ("/ui/app.css", "text/css; charset=utf-8", APP_CSS),
    ("/ui/icon.svg", "image/svg+xml", ICON_SVG),
];

/// The dashboard's calls, each behind the token: (method, path).
pub const API_ROUTES: &[(&str, &str)] = &[
    ("GET", "/ui/api/summary"),
    ("GET", "/ui/api/sandboxes"),
    ("GET", "/ui/api/sandboxes/{id}/events"),
    ("GET", "/ui/api/jobs"),
    ("GET", "/ui/api/prepare"),
];

/// Only the page's own files, no inline script, nothing framed: a token typed into the page
/// can be sent nowhere but this server.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

/// The assets, served without the token (the login form is one of them).
pub fn assets<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS.iter().fold(Router::new(), |r, &(path, kind, body)| {
        r.route(
            path,
            get(move || async move {
                (
                    [
                        (header::CONTENT_TYPE, kind),
                        (header::CONTENT_SECURITY_POLICY, CSP),
                        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                        (header::REFERRER_POLICY, "no-referrer"),
                        (header::CACHE_CONTROL, "no-cache"),
                    ],
                    body,
                )
            }),
        )
    })
}

/// The dashboard's calls; the caller puts them behind the token.
pub fn api() -> Router<Arc<Service>> {
    Router::new()
        .route("/ui/api/summary", get(summary))
        .route("/ui/api/sandboxes", get(sandboxes))
        .route("/ui/api/sandboxes/{id}/events", get(sandbox_events))
        .route("/ui/api/jobs", get(jobs))
        .route("/ui/api/prepare", get(prepare))
}

async fn summary(State(service): State<Arc<Service>>) -> Json<Summary> {
    let all = service.snapshot();
    let mut s = view::summarize(&all, now_ms());
    s.last_seq = service.events.last_seq();
    s.provider = service.provider.name().to_string();
    s.version = crate::VERSION.to_string();
    Json(s)
}

async fn sandboxes(
    State(service): State<Arc<Service>>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ServerResult<Json<PageOf>> {
    let page = q.check().map_err(ServerError::InvalidArgument)?;
    Ok(Json(page.apply(&service.snapshot())))
}

#[derive(Debug, Serialize)]
struct SandboxEvents {
    events: Vec<Event>,
}

/// The sandbox's events among the recent ones the server keeps (`GET /v1/events` has no
/// filter by sandbox).
async fn sandbox_events(State(service): State<Arc<Service>>, Path(id): Path<String>) -> Json<SandboxEvents> {
    // Narrow by job first where the sandbox is still known: fewer events are copied.
    let job = service.get(&id).ok().and_then(|sb| sb.spec.job.clone());
    let filter = Filter { job: job.as_deref(), idempotency_key: None };
    let events = service
        .events
        .list(&filter, 0)
        .into_iter()
        .filter(|e| e.kind == EventKind::Sandbox && e.sandbox == id)
        .collect();
    Json(SandboxEvents { events })
}

#[derive(Debug, Serialize)]
struct JobList {
    jobs: Vec<JobRow>,
}

async fn jobs(State(service): State<Arc<Service>>) -> Json<JobList> {
    let mut states = view::live_by_job(&service.snapshot());
    let jobs = service
        .job_names()
        .into_iter()
        .filter_map(|name| {
            // A job whose sandboxes all ended and that has no quota is history: not listed.
            let job = service.job(&name).ok()?;
            let usage = service.job_usage(&name).ok();
            Some(JobRow { by_state: states.remove(&name).unwrap_or_default(), job, usage })
        })
        .collect();
    Json(JobList { jobs })
}

#[derive(Debug, Serialize)]
struct PrepareList {
    runs: Vec<PrepareRun>,
}

async fn prepare(State(service): State<Arc<Service>>) -> Json<PrepareList> {
    let events = service.events.list(&Filter::default(), 0);
    Json(PrepareList { runs: view::prepare_runs(&events) })
}

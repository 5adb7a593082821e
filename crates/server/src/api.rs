//! The server's HTTP surface: the route table, bearer-token auth, the tower layers at the edge
//! (load shedding, a concurrency limit, a timeout for control calls), and the control handlers.
//! Daemon calls go through [`crate::proxy`].

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Path, Request, State};
use axum::http::{Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{BoxError, Json};
use sandman_http::error_response;
use sandman_http::extract::{ApiJson, ApiQuery};
use sandman_provider::Provider;
use sandman_wire::ErrorCode;
use sandman_wire::server::{
    CreateSandbox, EventList, EventStreamItem, EventsQuery, ImageList, ImageQuery, ImagesRemoved, Job, JobAction,
    JobSpec, JobUsage, ListQuery, Pool, PoolList, PoolSpec, PrepareRequest, PrepareResult, Reason, Sandbox,
    SandboxList, ServerHealth, SignedConditions, Verification,
};
use tokio::sync::{broadcast, mpsc};
use tower::ServiceBuilder;

use crate::error::{ServerError, ServerResult};
use crate::events::Filter;
use crate::proxy;
use crate::service::Service;

/// Edge limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub request_timeout: Duration,
    pub max_concurrent: usize,
}

/// Every call of the server API as (method, path), proxied daemon calls as one wildcard.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}/keepalive"),
    ("POST", "/v1/sandboxes/{id}/pause"),
    ("POST", "/v1/sandboxes/{id}/resume"),
    ("GET", "/v1/sandboxes/{id}/conditions"),
    ("POST", "/v1/sandboxes/{id}/snapshots"),
    ("GET", "/v1/sandboxes/{id}/snapshots"),
    ("POST", "/v1/sandboxes/{id}/fork"),
    ("GET", "/v1/snapshots"),
    ("GET", "/v1/snapshots/{snapshot}"),
    ("DELETE", "/v1/snapshots/{snapshot}"),
    ("POST", "/v1/snapshots/{snapshot}/export"),
    ("ANY", "/v1/sandboxes/{id}/{*call}"),
    ("PUT", "/v1/jobs/{job}"),
    ("GET", "/v1/jobs/{job}"),
    ("DELETE", "/v1/jobs/{job}"),
    ("POST", "/v1/jobs/{job}/heartbeat"),
    ("GET", "/v1/jobs/{job}/usage"),
    ("POST", "/v1/jobs/{job}/fusion-key"),
    ("DELETE", "/v1/jobs/{job}/fusion-key"),
    ("POST", "/fusion/run_code"),
    ("POST", "/fusion/run_jupyter"),
    ("GET", "/fusion/v1/ping"),
    ("POST", "/fusion/job/{key}/run_code"),
    ("POST", "/fusion/job/{key}/run_jupyter"),
    ("GET", "/fusion/job/{key}/v1/ping"),
    ("GET", "/v1/pools"),
    ("PUT", "/v1/pools/{name}"),
    ("GET", "/v1/pools/{name}"),
    ("DELETE", "/v1/pools/{name}"),
    ("POST", "/v1/prepare"),
    ("GET", "/v1/images"),
    ("DELETE", "/v1/images"),
    ("POST", "/v1/images/prune"),
    ("POST", "/v1/verify"),
    ("GET", "/v1/events"),
];

pub fn router(service: Arc<Service>, limits: Limits) -> Router {
    router_with(service, limits, crate::fusion::FusionConfig::default())
}

/// [`router`], with the SandboxFusion API served as `fusion` says.
pub fn router_with(service: Arc<Service>, limits: Limits, fusion: crate::fusion::FusionConfig) -> Router {
    let control = Router::new()
        .route("/metrics", get(metrics))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/{id}", get(get_one).delete(release))
        .route("/v1/sandboxes/{id}/keepalive", post(keepalive))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/conditions", get(conditions))
        .merge(crate::snapshots_api::routes())
        .route("/v1/jobs/{job}", get(get_job).put(put_job).delete(delete_job))
        .route("/v1/jobs/{job}/heartbeat", post(heartbeat))
        .route("/v1/jobs/{job}/usage", get(job_usage))
        .route("/v1/pools", get(list_pools))
        .route("/v1/pools/{name}", get(get_pool).put(put_pool).delete(delete_pool))
        .route("/v1/prepare", post(prepare))
        .route("/v1/images", get(list_images).delete(remove_image))
        .route("/v1/images/prune", post(prune_images))
        .route("/v1/verify", post(verify))
        .route("/v1/events", get(events))
        .merge(crate::ui::api())
        .layer(ServiceBuilder::new().layer(HandleErrorLayer::new(edge_error)).timeout(limits.request_timeout));
    // Proxied calls carry their own timeouts (the daemon enforces `timeout_ms`), and streams may
    // run for long; they get no edge timeout.
    let proxied = Router::new().route("/v1/sandboxes/{id}/{*call}", any(proxy::forward));
    let app = Router::new()
        .merge(control)
        .merge(proxied)
        .route_layer(middleware::from_fn_with_state(service.clone(), authorize))
        // The dashboard's pages carry no data: they load without the token, then ask for it.
        .merge(crate::ui::assets())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(service.clone())
        // The E2B-compatible API, with E2B's own credentials (docs/e2b.md).
        .merge(crate::e2b::router(service.clone(), limits.request_timeout));
    // The limit wraps the whole router as one service: `Router::layer` would give every route
    // and method a semaphore of its own.
    let limited = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(edge_error))
        .load_shed()
        .concurrency_limit(limits.max_concurrent)
        .service(app);
    // Liveness and readiness are answered beside the limit, never shed: a probe that got 503 under load would
    // have the server killed for being busy. So is the SandboxFusion API, whose clients score
    // a shed call as a wrong answer: its calls wait for a slot of their own (`--fusion-max-calls`).
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(service.clone())
        .merge(crate::fusion::router(service, fusion))
        .fallback_service(limited)
}

/// Answers the edge layers' refusals with the wire error body.
async fn edge_error(err: BoxError) -> Response {
    if err.is::<tower::timeout::error::Elapsed>() {
        error_response(ErrorCode::Timeout, "the request took longer than the server's request timeout", None)
    } else if err.is::<tower::load_shed::error::Overloaded>() {
        let mut resp =
            error_response(ErrorCode::Unavailable, "the server is at its concurrency limit; retry shortly", None);
        resp.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        resp
    } else {
        error_response(ErrorCode::Internal, format!("unhandled edge error: {err}"), None)
    }
}

/// Refuses, `401`, a call without the server's token.
pub(crate) async fn authorize(State(service): State<Arc<Service>>, req: Request, next: Next) -> Response {
    if !token_matches(req.headers(), &service.token) {
        return ServerError::Unauthorized.into_response();
    }
    next.run(req).await
}

/// Whether `headers` carry `token` as their bearer token.
pub(crate) fn token_matches(headers: &http::HeaderMap, token: &str) -> bool {
    let presented = sandman_http::bearer(headers.get(header::AUTHORIZATION));
    sandman_http::constant_time_eq(presented.as_bytes(), token.as_bytes())
}

async fn healthz(State(service): State<Arc<Service>>) -> Json<ServerHealth> {
    Json(ServerHealth {
        status: "ok".into(),
        version: crate::VERSION.into(),
        provider: service.provider.name().into(),
        isolation: Some(service.provider.isolation()),
    })
}

/// Readiness: 200 while the server takes calls, 503 once its shutdown has begun (it still
/// serves, for its drain period, while load balancers stop sending it calls). Unlike `/healthz`
/// (liveness), a 503 here never gets the server restarted.
async fn readyz(State(service): State<Arc<Service>>) -> Response {
    if service.draining.is_cancelled() {
        return error_response(ErrorCode::Unavailable, "the server is shutting down", Some("draining"));
    }
    Json(ServerHealth {
        status: "ready".into(),
        version: crate::VERSION.into(),
        provider: service.provider.name().into(),
        isolation: Some(service.provider.isolation()),
    })
    .into_response()
}

async fn metrics(State(service): State<Arc<Service>>) -> Response {
    service.refresh_gauges();
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], service.metrics.encode())
        .into_response()
}

async fn create(
    State(service): State<Arc<Service>>,
    ApiJson(req): ApiJson<CreateSandbox>,
) -> ServerResult<Json<Sandbox>> {
    service.create(req).await.map(Json)
}

async fn list(
    State(service): State<Arc<Service>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ServerResult<Json<SandboxList>> {
    Ok(Json(SandboxList { sandboxes: service.list(&q)? }))
}

async fn get_one(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Sandbox>> {
    Ok(Json(service.get(&id)?.to_wire()))
}

async fn release(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Sandbox>> {
    service.release(&id, Reason::Released).await.map(Json)
}

async fn keepalive(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Sandbox>> {
    service.keepalive(&id).map(Json)
}

async fn pause(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Sandbox>> {
    service.pause(&id).await.map(Json)
}

async fn resume(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Sandbox>> {
    service.resume(&id).await.map(Json)
}

async fn put_job(
    State(service): State<Arc<Service>>,
    Path(job): Path<String>,
    ApiJson(spec): ApiJson<JobSpec>,
) -> ServerResult<Json<Job>> {
    let job = service.put_job(&job, spec)?;
    service.settings.store.saved().await?;
    Ok(Json(job))
}

async fn get_job(State(service): State<Arc<Service>>, Path(job): Path<String>) -> ServerResult<Json<Job>> {
    service.job(&job).map(Json)
}

async fn delete_job(State(service): State<Arc<Service>>, Path(job): Path<String>) -> ServerResult<Json<JobAction>> {
    let done = service.delete_job(&job).await?;
    service.settings.store.saved().await?;
    Ok(Json(done))
}

async fn heartbeat(State(service): State<Arc<Service>>, Path(job): Path<String>) -> ServerResult<Json<JobAction>> {
    service.heartbeat(&job).map(Json)
}

async fn job_usage(State(service): State<Arc<Service>>, Path(job): Path<String>) -> ServerResult<Json<JobUsage>> {
    service.job_usage(&job).map(Json)
}

async fn list_pools(State(service): State<Arc<Service>>) -> Json<PoolList> {
    Json(PoolList { pools: service.pool_list() })
}

async fn get_pool(State(service): State<Arc<Service>>, Path(name): Path<String>) -> ServerResult<Json<Pool>> {
    service.pool(&name).map(Json)
}

async fn put_pool(
    State(service): State<Arc<Service>>,
    Path(name): Path<String>,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> ServerResult<Json<Pool>> {
    let pool = service.put_pool(&name, spec)?;
    service.settings.store.saved().await?;
    Ok(Json(pool))
}

async fn delete_pool(State(service): State<Arc<Service>>, Path(name): Path<String>) -> ServerResult<Json<Pool>> {
    let pool = service.delete_pool(&name)?;
    service.settings.store.saved().await?;
    Ok(Json(pool))
}

async fn prepare(
    State(service): State<Arc<Service>>,
    ApiJson(req): ApiJson<PrepareRequest>,
) -> ServerResult<Json<PrepareResult>> {
    service.prepare(req).await.map(Json)
}

async fn list_images(State(service): State<Arc<Service>>) -> ServerResult<Json<ImageList>> {
    service.images().await.map(Json)
}

async fn remove_image(
    State(service): State<Arc<Service>>,
    ApiQuery(q): ApiQuery<ImageQuery>,
) -> ServerResult<Json<ImagesRemoved>> {
    service.remove_image(&q.image).await.map(Json)
}

async fn prune_images(State(service): State<Arc<Service>>) -> ServerResult<Json<ImagesRemoved>> {
    service.prune_images().await.map(Json)
}

async fn conditions(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
) -> ServerResult<Json<SignedConditions>> {
    service.conditions(&id).await.map(Json)
}

/// Takes any JSON (not the typed record): whatever was signed, unknown fields included, is
/// what must verify.
async fn verify(
    State(service): State<Arc<Service>>,
    ApiJson(signed): ApiJson<serde_json::Value>,
) -> ServerResult<Json<Verification>> {
    service.verify(&signed).map(Json)
}

/// Events buffered for one follower before it is slowed down.
const FOLLOW_EVENTS: usize = 256;

async fn events(State(service): State<Arc<Service>>, ApiQuery(q): ApiQuery<EventsQuery>) -> Response {
    let after = q.after.unwrap_or(0);
    let filter = Filter { job: q.job.as_deref(), idempotency_key: q.idempotency_key.as_deref() };
    if !q.follow {
        return Json(EventList { events: service.events.list(&filter, after) }).into_response();
    }
    // Subscribe before reading the backlog so that nothing falls between the two.
    let mut live = service.events.subscribe();
    let backlog = service.events.list(&filter, after);
    let (tx, rx) = mpsc::channel(FOLLOW_EVENTS);
    service.tasks.spawn(async move {
        let filter = Filter { job: q.job.as_deref(), idempotency_key: q.idempotency_key.as_deref() };
        let mut last = after;
        for e in backlog {
            last = e.seq;
            if tx.send(EventStreamItem::Sandbox(Box::new(e))).await.is_err() {
                return;
            }
        }
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                ev = live.recv() => match ev {
                    Ok(e) if e.seq > last && filter.takes(&e) => {
                        last = e.seq;
                        if tx.send(EventStreamItem::Sandbox(Box::new(e))).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "an events follower fell behind");
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    });
    sandman_http::ndjson::response(rx, || EventStreamItem::Keepalive)
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
    use crate::service::Settings;
    use axum::body::Body;
    use sandman_provider::Endpoint;
    use sandman_provider::fake::FakeProvider;
    use tower::ServiceExt;

    fn app(dir: &std::path::Path, limits: Limits) -> Router {
        let settings = Settings {
            default_lease: Duration::from_secs(60),
            max_ttl: None,
            ready_timeout: Duration::from_secs(30),
            gone_retention: Duration::from_secs(60),
            ..Settings::new(dir.to_path_buf())
        };
        // The fake's endpoint answers nothing, so a waiting create waits for the ready timeout.
        let provider = crate::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("none.sock"))));
        let service = Service::new(settings, provider, "t".into());
        router(service, limits)
    }

    fn req(method: &str, uri: &str, body: &str, token: Option<&str>) -> Request<Body> {
        let mut b = Request::builder().method(method).uri(uri).header("content-type", "application/json");
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        b.body(Body::from(body.to_string())).unwrap_or_default()
    }

    async fn answer(app: &Router, r: Request<Body>) -> (u16, serde_json::Value) {
        let resp = app.clone().oneshot(r).await.unwrap_or_else(|e| match e {});
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20).await.unwrap_or_default();
        (status, serde_json::from_slice(&bytes).unwrap_or_default())
    }

    /// On a server with one request slot: a create that waits takes it (the test's provider never
    /// answers), and a list is shed. Answers the create's task and the shed answer, once there is
    /// one (no sleep "long enough" for the create to arrive first).
    async fn hold_the_one_slot(
        app: &Router,
    ) -> (tokio::task::JoinHandle<(u16, serde_json::Value)>, (u16, serde_json::Value)) {
        let slow = app.clone();
        let first =
            tokio::spawn(
                async move { answer(&slow, req("POST", "/v1/sandboxes", r#"{"image":"x"}"#, Some("t"))).await },
            );
        let shed = async {
            loop {
                let listed = answer(app, req("GET", "/v1/sandboxes", "", Some("t"))).await;
                if listed.0 == 503 {
                    return listed;
                }
                tokio::task::yield_now().await;
            }
        };
        let listed = tokio::time::timeout(Duration::from_secs(10), shed).await.unwrap_or_else(|_| panic!("never shed"));
        (first, listed)
    }

    #[tokio::test]
    async fn past_the_concurrency_limit_requests_are_shed_with_the_error_body() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = app(dir.path(), Limits { request_timeout: Duration::from_secs(30), max_concurrent: 1 });
        let (first, (status, body)) = hold_the_one_slot(&app).await;
        assert_eq!((status, body["error"]["code"].as_str()), (503, Some("unavailable")), "{body}");
        first.abort();
    }

    /// Before, a lease of u64::MAX panicked the request (an instant plus the lease overflowed)
    /// and broke listing for everyone; every number a caller sends is now refused with 400
    /// naming the field and its range.
    #[tokio::test]
    async fn a_lease_of_u64_max_is_refused_naming_its_range() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = app(dir.path(), Limits { request_timeout: Duration::from_secs(5), max_concurrent: 16 });
        let max = u64::MAX;
        let cases = [
            ("POST", "/v1/sandboxes", format!(r#"{{"image":"x","lease_s":{max}}}"#), "`lease_s`", "604800 (7 days)"),
            (
                "POST",
                "/v1/sandboxes",
                format!(r#"{{"image":"x","idle_timeout_s":{max}}}"#),
                "`idle_timeout_s`",
                "604800",
            ),
            ("POST", "/v1/sandboxes", format!(r#"{{"image":"x","ttl_s":{max}}}"#), "`ttl_s`", "2592000 (30 days)"),
            (
                "POST",
                "/v1/sandboxes",
                format!(r#"{{"image":"x","wait_timeout_s":{max}}}"#),
                "`wait_timeout_s`",
                "86400 (1 day)",
            ),
            (
                "POST",
                "/v1/sandboxes",
                r#"{"image":"x","resources":{"memory":"1e30"}}"#.into(),
                "`resources.memory`",
                "TiB",
            ),
            ("POST", "/v1/sandboxes", r#"{"image":"x","resources":{"pids":0}}"#.into(), "`resources.pids`", "4194304"),
            ("PUT", "/v1/jobs/j", format!(r#"{{"lease_s":{max}}}"#), "`lease_s`", "604800"),
            ("PUT", "/v1/jobs/j", r#"{"weight":1e300}"#.into(), "`weight`", "at most 1000"),
            ("PUT", "/v1/pools/p", format!(r#"{{"image":"x","min_ready":0,"lease_s":{max}}}"#), "`lease_s`", "604800"),
            ("POST", "/v1/sandboxes", r#"{"image":"x","lease_s":-1}"#.into(), "lease_s", "u64"),
        ];
        for (method, uri, body, field, range) in cases {
            let (status, v) = answer(&app, req(method, uri, &body, Some("t"))).await;
            let message = v["error"]["message"].as_str().unwrap_or_default().to_string();
            assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_argument")), "{body}: {v}");
            assert!(message.contains(field) && message.contains(range), "{body}: {message}");
        }
        // Nothing of it broke listing.
        assert_eq!(answer(&app, req("GET", "/v1/sandboxes", "", Some("t"))).await.0, 200);
    }

    #[tokio::test]
    async fn healthz_answers_while_the_server_sheds() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = app(dir.path(), Limits { request_timeout: Duration::from_secs(30), max_concurrent: 1 });
        let (first, _) = hold_the_one_slot(&app).await;
        let (status, body) = answer(&app, req("GET", "/healthz", "", None)).await;
        assert_eq!((status, body["status"].as_str()), (200, Some("ok")), "{body}");
        first.abort();
    }

    /// Readiness turns 503 once shutdown begins, while liveness and every call still answer: a
    /// draining server is taken out of its load balancer, not restarted, and still serves.
    #[tokio::test]
    async fn readyz_turns_503_when_draining_begins_and_calls_are_still_served() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (app, service) = fake_app(dir.path(), 1000.0);
        let (status, body) = answer(&app, req("GET", "/readyz", "", None)).await;
        assert_eq!((status, body["status"].as_str()), (200, Some("ready")), "{body}");
        service.draining.cancel();
        let (status, body) = answer(&app, req("GET", "/readyz", "", None)).await;
        assert_eq!((status, body["error"]["reason"].as_str()), (503, Some("draining")), "{body}");
        assert_eq!(answer(&app, req("GET", "/healthz", "", None)).await.0, 200);
        let (status, body) = answer(&app, req("POST", "/v1/sandboxes", r#"{"image":"any"}"#, Some("t"))).await;
        assert_eq!((status, body["state"].as_str()), (200, Some("ready")), "{body}");
    }

    #[tokio::test]
    async fn readyz_answers_while_the_server_sheds() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = app(dir.path(), Limits { request_timeout: Duration::from_secs(30), max_concurrent: 1 });
        let (first, _) = hold_the_one_slot(&app).await;
        assert_eq!(answer(&app, req("GET", "/readyz", "", None)).await.0, 200);
        first.abort();
    }

    #[tokio::test]
    async fn control_calls_time_out_with_the_error_body() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = app(dir.path(), Limits { request_timeout: Duration::from_millis(200), max_concurrent: 16 });
        let (status, body) = answer(&app, req("POST", "/v1/sandboxes", r#"{"image":"x"}"#, Some("t"))).await;
        assert_eq!((status, body["error"]["code"].as_str()), (408, Some("timeout")), "{body}");
    }

    #[tokio::test]
    async fn every_call_but_the_probes_needs_the_token() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = app(dir.path(), Limits { request_timeout: Duration::from_secs(5), max_concurrent: 16 });
        assert_eq!(answer(&app, req("GET", "/healthz", "", None)).await.0, 200);
        assert_eq!(answer(&app, req("GET", "/readyz", "", None)).await.0, 200);
        for (m, p) in ROUTES.iter().filter(|(_, p)| !matches!(*p, "/healthz" | "/readyz")) {
            let method = if *m == "ANY" { "POST" } else { m };
            let uri = p.replace("{id}", "sb-x").replace("{job}", "j").replace("{name}", "p").replace("{*call}", "exec");
            let (status, body) = answer(&app, req(method, &uri, "{}", None)).await;
            assert_eq!((status, body["error"]["code"].as_str()), (401, Some("unauthorized")), "{m} {p}");
            let (status, _) = answer(&app, req(method, &uri, "{}", Some("wrong"))).await;
            assert_eq!(status, 401, "{m} {p}");
        }
    }

    /// The whole API over a service whose fake sandboxes are ready as soon as they are made,
    /// admitting `rate` creates a second.
    fn fake_app(dir: &std::path::Path, rate: f64) -> (Router, Arc<Service>) {
        let settings = Settings {
            create_rate: Some(rate),
            create_burst: 1.0,
            daemons: crate::service::Daemons::Absent,
            ..Settings::new(dir.to_path_buf())
        };
        let provider = crate::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("none.sock"))));
        let service = Service::new(settings, provider, "t".into());
        service.start_background();
        let limits = Limits { request_timeout: Duration::from_secs(600), max_concurrent: 16 };
        (router(service.clone(), limits), service)
    }

    async fn ready_of(app: &Router, job: &str) -> usize {
        let (status, body) =
            answer(app, req("GET", &format!("/v1/sandboxes?job={job}&state=ready"), "", Some("t"))).await;
        assert_eq!(status, 200, "{body}");
        body["sandboxes"].as_array().map_or(0, Vec::len)
    }

    /// The issue's burst: 5,000 creates from three jobs through the API, held to the global rate,
    /// each job's share as its weight says while all three queue; none lost or duplicated;
    /// every sandbox released at the end.
    #[tokio::test(start_paused = true)]
    async fn a_burst_of_5000_creates_from_three_jobs_is_held_to_the_rate_and_shared_by_weight() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (app, service) = fake_app(dir.path(), 200.0);
        let jobs = [("w1", 1.0), ("w2", 2.0), ("w5", 5.0)];
        for (job, weight) in jobs {
            let body = format!(r#"{{"weight": {weight}}}"#);
            assert_eq!(answer(&app, req("PUT", &format!("/v1/jobs/{job}"), &body, Some("t"))).await.0, 200);
        }
        let mut ids = std::collections::HashSet::new();
        for i in 0..5000 {
            let job = jobs[i % 3].0;
            let body = format!(r#"{{"image": "any", "job": "{job}", "wait": false}}"#);
            let (status, sb) = answer(&app, req("POST", "/v1/sandboxes", &body, Some("t"))).await;
            assert_eq!(status, 200, "{sb}");
            assert!(ids.insert(sb["id"].as_str().unwrap_or_default().to_string()), "a duplicate id");
        }
        assert_eq!(ids.len(), 5000);
        // 10 s at 200/s: about 2,000 admitted while all three jobs still queue (the heaviest
        // drains its 1,667 at 125/s, in about 13 s).
        tokio::time::sleep(Duration::from_secs(10)).await;
        let got: Vec<f64> = futures_util::future::join_all(jobs.iter().map(|(j, _)| ready_of(&app, j)))
            .await
            .into_iter()
            .map(|n| n as f64)
            .collect();
        let total: f64 = got.iter().sum();
        assert!((total - 2000.0).abs() <= 5.0, "the rate was not held: {total} in 10 s");
        for ((job, weight), n) in jobs.iter().zip(&got) {
            let want = total * weight / 8.0;
            assert!((n - want).abs() / want < 0.10, "{job}: {n} admitted, its share is {want}");
        }
        // The rest, then every sandbox exactly once.
        tokio::time::sleep(Duration::from_secs(30)).await;
        let (_, all) = answer(&app, req("GET", "/v1/sandboxes?state=ready", "", Some("t"))).await;
        let listed: std::collections::HashSet<String> = all["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["id"].as_str().map(str::to_string))
            .collect();
        assert!(listed == ids, "{} sandboxes ready, of {} created", listed.len(), ids.len());
        let made = match &service.provider {
            crate::provider::AnyProvider::Fake(f) => f.count(),
            _ => 0,
        };
        assert_eq!(made, 5000);
        for (job, _) in jobs {
            let (status, body) = answer(&app, req("DELETE", &format!("/v1/jobs/{job}"), "", Some("t"))).await;
            assert_eq!(status, 200, "{body}");
        }
        let made = match &service.provider {
            crate::provider::AnyProvider::Fake(f) => f.count(),
            _ => usize::MAX,
        };
        assert_eq!(made, 0, "sandboxes left after their jobs were deleted");
        let (_, body) = answer(&app, req("GET", "/v1/jobs/w5/usage", "", Some("t"))).await;
        assert_eq!(body["by_reason"]["job_deleted"], 1666, "{body}");
        let (_, text) = (200, service.metrics.encode());
        assert!(text.contains("sandman_creates_admitted_total"), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_answers_429_with_retry_after() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let settings = Settings {
            create_rate: Some(1.0),
            create_burst: 1.0,
            max_queue: 2,
            daemons: crate::service::Daemons::Absent,
            ..Settings::new(dir.path().to_path_buf())
        };
        let provider =
            crate::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.path().join("none.sock"))));
        let service = Service::new(settings, provider, "t".into());
        let app = router(service, Limits { request_timeout: Duration::from_secs(60), max_concurrent: 16 });
        let body = r#"{"image": "any", "wait": false}"#;
        for _ in 0..3 {
            assert_eq!(answer(&app, req("POST", "/v1/sandboxes", body, Some("t"))).await.0, 200);
        }
        let resp =
            app.clone().oneshot(req("POST", "/v1/sandboxes", body, Some("t"))).await.unwrap_or_else(|e| match e {});
        assert_eq!(resp.status().as_u16(), 429);
        assert!(resp.headers().get("retry-after").is_some());
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap_or_default();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        assert_eq!(v["error"]["code"], "quota_exceeded");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("--max-queue")), "{v}");
    }
}

/// Property tests of the whole router: arbitrary JSON bodies, numbers and query strings on every
/// control call never panic the server and never answer 5xx; bad input is 4xx.
#[cfg(test)]
mod properties {
    use super::{CreateSandbox, Duration, Limits, Request, Router, Service, router};
    use crate::service::{Daemons, Settings};
    use axum::body::Body;
    use proptest::prelude::*;
    use sandman_provider::Endpoint;
    use sandman_provider::fake::FakeProvider;
    use serde_json::Value;
    use tower::ServiceExt;

    /// Field names of the server's requests, so that arbitrary bodies reach past "unknown field".
    const FIELDS: &[&str] = &[
        "image",
        "provider",
        "resources",
        "cpu",
        "memory",
        "disk",
        "pids",
        "env",
        "labels",
        "job",
        "profile",
        "network",
        "ttl_s",
        "idle_timeout_s",
        "lease_s",
        "pool",
        "setup",
        "idempotency_key",
        "wait",
        "wait_timeout_s",
        "max_sandboxes",
        "create_rate",
        "weight",
        "min_ready",
        "max",
        "autoscale",
        "images",
        "hold_until",
        "record",
        "signature",
        "key_id",
    ];

    fn number() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u64..100_000).prop_map(Value::from),
            Just(Value::from(u64::MAX)),
            any::<f64>().prop_filter("JSON has no NaN or infinity", |f| f.is_finite()).prop_map(Value::from),
        ]
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            number(),
            "[a-z0-9:/._-]{0,12}".prop_map(Value::from),
            Just(Value::from("host")),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop_oneof![prop::sample::select(FIELDS).prop_map(str::to_string), "[a-z_]{1,8}"],
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn call() -> impl Strategy<Value = (&'static str, String)> {
        prop_oneof![
            Just(("POST", "/v1/sandboxes".to_string())),
            Just(("PUT", "/v1/jobs/j".to_string())),
            Just(("PUT", "/v1/pools/p".to_string())),
            Just(("POST", "/v1/prepare".to_string())),
            Just(("POST", "/v1/verify".to_string())),
            "[a-z0-9=&%_-]{0,40}".prop_map(|q| ("GET", format!("/v1/sandboxes?{q}"))),
            "[a-z0-9=&%_-]{0,40}".prop_map(|q| ("GET", format!("/v1/events?{q}"))),
            ("[a-z0-9-]{1,8}", "[a-z/]{0,12}").prop_map(|(id, call)| ("POST", format!("/v1/sandboxes/{id}/{call}"))),
        ]
    }

    fn app(dir: &std::path::Path) -> Router {
        let settings = Settings { create_rate: None, daemons: Daemons::Absent, ..Settings::new(dir.to_path_buf()) };
        let provider = crate::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("none.sock"))));
        let service = Service::new(settings, provider, "t".into());
        service.start_background();
        router(service, Limits { request_timeout: Duration::from_secs(30), max_concurrent: 64 })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_requests_never_panic_nor_answer_5xx((method, uri) in call(), body in json(), raw in any::<bool>()) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| panic!("{e}"));
            let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
            let status = rt.block_on(async {
                let app = app(dir.path());
                // Now and then a body that is not JSON at all.
                let text = if raw { body.to_string().replace('"', "") } else { body.to_string() };
                let req = Request::builder()
                    .method(method)
                    .uri(&uri)
                    .header("authorization", "Bearer t")
                    .header("content-type", "application/json")
                    .body(Body::from(text))
                    .unwrap_or_default();
                let resp = tokio::time::timeout(Duration::from_secs(20), app.oneshot(req)).await;
                resp.map(|r| r.unwrap_or_else(|e| match e {}).status().as_u16()).unwrap_or(408)
            });
            prop_assert!(status < 500, "{method} {uri} {body}: {status}");
        }

        #[test]
        fn every_number_of_a_create_is_checked_before_use(lease in any::<u64>(), idle in any::<u64>(), ttl in any::<u64>(), wait in any::<u64>()) {
            let c = CreateSandbox {
                image: "host".into(),
                lease_s: Some(lease),
                idle_timeout_s: Some(idle),
                ttl_s: Some(ttl),
                wait_timeout_s: Some(wait),
                ..CreateSandbox::default()
            };
            let ok = (1..=sandman_wire::bounds::LEASE_S.max).contains(&lease)
                && (1..=sandman_wire::bounds::IDLE_TIMEOUT_S.max).contains(&idle)
                && (1..=sandman_wire::bounds::TTL_S.max).contains(&ttl)
                && wait <= sandman_wire::bounds::WAIT_TIMEOUT_S.max;
            prop_assert_eq!(c.check_bounds().is_ok(), ok);
        }
    }
}

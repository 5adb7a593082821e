//! Several replicas of the server on Kubernetes (`--leader-election`): the replicas elect a
//! leader with a Lease; the leader runs the whole control plane (the same [`Service`] one server
//! runs, its jobs, pools, snapshots and conditions key kept in the cluster by
//! [`Store::Shared`]), and every other replica passes each call it gets on to the leader,
//! streaming both ways (a WebSocket upgrade included). When the leader goes (killed, drained,
//! its node lost), a follower takes the Lease, builds the service from the cluster (the pods,
//! the ConfigMap, the Secret) and serves; calls meanwhile answer `503` with `Retry-After`,
//! which the SDKs and the CLI retry. A leader that loses the Lease, or finds that another
//! replica wrote the shared state, stops at once rather than act beside a second leader
//! (docs/design.md#replicas).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::header;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use sandman_provider_kube::shared::Shared;
use sandman_wire::error::ErrorCode;
use sandman_wire::server::UNANSWERED;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::mirror::Mirror;
use crate::service::Service;

/// Set on a call one replica passes to another: a replica that gets one and does not lead
/// (it lost the Lease meanwhile) answers 503 rather than pass it on again.
pub const FORWARDED: &str = "x-sandman-forwarded";

/// One replica: the leader's router once it leads, else where the leader is.
pub struct Replica {
    /// This replica's address, its identity in the Lease.
    pub me: String,
    /// The leader's whole router and service, once this replica leads.
    pub leading: OnceLock<(Router, Arc<Service>)>,
    /// The leader's address as the Lease names it.
    pub leader: watch::Receiver<Option<String>>,
    /// Cancelled when this replica's shutdown begins: `/readyz` answers 503.
    pub draining: CancellationToken,
    /// The leader's routes, for the daemon calls this replica passes on itself while it
    /// follows (`crate::mirror`); without one, every call goes to the leader.
    pub mirror: Option<Arc<Mirror>>,
    client: Client<HttpConnector, Body>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("me", &self.me)
            .field("leads", &self.leading.get().is_some())
            .field("leader", &*self.leader.borrow())
            .finish_non_exhaustive()
    }
}

impl Replica {
    pub fn new(
        me: String,
        leader: watch::Receiver<Option<String>>,
        draining: CancellationToken,
        mirror: Option<Arc<Mirror>>,
    ) -> Arc<Replica> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Arc::new(Replica { me, leading: OnceLock::new(), leader, draining, mirror, client })
    }

    /// Follows the leader's routes until `stop`, when this replica has a mirror.
    pub async fn follow(self: Arc<Self>, stop: CancellationToken) {
        if let Some(mirror) = &self.mirror {
            mirror.clone().follow(self.me.clone(), self.leader.clone(), self.client.clone(), stop).await;
        }
    }

    /// The router every replica serves: the leader's own, or passing calls on to it.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new().fallback(dispatch).with_state(self.clone())
    }
}

fn unavailable(message: String, reason: &str) -> Response {
    let mut resp = sandman_http::error_response(ErrorCode::Unavailable, message, Some(reason));
    resp.headers_mut().insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
    resp
}

async fn dispatch(State(replica): State<Arc<Replica>>, req: Request) -> Response {
    if let Some((app, _)) = replica.leading.get() {
        return match app.clone().oneshot(req).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
    }
    match req.uri().path() {
        "/healthz" => return health(&replica, "ok"),
        "/readyz" => {
            if replica.draining.is_cancelled() {
                return unavailable("the server is shutting down".into(), "draining");
            }
            if replica.leader.borrow().is_none() {
                return unavailable("no replica leads yet".into(), "no_leader");
            }
            return health(&replica, "ready");
        }
        "/metrics" => {
            // A follower's own: Prometheus scrapes every pod, and only the leader's figures
            // are the service's, but for the daemon calls this replica passed on itself.
            let mut text = String::from("sandman_replica_leading 0\n");
            if let Some(mirror) = &replica.mirror {
                text.push_str(&format!(
                    "sandman_replica_routes {}\nsandman_replica_direct_calls_total {}\n",
                    mirror.len(),
                    mirror.direct_calls()
                ));
            }
            return ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response();
        }
        _ => {}
    }
    let req = match &replica.mirror {
        Some(mirror) => match mirror.serve(req).await {
            Ok(resp) => return resp,
            Err(req) => req,
        },
        None => req,
    };
    if req.headers().contains_key(FORWARDED) {
        return unavailable(
            format!("replica {} was passed a call for the leader, and does not lead; try again", replica.me),
            "no_leader",
        );
    }
    let leader = replica.leader.borrow().clone();
    match leader {
        Some(addr) if addr != replica.me => forward(&replica, &addr, req).await,
        // The Lease names this replica, which is still building the service from the cluster.
        Some(_) => unavailable("this replica is taking over as leader; try again".into(), "no_leader"),
        None => unavailable("no replica leads yet (one takes over within seconds); try again".into(), "no_leader"),
    }
}

fn health(replica: &Replica, status: &str) -> Response {
    axum::Json(serde_json::json!({
        "status": status,
        "version": crate::VERSION,
        "provider": "kubernetes",
        "replica": replica.me,
        "leader": *replica.leader.borrow(),
    }))
    .into_response()
}

/// Passes `req` on to the leader at `addr`, bodies streaming both ways.
async fn forward(replica: &Replica, addr: &str, mut req: Request) -> Response {
    let upgrade = crate::proxy::is_upgrade(req.headers());
    let inbound = upgrade.then(|| hyper::upgrade::on(&mut req));
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let uri: http::Uri = match format!("http://{addr}{path}").parse() {
        Ok(u) => u,
        Err(e) => return unavailable(format!("the leader's address `{addr}` is not usable: {e}"), "no_leader"),
    };
    let (parts, body) = req.into_parts();
    let mut out = http::Request::builder().method(parts.method).uri(uri);
    if let Some(headers) = out.headers_mut() {
        for (name, value) in &parts.headers {
            if crate::proxy::HOP_BY_HOP.contains(name) || name == header::HOST || name.as_str() == "keep-alive" {
                continue;
            }
            headers.append(name.clone(), value.clone());
        }
        headers.insert(FORWARDED, http::HeaderValue::from_static("1"));
        if upgrade {
            crate::proxy::keep_upgrade(&parts.headers, headers);
        }
    }
    let out = match out.body(body) {
        Ok(r) => r,
        Err(e) => return unavailable(format!("cannot pass the call on: {e}"), "no_leader"),
    };
    let mut resp = match replica.client.request(out).await {
        Ok(r) => r,
        // Never reached the leader: nothing ran, any call may be sent again.
        Err(e) if e.is_connect() => {
            return unavailable(
                format!("the leader replica {addr} did not answer ({}); try again", crate::daemon::with_causes(&e)),
                "no_leader",
            );
        }
        // The call went out and the leader went away: it may have run.
        Err(e) => {
            let mut resp = sandman_http::error_response(
                ErrorCode::Unavailable,
                format!(
                    "the leader replica {addr} went away with the call under way ({}): it may have run",
                    crate::daemon::with_causes(&e)
                ),
                Some("leader_lost"),
            );
            resp.headers_mut().insert(UNANSWERED, http::HeaderValue::from_static("1"));
            return resp;
        }
    };
    let switching = resp.status() == http::StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(inbound)) = (switching, inbound) {
        let outbound = hyper::upgrade::on(&mut resp);
        tokio::spawn(crate::proxy::splice(inbound, outbound));
    }
    let (mut parts, body) = resp.into_parts();
    let kept = parts.headers.clone();
    for h in crate::proxy::HOP_BY_HOP {
        parts.headers.remove(h);
    }
    if switching {
        crate::proxy::keep_upgrade(&kept, &mut parts.headers);
    }
    Response::from_parts(parts, Body::new(body))
}

/// How this replica's turn as leader ended.
#[derive(Debug)]
pub enum Ended {
    /// Asked to stop (its shutdown).
    Stopped,
    /// It lost the Lease, or another replica wrote the shared state: it must not act further.
    Deposed(String),
}

/// Campaigns for the Lease; once this replica leads, builds the service with `build` and hands
/// it to `replica`, then holds the Lease until `stop` or until it is lost. Releases it on the
/// way out, so that a follower takes over at once.
pub async fn lead<F, Fut>(replica: Arc<Replica>, shared: Shared, stop: CancellationToken, build: F) -> Ended
where
    F: FnOnce(Shared) -> Fut,
    Fut: Future<Output = Result<(Router, Arc<Service>, CancellationToken), String>>,
{
    let (mut leading, task) = match shared.elect(&replica.me).await {
        Ok(e) => e,
        Err(e) => return Ended::Deposed(format!("cannot campaign for the Lease: {e}")),
    };
    tokio::select! {
        () = stop.cancelled() => return Ended::Stopped,
        r = leading.wait_for(|l| *l) => if r.is_err() {
            return Ended::Deposed("the Lease's manager stopped".into());
        },
    }
    tracing::info!(replica = replica.me, "this replica leads: building the service from the cluster");
    let (app, service, fenced) = match build(shared).await {
        Ok(built) => built,
        Err(e) => {
            drop(leading);
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
            return Ended::Deposed(format!("cannot take over as leader: {e}"));
        }
    };
    let _ = replica.leading.set((app, service));
    tracing::info!(replica = replica.me, "serving as leader");
    let ended = tokio::select! {
        () = stop.cancelled() => Ended::Stopped,
        () = fenced.cancelled() => Ended::Deposed("another replica wrote the shared state".into()),
        _ = leading.wait_for(|l| !*l) => Ended::Deposed("this replica lost the Lease".into()),
    };
    // Dropping the last receiver makes the manager release the Lease.
    drop(leading);
    let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    ended
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::Router;
    use axum::body::Body;
    use axum::extract::Request;
    use http::StatusCode;
    use http_body_util::BodyExt;
    use sandman_provider::Endpoint;
    use sandman_provider::fake::FakeProvider;
    use tokio::sync::watch;
    use tokio_util::sync::CancellationToken;
    use tower::ServiceExt;

    use super::{FORWARDED, Replica};
    use crate::api::{Limits, router};
    use crate::service::{Daemons, Service, Settings};

    /// Serves `app` on a loopback port; answers its address.
    async fn serve(app: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// A leader that answers what it was sent: method, path and query, the headers a replica
    /// must pass on (or add), and the body.
    fn echo() -> Router {
        Router::new().fallback(|req: Request| async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("-").to_string();
            let text = format!(
                "{} {} auth={} forwarded={} body={}",
                parts.method,
                parts.uri,
                header("authorization"),
                header(FORWARDED),
                String::from_utf8_lossy(&body)
            );
            (StatusCode::CREATED, [("x-leader", "echo")], text)
        })
    }

    async fn call(app: &Router, req: http::Request<Body>) -> (StatusCode, http::HeaderMap, String) {
        let resp = app.clone().oneshot(req).await.unwrap_or_else(|e| match e {});
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
    }

    fn post(uri: &str, body: &str) -> http::Request<Body> {
        http::Request::builder()
            .method("POST")
            .uri(uri)
            .header("authorization", "Bearer secret")
            .body(Body::from(body.to_string()))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn get(uri: &str) -> http::Request<Body> {
        http::Request::builder().uri(uri).body(Body::empty()).unwrap_or_else(|e| panic!("{e}"))
    }

    #[tokio::test]
    async fn a_follower_passes_every_call_on_to_the_leader_with_its_token_and_body() {
        let leader = serve(echo()).await;
        let (_tx, rx) = watch::channel(Some(leader));
        let replica = Replica::new("127.0.0.1:1".into(), rx, CancellationToken::new(), None);
        let app = replica.router();
        let (status, headers, body) = call(&app, post("/v1/sandboxes/sb-1/exec?x=1", r#"{"argv":["true"]}"#)).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert_eq!(headers.get("x-leader").and_then(|v| v.to_str().ok()), Some("echo"));
        assert_eq!(
            body, r#"POST /v1/sandboxes/sb-1/exec?x=1 auth=Bearer secret forwarded=1 body={"argv":["true"]}"#,
            "the method, path, query, token and body reach the leader, marked as passed on once"
        );
        // Its own health and readiness, and metrics that say it does not lead.
        let (status, _, body) = call(&app, get("/readyz")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (_, _, body) = call(&app, get("/metrics")).await;
        assert_eq!(body, "sandman_replica_leading 0\n");
    }

    #[tokio::test]
    async fn without_a_reachable_leader_a_call_answers_503_with_retry_after() {
        let (tx, rx) = watch::channel(None);
        let draining = CancellationToken::new();
        let replica = Replica::new("127.0.0.1:1".into(), rx, draining.clone(), None);
        let app = replica.router();
        let unavailable = |(status, headers, body): (StatusCode, http::HeaderMap, String)| {
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
            assert_eq!(headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"), "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
            assert_eq!(v["error"]["code"], "unavailable", "{body}");
            v["error"]["message"].as_str().unwrap_or_default().to_string()
        };
        // Nobody leads yet: not ready, and calls are refused for the client to retry.
        assert!(unavailable(call(&app, post("/v1/sandboxes", "{}")).await).contains("no replica leads"));
        unavailable(call(&app, get("/readyz")).await);
        // A leader that does not answer (nothing listens at its address).
        let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = gone.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        drop(gone);
        tx.send_replace(Some(addr.clone()));
        assert!(unavailable(call(&app, post("/v1/sandboxes", "{}")).await).contains(&addr));
        // The Lease names this replica, which is still taking over.
        tx.send_replace(Some("127.0.0.1:1".into()));
        assert!(unavailable(call(&app, post("/v1/sandboxes", "{}")).await).contains("taking over"));
        // A call another replica passed on is never passed on again (two replicas that each
        // believe the other leads would bounce it for ever).
        let mut passed = post("/v1/sandboxes", "{}");
        passed.headers_mut().insert(FORWARDED, http::HeaderValue::from_static("1"));
        assert!(unavailable(call(&app, passed).await).contains("does not lead"));
        // Shutting down: not ready, while calls are still passed on.
        tx.send_replace(Some(serve(echo()).await));
        draining.cancel();
        unavailable(call(&app, get("/readyz")).await);
        assert_eq!(call(&app, post("/v1/jobs", "{}")).await.0, StatusCode::CREATED);
    }

    #[tokio::test]
    async fn once_it_leads_a_replica_serves_the_whole_api_itself() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let settings = Settings { create_rate: None, daemons: Daemons::Absent, ..Settings::new(dir.path().into()) };
        let provider = crate::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.path().join("x"))));
        let service = Service::new(settings, provider, "t".into());
        service.start_background();
        let leader_app =
            router(service.clone(), Limits { request_timeout: Duration::from_secs(30), max_concurrent: 8 });
        // A follower in front of the leader, as the Service would route a client to either.
        let leader = Replica::new("127.0.0.1:2".into(), watch::channel(None).1, CancellationToken::new(), None);
        let _ = leader.leading.set((leader_app, service));
        let leader_addr = serve(leader.router()).await;
        let follower =
            Replica::new("127.0.0.1:3".into(), watch::channel(Some(leader_addr)).1, CancellationToken::new(), None);
        let app = follower.router();
        let create = || {
            http::Request::builder()
                .method("POST")
                .uri("/v1/sandboxes")
                .header("authorization", "Bearer t")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"image":"img","idempotency_key":"k1"}"#))
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let (status, _, body) = call(&app, create()).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let made: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(made["state"], "ready", "{body}");
        // The same key through the leader itself: the same sandbox.
        let (_, _, body) = call(&Arc::clone(&leader).router(), create()).await;
        let same: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(same["id"], made["id"]);
        // A wrong token is refused by the leader (the follower passes the call on as it is).
        let wrong = http::Request::builder()
            .uri("/v1/sandboxes")
            .header("authorization", "Bearer not-t")
            .body(Body::empty())
            .unwrap_or_else(|e| panic!("{e}"));
        let (status, _, _) = call(&app, wrong).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
}

#[cfg(test)]
mod upgrade_tests {
    use axum::Router;
    use axum::extract::Request;
    use axum::response::{IntoResponse, Response};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::watch;
    use tokio_util::sync::CancellationToken;

    use super::Replica;

    /// A leader whose every call switches protocols and then echoes what it reads.
    fn echoing_leader() -> Router {
        Router::new().fallback(|mut req: Request| async move {
            let upgrade = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(upgraded) = upgrade.await else { return };
                let mut io = hyper_util::rt::TokioIo::new(upgraded);
                let mut buf = [0u8; 64];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
            let resp: Response = (
                http::StatusCode::SWITCHING_PROTOCOLS,
                [(http::header::CONNECTION, "upgrade"), (http::header::UPGRADE, "websocket")],
            )
                .into_response();
            resp
        })
    }

    async fn serve(app: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// A WebSocket to a sandbox's port, sent to a follower: the follower passes the upgrade on
    /// and splices the two connections, so bytes go through both ways.
    #[tokio::test]
    async fn a_follower_passes_an_upgrade_on_and_splices_the_connections() {
        let leader = serve(echoing_leader()).await;
        let follower =
            Replica::new("127.0.0.1:1".into(), watch::channel(Some(leader)).1, CancellationToken::new(), None);
        let addr = serve(follower.router()).await;
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap_or_else(|e| panic!("{e}"));
        conn.write_all(
            b"GET /v1/sandboxes/sb-1/ports/8080/ws HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            conn.read_exact(&mut byte).await.unwrap_or_else(|e| panic!("{e}"));
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 101"), "{head}");
        assert!(head.contains("upgrade: websocket"), "{head}");
        conn.write_all(b"ping through two hops").await.unwrap_or_else(|e| panic!("{e}"));
        let mut echoed = [0u8; 21];
        tokio::time::timeout(std::time::Duration::from_secs(30), conn.read_exact(&mut echoed))
            .await
            .unwrap_or_else(|_| panic!("nothing came back through the spliced connections"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&echoed, b"ping through two hops");
    }
}

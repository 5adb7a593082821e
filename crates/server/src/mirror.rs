//! Proxied calls served by every replica (`--leader-election`): the leader streams the route of
//! each ready sandbox (its daemon's endpoint and token, the claimer's environment, its default
//! user) to the followers, and a follower passes a sandbox's daemon calls (`/v1/sandboxes/{id}/…`:
//! exec, files, sessions, ports) straight to the daemon, proving its identity on every new
//! connection as the leader does, without a hop through the leader. Twice a second it tells the
//! leader which sandboxes it called (and which are still in a call), which count as activity for
//! their leases and idle timeouts; a daemon that failed its identity proof is told too, and the
//! leader ends the sandbox as it would have. Everything else (creates, releases, pauses, a call
//! on a sandbox the follower has no route for) goes to the leader.
//!
//! The leader's table is the only authority: a follower's copy only ever names a sandbox the
//! leader had ready, and a stale route cannot reach the wrong daemon, since each new connection
//! must prove the sandbox's token. A follower keeps its routes while no replica leads, so a
//! leader's death does not stop calls to sandboxes that are running; the next leader's first
//! answer replaces them whole (docs/design.md#replicas).
//!
//! The stream (`GET /v1/replicas/routes`, NDJSON, the server's token): `"reset"`, then a `set`
//! line for each route, then `"synced"`; after it, `set` and `unset` as sandboxes change, and
//! `"keepalive"` when nothing else was sent for 15 s. A leader whose follower fell behind sends
//! the whole table again, from `"reset"`. Activity: `POST /v1/replicas/activity`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::header;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use sandman_wire::server::{EventKind, SandboxState};
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, broadcast, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::{self, DaemonClient, Identities};
use crate::error::ServerError;
use crate::proxy::{self, Failed, Hop, Route, daemon_call};
use crate::service::{BODY_BUDGET_KIB, Service};

/// How often a follower reports its calls to the leader.
/// Half the shortest lease (1 s): a call under way through a follower renews even that in time.
pub const REPORT_EVERY: Duration = Duration::from_millis(500);
/// A leader's stream that sent nothing (not even a keep-alive) for this long is dead.
const SILENT_FOR: Duration = Duration::from_secs(45);
/// The longest line of the routes stream read.
const MAX_LINE: usize = 1 << 20;
/// The most sandbox ids one activity report carries; more wait for the next.
pub const MAX_REPORT: usize = 50_000;

/// One line of the routes stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Line {
    /// The whole table follows, ending with `Synced`.
    Reset,
    Set {
        id: String,
        route: Route,
    },
    Unset {
        id: String,
    },
    /// The table sent since `Reset` is whole.
    Synced,
    Keepalive,
}

/// What a follower tells the leader twice a second.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Activity {
    /// Sandboxes with a call since the last report, or one still under way.
    #[serde(default)]
    pub called: Vec<String>,
    /// Sandboxes whose daemon failed its identity proof on a new connection, and why.
    #[serde(default)]
    pub unproven: Vec<(String, String)>,
}

/// The leader's side: the routes stream and the activity reports, behind the server's token.
pub fn leader_routes(service: Arc<Service>) -> Router {
    Router::new()
        .route("/v1/replicas/routes", get(stream_routes))
        .route("/v1/replicas/activity", post(take_activity))
        .route_layer(axum::middleware::from_fn_with_state(service.clone(), crate::api::authorize))
        .with_state(service)
}

/// Lines buffered for one follower before the leader waits for it.
const STREAM_BUFFER: usize = 1024;

async fn stream_routes(State(service): State<Arc<Service>>) -> Response {
    // Subscribe before reading the table, so that no change falls between the two.
    let mut live = service.events.subscribe();
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let cancel = service.cancel.clone();
    let me = service.clone();
    service.tasks.spawn(async move {
        if !send_table(&me, &tx).await {
            return;
        }
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                () = tx.closed() => return,
                e = live.recv() => e,
            };
            let line = match event {
                Ok(e) if e.kind == EventKind::Sandbox && e.state.is_some() && !e.sandbox.is_empty() => {
                    match me.route(&e.sandbox) {
                        Some(route) => Line::Set { id: e.sandbox, route },
                        None => Line::Unset { id: e.sandbox },
                    }
                }
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::info!(missed, "a follower replica's routes fell behind; sending the whole table again");
                    if !send_table(&me, &tx).await {
                        return;
                    }
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if tx.send(line).await.is_err() {
                return;
            }
        }
    });
    sandman_http::ndjson::response(rx, || Line::Keepalive)
}

/// Sends the whole table, from `Reset` to `Synced`; false once the follower has gone.
async fn send_table(service: &Service, tx: &mpsc::Sender<Line>) -> bool {
    if tx.send(Line::Reset).await.is_err() {
        return false;
    }
    for sb in service.snapshot() {
        let Some(route) = service.route(sb.id()) else { continue };
        if tx.send(Line::Set { id: sb.id().to_string(), route }).await.is_err() {
            return false;
        }
    }
    tx.send(Line::Synced).await.is_ok()
}

async fn take_activity(State(service): State<Arc<Service>>, body: Body) -> Response {
    let bytes = match sandman_http::extract::read_limited(body, 8 << 20).await {
        Ok(b) => b,
        Err(e) => return ServerError::Body(e).into_response(),
    };
    let activity: Activity = match serde_json::from_slice(&bytes) {
        Ok(a) => a,
        Err(e) => return ServerError::InvalidArgument(format!("not an activity report: {e}")).into_response(),
    };
    let now = Instant::now();
    for id in activity.called.iter().take(MAX_REPORT) {
        let Ok(sb) = service.get(id) else { continue };
        let mut inner = sb.lock();
        if inner.state == SandboxState::Ready {
            inner.timers.call(now);
            inner.daemon_touched = now;
        }
    }
    for (id, why) in activity.unproven.iter().take(MAX_REPORT) {
        let Ok(sb) = service.get(id) else { continue };
        let why = sandman_provider::identity::Unproven::Refused(format!("on a follower replica's connection: {why}"));
        service.distrust(&sb, &why).await;
    }
    http::StatusCode::NO_CONTENT.into_response()
}

/// A follower's copy of the leader's routes, and what it needs to call daemons itself.
pub struct Mirror {
    /// The server's token: every call must present it, and the follower presents it to the
    /// leader.
    token: String,
    routes: RwLock<HashMap<String, Route>>,
    identities: Arc<Identities>,
    daemons: DaemonClient,
    bodies: Arc<Semaphore>,
    max_output_bytes: u64,
    tasks: TaskTracker,
    report: Mutex<Report>,
    /// Calls passed straight to a daemon.
    direct: AtomicU64,
}

#[derive(Default)]
struct Report {
    in_flight: HashMap<String, u32>,
    called: HashSet<String>,
    unproven: Vec<(String, String)>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror").field("routes", &self.len()).finish_non_exhaustive()
    }
}

impl Mirror {
    /// A mirror presenting `token`, holding a command's output to `max_output_bytes` as the
    /// leader does (`--max-output-bytes`).
    pub fn new(token: String, max_output_bytes: u64) -> Arc<Mirror> {
        let identities = Arc::new(Identities::default());
        Arc::new(Mirror {
            token,
            routes: RwLock::default(),
            daemons: daemon::client(identities.clone()),
            identities,
            bodies: Arc::new(Semaphore::new(BODY_BUDGET_KIB)),
            max_output_bytes,
            tasks: TaskTracker::new(),
            report: Mutex::default(),
            direct: AtomicU64::new(0),
        })
    }

    /// Routes held now.
    pub fn len(&self) -> usize {
        self.routes.read().unwrap_or_else(PoisonError::into_inner).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls passed straight to a daemon so far.
    pub fn direct_calls(&self) -> u64 {
        self.direct.load(Ordering::Relaxed)
    }

    fn route(&self, id: &str) -> Option<Route> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }

    fn set(&self, id: String, route: Route) {
        self.identities.register(&route.endpoint, &route.token);
        let old = self.routes.write().unwrap_or_else(PoisonError::into_inner).insert(id, route.clone());
        if let Some(old) = old.filter(|o| o.endpoint != route.endpoint) {
            self.identities.forget(&old.endpoint, &old.token);
        }
    }

    fn unset(&self, id: &str) {
        let old = self.routes.write().unwrap_or_else(PoisonError::into_inner).remove(id);
        if let Some(old) = old {
            self.identities.forget(&old.endpoint, &old.token);
        }
    }

    /// Replaces the whole table with `table`.
    fn replace(&self, table: HashMap<String, Route>) {
        let mut routes = self.routes.write().unwrap_or_else(PoisonError::into_inner);
        for route in table.values() {
            self.identities.register(&route.endpoint, &route.token);
        }
        for (id, route) in routes.iter() {
            if table.get(id).is_none_or(|r| r.endpoint != route.endpoint) {
                self.identities.forget(&route.endpoint, &route.token);
            }
        }
        *routes = table;
    }

    /// Answers `req` itself when it is a daemon call on a sandbox this replica has a route for;
    /// hands it back otherwise, for the leader.
    pub async fn serve(self: &Arc<Self>, req: Request) -> Result<Response, Request> {
        let Some((id, rest)) = daemon_call(req.uri().path()) else { return Err(req) };
        let Some(route) = self.route(id) else { return Err(req) };
        if !crate::api::token_matches(req.headers(), &self.token) {
            return Ok(ServerError::Unauthorized.into_response());
        }
        let (id, rest) = (id.to_string(), rest.to_string());
        self.direct.fetch_add(1, Ordering::Relaxed);
        let held = Called::new(self.clone(), &id);
        let hop = Hop {
            daemons: &self.daemons,
            bodies: &self.bodies,
            max_output_bytes: self.max_output_bytes,
            tasks: &self.tasks,
        };
        Ok(match proxy::pass(&hop, &id, &route, &rest, req, held).await {
            Ok(resp) => resp,
            Err(Failed::Server(e)) => e.into_response(),
            Err(Failed::Unproven(why)) => {
                // Later calls go to the leader, which ends the sandbox once it is told.
                self.unset(&id);
                self.lock_report().unproven.push((id.clone(), why.to_string()));
                ServerError::Unavailable(format!(
                    "sandbox `{id}`: what answers at its daemon's address did not prove the sandbox's token ({why}); \
                     nothing was sent there"
                ))
                .into_response()
            }
        })
    }

    fn lock_report(&self) -> std::sync::MutexGuard<'_, Report> {
        self.report.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What to tell the leader now: the sandboxes called since the last report and those still
    /// in a call, and the daemons that failed their proof.
    fn take_report(&self) -> Activity {
        let mut report = self.lock_report();
        let mut called: HashSet<String> = std::mem::take(&mut report.called);
        called.extend(report.in_flight.keys().cloned());
        let mut called: Vec<String> = called.into_iter().collect();
        if called.len() > MAX_REPORT {
            // The rest go in the next report.
            report.called.extend(called.drain(MAX_REPORT..));
        }
        Activity { called, unproven: std::mem::take(&mut report.unproven) }
    }

    /// Follows the leader's routes, and reports this replica's calls to it, until `stop`:
    /// reconnects whenever the leader changes or its stream ends. `me` is this replica's
    /// address: while it leads, there is nothing to follow.
    pub async fn follow(
        self: Arc<Self>,
        me: String,
        mut leader: watch::Receiver<Option<String>>,
        client: Client<HttpConnector, Body>,
        stop: CancellationToken,
    ) {
        let reporting = {
            let (mirror, leader, client, stop) = (self.clone(), leader.clone(), client.clone(), stop.clone());
            tokio::spawn(async move { mirror.report_to(leader, client, stop).await })
        };
        // Once nothing can change the leader any more, the last one named is followed.
        let mut watching = true;
        loop {
            let addr = leader.borrow_and_update().clone();
            let following = async {
                match addr.as_deref() {
                    Some(addr) if addr != me => {
                        if let Err(e) = self.read_routes(addr, &client).await {
                            tracing::info!(leader = addr, error = %e, "the leader's routes stream ended; following again");
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    // Nobody leads, or this replica does: wait for a change.
                    _ => std::future::pending().await,
                }
            };
            let changed = async {
                if !watching || leader.changed().await.is_err() {
                    watching = false;
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = stop.cancelled() => break,
                () = changed => {}
                () = following => {}
            }
        }
        let _ = reporting.await;
    }

    /// Reads the routes stream of the leader at `addr` until it ends.
    async fn read_routes(&self, addr: &str, client: &Client<HttpConnector, Body>) -> Result<(), String> {
        let req = http::Request::get(format!("http://{addr}/v1/replicas/routes"))
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            .body(Body::empty())
            .map_err(|e| e.to_string())?;
        let resp = client.request(req).await.map_err(|e| daemon::with_causes(&e))?;
        if !resp.status().is_success() {
            return Err(format!("the leader answered {}", resp.status()));
        }
        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        let mut pending: Option<HashMap<String, Route>> = None;
        loop {
            let frame = match tokio::time::timeout(SILENT_FOR, body.frame()).await {
                Err(_) => return Err(format!("nothing came for {} s", SILENT_FOR.as_secs())),
                Ok(None) => return Ok(()),
                Ok(Some(frame)) => frame.map_err(|e| e.to_string())?,
            };
            let Ok(data) = frame.into_data() else { continue };
            buf.extend_from_slice(&data);
            while let Some(end) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=end).collect();
                let line: Line = serde_json::from_slice(&line).map_err(|e| format!("not a routes line: {e}"))?;
                self.apply(line, &mut pending);
            }
            if buf.len() > MAX_LINE {
                return Err(format!("a line longer than {MAX_LINE} bytes"));
            }
        }
    }

    fn apply(&self, line: Line, pending: &mut Option<HashMap<String, Route>>) {
        match (line, pending.as_mut()) {
            (Line::Reset, _) => *pending = Some(HashMap::new()),
            (Line::Set { id, route }, Some(table)) => {
                table.insert(id, route);
            }
            (Line::Unset { id }, Some(table)) => {
                table.remove(&id);
            }
            (Line::Synced, Some(_)) => {
                if let Some(table) = pending.take() {
                    self.replace(table);
                }
            }
            (Line::Set { id, route }, None) => self.set(id, route),
            (Line::Unset { id }, None) => self.unset(&id),
            (Line::Synced | Line::Keepalive, None) | (Line::Keepalive, Some(_)) => {}
        }
    }

    /// Twice a second, tells the leader what this replica called.
    async fn report_to(
        &self,
        leader: watch::Receiver<Option<String>>,
        client: Client<HttpConnector, Body>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(REPORT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let Some(addr) = leader.borrow().clone() else { continue };
            let report = self.take_report();
            if report.called.is_empty() && report.unproven.is_empty() {
                continue;
            }
            let Ok(body) = serde_json::to_vec(&report) else { continue };
            let req = http::Request::post(format!("http://{addr}/v1/replicas/activity"))
                .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body));
            let Ok(req) = req else { continue };
            match client.request(req).await {
                Ok(resp) if resp.status().is_success() => {}
                // A leader going away: its successor starts every sandbox's timers afresh.
                Ok(resp) => {
                    tracing::info!(leader = addr, status = %resp.status(), "the leader refused an activity report")
                }
                Err(e) => {
                    tracing::info!(leader = addr, error = %daemon::with_causes(&e), "cannot report activity to the leader")
                }
            }
        }
    }
}

/// A call under way on a sandbox, for the next report.
struct Called {
    mirror: Arc<Mirror>,
    id: String,
}

impl Called {
    fn new(mirror: Arc<Mirror>, id: &str) -> Called {
        *mirror.lock_report().in_flight.entry(id.to_string()).or_default() += 1;
        Called { mirror, id: id.to_string() }
    }
}

impl Drop for Called {
    fn drop(&mut self) {
        let mut report = self.mirror.lock_report();
        if let Some(n) = report.in_flight.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                report.in_flight.remove(&self.id);
            }
        }
        report.called.insert(std::mem::take(&mut self.id));
    }
}

#[cfg(test)]
#[path = "mirror_tests.rs"]
mod tests;

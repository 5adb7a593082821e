//! `/v1/sandboxes/{id}/…`: every daemon call, forwarded to the sandbox's daemon with its own
//! token. Bodies stream both ways; nothing is buffered whole, but for one case: the JSON body
//! of a call that starts a command (exec, a process, a session) on a sandbox claimed from a
//! warm pool with an environment of its own, which is read (up to the JSON limit) to merge
//! that environment (and a default user) into it, and the JSON body of `/exec` and a session's
//! `/run`, read to hold its `max_output_bytes` to the server's ceiling. Bodies read whole share one
//! budget ([`Service::hold_body`]), so that many large ones at once are refused rather than held.
//! An HTTP/1.1 upgrade (a WebSocket to a port in the sandbox, `…/ports/{port}/…`) is passed on,
//! and once the daemon answers 101 both connections are spliced. A sandbox's default user is
//! added to the calls that start commands (in their JSON body) and to those that create files
//! (`PUT /files`, `POST /dir`, `PUT /archive`: a `user` query parameter), where they name none.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use http::header::{self, HeaderName};

use sandman_wire::bounds;

use sandman_provider::Endpoint;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::task::TaskTracker;

use crate::daemon;
use crate::error::{ServerError, ServerResult};
use crate::service::{BODY_BUDGET_KIB, Service};

/// Headers that belong to one hop and are not forwarded.
pub(crate) const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

pub async fn forward(
    State(service): State<Arc<Service>>,
    Path((id, rest)): Path<(String, String)>,
    req: Request,
) -> ServerResult<Response> {
    // The call as the client wrote it, percent-encoding kept (`Path` decodes it: a `%20` in a
    // port's path would become a space no URI may hold, a `%2F` a separator).
    let rest = daemon_call(req.uri().path()).map_or(rest, |(_, call)| call.to_string());
    let target = service.call_target_resuming(&id).await?;
    service.metrics.proxied.inc();
    let hop = Hop {
        daemons: &service.daemons,
        bodies: &service.bodies,
        max_output_bytes: service.settings.max_output_bytes,
        tasks: &service.tasks,
    };
    match pass(&hop, &id, &target.route, &rest, req, target.held).await {
        Ok(resp) => Ok(resp),
        Err(Failed::Server(e)) => Err(e),
        // What answered is not the sandbox's daemon: the call was not sent, and the sandbox
        // ends, untrusted; this call answers as every later one will.
        Err(Failed::Unproven(why)) => {
            let sb = service.get(&id)?;
            service.distrust(&sb, &why).await;
            Err(sb.gone_error())
        }
    }
}

/// The sandbox calls the server answers itself (its control routes), never passed to a daemon.
const CONTROL: [&str; 6] = ["keepalive", "pause", "resume", "conditions", "snapshots", "fork"];

/// The sandbox and the daemon call of a path the server passes to a daemon
/// (`/v1/sandboxes/{id}/{call…}`, not one of its own control calls), as written: percent-encoding
/// is kept.
pub(crate) fn daemon_call(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let (id, call) = rest.split_once('/')?;
    if id.is_empty() || call.is_empty() || CONTROL.contains(&call) {
        return None;
    }
    Some((id, call))
}

/// Where a sandbox's proxied calls go and what the server adds to them: its daemon's endpoint
/// and token, the claimer's environment, whether it is an `eval` sandbox (whose commands may not
/// change what eval fixes), and its default user. The leader's table has it
/// ([`Service::call_target`]); a follower replica keeps a copy (`crate::mirror`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Route {
    pub endpoint: Endpoint,
    pub token: String,
    #[serde(default)]
    pub env: Arc<BTreeMap<String, String>>,
    #[serde(default)]
    pub eval: bool,
    #[serde(default)]
    pub user: Option<String>,
}

/// What passing a call on to a daemon uses: the leader's service has one, and so has a follower
/// replica that calls daemons itself.
pub(crate) struct Hop<'a> {
    pub daemons: &'a daemon::DaemonClient,
    /// The budget of bodies read whole ([`hold_body`]).
    pub bodies: &'a Arc<Semaphore>,
    pub max_output_bytes: u64,
    /// Owns the splice of an upgraded connection.
    pub tasks: &'a TaskTracker,
}

/// Why [`pass`] gave no answer of the daemon's.
#[derive(Debug)]
pub(crate) enum Failed {
    Server(ServerError),
    /// A new connection to the daemon failed its identity proof: nothing was sent, and the
    /// sandbox is no longer to be trusted.
    Unproven(sandman_provider::identity::Unproven),
}

impl From<ServerError> for Failed {
    fn from(e: ServerError) -> Self {
        Failed::Server(e)
    }
}

/// Passes `req` (the call `rest` of sandbox `id`) on to the daemon `route` names, with its
/// token, and streams the answer back; `held` lives until the answer has been sent (or, for an
/// upgrade, until the spliced connection closes).
pub(crate) async fn pass<H: Send + Unpin + 'static>(
    hop: &Hop<'_>,
    id: &str,
    route: &Route,
    rest: &str,
    mut req: Request,
    held: H,
) -> Result<Response, Failed> {
    let upgrade = is_upgrade(req.headers());
    let inbound = upgrade.then(|| hyper::upgrade::on(&mut req));
    let query = match (&route.user, creates_files(req.method(), rest)) {
        (Some(user), true) => Some(with_user(req.uri().query(), user)),
        _ => req.uri().query().map(str::to_string),
    };
    let path_and_query = match query {
        Some(q) => format!("/v1/{rest}?{q}"),
        None => format!("/v1/{rest}"),
    };
    let uri = daemon::uri(&route.endpoint, &path_and_query)
        .map_err(|e| ServerError::InvalidArgument(format!("bad path: {e}")))?;
    let (mut parts, body) = req.into_parts();
    let is_post_json = parts.method == http::Method::POST && is_json(&parts.headers);
    let merges = (!route.env.is_empty() || route.eval || route.user.is_some()) && starts_command(rest);
    let holds_output = holds_output(rest);
    let body = if is_post_json && (merges || holds_output) {
        let _held = hold_body(hop.bodies, &parts.headers)?;
        let bytes = sandman_http::extract::read_limited(body, sandman_http::extract::MAX_JSON_BODY)
            .await
            .map_err(ServerError::Body)?;
        if holds_output {
            check_output_cap(&bytes, hop.max_output_bytes)?;
        }
        if !merges {
            Body::from(bytes)
        } else {
            if route.eval {
                check_eval_call(&bytes).map_err(ServerError::InvalidArgument)?;
            }
            parts.headers.remove(header::CONTENT_LENGTH);
            Body::from(merge_defaults(bytes, &route.env, route.user.as_deref()))
        }
    } else {
        body
    };
    let mut out = http::Request::builder().method(parts.method).uri(uri);
    if let Some(headers) = out.headers_mut() {
        for (name, value) in &parts.headers {
            if HOP_BY_HOP.contains(name)
                || name == header::HOST
                || name == header::AUTHORIZATION
                || name.as_str() == "keep-alive"
            {
                continue;
            }
            headers.append(name.clone(), value.clone());
        }
        if let Ok(v) = format!("Bearer {}", route.token).parse() {
            headers.insert(header::AUTHORIZATION, v);
        }
        if upgrade {
            keep_upgrade(&parts.headers, headers);
        }
    }
    let out = out.body(body).map_err(|e| ServerError::Internal(format!("cannot build the daemon request: {e}")))?;
    let mut resp = match hop.daemons.request(out).await {
        Ok(resp) => resp,
        Err(e) => {
            return Err(match daemon::unproven(&e).cloned() {
                Some(why) => Failed::Unproven(why),
                None => Failed::Server(ServerError::Unavailable(format!(
                    "sandbox `{id}` did not answer: {}",
                    daemon::with_causes(&e)
                ))),
            });
        }
    };
    let switching = resp.status() == http::StatusCode::SWITCHING_PROTOCOLS;
    let mut held = Some(held);
    if let (true, Some(inbound)) = (switching, inbound) {
        let outbound = hyper::upgrade::on(&mut resp);
        let held = held.take();
        // Owned by the tracker; it ends when either side closes.
        hop.tasks.spawn(async move {
            // The spliced connection is the call: the lease is held while it lasts.
            let _held = held;
            splice(inbound, outbound).await;
        });
    }
    let (mut parts, body) = resp.into_parts();
    let kept = parts.headers.clone();
    for h in HOP_BY_HOP {
        parts.headers.remove(h);
    }
    if switching {
        keep_upgrade(&kept, &mut parts.headers);
    }
    Ok(Response::from_parts(parts, sandman_http::holding(Body::new(body), held)).into_response())
}

/// A share of the budget `bodies` of bodies the proxy reads whole, for one body of the size its
/// `content-length` says (the JSON limit when it says none), held until the permit is dropped;
/// `503 unavailable` when the budget is spent, rather than memory without bound.
pub(crate) fn hold_body(bodies: &Arc<Semaphore>, headers: &http::HeaderMap) -> ServerResult<OwnedSemaphorePermit> {
    let limit = sandman_http::extract::MAX_JSON_BODY as u64;
    let len = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(limit, |n| n.min(limit));
    let kib = u32::try_from(len.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    Arc::clone(bodies).try_acquire_many_owned(kib).map_err(|_| {
        ServerError::Unavailable(format!(
            "the server holds {} MiB of request bodies at once, its most; retry shortly",
            BODY_BUDGET_KIB / 1024
        ))
    })
}

/// Once both sides of an HTTP/1.1 upgrade have switched, copies bytes both ways until either
/// closes.
pub(crate) async fn splice(inbound: hyper::upgrade::OnUpgrade, outbound: hyper::upgrade::OnUpgrade) {
    let (Ok(client), Ok(server)) = (inbound.await, outbound.await) else { return };
    let _ = tokio::io::copy_bidirectional(
        &mut hyper_util::rt::TokioIo::new(client),
        &mut hyper_util::rt::TokioIo::new(server),
    )
    .await;
}

/// Whether a request asks to switch protocols (`Connection: upgrade` with `Upgrade`).
pub(crate) fn is_upgrade(headers: &http::HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")))
}

/// Puts back `Connection: upgrade` and `Upgrade`, which an upgrade carries across each hop.
pub(crate) fn keep_upgrade(from: &http::HeaderMap, to: &mut http::HeaderMap) {
    to.insert(header::CONNECTION, http::HeaderValue::from_static("upgrade"));
    if let Some(u) = from.get(header::UPGRADE) {
        to.insert(header::UPGRADE, u.clone());
    }
}

/// The daemon calls whose JSON body has an `env` for the command they start.
fn starts_command(call: &str) -> bool {
    matches!(call.trim_end_matches('/'), "exec" | "exec/stream" | "processes" | "sessions")
}

/// The daemon calls that create files, whose `user` query parameter names who owns them.
fn creates_files(method: &http::Method, call: &str) -> bool {
    matches!(
        (method, call.trim_end_matches('/')),
        (&http::Method::PUT, "files" | "archive") | (&http::Method::POST, "dir")
    )
}

/// `query` with `user=<user>` added, unless it names a `user` of its own (which wins, as a
/// command's own `user` does).
fn with_user(query: Option<&str>, user: &str) -> String {
    let query = query.unwrap_or_default();
    if form_urlencoded::parse(query.as_bytes()).any(|(k, _)| k == "user") {
        return query.to_string();
    }
    let user: String = form_urlencoded::Serializer::new(String::new()).append_pair("user", user).finish();
    if query.is_empty() { user } else { format!("{query}&{user}") }
}

/// The daemon calls that hold a command's output until it ends, up to its `max_output_bytes`:
/// `/exec` and a session's `/run` (a streamed exec holds none).
fn holds_output(call: &str) -> bool {
    let call = call.trim_end_matches('/');
    call == "exec" || call.strip_prefix("sessions/").is_some_and(|rest| rest.ends_with("/run"))
}

/// Refuses a `max_output_bytes` over the server's ceiling (`--max-output-bytes`), naming it; a
/// body that is not a JSON object goes on, for the daemon to refuse.
fn check_output_cap(body: &[u8], ceiling: u64) -> ServerResult<()> {
    #[derive(serde::Deserialize)]
    struct Cap {
        max_output_bytes: Option<u64>,
    }
    let Ok(cap) = serde_json::from_slice::<Cap>(body) else { return Ok(()) };
    bounds::MAX_OUTPUT_BYTES
        .up_to(ceiling)
        .check_opt(cap.max_output_bytes)
        .map_err(|e| ServerError::InvalidArgument(format!("{e} (this server's --max-output-bytes)")))
}

fn is_json(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|v| v.trim_start().to_ascii_lowercase().starts_with("application/json"))
}

/// Refuses a command of an `eval` sandbox whose `env` changes what eval fixes (TZ, locale).
fn check_eval_call(body: &[u8]) -> Result<(), String> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else { return Ok(()) };
    let Some(env) = v.get("env").and_then(|e| e.as_object()) else { return Ok(()) };
    let env: BTreeMap<String, String> =
        env.iter().filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string()))).collect();
    crate::conditions::check_eval_env(&env)
}

/// The body with `env` added to its `env` object and `user` as its `user` when it names none, the
/// body's own values winning; a body that is not a JSON object goes on unchanged, for the daemon
/// to refuse.
fn merge_defaults(body: bytes::Bytes, env: &BTreeMap<String, String>, user: Option<&str>) -> bytes::Bytes {
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    if let Some(user) = user
        && obj.get("user").is_none_or(|u| u.is_null())
    {
        obj.insert("user".into(), serde_json::Value::String(user.to_string()));
    }
    if env.is_empty() {
        return serde_json::to_vec(&obj).map(bytes::Bytes::from).unwrap_or(body);
    }
    let slot = obj.entry("env").or_insert_with(|| serde_json::Value::Object(Default::default()));
    let Some(map) = slot.as_object_mut() else { return body };
    for (k, v) in env {
        map.entry(k.clone()).or_insert_with(|| serde_json::Value::String(v.clone()));
    }
    serde_json::to_vec(&obj).map(bytes::Bytes::from).unwrap_or(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimers_env_is_merged_under_the_calls_own() {
        let env = BTreeMap::from([("A".to_string(), "claim".to_string()), ("B".to_string(), "claim".to_string())]);
        let out = merge_defaults(bytes::Bytes::from_static(br#"{"argv":["env"],"env":{"B":"call"}}"#), &env, None);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        assert_eq!(v["env"], serde_json::json!({"A": "claim", "B": "call"}));
        let out = merge_defaults(bytes::Bytes::from_static(br#"{"command":"env"}"#), &env, None);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        assert_eq!(v["env"]["A"], "claim");
        let raw = bytes::Bytes::from_static(b"not json");
        assert_eq!(merge_defaults(raw.clone(), &env, Some("1000")), raw);
        assert!(starts_command("exec/stream") && starts_command("sessions") && !starts_command("sessions/s1/run"));
    }

    #[test]
    fn the_sandboxs_user_is_given_to_calls_that_name_none() {
        let none = BTreeMap::new();
        let out = merge_defaults(bytes::Bytes::from_static(br#"{"argv":["id"]}"#), &none, Some("agent"));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        assert_eq!((v["user"].as_str(), v.get("env")), (Some("agent"), None));
        let out = merge_defaults(bytes::Bytes::from_static(br#"{"argv":["id"],"user":"0"}"#), &none, Some("agent"));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        assert_eq!(v["user"], "0");
        let out = merge_defaults(bytes::Bytes::from_static(br#"{"argv":["id"],"user":null}"#), &none, Some("agent"));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        assert_eq!(v["user"], "agent");
    }

    #[test]
    fn the_sandboxs_user_is_given_to_calls_that_create_files_and_name_none() {
        use http::Method;
        assert!(creates_files(&Method::PUT, "files") && creates_files(&Method::PUT, "archive"));
        assert!(creates_files(&Method::POST, "dir") && creates_files(&Method::POST, "dir/"));
        assert!(!creates_files(&Method::GET, "files") && !creates_files(&Method::GET, "dir"));
        assert!(!creates_files(&Method::DELETE, "files") && !creates_files(&Method::POST, "move"));
        assert_eq!(with_user(Some("path=%2Ftmp%2Fa&mode=644"), "agent"), "path=%2Ftmp%2Fa&mode=644&user=agent");
        assert_eq!(with_user(None, "a b:c"), "user=a+b%3Ac");
        // The call's own user wins, root included.
        assert_eq!(with_user(Some("path=%2Fx&user=0"), "agent"), "path=%2Fx&user=0");
        assert_eq!(with_user(Some("us%65r=0&path=%2Fx"), "agent"), "us%65r=0&path=%2Fx");
    }

    #[test]
    fn an_eval_sandboxs_command_may_not_change_its_timezone_or_locale() {
        assert!(check_eval_call(br#"{"argv":["date"],"env":{"TZ":"UTC","X":"1"}}"#).is_ok());
        assert!(check_eval_call(br#"{"argv":["date"]}"#).is_ok());
        let e = check_eval_call(br#"{"argv":["date"],"env":{"TZ":"Asia/Tokyo"}}"#).err().unwrap_or_default();
        assert!(e.contains("TZ=Asia/Tokyo"), "{e}");
    }
}

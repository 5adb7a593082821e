//! The `sandman` binary against a fake server (axum on 127.0.0.1, canned answers): what it prints
//! on stdout and stderr, and its exit codes.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, RawQuery, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Router};
use serde_json::{Value, json};
use tokio::sync::oneshot;

const TOKEN: &str = "t0ken";
/// A state directory that does not exist, so no token file is found by accident.
const NO_STATE_DIR: &str = "/nonexistent/sandman-cli-test-state";

/// What the fake server saw: uploads, as (query, content type, bytes).
type Uploads = Arc<Mutex<Vec<(String, String, Vec<u8>)>>>;

/// What the fake server saw of pool and job calls: (method, path, body).
type Seen = Arc<Mutex<Vec<(String, String, String)>>>;

/// The fake server, on its own thread and runtime; stopped and joined when dropped.
struct Fake {
    addr: SocketAddr,
    uploads: Uploads,
    seen: Seen,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Fake {
    fn start() -> Fake {
        let uploads = Uploads::default();
        let seen = Seen::default();
        let app = app(Arc::clone(&uploads)).layer(middleware::from_fn_with_state(Arc::clone(&seen), record));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        Fake { addr: addr_rx.recv().unwrap(), uploads, seen, stop: Some(stop), thread: Some(thread) }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The pool and job calls seen so far, taken.
    fn seen(&self) -> Vec<(String, String, String)> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }

    /// Runs `sandman ARGS` against this server with the right token.
    fn sandman(&self, args: &[&str]) -> Run {
        run(Command::new(env!("CARGO_BIN_EXE_sandman")).args(args).env("SANDMAN_URL", self.url()))
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The outcome of one run of the binary.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn run(cmd: &mut Command) -> Run {
    let Output { status, stdout, stderr } = cmd
        .env("SANDMAN_TOKEN", TOKEN)
        .env("SANDMAN_STATE_DIR", NO_STATE_DIR)
        .env_remove("XDG_STATE_HOME")
        .output()
        .unwrap();
    Run { code: status.code(), stdout: String::from_utf8(stdout).unwrap(), stderr: String::from_utf8(stderr).unwrap() }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

fn sandbox(id: &str, state: &str, reason: Option<&str>, job: Option<&str>, age_s: u64) -> Value {
    let mut sb = json!({
        "id": id, "image": "host", "provider": "process", "state": state,
        "profile": "default", "network": "egress", "resources": {},
        "created_at_ms": now_ms() - age_s * 1000, "lease_s": 60
    });
    if let Some(reason) = reason {
        sb["reason"] = json!(reason);
    }
    if let Some(job) = job {
        sb["job"] = json!(job);
    }
    sb
}

fn answer(status: StatusCode, body: Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn error(status: StatusCode, code: &str, message: &str, reason: Option<&str>) -> Response {
    let mut detail = json!({"code": code, "message": message});
    if let Some(reason) = reason {
        detail["reason"] = json!(reason);
    }
    answer(status, json!({ "error": detail }))
}

/// Told when the progress of a create of [`SLOW_IMAGE`] has all been sent to its follower.
type ProgressSent = Arc<tokio::sync::Notify>;

/// An image whose create waits until its pull's progress has been streamed.
const SLOW_IMAGE: &str = "slow:1";

fn app(uploads: Uploads) -> Router {
    Router::new()
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/events", get(follow_progress))
        .route("/v1/sandboxes/{id}", get(get_sandbox).delete(release))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec_stream))
        .route("/v1/sandboxes/{id}/stat", get(stat))
        .route("/v1/sandboxes/{id}/files", put(upload))
        .route("/v1/sandboxes/{id}/archive", put(upload))
        .route("/v1/pools", get(list_pools))
        .route("/v1/pools/{name}", get(get_pool).put(put_pool).delete(delete_pool))
        .route("/v1/jobs/{job}/usage", get(job_usage))
        .layer(middleware::from_fn(authorize))
        .layer(Extension(ProgressSent::default()))
        .with_state(uploads)
}

async fn authorize(req: Request, next: Next) -> Response {
    let auth = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if auth != Some(&format!("Bearer {TOKEN}")) {
        return error(StatusCode::UNAUTHORIZED, "unauthorized", "the token is missing or wrong", None);
    }
    next.run(req).await
}

/// Notes each pool and job call (method, path, body) in [`Seen`], passing the request on.
async fn record(State(seen): State<Seen>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    if !path.starts_with("/v1/pools") && !path.starts_with("/v1/jobs") {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    seen.lock().unwrap().push((parts.method.to_string(), path, text));
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

async fn create(Extension(sent): Extension<ProgressSent>, body: String) -> Response {
    let req: Value = serde_json::from_str(&body).unwrap();
    if req["image"] == SLOW_IMAGE {
        // Ready once the pull's progress has reached the CLI (a moment after it was sent).
        tokio::time::timeout(Duration::from_secs(10), sent.notified()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut sb = sandbox("sb-7", "ready", None, req["job"].as_str(), 0);
    sb["image"] = req["image"].clone();
    if let Some(labels) = req.get("labels") {
        sb["labels"] = labels.clone();
    }
    answer(StatusCode::OK, sb)
}

/// `GET /v1/events?follow=true&idempotency_key=K`: two progress lines of a pull tagged with `K`
/// when `K` starts with `slow-`, else nothing.
async fn follow_progress(Extension(sent): Extension<ProgressSent>, RawQuery(query): RawQuery) -> Response {
    let query = query.unwrap_or_default();
    let key = query.split('&').find_map(|kv| kv.strip_prefix("idempotency_key=")).unwrap().to_owned();
    assert!(query.split('&').any(|kv| kv == "follow=true"), "{query}");
    if !key.starts_with("slow-") {
        let nothing = futures_util::stream::empty::<Result<Bytes, std::io::Error>>();
        return ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(nothing)).into_response();
    }
    let lines: Vec<Result<Bytes, std::io::Error>> = [
        "pulling slow:1: 0/2 layers",
        "pulling slow:1: 1/2 layers, 3/8 MiB",
    ]
    .iter()
    .enumerate()
    .map(|(i, message)| {
        let e = json!({"event": "sandbox", "seq": i + 1, "time_ms": now_ms(), "sandbox": "sb-7", "state": "creating",
                           "message": message, "idempotency_key": key});
        Ok(Bytes::from(format!("{e}\n")))
    })
    .collect();
    let done = futures_util::stream::once(async move {
        sent.notify_one();
        Ok(Bytes::new())
    });
    let body = futures_util::stream::StreamExt::chain(futures_util::stream::iter(lines), done);
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(body)).into_response()
}

async fn list(RawQuery(query): RawQuery) -> Response {
    assert_eq!(query, None);
    let sandboxes = vec![
        sandbox("sb-1", "ready", None, Some("j"), 3600),
        sandbox("sb-2", "gone", Some("lease_expired"), None, 120),
    ];
    answer(StatusCode::OK, json!({ "sandboxes": sandboxes }))
}

async fn get_sandbox(UrlPath(id): UrlPath<String>) -> Response {
    answer(StatusCode::OK, sandbox(&id, "ready", None, None, 5))
}

async fn release(UrlPath(id): UrlPath<String>) -> Response {
    match id.as_str() {
        "sb-gone" => error(StatusCode::GONE, "gone", "sandbox `sb-gone` is gone", Some("lease_expired")),
        "sb-broken" => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the provider failed", None),
        _ => answer(StatusCode::OK, sandbox(&id, "releasing", Some("released"), None, 5)),
    }
}

/// Echoes the argv on stdout, writes to stderr, exits 3.
async fn exec_stream(body: String) -> Response {
    let req: Value = serde_json::from_str(&body).unwrap();
    let argv: Vec<&str> = req["argv"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let lines = [
        json!({"event": "started", "pid": 42}),
        json!({"event": "stdout", "data": format!("{}\n", argv.join("|"))}),
        json!({"event": "keepalive"}),
        json!({"event": "stderr", "data": "warning from the command\n"}),
        json!({"event": "exit", "exit_code": 3, "signal": null, "timed_out": false, "duration_ms": 7,
               "usage": {"cpu_user_ms": 0, "cpu_system_ms": 0, "max_rss_kib": 0},
               "stdout_truncated": false, "stderr_truncated": false}),
    ];
    let chunks: Vec<Result<Bytes, std::io::Error>> = lines.iter().map(|l| Ok(Bytes::from(format!("{l}\n")))).collect();
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(futures_util::stream::iter(chunks)))
        .into_response()
}

async fn stat(RawQuery(query): RawQuery) -> Response {
    let query = query.unwrap_or_default();
    if query == "path=%2Fwork" {
        let stat = json!({"path": "/work", "kind": "dir", "size": 0, "mode": 493, "uid": 0, "gid": 0, "mtime_ms": 0});
        return answer(StatusCode::OK, stat);
    }
    error(StatusCode::NOT_FOUND, "not_found", "no such file", None)
}

async fn upload(
    State(uploads): State<Uploads>,
    RawQuery(query): RawQuery,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let size = body.len();
    let tar = content_type == "application/x-tar";
    uploads.lock().unwrap().push((query.unwrap_or_default(), content_type, body.to_vec()));
    if tar {
        answer(StatusCode::OK, json!({"path": "/work/d", "entries": 3, "bytes": 11}))
    } else {
        answer(
            StatusCode::OK,
            json!({"path": "/work/f", "kind": "file", "size": size, "mode": 420, "uid": 0, "gid": 0, "mtime_ms": 0}),
        )
    }
}

/// `warm`: a fixed-size pool whose refills fail; `auto`: an autoscaled one.
fn pool(name: &str) -> Option<Value> {
    match name {
        "warm" => Some(json!({
            "name": "warm", "spec": {"image": "host", "min_ready": 2, "resources": {}, "profile": "default",
                                     "network": "egress"},
            "ready": 1, "creating": 1, "claimed": 3, "claims": 40, "target": 2,
            "last_error": "setup failed: exit 1"
        })),
        "auto" => Some(json!({
            "name": "auto", "spec": {"image": "py:3.12", "min_ready": 1, "max": 20, "autoscale": true,
                                     "resources": {"cpu": 1.0, "memory": "1Gi"}, "profile": "eval",
                                     "network": "none", "setup": ["pip install -e ."], "lease_s": 300},
            "ready": 11, "creating": 1, "claimed": 0, "claims": 1234, "target": 12,
            "claim_rate": 0.8, "refill_seconds": 15.0
        })),
        _ => None,
    }
}

fn no_pool(name: &str) -> Response {
    error(StatusCode::NOT_FOUND, "not_found", &format!("no pool `{name}`"), None)
}

async fn list_pools() -> Response {
    answer(StatusCode::OK, json!({"pools": [pool("warm"), pool("auto")]}))
}

async fn get_pool(UrlPath(name): UrlPath<String>) -> Response {
    pool(&name).map_or_else(|| no_pool(&name), |p| answer(StatusCode::OK, p))
}

/// Answers the pool as just made: its spec, `min_ready` being created.
async fn put_pool(UrlPath(name): UrlPath<String>, body: String) -> Response {
    let spec: sandman_wire::server::PoolSpec = serde_json::from_str(&body).unwrap();
    let mut made = json!({"name": name, "spec": spec, "ready": 0, "creating": spec.min_ready, "claimed": 0,
                          "claims": 0, "target": spec.min_ready});
    if spec.autoscale {
        made["claim_rate"] = json!(0.0);
    }
    answer(StatusCode::OK, made)
}

async fn delete_pool(UrlPath(name): UrlPath<String>) -> Response {
    pool(&name).map_or_else(|| no_pool(&name), |p| answer(StatusCode::OK, p))
}

async fn job_usage(UrlPath(job): UrlPath<String>) -> Response {
    if job != "train-7" {
        return error(StatusCode::NOT_FOUND, "not_found", &format!("no job `{job}`"), None);
    }
    answer(
        StatusCode::OK,
        json!({"job": "train-7", "sandboxes": 12, "live": 3, "by_reason": {"released": 10, "lease_expired": 2},
               "sandbox_seconds": 3600.26, "cpu_seconds": 812.5, "with_usage": 12, "peak_memory_kib": 1572864}),
    )
}

#[test]
fn pool_put_sends_the_spec_and_shows_the_pool() {
    let fake = Fake::start();
    let out = fake.sandman(&["pool", "put", "warm", "host", "--min-ready", "2"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stdout,
        "pool:     warm\nimage:    host\nprofile:  default\nnetwork:  egress\nlease:    the server's default\n\
         size:     min ready 2, max 2\ntarget:   2\nready:    0\ncreating: 2\nclaimed:  0\nclaims:   0\n"
    );
    let (method, path, body) = fake.seen().pop().unwrap();
    assert_eq!((method.as_str(), path.as_str()), ("PUT", "/v1/pools/warm"));
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body,
        json!({"image": "host", "resources": {}, "profile": "default", "network": "egress", "min_ready": 2})
    );

    let out = fake.sandman(&[
        "pool",
        "put",
        "auto",
        "py:3.12",
        "--min-ready",
        "1",
        "--max",
        "20",
        "--autoscale",
        "--cpu",
        "1",
        "--memory",
        "1Gi",
        "--profile",
        "eval",
        "--network",
        "none",
        "-e",
        "K=V",
        "--setup",
        "pip install -e .",
        "--lease",
        "300",
        "--provider",
        "docker",
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let (method, path, body) = fake.seen().pop().unwrap();
    assert_eq!((method.as_str(), path.as_str()), ("PUT", "/v1/pools/auto"));
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body,
        json!({"image": "py:3.12", "provider": "docker", "resources": {"cpu": 1.0, "memory": "1Gi"},
               "profile": "eval", "network": "none", "env": {"K": "V"}, "min_ready": 1, "max": 20,
               "setup": ["pip install -e ."], "lease_s": 300, "autoscale": true})
    );
    let made: sandman_wire::server::Pool = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!((made.name.as_str(), made.spec.autoscale, made.claim_rate), ("auto", true, Some(0.0)));
}

#[test]
fn pool_ls_shows_targets_demand_and_errors() {
    let fake = Fake::start();
    let out = fake.sandman(&["pool", "ls"]);
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
    assert_eq!(
        out.stdout,
        "NAME  IMAGE    READY  CREATING  CLAIMED  TARGET     CLAIMS  DEMAND                     ERROR\n\
         warm  host     1      1         3        2          40      -                          setup failed: exit 1\n\
         auto  py:3.12  11     1         0        12 (auto)  1234    0.8 claims/s × 15s refill  -\n"
    );
    assert_eq!(fake.seen(), [("GET".to_owned(), "/v1/pools".to_owned(), String::new())]);
    let out = fake.sandman(&["pool", "ls", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let pools: Vec<sandman_wire::server::Pool> = serde_json::from_str(&out.stdout).unwrap();
    let expected: Vec<sandman_wire::server::Pool> =
        [pool("warm"), pool("auto")].into_iter().map(|p| serde_json::from_value(p.unwrap()).unwrap()).collect();
    assert_eq!(pools, expected);
}

#[test]
fn pool_get_shows_one_pool() {
    let fake = Fake::start();
    let out = fake.sandman(&["pool", "get", "auto"]);
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
    assert_eq!(
        out.stdout,
        "pool:      auto\nimage:     py:3.12\nprofile:   eval\nnetwork:   none\nresources: cpu=1 memory=1Gi\n\
         setup:     pip install -e .\nlease:     300s\nsize:      min ready 1, max 20, autoscaled\n\
         target:    12 (auto)\ndemand:    0.8 claims/s × 15s refill\nready:     11\ncreating:  1\n\
         claimed:   0\nclaims:    1234\n"
    );
    assert_eq!(fake.seen(), [("GET".to_owned(), "/v1/pools/auto".to_owned(), String::new())]);
    let out = fake.sandman(&["pool", "get", "warm"]);
    assert!(out.stdout.ends_with("claims:   40\nerror:    setup failed: exit 1\n"), "{}", out.stdout);
    let out = fake.sandman(&["pool", "get", "warm", "--json"]);
    let got: sandman_wire::server::Pool = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(got, serde_json::from_value(pool("warm").unwrap()).unwrap());
}

#[test]
fn pool_rm_says_what_it_released() {
    let fake = Fake::start();
    let out = fake.sandman(&["pool", "rm", "warm"]);
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
    assert_eq!(
        out.stdout,
        "pool `warm`: released 2 unclaimed sandboxes (1 ready, 1 creating); 3 claimed sandboxes left to their \
         claimers\n"
    );
    assert_eq!(fake.seen(), [("DELETE".to_owned(), "/v1/pools/warm".to_owned(), String::new())]);
}

#[test]
fn a_missing_pool_is_not_found() {
    let fake = Fake::start();
    // Showing it is an error, as `sandman get` of an unknown sandbox is.
    let out = fake.sandman(&["pool", "get", "nope"]);
    assert_eq!((out.code, out.stdout.as_str(), out.stderr.as_str()), (Some(2), "", "error: no pool `nope`\n"));
    // Removing it is a clean "no", as `sandman rm` of an unknown sandbox is.
    let out = fake.sandman(&["pool", "rm", "nope"]);
    assert_eq!((out.code, out.stdout.as_str(), out.stderr.as_str()), (Some(1), "", "error: no pool `nope`\n"));
    assert_eq!(
        fake.seen(),
        [
            ("GET".to_owned(), "/v1/pools/nope".to_owned(), String::new()),
            ("DELETE".to_owned(), "/v1/pools/nope".to_owned(), String::new())
        ]
    );
}

#[test]
fn job_usage_shows_the_sums() {
    let fake = Fake::start();
    let out = fake.sandman(&["job", "usage", "train-7"]);
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
    assert_eq!(
        out.stdout,
        "job:             train-7\nended:           12\nlive:            3\n\
         by reason:       lease_expired=2 released=10\nsandbox-seconds: 3600.3\ncpu-seconds:     812.5\n\
         peak memory:     1.5 GiB\n"
    );
    assert_eq!(fake.seen(), [("GET".to_owned(), "/v1/jobs/train-7/usage".to_owned(), String::new())]);
    let out = fake.sandman(&["job", "usage", "train-7", "--json"]);
    let usage: sandman_wire::server::JobUsage = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!((usage.sandboxes, usage.live, usage.peak_memory_kib), (12, 3, Some(1_572_864)));
    assert_eq!(usage.by_reason.get("lease_expired"), Some(&2));
    let out = fake.sandman(&["job", "usage", "nope"]);
    assert_eq!((out.code, out.stderr.as_str()), (Some(2), "error: no job `nope`\n"));
}

#[test]
fn create_prints_the_id() {
    let fake = Fake::start();
    let out = fake.sandman(&["create", "host", "--job", "j", "--label", "a=b"]);
    assert_eq!((out.code, out.stdout.as_str(), out.stderr.as_str()), (Some(0), "sb-7\n", ""));

    let out = fake.sandman(&["create", "host", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let sb: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!((sb["id"].as_str(), sb["state"].as_str()), (Some("sb-7"), Some("ready")));
}

#[test]
fn create_and_run_show_the_pulls_progress_on_stderr() {
    let fake = Fake::start();
    let progress = "pulling slow:1: 0/2 layers\npulling slow:1: 1/2 layers, 3/8 MiB\n";
    let out = fake.sandman(&["create", SLOW_IMAGE, "--idempotency-key", "slow-1"]);
    assert_eq!((out.code, out.stdout.as_str(), out.stderr.as_str()), (Some(0), "sb-7\n", progress));

    let out = fake.sandman(&["run", SLOW_IMAGE, "--idempotency-key", "slow-2", "--", "echo", "hi"]);
    assert_eq!((out.code, out.stdout.as_str()), (Some(3), "echo|hi\n"), "{out:?}");
    assert_eq!(out.stderr, format!("{progress}warning from the command\n"));
}

#[test]
fn exec_streams_output_and_exits_with_the_command_code() {
    let fake = Fake::start();
    let out = fake.sandman(&["exec", "sb-1", "--", "sh", "-c", "echo hi; exit 3"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(out.stdout, "sh|-c|echo hi; exit 3\n");
    assert_eq!(out.stderr, "warning from the command\n");
}

#[test]
fn ls_quiet_prints_only_the_ids() {
    let fake = Fake::start();
    let out = fake.sandman(&["ls", "-q"]);
    assert_eq!((out.code, out.stdout.as_str()), (Some(0), "sb-1\nsb-2\n"), "{out:?}");
}

#[test]
fn ls_shows_a_table_or_json() {
    let fake = Fake::start();
    let out = fake.sandman(&["ls"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stdout,
        "ID    IMAGE  STATE  REASON         JOB  AGE\n\
         sb-1  host   ready  -              j    1h\n\
         sb-2  host   gone   lease_expired  -    2m\n"
    );
    let out = fake.sandman(&["ls", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let list: Vec<Value> = serde_json::from_str(&out.stdout).unwrap();
    let ids: Vec<&str> = list.iter().map(|s| s["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["sb-1", "sb-2"]);
    assert_eq!(list[1]["reason"], "lease_expired");
}

#[test]
fn rm_of_a_gone_sandbox_is_a_clean_no() {
    let fake = Fake::start();
    let out = fake.sandman(&["rm", "sb-1", "sb-gone"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_eq!(out.stdout, "sb-1\n");
    assert_eq!(
        out.stderr,
        "error: sandbox `sb-gone` is gone (lease_expired)\n\
         hint: a sandbox is reclaimed when its lease lapses: renew it with `sandman keepalive` or `sandman job \
         heartbeat`, or create it with a longer `--lease`\n"
    );
    // Any other failure is an error.
    let out = fake.sandman(&["rm", "sb-gone", "sb-broken"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.ends_with("error: the provider failed\n"), "{}", out.stderr);
}

#[test]
fn unauthorized_hints_at_the_token() {
    let fake = Fake::start();
    let out = fake.sandman(&["ls", "--token", "wrong"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert_eq!(out.stdout, "");
    assert_eq!(
        out.stderr,
        format!(
            "error: the token is missing or wrong\n\
             hint: set SANDMAN_TOKEN (or `--token`) to the server's token, or point SANDMAN_STATE_DIR at the \
             server's state directory, where it writes its token (read from `{NO_STATE_DIR}/token`)\n"
        )
    );
}

#[test]
fn the_token_file_of_the_state_dir_is_used_when_no_token_is_given() {
    let fake = Fake::start();
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let bare = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandman"));
        cmd.arg("ls").env("SANDMAN_URL", fake.url()).env("SANDMAN_STATE_DIR", state_dir);
        cmd.env_remove("SANDMAN_TOKEN").env_remove("XDG_STATE_HOME");
        cmd
    };
    let out = bare().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with(&format!(
            "error: no token: SANDMAN_TOKEN is unset and there is no token file at `{state_dir}/token`\nhint: set"
        )),
        "{stderr}"
    );
    std::fs::write(Path::new(state_dir).join("token"), format!("{TOKEN}\n")).unwrap();
    let out = bare().output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn connection_refused_is_tried_again_then_hints_at_serve() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let out = run(Command::new(env!("CARGO_BIN_EXE_sandman")).args([
        "ls",
        "--url",
        &format!("http://{addr}"),
        "--retries",
        "2",
        "--retry-deadline",
        "60",
    ]));
    assert_eq!(out.code, Some(2), "{out:?}");
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(lines.first().copied(), Some("error: GET /v1/sandboxes failed after 3 attempts"), "{}", out.stderr);
    assert_eq!(
        lines.get(1).copied(),
        Some(format!("  Caused by: could not reach the server at http://{addr}").as_str())
    );
    assert!(lines.iter().any(|l| l.starts_with("  Caused by: ") && l.contains("refused")), "{}", out.stderr);
    assert_eq!(
        lines.last().copied(),
        Some(
            "hint: no server is listening there: start one with `sandman serve`, or point SANDMAN_URL (or `--url`) \
             at it"
        )
    );
}

#[test]
fn cp_uploads_a_file_and_a_directory() {
    let fake = Fake::start();
    let local = tempfile::tempdir().unwrap();
    let file = local.path().join("data.bin");
    let content: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(&file, &content).unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    // Into an existing directory: the file keeps its name.
    let out = fake.sandman(&["cp", file.to_str().unwrap(), "sb-1:/work"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stderr, "Copied 293.0 KiB to sb-1:/work/data.bin\n");
    let dir = local.path().join("d");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("sub/hello.txt"), "hello world").unwrap();
    let out = fake.sandman(&["cp", dir.to_str().unwrap(), "sb-1:/new"]);
    assert_eq!(out.code, Some(0), "{out:?}");

    let uploads = fake.uploads.lock().unwrap().clone();
    assert_eq!(uploads.len(), 2);
    let (query, content_type, bytes) = &uploads[0];
    assert_eq!(query, "path=%2Fwork%2Fdata.bin&mode=644");
    assert_eq!(content_type, "application/octet-stream");
    assert!(bytes == &content, "the uploaded file differs");
    let (query, content_type, bytes) = &uploads[1];
    assert_eq!((query.as_str(), content_type.as_str()), ("path=%2Fnew", "application/x-tar"));
    let mut archive = tar::Archive::new(&bytes[..]);
    let names: Vec<String> =
        archive.entries().unwrap().map(|e| e.unwrap().path().unwrap().display().to_string()).collect();
    assert_eq!(names, ["sub", "sub/hello.txt"]);
}

#[test]
fn usage_errors_exit_2() {
    let out = run(Command::new(env!("CARGO_BIN_EXE_sandman")).args(["exec", "sb-1"]));
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.starts_with("error:"), "{}", out.stderr);
}

//! Test harness: the recorded fixtures, and a mocked API server (`tower_test::mock` behind
//! `kube::Client::new`) that answers each request through a route the test gives, with whole
//! bodies or with watch streams the test feeds line by line.
#![allow(dead_code, clippy::unwrap_used, clippy::panic, clippy::expect_used)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

pub const NAMESPACE: &str = "sandman-fixtures";

/// A recorded fixture file, as text.
pub fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read fixture {path}: {e}"))
}

/// A recorded JSON fixture, parsed.
pub fn json(name: &str) -> Value {
    serde_json::from_str(&fixture(name)).unwrap_or_else(|e| panic!("fixture {name} is not JSON: {e}"))
}

/// A recorded pod, parsed into the typed Pod.
pub fn pod(name: &str) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(json(name)).unwrap_or_else(|e| panic!("fixture {name} is not a Pod: {e}"))
}

/// The response recorded in a `.http` file: status, headers and body.
pub fn recorded_response(name: &str) -> (StatusCode, Vec<(String, String)>, String) {
    let text = fixture(name);
    let start = text.find("\nHTTP/1.1 ").map(|i| i + 1).unwrap_or_else(|| panic!("{name} has no response"));
    let response = &text[start..];
    let (head, body) = response.split_once("\n\n").unwrap_or((response, ""));
    let mut lines = head.lines();
    let status_line = lines.next().unwrap();
    let code: u16 = status_line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers =
        lines.filter_map(|l| l.split_once(": ")).map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    (StatusCode::from_u16(code).unwrap(), headers, body.to_string())
}

/// A watch event line.
pub fn event(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&serde_json::json!({"type": kind, "object": object})).unwrap();
    line.push(b'\n');
    Bytes::from(line)
}

pub type MockBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A request the mock saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
    /// The request's `Content-Type` (a patch's kind: merge, strategic, apply).
    pub content_type: Option<String>,
    /// The request's `Accept` (metadata only: `as=PartialObjectMetadataList`).
    pub accept: Option<String>,
    pub body: Bytes,
    pub at: Instant,
}

impl Seen {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn is_watch(&self) -> bool {
        self.query.get("watch").is_some_and(|w| w == "true")
    }

    pub fn is_write(&self) -> bool {
        matches!(self.method.as_str(), "POST" | "PUT" | "PATCH" | "DELETE")
    }
}

/// What the route answers.
pub enum Reply {
    Json(StatusCode, Value),
    Raw(StatusCode, Vec<(String, String)>, String),
    /// A watch: 200, then whatever is sent on the channel; the stream ends when it is dropped.
    Stream(mpsc::Receiver<Bytes>),
}

pub fn ok(v: Value) -> Reply {
    Reply::Json(StatusCode::OK, v)
}

fn respond(reply: Reply) -> Response<MockBody> {
    match reply {
        Reply::Json(status, v) => {
            let body = Full::new(Bytes::from(serde_json::to_vec(&v).unwrap())).map_err(|e| match e {}).boxed_unsync();
            Response::builder().status(status).header("content-type", "application/json").body(body).unwrap()
        }
        Reply::Raw(status, headers, body) => {
            let mut b = Response::builder().status(status);
            for (k, v) in headers {
                if !k.eq_ignore_ascii_case("content-length") && !k.eq_ignore_ascii_case("transfer-encoding") {
                    b = b.header(k, v);
                }
            }
            b.body(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed_unsync()).unwrap()
        }
        Reply::Stream(rx) => {
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|b| (Ok::<_, std::io::Error>(Frame::data(b)), rx))
            });
            let body = StreamBody::new(stream).boxed_unsync();
            Response::builder().status(200).header("content-type", "application/json").body(body).unwrap()
        }
    }
}

/// The mocked API server: every request is logged, then answered by the route.
pub struct Mock {
    pub log: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Mock {
    pub fn seen(&self) -> Vec<Seen> {
        self.log.lock().unwrap().clone()
    }

    pub fn writes(&self) -> Vec<Seen> {
        self.seen().into_iter().filter(Seen::is_write).collect()
    }

    /// Waits (polling the log every millisecond) until `f` holds for what was seen.
    pub async fn until(&self, what: &str, f: impl Fn(&[Seen]) -> bool) {
        let wait = async {
            loop {
                if f(&self.seen()) {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        };
        if tokio::time::timeout(std::time::Duration::from_secs(30), wait).await.is_err() {
            panic!(
                "timed out waiting for {what}; seen: {:#?}",
                self.seen().iter().map(|s| (&s.method, &s.path, &s.query)).collect::<Vec<_>>()
            );
        }
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client on the mocked API server, and the server answering through `route`.
pub fn mock(route: impl FnMut(&Seen) -> Reply + Send + 'static) -> (kube::Client, Mock) {
    let (svc, mut handle) = tower_test::mock::pair::<Request<kube::client::Body>, Response<MockBody>>();
    let client = kube::Client::new(svc, NAMESPACE);
    let log: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let seen_log = log.clone();
    let route = Arc::new(Mutex::new(route));
    let task = tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let log = seen_log.clone();
            let route = route.clone();
            // Each request answered on its own task: bodies are read while others wait.
            tokio::spawn(async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let seen = seen_of(&parts, body);
                log.lock().unwrap().push(seen.clone());
                let reply = (route.lock().unwrap())(&seen);
                send.send_response(respond(reply));
            });
        }
    });
    (client, Mock { log, task })
}

/// A request as the log keeps it.
fn seen_of(parts: &http::request::Parts, body: Bytes) -> Seen {
    let query = parts
        .uri
        .query()
        .map(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
                .map(|(k, v)| (k.to_string(), percent_decode(v)))
                .collect()
        })
        .unwrap_or_default();
    let header = |name| parts.headers.get(name).and_then(|v: &http::HeaderValue| v.to_str().ok()).map(str::to_string);
    let content_type = header(http::header::CONTENT_TYPE);
    let accept = header(http::header::ACCEPT);
    Seen {
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query,
        content_type,
        accept,
        body,
        at: Instant::now(),
    }
}

/// An object as the API server answers it to an `Accept` of `as=PartialObjectMetadata` (a
/// create): its metadata alone.
fn object_metadata_if_asked(req: &Seen, mut obj: Value) -> Value {
    if !req.accept.as_deref().is_some_and(|a| a.contains("as=PartialObjectMetadata;")) {
        return obj;
    }
    serde_json::json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"].take()})
}

/// A list as the API server answers it to an `Accept` of `as=PartialObjectMetadataList` (a
/// list, or a `deletecollection`): each item's metadata alone.
fn metadata_if_asked(req: &Seen, mut list: Value) -> Value {
    if !req.accept.as_deref().is_some_and(|a| a.contains("as=PartialObjectMetadataList")) {
        return list;
    }
    list["kind"] = "PartialObjectMetadataList".into();
    list["apiVersion"] = "meta.k8s.io/v1".into();
    if let Some(items) = list["items"].as_array_mut() {
        for item in items {
            *item = serde_json::json!({
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": item["metadata"].take(),
            });
        }
    }
    list
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

/// Watch streams handed out in order; once they are used up, watches hang (kept open, empty).
#[derive(Default)]
pub struct Watches {
    queue: VecDeque<mpsc::Receiver<Bytes>>,
    /// Senders of the hanging watches, kept so that they never end.
    hanging: Vec<mpsc::Sender<Bytes>>,
}

impl Watches {
    /// A new stream for the next watch request, and its sender.
    pub fn push(&mut self) -> mpsc::Sender<Bytes> {
        let (tx, rx) = mpsc::channel(1024);
        self.queue.push_back(rx);
        tx
    }

    pub fn next(&mut self) -> Reply {
        match self.queue.pop_front() {
            Some(rx) => Reply::Stream(rx),
            None => {
                let (tx, rx) = mpsc::channel(1);
                self.hanging.push(tx);
                Reply::Stream(rx)
            }
        }
    }
}

/// A PodList body with these pods and a resource version.
pub fn pod_list(rv: &str, items: Vec<Value>) -> Value {
    serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items})
}

/// A recorded pod with the labels and annotation a pod of `KubeProvider` carries.
pub fn as_ours(mut pod: Value, spec: &sandman_provider::SandboxSpec) -> Value {
    let meta = &mut pod["metadata"];
    meta["labels"]["sandman.dev/instance"] = "sandman".into();
    meta["labels"]["sandman.dev/sandbox"] = spec.id.clone().into();
    meta["name"] = format!("sandman-{}", spec.id).into();
    let mut stored = spec.clone();
    stored.token = String::new();
    if meta.get("annotations").is_none_or(Value::is_null) {
        meta["annotations"] = serde_json::json!({});
    }
    meta["annotations"]["sandman.dev/spec"] = serde_json::to_string(&stored).unwrap().into();
    pod
}

/// Whether a label selector (`k=v`, `k`, comma-separated) matches these labels.
pub fn selects(selector: &str, labels: &serde_json::Map<String, Value>) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| match term.split_once('=') {
        Some((k, v)) => labels.get(k).and_then(Value::as_str) == Some(v),
        None => labels.contains_key(term),
    })
}

/// A small API server for pods and Secrets in one namespace, answering with the recorded bodies
/// where it can (errors, the running pod's status). Without an external kubelet it runs pods
/// itself: a pod whose token Secret exists runs at once with the next IP (10.0.x.y, never
/// dialled), unless its image names a failure. With one (`sandman-fake-node`), it serves Nodes,
/// bindings and status patches, and a bound pod's deletion waits for the kubelet's confirmation.
/// Watches replay the events after their resource version, then follow.
#[derive(Default)]
pub struct Cluster {
    pub pods: BTreeMap<String, Value>,
    pub secrets: BTreeMap<String, Value>,
    pub nodes: BTreeMap<String, Value>,
    rv: u64,
    /// Every event so far, with its resource version, for watches resuming from one.
    /// Each with the object's labels, which a watch's label selector is matched against.
    history: Vec<(u64, Bytes, serde_json::Map<String, Value>)>,
    /// Open watches and their label selectors.
    watchers: Vec<(String, mpsc::Sender<Bytes>)>,
    next_ip: u32,
    /// Answer the next pod creates with the recorded 429 first.
    pub throttle_next: u32,
    /// A kubelet of its own runs the pods (else the fake node does).
    pub external_kubelet: bool,
    /// A `deletecollection` of pods runs out of time after deleting this many (those being
    /// deleted already cost it nothing) and answers the recorded `504`, naming none.
    pub collection_cut: Option<usize>,
}

/// Images the fake kubelet cannot pull (`ErrImagePull`, with the recorded message).
pub const MISSING_IMAGE: &str = "nonexistent.invalid/task:1";

pub type Shared = Arc<Mutex<Cluster>>;

impl Cluster {
    pub fn shared() -> Shared {
        Arc::default()
    }

    /// A cluster whose pods only a fake node runs.
    pub fn for_fake_node() -> Shared {
        Arc::new(Mutex::new(Cluster { external_kubelet: true, ..Cluster::default() }))
    }

    /// A copy of the pods and Secrets, to look at without the lock.
    pub fn clone_state(&self) -> Cluster {
        Cluster { pods: self.pods.clone(), secrets: self.secrets.clone(), ..Cluster::default() }
    }

    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Records an event and sends it to every open watch.
    pub fn emit(&mut self, kind: &str, object: &Value) {
        let rv: u64 = object["metadata"]["resourceVersion"].as_str().and_then(|s| s.parse().ok()).unwrap_or(self.rv);
        let line = event(kind, object);
        let labels = object["metadata"]["labels"].as_object().cloned().unwrap_or_default();
        self.watchers.retain(|(selector, w)| !selects(selector, &labels) || w.try_send(line.clone()).is_ok());
        self.history.push((rv, line, labels));
    }

    /// Stores a changed pod with a new resource version and tells the watches.
    pub fn update(&mut self, mut pod: Value) {
        let rv = self.bump();
        pod["metadata"]["resourceVersion"] = rv.to_string().into();
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        self.pods.insert(name, pod.clone());
        self.emit("MODIFIED", &pod);
    }

    /// The pod whose daemon listens at `addr` (`ip:port`).
    pub fn pod_at(&self, addr: &str) -> Option<Value> {
        let ip = addr.rsplit_once(':').map(|(ip, _)| ip)?;
        self.pods.values().find(|p| p["status"]["podIP"] == ip).cloned()
    }

    /// The recorded running pod's status, given this pod's IP.
    fn run(&mut self, name: &str) {
        let Some(mut pod) = self.pods.get(name).cloned() else { return };
        if pod["metadata"]["deletionTimestamp"].is_string() {
            return;
        }
        let image = pod["spec"]["containers"][0]["image"].as_str().unwrap_or("").to_string();
        if image == MISSING_IMAGE {
            pod["status"] = json("status-errimagepull.json")["status"].clone();
        } else {
            self.next_ip += 1;
            let ip = format!("10.0.{}.{}", self.next_ip / 250, 1 + self.next_ip % 250);
            let mut status = json("pod-running-ready.json")["status"].clone();
            status["podIP"] = ip.clone().into();
            status["podIPs"] = serde_json::json!([{"ip": ip}]);
            pod["status"] = status;
        }
        self.update(pod);
    }

    /// Deletes a pod: at once when no kubelet runs it, else marked and left for the kubelet to
    /// confirm (with a zero grace period), as the recordings show. Its Secret goes with it.
    fn delete_pod(&mut self, name: &str, grace: Option<u64>) -> Option<Value> {
        let mut pod = self.pods.get(name).cloned()?;
        let before = pod.clone();
        let bound = pod["spec"]["nodeName"].is_string();
        if self.external_kubelet && bound && grace != Some(0) {
            if !pod["metadata"]["deletionTimestamp"].is_string() {
                pod["metadata"]["deletionTimestamp"] = "2026-11-29T18:59:08Z".into();
                pod["metadata"]["deletionGracePeriodSeconds"] = grace.unwrap_or(2).into();
                self.update(pod.clone());
            }
            return Some(self.pods[name].clone());
        }
        if !pod["metadata"]["deletionTimestamp"].is_string() {
            pod["metadata"]["deletionTimestamp"] = "2026-11-29T18:59:08Z".into();
            pod["metadata"]["deletionGracePeriodSeconds"] = grace.unwrap_or(2).into();
            self.update(pod.clone());
        }
        let rv = self.bump();
        pod["metadata"]["resourceVersion"] = rv.to_string().into();
        self.pods.remove(name);
        self.secrets.remove(name);
        // The garbage collector: a Secret whose owners are all gone goes too.
        let uids: std::collections::HashSet<String> =
            self.pods.values().filter_map(|p| p["metadata"]["uid"].as_str().map(str::to_string)).collect();
        self.secrets.retain(|_, s| {
            let owners = s["metadata"]["ownerReferences"].as_array().cloned().unwrap_or_default();
            owners.is_empty() || owners.iter().any(|o| o["uid"].as_str().is_some_and(|u| uids.contains(u)))
        });
        self.emit("DELETED", &pod);
        Some(before)
    }

    fn list(&self, kind: &str, items: Vec<Value>) -> Value {
        serde_json::json!({"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": self.rv.to_string()}, "items": items})
    }

    /// Answers one request.
    pub fn handle(&mut self, req: &Seen) -> Reply {
        if let Some(rest) = req.path.strip_prefix("/api/v1/nodes") {
            return self.node(req, rest.trim_start_matches('/'));
        }
        if req.method == "GET" && req.path == "/api/v1/namespaces" {
            // One namespace, never listed by the provider; the e2e sweep finds no leftovers.
            return ok(self.list("NamespaceList", Vec::new()));
        }
        if req.path.starts_with("/api/v1/namespaces") && !req.path.contains("/pods") && !req.path.contains("/secrets") {
            // Namespaces, service accounts, NetworkPolicies: accepted as they are.
            return match req.method.as_str() {
                "POST" => Reply::Json(StatusCode::CREATED, req.json()),
                _ => ok(req.json()),
            };
        }
        let Some(rest) = req.path.strip_prefix("/api/v1/namespaces/").and_then(|r| r.split_once('/')).map(|(_, r)| r)
        else {
            return not_found(&req.path);
        };
        let segments: Vec<&str> = rest.split('/').collect();
        let selector = req.query.get("labelSelector").cloned().unwrap_or_default();
        let selected = |objs: &BTreeMap<String, Value>| -> Vec<Value> {
            objs.values()
                .filter(|o| o["metadata"]["labels"].as_object().is_some_and(|l| selects(&selector, l)))
                .cloned()
                .collect()
        };
        let grace = req.json()["gracePeriodSeconds"].as_u64();
        match (req.method.as_str(), segments.as_slice()) {
            ("GET", ["pods"]) if req.is_watch() => {
                let from: u64 = req.query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
                let (tx, rx) = mpsc::channel(100_000);
                for (rv, line, labels) in &self.history {
                    if *rv > from && selects(&selector, labels) {
                        let _ = tx.try_send(line.clone());
                    }
                }
                self.watchers.push((selector.clone(), tx));
                Reply::Stream(rx)
            }
            ("GET", ["pods"]) => ok(metadata_if_asked(req, self.list("PodList", selected(&self.pods)))),
            ("GET", ["secrets"]) => ok(self.list("SecretList", selected(&self.secrets))),
            ("POST", ["pods"]) => {
                if self.throttle_next > 0 {
                    self.throttle_next -= 1;
                    let (status, headers, body) = recorded_response("http-429-mutating.http");
                    return Reply::Raw(status, headers, body);
                }
                let mut pod = req.json();
                let name = pod["metadata"]["name"].as_str().unwrap().to_string();
                if self.pods.contains_key(&name) {
                    let mut status = json("error-409-already-exists.json");
                    status["message"] = format!("pods \"{name}\" already exists").into();
                    status["details"]["name"] = name.into();
                    return Reply::Json(StatusCode::CONFLICT, status);
                }
                let rv = self.bump();
                pod["metadata"]["uid"] = format!("uid-{name}").into();
                pod["metadata"]["resourceVersion"] = rv.to_string().into();
                pod["status"] = serde_json::json!({"phase": "Pending", "qosClass": qos_class(&pod)});
                self.pods.insert(name.clone(), pod.clone());
                self.emit("ADDED", &pod);
                // A shared token Secret is made before its pods: the kubelet finds it at once.
                let volumes = pod["spec"]["volumes"].as_array().cloned().unwrap_or_default();
                let shared = volumes.iter().find(|v| v["name"] == "sandman-token").and_then(|v| {
                    let secret = v["secret"]["secretName"].as_str()?;
                    (secret != name && self.secrets.contains_key(secret)).then_some(())
                });
                if shared.is_some() && !self.external_kubelet {
                    self.run(&name);
                }
                Reply::Json(StatusCode::CREATED, object_metadata_if_asked(req, pod))
            }
            ("POST", ["secrets"]) => {
                let posted = req.json();
                let name = posted["metadata"]["name"].as_str().unwrap().to_string();
                let mut secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(posted).unwrap();
                let data = secret.string_data.take().unwrap_or_default();
                secret.data =
                    Some(data.into_iter().map(|(k, v)| (k, k8s_openapi::ByteString(v.into_bytes()))).collect());
                let secret = serde_json::to_value(secret).unwrap();
                self.secrets.insert(name.clone(), secret.clone());
                if !self.external_kubelet {
                    // The kubelet mounts the token and starts the daemon.
                    self.run(&name);
                }
                Reply::Json(StatusCode::CREATED, secret)
            }
            ("POST", ["pods", name, "binding"]) => {
                let Some(mut pod) = self.pods.get(*name).cloned() else { return not_found(name) };
                if pod["spec"]["nodeName"].is_string() {
                    return Reply::Json(StatusCode::CONFLICT, json("error-409-binding-already-assigned.json"));
                }
                pod["spec"]["nodeName"] = req.json()["target"]["name"].clone();
                pod["status"]["conditions"] = serde_json::json!([{"type": "PodScheduled", "status": "True"}]);
                self.update(pod);
                Reply::Json(StatusCode::CREATED, json("pod-binding-201.json"))
            }
            ("PATCH", ["pods", name, "status"]) => {
                let Some(mut pod) = self.pods.get(*name).cloned() else { return not_found(name) };
                let patch = req.json();
                if patch["metadata"]["uid"].is_string() && patch["metadata"]["uid"] != pod["metadata"]["uid"] {
                    return Reply::Json(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        json("error-422-status-patch-uid-mismatch.json"),
                    );
                }
                merge_status(&mut pod["status"], &patch["status"]);
                self.update(pod.clone());
                ok(pod)
            }
            ("PATCH", ["pods", name]) => {
                let Some(mut pod) = self.pods.get(*name).cloned() else { return not_found(name) };
                if req.content_type.as_deref() != Some("application/merge-patch+json") {
                    return Reply::Json(StatusCode::UNSUPPORTED_MEDIA_TYPE, serde_json::json!({"kind": "Status"}));
                }
                let mut patch = req.json();
                // A resourceVersion in the patch is a precondition, as the API server reads it.
                let precondition = patch["metadata"].as_object_mut().and_then(|m| m.remove("resourceVersion"));
                if let Some(rv) = precondition
                    && rv != pod["metadata"]["resourceVersion"]
                {
                    return Reply::Json(StatusCode::CONFLICT, conflict(name));
                }
                merge_patch(&mut pod, &patch);
                self.update(pod.clone());
                ok(self.pods[*name].clone())
            }
            ("GET", ["pods", name]) => match self.pods.get(*name) {
                Some(p) => ok(p.clone()),
                None => not_found(name),
            },
            ("GET", ["secrets", name]) => match self.secrets.get(*name) {
                Some(s) => ok(s.clone()),
                None => not_found(name),
            },
            ("PATCH", ["secrets", name]) => {
                let Some(secret) = self.secrets.get_mut(*name) else { return not_found(name) };
                merge_patch(secret, &req.json());
                ok(secret.clone())
            }
            ("DELETE", ["secrets", name]) => match self.secrets.remove(*name) {
                Some(s) => ok(s),
                None => not_found(name),
            },
            ("DELETE", ["pods", name]) => match self.delete_pod(name, grace) {
                Some(p) => ok(p),
                None => not_found(name),
            },
            ("DELETE", ["pods"]) => {
                let matched = selected(&self.pods);
                let deleting = |p: &Value| p["metadata"]["deletionTimestamp"].is_string();
                if let Some(cut) = self.collection_cut
                    && matched.iter().filter(|p| !deleting(p)).count() > cut
                {
                    for p in matched.iter().filter(|p| !deleting(p)).take(cut) {
                        self.delete_pod(p["metadata"]["name"].as_str().unwrap(), grace);
                    }
                    let (status, headers, body) = recorded_response("http-504-deletecollection-timeout.http");
                    return Reply::Raw(status, headers, body);
                }
                let out = self.list("PodList", matched.clone());
                for p in matched {
                    self.delete_pod(p["metadata"]["name"].as_str().unwrap(), grace);
                }
                ok(metadata_if_asked(req, out))
            }
            _ => not_found(&req.path),
        }
    }

    /// Nodes: registered, listed by label, their status patched, deleted.
    fn node(&mut self, req: &Seen, rest: &str) -> Reply {
        match (req.method.as_str(), rest.split_once('/')) {
            ("GET", None) if rest.is_empty() => {
                let selector = req.query.get("labelSelector").cloned().unwrap_or_default();
                let items = self
                    .nodes
                    .values()
                    .filter(|n| {
                        let none = serde_json::Map::new();
                        selects(&selector, n["metadata"]["labels"].as_object().unwrap_or(&none))
                    })
                    .cloned()
                    .collect();
                ok(self.list("NodeList", items))
            }
            ("POST", None) if rest.is_empty() => {
                let node = req.json();
                let name = node["metadata"]["name"].as_str().unwrap().to_string();
                self.nodes.insert(name, node.clone());
                Reply::Json(StatusCode::CREATED, node)
            }
            ("PATCH", Some((name, "status"))) => {
                let Some(node) = self.nodes.get_mut(name) else { return not_found(name) };
                merge_status(&mut node["status"], &req.json()["status"]);
                ok(node.clone())
            }
            ("DELETE", None) => {
                self.nodes.remove(rest);
                ok(serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}))
            }
            _ => not_found(rest),
        }
    }
}

/// The QoS class the API server gives a pod: Guaranteed when every container's cpu and memory
/// requests equal its limits, BestEffort when none has any, else Burstable.
fn qos_class(pod: &Value) -> &'static str {
    let spec = &pod["spec"];
    let containers: Vec<&Value> =
        spec["containers"].as_array().into_iter().chain(spec["initContainers"].as_array()).flatten().collect();
    let r = |c: &Value, kind: &str, what: &str| c["resources"][kind][what].as_str().map(str::to_string);
    let guaranteed = containers.iter().all(|c| {
        ["cpu", "memory"].iter().all(|w| r(c, "limits", w).is_some() && r(c, "requests", w) == r(c, "limits", w))
    });
    let none = containers
        .iter()
        .all(|c| ["cpu", "memory"].iter().all(|w| r(c, "limits", w).is_none() && r(c, "requests", w).is_none()));
    if guaranteed {
        "Guaranteed"
    } else if none {
        "BestEffort"
    } else {
        "Burstable"
    }
}

/// A strategic merge of a status: conditions merged by type, every other field replaced.
fn merge_status(status: &mut Value, patch: &Value) {
    if !status.is_object() {
        *status = serde_json::json!({});
    }
    let Some(fields) = patch.as_object() else { return };
    for (k, v) in fields {
        if k.starts_with("$setElementOrder") {
            continue;
        }
        if k == "conditions" && status[k].is_array() {
            let mut merged = status[k].as_array().cloned().unwrap_or_default();
            for c in v.as_array().into_iter().flatten() {
                match merged.iter_mut().find(|m| m["type"] == c["type"]) {
                    Some(m) => {
                        for (ck, cv) in c.as_object().into_iter().flatten() {
                            m[ck] = cv.clone();
                        }
                    }
                    None => merged.push(c.clone()),
                }
            }
            status[k] = Value::Array(merged);
        } else {
            status[k] = v.clone();
        }
    }
}

/// A JSON merge patch (RFC 7386): objects merged key by key, `null` removes, anything else
/// replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = serde_json::json!({});
    }
    let Some(object) = target.as_object_mut() else { return };
    for (k, v) in fields {
        if v.is_null() {
            object.remove(k);
        } else {
            merge_patch(object.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// The API server's 409 for an update whose resourceVersion precondition failed: the recorded
/// `Conflict` Status, with the message an update of a changed object gets.
pub fn conflict(pod: &str) -> Value {
    let mut status = json("error-409-binding-already-assigned.json");
    status["message"] = format!(
        "Operation cannot be fulfilled on pods \"{pod}\": the object has been modified; please apply your changes \
         to the latest version and try again"
    )
    .into();
    status["details"] = serde_json::json!({"name": pod, "kind": "pods"});
    status
}

fn not_found(name: &str) -> Reply {
    let mut status = json("error-404-delete-missing-pod.json");
    status["message"] = format!("pods \"{name}\" not found").into();
    Reply::Json(StatusCode::NOT_FOUND, status)
}

/// A client on `cluster` (several clients may share one cluster: restarted servers).
pub fn client_on(cluster: &Shared) -> (kube::Client, Mock) {
    let cluster = cluster.clone();
    mock(move |req| cluster.lock().unwrap().handle(req))
}

/// Serves `cluster` over HTTP on 127.0.0.1 (for programs: the fake node); answers its address.
pub async fn serve_http(cluster: &Shared) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use hyper::service::service_fn;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cluster = cluster.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let cluster = cluster.clone();
                    async move {
                        let (parts, body) = req.into_parts();
                        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        let seen = seen_of(&parts, body);
                        let reply = cluster.lock().unwrap().handle(&seen);
                        Ok::<_, std::convert::Infallible>(respond(reply))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    (addr, task)
}

/// A kubeconfig for the API server at `addr` (plain HTTP, no credentials).
pub fn kubeconfig(dir: &std::path::Path, addr: std::net::SocketAddr) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: mock\n  cluster:\n    server: http://{addr}\n\
         users:\n- name: mock\n  user: {{}}\ncontexts:\n- name: mock\n  context:\n    cluster: mock\n    user: mock\n\
         current-context: mock\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

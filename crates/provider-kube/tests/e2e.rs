//! End to end on a real API server with the fake node (`sandman-fake-node`) as its only
//! kubelet: the provider conformance suite, `prepare` (a pull pod per node, progress, cleanup),
//! two servers racing to claim the same warm-pool pods (exactly one wins each), and a burst of
//! 1,000 sandboxes checked for the write rate, readiness, an exec in each, and a
//! release-all that leaves no pod. Each runs twice: on a
//! real API server, ignored by default since it needs one, named by `SANDMAN_E2E_KUBECONFIG` (see
//! `docs/kubernetes.md`); and on the crate's mocked API server (`tests/common`) served over HTTP,
//! which proves the fake node, the real `sandmand` and this suite here, but not the API server:
//!
//! ```sh
//! cargo build -p sandmand
//! SANDMAN_E2E_KUBECONFIG=~/.kube/config cargo test -p sandman-provider-kube --test e2e -- --ignored --nocapture
//! ```
//!
//! One more needs a real kubelet, since it checks what a sandbox sees from inside: an `eval`
//! sandbox is Guaranteed, and its daemon observes the cpu and memory limits, timezone and locale
//! that `applied` reports. It needs `SANDMAN_E2E_DAEMON_IMAGE` (a sandmand image the nodes can
//! pull), `kubectl` (to port-forward to the daemon), optionally `SANDMAN_E2E_TASK_IMAGE`
//! (`busybox:1.36`) and `SANDMAN_E2E_POD_PIDS_LIMIT` (the nodes' podPidsLimit, 1024).
//!
//! `SANDMAN_E2E_SANDBOXES` (1000), `SANDMAN_E2E_QPS` (50) and `SANDMAN_E2E_BURST` (100) size the
//! burst (`SANDMAN_MOCK_*`, 40, 20 and 10, the mocked one); `SANDMAN_E2E_FAKE_NODES` (2) run it,
//! `SANDMAN_E2E_TOKEN=secret` gives each sandbox a Secret of its own instead of shared ones,
//! `SANDMAN_E2E_API_CONCURRENCY` (the provider's default) and `SANDMAN_E2E_NODE_CONCURRENCY` (16
//! per fake node) bound the calls in flight. `SANDMAN_E2E_BENCH=1` measures the API server's
//! bare pod creates (`SANDMAN_E2E_RAW_CLIENTS`, 16) before and after the burst and prints, side by
//! side, sandboxes per second, create-to-ready p50/p99, writes per sandbox (the provider's and
//! the fake nodes'), all writes per second and their ratio to the bare create rate, where the
//! CPU went, and the latencies of each step.
//!
//! At the paper's scale (`e2e/scale.rs`, skipped by `./scripts/e2e-kube` unless `--scale`): a
//! hold of `SANDMAN_E2E_SANDBOXES` (11858 there) sandboxes at once on `SANDMAN_E2E_FAKE_NODES`
//! (one per 3,000) fake nodes, and a churn soak of `SANDMAN_E2E_SOAK_S` (1800) seconds at
//! `SANDMAN_E2E_SOAK_RATE` (12) creates a second, each sandbox held `SANDMAN_E2E_SOAK_HOLD_S`
//! (10) after its exec, sampled every `SANDMAN_E2E_SOAK_SAMPLE_S` (30).
#![allow(clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod common;
#[path = "e2e/scale.rs"]
mod scale;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, ServiceAccount, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use sandman_provider::conformance::{self, spec};
use sandman_provider::{Endpoint, NodeProgress, NodeState, Prepared, Provider, ProviderError, SandboxSpec};
use sandman_provider_kube::pace::WriteSlot;
use sandman_provider_kube::pod::{DAEMON_DIR, DAEMON_PATH};
use sandman_provider_kube::{CapacityConfig, Injection, KubeConfig, KubeProvider, TokenDelivery};
use sandman_wire::daemon::Observed;
use sandman_wire::server::{Profile, Quantity, Reason, Resources};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;

const SCHEDULER: &str = "sandman-fake-scheduler";
/// Images the fake node refuses to pull, and OOM-kills.
const MISSING: &str = "example.invalid/e2e-missing:1";
const OOM: &str = "example.invalid/e2e-oom:1";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The tests on a real kubelet: the sandmand image its nodes can pull, and the task image.
fn kubelet_images() -> (String, String) {
    let daemon_image = std::env::var("SANDMAN_E2E_DAEMON_IMAGE")
        .unwrap_or_else(|_| panic!("set SANDMAN_E2E_DAEMON_IMAGE to a sandmand image the cluster's nodes can pull"));
    (daemon_image, env_or("SANDMAN_E2E_TASK_IMAGE", "busybox:1.36".to_string()))
}

fn e2e_kubeconfig() -> PathBuf {
    let path = std::env::var_os("SANDMAN_E2E_KUBECONFIG")
        .unwrap_or_else(|| panic!("set SANDMAN_E2E_KUBECONFIG to the kubeconfig of a test API server"));
    PathBuf::from(path)
}

/// The lock every test on a real cluster holds for its whole run, shared by every test thread
/// and every process on this machine (`flock` on one file, released when the test ends however
/// it ends). The tests share the cluster's nodes and this machine's cores: run side by side, the
/// eval test found the node full of the capacity rollout's pods, and a burst's figures measured
/// the other tests too. So the suite passes however it is started (`--test-threads`, two
/// `cargo test` at once).
struct ClusterLock(#[allow(dead_code)] std::fs::File);

async fn cluster_lock() -> ClusterLock {
    let path = std::env::temp_dir().join("sandman-e2e-kube.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    tokio::task::spawn_blocking(move || {
        if file.try_lock().is_err() {
            eprintln!("waiting for {} (another test on the cluster holds it)", path.display());
            file.lock().unwrap_or_else(|e| panic!("cannot lock {}: {e}", path.display()));
        }
        ClusterLock(file)
    })
    .await
    .unwrap()
}

/// One write the provider's client sent, seen below the provider: its method, what it wrote
/// (`pods`, `secrets`, …), when it passed the log, the pacer's slot it carries (`None`: sent
/// unpaced), and when its answer came.
#[derive(Debug, Clone)]
struct Write {
    method: String,
    kind: String,
    seen: Instant,
    slot: Option<Instant>,
    answered: Option<Instant>,
}

/// Every write the provider's client sent.
type WriteLog = Arc<Mutex<Vec<Write>>>;

/// The layer below the client that logs its writes and when each was answered.
#[derive(Clone)]
struct Logged<S> {
    inner: S,
    log: WriteLog,
}

impl<S> tower::Service<http::Request<kube::client::Body>> for Logged<S>
where
    S: tower::Service<http::Request<kube::client::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures_util::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<kube::client::Body>) -> Self::Future {
        let entry = (!matches!(req.method().as_str(), "GET" | "HEAD")).then(|| {
            let slot = req.extensions().get::<WriteSlot>().map(|s| s.0);
            // `/api/v1/namespaces/<ns>/<kind>/...`
            let kind = req.uri().path().split('/').nth(5).unwrap_or_default().to_string();
            let mut log = self.log.lock().unwrap();
            log.push(Write { method: req.method().to_string(), kind, seen: Instant::now(), slot, answered: None });
            log.len() - 1
        });
        let answer = self.inner.call(req);
        let log = self.log.clone();
        Box::pin(async move {
            let answer = answer.await;
            if let Some(i) = entry {
                log.lock().unwrap()[i].answered = Some(Instant::now());
            }
            answer
        })
    }
}

/// A client on the test API server; its writes are logged in `log`, if given (not otherwise:
/// a soak's client would keep every write it ever sent).
async fn client(kubeconfig: &Path, log: Option<WriteLog>) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    let builder = kube::client::ClientBuilder::try_from(config).unwrap();
    match log {
        Some(log) => {
            builder.with_layer(&tower::layer::layer_fn(move |inner| Logged { inner, log: log.clone() })).build()
        }
        None => builder.build(),
    }
}

/// Eight hex digits no other run will pick (from the standard library's random hash keys).
fn unique() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

/// The label of every namespace this suite makes, and the fake Node's annotation naming the
/// namespace it runs (set by `sandman-fake-node`).
const E2E_LABEL: &str = "sandman.dev/e2e";
const NODE_NAMESPACE: &str = "sandman.dev/fake-node-namespace";
/// A fake node posts a heartbeat every 10 s: one silent for this long is gone.
const STALE_NODE_S: i64 = 60;
/// A namespace of this suite with no live fake node, older than this, is a leftover.
const STALE_NAMESPACE_S: i64 = 15 * 60;

/// What a test registered in the cluster (its namespace, its fake Node), removed however the
/// test ends: by [`Registered::remove`], or on drop (a panic) from a thread of its own.
struct Registered {
    kubeconfig: PathBuf,
    namespace: String,
    nodes: Vec<String>,
    removed: bool,
}

impl Registered {
    /// Creates the namespace, labelled as this suite's.
    async fn namespace(client: &Client, kubeconfig: &Path, namespace: String, nodes: Vec<String>) -> Registered {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": namespace, "labels": {E2E_LABEL: "true"}}})).unwrap();
        namespaces.create(&PostParams::default(), &ns).await.unwrap();
        Registered { kubeconfig: kubeconfig.to_path_buf(), namespace, nodes, removed: false }
    }

    async fn remove(mut self) {
        remove(&client(&self.kubeconfig, None).await, &self.namespace, &self.nodes).await;
        self.removed = true;
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let (kubeconfig, namespace, nodes) = (self.kubeconfig.clone(), self.namespace.clone(), self.nodes.clone());
        eprintln!("removing namespace {namespace} and nodes {nodes:?} after a run that ended early");
        // The test's runtime may be shutting down: a runtime of its own, on a thread of its own.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async { remove(&client(&kubeconfig, None).await, &namespace, &nodes).await });
        });
        let _ = cleanup.join();
    }
}

/// Deletes a namespace's pods at once (no kubelet is left to confirm them), the namespace, and
/// the fake Nodes; what is gone already is fine.
async fn remove(client: &Client, namespace: &str, nodes: &[String]) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    let _ = pods.delete_collection(&now, &ListParams::default()).await;
    let _ = Api::<Namespace>::all(client.clone()).delete(namespace, &DeleteParams::default()).await;
    for node in nodes {
        let _ = Api::<Node>::all(client.clone()).delete(node, &DeleteParams::default()).await;
    }
}

/// Seconds since `t`.
fn age_s(t: Option<&Time>) -> i64 {
    t.map_or(i64::MAX, |t| k8s_openapi::jiff::Timestamp::now().as_second() - t.0.as_second())
}

/// Removes what earlier runs that ended badly left behind: fake Nodes whose heartbeat stopped,
/// with the namespace each names, and this suite's namespaces that no live fake node runs.
async fn sweep_leftovers(client: &Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut live = std::collections::BTreeSet::new();
    for node in nodes.list(&ListParams::default().labels("sandman.dev/fake")).await.unwrap().items {
        let name = node.metadata.name.clone().unwrap_or_default();
        let namespace = node.metadata.annotations.as_ref().and_then(|a| a.get(NODE_NAMESPACE)).cloned();
        let conditions = node.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        let heartbeat = conditions.iter().find(|c| c.type_ == "Ready").and_then(|c| c.last_heartbeat_time.clone());
        if age_s(heartbeat.as_ref()) <= STALE_NODE_S {
            live.extend(namespace);
            continue;
        }
        eprintln!("removing fake node {name} (no heartbeat for {STALE_NODE_S} s) and namespace {namespace:?}");
        match namespace {
            Some(ns) => remove(client, &ns, std::slice::from_ref(&name)).await,
            None => {
                let _ = nodes.delete(&name, &DeleteParams::default()).await;
            }
        }
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for ns in namespaces.list(&ListParams::default()).await.unwrap().items {
        let name = ns.metadata.name.clone().unwrap_or_default();
        let terminating = ns.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Terminating");
        if name.starts_with("sandman-e2e-")
            && !terminating
            && !live.contains(&name)
            && age_s(ns.metadata.creation_timestamp.as_ref()) > STALE_NAMESPACE_S
        {
            eprintln!("removing namespace {name}, left by an earlier run");
            remove(client, &name, &[]).await;
        }
    }
}

/// One fake node process: asked for its stats on stdin, answering on stdout.
struct FakeNode {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

/// A namespace of its own, the fake nodes running its pods; all removed however the test ends.
struct World {
    kubeconfig: PathBuf,
    namespace: String,
    /// The fake nodes' Node names.
    node_names: Vec<String>,
    client: Client,
    /// The fake nodes; empty once torn down.
    nodes: Vec<FakeNode>,
    /// Dropped after the fake nodes have been stopped (fields drop after `Drop::drop`).
    registered: Option<Registered>,
    _state: tempfile::TempDir,
    /// The provider's capacity-aware admission: the default (on) on a real API server; off on
    /// the mocked one, which serves no cluster-wide watch of nodes and pods.
    capacity: CapacityConfig,
}

/// Loopback addresses each fake node of a world may hand out (a /19 each, from the world's
/// first address), so that several nodes never hand out the same one.
const ADDRESSES_PER_NODE: u32 = 8192;

impl World {
    async fn new(kubeconfig: PathBuf, tag: &str, first_ip: &str) -> World {
        World::with_nodes(kubeconfig, tag, first_ip, 1).await
    }

    /// A world whose pods `count` fake nodes run, each binding its share of them.
    async fn with_nodes(kubeconfig: PathBuf, tag: &str, first_ip: &str, count: u32) -> World {
        let client = client(&kubeconfig, None).await;
        sweep_leftovers(&client).await;
        let suffix = unique();
        let namespace = format!("sandman-e2e-{tag}-{suffix}");
        let node_names: Vec<String> = (0..count)
            .map(|i| {
                if i == 0 { format!("sandman-fake-{tag}-{suffix}") } else { format!("sandman-fake-{tag}-{suffix}-{i}") }
            })
            .collect();
        let registered = Registered::namespace(&client, &kubeconfig, namespace.clone(), node_names.clone()).await;
        // Pods need the namespace's `default` ServiceAccount, which a controller manager would make.
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &namespace);
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap();
        match accounts.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("cannot create the default service account: {e}"),
        }
        let state = tempfile::Builder::new().prefix("fake-node").tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let first: std::net::Ipv4Addr = first_ip.parse().unwrap();
        let mut nodes = Vec::new();
        for (i, node_name) in node_names.iter().enumerate() {
            let ip = std::net::Ipv4Addr::from(u32::from(first) + i as u32 * ADDRESSES_PER_NODE);
            let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandman-fake-node"))
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["--namespace", &namespace, "--node-name", node_name])
                .args(["--scheduler-name", SCHEDULER, "--first-ip", &ip.to_string()])
                .args(["--addresses", &ADDRESSES_PER_NODE.to_string()])
                .args(["--shards", &count.to_string(), "--shard", &i.to_string()])
                .args(["--api-concurrency", &env_or("SANDMAN_E2E_NODE_CONCURRENCY", 16u32).to_string()])
                .args(["--fail-image", "e2e-missing", "--oom-image", "e2e-oom"])
                .arg("--daemon")
                .arg(sandman_testkit::daemon_beside_tests())
                .arg("--state-dir")
                .arg(state.path().join(i.to_string()))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let stdin = child.stdin.take().unwrap();
            let lines = BufReader::new(child.stdout.take().unwrap()).lines();
            nodes.push(FakeNode { child, stdin, lines });
        }
        let mut world = World {
            kubeconfig,
            namespace,
            node_names,
            client,
            nodes,
            registered: Some(registered),
            _state: state,
            capacity: CapacityConfig::default(),
        };
        for node in &mut world.nodes {
            let ready = tokio::time::timeout(Duration::from_secs(60), node.lines.next_line()).await;
            assert!(matches!(ready, Ok(Ok(Some(ref l))) if l == "ready"), "a fake node did not start: {ready:?}");
        }
        world
    }

    /// On the mocked API server: no capacity-aware admission (it serves no cluster-wide watch).
    fn on_the_mock(mut self) -> World {
        self.capacity = CapacityConfig::disabled();
        self
    }

    /// The fake nodes' process ids (those still running).
    fn node_pids(&self) -> Vec<u32> {
        self.nodes.iter().filter_map(|n| n.child.id()).collect()
    }

    /// Where the fake nodes keep each pod's token and working directory (every daemon's
    /// command line names it).
    fn state_dir(&self) -> PathBuf {
        self._state.path().to_path_buf()
    }

    /// The first fake node's Node name.
    fn node_name(&self) -> &str {
        &self.node_names[0]
    }

    /// Every fake node's stats (see `sandman-fake-node`), added up: counts summed, timings
    /// pooled.
    async fn node_stats(&mut self) -> NodeStats {
        use tokio::io::AsyncWriteExt;
        let mut total = NodeStats::default();
        for node in &mut self.nodes {
            node.stdin.write_all(b"stats\n").await.unwrap();
            node.stdin.flush().await.unwrap();
            let line = tokio::time::timeout(Duration::from_secs(30), node.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("a fake node did not answer its stats"))
                .unwrap()
                .unwrap_or_else(|| panic!("a fake node ended"));
            let one: NodeStats = serde_json::from_str(&line).unwrap_or_else(|e| panic!("fake node stats {line}: {e}"));
            total.add(one);
        }
        total
    }

    async fn client(&self, log: Option<WriteLog>) -> Client {
        client(&self.kubeconfig, log).await
    }

    fn config(&self) -> KubeConfig {
        KubeConfig {
            namespace: self.namespace.clone(),
            daemon_image: "sandmand:e2e".into(),
            scheduler_name: Some(SCHEDULER.into()),
            node_selector: BTreeMap::from([("sandman.dev/fake".into(), "true".into())]),
            tolerations: vec![Toleration {
                key: Some("sandman.dev/fake".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Toleration::default()
            }],
            capacity: self.capacity.clone(),
            ..KubeConfig::default()
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Stops the fake nodes (SIGTERM: each kills its daemons and deletes its Node), then
    /// removes the namespace.
    async fn tear_down(mut self) {
        let nodes = std::mem::take(&mut self.nodes);
        let mut children = Vec::new();
        for node in nodes {
            if let Some(pid) = node.child.id() {
                let _ = tokio::process::Command::new("kill").arg(pid.to_string()).status().await;
            }
            // Its stdin closed, so that nothing it reads holds it up.
            children.push(node.child);
        }
        for mut child in children {
            let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
        }
        if let Some(registered) = self.registered.take() {
            registered.remove().await;
        }
    }
}

impl Drop for World {
    /// A run that ended early (a panic): the fake nodes are stopped as `tear_down` does,
    /// blocking (SIGTERM, then SIGKILL after 20 s; their daemons die with them either way); the
    /// namespace and the Nodes are removed when `registered` drops next.
    fn drop(&mut self) {
        let mut children = Vec::new();
        for node in std::mem::take(&mut self.nodes) {
            if let Some(pid) = node.child.id() {
                let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
            }
            // Its stdin closed, so that nothing it reads holds it up.
            children.push(node.child);
        }
        let until = std::time::Instant::now() + Duration::from_secs(20);
        for child in &mut children {
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.start_kill();
        }
    }
}

/// What the fake nodes report: their writes by kind and their steps' timings (milliseconds).
#[derive(Debug, Default, serde::Deserialize)]
struct NodeStats {
    bindings: u64,
    statuses: u64,
    deletes: u64,
    secret_reads: u64,
    secret_misses: u64,
    bind_ms: Vec<u32>,
    start_ms: Vec<u32>,
    status_ms: Vec<u32>,
}

impl NodeStats {
    fn add(&mut self, other: NodeStats) {
        self.bindings += other.bindings;
        self.statuses += other.statuses;
        self.deletes += other.deletes;
        self.secret_reads += other.secret_reads;
        self.secret_misses += other.secret_misses;
        self.bind_ms.extend(other.bind_ms);
        self.start_ms.extend(other.start_ms);
        self.status_ms.extend(other.status_ms);
    }

    fn writes(&self) -> u64 {
        self.bindings + self.statuses + self.deletes
    }
}

/// One request to a daemon over TCP.
async fn call(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Result<(u16, Value), String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = http::Request::builder().method(method).uri(path).header("host", "sandbox");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let bytes = match body {
        Some(v) => {
            req = req.header("content-type", "application/json");
            Bytes::from(serde_json::to_vec(&v).unwrap())
        }
        None => Bytes::new(),
    };
    let resp = sender.send_request(req.body(Full::new(bytes)).unwrap()).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

fn addr(endpoint: &Endpoint) -> String {
    match endpoint {
        Endpoint::Tcp(a) => {
            assert!(a.starts_with("127."), "the fake node handed out a non-loopback address: {a}");
            a.clone()
        }
        other => panic!("the kubernetes provider answered a non-TCP endpoint: {other:?}"),
    }
}

/// Health, as the server checks it, then `echo hi` with the token.
async fn check_daemon(endpoint: Endpoint, token: String) -> Result<(), String> {
    let addr = addr(&endpoint);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match call(&addr, "GET", "/v1/health", None, None).await {
            Ok((200, _)) => break,
            other if Instant::now() > deadline => return Err(format!("{addr} not healthy: {other:?}")),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let (status, out) =
        call(&addr, "POST", "/v1/exec", Some(&token), Some(json!({"argv": ["/bin/echo", "hi"]}))).await?;
    if status == 200 && out["exit_code"] == 0 && out["stdout"] == "hi\n" {
        Ok(())
    } else {
        Err(format!("exec: {status} {out}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes API server (SANDMAN_E2E_KUBECONFIG)"]
async fn the_kubernetes_provider_passes_the_conformance_suite_on_a_real_api_server() {
    let _cluster = cluster_lock().await;
    conformance_suite(World::new(e2e_kubeconfig(), "conf", "127.1.0.1").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_and_the_fake_node_pass_on_a_mocked_api_server() {
    let mocked = Mocked::start().await;
    conformance_suite(World::new(mocked.kubeconfig.clone(), "conf", "127.3.0.1").await.on_the_mock()).await;
    assert!(mocked.cluster.lock().unwrap().nodes.is_empty(), "the fake node did not remove its Node");
}

async fn conformance_suite(world: World) {
    let p = KubeProvider::new(world.client(None).await, world.config()).unwrap();
    conformance::create_list_delete(&p, spec("c1", "busybox:e2e"), check_daemon).await;
    conformance::many_at_once(&p, (0..20).map(|i| spec(&format!("m{i}"), "busybox:e2e")).collect()).await;
    conformance::refuses_clearly(&p, spec("r1", MISSING), "e2e-missing").await;
    let second = KubeProvider::new(world.client(None).await, world.config()).unwrap();
    conformance::found_again_after_restart(&p, &second, spec("f1", "busybox:e2e")).await;
    // The daemon killed behind the provider's back: the fake node reports its exit.
    conformance::death_is_reported(&p, spec("d1", "busybox:e2e"), |endpoint| async move {
        let addr = addr(&endpoint);
        check_daemon(endpoint, "token-d1".into()).await.unwrap();
        let _ = call(&addr, "POST", "/v1/exec", Some("token-d1"), Some(json!({"command": "kill -9 $PPID"}))).await;
    })
    .await;

    // An OOM kill after ready is an event with its reason.
    let third = KubeProvider::new(world.client(None).await, world.config()).unwrap();
    let mut events = third.events().unwrap();
    let oom = spec("o1", OOM);
    third.create(&oom).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let ev = events.recv().await.unwrap();
            if ev.id == "o1" {
                return ev;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(ev.ended.reason, Reason::OomKilled, "{}", ev.ended.message);
    third.delete("o1").await.unwrap();

    // Nothing left, once the fake node has confirmed the deletions.
    let pods = world.pods();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pods.list(&ListParams::default()).await.unwrap().items.is_empty() {
        assert!(Instant::now() < deadline, "pods left behind");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    world.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes API server (SANDMAN_E2E_KUBECONFIG)"]
async fn a_burst_of_a_thousand_sandboxes_keeps_the_write_rate_and_every_one_answers() {
    let _cluster = cluster_lock().await;
    let n: usize = env_or("SANDMAN_E2E_SANDBOXES", 1000);
    let qps: f64 = env_or("SANDMAN_E2E_QPS", 50.0);
    let burst: u32 = env_or("SANDMAN_E2E_BURST", 100);
    let nodes: u32 = env_or("SANDMAN_E2E_FAKE_NODES", 2);
    burst_of(World::with_nodes(e2e_kubeconfig(), "burst", "127.2.0.1", nodes).await, n, qps, burst).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_burst_passes_on_a_mocked_api_server() {
    let n: usize = env_or("SANDMAN_MOCK_SANDBOXES", 40);
    let qps: f64 = env_or("SANDMAN_MOCK_QPS", 20.0);
    let burst: u32 = env_or("SANDMAN_MOCK_BURST", 10);
    let mocked = Mocked::start().await;
    burst_of(World::new(mocked.kubeconfig.clone(), "burst", "127.4.0.1").await.on_the_mock(), n, qps, burst).await;
}

/// The mocked API server of `tests/common`, served over HTTP, with its kubeconfig.
struct Mocked {
    cluster: common::Shared,
    kubeconfig: PathBuf,
    _server: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Mocked {
    async fn start() -> Mocked {
        let cluster = common::Cluster::for_fake_node();
        let (addr, server) = common::serve_http(&cluster).await;
        let dir = tempfile::Builder::new().prefix("mock-api").tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let kubeconfig = common::kubeconfig(dir.path(), addr);
        Mocked { cluster, kubeconfig, _server: server, _dir: dir }
    }
}

async fn burst_of(mut world: World, n: usize, qps: f64, burst: u32) {
    let bench = std::env::var_os("SANDMAN_E2E_BENCH").is_some();
    let raw_clients: usize = env_or("SANDMAN_E2E_RAW_CLIENTS", 16);
    // The API server's own pace, measured just before (and after) the burst.
    // (At most 2,000 bare pods: enough for a steady rate.)
    let raw_count = n.min(2000);
    let raw_before = if bench { Some(raw_pod_creates(&world, raw_count, raw_clients).await) } else { None };
    let log: WriteLog = Arc::default();
    // Shared token Secrets unless SANDMAN_E2E_TOKEN=secret (one Secret per sandbox).
    let token = match std::env::var("SANDMAN_E2E_TOKEN").as_deref() {
        Ok("secret") => TokenDelivery::Secret,
        _ => TokenDelivery::SharedSecret,
    };
    let api_concurrency = env_or("SANDMAN_E2E_API_CONCURRENCY", KubeConfig::default().api_concurrency);
    let config = KubeConfig { write_qps: qps, write_burst: burst, token, api_concurrency, ..world.config() };
    let p = Arc::new(KubeProvider::new(world.client(Some(log.clone())).await, config).unwrap());
    let job = "e2e-burst";
    let specs: Vec<SandboxSpec> = (0..n)
        .map(|i| {
            let mut s = spec(&format!("b{i:05}"), "busybox:e2e");
            s.job = Some(job.into());
            s
        })
        .collect();

    if bench {
        // Each phase says when it starts, so that a profile taken meanwhile can be cut by phase.
        println!("burst: {n} creates start");
    }
    let cpu_before = cpu_seconds(&world.node_pids());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for s in specs.clone() {
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let endpoint = p.create(&s).await.map_err(|e| format!("{}: {e}", s.id))?;
            check_health(&endpoint).await?;
            Ok::<_, String>((s, endpoint, t0.elapsed(), Instant::now()))
        }));
    }
    // A deliberately failed run, to show that what a run leaves is cleaned up however it ends:
    // a panic once this many sandboxes are ready, the rest of the burst still under way.
    let panic_after: Option<usize> = std::env::var("SANDMAN_E2E_PANIC_AFTER").ok().and_then(|v| v.parse().ok());
    let mut ready = Vec::new();
    let mut failed = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => ready.push(r),
            Err(e) => failed.push(e),
        }
        if panic_after.is_some_and(|k| ready.len() == k) {
            panic!("SANDMAN_E2E_PANIC_AFTER: a deliberate panic with {} of {n} sandboxes ready", ready.len());
        }
    }
    assert!(failed.is_empty(), "{} of {n} sandboxes failed: {:?}", failed.len(), &failed[..failed.len().min(10)]);
    let last_ready = ready.iter().map(|r| r.3).max().unwrap();
    let cpu_after = cpu_seconds(&world.node_pids());

    // The write rate: every write reached the client with a slot of the pacer, and no window
    // holds more slots than the burst plus the rate. (The times the writes passed the log trail
    // their slots by the client queue's delays, which bunch them by a few: printed below.)
    let secrets = token_secrets_settled(&world, n, token).await;
    let logged = log.lock().unwrap().clone();
    let writes_of = |kind: &str, method: &str| logged.iter().filter(|w| w.kind == kind && w.method == method).count();
    assert_eq!(writes_of("pods", "POST"), n, "one pod write per create");
    assert_eq!(writes_of("secrets", "POST"), secrets, "one write per token Secret");
    match token {
        TokenDelivery::SharedSecret => {
            assert!(secrets < n, "{secrets} shared token Secrets for {n} creates: none was shared");
            assert_eq!(writes_of("secrets", "PATCH"), secrets, "one write of owners per shared token Secret");
            assert_eq!(logged.len(), n + 2 * secrets, "writes beside the pods' and the Secrets'");
        }
        _ => assert_eq!(logged.len(), 2 * n, "two writes per create (pod and secret)"),
    }
    let unpaced: Vec<&str> = logged.iter().filter(|w| w.slot.is_none()).map(|w| w.method.as_str()).collect();
    assert!(unpaced.is_empty(), "{} writes were sent without a slot of the pacer: {unpaced:?}", unpaced.len());
    let slots: Vec<Instant> = logged.iter().filter_map(|w| w.slot).collect();
    let seen: Vec<Instant> = logged.iter().map(|w| w.seen).collect();
    for secs in [1u64, 5, 10, 30] {
        let window = Duration::from_secs(secs);
        let most = most_in_window(&slots, window);
        let allowed = f64::from(burst) + qps * window.as_secs_f64();
        assert!(most as f64 <= allowed, "{most} write slots within {secs} s, over the {allowed} allowed");
    }
    let writes = seen;

    // Every one answers an exec.
    let results = futures_util::stream::iter(ready.iter().map(|(s, e, _, _)| check_daemon(e.clone(), s.token.clone())))
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    let bad: Vec<_> = results.into_iter().filter_map(Result::err).collect();
    assert!(bad.is_empty(), "{} sandboxes did not answer an exec: {:?}", bad.len(), &bad[..bad.len().min(10)]);

    if let Some(raw_before) = raw_before {
        let stats = world.node_stats().await;
        // Memory while every sandbox is held.
        let held = memory_kib(&world.node_pids());
        let raw_after = raw_pod_creates(&world, raw_count, raw_clients).await;
        let raw = (raw_before.rate + raw_after.rate) / 2.0;
        let raw_api_cores = (raw_before.api_cores + raw_after.api_cores) / 2.0;
        let (raw_before, raw_after) = (raw_before.rate, raw_after.rate);
        let mut times: Vec<Duration> = ready.iter().map(|r| r.2).collect();
        times.sort();
        let span = (last_ready - started).as_secs_f64();
        let ours = logged.len() as u64;
        let all = ours + stats.writes();
        let per = |k: u64| k as f64 / n as f64;
        let count = |kind: &str| logged.iter().filter(|w| w.kind == kind).count() as u64;
        println!(
            "sandboxes                {n}, {} fake nodes, write limit {qps} qps, burst {burst}",
            world.nodes.len()
        );
        println!(
            "raw pod creates          {raw:.0}/s ({raw_before:.0} before, {raw_after:.0} after; {raw_count} bare pods, {raw_clients} clients)"
        );
        println!("sandboxes/s              {:.1} ({n} ready in {span:.1} s)", n as f64 / span);
        println!(
            "create-to-ready p50/p99  {:.3} s / {:.3} s",
            pct(&times, 0.50).as_secs_f64(),
            pct(&times, 0.99).as_secs_f64()
        );
        println!(
            "writes per sandbox       {:.2} ours (pods {}, secrets {}), {:.2} the fake nodes' (bindings {}, statuses {})",
            per(ours),
            count("pods"),
            count("secrets"),
            per(stats.bindings + stats.statuses),
            stats.bindings,
            stats.statuses
        );
        println!(
            "all writes/s             {:.0} ({all} in {span:.1} s) = {:.0}% of the raw pod-create rate",
            all as f64 / span,
            100.0 * all as f64 / span / raw
        );
        for kind in ["pods", "secrets"] {
            let mut lat: Vec<Duration> =
                logged.iter().filter(|w| w.kind == kind).filter_map(|w| Some(w.answered? - w.seen)).collect();
            lat.sort();
            if !lat.is_empty() {
                println!(
                    "our {kind:<8} write p50/p99 {:.1} / {:.1} ms",
                    pct(&lat, 0.5).as_secs_f64() * 1e3,
                    pct(&lat, 0.99).as_secs_f64() * 1e3
                );
            }
        }
        let ms = |v: &[u32], p: f64| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v.get(((v.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0)
        };
        println!(
            "fake nodes (ms p50/p99)  bind {}/{}, bound to listening {}/{}, status write {}/{}; secret reads {} ({} not there yet)",
            ms(&stats.bind_ms, 0.5),
            ms(&stats.bind_ms, 0.99),
            ms(&stats.start_ms, 0.5),
            ms(&stats.start_ms, 0.99),
            ms(&stats.status_ms, 0.5),
            ms(&stats.status_ms, 0.99),
            stats.secret_reads,
            stats.secret_misses
        );
        let cpu: Vec<String> = cpu_after
            .iter()
            .map(|(name, after)| format!("{name} {:.1}", after - cpu_before.get(name).copied().unwrap_or(0.0)))
            .collect();
        println!("cpu seconds in the burst {} (of {:.1} on 2 cores)", cpu.join(", "), 2.0 * span);
        let per_write = |name: &str| {
            let used = cpu_after.get(name).copied().unwrap_or(0.0) - cpu_before.get(name).copied().unwrap_or(0.0);
            used * 1e3 / all as f64
        };
        let api_cores = per_write("API server") * all as f64 / span / 1e3;
        println!(
            "cpu per write            API server {:.2} ms, etcd {:.2} ms; API server busy {api_cores:.2} cores = {:.0}% of its {raw_api_cores:.2} at bare creates",
            per_write("API server"),
            per_write("etcd"),
            100.0 * api_cores / raw_api_cores
        );
        let mem: Vec<String> =
            held.iter().map(|(name, kib)| format!("{name} {:.0} MiB", *kib as f64 / 1024.0)).collect();
        println!("memory with all held     {} (resident; the daemons' proportional share)", mem.join(", "));
        let lag =
            logged.iter().filter_map(|w| Some(w.seen.saturating_duration_since(w.slot?))).max().unwrap_or_default();
        println!(
            "most writes in 5 s       {} slots, {} as seen below the client queue (longest lag {:.1} ms; allowed {})",
            most_in_window(&slots, Duration::from_secs(5)),
            most_in_window(&writes, Duration::from_secs(5)),
            lag.as_secs_f64() * 1000.0,
            f64::from(burst) + qps * 5.0
        );
    }

    // Release-all: one deletecollection, and no pod left.
    let writes_before = log.lock().unwrap().len();
    let released = p.delete_job(job).await.unwrap();
    assert_eq!(released.len(), n);
    assert_eq!(log.lock().unwrap().len(), writes_before + 1, "release-all took more than one write");
    let pods = world.pods();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = pods.list(&ListParams::default().labels("sandman.dev/job=e2e-burst")).await.unwrap().items.len();
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} pods left 300 s after release-all");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The garbage collector takes the token Secrets with their pods.
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), &world.namespace);
    loop {
        let left = secrets.list(&ListParams::default().labels(OURS)).await.unwrap().items.len();
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} token Secrets left 300 s after release-all");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    world.tear_down().await;
}

/// The label of everything the provider makes.
const OURS: &str = "app.kubernetes.io/managed-by=sandman";

/// Waits until every token Secret of the burst has its owners, and checks them: with shared
/// Secrets, each pod is an owner of the Secret it mounts, which holds its key, and no Secret
/// has an owner that does not mount it; else one Secret per pod, owned by it. Answers how many
/// Secrets there are.
async fn token_secrets_settled(world: &World, n: usize, token: TokenDelivery) -> usize {
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), &world.namespace);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = secrets.list(&ListParams::default().labels(OURS)).await.unwrap().items;
        let owners: usize = list.iter().map(|s| s.metadata.owner_references.as_ref().map_or(0, Vec::len)).sum();
        if owners == n {
            let pods = world.pods().list(&ListParams::default().labels(OURS)).await.unwrap().items;
            let by_name: BTreeMap<String, &Secret> =
                list.iter().map(|s| (s.metadata.name.clone().unwrap_or_default(), s)).collect();
            for pod in &pods {
                let name = pod.metadata.name.clone().unwrap_or_default();
                let volume = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.volumes.as_ref())
                    .and_then(|v| v.iter().find(|v| v.name == "sandman-token").and_then(|v| v.secret.clone()));
                let volume = volume.unwrap_or_else(|| panic!("{name} mounts no token Secret"));
                let mounted = volume.secret_name.clone().unwrap_or_default();
                let key = volume.items.as_ref().and_then(|i| i.first()).map(|i| i.key.clone()).unwrap_or_default();
                let items = volume.items.as_ref().map_or(0, Vec::len);
                assert_eq!(items, 1, "{name} mounts {items} keys of its token Secret");
                let secret =
                    by_name.get(&mounted).unwrap_or_else(|| panic!("{name} mounts a Secret that is not there"));
                assert!(secret.data.as_ref().is_some_and(|d| d.contains_key(&key)), "{mounted} holds no `{key}`");
                let owned = secret
                    .metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| Some(&o.uid) == pod.metadata.uid.as_ref());
                assert!(owned, "{name} is not an owner of the token Secret {mounted} it mounts");
                match token {
                    TokenDelivery::SharedSecret => assert_eq!(key, name.trim_start_matches("sandman-")),
                    _ => assert_eq!((mounted.as_str(), key.as_str()), (name.as_str(), "token")),
                }
            }
            return list.len();
        }
        assert!(Instant::now() < deadline, "{owners} owners of token Secrets after 60 s, not {n}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The parent pid in the fields of a `/proc/<pid>/stat` line after the process's name.
fn parent(fields: &[&str]) -> u32 {
    fields.get(1).and_then(|p| p.parse().ok()).unwrap_or(0)
}

/// CPU seconds used so far by the processes the burst runs on (this machine's `/proc`): the
/// API server, etcd, the fake nodes `node_pids`, their daemons (their children named
/// `sandmand`, not every daemon on the machine), and this test (the provider). A process that
/// has exited is not counted; on a remote cluster the first two are absent.
fn cpu_seconds(node_pids: &[u32]) -> BTreeMap<&'static str, f64> {
    const NAMES: [(&str, &str); 2] = [("kube-apiserver", "API server"), ("etcd", "etcd")];
    let me = std::process::id().to_string();
    let mut out = BTreeMap::new();
    // The whole machine's idle time (idle and iowait, in ticks of every cpu).
    if let Some(line) = std::fs::read_to_string("/proc/stat").ok().and_then(|s| s.lines().next().map(str::to_string)) {
        let idle: f64 = line.split_whitespace().skip(4).take(2).filter_map(|f| f.parse::<f64>().ok()).sum();
        out.insert("idle", idle / 100.0);
    }
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let comm = &stat[open + 1..close];
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name.
        let ticks: f64 = fields.iter().skip(11).take(2).filter_map(|f| f.parse::<f64>().ok()).sum();
        let (pid_n, ppid) = (pid.parse::<u32>().unwrap_or(0), parent(&fields));
        let name = if pid == me {
            Some("provider (this test)")
        } else if node_pids.contains(&pid_n) {
            Some("fake nodes")
        } else if comm == "sandmand" && node_pids.contains(&ppid) {
            Some("daemons")
        } else {
            NAMES.iter().find(|(c, _)| *c == comm).map(|(_, n)| *n)
        };
        if let Some(name) = name {
            *out.entry(name).or_default() += ticks / 100.0;
        }
    }
    out
}

/// The `p` quantile of sorted `times`.
fn pct(times: &[Duration], p: f64) -> Duration {
    times[((times.len() as f64 * p).ceil() as usize).saturating_sub(1).min(times.len() - 1)]
}

/// Memory of the processes the burst runs on, in KiB: resident for the API server, etcd, the fake
/// nodes `node_pids` and this test (the provider); for the daemons of those nodes their
/// proportional share (their shared binary counted once), with how many there are. Other
/// `sandmand` processes on the machine (another test's, a real kubelet's pods) are not counted.
fn memory_kib(node_pids: &[u32]) -> BTreeMap<String, u64> {
    let me = std::process::id().to_string();
    let mut out = BTreeMap::new();
    let mut daemons = 0u64;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let comm = &stat[open + 1..close];
        let ppid = parent(&stat[close + 1..].split_whitespace().collect::<Vec<_>>());
        let pid_n = pid.parse::<u32>().unwrap_or(0);
        let field = |file: &str, key: &str| -> u64 {
            let text = std::fs::read_to_string(entry.path().join(file)).unwrap_or_default();
            let line = text.lines().find(|l| l.starts_with(key)).unwrap_or_default();
            line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
        };
        let name = match comm {
            _ if pid == me => "provider (this test)",
            _ if node_pids.contains(&pid_n) => "fake nodes",
            "kube-apiserver" => "API server",
            "etcd" => "etcd",
            "sandmand" if node_pids.contains(&ppid) => {
                daemons += 1;
                *out.entry("daemons".to_string()).or_default() += field("smaps_rollup", "Pss:");
                continue;
            }
            _ => continue,
        };
        *out.entry(name.to_string()).or_default() += field("status", "VmRSS:");
    }
    if let Some(kib) = out.remove("daemons") {
        out.insert(format!("{daemons} daemons"), kib);
    }
    out
}

/// How fast the API server took bare pod creates, and how busy it was meanwhile.
struct RawRate {
    /// Creates per second.
    rate: f64,
    /// The API server's CPU seconds per second (where it runs on this machine).
    api_cores: f64,
}

/// The API server's pace at pod creates, as a yardstick for the burst: `count` bare pods (one
/// container, no volumes, bound to a node that does not exist, so that nothing runs them), made
/// by `clients` clients at once, each one after another. They are deleted (at once: no kubelet
/// confirms them) before it answers.
async fn raw_pod_creates(world: &World, count: usize, clients: usize) -> RawRate {
    const RAW_LABEL: &str = "sandman.dev/e2e-raw";
    let nowhere = format!("sandman-nowhere-{}", unique());
    let mut apis = Vec::new();
    for _ in 0..clients {
        apis.push(Api::<Pod>::namespaced(world.client(None).await, &world.namespace));
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    println!("raw pod creates: {count} bare pods by {clients} clients start");
    let cpu_before = cpu_seconds(&world.node_pids());
    let started = Instant::now();
    let made = futures_util::future::join_all(apis.iter().map(|pods| {
        let (next, nowhere) = (next.clone(), nowhere.clone());
        async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    return;
                }
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("raw-{i:05}"), "labels": {RAW_LABEL: "true"}},
                    "spec": {"nodeName": nowhere, "automountServiceAccountToken": false,
                        "containers": [{"name": "c", "image": "busybox:e2e"}]}
                }))
                .unwrap();
                pods.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("raw pod create: {e}"));
            }
        }
    }));
    made.await;
    let rate = count as f64 / started.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(&world.node_pids());
    let api_cpu =
        cpu_after.get("API server").copied().unwrap_or(0.0) - cpu_before.get("API server").copied().unwrap_or(0.0);
    let etcd_cpu = cpu_after.get("etcd").copied().unwrap_or(0.0) - cpu_before.get("etcd").copied().unwrap_or(0.0);
    let idle = cpu_after.get("idle").copied().unwrap_or(0.0) - cpu_before.get("idle").copied().unwrap_or(0.0);
    let secs = count as f64 / rate;
    println!(
        "raw pod creates          {rate:.0}/s; cpu per create: API server {:.2} ms, etcd {:.2} ms; API server busy {:.2} cores, machine idle {:.0}%",
        api_cpu * 1e3 / count as f64,
        etcd_cpu * 1e3 / count as f64,
        api_cpu / secs,
        100.0 * idle / (2.0 * secs)
    );
    let pods = world.pods();
    let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    let raw = ListParams::default().labels(RAW_LABEL);
    pods.delete_collection(&now, &raw).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !pods.list(&raw.clone().limit(1)).await.unwrap().items.is_empty() {
        assert!(Instant::now() < deadline, "raw pods left 120 s after their deletion");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    RawRate { rate, api_cores: api_cpu / secs }
}

async fn check_health(endpoint: &Endpoint) -> Result<(), String> {
    let addr = addr(endpoint);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call(&addr, "GET", "/v1/health", None, None).await {
            Ok((200, _)) => return Ok(()),
            other if Instant::now() > deadline => return Err(format!("{addr} not healthy: {other:?}")),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// The most of `times` that fall within any window of `window` (times sorted first).
fn most_in_window(times: &[Instant], window: Duration) -> usize {
    let mut sorted = times.to_vec();
    sorted.sort();
    let mut most = 0;
    let mut start = 0;
    for end in 0..sorted.len() {
        while sorted[end] - sorted[start] >= window {
            start += 1;
        }
        most = most.max(end - start + 1);
    }
    most
}

// ---- prepare, on the fake node ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes API server (SANDMAN_E2E_KUBECONFIG)"]
async fn prepare_pulls_on_the_fake_node_on_a_real_api_server() {
    let _cluster = cluster_lock().await;
    prepare_suite(World::new(e2e_kubeconfig(), "prep", "127.5.0.1").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_and_the_fake_node_pass_on_a_mocked_api_server() {
    let mocked = Mocked::start().await;
    prepare_suite(World::new(mocked.kubeconfig.clone(), "prep", "127.6.0.1").await.on_the_mock()).await;
}

/// Every progress line sent so far.
fn drain(rx: &mut tokio::sync::mpsc::UnboundedReceiver<NodeProgress>) -> Vec<NodeProgress> {
    let mut lines = Vec::new();
    while let Ok(line) = rx.try_recv() {
        lines.push(line);
    }
    lines
}

/// Prepares an image the fake node "pulls" and one it refuses, then checks no pull pod is left.
async fn prepare_suite(world: World) {
    let mut config = world.config();
    // Only this run's node: a real API server may hold fake nodes of other runs.
    config.node_selector.insert("kubernetes.io/hostname".into(), world.node_name().to_string());
    // A node controller (if the server has one) lifts this taint a moment after the node is Ready.
    config.tolerations.push(Toleration {
        key: Some("node.kubernetes.io/not-ready".into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Toleration::default()
    });
    config.prepare_timeout_s = 120;
    let p = KubeProvider::new(world.client(None).await, config).unwrap();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let prepared = p.prepare("busybox:e2e", tx).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(prepared, Prepared { nodes_ready: 1, nodes_total: 1 });
    let lines = drain(&mut rx);
    let states: Vec<NodeState> = lines.iter().map(|l| l.state).collect();
    assert_eq!(states, [NodeState::Pulling, NodeState::Ready], "{lines:?}");
    assert!(lines.iter().all(|l| l.node == world.node_name() && l.nodes_total == 1), "{lines:?}");

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    match p.prepare(MISSING, tx).await {
        Err(ProviderError::Failed { reason: Reason::ImagePullFailed, message }) => {
            assert!(message.contains(MISSING), "{message}")
        }
        other => panic!("a missing image was prepared: {other:?}"),
    }
    let lines = drain(&mut rx);
    let last = lines.last().unwrap_or_else(|| panic!("no progress"));
    assert_eq!(last.state, NodeState::Failed);
    assert!(last.message.contains("ErrImagePull"), "{}", last.message);

    // The pull pods are gone once the fake node has confirmed their deletion.
    let pods = world.pods();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = pods.list(&ListParams::default().labels("sandman.dev/prepare")).await.unwrap().items.len();
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} pull pods left 60 s after prepare");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    world.tear_down().await;
}

// ---- warm-pool claims: two servers, one pod ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes API server (SANDMAN_E2E_KUBECONFIG)"]
async fn two_servers_claiming_one_pool_pod_at_once_exactly_one_wins_on_a_real_api_server() {
    let _cluster = cluster_lock().await;
    claim_race(World::new(e2e_kubeconfig(), "claim", "127.7.0.1").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_claiming_one_pool_pod_at_once_exactly_one_wins_on_a_mocked_api_server() {
    let mocked = Mocked::start().await;
    claim_race(World::new(mocked.kubeconfig.clone(), "claim", "127.8.0.1").await.on_the_mock()).await;
}

/// Two providers on the same namespace and instance (two servers) claim each pool pod at the
/// same moment: for every pod exactly one claim wins and the other is `Claimed`; the pod carries
/// the winner's claim, which a third provider lists, and its daemon still answers.
async fn claim_race(world: World) {
    let first = Arc::new(KubeProvider::new(world.client(None).await, world.config()).unwrap());
    let second = Arc::new(KubeProvider::new(world.client(None).await, world.config()).unwrap());
    let pools: Vec<SandboxSpec> = (0..5)
        .map(|i| {
            let mut s = spec(&format!("pool{i}"), "busybox:e2e");
            s.job = None;
            s.labels = BTreeMap::from([("sandman.dev/pool".to_string(), "warm".to_string())]);
            s
        })
        .collect();
    for r in futures_util::future::join_all(pools.iter().map(|s| first.create(s))).await {
        r.unwrap_or_else(|e| panic!("a pool sandbox was not created: {e}"));
    }
    let mut winners: BTreeMap<String, sandman_provider::Claim> = BTreeMap::new();
    for (i, pool) in pools.iter().enumerate() {
        let claims: Vec<sandman_provider::Claim> = ["a", "b"]
            .iter()
            .map(|who| {
                let mut s = pool.clone();
                s.job = Some(format!("claimer-{who}"));
                s.created_at_ms = 1_700_000_100_000 + i as u64;
                sandman_provider::Claim {
                    spec: s,
                    env: BTreeMap::from([("CLAIMER".to_string(), (*who).to_string())]),
                    claimed_ms: 1_700_000_100_000 + i as u64,
                    pool_created_ms: pool.created_at_ms,
                }
            })
            .collect();
        // Each on its own task, so that both are in flight at once.
        let (a, b) = (claims[0].clone(), claims[1].clone());
        let (p1, p2) = (first.clone(), second.clone());
        let t1 = tokio::spawn(async move { p1.claim(&a).await });
        let t2 = tokio::spawn(async move { p2.claim(&b).await });
        let results = [t1.await.unwrap(), t2.await.unwrap()];
        let won: Vec<usize> = (0..2).filter(|k| results[*k].is_ok()).collect();
        assert_eq!(won.len(), 1, "{}: not exactly one claim won: {results:?}", pool.id);
        let lost = &results[1 - won[0]];
        assert!(matches!(lost, Err(ProviderError::Claimed(m)) if m.contains(&pool.id)), "{}: {lost:?}", pool.id);
        winners.insert(pool.id.clone(), claims[won[0]].clone());
    }

    // What the pods carry, and what a third server finds.
    let pods = world.pods();
    for (id, claim) in &winners {
        let pod = pods.get(&format!("sandman-{id}")).await.unwrap();
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get("sandman.dev/claimed").map(String::as_str), Some("true"), "{id}");
        assert_eq!(labels.get("sandman.dev/job"), claim.spec.job.as_ref(), "{id}");
        let text = serde_json::to_string(&pod.metadata.annotations).unwrap();
        assert!(!text.contains(&claim.spec.token), "{id}: the token is in the pod's annotations");
    }
    let third = KubeProvider::new(world.client(None).await, world.config()).unwrap();
    let records = third.list().await.unwrap();
    assert_eq!(records.len(), pools.len());
    for r in &records {
        let claim = &winners[&r.spec.id];
        assert_eq!(r.claim.as_ref(), Some(claim), "{}: the listed claim", r.spec.id);
        assert_eq!(r.spec, claim.spec, "{}: the listed spec is the claimed one", r.spec.id);
        check_daemon(r.endpoint.clone(), r.spec.token.clone()).await.unwrap();
    }

    for pool in &pools {
        third.delete(&pool.id).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pods.list(&ListParams::default()).await.unwrap().items.is_empty() {
        assert!(Instant::now() < deadline, "pods left behind");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    world.tear_down().await;
}

// ---- eval, on a real kubelet ----

/// `kubectl port-forward` to a pod's daemon port; killed on drop. The test reaches the daemon on
/// loopback, wherever the pod runs.
struct PortForward {
    /// Held only to be killed on drop.
    _child: tokio::process::Child,
    addr: String,
}

impl PortForward {
    async fn start(kubeconfig: &Path, namespace: &str, pod: &str, port: u16) -> PortForward {
        let mut child = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "-n",
                namespace,
                "port-forward",
                "--address",
                "127.0.0.1",
                &format!("pod/{pod}"),
                &format!(":{port}"),
            ])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run kubectl (needed for port-forward): {e}"));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // "Forwarding from 127.0.0.1:41234 -> 7778"
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("kubectl port-forward said nothing within 60 s"))
            .unwrap()
            .unwrap_or_else(|| panic!("kubectl port-forward exited"));
        let addr = line
            .strip_prefix("Forwarding from ")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("unexpected kubectl output: {line}"))
            .to_string();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        PortForward { _child: child, addr }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster with a kubelet (SANDMAN_E2E_KUBECONFIG, SANDMAN_E2E_DAEMON_IMAGE) and kubectl"]
async fn an_eval_sandbox_is_guaranteed_and_its_daemon_sees_what_applied_reports() {
    let _cluster = cluster_lock().await;
    let kubeconfig = e2e_kubeconfig();
    let (daemon_image, task_image) = kubelet_images();
    let pids: u64 = env_or("SANDMAN_E2E_POD_PIDS_LIMIT", 1024);
    let client = client(&kubeconfig, None).await;
    sweep_leftovers(&client).await;
    let namespace = format!("sandman-e2e-eval-{}", unique());
    let registered = Registered::namespace(&client, &kubeconfig, namespace.clone(), Vec::new()).await;
    let config = KubeConfig {
        namespace: namespace.clone(),
        daemon_image,
        pod_pids_limit: Some(pids),
        manage_network_policy: true,
        ..KubeConfig::default()
    };
    let p = KubeProvider::new(client.clone(), config).unwrap();

    let mut s = spec("e1", &task_image);
    s.profile = Profile::Eval;
    s.resources = Resources {
        cpu: Some(Quantity::Text("500m".into())),
        memory: Some(Quantity::Text("256Mi".into())),
        ..Resources::default()
    };
    p.create(&s).await.unwrap_or_else(|e| panic!("the eval sandbox was not created: {e}"));

    // Guaranteed, as the API server classed it: requests = limits in every container.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = pods.get("sandman-e1").await.unwrap();
    let status = pod.status.clone().unwrap();
    assert_eq!(status.qos_class.as_deref(), Some("Guaranteed"));
    let spec_of_pod = pod.spec.clone().unwrap();
    for c in spec_of_pod.containers.iter().chain(spec_of_pod.init_containers.iter().flatten()) {
        let r = c.resources.clone().unwrap();
        assert_eq!(r.requests, r.limits, "{}: requests differ from limits", c.name);
    }

    // What the provider reports it applied.
    let applied = p.applied("e1").await.unwrap();
    assert_eq!(applied.cpu, Some(0.5));
    assert_eq!(applied.memory, Some(256 * 1024 * 1024));
    assert_eq!(applied.swap, Some(0));
    assert_eq!(applied.pids, Some(pids));
    assert_eq!(applied.network.as_deref(), Some("policy"));
    assert_eq!((applied.timezone.as_deref(), applied.locale.as_deref()), (Some("UTC"), Some("C.UTF-8")));
    let image_id = status.container_statuses.iter().flatten().find(|c| c.name == "task").unwrap().image_id.clone();
    assert!(image_id.contains("sha256:"), "the runtime named no digest: {image_id}");
    assert_eq!(applied.image.as_deref(), Some(image_id.as_str()), "the record names the digest that runs");

    // What the daemon sees from inside equals it.
    let forward = PortForward::start(&kubeconfig, &namespace, "sandman-e1", 7778).await;
    check_health(&Endpoint::Tcp(forward.addr.clone())).await.unwrap();
    let (code, observed) = call(&forward.addr, "GET", "/v1/conditions", Some(&s.token), None).await.unwrap();
    assert_eq!(code, 200, "{observed}");
    let observed: Observed = serde_json::from_value(observed).unwrap();
    assert_eq!(observed.cgroup_cpu_limit, applied.cpu, "cpu limit seen inside");
    assert_eq!(observed.cgroup_memory_limit, applied.memory, "memory limit seen inside");
    if observed.cgroup_swap_limit.is_some() {
        assert_eq!(observed.cgroup_swap_limit, applied.swap, "swap limit seen inside (cgroup v2)");
    }
    assert_eq!(observed.timezone, applied.timezone);
    assert_eq!(observed.locale, applied.locale);
    let (code, out) = call(
        &forward.addr,
        "POST",
        "/v1/exec",
        Some(&s.token),
        Some(json!({"argv": ["/bin/sh", "-c", "echo \"$TZ $LC_ALL $LANG\""]})),
    )
    .await
    .unwrap();
    assert_eq!((code, out["stdout"].as_str()), (200, Some("UTC C.UTF-8 C.UTF-8\n")), "{out}");

    drop(forward);
    p.delete("e1").await.unwrap();
    registered.remove().await;
}

/// `injection: image_volume` on a real kubelet whose runtime mounts image volumes (containerd
/// 2.1+; `./scripts/e2e-kube` leaves this test out, saying so, where no node's runtime does): the
/// provider's start check passes, the pod gets the daemon image as a volume with no init
/// container, the daemon runs from it and answers, and the volume cannot be written from inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster with a kubelet whose runtime mounts image volumes (SANDMAN_E2E_KUBECONFIG, SANDMAN_E2E_DAEMON_IMAGE)"]
async fn a_sandbox_gets_its_daemon_from_an_image_volume_on_a_real_kubelet() {
    let _cluster = cluster_lock().await;
    let kubeconfig = e2e_kubeconfig();
    let (daemon_image, task_image) = kubelet_images();
    let client = client(&kubeconfig, None).await;
    sweep_leftovers(&client).await;
    let namespace = format!("sandman-e2e-imgvol-{}", unique());
    let registered = Registered::namespace(&client, &kubeconfig, namespace.clone(), Vec::new()).await;
    let config = KubeConfig {
        namespace: namespace.clone(),
        daemon_image: daemon_image.clone(),
        injection: Injection::ImageVolume,
        manage_network_policy: false,
        ..KubeConfig::default()
    };
    sandman_provider_kube::check_runtimes(&client, &config).await.unwrap_or_else(|e| {
        panic!("the provider would refuse to start (run ./scripts/k8s-local-containerd on the local cluster): {e}")
    });
    let p = KubeProvider::new(client.clone(), config).unwrap();

    let s = spec("iv1", &task_image);
    let endpoint = p.create(&s).await.unwrap_or_else(|e| panic!("the sandbox was not created: {e}"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod_spec = pods.get("sandman-iv1").await.unwrap().spec.unwrap();
    assert!(pod_spec.init_containers.unwrap_or_default().is_empty(), "an init container beside the image volume");
    let images: Vec<String> =
        pod_spec.volumes.iter().flatten().filter_map(|v| v.image.as_ref().and_then(|i| i.reference.clone())).collect();
    assert_eq!(images, vec![daemon_image], "the pod's image volumes");

    let Endpoint::Tcp(addr) = endpoint else { panic!("not a TCP endpoint: {endpoint:?}") };
    echo(&addr, &s.token).await.unwrap();
    // The daemon is the image volume's file, and the volume is read-only.
    let script = format!("head -c 4 {DAEMON_PATH} | tail -c 3; echo; touch {DAEMON_DIR}/x && echo writable");
    let (code, out) = call(&addr, "POST", "/v1/exec", Some(&s.token), Some(json!({"argv": ["/bin/sh", "-c", script]})))
        .await
        .unwrap();
    assert_eq!(code, 200, "{out}");
    let stdout = out["stdout"].as_str().unwrap_or_default();
    assert!(stdout.starts_with("ELF\n"), "{DAEMON_PATH} is not the daemon: {out}");
    assert!(!stdout.contains("writable"), "the daemon's volume is writable from inside: {out}");
    assert!(out["stderr"].as_str().unwrap_or_default().contains("Read-only file system"), "{out}");

    p.delete("iv1").await.unwrap();
    registered.remove().await;
}

// ---- capacity-aware admission, on a real kubelet ----

/// `echo hi` through the daemon at `addr` (any address: a real pod's IP here).
async fn echo(addr: &str, token: &str) -> Result<(), String> {
    let (status, out) = call(addr, "POST", "/v1/exec", Some(token), Some(json!({"argv": ["/bin/echo", "hi"]}))).await?;
    if status == 200 && out["exit_code"] == 0 && out["stdout"] == "hi\n" {
        Ok(())
    } else {
        Err(format!("exec at {addr}: {status} {out}"))
    }
}

/// A rollout asking more cpu than the node has: 200 episodes of 100m each (create, three execs,
/// release), 60 under way at a time, on a real kubelet's node, with the provider's default
/// configuration. Capacity-aware admission is on by default (a new user's first rollout failed
/// 40 of 60 `unschedulable` while it had to be asked for): every one completes, and the API
/// server never holds more sandbox pods the scheduler found no room for than the default bound;
/// a create asking 64 cpu fails at once with `unschedulable`, naming the largest node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster with a kubelet (SANDMAN_E2E_KUBECONFIG, SANDMAN_E2E_DAEMON_IMAGE)"]
async fn a_rollout_beyond_the_nodes_room_waits_for_capacity_and_none_fails() {
    let _cluster = cluster_lock().await;
    let kubeconfig = e2e_kubeconfig();
    let (daemon_image, task_image) = kubelet_images();
    let episodes: usize = env_or("SANDMAN_E2E_EPISODES", 200);
    let at_once: usize = env_or("SANDMAN_E2E_EPISODES_AT_ONCE", 60);
    let client = client(&kubeconfig, None).await;
    sweep_leftovers(&client).await;
    let namespace = format!("sandman-e2e-cap-{}", unique());
    let registered = Registered::namespace(&client, &kubeconfig, namespace.clone(), Vec::new()).await;
    // The default configuration but for where the pods go and what the daemon image is.
    let config = KubeConfig {
        namespace: namespace.clone(),
        daemon_image,
        manage_network_policy: false,
        ..KubeConfig::default()
    };
    let max_pending = config.admission().map(|c| c.max_pending).expect("capacity-aware admission is on by default");
    let p = Arc::new(KubeProvider::new(client.clone(), config).unwrap());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    // What the creates that wait tell the server (which passes it on as their progress events).
    let mut progress = p.progress().unwrap();
    let told = tokio::spawn(async move {
        let mut waits = Vec::new();
        while let Some(line) = progress.recv().await {
            if line.message.starts_with("waiting for capacity (") {
                waits.push(line);
            }
        }
        waits
    });

    // Never: more cpu than any node has.
    let mut big = spec("never", &task_image);
    big.resources = Resources { cpu: Some(Quantity::Text("64".into())), ..Resources::default() };
    match tokio::time::timeout(Duration::from_secs(60), p.create(&big))
        .await
        .unwrap_or_else(|_| panic!("a create of 64 cpu waited"))
    {
        Err(ProviderError::Failed { reason: Reason::Unschedulable, message }) => {
            assert!(message.contains("largest eligible node"), "{message}")
        }
        other => panic!("a create of 64 cpu was not refused as unschedulable: {other:?}"),
    }
    assert!(pods.get_opt("sandman-never").await.unwrap().is_none(), "a pod was made for a request that can never fit");

    // The sandbox pods the scheduler found no room for (unbound, `PodScheduled: False`), watched
    // through the rollout. (Pods that fit, not yet bound, are not bounded: the scheduler places
    // them at once.)
    let most_pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let watcher = {
        let (pods, most, stop) = (pods.clone(), most_pending.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let list = pods.list(&ListParams::default()).await.unwrap();
                let pending = list
                    .items
                    .iter()
                    .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter(|p| {
                        let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
                        conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "PodScheduled" && c.status == "False"))
                    })
                    .count();
                most.fetch_max(pending, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let started = Instant::now();
    let results = futures_util::stream::iter((0..episodes).map(|i| {
        let p = p.clone();
        let task_image = task_image.clone();
        async move {
            let mut s = spec(&format!("ep{i:03}"), &task_image);
            s.resources = Resources { cpu: Some(Quantity::Text("100m".into())), ..Resources::default() };
            let endpoint = p.create(&s).await.map_err(|e| format!("{}: {e}", s.id))?;
            let Endpoint::Tcp(addr) = endpoint else { return Err(format!("{}: not a TCP endpoint", s.id)) };
            for _ in 0..3 {
                echo(&addr, &s.token).await.map_err(|e| format!("{}: {e}", s.id))?;
            }
            p.delete(&s.id).await.map_err(|e| format!("{}: delete: {e}", s.id))?;
            Ok::<_, String>(())
        }
    }))
    .buffer_unordered(at_once)
    .collect::<Vec<_>>()
    .await;
    let span = started.elapsed();
    stop.cancel();
    watcher.await.unwrap();
    let failed: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failed.is_empty(), "{} of {episodes} episodes failed: {:?}", failed.len(), &failed[..failed.len().min(10)]);
    let most = most_pending.load(std::sync::atomic::Ordering::Relaxed);
    assert!(most <= max_pending, "{most} unscheduled sandbox pods at once, over the bound of {max_pending}");
    println!(
        "capacity rollout: {episodes} episodes of 100m, {at_once} at a time, in {:.1} s; at most {most} unscheduled pods (bound {max_pending})",
        span.as_secs_f64()
    );

    let deadline = Instant::now() + Duration::from_secs(120);
    while !pods.list(&ListParams::default()).await.unwrap().items.is_empty() {
        assert!(Instant::now() < deadline, "pods left 120 s after the rollout");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The channel ends with the provider; creates beyond the room told where they waited.
    drop(p);
    let waits = tokio::time::timeout(Duration::from_secs(10), told).await.unwrap().unwrap();
    // (The 64-cpu create may have told one too, waiting for the first look at the nodes.)
    let episodes_told = waits.iter().filter(|w| w.id.starts_with("ep")).count();
    assert!(episodes_told > 0, "no episode told that it waited for capacity: {waits:?}");
    println!("capacity rollout: {episodes_told} progress lines of episodes waiting for capacity");
    registered.remove().await;
}

/// The most CPU any node of the cluster can give pods (its allocatable cores).
async fn most_node_cpu(client: &Client) -> f64 {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|n| n.status.as_ref()?.allocatable.as_ref()?.get("cpu").cloned())
        .filter_map(|q| Quantity::Text(q.0).value().ok())
        .fold(0.0, f64::max)
}

/// Fair shares on a real kubelet's node: job `a` asks for more 100m sandboxes than the node holds
/// and keeps them; job `b` arrives later, while `a`'s surplus waits. Every one of `b`'s creates
/// waits ahead of every one of `a`'s (`b` holds nothing, `a` the node), and as `a` releases
/// sandboxes the room goes to `b` first: all of `b`'s leave the queue no later than any of `a`'s
/// that waited when `b` came, and every create of both completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster with a kubelet (SANDMAN_E2E_KUBECONFIG, SANDMAN_E2E_DAEMON_IMAGE)"]
async fn a_job_arriving_while_another_holds_the_node_gets_the_room_that_frees_first() {
    let _cluster = cluster_lock().await;
    let kubeconfig = e2e_kubeconfig();
    let (daemon_image, task_image) = kubelet_images();
    let client = client(&kubeconfig, None).await;
    let namespace = format!("sandman-e2e-fair-{}", unique());
    let registered = Registered::namespace(&client, &kubeconfig, namespace.clone(), Vec::new()).await;
    // What one node holds of 100m sandboxes, and then some: `a` always has creates waiting.
    let most_cpu = most_node_cpu(&client).await;
    let a_count = (most_cpu * 10.0) as usize + 10;
    let b_count = 6;
    let config = KubeConfig {
        namespace: namespace.clone(),
        daemon_image,
        manage_network_policy: false,
        capacity: CapacityConfig { max_pending: 2, ..CapacityConfig::default() },
        ..KubeConfig::default()
    };
    let p = Arc::new(KubeProvider::new(client.clone(), config).unwrap());
    let sandbox = |job: &str, i: usize| {
        let mut s = spec(&format!("{job}{i:02}"), &task_image);
        s.job = Some(job.to_string());
        s.resources = Resources { cpu: Some(Quantity::Text("100m".into())), ..Resources::default() };
        s
    };
    let a: Vec<SandboxSpec> = (0..a_count).map(|i| sandbox("a", i)).collect();
    let b: Vec<SandboxSpec> = (0..b_count).map(|i| sandbox("b", i)).collect();
    // Each create, kept once ready: the ready ones answer their token.
    let ready = Arc::new(Mutex::new(Vec::<(String, String, String)>::new()));
    let start = |s: SandboxSpec| {
        let (p, ready) = (p.clone(), ready.clone());
        tokio::spawn(async move {
            let endpoint = p.create(&s).await.map_err(|e| format!("{}: {e}", s.id))?;
            let Endpoint::Tcp(addr) = endpoint else { return Err(format!("{}: not a TCP endpoint", s.id)) };
            echo(&addr, &s.token).await?;
            ready.lock().unwrap().push((s.id.clone(), addr, s.token.clone()));
            Ok::<_, String>(())
        })
    };
    // When each create left the queue, polled (a create that never waited left at once).
    let left = Arc::new(Mutex::new(BTreeMap::<String, Instant>::new()));
    let waited = Arc::new(Mutex::new(std::collections::BTreeSet::<String>::new()));
    let stop = tokio_util::sync::CancellationToken::new();
    let poller = {
        let (p, left, waited, stop) = (p.clone(), left.clone(), waited.clone(), stop.clone());
        let ids: Vec<String> = a.iter().chain(&b).map(|s| s.id.clone()).collect();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for id in &ids {
                    if p.waiting(id).is_some() {
                        waited.lock().unwrap().insert(id.clone());
                    } else if waited.lock().unwrap().contains(id) {
                        left.lock().unwrap().entry(id.clone()).or_insert_with(Instant::now);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    let mut tasks: Vec<_> = a.iter().cloned().map(start).collect();
    // Until the node is full and `a`'s surplus waits.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        // (Before the watches have listed, every create waits for an eligible node.)
        let waits: Vec<_> = a.iter().filter_map(|s| p.waiting(&s.id)).collect();
        let waiting = waits.len();
        let held = ready.lock().unwrap().len();
        let for_room = waits.iter().all(|w| w.resource != sandman_provider_kube::capacity::Resource::Nodes);
        if waiting >= 3 && for_room && held > 0 && held + waiting + 2 >= a_count {
            break;
        }
        assert!(Instant::now() < deadline, "job a never filled the node: {held} ready, {waiting} waiting");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tasks.extend(b.iter().cloned().map(start));
    let deadline = Instant::now() + Duration::from_secs(60);
    while b.iter().any(|s| p.waiting(&s.id).is_none()) {
        let places: Vec<_> = b.iter().map(|s| p.waiting(&s.id)).collect();
        assert!(Instant::now() < deadline, "job b's creates did not all wait: {places:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every one of b's waits ahead of every one of a's.
    let places = |specs: &[SandboxSpec]| -> Vec<usize> {
        specs.iter().filter_map(|s| p.waiting(&s.id)).map(|w| w.position).collect()
    };
    let (a_places, b_places) = (places(&a), places(&b));
    let a_waiting: Vec<String> = a.iter().filter(|s| p.waiting(&s.id).is_some()).map(|s| s.id.clone()).collect();
    assert!(
        b_places.iter().max() < a_places.iter().min(),
        "job b (holding nothing) waits behind job a (holding the node): b at {b_places:?}, a at {a_places:?}"
    );

    // a releases what it holds, one sandbox a second: the room goes to b first.
    let deadline = Instant::now() + Duration::from_secs(400);
    while !tasks.iter().all(|t| t.is_finished()) {
        assert!(Instant::now() < deadline, "the creates did not all complete");
        let next = {
            let mut r = ready.lock().unwrap();
            let at = r.iter().position(|(id, _, _)| id.starts_with('a'));
            at.map(|at| r.remove(at))
        };
        if let Some((id, _, _)) = next {
            p.delete(&id).await.unwrap_or_else(|e| panic!("delete {id}: {e}"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.cancel();
    poller.await.unwrap();
    let failed: Vec<String> =
        futures_util::future::join_all(tasks).await.into_iter().filter_map(|r| r.unwrap().err()).collect();
    assert!(failed.is_empty(), "creates failed: {failed:?}");
    let left = left.lock().unwrap().clone();
    let b_last = b.iter().map(|s| left[&s.id]).max().unwrap();
    let a_first = a_waiting.iter().filter_map(|id| left.get(id)).min().copied().unwrap();
    assert!(
        b_last <= a_first,
        "one of a's waiting creates left the queue {:?} before b's last",
        b_last.saturating_duration_since(a_first)
    );
    println!(
        "fair shares: job a {a_count} creates ({} waited when b came), job b {b_count}: b at places {b_places:?}, a from {:?}; b's last left the queue {:.1} s before a's first",
        a_waiting.len(),
        a_places.iter().min(),
        a_first.saturating_duration_since(b_last).as_secs_f64()
    );
    let kept: Vec<(String, String, String)> = std::mem::take(&mut *ready.lock().unwrap());
    for (id, _, _) in kept {
        p.delete(&id).await.unwrap_or_else(|e| panic!("delete {id}: {e}"));
    }
    registered.remove().await;
}

/// Weighted shares on a real kubelet's node, with the provider's default configuration: job
/// `filler` holds the node (its surplus waiting); jobs `light` (weight 1) and `heavy` (weight 3)
/// then queue together, holding nothing. As `filler` releases a sandbox a second, the room that
/// frees goes to `light` and `heavy` 1:3: in every prefix of the order their creates leave the
/// queue, `light` has a quarter of them, give or take one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster with a kubelet (SANDMAN_E2E_KUBECONFIG, SANDMAN_E2E_DAEMON_IMAGE)"]
async fn two_jobs_weighted_one_to_three_get_the_room_that_frees_one_to_three() {
    let _cluster = cluster_lock().await;
    let kubeconfig = e2e_kubeconfig();
    let (daemon_image, task_image) = kubelet_images();
    let client = client(&kubeconfig, None).await;
    let namespace = format!("sandman-e2e-weight-{}", unique());
    let registered = Registered::namespace(&client, &kubeconfig, namespace.clone(), Vec::new()).await;
    let most_cpu = most_node_cpu(&client).await;
    let config = KubeConfig {
        namespace: namespace.clone(),
        daemon_image,
        manage_network_policy: false,
        ..KubeConfig::default()
    };
    let max_pending = config.admission().map(|c| c.max_pending).expect("capacity-aware admission is on by default");
    let p = Arc::new(KubeProvider::new(client.clone(), config).unwrap());
    let sandbox = |job: &str, weight: f64, i: usize| {
        let mut s = spec(&format!("{job}{i:02}"), &task_image);
        s.job = Some(job.to_string());
        s.server.weight = Some(weight);
        s.resources = Resources { cpu: Some(Quantity::Text("100m".into())), ..Resources::default() };
        s
    };
    let filler_count = (most_cpu * 10.0) as usize + max_pending + 4;
    let filler: Vec<SandboxSpec> = (0..filler_count).map(|i| sandbox("filler", 1.0, i)).collect();
    let (light_count, heavy_count) = (3, 9);
    // Interleaved, so that neither is first in line by arrival alone.
    let mut contenders = Vec::new();
    for i in 0..light_count {
        contenders.push(sandbox("light", 1.0, i));
        contenders.extend((3 * i..3 * i + 3).map(|j| sandbox("heavy", 3.0, j)));
    }
    assert_eq!(contenders.len(), light_count + heavy_count);
    let ready = Arc::new(Mutex::new(Vec::<String>::new()));
    let start = |s: SandboxSpec| {
        let (p, ready) = (p.clone(), ready.clone());
        tokio::spawn(async move {
            let endpoint = p.create(&s).await.map_err(|e| format!("{}: {e}", s.id))?;
            let Endpoint::Tcp(addr) = endpoint else { return Err(format!("{}: not a TCP endpoint", s.id)) };
            echo(&addr, &s.token).await?;
            ready.lock().unwrap().push(s.id.clone());
            Ok::<_, String>(())
        })
    };
    // The order the contenders leave the queue, polled.
    let order = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = tokio_util::sync::CancellationToken::new();
    let poller = {
        let (p, order, stop) = (p.clone(), order.clone(), stop.clone());
        let ids: Vec<String> = contenders.iter().map(|s| s.id.clone()).collect();
        tokio::spawn(async move {
            let mut waited = std::collections::BTreeSet::new();
            while !stop.is_cancelled() {
                for id in &ids {
                    if p.waiting(id).is_some() {
                        waited.insert(id.clone());
                    } else if waited.remove(id) {
                        order.lock().unwrap().push(id.clone());
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    let mut tasks: Vec<_> = filler.iter().cloned().map(start).collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let waits: Vec<_> = filler.iter().filter_map(|s| p.waiting(&s.id)).collect();
        let held = ready.lock().unwrap().len();
        let for_room = waits.iter().all(|w| w.resource != sandman_provider_kube::capacity::Resource::Nodes);
        if waits.len() >= 3 && for_room && held > 0 && held + waits.len() + max_pending >= filler_count {
            break;
        }
        assert!(Instant::now() < deadline, "job filler never filled the node: {held} ready, {} waiting", waits.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let held = ready.lock().unwrap().len();
    // Each contender leaves the queue on a release of filler's, after filler's pending ones.
    assert!(
        held >= light_count + heavy_count + max_pending,
        "the node holds {held} sandboxes of 100m, too few to tell shares"
    );
    tasks.extend(contenders.iter().cloned().map(start));
    let deadline = Instant::now() + Duration::from_secs(60);
    while contenders.iter().any(|s| p.waiting(&s.id).is_none()) {
        assert!(Instant::now() < deadline, "the contenders did not all wait");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // filler releases what it holds, one sandbox a second, until every contender has left the
    // queue; then everything else goes.
    let deadline = Instant::now() + Duration::from_secs(400);
    while order.lock().unwrap().len() < contenders.len() {
        assert!(Instant::now() < deadline, "the contenders did not all leave the queue: {:?}", order.lock().unwrap());
        let next = {
            let mut r = ready.lock().unwrap();
            r.iter().position(|id| id.starts_with("filler")).map(|at| r.remove(at))
        };
        if let Some(id) = next {
            p.delete(&id).await.unwrap_or_else(|e| panic!("delete {id}: {e}"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.cancel();
    poller.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(400);
    while !tasks.iter().all(|t| t.is_finished()) {
        assert!(Instant::now() < deadline, "the creates did not all complete");
        let next = ready.lock().unwrap().pop();
        if let Some(id) = next {
            p.delete(&id).await.unwrap_or_else(|e| panic!("delete {id}: {e}"));
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let failed: Vec<String> =
        futures_util::future::join_all(tasks).await.into_iter().filter_map(|r| r.unwrap().err()).collect();
    assert!(failed.is_empty(), "creates failed: {failed:?}");
    let order = order.lock().unwrap().clone();
    let mut light = 0usize;
    for (n, id) in order.iter().enumerate() {
        light += usize::from(id.starts_with("light"));
        let expected = (n + 1) as f64 / 4.0;
        assert!(
            (light as f64 - expected).abs() <= 1.0,
            "after {} creates left the queue, {light} were light's (weight 1 of 4: {expected}): {order:?}",
            n + 1
        );
    }
    println!(
        "weighted shares: light (1) and heavy (3) behind a full node, served in the order {:?}: light {light} of {}",
        order.iter().map(|id| if id.starts_with("light") { 'L' } else { 'H' }).collect::<String>(),
        order.len()
    );
    let left = std::mem::take(&mut *ready.lock().unwrap());
    for id in left {
        let _ = p.delete(&id).await;
    }
    registered.remove().await;
}

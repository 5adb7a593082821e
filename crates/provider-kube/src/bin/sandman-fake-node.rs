//! `sandman-fake-node`: a kubelet stand-in for testing the Kubernetes provider on a real API
//! server that has no kubelet. It registers a Node, binds the pending sandbox pods of its
//! scheduler name to itself, runs each pod's `sandmand` as a local process on a loopback address
//! of its own (127.x.y.z, never any other address), writes pod status as a kubelet would, fails
//! the images and OOM-kills the pods it is told to, and kills the process when the pod is deleted.
//! The pull pods of `prepare` (label `sandman.dev/prepare`) it "pulls": they succeed at once, or
//! fail with `ErrImagePull` for the images it is told to fail.
//! Its daemons die with it however it ends (a parent-death signal), an address something
//! already listens at is never handed out, and on SIGTERM it deletes its Node.
//! It is part of the tests (`tests/e2e.rs`); `docs/kubernetes.md` says how to run it by hand.
#![allow(clippy::print_stdout)]

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Container, Node, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::process::Command;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const FAKE_TAINT: &str = "sandman.dev/fake";
/// The Node's annotation naming the namespace whose pods it runs, so that whoever sweeps up
/// after a run that ended badly knows what went with it.
const NAMESPACE_ANNOTATION: &str = "sandman.dev/fake-node-namespace";
const TASK: &str = "task";
const INIT: &str = "sandman-init";
/// The label and container of the pull pods of `prepare`.
const PREPARE_LABEL: &str = "sandman.dev/prepare";
const PULL: &str = "pull";
const HEARTBEAT: Duration = Duration::from_secs(10);
/// How long a started daemon may take to listen before its pod is failed.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Parser)]
#[command(name = "sandman-fake-node", about = "A fake kubelet running sandbox daemons as local processes")]
struct Args {
    /// Kubeconfig of the API server (else $KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "SANDMAN_E2E_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Namespace whose sandbox pods this node runs.
    #[arg(long)]
    namespace: String,
    #[arg(long, default_value = "sandman-fake-node-0")]
    node_name: String,
    /// Pending pods with this `schedulerName` are bound to this node.
    #[arg(long, default_value = "sandman-fake-scheduler")]
    scheduler_name: String,
    /// The `sandmand` binary to run for each pod.
    #[arg(long, env = "SANDMAN_DAEMON")]
    daemon: PathBuf,
    /// Where each pod's token, working directory and daemon log go.
    #[arg(long)]
    state_dir: PathBuf,
    /// Pods whose task image contains this fail to pull it (ErrImagePull). Repeatable.
    #[arg(long = "fail-image")]
    fail_images: Vec<String>,
    /// Pods whose task image contains this are OOM-killed once running. Repeatable.
    #[arg(long = "oom-image")]
    oom_images: Vec<String>,
    /// How long an OOM-marked pod runs before it is killed.
    #[arg(long, default_value_t = 500)]
    oom_after_ms: u64,
    /// The first loopback address handed out; each pod gets the next one.
    #[arg(long, default_value = "127.1.0.1")]
    first_ip: Ipv4Addr,
    /// How many addresses from `--first-ip` it hands out before it starts over at the first
    /// (0: on to the end of 127.0.0.0/8). Nodes sharing a machine each take a range of their
    /// own; an address where a daemon still listens is skipped, so a range only needs to be
    /// larger than the pods the node runs at once.
    #[arg(long, default_value_t = 0)]
    addresses: u32,
    #[arg(long, default_value = "info")]
    log: String,
    /// With several fake nodes on one scheduler name: how many there are, and which one this
    /// is. Each binds only the pods whose name hashes to its own shard, so that no two race to
    /// bind the same pod.
    #[arg(long, default_value_t = 1)]
    shards: u32,
    #[arg(long, default_value_t = 0)]
    shard: u32,
    /// Calls to the API server in flight at once (bindings, statuses, deletions, Secret reads):
    /// each holds one pooled connection, so this bounds the connections too.
    #[arg(long, default_value_t = 16)]
    api_concurrency: u32,
}

/// A pod this node has taken on.
#[derive(Debug)]
struct Taken {
    /// Cancelled when the pod is deleted: its daemon is killed and the pod let go.
    stop: CancellationToken,
}

/// What the node shares between its tasks.
struct FakeNode {
    args: Args,
    client: Client,
    pods: Api<Pod>,
    /// Pods taken on, by uid. Locked briefly, never across an await.
    taken: Mutex<HashMap<String, Taken>>,
    /// Pods a binding was sent for, by uid.
    bound: Mutex<HashSet<String>>,
    /// The next loopback address, as an offset from `first_ip`.
    next_ip: Mutex<u32>,
    tasks: TaskTracker,
    cancel: CancellationToken,
    /// What this node has written to the API server, and how long its work took.
    stats: Mutex<Stats>,
    /// Bounds the calls in flight (`--api-concurrency`).
    in_flight: tokio::sync::Semaphore,
    /// Immutable Secrets read already, by name: their data never changes. Locked briefly.
    immutable: Mutex<HashMap<String, HashMap<String, String>>>,
}

/// The node's writes by kind, and the time each step of starting a pod took, answered on
/// stdout as one JSON line whenever a line `stats` is read on stdin.
#[derive(Debug, Default, serde::Serialize)]
struct Stats {
    bindings: u64,
    statuses: u64,
    deletes: u64,
    /// Reads of token Secrets, and how many found none yet.
    secret_reads: u64,
    secret_misses: u64,
    /// Milliseconds from seeing a pod unbound to its binding answered.
    bind_ms: Vec<u32>,
    /// Milliseconds from seeing a pod bound to its daemon listening (token, process, listen).
    start_ms: Vec<u32>,
    /// Milliseconds the Running status write took.
    status_ms: Vec<u32>,
}

fn ms(since: Instant) -> u32 {
    u32::try_from(since.elapsed().as_millis()).unwrap_or(u32::MAX)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| args.log.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(run(args));
    // The read of stdin (a blocking thread) may never end: the runtime does not wait for it.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run(args: Args) -> Result<()> {
    if !args.first_ip.is_loopback() {
        bail!("--first-ip {} is not a loopback address: this node only runs daemons on 127.0.0.0/8", args.first_ip);
    }
    std::fs::create_dir_all(&args.state_dir).with_context(|| format!("cannot create {}", args.state_dir.display()))?;
    // Each running daemon holds a descriptor here (its pidfd): thousands of pods need more
    // than the usual soft limit of 1,024.
    let open_files = sys::raise_open_files().context("cannot raise the limit of open files")?;
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("cannot read {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = Client::try_from(config)?;
    let node = Arc::new(FakeNode {
        pods: Api::namespaced(client.clone(), &args.namespace),
        client,
        taken: Mutex::default(),
        bound: Mutex::default(),
        next_ip: Mutex::new(0),
        tasks: TaskTracker::new(),
        cancel: CancellationToken::new(),
        stats: Mutex::default(),
        in_flight: tokio::sync::Semaphore::new(args.api_concurrency.max(1) as usize),
        immutable: Mutex::default(),
        args,
    });
    node.register().await?;
    tracing::info!(node = %node.args.node_name, namespace = %node.args.namespace, open_files, "fake node registered");
    println!("ready");

    let heartbeat = node.clone();
    node.tasks.spawn(async move { heartbeat.heartbeat().await });
    let watching = node.clone();
    node.tasks.spawn(async move { watching.watch().await });
    let asked = node.clone();
    node.tasks.spawn(async move { asked.answer_stats().await });

    shutdown_signal().await;
    tracing::info!("stopping: killing every daemon");
    node.cancel.cancel();
    for taken in node.taken.lock().unwrap_or_else(PoisonError::into_inner).values() {
        taken.stop.cancel();
    }
    node.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(10), node.tasks.wait()).await;
    let nodes: Api<Node> = Api::all(node.client.clone());
    let _ = nodes.delete(&node.args.node_name, &DeleteParams::default()).await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn now() -> Value {
    serde_json::to_value(Time(Timestamp::now())).unwrap_or(Value::Null)
}

impl FakeNode {
    /// Answers each `stats` line on stdin with the stats as one JSON line on stdout.
    async fn answer_stats(self: Arc<Self>) {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        loop {
            let line = tokio::select! {
                _ = self.cancel.cancelled() => return,
                line = lines.next_line() => line,
            };
            match line {
                Ok(Some(l)) if l.trim() == "stats" => {
                    let text = serde_json::to_string(&*self.stats()).unwrap_or_default();
                    println!("{text}");
                }
                Ok(Some(_)) => {}
                _ => return,
            }
        }
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this node binds the pod `name` (its shard's).
    fn binds(&self, name: &str) -> bool {
        // FNV-1a: the same on every node, whatever the process.
        let hash = name.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
        hash % self.args.shards.max(1) == self.args.shard
    }

    /// Creates the Node (or takes over one of the same name) and reports it Ready.
    async fn register(&self) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let name = &self.args.node_name;
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", FAKE_TAINT: "true"},
                "annotations": {NAMESPACE_ANNOTATION: self.args.namespace}},
            "spec": {"taints": [{"key": FAKE_TAINT, "value": "true", "effect": "NoSchedule"}]}
        }))?;
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => tracing::info!(node = %name, "node exists; taking it over"),
            Err(e) => return Err(e).context("cannot create the node"),
        }
        let quantity = json!({"cpu": "1000", "memory": "4Ti", "pods": "100000", "ephemeral-storage": "10Ti"});
        let status = json!({"status": {
            "capacity": quantity, "allocatable": quantity,
            "conditions": [self.ready_condition()],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "", "osImage": "sandman fake node",
                "containerRuntimeVersion": "fake://0", "kubeletVersion": "v1.36.0", "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64"}
        }});
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Strategic(status))
            .await
            .context("cannot report the node ready")?;
        Ok(())
    }

    fn ready_condition(&self) -> Value {
        json!({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "sandman fake node is posting ready status",
            "lastHeartbeatTime": now(), "lastTransitionTime": now()})
    }

    /// Keeps the node Ready, as a kubelet's status updates do.
    async fn heartbeat(self: Arc<Self>) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tokio::time::sleep(HEARTBEAT) => {}
            }
            let patch = json!({"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "sandman fake node is posting ready status", "lastHeartbeatTime": now()}]}});
            if let Err(err) =
                nodes.patch_status(&self.args.node_name, &PatchParams::default(), &Patch::Strategic(patch)).await
            {
                tracing::warn!(%err, "node heartbeat failed");
            }
        }
    }

    /// Watches the namespace's sandbox pods and acts on each.
    /// Watches the namespace's sandbox pods as a scheduler and a kubelet do: the unbound ones
    /// (`spec.nodeName=`), and those bound to this node; acts on each. (Not every pod of the
    /// namespace: with several fake nodes, each would read every other's pods' changes.)
    async fn watch(self: Arc<Self>) {
        let labels = "app.kubernetes.io/managed-by=sandman";
        let unbound = watcher::Config::default().labels(labels).fields("spec.nodeName=");
        let mine = watcher::Config::default().labels(labels).fields(&format!("spec.nodeName={}", self.args.node_name));
        let unbound = watcher::watcher(self.pods.clone(), unbound).default_backoff().map(|e| (false, e));
        let mine = watcher::watcher(self.pods.clone(), mine).default_backoff().map(|e| (true, e));
        let stream = futures_util::stream::select(unbound, mine);
        let mut stream = std::pin::pin!(stream);
        loop {
            let next = tokio::select! {
                _ = self.cancel.cancelled() => return,
                next = stream.next() => next,
            };
            match next {
                None => return,
                Some((_, Ok(Event::Apply(pod) | Event::InitApply(pod)))) => self.clone().pod_changed(pod),
                // Gone from the unbound ones: bound (or deleted before it was).
                Some((false, Ok(Event::Delete(pod)))) => {
                    let uid = pod.metadata.uid.clone().unwrap_or_default();
                    self.bound.lock().unwrap_or_else(PoisonError::into_inner).remove(&uid);
                }
                Some((true, Ok(Event::Delete(pod)))) => self.let_go(&pod),
                Some((_, Ok(Event::Init | Event::InitDone))) => {}
                Some((_, Err(err))) => tracing::warn!(%err, "pod watch failed; resuming"),
            }
        }
    }

    fn let_go(&self, pod: &Pod) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if let Some(taken) = self.taken.lock().unwrap_or_else(PoisonError::into_inner).remove(&uid) {
            taken.stop.cancel();
        }
        self.bound.lock().unwrap_or_else(PoisonError::into_inner).remove(&uid);
    }

    fn pod_changed(self: Arc<Self>, pod: Pod) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let spec = pod.spec.clone().unwrap_or_default();
        let mine = spec.node_name.as_deref() == Some(self.args.node_name.as_str());
        if pod.metadata.deletion_timestamp.is_some() {
            if mine {
                // As a kubelet: stop the containers, then confirm the deletion.
                self.let_go(&pod);
                let me = self.clone();
                self.tasks.spawn(async move { me.finish_delete(&name, &uid).await });
            }
            return;
        }
        if spec.node_name.is_none() {
            if spec.scheduler_name.as_deref() == Some(self.args.scheduler_name.as_str())
                && self.binds(&name)
                && self.bound.lock().unwrap_or_else(PoisonError::into_inner).insert(uid)
            {
                let me = self.clone();
                self.tasks.spawn(async move { me.bind(&name).await });
            }
            return;
        }
        if !mine {
            return;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
        let stop = {
            let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
            if taken.contains_key(&uid) {
                return;
            }
            let stop = self.cancel.child_token();
            taken.insert(uid.clone(), Taken { stop: stop.clone() });
            stop
        };
        let me = self.clone();
        match phase.as_str() {
            "Succeeded" | "Failed" => {}
            "Running" => {
                // Running before this node (re)started: its process is gone.
                self.tasks.spawn(async move {
                    let failed = terminated_status(&pod, 137, "Error", Some("the fake node restarted"), None);
                    me.patch_status(&pod, failed).await;
                });
            }
            _ => {
                self.tasks.spawn(async move { me.start(pod, stop).await });
            }
        }
    }

    async fn bind(&self, name: &str) {
        let binding = json!({"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": self.args.namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.args.node_name}});
        let t0 = Instant::now();
        let _permit = self.in_flight.acquire().await.ok();
        let result = self.pods.create_subresource::<_, Value>("binding", name, &PostParams::default(), &binding).await;
        {
            let mut stats = self.stats();
            stats.bindings += 1;
            stats.bind_ms.push(ms(t0));
        }
        match result {
            Ok(_) => tracing::debug!(pod = name, "bound"),
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(err) => tracing::warn!(pod = name, %err, "cannot bind"),
        }
    }

    async fn finish_delete(&self, name: &str, uid: &str) {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions { uid: Some(uid.to_string()), resource_version: None }),
            ..DeleteParams::default()
        };
        self.stats().deletes += 1;
        let permit = self.in_flight.acquire().await.ok();
        let deleted = self.pods.delete(name, &params).await;
        drop(permit);
        match deleted {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(err) => tracing::warn!(pod = name, %err, "cannot confirm the deletion"),
        }
        let dir = self.args.state_dir.join(uid);
        let _ = tokio::fs::remove_dir_all(dir).await;
    }

    fn next_ip(&self) -> Ipv4Addr {
        let mut next = self.next_ip.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if self.args.addresses > 0 && *next >= self.args.addresses {
                *next = 0;
            }
            let candidate = Ipv4Addr::from(u32::from(self.args.first_ip).wrapping_add(*next));
            *next += 1;
            let [a, _, _, d] = candidate.octets();
            // Stay in 127.0.0.0/8, away from .0 and .255 host parts and from 127.0.0.1.
            if a == 127 && d != 0 && d != 255 && candidate != Ipv4Addr::LOCALHOST {
                return candidate;
            }
            if a != 127 {
                *next = 0;
            }
        }
    }

    /// The next loopback address where nothing listens at `port`: a daemon left by another run
    /// (or anything else) keeps its address, and no pod is ever given it.
    async fn free_ip(&self, port: u16) -> Ipv4Addr {
        loop {
            let ip = self.next_ip();
            match tokio::net::TcpStream::connect((ip, port)).await {
                Ok(_) => tracing::warn!(%ip, port, "something listens there already; skipping the address"),
                Err(_) => return ip,
            }
        }
    }

    /// Runs the pod: its image "pulled", its daemon started on a loopback address of its own,
    /// Running reported once the daemon listens; then its end reported.
    async fn start(self: Arc<Self>, pod: Pod, stop: CancellationToken) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        if pod.metadata.labels.as_ref().is_some_and(|l| l.contains_key(PREPARE_LABEL)) {
            self.pull(&pod).await;
            return;
        }
        let Some(task) = container(&pod, TASK) else {
            tracing::warn!(pod = %name, "no `task` container; ignoring the pod");
            return;
        };
        let image = task.image.clone().unwrap_or_default();
        if self.args.fail_images.iter().any(|f| image.contains(f.as_str())) {
            let message = format!(
                "failed to pull and unpack image \"{image}\": sandman fake node: pulls of images matching --fail-image are refused"
            );
            self.patch_status(&pod, waiting_status(&pod, "ErrImagePull", &message)).await;
            return;
        }
        let port = listen_port(task).unwrap_or(7778);
        let t0 = Instant::now();
        let ip = self.free_ip(port).await;
        let started = now();
        let dir = self.args.state_dir.join(pod.metadata.uid.as_deref().unwrap_or_default());
        let mut child = match self.spawn_daemon(&pod, task, ip, &dir).await {
            Ok(child) => child,
            Err(err) => {
                tracing::warn!(pod = %name, err = format!("{err:#}"), "cannot start the daemon");
                let status = terminated_status(&pod, 128, "StartError", Some(&format!("{err:#}")), Some(&started));
                self.patch_status(&pod, status).await;
                return;
            }
        };
        let listening = wait_listening(ip, port, &mut child).await;
        if let Err(why) = listening {
            let _ = child.kill().await;
            let status = terminated_status(&pod, 1, "Error", Some(&why), Some(&started));
            self.patch_status(&pod, status).await;
            return;
        }
        let t1 = Instant::now();
        self.patch_status(&pod, running_status(&pod, &ip.to_string(), &started)).await;
        {
            let mut stats = self.stats();
            stats.start_ms.push(u32::try_from((t1 - t0).as_millis()).unwrap_or(u32::MAX));
            stats.status_ms.push(ms(t1));
        }
        tracing::debug!(pod = %name, %ip, "running");

        let oom = self.args.oom_images.iter().any(|f| image.contains(f.as_str()));
        let oom_at = oom.then(|| Instant::now() + Duration::from_millis(self.args.oom_after_ms));
        let deadline = pod
            .spec
            .as_ref()
            .and_then(|s| s.active_deadline_seconds)
            .map(|s| Instant::now() + Duration::from_secs(u64::try_from(s).unwrap_or(0)));
        let at_or_never = |t: Option<Instant>| async move {
            match t {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let ending = tokio::select! {
            _ = stop.cancelled() => {
                let _ = child.kill().await;
                return;
            }
            status = child.wait() => Ending::Exited(status.ok()),
            _ = at_or_never(oom_at) => Ending::Oom,
            _ = at_or_never(deadline) => Ending::Deadline,
        };
        if !matches!(ending, Ending::Exited(_)) {
            let _ = child.kill().await;
        }
        if stop.is_cancelled() {
            return;
        }
        let status = match ending {
            Ending::Oom => terminated_status(&pod, 137, "OOMKilled", None, Some(&started)),
            Ending::Deadline => {
                let mut s = terminated_status(&pod, 137, "Error", None, Some(&started));
                s["status"]["reason"] = json!("DeadlineExceeded");
                s["status"]["message"] = json!("Pod was active on the node longer than the specified deadline");
                s
            }
            Ending::Exited(status) => {
                use std::os::unix::process::ExitStatusExt;
                let code = status.map(|s| s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9))).unwrap_or(1);
                let reason = if code == 0 { "Completed" } else { "Error" };
                terminated_status(&pod, code, reason, None, Some(&started))
            }
        };
        self.patch_status(&pod, status).await;
    }

    /// A pull pod of `prepare`: the image "pulled" (or refused, like a task image), then its
    /// container (`sandmand --version`) exits 0 at once.
    async fn pull(&self, pod: &Pod) {
        let image = image_of(pod, PULL);
        let status = if self.args.fail_images.iter().any(|f| image.contains(f.as_str())) {
            let message = format!(
                "failed to pull and unpack image \"{image}\": sandman fake node: pulls of images matching --fail-image are refused"
            );
            pull_status(pod, json!({"waiting": {"reason": "ErrImagePull", "message": message}}), "Pending")
        } else {
            let started = now();
            let done = json!({"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": started, "finishedAt": now()}});
            pull_status(pod, done, "Succeeded")
        };
        self.patch_status(pod, status).await;
    }

    /// Starts `sandmand` as the pod's task container would, but listening on `ip` and reading
    /// its token from a local file.
    async fn spawn_daemon(
        &self,
        pod: &Pod,
        task: &Container,
        ip: Ipv4Addr,
        dir: &Path,
    ) -> Result<tokio::process::Child> {
        let token = self.token_of(pod).await?;
        let work = dir.join("work");
        tokio::fs::create_dir_all(&work).await?;
        let token_file = dir.join("token");
        tokio::fs::write(&token_file, token.as_bytes()).await?;
        let args = daemon_args(task, ip, &token_file)?;
        let log = std::fs::File::create(dir.join("daemon.log"))?;
        let mut cmd = Command::new(&self.args.daemon);
        cmd.args(&args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
            .env("HOME", &work)
            .current_dir(&work)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true);
        sys::die_with_this_process(&mut cmd);
        for e in task.env.iter().flatten() {
            if let Some(v) = &e.value {
                cmd.env(&e.name, v);
            }
        }
        cmd.spawn().with_context(|| format!("cannot run {}", self.args.daemon.display()))
    }

    /// The pod's token, as its volume would hold it: from its Secret or its annotation.
    async fn token_of(&self, pod: &Pod) -> Result<String> {
        let volume = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == "sandman-token"))
            .context("the pod has no `sandman-token` volume")?;
        if volume.downward_api.is_some() {
            return pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("sandman.dev/token"))
                .cloned()
                .context("the pod has no `sandman.dev/token` annotation");
        }
        let source = volume.secret.as_ref().context("the token volume is neither a Secret nor the downward API")?;
        let name = source.secret_name.clone().context("the token volume names no secret")?;
        // The key the pod mounts: `token` of a Secret of its own, its sandbox id of a shared one.
        let key = source
            .items
            .as_ref()
            .and_then(|items| items.first())
            .map_or_else(|| "token".to_string(), |item| item.key.clone());
        // As the kubelet does, an immutable Secret is read once.
        if let Some(token) =
            self.immutable.lock().unwrap_or_else(PoisonError::into_inner).get(&name).and_then(|d| d.get(&key))
        {
            return Ok(token.clone());
        }
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.args.namespace);
        // As the kubelet does, wait for a Secret created just after its pod.
        for _ in 0..100 {
            let permit = self.in_flight.acquire().await.ok();
            let found = secrets.get_opt(&name).await?;
            drop(permit);
            {
                let mut stats = self.stats();
                stats.secret_reads += 1;
                stats.secret_misses += u64::from(found.is_none());
            }
            if let Some(secret) = found {
                let data: HashMap<String, String> = secret
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(k, v)| Some((k, String::from_utf8(v.0).ok()?)))
                    .collect();
                let token = data.get(&key).cloned().with_context(|| format!("the secret `{name}` has no `{key}`"))?;
                if secret.immutable == Some(true) {
                    self.immutable.lock().unwrap_or_else(PoisonError::into_inner).insert(name, data);
                }
                return Ok(token);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("secret `{name}` not found")
    }

    async fn patch_status(&self, pod: &Pod, patch: Value) {
        self.stats().statuses += 1;
        let name = pod.metadata.name.clone().unwrap_or_default();
        let _permit = self.in_flight.acquire().await.ok();
        if let Err(err) = self.pods.patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch)).await {
            tracing::warn!(pod = %name, %err, "cannot write the pod's status");
        }
    }
}

/// How a running pod ended.
#[derive(Debug)]
enum Ending {
    Exited(Option<std::process::ExitStatus>),
    Oom,
    Deadline,
}

fn container<'a>(pod: &'a Pod, name: &str) -> Option<&'a Container> {
    pod.spec.as_ref()?.containers.iter().find(|c| c.name == name)
}

fn has_init(pod: &Pod) -> bool {
    pod.spec.as_ref().and_then(|s| s.init_containers.as_ref()).is_some_and(|c| c.iter().any(|c| c.name == INIT))
}

/// The task container's command line with the listen address and the token file replaced.
fn daemon_args(task: &Container, ip: Ipv4Addr, token_file: &Path) -> Result<Vec<String>> {
    let mut argv: Vec<String> = task.command.iter().flatten().chain(task.args.iter().flatten()).cloned().collect();
    if argv.first().is_none_or(|p| !p.ends_with("/sandmand")) {
        bail!("the task container does not run sandmand: {argv:?}");
    }
    argv.remove(0);
    let port = listen_port(task).unwrap_or(7778);
    let mut out = Vec::with_capacity(argv.len());
    let mut it = argv.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--listen" => {
                it.next();
                out.extend(["--listen".to_string(), format!("{ip}:{port}")]);
            }
            "--token-file" => {
                it.next();
                out.extend(["--token-file".to_string(), token_file.display().to_string()]);
            }
            _ => out.push(a),
        }
    }
    Ok(out)
}

fn listen_port(task: &Container) -> Option<u16> {
    let args: Vec<&String> = task.args.iter().flatten().collect();
    let at = args.iter().position(|a| *a == "--listen")?;
    args.get(at + 1)?.rsplit(':').next()?.parse().ok()
}

/// Waits until the daemon accepts connections on `ip:port`, or says why it does not.
async fn wait_listening(ip: Ipv4Addr, port: u16, child: &mut tokio::process::Child) -> Result<(), String> {
    let until = Instant::now() + LISTEN_TIMEOUT;
    while Instant::now() < until {
        if tokio::net::TcpStream::connect((ip, port)).await.is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("the daemon exited before listening: {status}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("the daemon did not listen on {ip}:{port} within {} s", LISTEN_TIMEOUT.as_secs()))
}

fn condition(kind: &str, status: bool, reason: Option<&str>) -> Value {
    let mut c = json!({"type": kind, "status": if status { "True" } else { "False" }, "lastProbeTime": null,
        "lastTransitionTime": now()});
    if let Some(r) = reason {
        c["reason"] = json!(r);
    }
    c
}

fn init_done(pod: &Pod, started: &Value) -> Value {
    if !has_init(pod) {
        return json!([]);
    }
    json!([{"name": INIT, "image": image_of(pod, INIT), "imageID": "", "ready": true, "restartCount": 0, "started": false,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": started, "finishedAt": started}}}])
}

fn image_of(pod: &Pod, name: &str) -> String {
    let spec = pod.spec.as_ref();
    let all = spec.into_iter().flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()));
    all.into_iter().find(|c| c.name == name).and_then(|c| c.image.clone()).unwrap_or_default()
}

fn uid_of(pod: &Pod) -> Value {
    json!({"uid": pod.metadata.uid})
}

fn running_status(pod: &Pod, ip: &str, started: &Value) -> Value {
    json!({"metadata": uid_of(pod), "status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
        "startTime": started,
        "conditions": [condition("PodReadyToStartContainers", true, None), condition("Initialized", true, None),
            condition("Ready", true, None), condition("ContainersReady", true, None), condition("PodScheduled", true, None)],
        "initContainerStatuses": init_done(pod, started),
        "containerStatuses": [{"name": TASK, "image": image_of(pod, TASK), "imageID": "", "ready": true, "restartCount": 0,
            "started": true, "state": {"running": {"startedAt": started}}}]
    }})
}

/// The status of a pull pod whose container is in `state`.
fn pull_status(pod: &Pod, state: Value, phase: &str) -> Value {
    let started = now();
    json!({"metadata": uid_of(pod), "status": {
        "phase": phase, "hostIP": "127.0.0.1", "startTime": started,
        "conditions": [condition("Initialized", true, None), condition("PodScheduled", true, None)],
        "initContainerStatuses": init_done(pod, &started),
        "containerStatuses": [{"name": PULL, "image": image_of(pod, PULL), "imageID": "", "ready": false, "restartCount": 0,
            "started": false, "state": state}]
    }})
}

fn waiting_status(pod: &Pod, reason: &str, message: &str) -> Value {
    let started = now();
    json!({"metadata": uid_of(pod), "status": {
        "phase": "Pending", "hostIP": "127.0.0.1", "startTime": started,
        "conditions": [condition("Initialized", true, None), condition("Ready", false, Some("ContainersNotReady")),
            condition("ContainersReady", false, Some("ContainersNotReady")), condition("PodScheduled", true, None)],
        "initContainerStatuses": init_done(pod, &started),
        "containerStatuses": [{"name": TASK, "image": image_of(pod, TASK), "imageID": "", "ready": false, "restartCount": 0,
            "started": false, "state": {"waiting": {"reason": reason, "message": message}}}]
    }})
}

fn terminated_status(pod: &Pod, code: i32, reason: &str, message: Option<&str>, started: Option<&Value>) -> Value {
    let finished = now();
    let started = started.cloned().unwrap_or_else(|| finished.clone());
    let mut terminated = json!({"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": finished});
    if let Some(m) = message {
        terminated["message"] = json!(m);
    }
    json!({"metadata": uid_of(pod), "status": {
        "phase": "Failed",
        "conditions": [condition("Ready", false, Some("PodFailed")), condition("ContainersReady", false, Some("PodFailed"))],
        "initContainerStatuses": init_done(pod, &started),
        "containerStatuses": [{"name": TASK, "image": image_of(pod, TASK), "imageID": "", "ready": false, "restartCount": 0,
            "started": false, "state": {"terminated": terminated}}]
    }})
}

/// The node's only `unsafe`: each daemon is killed by the kernel when the node dies, however it
/// dies (SIGKILL included), so that no daemon outlives its node holding a loopback address; and
/// the limit of open files raised.
#[allow(unsafe_code)]
mod sys {
    /// Raises this process's soft limit of open files to its hard limit; answers the limit in
    /// force. (The daemons inherit it.)
    pub fn raise_open_files() -> std::io::Result<u64> {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit only read and write the plain struct they are given.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if limit.rlim_cur < limit.rlim_max {
                limit.rlim_cur = limit.rlim_max;
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(limit.rlim_cur)
    }

    /// Has the kernel SIGKILL the command's process when the thread that started it ends (tokio's
    /// worker threads live as long as the node's runtime), or at once if the node is already gone.
    pub fn die_with_this_process(cmd: &mut tokio::process::Command) {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // async-signal-safe functions (prctl, getppid, _exit) on plain integers.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The node died between the fork and the prctl: the signal will never come.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
}

//! The Kubernetes provider: one pod per sandbox, the static `sandmand` injected into the
//! unmodified task image (init container, node directory or image volume), one shared watch of
//! every sandbox pod, API writes paced by a token bucket. Start at [`KubeProvider`]; the pod is
//! built in [`pod`], its status read in [`status`], what it applied read back in [`applied`],
//! images pulled ahead in [`prepare`], the daemon told from a stranger at its address in
//! [`identity`], and `docs/kubernetes.md` is the guide.

pub mod api;
pub mod applied;
pub mod capacity;
pub mod config;
pub mod identity;
pub mod pace;
pub mod pod;
pub mod prepare;
pub mod shared;
pub mod snapshot;
pub mod status;
pub mod tokens;
mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPort, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sandman_provider::{
    Claim, EVENT_CAPACITY, Ended, Endpoint, NodeProgress, PROGRESS_CAPACITY, Prepared, Progress, Provider,
    ProviderError, ProviderEvent, Record, SandboxSpec,
};
use sandman_wire::server::{Applied, Reason};
use tokio::sync::{OnceCell, mpsc, watch as tokio_watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::api::KubeError;
use crate::api::{KubeApi, chain};
use crate::capacity::{Admission, Ask, Waiting};
pub use crate::config::{CapacityConfig, ConfigError, Injection, KubeConfig, PullPolicy, TokenDelivery};
use crate::pace::Pacer;
use crate::pod::{
    LABEL_CLAIMED, LABEL_INSTANCE, LABEL_MANAGED_BY, LABEL_NETWORK, MANAGED_BY, daemon_addr, label_value, pod_name,
};
use crate::status::{PodState, classify};
use crate::tokens::Tokens;
use crate::watch::Tracker;

/// How often a claim reads the pod and tries its conditional update again when something other
/// than a claim (the kubelet's status, say) wrote the pod between the read and the update.
const CLAIM_TRIES: u32 = 3;
/// How often a release-all calls `deletecollection` again after the API server ran out of time
/// without the job's pods getting fewer.
const RELEASE_STALLED_TRIES: u32 = 3;
/// How often, at most, a create waiting for capacity is told its new place (what it waits for
/// changing is told at once).
const WAIT_TOLD_EVERY: Duration = Duration::from_secs(1);

/// How a create makes sure the daemon at its pod's address is the sandbox's own before handing
/// the address out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdentityCheck {
    /// The daemon proves the sandbox's token to a fresh challenge ([`identity::prove`]); a
    /// daemon of another sandbox answering at a reused pod IP fails the create.
    #[default]
    Challenge,
    /// The address the pod's status names is taken as it is. Only for tests on a mocked API
    /// server, whose pod IPs no daemon listens at.
    Trust,
}

/// What a [`KubeProvider`] holds at one moment ([`KubeProvider::footprint`]): each count is
/// bounded by the sandboxes alive and being made or released, never by how many there have been.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Footprint {
    /// Sandbox pods the shared watch sees now (the provider keeps a few fields of each, not
    /// the pod).
    pub watched_pods: usize,
    /// Sandboxes the watch's tracker follows (being made, alive, or being deleted).
    pub tracked: usize,
    /// Shared token Secrets written whose creates have not all reported their pods.
    pub pending_secrets: usize,
}

/// Name of the NetworkPolicy that cuts off `network: none` and `eval` sandboxes.
pub const NETWORK_NONE_POLICY: &str = "sandman-network-none";

/// The Kubernetes provider. Its state of record is the cluster: each sandbox is a pod labelled
/// with its id and job and annotated with its spec (and, once a create has claimed it from a
/// warm pool, with the claim: [`Provider::claim`]), and its token is in a Secret the pod owns,
/// so a second instance (a restarted or replicated server) finds every sandbox with
/// [`Provider::list`].
#[derive(Debug)]
pub struct KubeProvider {
    config: KubeConfig,
    /// Shared with the cleanup of a cancelled prepare, which outlives the call.
    api: Arc<KubeApi>,
    /// The namespace's pods, for the watches of `prepare` (the shared watch has its own).
    pods: kube::Api<Pod>,
    /// Every sandbox pod's state, as the shared watch last saw it.
    tracker: Arc<Tracker>,
    /// Handed to the server once.
    events_rx: Mutex<Option<mpsc::Receiver<ProviderEvent>>>,
    /// Set once the NetworkPolicy for `network: none` has been applied.
    policy: OnceCell<()>,
    /// The watch task; cancelled on shutdown (the pods stay for the next server).
    tasks: TaskTracker,
    cancel: CancellationToken,
    identity: IdentityCheck,
    /// The gate of capacity-aware admission, when configured.
    admission: Option<Arc<Admission>>,
    /// The creates waiting for capacity, and where. Locked briefly, never across an await.
    waiting: Mutex<HashMap<String, Waiting>>,
    /// Where creates waiting for capacity tell their place (lossy: a full channel drops a line),
    /// which the server passes on as progress events of those creates.
    progress_tx: mpsc::Sender<Progress>,
    progress_rx: Mutex<Option<mpsc::Receiver<Progress>>>,
    /// The shared token Secrets, with `token: shared_secret`.
    tokens: Option<Arc<Tokens>>,
}

impl KubeProvider {
    /// Checks the configuration and starts the shared watch of this instance's sandbox pods in
    /// `config.namespace`. Needs a tokio runtime; touches nothing in the cluster.
    pub fn new(client: kube::Client, config: KubeConfig) -> Result<Self, ProviderError> {
        config.validate().map_err(|e| ProviderError::Unsupported(e.to_string()))?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ProviderError::Backend("the kubernetes provider must be started inside a tokio runtime".into())
        })?;
        let (events_tx, events_rx) = mpsc::channel(EVENT_CAPACITY);
        let (progress_tx, progress_rx) = mpsc::channel(PROGRESS_CAPACITY);
        let tracker = Arc::new(Tracker::default());
        let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), &config.namespace);
        let tasks = TaskTracker::new();
        let cancel = CancellationToken::new();
        tasks.spawn_on(
            watch::run(pods.clone(), pod::selector(&config.instance), tracker.clone(), events_tx, cancel.clone()),
            &runtime,
        );
        let admission = config.admission().map(|c| Arc::new(Admission::new(c.max_pending)));
        if let Some(gate) = &admission {
            tasks.spawn_on(capacity::watch(client.clone(), config.clone(), gate.clone(), cancel.clone()), &runtime);
        }
        let pacer = Pacer::new(config.write_qps, config.write_burst);
        let api = Arc::new(KubeApi::new(client, &config.namespace, pacer, config.api_concurrency));
        let tokens = (config.token == TokenDelivery::SharedSecret).then(|| {
            let _guard = runtime.enter();
            Tokens::start(api.clone(), &config.namespace, &config.instance, &tasks, cancel.clone())
        });
        tracing::info!(
            namespace = %config.namespace,
            instance = %config.instance,
            injection = ?config.injection,
            write_qps = config.write_qps,
            write_burst = config.write_burst,
            api_concurrency = config.api_concurrency,
            "kubernetes provider"
        );
        Ok(KubeProvider {
            api,
            pods,
            config,
            tracker,
            events_rx: Mutex::new(Some(events_rx)),
            policy: OnceCell::new(),
            tasks,
            cancel,
            identity: IdentityCheck::default(),
            admission,
            waiting: Mutex::default(),
            progress_tx,
            progress_rx: Mutex::new(Some(progress_rx)),
            tokens,
        })
    }

    /// Where the create of `id` waits for capacity, while it does.
    pub fn waiting(&self, id: &str) -> Option<Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }

    /// Passes the create through capacity-aware admission, when configured: waits for room,
    /// reporting where it waits; a request that can never fit, or a wait past `wait_s`, fails
    /// it with `unschedulable`. Answers the admission, which a failed create gives back.
    async fn admit<'a>(&'a self, spec: &'a SandboxSpec, ask: Ask) -> Result<Option<Admitted<'a>>, ProviderError> {
        let (Some(gate), Some(cap)) = (&self.admission, self.config.admission()) else { return Ok(None) };
        let deadline = Instant::now() + Duration::from_secs(cap.wait_s);
        // Told (logged, and sent as progress) when what it waits for changes, else at most every
        // WAIT_TOLD_EVERY: each admission moves every waiting create up one place, and telling
        // each move would make lines without bound in the square of the queue's length.
        let mut told: Option<(Instant, capacity::Resource)> = None;
        let admitted = gate
            .admit(&spec.id, ask, capacity::Share::of_spec(spec), deadline, |w| {
                self.waiting.lock().unwrap_or_else(PoisonError::into_inner).insert(spec.id.clone(), w.clone());
                let now = Instant::now();
                let due = told.as_ref().is_none_or(|(at, what)| {
                    *what != w.resource || now.saturating_duration_since(*at) >= WAIT_TOLD_EVERY
                });
                if due {
                    told = Some((now, w.resource));
                    tracing::info!(sandbox = %spec.id, "{w}");
                    let _ = self.progress_tx.try_send(Progress { id: spec.id.clone(), message: w.to_string() });
                }
            })
            .await;
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).remove(&spec.id);
        admitted.map_err(|e| {
            let reason = match e {
                capacity::AdmissionError::Forbidden { .. } => Reason::ProviderError,
                _ => Reason::Unschedulable,
            };
            ProviderError::Failed { reason, message: e.to_string() }
        })?;
        Ok(Some(Admitted { gate, id: &spec.id, kept: false }))
    }

    /// Sets how creates check the daemon's identity (a challenge by default).
    pub fn with_identity_check(mut self, check: IdentityCheck) -> Self {
        self.identity = check;
        self
    }

    /// Connects with the client the environment gives (in a pod: its service account; else
    /// `$KUBECONFIG` or `~/.kube/config`), then [`KubeProvider::new`].
    pub async fn connect(config: KubeConfig) -> Result<Self, ProviderError> {
        let client = kube::Client::try_default()
            .await
            .map_err(|e| ProviderError::Backend(format!("cannot reach the Kubernetes API server: {}", chain(&e))))?;
        check_runtimes(&client, &config).await?;
        Self::new(client, config)
    }

    pub fn config(&self) -> &KubeConfig {
        &self.config
    }

    /// Waits until the shared watch has listed the pods once.
    pub async fn wait_synced(&self) {
        self.tracker.wait_synced().await;
    }

    /// Stops the watch (the pods keep running, for the next server) and waits for it to end.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Releases every sandbox of `job` with one `deletecollection` by label; answers the ids of
    /// the sandboxes whose pods it deleted. The job's pods are read first (their metadata):
    /// the API server stops a `deletecollection` at its request timeout (60 s by default, a few
    /// thousand pods), having deleted the pods it reached and naming none, and then it is called
    /// again, as long as each call leaves fewer pods not yet being deleted (the pods being
    /// deleted already cost the API server no write).
    pub async fn delete_job(&self, job: &str) -> Result<Vec<String>, ProviderError> {
        self.tracker.mark_job_deleting(&label_value(job));
        let selector = pod::job_selector(&self.config.instance, job);
        let ids_of = |metas: Vec<api::PodMeta>| -> Vec<String> {
            metas.into_iter().filter_map(|mut m| m.labels.remove(pod::LABEL_SANDBOX)).collect()
        };
        let listed = self.api.list_pod_metadata(&selector).await?;
        let mut ids: std::collections::BTreeSet<String> = ids_of(listed).into_iter().collect();
        let mut left = usize::MAX;
        let mut stalled = 0;
        loop {
            match self.api.delete_pods(&selector, self.config.termination_grace_s).await {
                Ok(pods) => {
                    ids.extend(ids_of(pods));
                    break;
                }
                Err(e) if e.code() == Some(504) => {
                    let pods = self.api.list_pod_metadata(&selector).await?;
                    let now = pods.iter().filter(|p| p.deletion_timestamp.is_none()).count();
                    ids.extend(ids_of(pods));
                    stalled = if now < left { 0 } else { stalled + 1 };
                    if stalled >= RELEASE_STALLED_TRIES {
                        return Err(e.into());
                    }
                    left = now;
                    tracing::info!(job, left, "the API server ran out of time deleting a job's pods; calling again");
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Its pods the watch has not seen are no news when it does (their job is marked); one
        // whose deletion it has seen already is gone from the tracker and stays gone.
        for id in &ids {
            self.tracker.mark_deleting_if_tracked(id);
        }
        tracing::info!(job, pods = ids.len(), "released a job's sandboxes");
        Ok(ids.into_iter().collect())
    }

    /// What this provider holds now, to watch it stay flat over a long run.
    pub fn footprint(&self) -> Footprint {
        Footprint {
            watched_pods: self.tracker.present(),
            tracked: self.tracker.tracked(),
            pending_secrets: self.tokens.as_ref().map_or(0, |t| t.pending()),
        }
    }

    /// The sandbox's pod state as the shared watch last saw it, with where the pod was when it
    /// was not running (`Pending, container `task` ContainerCreating`).
    pub fn watched(&self, id: &str) -> Option<(PodState, Option<String>)> {
        self.tracker.state(id)
    }

    /// Slots the provider's map of sandboxes has room for now: it gives a burst's room back
    /// once the burst's sandboxes are gone.
    pub fn tracker_capacity(&self) -> usize {
        self.tracker.capacity()
    }

    /// Applies the NetworkPolicy for `network: none` once (the first such create).
    async fn ensure_policy(&self) -> Result<(), ProviderError> {
        if !self.config.manage_network_policy {
            return Ok(());
        }
        self.policy
            .get_or_try_init(|| async {
                self.api.apply_policy(&network_none_policy(&self.config)).await.map_err(|e| {
                    ProviderError::Backend(format!(
                        "network: none needs the NetworkPolicy `{NETWORK_NONE_POLICY}`, which could not be applied: {}",
                        chain(&e)
                    ))
                })
            })
            .await
            .map(drop)
    }

    /// After a 409 on create: the pod is ours when it was made from the same spec (a retried
    /// create); anything else is a conflict.
    async fn existing(&self, spec: &SandboxSpec, name: &str) -> Result<Pod, ProviderError> {
        let found = self.api.get_pod(name).await?;
        match found {
            Some(pod) if pod::spec_of(&pod).is_some_and(|s| same_spec(&s, spec)) => Ok(pod),
            _ => Err(ProviderError::Backend(format!(
                "a pod `{name}` exists already in namespace `{}` and is not sandbox `{}`",
                self.config.namespace, spec.id
            ))),
        }
    }

    /// Creates the token Secret, owned by the pod; a Secret left by an earlier try of the same
    /// create is fine when it holds the same token.
    async fn put_secret(&self, spec: &SandboxSpec, pod_uid: &str) -> Result<(), ProviderError> {
        let secret = pod::build_secret(spec, &self.config, pod_uid);
        match self.api.create_secret(&secret).await {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some(409) => {
                let name = pod_name(&spec.id);
                let existing = self.api.get_secret(&name).await?;
                let token = existing.as_ref().and_then(|s| s.data.as_ref()?.get(pod::TOKEN_KEY).cloned());
                if token.is_some_and(|t| t.0 == spec.token.as_bytes()) {
                    Ok(())
                } else {
                    Err(ProviderError::Backend(format!(
                        "a secret `{name}` exists already in namespace `{}` with another token",
                        self.config.namespace
                    )))
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// After a 409 with shared token Secrets: the pod found (made by an earlier try of the same
    /// create) must mount this create's token.
    async fn check_shared_token(&self, spec: &SandboxSpec, existing: &Pod) -> Result<(), ProviderError> {
        let name = pod_name(&spec.id);
        let Some((secret, key)) = pod::token_secret_of(existing) else {
            return Err(ProviderError::Backend(format!("the pod `{name}` that exists already mounts no token Secret")));
        };
        let found = self.api.get_secret(secret).await?;
        let token = found.as_ref().and_then(|s| s.data.as_ref()?.get(key).cloned());
        if token.is_some_and(|t| t.0 == spec.token.as_bytes()) {
            Ok(())
        } else {
            Err(ProviderError::Backend(format!(
                "the pod `{name}` exists already in namespace `{}` with another token",
                self.config.namespace
            )))
        }
    }

    /// Whether `pod` is the pod of sandbox `id` of this instance, not being deleted: one that
    /// [`Provider::list`] would answer.
    fn is_live_sandbox(&self, pod: &Pod, id: &str) -> bool {
        let labels = pod.metadata.labels.as_ref();
        pod::sandbox_id(&pod.metadata) == Some(id)
            && labels.and_then(|l| l.get(LABEL_MANAGED_BY)).is_some_and(|v| v == MANAGED_BY)
            && labels.and_then(|l| l.get(LABEL_INSTANCE)).is_some_and(|v| *v == label_value(&self.config.instance))
            && pod.metadata.deletion_timestamp.is_none()
    }

    /// A claim is recorded on the pod: the sandbox is the claimer's job's from now on.
    fn claimed(&self, claim: &Claim) {
        self.tracker.set_job(&claim.spec.id, claim.spec.job.as_deref().map(label_value));
        tracing::info!(
            sandbox = %claim.spec.id,
            job = claim.spec.job.as_deref().unwrap_or_default(),
            "claimed a pool sandbox"
        );
    }

    /// Waits for the pod to run with an IP, or for a reason it never will, whichever the watch
    /// shows first.
    async fn wait_running(
        &self,
        id: &str,
        rx: &mut tokio_watch::Receiver<PodState>,
        deadline: Instant,
    ) -> Result<String, ProviderError> {
        // Under capacity-aware admission a pod may be made with no room on purpose (for an
        // autoscaler to see): it waits as long as a create would have waited in the gate.
        let capacity_wait = self.config.admission().map_or(0, |c| c.wait_s);
        let grace = Duration::from_secs(self.config.unschedulable_grace_s.max(capacity_wait));
        let mut unschedulable_since: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let state = rx.borrow_and_update().clone();
            let mut wake = deadline;
            match state {
                PodState::Ready { ip } => return Ok(ip),
                PodState::Ended(e) => return Err(ProviderError::Failed { reason: e.reason, message: e.message }),
                PodState::Exited(e) => {
                    // The daemon exited before the sandbox was ever ready.
                    let reason = if e.reason == Reason::ProviderError { Reason::DaemonStartFailed } else { e.reason };
                    return Err(ProviderError::Failed { reason, message: e.message });
                }
                PodState::Unschedulable(message) => {
                    let until = *unschedulable_since.get_or_insert(now) + grace;
                    if now >= until {
                        return Err(ProviderError::Failed { reason: Reason::Unschedulable, message });
                    }
                    wake = wake.min(until);
                }
                PodState::Pending => unschedulable_since = None,
            }
            if now >= deadline {
                let seen =
                    self.watched(id).and_then(|(_, seen)| seen).unwrap_or_else(|| "not seen by the watch".into());
                return Err(ProviderError::Failed {
                    reason: Reason::ReadyTimeout,
                    message: format!("the pod was not running after {} s ({seen})", self.config.create_timeout_s),
                });
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() {
                    return Err(ProviderError::Backend("the pod watch has stopped".into()));
                },
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }
}

impl KubeProvider {
    /// Makes sure the daemon at `addr` is the sandbox's own ([`identity::prove`]), while the
    /// watch still shows its pod running: a pod that ends meanwhile fails the create with why.
    /// This is why the provider, not the server, proves its daemons ([`Provider::proves_daemon`]).
    async fn verify_daemon(
        &self,
        spec: &SandboxSpec,
        addr: &str,
        rx: &mut tokio_watch::Receiver<PodState>,
        deadline: Instant,
    ) -> Result<(), ProviderError> {
        if self.identity == IdentityCheck::Trust {
            return Ok(());
        }
        let proved = identity::prove(addr, &spec.token, deadline);
        let ended = async {
            loop {
                if rx.changed().await.is_err() {
                    return ProviderError::Backend("the pod watch has stopped".into());
                }
                if !matches!(*rx.borrow(), PodState::Ready { .. }) {
                    // Pending again (not seen in practice) waits on; an end is the answer.
                    if let Err(e) = self.wait_running(&spec.id, rx, deadline).await {
                        return e;
                    }
                }
            }
        };
        tokio::select! {
            proved = proved => proved.map_err(|e| {
                tracing::warn!(sandbox = %spec.id, err = %e, addr, "the daemon at the pod's address is not the sandbox's");
                ProviderError::Failed { reason: e.reason(), message: format!("{e} (at {addr})") }
            }),
            e = ended => Err(e),
        }
    }
}

impl Drop for KubeProvider {
    fn drop(&mut self) {
        // The watch stops; the pods run on for the next server.
        self.cancel.cancel();
    }
}

/// Whether two specs are the same sandbox, tokens aside (the annotation has none).
fn same_spec(stored: &SandboxSpec, spec: &SandboxSpec) -> bool {
    let mut spec = spec.clone();
    spec.token = String::new();
    *stored == spec
}

/// A create let through the capacity gate: given back unless its pod came to run (then the
/// watch sees it bound and the gate counts it from there).
struct Admitted<'a> {
    gate: &'a Admission,
    id: &'a str,
    kept: bool,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.gate.forget(self.id);
        }
    }
}

/// Ends the tracker's create however the create ends.
struct Creating<'a> {
    tracker: &'a Tracker,
    id: &'a str,
    ok: bool,
}

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        self.tracker.end_create(self.id, self.ok);
    }
}

/// Why the kubernetes provider refuses a snapshot of a whole file system.
pub const SNAPSHOT_REFUSED: &str = "the kubernetes provider cannot snapshot a sandbox's whole file system: a pod's file system belongs to its node's container runtime, which the Kubernetes API cannot commit into an image; name the directories to record (`paths`), which are pushed as one layer over the pod's image to the registry of its `snapshots` configuration";
/// Why the kubernetes provider refuses pause and resume.
const NO_FREEZE: &str = "a pod cannot be frozen without a runtime's help (the Kubernetes API has no pause; a \
                         runtime class whose runtime freezes, such as a microVM's, would be needed)";

impl Provider for KubeProvider {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    /// Refused at once: a pod's files are in its node's container runtime, which neither the
    /// API server nor the daemon can commit into an image. Named directories can be recorded
    /// ([`Provider::snapshot_dirs`]).
    async fn snapshot(&self, id: &str, snapshot: &str) -> Result<sandman_provider::SnapshotMade, ProviderError> {
        let _ = (id, snapshot);
        Err(ProviderError::Unsupported(SNAPSHOT_REFUSED.into()))
    }

    fn snapshot_scope(&self) -> sandman_provider::SnapshotScope {
        sandman_provider::SnapshotScope::Named {
            why: snapshot::WHOLE_REFUSED,
            max_bytes: self.config.snapshots.as_ref().map_or(0, |s| s.max_bytes),
        }
    }

    /// Refused at once when no registry is configured: there is nowhere to push to.
    fn check_snapshot(&self) -> Result<(), ProviderError> {
        self.config.snapshots.as_ref().map(|_| ()).ok_or_else(snapshot::no_registry)
    }

    /// The named directories as one layer over the pod's image, pushed to the configured
    /// registry ([`snapshot`]).
    async fn snapshot_dirs(
        &self,
        id: &str,
        snapshot: &str,
        dirs: Vec<sandman_provider::NamedDir>,
    ) -> Result<sandman_provider::SnapshotMade, ProviderError> {
        self.push_snapshot(id, snapshot, dirs).await
    }

    /// The snapshot's image stays in the registry (the registry's own deletion and garbage
    /// collection remove it); only the server forgets the snapshot.
    async fn delete_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        let _ = snapshot;
        Ok(())
    }

    /// Refused: the snapshot is an image in the registry already; its tag says where.
    async fn export_snapshot(&self, snapshot: &str, reference: &str) -> Result<String, ProviderError> {
        let _ = reference;
        let at = match &self.config.snapshots {
            Some(s) => format!("`{}`", snapshot::snapshot_reference(s, snapshot)),
            None => "its registry".into(),
        };
        Err(ProviderError::Unsupported(format!(
            "the kubernetes provider's snapshot `{snapshot}` is an image in {at} already: pull it from there, or copy it \
             with the registry's tools (skopeo copy, crane copy)"
        )))
    }

    /// Refused at once: Kubernetes has no way to freeze a pod's processes (no pause in the pod
    /// API or the kubelet), and the container runtime's own pause is not reachable through it.
    async fn pause(&self, id: &str) -> Result<(), ProviderError> {
        Err(ProviderError::Unsupported(format!("the kubernetes provider cannot pause sandbox `{id}`: {NO_FREEZE}")))
    }

    async fn resume(&self, id: &str) -> Result<(), ProviderError> {
        Err(ProviderError::Unsupported(format!("the kubernetes provider cannot resume sandbox `{id}`: {NO_FREEZE}")))
    }

    fn isolation(&self) -> sandman_wire::server::Isolation {
        sandman_wire::server::Isolation::Pod
    }

    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        pod::check(spec, &self.config)
    }

    /// Yes, unless told to trust pod addresses (tests on a mocked API server): each create
    /// proves the daemon at its pod's address while it follows the pod on the watch.
    fn proves_daemon(&self) -> bool {
        self.identity == IdentityCheck::Challenge
    }

    /// Creates the pod (and its token Secret), then waits, on the shared watch, until it runs
    /// with an IP; a pull error, an unschedulable pod, an OOM kill or a daemon that cannot start
    /// fail the create as soon as the pod's status shows them.
    ///
    /// A create holds neither its pod nor the API server's answer while it waits (for room, for
    /// its token's Secret, for its write's slot, for the pod to run): in a burst thousands wait
    /// at once, and each pod is kilobytes once built. The pod is built to be checked and
    /// measured, then again to be sent, as JSON, and only the answer's uid is kept.
    async fn create(&self, spec: &SandboxSpec) -> Result<Endpoint, ProviderError> {
        let ask = Ask::of_pod(&pod::build_pod(spec, &self.config)?);
        if pod::no_network(spec) {
            self.ensure_policy().await?;
        }
        // The steps a create passes through once (or only when something went wrong) are boxed,
        // so that the create's future is the size of the step it is at: in a burst thousands
        // wait at once, each in one step.
        let mut admitted = Box::pin(self.admit(spec, ask)).await?;
        let deadline = Instant::now() + Duration::from_secs(self.config.create_timeout_s);
        let name = pod_name(&spec.id);
        let mut rx = self.tracker.begin_create(&spec.id, spec.job.as_deref().map(label_value));
        let mut creating = Creating { tracker: &self.tracker, id: &spec.id, ok: false };
        // With shared token Secrets the token is in one before the pod is made, so that the
        // kubelet never waits for it.
        let held = match &self.tokens {
            Some(tokens) => Some(tokens.deposit(&spec.id, &spec.token).await?),
            None => None,
        };
        let mut pod = pod::build_pod(spec, &self.config)?;
        if let Some(held) = &held {
            pod::set_token_secret(&mut pod, &held.secret);
        }
        let sent = self.api.create_pod(&pod);
        drop(pod);
        let uid = match sent.await {
            Ok(uid) => {
                if let Some(held) = held {
                    held.made(&name, &uid);
                }
                uid
            }
            Err(e) if e.code() == Some(409) => {
                drop(held);
                let existing = Box::pin(self.existing(spec, &name)).await?;
                if self.tokens.is_some() {
                    Box::pin(self.check_shared_token(spec, &existing)).await?;
                }
                existing.metadata.uid.unwrap_or_default()
            }
            Err(e) => return Err(e.into()),
        };
        if self.config.token == TokenDelivery::Secret
            && let Err(e) = Box::pin(self.put_secret(spec, &uid)).await
        {
            // Without its token the daemon never starts: take the pod back at once.
            self.tracker.mark_deleting(&spec.id);
            if let Err(del) = Box::pin(self.api.delete_pod(&name, 0)).await {
                tracing::warn!(sandbox = %spec.id, err = %chain(&del), "cannot delete a pod whose secret failed");
            }
            return Err(e);
        }
        let running = match self.wait_running(&spec.id, &mut rx, deadline).await {
            Ok(ip) => {
                let addr = daemon_addr(&ip, self.config.daemon_port);
                Box::pin(self.verify_daemon(spec, &addr, &mut rx, deadline)).await.map(|()| addr)
            }
            Err(e) => Err(e),
        };
        match running {
            Ok(addr) => {
                creating.ok = true;
                if let Some(a) = admitted.as_mut() {
                    a.kept = true;
                }
                Ok(Endpoint::Tcp(addr))
            }
            Err(e) => {
                // A pod that will never serve is removed now; its reason is in the error.
                self.tracker.mark_deleting(&spec.id);
                if let Err(del) = Box::pin(self.api.delete_pod(&name, self.config.termination_grace_s)).await {
                    tracing::warn!(sandbox = %spec.id, err = %chain(&del), "cannot delete the pod of a failed create");
                }
                Err(e)
            }
        }
    }

    /// Deletes the pod (its Secret goes with it); a pod that is gone already is fine.
    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        if !pod::is_dns_label(id) {
            return Ok(());
        }
        self.tracker.mark_deleting(id);
        if let Some(gate) = &self.admission {
            // A pod deleted before the capacity watch saw it bound would hold its place among
            // the `max_pending` unbound ones for good.
            gate.forget(id);
        }
        let existed = self.api.delete_pod(&pod_name(id), self.config.termination_grace_s).await?;
        if !existed {
            self.tracker.forget(id);
        }
        Ok(())
    }

    /// Lists the sandbox pods from the API server (not the watch's cache, so that a delete just
    /// answered is never listed), and their tokens. A pod being deleted is not listed; one not
    /// running is listed ended, with why.
    async fn list(&self) -> Result<Vec<Record>, ProviderError> {
        let selector = pod::selector(&self.config.instance);
        let pods = self.api.list_pods(&selector).await?;
        // Each pod's token, by the Secret and key its volume mounts (a sandbox id may come
        // again after a release, while the shared Secret of its first life lives on), or from
        // its annotation.
        let tokens: HashMap<(String, String), String> = match self.config.token {
            TokenDelivery::Secret | TokenDelivery::SharedSecret => {
                self.api
                    .list_secrets(&pod::owned_selector(&self.config.instance))
                    .await?
                    .into_iter()
                    .flat_map(|s| {
                        let name = s.metadata.name.clone().unwrap_or_default();
                        s.data.into_iter().flatten().filter_map(move |(key, value)| {
                            Some(((name.clone(), key), String::from_utf8(value.0).ok()?))
                        })
                    })
                    .collect()
            }
            TokenDelivery::PodAnnotation => pods
                .iter()
                .filter_map(|p| {
                    let token = pod::annotation_token(p)?;
                    Some(((p.metadata.name.clone()?, pod::TOKEN_KEY.to_string()), token))
                })
                .collect(),
        };
        let mut records = Vec::with_capacity(pods.len());
        for p in &pods {
            if p.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Some(mut spec) = pod::spec_of(p) else {
                tracing::warn!(
                    pod = p.metadata.name.as_deref().unwrap_or_default(),
                    "skipping a sandbox pod without a readable spec annotation"
                );
                continue;
            };
            let state = classify(p);
            let ready = matches!(state, PodState::Ready { .. });
            if !ready && self.tracker.is_creating(&spec.id) {
                // Still being made by this provider: not a sandbox yet.
                continue;
            }
            let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_default();
            let endpoint = Endpoint::Tcp(daemon_addr(&ip, self.config.daemon_port));
            let mut ended = match state {
                PodState::Ready { .. } => None,
                PodState::Ended(e) | PodState::Exited(e) => Some(e),
                PodState::Pending | PodState::Unschedulable(_) => Some(Ended {
                    reason: Reason::ProviderError,
                    message: format!("the pod was not running when its sandbox was listed ({})", status::describe(p)),
                }),
            };
            let mounted = match self.config.token {
                TokenDelivery::PodAnnotation => p.metadata.name.clone().map(|n| (n, pod::TOKEN_KEY.to_string())),
                // A pod with no readable token volume: its own Secret's, as before shared ones.
                _ => Some(pod::token_secret_of(p).map_or_else(
                    || (pod_name(&spec.id), pod::TOKEN_KEY.to_string()),
                    |(s, k)| (s.to_string(), k.to_string()),
                )),
            };
            let missing = mounted.as_ref().map_or_else(|| pod_name(&spec.id), |m| m.0.clone());
            match mounted.and_then(|m| tokens.get(&m)) {
                Some(t) => spec.token = t.clone(),
                None if ended.is_none() => {
                    ended = Some(Ended {
                        reason: Reason::ProviderError,
                        message: format!("its token Secret `{missing}` is missing"),
                    })
                }
                None => {}
            }
            let claim = match pod::claim_of(p) {
                Ok(claim) => claim.map(|mut c| {
                    c.spec.token = spec.token.clone();
                    c
                }),
                Err(why) => {
                    tracing::warn!(
                        pod = p.metadata.name.as_deref().unwrap_or_default(),
                        "listing a sandbox pod without its claim: {why}"
                    );
                    None
                }
            };
            records.push(Record { spec, endpoint, ended, claim, paused: false, ready: pod::ready_of(p) });
        }
        Ok(records)
    }

    /// Records on the sandbox's pod that it became ready (an annotation, one merge patch).
    async fn mark_ready(&self, id: &str, line: &str) -> Result<(), ProviderError> {
        if !pod::is_dns_label(id) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        match self.api.merge_patch_pod(&pod_name(id), &pod::ready_patch(line)).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some(404) => Err(ProviderError::NotFound(id.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    /// Records the claim on the pool sandbox's pod, by a conditional update: reads the pod,
    /// refuses one labelled claimed already, then merge-patches it carrying the
    /// `resourceVersion` it read (label `sandman.dev/claimed`, the claimer's job label, the
    /// claim and the claimed spec as annotations, no token). The API server applies it only if
    /// nothing wrote the pod in between, so of two servers claiming at once exactly one wins;
    /// the other's `409 Conflict` becomes [`ProviderError::Claimed`]. A conflict with a write
    /// that was no claim (the kubelet's) is tried again on the new version. The same claim found
    /// recorded already (its answer lost, the write retried) is a success.
    async fn claim(&self, claim: &Claim) -> Result<(), ProviderError> {
        let id = &claim.spec.id;
        if !pod::is_dns_label(id) {
            return Err(ProviderError::NotFound(id.clone()));
        }
        let name = pod_name(id);
        for attempt in 0..CLAIM_TRIES {
            let found = match self.api.get_pod(&name).await? {
                Some(p) if self.is_live_sandbox(&p, id) => p,
                _ => return Err(ProviderError::NotFound(id.clone())),
            };
            if pod::records_claim(&found, claim) {
                self.claimed(claim);
                return Ok(());
            }
            if pod::is_claimed(&found) {
                return Err(ProviderError::Claimed(if attempt > 0 {
                    format!("another server claimed pool sandbox `{id}` first")
                } else {
                    format!("pool sandbox `{id}` is claimed already (its pod `{name}` is labelled `{LABEL_CLAIMED}`)")
                }));
            }
            let Some(rv) = found.metadata.resource_version.as_deref() else {
                return Err(ProviderError::Backend(format!(
                    "the pod `{name}` has no resourceVersion: its claim cannot be a conditional update"
                )));
            };
            match self.api.merge_patch_pod(&name, &pod::claim_patch(claim, rv)?).await {
                Ok(_) => {
                    self.claimed(claim);
                    return Ok(());
                }
                // Someone wrote the pod since it was read: read it again to see who.
                Err(e) if e.code() == Some(409) => {
                    tracing::debug!(sandbox = %id, err = %chain(&e), "the pod changed before its claim");
                }
                Err(e) if e.code() == Some(404) => return Err(ProviderError::NotFound(id.clone())),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ProviderError::Backend(format!(
            "the pod `{name}` kept changing: the claim of pool sandbox `{id}` was not recorded after {CLAIM_TRIES} tries"
        )))
    }

    fn events(&self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Creates waiting for capacity: "waiting for capacity (cpu), position 3 in the queue" each
    /// time their place or what they wait for changes.
    fn progress(&self) -> Option<mpsc::Receiver<Progress>> {
        self.progress_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Pulls `image` on every node that may run sandboxes, one short-lived pod per node; see
    /// [`prepare::run`].
    async fn prepare(
        &self,
        image: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> Result<Prepared, ProviderError> {
        prepare::run(&self.api, self.pods.clone(), &self.config, image, progress).await
    }

    /// Reads the sandbox's pod from the API server (not the watch's cache, so that the record
    /// names the pod as it is now) and reports what it applied; see [`applied::applied`].
    async fn applied(&self, id: &str) -> Result<Applied, ProviderError> {
        if !pod::is_dns_label(id) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        match self.api.get_pod(&pod_name(id)).await? {
            Some(p) => Ok(applied::applied(&p, &self.config)),
            None => Err(ProviderError::NotFound(id.to_string())),
        }
    }
}

/// The NetworkPolicy of `network: none` sandboxes: no egress at all; ingress only to the daemon's
/// port (which needs the token), so the server still reaches it.
pub fn network_none_policy(config: &KubeConfig) -> NetworkPolicy {
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(NETWORK_NONE_POLICY.into()),
            namespace: Some(config.namespace.clone()),
            labels: Some([(LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string())].into()),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(
                    [
                        (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
                        (LABEL_NETWORK.to_string(), "none".to_string()),
                    ]
                    .into(),
                ),
                match_expressions: None,
            }),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: None,
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::Int(i32::from(config.daemon_port))),
                    protocol: Some("TCP".into()),
                    end_port: None,
                }]),
            }]),
            egress: Some(Vec::new()),
        }),
    }
}

/// Whether a container runtime (a node's `containerRuntimeVersion`, `containerd://1.6.20`) mounts
/// image volumes: containerd 2.1 and later, CRI-O 1.31 and later. Another runtime, or one that
/// does not say, is given the benefit of the doubt.
pub fn mounts_image_volumes(runtime: &str) -> bool {
    let Some((name, version)) = runtime.split_once("://") else { return true };
    let mut parts = version.trim_start_matches('v').split(['.', '-', '+']).map(|p| p.parse::<u32>().ok());
    let (Some(Some(major)), Some(Some(minor))) = (parts.next(), parts.next()) else { return true };
    match name {
        "containerd" => (major, minor) >= (2, 1),
        "cri-o" => (major, minor) >= (1, 31),
        _ => true,
    }
}

/// With `injection: image_volume`, refuses to start when no eligible node's runtime mounts image
/// volumes (each create would fail at the kubelet with a bare `failed to mkdir`), naming the
/// nodes and their runtimes; warns of the eligible nodes that cannot when some can. A node list
/// the API server refuses is only warned of: the check is a courtesy, not a gate.
pub async fn check_runtimes(client: &kube::Client, config: &KubeConfig) -> Result<(), ProviderError> {
    if config.injection != Injection::ImageVolume {
        return Ok(());
    }
    let nodes = match kube::Api::<Node>::all(client.clone()).list(&kube::api::ListParams::default()).await {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!(err = %chain(&e), "cannot list the nodes to check that their runtimes mount image volumes");
            return Ok(());
        }
    };
    let runtimes: Vec<(String, String)> = nodes
        .iter()
        .filter(|n| capacity::eligible(n, config))
        .map(|n| {
            let runtime =
                n.status.as_ref().and_then(|s| s.node_info.as_ref()).map(|i| i.container_runtime_version.clone());
            (n.metadata.name.clone().unwrap_or_default(), runtime.unwrap_or_default())
        })
        .collect();
    let cannot: Vec<String> = runtimes
        .iter()
        .filter(|(_, runtime)| !mounts_image_volumes(runtime))
        .map(|(node, runtime)| format!("{node} ({runtime})"))
        .collect();
    if cannot.is_empty() {
        return Ok(());
    }
    if cannot.len() == runtimes.len() {
        return Err(ProviderError::Unsupported(format!(
            "`injection: image_volume` needs a container runtime that mounts image volumes (containerd 2.1+ or CRI-O 1.31+), and no eligible node has one: {}; use `injection: init_container` (the default) or `host_path`",
            cannot.join(", ")
        )));
    }
    tracing::warn!(
        nodes = %cannot.join(", "),
        "`injection: image_volume`: these eligible nodes' runtimes cannot mount image volumes (containerd 2.1+ or CRI-O 1.31+ can); a sandbox placed there fails to start"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mounts_image_volumes;

    #[test]
    fn runtimes_that_mount_image_volumes_are_told_by_name_and_version() {
        for yes in [
            "containerd://2.1.0",
            "containerd://2.2.1-k3s1",
            "cri-o://1.31.2",
            "cri-o://v1.33.0",
            "docker://28.0",
            "",
            "containerd://dev",
        ] {
            assert!(mounts_image_volumes(yes), "{yes}");
        }
        for no in ["containerd://1.6.20", "containerd://2.0.5", "cri-o://1.30.4", "containerd://1.7.27-1"] {
            assert!(!mounts_image_volumes(no), "{no}");
        }
    }
}

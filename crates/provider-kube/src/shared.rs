//! What several server replicas share through the API server, so that etcd is their one store:
//! the Lease that names the leader ([`Shared::elect`], [`Shared::leader`]), the documents of
//! record (jobs, pools, snapshots) in one ConfigMap written with optimistic concurrency
//! ([`Documents`]), and the key that signs conditions records in a Secret ([`Shared::key`]).
//!
//! Only the leader writes the documents. A write carries the `resourceVersion` the leader last
//! read or wrote, so a `409 Conflict` means another replica wrote them: this one is no longer
//! the only leader, and [`Documents::fenced`] tells the server to stop (a replica that stops is
//! restarted by its Deployment as a follower).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use sandman_provider::ProviderError;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// The task that holds (or campaigns for) the Lease: it releases the Lease and ends once every
/// receiver [`Shared::elect`] gave is dropped, or once it stops leading.
pub type Election = tokio::task::JoinHandle<()>;

/// What the process does when the API server refuses its credentials (`401 Unauthorized`),
/// once set by [`on_credentials_refused`].
static CREDENTIALS_REFUSED: std::sync::OnceLock<RefusedHook> = std::sync::OnceLock::new();

type RefusedHook = Box<dyn Fn(&str) + Send + Sync>;

/// Sets what happens the first time the API server answers `401 Unauthorized` to any call of
/// this process (the provider's, the shared documents' writer): a replica's pod that was deleted
/// (force-deleted, its node lost) may still run for a while with a token the API server no
/// longer accepts, and must not go on answering calls it can no longer carry out. A server
/// replica exits there (see `sandman_server::replicas`). Set once; later calls are ignored.
pub fn on_credentials_refused(hook: impl Fn(&str) + Send + Sync + 'static) {
    let _ = CREDENTIALS_REFUSED.set(Box::new(hook));
}

/// Runs the hook of [`on_credentials_refused`], if any, for the call `what`.
pub(crate) fn credentials_refused(what: &str) {
    if let Some(hook) = CREDENTIALS_REFUSED.get() {
        hook(what);
    }
}

/// The Lease whose holder is the leader.
pub const LEASE: &str = "sandman-leader";
/// The ConfigMap holding the documents of record.
pub const DOCUMENTS: &str = "sandman-state";
/// The Secret holding the key that signs conditions records.
pub const KEY_SECRET: &str = "sandman-conditions-key";
const KEY_FIELD: &str = "key";
/// Seconds a leader's Lease holds without a renewal; a follower takes over at most this long
/// after a leader dies without releasing it.
pub const LEASE_DURATION_S: u64 = 15;
/// How often a leader renews the Lease, and a follower looks at it.
const LEASE_RETRY: Duration = Duration::from_secs(2);
/// A leader that has not renewed the Lease for this long stops leading, before any follower may
/// take it ([`LEASE_DURATION_S`] after it last saw it change).
const RENEW_DEADLINE: Duration = Duration::from_secs(10);

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/managed-by".to_string(), "sandman".to_string()),
        ("app.kubernetes.io/part-of".to_string(), "sandman".to_string()),
    ])
}

fn failed(what: &str, e: &kube::Error) -> ProviderError {
    ProviderError::Backend(format!("cannot {what}: {}", crate::api::chain(e)))
}

fn status(e: &kube::Error) -> Option<&kube::core::Status> {
    match e {
        kube::Error::Api(s) => Some(s),
        _ => None,
    }
}

/// The replicas' shared objects in one namespace (the server's own).
#[derive(Clone)]
pub struct Shared {
    client: kube::Client,
    namespace: String,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("namespace", &self.namespace).finish_non_exhaustive()
    }
}

impl Shared {
    /// Connects as the provider does (in-cluster, or the kubeconfig).
    pub async fn connect(namespace: &str) -> Result<Shared, ProviderError> {
        let client = kube::Client::try_default().await.map_err(|e| failed("reach the Kubernetes API server", &e))?;
        Ok(Shared::new(client, namespace))
    }

    pub fn new(client: kube::Client, namespace: &str) -> Shared {
        Shared { client, namespace: namespace.to_string() }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Campaigns for the Lease as `identity` (the replica's address, which followers forward
    /// to): the receiver is `true` while this replica leads. As client-go's leader election:
    /// every write of the Lease is a replace carrying the `resourceVersion` read just before, so
    /// of two replicas writing at once one wins; a follower takes the Lease only once it has
    /// seen it unchanged for [`LEASE_DURATION_S`] by its own clock; and a leader that could not
    /// renew it for [`RENEW_DEADLINE`] (shorter) stops leading, the receiver turns `false` and
    /// the task ends. Dropping every receiver releases the Lease, so that a follower takes over
    /// at its next look rather than when the Lease expires.
    pub async fn elect(&self, identity: &str) -> Result<(watch::Receiver<bool>, Election), ProviderError> {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        api.get_opt(LEASE).await.map_err(|e| failed(&format!("read the Lease `{LEASE}`"), &e))?;
        let (tx, rx) = watch::channel(false);
        let identity = identity.to_string();
        let task = tokio::spawn(async move {
            let mut elector = Elector { api, identity, observed: None };
            let mut renewed: Option<tokio::time::Instant> = None;
            loop {
                match elector.try_acquire_or_renew().await {
                    Ok(true) => renewed = Some(tokio::time::Instant::now()),
                    Ok(false) => {
                        if renewed.is_some() {
                            tracing::error!(lease = LEASE, "another replica holds the Lease");
                            tx.send_replace(false);
                            return;
                        }
                    }
                    Err(e) => tracing::warn!(lease = LEASE, error = %e, "cannot read or write the Lease"),
                }
                if let Some(at) = renewed {
                    if at.elapsed() > RENEW_DEADLINE {
                        tracing::error!(lease = LEASE, "could not renew the Lease in time: no longer leading");
                        tx.send_replace(false);
                        return;
                    }
                    tx.send_if_modified(|l| !std::mem::replace(l, true));
                }
                tokio::select! {
                    () = tx.closed() => {
                        if renewed.is_some() {
                            elector.release().await;
                        }
                        return;
                    }
                    () = tokio::time::sleep(LEASE_RETRY) => {}
                }
            }
        });
        Ok((rx, task))
    }

    /// The leader's identity as the Lease names it, followed by one watch of that one object:
    /// `None` while nobody holds it. Ends with `cancel`.
    pub fn leader(&self, cancel: CancellationToken) -> watch::Receiver<Option<String>> {
        let (tx, rx) = watch::channel(None);
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        let config = kube::runtime::watcher::Config::default().fields(&format!("metadata.name={LEASE}"));
        tokio::spawn(async move {
            let stream = kube::runtime::watcher(api, config);
            let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(stream));
            loop {
                let event = tokio::select! {
                    () = cancel.cancelled() => return,
                    e = stream.next() => e,
                };
                let lease = match event {
                    None => return,
                    Some(Ok(kube::runtime::watcher::Event::Apply(l) | kube::runtime::watcher::Event::InitApply(l))) => {
                        l
                    }
                    Some(Ok(kube::runtime::watcher::Event::Delete(_))) => {
                        tx.send_replace(None);
                        continue;
                    }
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, lease = LEASE, "watching the leader's Lease");
                        continue;
                    }
                };
                let holder = lease.spec.and_then(|s| s.holder_identity).filter(|h| !h.is_empty());
                tx.send_if_modified(|old| {
                    let changed = *old != holder;
                    *old = holder;
                    changed
                });
            }
        });
        rx
    }

    /// The conditions key every replica signs with: read from its Secret, or made (32 random
    /// bytes from `make`) by the first replica to start. Of two making it at once, one create
    /// wins and the other reads the winner's.
    pub async fn key(&self, make: impl FnOnce() -> Vec<u8>) -> Result<Vec<u8>, ProviderError> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        let read = |s: Secret| -> Result<Vec<u8>, ProviderError> {
            let key = s.data.and_then(|mut d| d.remove(KEY_FIELD)).map(|b| b.0).unwrap_or_default();
            if key.len() < 32 {
                return Err(ProviderError::Backend(format!(
                    "the Secret `{KEY_SECRET}` holds a key of {} bytes under `{KEY_FIELD}`; a signing key has 32",
                    key.len()
                )));
            }
            Ok(key)
        };
        match api.get_opt(KEY_SECRET).await {
            Ok(Some(s)) => return read(s),
            Ok(None) => {}
            Err(e) => return Err(failed(&format!("read the Secret `{KEY_SECRET}`"), &e)),
        }
        let secret = Secret {
            metadata: ObjectMeta { name: Some(KEY_SECRET.into()), labels: Some(labels()), ..ObjectMeta::default() },
            data: Some(BTreeMap::from([(KEY_FIELD.to_string(), ByteString(make()))])),
            ..Secret::default()
        };
        match api.create(&PostParams::default(), &secret).await {
            Ok(s) => read(s),
            Err(e) if status(&e).is_some_and(kube::core::Status::is_already_exists) => {
                match api.get(KEY_SECRET).await {
                    Ok(s) => read(s),
                    Err(e) => Err(failed(&format!("read the Secret `{KEY_SECRET}`"), &e)),
                }
            }
            Err(e) => Err(failed(&format!("make the Secret `{KEY_SECRET}`"), &e)),
        }
    }

    /// The documents of record, read now from their ConfigMap (made empty when missing); a
    /// writer task keeps the ConfigMap up to date until `cancel`.
    pub async fn documents(&self, cancel: CancellationToken) -> Result<Arc<Documents>, ProviderError> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let found = match api.get_opt(DOCUMENTS).await {
            Ok(Some(cm)) => cm,
            Ok(None) => {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(DOCUMENTS.into()),
                        labels: Some(labels()),
                        ..ObjectMeta::default()
                    },
                    ..ConfigMap::default()
                };
                match api.create(&PostParams::default(), &cm).await {
                    Ok(cm) => cm,
                    Err(e) if status(&e).is_some_and(kube::core::Status::is_already_exists) => api
                        .get(DOCUMENTS)
                        .await
                        .map_err(|e| failed(&format!("read the ConfigMap `{DOCUMENTS}`"), &e))?,
                    Err(e) => return Err(failed(&format!("make the ConfigMap `{DOCUMENTS}`"), &e)),
                }
            }
            Err(e) => return Err(failed(&format!("read the ConfigMap `{DOCUMENTS}`"), &e)),
        };
        let docs = Arc::new(Documents {
            state: Mutex::new(DocState {
                data: found.data.unwrap_or_default(),
                resource_version: found.metadata.resource_version,
                version: 0,
            }),
            wake: Notify::new(),
            written: watch::channel(Written::Upto(0)).0,
            fenced: CancellationToken::new(),
        });
        tokio::spawn(docs.clone().write_back(api, cancel));
        Ok(docs)
    }
}

#[derive(Debug)]
struct DocState {
    data: BTreeMap<String, String>,
    /// What the API server last said the ConfigMap's `resourceVersion` is.
    resource_version: Option<String>,
    /// Bumped by every change.
    version: u64,
}

#[derive(Debug, Clone, PartialEq)]
enum Written {
    /// Every change up to this version is in the ConfigMap.
    Upto(u64),
    /// Another replica wrote the ConfigMap: nothing more will be written.
    Fenced(String),
}

/// Named documents (each a JSON text) kept in one ConfigMap: [`Documents::set`] changes one in
/// memory at once, a writer task writes the ConfigMap after it (coalescing changes made
/// meanwhile), and [`Documents::written`] waits until a change is in the API server.
#[derive(Debug)]
pub struct Documents {
    state: Mutex<DocState>,
    wake: Notify,
    written: watch::Sender<Written>,
    fenced: CancellationToken,
}

/// Pause after a write the API server refused for a reason other than a conflict.
const RETRY: Duration = Duration::from_secs(1);
/// The least time between two writes of the ConfigMap: changes made meanwhile (a sandbox's
/// accounting sums at each end, in a burst) go in the next write, so that the API server takes
/// at most ten writes a second from it however fast sandboxes come and go.
const WRITE_EVERY: Duration = Duration::from_millis(100);

impl Documents {
    fn lock(&self) -> std::sync::MutexGuard<'_, DocState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The document `name` as last set (or read at start).
    pub fn get(&self, name: &str) -> Option<String> {
        self.lock().data.get(name).cloned()
    }

    /// Changes document `name`; answers the version to wait for with [`Documents::written`].
    pub fn set(&self, name: &str, text: String) -> u64 {
        let version = {
            let mut s = self.lock();
            s.data.insert(name.to_string(), text);
            s.version += 1;
            s.version
        };
        self.wake.notify_one();
        version
    }

    /// The version of the last change.
    pub fn version(&self) -> u64 {
        self.lock().version
    }

    /// Waits until every change up to `version` is in the ConfigMap; why not, when another
    /// replica wrote it meanwhile.
    pub async fn written(&self, version: u64) -> Result<(), String> {
        let mut rx = self.written.subscribe();
        let seen = rx
            .wait_for(|w| match w {
                Written::Upto(v) => *v >= version,
                Written::Fenced(_) => true,
            })
            .await
            .map(|w| w.clone());
        match seen {
            Ok(Written::Upto(_)) => Ok(()),
            Ok(Written::Fenced(why)) => Err(why),
            Err(_) => Err("the writer of the shared state stopped".into()),
        }
    }

    /// Cancelled when another replica wrote the documents: this replica must stop leading.
    pub fn fenced(&self) -> CancellationToken {
        self.fenced.clone()
    }

    async fn write_back(self: Arc<Self>, api: Api<ConfigMap>, cancel: CancellationToken) {
        loop {
            let (data, resource_version, version) = {
                let s = self.lock();
                (s.data.clone(), s.resource_version.clone(), s.version)
            };
            if self.written.borrow().clone() != Written::Upto(version) {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(DOCUMENTS.into()),
                        labels: Some(labels()),
                        resource_version,
                        ..ObjectMeta::default()
                    },
                    data: Some(data),
                    ..ConfigMap::default()
                };
                match api.replace(DOCUMENTS, &PostParams::default(), &cm).await {
                    Ok(cm) => {
                        self.lock().resource_version = cm.metadata.resource_version;
                        self.written.send_replace(Written::Upto(version));
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(WRITE_EVERY) => {}
                        }
                        continue;
                    }
                    Err(e) if status(&e).is_some_and(|s| s.code == 401) => {
                        credentials_refused(&format!("write the ConfigMap `{DOCUMENTS}`"));
                        tracing::warn!(error = %crate::api::chain(&e), "cannot write the shared state; trying again");
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(RETRY) => {}
                        }
                        continue;
                    }
                    Err(e) if status(&e).is_some_and(|s| s.is_conflict() || s.is_not_found()) => {
                        let why = format!(
                            "another replica changed the ConfigMap `{DOCUMENTS}` since this one last wrote it \
                             ({}): two replicas acted as leader",
                            crate::api::chain(&e)
                        );
                        tracing::error!(error = %why, "the shared state was written by another replica");
                        self.written.send_replace(Written::Fenced(why));
                        self.fenced.cancel();
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %crate::api::chain(&e), "cannot write the shared state; trying again");
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(RETRY) => {}
                        }
                        continue;
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.wake.notified() => {}
            }
        }
    }
}

/// One replica's view of the Lease while it campaigns or leads.
struct Elector {
    api: Api<Lease>,
    identity: String,
    /// The Lease's `resourceVersion` when this replica last saw it change, and when (by its own
    /// clock: another replica's `renewTime` is never compared with this one's clock).
    observed: Option<(String, tokio::time::Instant)>,
}

impl Elector {
    /// Takes or renews the Lease: `true` when this replica holds it now.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, String> {
        let now = tokio::time::Instant::now();
        let stamp = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now());
        let Some(mut lease) = self.api.get_opt(LEASE).await.map_err(|e| crate::api::chain(&e))? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(LEASE.into()), labels: Some(labels()), ..ObjectMeta::default() },
                spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(LEASE_DURATION_S as i32),
                    acquire_time: Some(stamp.clone()),
                    renew_time: Some(stamp),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if status(&e).is_some_and(kube::core::Status::is_already_exists) => Ok(false),
                Err(e) => Err(crate::api::chain(&e)),
            };
        };
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != rv) {
            self.observed = Some((rv, now));
        }
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(self.identity.as_str());
        if let (Some(_), false) = (&holder, mine) {
            let duration =
                Duration::from_secs(spec.lease_duration_seconds.map_or(LEASE_DURATION_S, |d| d.max(1) as u64));
            let since = self.observed.as_ref().map_or(now, |(_, at)| *at);
            if now.saturating_duration_since(since) < duration {
                return Ok(false);
            }
        }
        if !mine {
            spec.acquire_time = Some(stamp.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + i32::from(holder.is_some()));
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.lease_duration_seconds = Some(LEASE_DURATION_S as i32);
        spec.renew_time = Some(stamp);
        // A replace carries the resourceVersion just read: a write by anyone since is a conflict.
        match self.api.replace(LEASE, &PostParams::default(), &lease).await {
            Ok(written) => {
                let rv = written.metadata.resource_version.unwrap_or_default();
                self.observed = Some((rv, tokio::time::Instant::now()));
                Ok(true)
            }
            Err(e) if status(&e).is_some_and(kube::core::Status::is_conflict) => Ok(false),
            Err(e) => Err(crate::api::chain(&e)),
        }
    }

    /// Gives the Lease up, if this replica still holds it, so that a follower need not wait for
    /// it to expire.
    async fn release(&self) {
        let Ok(Some(mut lease)) = self.api.get_opt(LEASE).await else { return };
        let Some(spec) = lease.spec.as_mut() else { return };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        match self.api.replace(LEASE, &PostParams::default(), &lease).await {
            Ok(_) => tracing::info!(lease = LEASE, "released the Lease"),
            Err(e) => tracing::warn!(lease = LEASE, error = %crate::api::chain(&e), "cannot release the Lease"),
        }
    }
}

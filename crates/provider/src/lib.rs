//! The provider seam: [`Provider`] is what a sandbox backend implements (create, delete, list,
//! observe); [`SandboxSpec`] is what the server asks for and what the backend keeps as the state
//! of record, so that a restarted server finds every sandbox again. [`fake::FakeProvider`] lives
//! beside it, and [`conformance`] checks any provider against the same expectations; [`records`]
//! is how providers keep a sandbox's records in the server's state directory; [`identity`] is
//! how a create makes sure the daemon at its endpoint is the sandbox's own.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use sandman_wire::server::{Applied, ImageConfig, Isolation, Network, Profile, Reason, Resources};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

#[cfg(feature = "conformance")]
pub mod conformance;
pub mod fake;
#[cfg(feature = "firewall")]
pub mod firewall;
pub mod identity;
pub mod records;

/// Everything a provider needs to make a sandbox, and everything the server needs back after a
/// restart. Providers persist it whole (a file, labels and annotations) and return it from
/// [`Provider::list`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    pub id: String,
    pub image: String,
    pub resources: Resources,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub job: Option<String>,
    pub profile: Profile,
    pub network: Network,
    /// The daemon's bearer token; only the server and the daemon know it.
    pub token: String,
    /// The daemon's own dead-man switch, in seconds: it exits when nobody calls for this long.
    pub daemon_lease_s: u64,
    pub created_at_ms: u64,
    /// The server's bookkeeping (lease, idle timeout, ttl, idempotency key), kept for recovery.
    pub server: ServerMeta,
}

/// What the server keeps about a sandbox beyond what the provider uses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerMeta {
    pub lease_s: u64,
    pub idle_timeout_s: Option<u64>,
    pub ttl_s: Option<u64>,
    pub idempotency_key: Option<String>,
    /// The create's default user for the sandbox's commands (the server passes it to each call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The job's weight when the create was asked for (unset: 1). A provider that makes creates
    /// wait for room (the kubernetes provider's capacity-aware admission) shares the room
    /// between the jobs waiting by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// A proxied call on the sandbox while it is paused resumes it first (the create's
    /// `auto_resume`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_resume: bool,
}

/// The label that marks a warm pool's sandboxes in [`SandboxSpec::labels`] (its value: the
/// pool's name). A provider may give their creates (the pool's refills) the last place.
pub const POOL_LABEL: &str = "sandman.dev/pool";

/// The sandboxes a provider is making right now: `list` must not take a half-made one for a
/// broken one, and a second create of an id being made is refused.
#[derive(Debug, Default)]
pub struct Creating(Mutex<HashSet<String>>);

impl Creating {
    /// Marks `id` as being made until the guard is dropped, however the create ends.
    pub fn start(&self, id: &str) -> Result<CreatingGuard<'_>, ProviderError> {
        if !self.lock().insert(id.to_string()) {
            return Err(ProviderError::Backend(format!("sandbox `{id}` is being created already")));
        }
        Ok(CreatingGuard { set: self, id: id.to_string() })
    }

    /// Whether `id` is being made now.
    pub fn contains(&self, id: &str) -> bool {
        self.lock().contains(id)
    }

    /// The ids being made now.
    pub fn snapshot(&self) -> HashSet<String> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Takes its sandbox off [`Creating`] when dropped.
#[derive(Debug)]
pub struct CreatingGuard<'a> {
    set: &'a Creating,
    id: String,
}

impl Drop for CreatingGuard<'_> {
    fn drop(&mut self) {
        self.set.lock().remove(&self.id);
    }
}

/// Where a sandbox's daemon answers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

/// A sandbox the provider holds, as its records say.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub spec: SandboxSpec,
    pub endpoint: Endpoint,
    /// `None` while it runs; why it ended when it has (the daemon died, OOM, eviction…).
    pub ended: Option<Ended>,
    /// The claim of a warm-pool sandbox, where the provider keeps claims (see
    /// [`Provider::claim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
    /// Its processes are frozen ([`Provider::pause`]), as the backend says now: a restarted
    /// server finds it paused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// What [`Provider::mark_ready`] recorded, where the provider keeps it (the kubernetes
    /// provider, on the pod): the sandbox became ready, with this line of the server's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
}

/// A warm-pool sandbox taken by a create: the sandbox as its claimer made it. The server
/// journals it; a provider whose records outlive the server's state directory keeps it too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    /// The claimed sandbox's spec: the claimer's job, labels, lease and key, the pool's image.
    pub spec: SandboxSpec,
    /// The claimer's environment, merged into its exec, process and session calls.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    pub claimed_ms: u64,
    /// When the pool made it.
    pub pool_created_ms: u64,
}

/// How a sandbox ended on the provider's side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ended {
    pub reason: Reason,
    pub message: String,
}

/// Something the provider saw happen to a sandbox without being asked: its daemon exited, it was
/// OOM-killed, its pod was evicted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderEvent {
    pub id: String,
    pub ended: Ended,
}

/// How many provider events may wait for the server before the provider's watcher blocks.
pub const EVENT_CAPACITY: usize = 1024;

/// A line of progress on a sandbox still being created (an image pull), for whoever waits for it.
/// Progress has its own channel, apart from [`ProviderEvent`]s: it is lossy (a provider drops a
/// line when the channel is full, see [`report_progress`]) so that it never slows a create and
/// never takes the place of a death the server must see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    pub id: String,
    pub message: String,
}

/// How many progress lines may wait for the server; more are dropped. Providers throttle their
/// lines (a few a second per create), so this covers many concurrent pulls.
pub const PROGRESS_CAPACITY: usize = 256;

/// Sends a progress line without waiting; a full or closed channel drops it.
pub fn report_progress(tx: &mpsc::Sender<Progress>, id: &str, message: String) {
    let _ = tx.try_send(Progress { id: id.to_string(), message });
}

/// How one node gets on with [`Provider::prepare`]: `nodes_total` is how many nodes the
/// prepare covers (1 for a provider with one host), the same on every line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeProgress {
    pub node: String,
    pub state: NodeState,
    pub message: String,
    pub nodes_total: u32,
}

/// Where one node is in a prepare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    Pulling,
    /// The node has the image; counted once per node.
    Ready,
    Failed,
}

/// How a prepare ended: how many of the nodes that may run sandboxes have the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prepared {
    pub nodes_ready: u32,
    pub nodes_total: u32,
}

/// What a provider made of a snapshot ([`Provider::snapshot`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotMade {
    /// Bytes of the snapshot's own layer (the sandbox's changes), where the provider knows them.
    pub size: Option<u64>,
    /// The image reference the provider pushed the snapshot to, when it did.
    pub pushed: Option<String>,
}

/// What a provider's snapshots record ([`Provider::snapshot_scope`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotScope {
    /// The sandbox's whole file system (its changes over its image): [`Provider::snapshot`].
    Whole,
    /// Only the directories a request names, which the server archives through the sandbox's
    /// daemon: [`Provider::snapshot_dirs`]. `why` says why the whole file system cannot be
    /// recorded; the archives of one snapshot may hold at most `max_bytes` together.
    Named { why: &'static str, max_bytes: u64 },
}

/// One directory a snapshot records: its absolute path, its own mode and owner, and its
/// contents as the sandbox's daemon archived them (`GET /v1/archive`: a tar whose names are
/// relative to the directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedDir {
    pub path: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub tar: Vec<u8>,
}

/// Why a provider call failed.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The request asks for something this provider cannot do; nothing was created.
    #[error("{0}")]
    Unsupported(String),
    /// The sandbox failed to come up for a reason of the lifecycle (image pull, daemon start…).
    #[error("{message}")]
    Failed { reason: Reason, message: String },
    #[error("no sandbox `{0}` in the provider")]
    NotFound(String),
    /// Another claim of the same pool sandbox got there first (another server sharing the
    /// provider's records); this one took nothing.
    #[error("{0}")]
    Claimed(String),
    /// Said whole, with the system's error (`cannot make the cgroup …: Cannot allocate memory`):
    /// the message is what a caller sees of a failed create.
    #[error("{what}: {cause}")]
    Io { what: String, cause: std::io::Error },
    /// The backend (engine, API server) answered with an error.
    #[error("{0}")]
    Backend(String),
}

impl ProviderError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ProviderError::Io { what: what.into(), cause: source }
    }

    /// The lifecycle reason a failed create is reported with.
    pub fn reason(&self) -> Reason {
        match self {
            ProviderError::Failed { reason, .. } => *reason,
            _ => Reason::ProviderError,
        }
    }
}

/// A sandbox backend. Small on purpose: the server owns the lifecycle, leases, readiness and the
/// proxy; a provider only makes, finds and removes sandboxes, and reports deaths it sees (and,
/// optionally, the progress of slow creates).
pub trait Provider: Send + Sync {
    fn name(&self) -> &'static str;

    /// How this provider keeps its sandboxes apart from the host and each other. The default
    /// claims nothing.
    fn isolation(&self) -> Isolation {
        Isolation::None
    }

    /// The resources a create that names none gets (`memory`, `disk`): the server fills them
    /// into the spec before [`Provider::check`], so that they are bounds the sandbox's info and
    /// conditions record show. An `eval` create's memory is never filled: eval fixes what it
    /// asks. The default fills nothing.
    fn defaults(&self) -> Resources {
        Resources::default()
    }

    /// Refuses at once, creating nothing, a spec this provider cannot honour (an image it cannot
    /// run, a network mode it cannot give). `create` may still fail later for reasons found only
    /// by trying.
    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        let _ = spec;
        Ok(())
    }

    /// Makes the sandbox and starts its daemon; answers with where the daemon will listen. The
    /// server then waits for the daemon to answer and prove the sandbox's token
    /// ([`identity::prove`]), unless the provider did so itself ([`Provider::proves_daemon`]).
    fn create(&self, spec: &SandboxSpec) -> impl Future<Output = Result<Endpoint, ProviderError>> + Send;

    /// Whether [`Provider::create`] answers only once the daemon at the endpoint has proven the
    /// sandbox's token ([`identity::prove`]), failing the create otherwise (with
    /// [`identity::Unproven::reason`]). The server then takes the daemon as healthy and the
    /// sandbox's own and does not ask again: one health round trip per create. A provider does
    /// it itself where it can do better than the server alone (Kubernetes: the pod's watch is
    /// followed meanwhile, so a pod that ends fails the create with its reason). The default is
    /// no: the server proves the daemon after every create.
    fn proves_daemon(&self) -> bool {
        false
    }

    /// Removes the sandbox and everything it holds. Deleting one that is gone already is fine.
    fn delete(&self, id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;

    /// Every sandbox the provider's records hold, running or ended but not yet deleted.
    fn list(&self) -> impl Future<Output = Result<Vec<Record>, ProviderError>> + Send;

    /// Takes the stream of provider events; called once by the server.
    fn events(&self) -> Option<mpsc::Receiver<ProviderEvent>>;

    /// Takes the stream of progress lines of creates; called once by the server. The default is
    /// none: a provider whose creates are quick has nothing to tell.
    fn progress(&self) -> Option<mpsc::Receiver<Progress>> {
        None
    }

    /// Makes `image` ready ahead of the creates that need it (a pull, on every node that may
    /// run sandboxes), telling `progress` how each node gets on. The server has already passed
    /// a spec with this image through [`Provider::check`]. The default does nothing and reports
    /// its one host ready: a provider whose images are always there (the process provider's
    /// `host`) needs nothing more.
    fn prepare(
        &self,
        image: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> impl Future<Output = Result<Prepared, ProviderError>> + Send {
        let _ = (image, progress);
        async { Ok(Prepared { nodes_ready: 1, nodes_total: 1 }) }
    }

    /// What the provider applied to sandbox `id`, as it reports it (limits, network, the image
    /// pinned to a digest, its own specifics), for the sandbox's conditions record; the server
    /// compares it with what the daemon observes from inside. The default applied nothing.
    fn applied(&self, id: &str) -> impl Future<Output = Result<Applied, ProviderError>> + Send {
        let _ = id;
        async { Ok(Applied::default()) }
    }

    /// The configuration of the image sandbox `id` runs (its `USER`, `WORKDIR`, `ENV`,
    /// entrypoint and command), where the provider knows it; the server shows it in the sandbox's
    /// info and takes its user as the sandbox's default. The default knows none.
    fn image_config(&self, id: &str) -> impl Future<Output = Result<Option<ImageConfig>, ProviderError>> + Send {
        let _ = id;
        async { Ok(None) }
    }

    /// Records `claim` of a warm-pool sandbox where the provider keeps its records, atomically:
    /// [`ProviderError::Claimed`] when another claim of it got there first. A provider whose
    /// records are shared beyond one server's state directory (Kubernetes: the pod, by a
    /// conditional update) must, so that a restarted or second server finds it claimed and
    /// never hands it out again; [`Provider::list`] then answers it in [`Record::claim`]. The
    /// default records nothing: the server's own claims file covers a provider whose records
    /// live beside it.
    fn claim(&self, claim: &Claim) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = claim;
        async { Ok(()) }
    }

    /// Records that sandbox `id` became ready, with the server's `line` about it, where the
    /// provider keeps its records beyond one server (Kubernetes: an annotation on the pod), so
    /// that a replica taking over tells it from a create that was interrupted; [`Provider::list`]
    /// answers it in [`Record::ready`]. The server asks only when several replicas share the
    /// provider (one server keeps its ready journal in its state directory). The default keeps
    /// nothing.
    fn mark_ready(&self, id: &str, line: &str) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = (id, line);
        async { Ok(()) }
    }

    /// Records sandbox `id`'s files as they are now under `snapshot` (its changes over its
    /// image, as one more layer of that image, with the image's configuration), so that a
    /// create whose image is `snapshot:<snapshot>` starts with them. Processes are not kept.
    /// The default refuses, naming the provider.
    fn snapshot(&self, id: &str, snapshot: &str) -> impl Future<Output = Result<SnapshotMade, ProviderError>> + Send {
        let _ = (id, snapshot);
        let name = self.name();
        async move { Err(ProviderError::Unsupported(format!("the {name} provider cannot snapshot a sandbox"))) }
    }

    /// What this provider's snapshots record: the whole file system (the default), or only the
    /// directories a request names.
    fn snapshot_scope(&self) -> SnapshotScope {
        SnapshotScope::Whole
    }

    /// Refuses at once, before the server reads anything of the sandbox, a snapshot this
    /// provider cannot take as it is set up (the kubernetes provider with no registry to push
    /// to). The default takes them.
    fn check_snapshot(&self) -> Result<(), ProviderError> {
        Ok(())
    }

    /// Records `dirs` of sandbox `id` (archived by the server through its daemon) under
    /// `snapshot`, for a provider whose [`Provider::snapshot_scope`] is
    /// [`SnapshotScope::Named`]: a create whose image is `snapshot:<snapshot>` starts from the
    /// sandbox's image with those directories as they were. The default refuses, naming the
    /// provider.
    fn snapshot_dirs(
        &self,
        id: &str,
        snapshot: &str,
        dirs: Vec<NamedDir>,
    ) -> impl Future<Output = Result<SnapshotMade, ProviderError>> + Send {
        let _ = (id, snapshot, dirs);
        let name = self.name();
        async move {
            Err(ProviderError::Unsupported(format!(
                "the {name} provider records a sandbox's whole file system, not named directories"
            )))
        }
    }

    /// Removes `snapshot`; sandboxes started from it keep running. Removing one that is gone
    /// already is fine.
    fn delete_snapshot(&self, snapshot: &str) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = snapshot;
        async { Ok(()) }
    }

    /// Pushes `snapshot` as an image to `reference` (`registry/repository:tag`), so that other
    /// machines and providers can start from it; answers the manifest's digest.
    fn export_snapshot(
        &self,
        snapshot: &str,
        reference: &str,
    ) -> impl Future<Output = Result<String, ProviderError>> + Send {
        let _ = (snapshot, reference);
        let name = self.name();
        async move { Err(ProviderError::Unsupported(format!("the {name} provider cannot export a snapshot"))) }
    }

    /// Freezes every process of sandbox `id` (the daemon's included) and answers once they
    /// are all frozen: they use no CPU and keep their memory until [`Provider::resume`].
    /// Pausing a paused sandbox is fine. The default refuses, naming the provider.
    fn pause(&self, id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = id;
        let name = self.name();
        async move { Err(ProviderError::Unsupported(format!("the {name} provider cannot pause a sandbox"))) }
    }

    /// Thaws what [`Provider::pause`] froze, answering once every process runs again.
    /// Resuming a running sandbox is fine. The default refuses, naming the provider.
    fn resume(&self, id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = id;
        let name = self.name();
        async move { Err(ProviderError::Unsupported(format!("the {name} provider cannot resume a sandbox"))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_failure_says_what_failed_and_why() {
        let enomem = std::io::Error::from_raw_os_error(12);
        let e = ProviderError::io("cannot make the cgroup `/x`", enomem);
        assert_eq!(e.to_string(), "cannot make the cgroup `/x`: Cannot allocate memory (os error 12)");
    }

    #[test]
    fn an_id_is_being_created_once_until_its_guard_goes() {
        let creating = Creating::default();
        let guard = creating.start("sb-1").unwrap_or_else(|e| panic!("{e}"));
        assert!(creating.snapshot().contains("sb-1"));
        assert!(matches!(creating.start("sb-1"), Err(ProviderError::Backend(m)) if m.contains("being created")));
        drop(guard);
        assert!(creating.snapshot().is_empty());
        assert!(creating.start("sb-1").is_ok());
    }
}

//! The server API (`sandman serve`, port 7777): sandboxes and their lifecycle, jobs, events.
//! Daemon calls are proxied unchanged under `/v1/sandboxes/{id}/…` and use [`crate::daemon`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Default listen address of the server.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7777";

/// A header of a `503` from a server replica that passed the call on to the leader and got no
/// answer back (the leader went away with the call under way): the call may have run, so a
/// client sends it again only if it is idempotent, as after a broken connection.
pub const UNANSWERED: &str = "x-sandman-unanswered";

/// Where a sandbox is in its life. Terminal states carry a [`Reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Queued,
    Creating,
    Ready,
    /// Every process of the sandbox is frozen (`POST /v1/sandboxes/{id}/pause`): it uses no
    /// CPU, keeps its memory, and its lease and idle timeout stand still; its lifetime still
    /// counts. `POST …/resume` (or a call, with `auto_resume`) makes it `ready` again.
    Paused,
    Releasing,
    Gone,
    Failed,
}

impl SandboxState {
    pub const ALL: [SandboxState; 7] = [
        SandboxState::Queued,
        SandboxState::Creating,
        SandboxState::Ready,
        SandboxState::Paused,
        SandboxState::Releasing,
        SandboxState::Gone,
        SandboxState::Failed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            SandboxState::Queued => "queued",
            SandboxState::Creating => "creating",
            SandboxState::Ready => "ready",
            SandboxState::Paused => "paused",
            SandboxState::Releasing => "releasing",
            SandboxState::Gone => "gone",
            SandboxState::Failed => "failed",
        }
    }

    /// Whether the sandbox has ended for good.
    pub const fn is_terminal(self) -> bool {
        matches!(self, SandboxState::Gone | SandboxState::Failed)
    }

    /// Whether the lifecycle allows moving from `self` to `next`.
    pub const fn can_become(self, next: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, next),
            (Queued, Creating)
                | (Queued, Failed)
                | (Queued, Gone)
                | (Creating, Ready)
                | (Creating, Failed)
                | (Creating, Releasing)
                | (Ready, Releasing)
                | (Ready, Failed)
                | (Ready, Paused)
                | (Paused, Ready)
                | (Paused, Releasing)
                | (Paused, Failed)
                | (Releasing, Gone)
                | (Releasing, Failed)
        )
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a sandbox ended. Stable and machine-readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Released,
    LeaseExpired,
    IdleExpired,
    TtlExpired,
    JobDeleted,
    ImagePullFailed,
    Unschedulable,
    DaemonStartFailed,
    ReadyTimeout,
    OomKilled,
    Evicted,
    NodeLost,
    ProviderError,
    /// A setup command of the create (or of its pool) exited non-zero; the message has the
    /// command and the tail of its output.
    SetupFailed,
    /// The create's `wait_timeout_s` passed while it was still queued for admission; it was
    /// taken off the queue and nothing was created.
    QueueTimeout,
    /// An `eval` sandbox whose daemon observed other limits, network, timezone or locale than
    /// the provider applied; the message names each difference. Nothing runs in it.
    ConditionsMismatch,
    /// The server stopped while it was creating the sandbox, before it was ready; the restarted
    /// server removed it. A retry of the create (same idempotency key) makes a new one.
    CreateInterrupted,
    /// The machine or the server could not hold one more sandbox: the message names the limit
    /// (open files, processes, id ranges). Nothing was left of it; a retry once others are
    /// released may succeed.
    ResourceExhausted,
    /// What answered at the sandbox's daemon's address, on a new connection of the server's,
    /// did not prove the sandbox's token (its socket was replaced from inside, say): the sandbox
    /// is no longer trusted and was removed. Nothing was sent there but a challenge.
    DaemonUntrusted,
}

impl Reason {
    pub const ALL: [Reason; 19] = [
        Reason::Released,
        Reason::LeaseExpired,
        Reason::IdleExpired,
        Reason::TtlExpired,
        Reason::JobDeleted,
        Reason::ImagePullFailed,
        Reason::Unschedulable,
        Reason::DaemonStartFailed,
        Reason::ReadyTimeout,
        Reason::OomKilled,
        Reason::Evicted,
        Reason::NodeLost,
        Reason::ProviderError,
        Reason::SetupFailed,
        Reason::QueueTimeout,
        Reason::ConditionsMismatch,
        Reason::CreateInterrupted,
        Reason::ResourceExhausted,
        Reason::DaemonUntrusted,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Released => "released",
            Reason::LeaseExpired => "lease_expired",
            Reason::IdleExpired => "idle_expired",
            Reason::TtlExpired => "ttl_expired",
            Reason::JobDeleted => "job_deleted",
            Reason::ImagePullFailed => "image_pull_failed",
            Reason::Unschedulable => "unschedulable",
            Reason::DaemonStartFailed => "daemon_start_failed",
            Reason::ReadyTimeout => "ready_timeout",
            Reason::OomKilled => "oom_killed",
            Reason::Evicted => "evicted",
            Reason::NodeLost => "node_lost",
            Reason::ProviderError => "provider_error",
            Reason::SetupFailed => "setup_failed",
            Reason::QueueTimeout => "queue_timeout",
            Reason::ConditionsMismatch => "conditions_mismatch",
            Reason::CreateInterrupted => "create_interrupted",
            Reason::ResourceExhausted => "resource_exhausted",
            Reason::DaemonUntrusted => "daemon_untrusted",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `default`, or `eval` for controlled, recorded conditions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    #[default]
    Default,
    Eval,
}

/// How a provider keeps a sandbox apart from the host and from other sandboxes; reported in
/// `/healthz`, in each sandbox's info and in its conditions record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// Nothing: plain processes of the server's user (the process provider with
    /// `--isolation none`, or a test's fake provider).
    #[default]
    None,
    /// The process provider's: a user namespace whose root is an unprivileged host id range of
    /// its own, a private root over the host's (read-only below, a writable layer of its own),
    /// its own mount, pid, cgroup, ipc, uts (and, for `network: none`, net) namespaces, cgroups,
    /// no admin capabilities, `no_new_privs`.
    UserNamespace,
    /// A container of the docker engine.
    Container,
    /// A Kubernetes pod: its runtime class and the cluster's policies decide the rest.
    Pod,
}

impl Isolation {
    pub const fn as_str(self) -> &'static str {
        match self {
            Isolation::None => "none",
            Isolation::UserNamespace => "user_namespace",
            Isolation::Container => "container",
            Isolation::Pod => "pod",
        }
    }
}

/// `egress` (the provider's default network) or `none` (loopback only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Network {
    #[default]
    Egress,
    None,
}

/// Resources of a sandbox. Quantities are written as in Kubernetes: cpu `0.5` or `"500m"`,
/// memory and disk `"512Mi"`, `"2G"` or a number of bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<Quantity>,
    /// Largest number of processes (threads included) at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

/// A number, or a string with a Kubernetes suffix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum Quantity {
    Number(f64),
    Text(String),
}

impl Quantity {
    /// The value in base units (cores, bytes): `500m` → 0.5, `1Ki` → 1024, `1k` → 1000.
    pub fn value(&self) -> Result<f64, String> {
        let text = match self {
            Quantity::Number(n) if n.is_finite() && *n >= 0.0 => return Ok(*n),
            Quantity::Number(n) => return Err(format!("quantity {n} must be a non-negative number")),
            Quantity::Text(t) => t.trim(),
        };
        const SUFFIXES: [(&str, f64); 13] = [
            ("Ki", 1024.0),
            ("Mi", 1048576.0),
            ("Gi", 1073741824.0),
            ("Ti", 1099511627776.0),
            ("Pi", 1125899906842624.0),
            ("m", 0.001),
            ("k", 1e3),
            ("K", 1e3),
            ("M", 1e6),
            ("G", 1e9),
            ("T", 1e12),
            ("P", 1e15),
            ("", 1.0),
        ];
        for (suffix, factor) in SUFFIXES {
            if let Some(num) = text.strip_suffix(suffix)
                && let Ok(n) = num.parse::<f64>()
                && n.is_finite()
                && n >= 0.0
            {
                return Ok(n * factor);
            }
        }
        Err(format!("`{text}` is not a quantity like 0.5, 500m, 512Mi or 2G"))
    }
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// The task image; `host` for the process provider. May be left out when `pool` names a
    /// pool (the pool's image is used).
    #[serde(default)]
    pub image: String,
    /// Which provider (default: the server's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default)]
    pub resources: Resources,
    /// Environment of every command in the sandbox.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    #[serde(default)]
    pub profile: Profile,
    #[serde(default)]
    pub network: Network,
    /// Maximum lifetime in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// Reclaim after this long with no call on the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// Reclaim after this long with no call, keepalive or job heartbeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_s: Option<u64>,
    /// Claim a ready sandbox from this warm pool (a create whose image, resources, profile and
    /// network match a pool claims from it without naming it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Shell commands run in order through the daemon before the sandbox is reported ready; a
    /// non-zero exit fails the sandbox with `setup_failed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub setup: Vec<String>,
    /// A retried create with the same key returns the same sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Answer once the sandbox is ready (default) or at once.
    #[serde(default = "yes")]
    pub wait: bool,
    /// Give up waiting after this long, time in the admission queue included (default: no
    /// limit while queued, then the server's ready timeout). A create still queued when it
    /// passes is taken off the queue and ends with `queue_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_timeout_s: Option<u64>,
    /// The user every exec, background process and session of the sandbox runs as unless the
    /// call names one: a name (from the image's `/etc/passwd`) or `uid[:gid]`. On the docker
    /// provider the image's `USER` is the default when this is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A call on the sandbox while it is paused resumes it first (E2B's behaviour) instead of
    /// failing with `paused`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_resume: bool,
}

fn yes() -> bool {
    true
}

/// A sandbox as the server reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Sandbox {
    pub id: String,
    pub image: String,
    pub provider: String,
    pub state: SandboxState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// A sentence about the reason (the provider's or the engine's message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    pub profile: Profile,
    pub network: Network,
    pub resources: Resources,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// When the lease lapses unless renewed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_expires_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_expires_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_expires_at_ms: Option<u64>,
    pub lease_s: u64,
    /// How the provider isolates it (absent from servers that predate the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
    /// The user its commands run as unless a call names one: the create's `user`, else the
    /// image's `USER` where the provider knows it; absent for the daemon's own (root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The image's configuration, where the provider knows it (docker); absent elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_config: Option<ImageConfig>,
    /// While `paused`: since when (milliseconds since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at_ms: Option<u64>,
    /// Calls on it while paused resume it (the create's `auto_resume`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_resume: bool,
}

/// What an image says about how to run it (`docker image inspect`'s `Config`). The daemon is the
/// sandbox's entry point, so `entrypoint` and `cmd` are not run; a harness may run them itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageConfig {
    /// `USER`: a name, `uid`, `name:group` or `uid:gid`; absent when the image sets none (root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `WORKDIR`; absent when the image sets none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// `ENV`, as variables.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
}

/// `GET /v1/sandboxes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// Query of `GET /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<SandboxState>,
    /// `key=value`; only sandboxes with that label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

/// `PUT /v1/jobs/{job}`: a job's quota and defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Most sandboxes alive at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    /// Most creates per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_rate: Option<f64>,
    /// Share of the create rate when jobs queue (default 1), and of the nodes' room when creates
    /// wait for it (the kubernetes provider's capacity-aware admission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// Default lease of the job's sandboxes, renewed by one heartbeat for all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_s: Option<u64>,
}

/// `GET /v1/jobs/{job}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Job {
    pub name: String,
    pub spec: JobSpec,
    /// Sandboxes of the job not yet ended.
    pub live: u64,
    /// Sandboxes of the job created since the server started.
    pub created: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_ms: Option<u64>,
}

/// `POST /v1/jobs/{job}/heartbeat` and `DELETE /v1/jobs/{job}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobAction {
    pub job: String,
    /// How many sandboxes the call renewed or released.
    pub sandboxes: u64,
}

/// `POST /v1/jobs/{job}/fusion-key` and `DELETE`: a job's capability URL for the SandboxFusion
/// API, for clients that send no credentials (verl, skyrl-agent). Whoever has the URL runs code
/// as the job until it is revoked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FusionKey {
    pub job: String,
    /// The base URL (`<server>/fusion/job/<key>`): clients append `/run_code`, `/run_jupyter`
    /// or `/v1/ping`. Absent once revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// True when this call revoked it.
    #[serde(default)]
    pub revoked: bool,
}

/// What an event is about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A sandbox changed state (or, while `queued`, its place in the queue): `sandbox` and
    /// `state` are set.
    #[default]
    Sandbox,
    /// Progress of `POST /v1/prepare` for one image: `image` and `phase` are set.
    Prepare,
    /// A call of the SandboxFusion API that the service failed (answered `SandboxError`, or
    /// 504 when it could not start in time): `message` says why, `sandbox` names its sandbox
    /// when it had one.
    Fusion,
}

impl EventKind {
    pub fn is_sandbox(&self) -> bool {
        *self == EventKind::Sandbox
    }
}

/// Where the preparation of one image is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PreparePhase {
    Started,
    /// A node reports how its pull goes (`node`, `message`, `nodes_ready` of `nodes_total`).
    Pulling,
    /// The image is ready where the provider runs sandboxes.
    Ready,
    /// The provider could not prepare it; `message` says why.
    Failed,
}

/// One event of `GET /v1/events`: a sandbox's lifecycle (kind `sandbox`, the default, left out
/// on the wire) or an image's preparation (kind `prepare`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// Increasing number of the event since the server started.
    pub seq: u64,
    pub time_ms: u64,
    #[serde(default, skip_serializing_if = "EventKind::is_sandbox")]
    pub kind: EventKind,
    /// The sandbox (kind `sandbox`); empty, and left out, for other kinds.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// The sandbox's new state (always set for kind `sandbox`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<SandboxState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// For a `queued` sandbox: about how many creates will be admitted before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<u64>,
    /// For a `queued` sandbox: about how long until it is admitted, from its job's share of the
    /// create rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_wait_ms: Option<u64>,
    /// For kind `prepare`: the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// For kind `prepare`: where that image is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<PreparePhase>,
    /// For kind `prepare`: the node a `pulling` line is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// For kind `prepare`: nodes that have the image so far, of `nodes_total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes_ready: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes_total: Option<u32>,
    /// On the progress of a `creating` sandbox (`message` says how an image pull goes): the
    /// idempotency key of the create, so that its caller can follow it before it knows the id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// Query of `GET /v1/events`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Keep the stream open and send events as they happen (NDJSON).
    #[serde(default)]
    pub follow: bool,
    /// Only events after this sequence number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// Only the events that carry this idempotency key: the progress of that create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// `GET /v1/events` without `follow`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventList {
    pub events: Vec<Event>,
}

/// One line of a followed `GET /v1/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventStreamItem {
    Sandbox(Box<Event>),
    Keepalive,
}

/// `PUT /v1/pools/{name}`: a warm pool of ready sandboxes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub image: String,
    /// Which provider (default: the server's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub profile: Profile,
    #[serde(default)]
    pub network: Network,
    /// Environment the pool's sandboxes start with; a claim adds its own on top.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Sandboxes kept ready, unclaimed.
    pub min_ready: u64,
    /// Most unclaimed sandboxes (ready or being created) at once (default: `min_ready`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u64>,
    /// Shell commands run in each sandbox before it joins the pool as ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub setup: Vec<String>,
    /// The longest lease a claim may ask for (default: the server's `--default-lease-s`); a
    /// create asking for more is created cold instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_s: Option<u64>,
    /// Size the pool from demand: keep about (claims a second over the last 30 s) × (how long
    /// a refill takes) ready, between `min_ready` and `max`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub autoscale: bool,
}

/// A warm pool and its sizes, as `GET /v1/pools` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Pool {
    pub name: String,
    pub spec: PoolSpec,
    /// Ready and unclaimed.
    pub ready: u64,
    /// Being created (or queued for admission) to refill the pool.
    pub creating: u64,
    /// Claimed from the pool and still alive.
    pub claimed: u64,
    /// Claims served since the server started.
    pub claims: u64,
    /// How many it keeps ready now: `min_ready`, or with `autoscale` what demand asks for.
    pub target: u64,
    /// With `autoscale`: claims a second over the last 30 s, and how long a refill took lately.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_seconds: Option<f64>,
    /// The last failure to refill the pool, while refills are failing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `GET /v1/pools`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolList {
    pub pools: Vec<Pool>,
}

/// `POST /v1/prepare`: make images ready ahead of the creates that need them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PrepareRequest {
    pub images: Vec<String>,
    /// The job the images are for; its name tags the progress events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// With `job`: hold the job's creates of these images (queued) until this fraction of the
    /// nodes (0 < f <= 1) has the image, or its preparation ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_until: Option<f64>,
}

/// How the preparation of one image ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PreparedImage {
    pub image: String,
    pub ok: bool,
    /// Nodes that have the image, of those that may run sandboxes (1 of 1 for one host).
    pub nodes_ready: u32,
    pub nodes_total: u32,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    pub duration_ms: u64,
}

/// The answer of `POST /v1/prepare`, once every image is ready or has failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrepareResult {
    pub images: Vec<PreparedImage>,
}

/// One image in the process provider's image store (`GET /v1/images`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StoredImage {
    /// Its config's digest (`sha256:…`).
    pub id: String,
    pub manifest_digest: String,
    /// The canonical references that name it (`docker.io/library/python:3.12`).
    pub references: Vec<String>,
    /// Unpacked bytes of its layers' files (layers shared with other images counted in each).
    pub size: u64,
    pub layers: u64,
    pub last_used_ms: u64,
    /// Sandboxes that run it now: while any does, it is not removed.
    pub sandboxes: u64,
}

/// `GET /v1/images`: the image store, most recently used first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageList {
    pub images: Vec<StoredImage>,
    /// Unpacked bytes of every layer in the store, each counted once.
    pub size: u64,
    /// The store's bound (`--image-store-max-size`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size: Option<u64>,
}

/// Query of `DELETE /v1/images`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ImageQuery {
    /// A reference, an image id, or 12 or more of its hex digits.
    pub image: String,
}

/// What `DELETE /v1/images?image=` and `POST /v1/images/prune` removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImagesRemoved {
    /// Ids of the images removed.
    pub images: Vec<String>,
    /// A reference that no longer names its image, which other references still name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub untagged: Option<String>,
    /// Bytes freed.
    pub freed: u64,
}

/// The accounting record of one sandbox, written when it ends: one JSON line of
/// `<state-dir>/accounting.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageRecord {
    pub sandbox: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub image: String,
    pub provider: String,
    /// The warm pool the sandbox was made for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// When a create claimed it from its pool (absent for a pool sandbox that ended unclaimed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed_ms: Option<u64>,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ms: Option<u64>,
    pub ended_ms: u64,
    pub state: SandboxState,
    pub reason: Reason,
    /// From creation to the end; for a claimed sandbox, from the claim (its time idle in the
    /// pool is not its job's).
    pub wall_seconds: f64,
    /// CPU (user + system) of the sandbox's finished commands, where the daemon reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<f64>,
    /// Largest peak resident set of any finished command, where the daemon reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_kib: Option<u64>,
    /// For a claimed sandbox: how long it was ready in its pool before the claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_idle_seconds: Option<f64>,
    /// The signed conditions record, when one was taken (always for `eval` sandboxes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<SignedConditions>,
}

/// `GET /v1/jobs/{job}/usage`: the sum of the job's accounting records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobUsage {
    pub job: String,
    /// Sandboxes of the job that have ended (and so have a record).
    pub sandboxes: u64,
    /// Sandboxes of the job alive now (not yet in the sums).
    pub live: u64,
    /// Ended sandboxes by reason.
    pub by_reason: BTreeMap<String, u64>,
    pub sandbox_seconds: f64,
    pub cpu_seconds: f64,
    /// How many records carried CPU and memory figures.
    pub with_usage: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_kib: Option<u64>,
}

/// What a provider applied to a sandbox, as the provider itself reports it (the container's
/// host config, the pod's spec and status, the cgroup it wrote). `None` where it applied
/// nothing (no limit) or cannot tell.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Applied {
    /// The image as it runs, pinned to its digest where the provider can resolve one
    /// (`sha256:…`, or `repo@sha256:…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// CPU limit in cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Memory limit in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Swap allowed beyond memory, in bytes (`0`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap: Option<u64>,
    /// Largest number of processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// `none` (loopback only, checked against the interfaces the daemon sees), `policy` (traffic
    /// denied by a network policy; interfaces remain) or `egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    /// Provider specifics: Docker's host config; the pod's QoS class, node and runtime class;
    /// the process provider's cgroups and namespaces.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub details: BTreeMap<String, serde_json::Value>,
}

/// What a create asked for, as the conditions record keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Asked {
    pub image: String,
    pub resources: Resources,
    pub profile: Profile,
    pub network: Network,
}

/// One place where what the provider applied and what the daemon observes from inside differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Mismatch {
    /// `cpu`, `memory`, `swap`, `pids`, `network`, `timezone` or `locale`.
    pub field: String,
    pub applied: String,
    pub observed: String,
}

/// The conditions a sandbox runs under: asked, applied, observed, and where the last two differ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConditionsRecord {
    pub sandbox: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub provider: String,
    /// How the provider isolated the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
    pub server_version: String,
    /// Milliseconds since the Unix epoch.
    pub recorded_ms: u64,
    pub asked: Asked,
    pub applied: Applied,
    pub observed: crate::daemon::Observed,
    pub mismatches: Vec<Mismatch>,
}

/// `GET /v1/sandboxes/{id}/conditions`: the record and the server's HMAC-SHA256 over its
/// canonical JSON (keys sorted, no spaces). `sandman verify` checks it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SignedConditions {
    pub record: ConditionsRecord,
    /// `hmac-sha256:<hex>`.
    pub signature: String,
    /// The first 16 hex digits of the SHA-256 of the signing key: which server signed it.
    pub key_id: String,
}

/// `POST /v1/verify`: whether a signed conditions record is intact and signed by this server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Verification {
    pub valid: bool,
    /// Why not, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServerHealth {
    pub status: String,
    pub version: String,
    pub provider: String,
    /// How the provider isolates sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_in_kubernetes_notation() {
        let v = |q: Quantity| q.value().unwrap_or(-1.0);
        assert_eq!(v(Quantity::Text("500m".into())), 0.5);
        assert_eq!(v(Quantity::Text("512Mi".into())), 512.0 * 1048576.0);
        assert_eq!(v(Quantity::Text("2G".into())), 2e9);
        assert_eq!(v(Quantity::Number(1.5)), 1.5);
        assert_eq!(v(Quantity::Text("1024".into())), 1024.0);
        assert!(Quantity::Text("lots".into()).value().is_err());
        assert!(Quantity::Number(-1.0).value().is_err());
    }

    #[test]
    fn lifecycle_guards() {
        use SandboxState::*;
        assert!(Creating.can_become(Ready));
        assert!(Ready.can_become(Releasing));
        assert!(!Gone.can_become(Ready));
        assert!(!Ready.can_become(Creating));
        assert!(!Failed.can_become(Gone));
        for s in SandboxState::ALL {
            assert_eq!(serde_json::to_value(s).unwrap_or_default(), s.as_str());
        }
        for r in Reason::ALL {
            assert_eq!(serde_json::to_value(r).unwrap_or_default(), r.as_str());
        }
    }

    #[test]
    fn create_defaults_to_waiting_and_refuses_unknown_fields() {
        let c: CreateSandbox = serde_json::from_str(r#"{"image":"host"}"#).unwrap_or_default();
        assert!(c.wait);
        assert_eq!(c.profile, Profile::Default);
        let err = serde_json::from_str::<CreateSandbox>(r#"{"image":"host","ttl":5}"#).err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("unknown field `ttl`"));
    }

    #[test]
    fn sandbox_events_keep_their_shape_and_prepare_events_have_theirs() {
        let e = Event {
            seq: 1,
            time_ms: 2,
            kind: EventKind::Sandbox,
            sandbox: "sb-1".into(),
            job: None,
            state: Some(SandboxState::Queued),
            reason: None,
            message: None,
            queue_position: Some(3),
            estimated_wait_ms: Some(60),
            idempotency_key: None,
            image: None,
            phase: None,
            node: None,
            nodes_ready: None,
            nodes_total: None,
        };
        let v = serde_json::to_value(&e).unwrap_or_default();
        assert_eq!(
            v,
            serde_json::json!({"seq": 1, "time_ms": 2, "sandbox": "sb-1", "state": "queued", "queue_position": 3, "estimated_wait_ms": 60})
        );
        let p: Event =
            serde_json::from_str(r#"{"seq":5,"time_ms":6,"kind":"prepare","image":"python:3.12","phase":"ready"}"#)
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (p.kind, p.sandbox.as_str(), p.state, p.phase),
            (EventKind::Prepare, "", None, Some(PreparePhase::Ready))
        );
    }

    #[test]
    fn a_create_from_a_pool_needs_no_image() {
        let c: CreateSandbox = serde_json::from_str(r#"{"pool":"py","setup":["pip install x"]}"#).unwrap_or_default();
        assert_eq!((c.image.as_str(), c.pool.as_deref(), c.setup.len()), ("", Some("py"), 1));
        let err = serde_json::from_str::<PoolSpec>(r#"{"image":"host","min_ready":1,"size":2}"#).err();
        assert!(err.map(|e| e.to_string()).unwrap_or_default().contains("unknown field `size`"));
    }
}

//! The server API (`sandman serve`, port 7777): sandboxes and their lifecycle, jobs, events.
//! Daemon calls are proxied unchanged under `/v1/sandboxes/{id}/…` and use [`crate::daemon`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Default listen address of the server.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7777";

/// Where a sandbox is in its life. Terminal states carry a [`Reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Queued,
    Creating,
    Ready,
    Releasing,
    Gone,
    Failed,
}

impl SandboxState {
    pub const ALL: [SandboxState; 6] = [
        SandboxState::Queued,
        SandboxState::Creating,
        SandboxState::Ready,
        SandboxState::Releasing,
        SandboxState::Gone,
        SandboxState::Failed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            SandboxState::Queued => "queued",
            SandboxState::Creating => "creating",
            SandboxState::Ready => "ready",
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
}

impl Reason {
    pub const ALL: [Reason; 13] = [
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
    /// The task image; `host` for the process provider.
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// A retried create with the same key returns the same sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Answer once the sandbox is ready (default) or at once.
    #[serde(default = "yes")]
    pub wait: bool,
    /// Give up waiting for readiness after this long (default: the server's ready timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_timeout_s: Option<u64>,
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
    /// Share of the create rate when jobs queue (default 1).
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

/// One lifecycle event of `GET /v1/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// Increasing number of the event since the server started.
    pub seq: u64,
    pub time_ms: u64,
    pub sandbox: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub state: SandboxState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
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
    Sandbox(Event),
    Keepalive,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServerHealth {
    pub status: String,
    pub version: String,
    pub provider: String,
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
}

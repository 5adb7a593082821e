//! `ServeArgs`: the flags of `sandman serve`, with their defaults.

use std::path::PathBuf;
use std::time::Duration;

/// Flags of `sandman serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = sandman_wire::server::DEFAULT_LISTEN)]
    pub listen: String,
    /// Where the token, the provider's records and logs live
    /// (default: $SANDMAN_STATE_DIR, else $XDG_STATE_HOME/sandman, else ~/.local/state/sandman).
    #[arg(long, env = "SANDMAN_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Which provider makes sandboxes: `process` (the embedded default) or `docker` (any image;
    /// the engine from DOCKER_HOST, else /var/run/docker.sock).
    #[arg(long, default_value = "process")]
    pub provider: String,
    /// The kubernetes provider's configuration file (YAML or JSON; see docs/kubernetes.md).
    #[arg(long, env = "SANDMAN_KUBE_CONFIG")]
    pub kube_config: Option<PathBuf>,
    /// The `sandmand` binary the process provider runs, or the static one the docker provider
    /// mounts into containers (default: next to `sandman`, else on PATH).
    #[arg(long, env = "SANDMAN_DAEMON")]
    pub daemon: Option<PathBuf>,
    /// How the process provider isolates sandboxes: `full` (the default: a user namespace, a
    /// private root, cgroups; needs root, and the server refuses to start where the host cannot
    /// give it) or `none` (plain processes of this user, for trusted code only).
    #[arg(long, default_value = "full", value_parser = ["full", "none"])]
    pub isolation: String,
    /// Lease of a sandbox that asks for none, in seconds.
    #[arg(long, default_value_t = 600)]
    pub default_lease_s: u64,
    /// Longest lifetime of any sandbox, in seconds (0 = none).
    #[arg(long, default_value_t = 86400)]
    pub max_ttl_s: u64,
    /// How long a create may take to become ready, in seconds.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout_s: u64,
    /// How long an ended sandbox still answers `gone` with its reason, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub gone_retention_s: u64,
    /// Timeout of control calls (not of proxied daemon calls, which carry their own), in seconds.
    #[arg(long, default_value_t = 600)]
    pub request_timeout_s: u64,
    /// Requests served at once; past it, requests are shed with 503.
    #[arg(long, default_value_t = 4096)]
    pub max_concurrent_requests: usize,
    /// Creates admitted a second over all jobs (0 = unlimited); the rest queue, shared between
    /// jobs by weight.
    #[arg(long, default_value_t = crate::service::DEFAULT_CREATE_RATE)]
    pub create_rate: f64,
    /// Creates admitted at once after a quiet spell (default: one second of --create-rate). The
    /// admission timer ticks by the millisecond: a burst under --create-rate / 1000 keeps the
    /// rate from being reached.
    #[arg(long)]
    pub create_burst: Option<f64>,
    /// Most creates waiting for admission; past it a create gets 429 with Retry-After.
    #[arg(long, default_value_t = crate::service::DEFAULT_MAX_QUEUE)]
    pub max_queue: usize,
    /// Log filter (also RUST_LOG).
    #[arg(long, default_value = "info")]
    pub log: String,
}

impl ServeArgs {
    pub fn ready_timeout(&self) -> Duration {
        Duration::from_secs(self.ready_timeout_s)
    }
}

/// `$SANDMAN_STATE_DIR`, else `$XDG_STATE_HOME/sandman`, else `~/.local/state/sandman`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SANDMAN_STATE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("sandman");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".local/state/sandman")
}

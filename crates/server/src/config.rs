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
    /// Which provider makes sandboxes: `process` (the embedded default).
    #[arg(long, default_value = "process")]
    pub provider: String,
    /// The `sandmand` binary the process provider runs (default: next to `sandman`, else on PATH).
    #[arg(long, env = "SANDMAN_DAEMON")]
    pub daemon: Option<PathBuf>,
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

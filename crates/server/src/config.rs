//! `ServeArgs`: the flags of `sandman serve`, with their defaults.

use std::path::PathBuf;
use std::time::Duration;

use sandman_wire::bounds;
use sandman_wire::server::Quantity;

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
    /// Process provider, isolated: where sandboxes' addresses come from (one per sandbox the host
    /// may hold: a /16 or larger). Their traffic leaves the host through NAT.
    #[arg(long, value_name = "CIDR", default_value = sandman_provider_process::net::DEFAULT_SUBNET,
          value_parser = clap::value_parser!(sandman_provider_process::net::Cidr))]
    pub sandbox_subnet: sandman_provider_process::net::Cidr,
    /// Process provider (isolated) and docker provider: a network `egress` sandboxes may reach
    /// although it is refused by default (the host's private, loopback and link-local ranges);
    /// repeatable.
    #[arg(long = "egress-allow", value_name = "CIDR", value_parser = clap::value_parser!(sandman_provider_process::net::Cidr))]
    pub egress_allow: Vec<sandman_provider_process::net::Cidr>,
    /// A Unix socket to serve on too, where the CLI and SDKs on this machine find the server
    /// (default: `sandman.sock` in the state directory, which only the server's user may enter,
    /// so no one else can stand in for the server there); `none` for none.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<String>,
    /// Process provider: a registry (`host` or `host:port`) to reach over plain HTTP although it
    /// is not on loopback (a local mirror); repeatable. Credentials come from
    /// `$REGISTRY_AUTH_FILE`, else `$DOCKER_CONFIG/config.json` or `~/.docker/config.json`.
    #[arg(long = "insecure-registry", value_name = "HOST")]
    pub insecure_registries: Vec<String>,
    /// Process provider: the bound of the image store (unpacked layers, under the state
    /// directory); images no sandbox runs go, least recently used first, past it. `none`: no bound.
    #[arg(long, value_name = "BYTES", default_value = "64Gi", value_parser = bytes_or_none)]
    pub image_store_max_size: Bound,
    /// Process provider, isolated: the memory limit of a create that names none
    /// (`resources.memory`), as `2Gi`; `none` leaves such creates unbounded. Without isolation a
    /// create gets no default memory (it could only be an address-space limit per process).
    #[arg(long, value_name = "BYTES", default_value = "2Gi", value_parser = bytes_or_none)]
    pub default_memory: Bound,
    /// Process provider: the disk of a create that names none (`resources.disk`: its writable
    /// layer, /tmp and working directory, and the largest file it may write), as `1Gi`; `none`
    /// leaves such creates unbounded. On this provider disk is memory: keep it below memory.
    #[arg(long, value_name = "BYTES", default_value = "1Gi", value_parser = bytes_or_none)]
    pub default_disk: Bound,
    /// Process provider: creates wait while the memory limits of the sandboxes held would pass the
    /// machine's memory times this (0: no such admission).
    #[arg(long, value_name = "FACTOR", default_value_t = 4.0, value_parser = overcommit)]
    pub memory_overcommit: f64,
    /// Process provider: how long a create may wait for memory, in seconds.
    #[arg(long, default_value_t = 600, value_parser = seconds(1, bounds::DAY_S))]
    pub capacity_wait_s: u64,
    /// Process provider (isolated) and docker provider: a resolver for egress sandboxes, which
    /// the firewall lets them reach on port 53; repeatable. Default: the host's own, less those
    /// on loopback.
    #[arg(long = "dns", value_name = "ADDR")]
    pub dns: Vec<std::net::Ipv4Addr>,
    /// Docker provider: `filtered` (egress sandboxes on sandman's own bridge network, refused
    /// the host and the private ranges by a host firewall, which needs root beside the engine)
    /// or `unfiltered` (the same network, nothing refused: they reach the host's services and
    /// private networks).
    #[arg(long, default_value = "filtered", value_parser = ["filtered", "unfiltered"])]
    pub docker_egress: String,
    /// Docker provider: the engine's network egress sandboxes join, made when missing.
    #[arg(long, env = "SANDMAN_DOCKER_NETWORK", default_value = sandman_provider_docker::DEFAULT_NETWORK)]
    pub docker_network: String,
    /// Docker provider: the bridge interface of that network, which the firewall names.
    #[arg(long, env = "SANDMAN_DOCKER_BRIDGE", default_value = sandman_provider_docker::DEFAULT_BRIDGE)]
    pub docker_bridge: String,
    /// Lease of a sandbox that asks for none, in seconds.
    #[arg(long, default_value_t = 600, value_parser = seconds(1, bounds::LEASE_S.max))]
    pub default_lease_s: u64,
    /// Longest lifetime of any sandbox, in seconds (0 = none).
    #[arg(long, default_value_t = 86400, value_parser = seconds(0, bounds::TTL_S.max))]
    pub max_ttl_s: u64,
    /// How long a create may take to become ready, in seconds.
    #[arg(long, default_value_t = 120, value_parser = seconds(1, bounds::DAY_S))]
    pub ready_timeout_s: u64,
    /// How long an ended sandbox still answers `gone` with its reason, in seconds.
    #[arg(long, default_value_t = 3600, value_parser = seconds(0, 30 * bounds::DAY_S))]
    pub gone_retention_s: u64,
    /// Timeout of control calls (not of proxied daemon calls, which carry their own), in seconds.
    #[arg(long, default_value_t = 600, value_parser = seconds(1, bounds::DAY_S))]
    pub request_timeout_s: u64,
    /// Requests served at once; past it, requests are shed with 503 (`GET /healthz` never is).
    #[arg(long, default_value_t = 4096, value_parser = count(1, 1_000_000))]
    pub max_concurrent_requests: usize,
    /// Connections open at once; past it, new ones wait in the listen backlog until one closes,
    /// and a warning is logged (at most once a minute). Lowered at start to what the open files
    /// limit allows.
    #[arg(long, default_value_t = sandman_http::serve::DEFAULT_MAX_CONNECTIONS, value_parser = count(1, 1_000_000))]
    pub max_connections: usize,
    /// A connection that has not sent a whole request head this long after it opened (or after
    /// its last answer, when kept alive) is closed, in seconds.
    #[arg(long, default_value_t = 30, value_parser = seconds(1, bounds::HOUR_S))]
    pub header_read_timeout_s: u64,
    /// On SIGTERM (or SIGINT), how long the server keeps serving every call, old connections and
    /// new, while `GET /readyz` answers 503, before it stops accepting, in seconds: the time a
    /// load balancer (Kubernetes' endpoints) needs to stop sending it calls. Answers meanwhile
    /// carry `Connection: close`, so kept-alive clients connect again elsewhere. A second signal
    /// ends it at once.
    #[arg(long, env = "SANDMAN_SHUTDOWN_DRAIN_S", default_value_t = 0, value_parser = seconds(0, bounds::HOUR_S))]
    pub shutdown_drain_s: u64,
    /// Runs as one of several replicas (kubernetes provider only): the replicas elect a leader
    /// with the Lease `sandman-leader`; it alone creates, releases, admits, reaps and refills,
    /// and keeps jobs, pools and snapshots in the ConfigMap `sandman-state` and the conditions
    /// key in the Secret `sandman-conditions-key`, in --replica-namespace; the others pass every
    /// call on to it, and one of them takes over when it goes (docs/kubernetes.md#replicas).
    #[arg(long, env = "SANDMAN_LEADER_ELECTION")]
    pub leader_election: bool,
    /// With --leader-election: the namespace of the Lease, ConfigMap and Secret (the server's
    /// own; a pod learns it from the downward API as `POD_NAMESPACE`).
    #[arg(long, env = "POD_NAMESPACE")]
    pub replica_namespace: Option<String>,
    /// With --leader-election: the address (`host:port`) where the other replicas reach this
    /// one when it leads (default: `$POD_IP` and the port of --listen).
    #[arg(long, env = "SANDMAN_ADVERTISE")]
    pub advertise: Option<String>,
    /// Once the server stops accepting, how long calls in flight get to finish before their
    /// connections are dropped, in seconds. A further signal drops them at once.
    #[arg(long, env = "SANDMAN_SHUTDOWN_TIMEOUT_S", default_value_t = 10, value_parser = seconds(0, bounds::DAY_S))]
    pub shutdown_timeout_s: u64,
    /// The largest `max_output_bytes` of a proxied `/exec` or session run, whose output the
    /// daemon holds until the command ends (at most the daemon's own ceiling, 64 MiB).
    #[arg(long, default_value_t = bounds::MAX_OUTPUT_BYTES.max, value_parser = clap::value_parser!(u64).range(0..=bounds::MAX_OUTPUT_BYTES.max))]
    pub max_output_bytes: u64,
    /// Creates admitted a second over all jobs (0 = unlimited); the rest queue, shared between
    /// jobs by weight.
    #[arg(long, default_value_t = crate::service::DEFAULT_CREATE_RATE, value_parser = rate)]
    pub create_rate: f64,
    /// Creates admitted at once after a quiet spell (default: one second of --create-rate). The
    /// admission timer ticks by the millisecond: a burst under --create-rate / 1000 keeps the
    /// rate from being reached.
    #[arg(long, value_parser = rate)]
    pub create_burst: Option<f64>,
    /// Most creates waiting for admission; past it a create gets 429 with Retry-After.
    #[arg(long, default_value_t = crate::service::DEFAULT_MAX_QUEUE, value_parser = count(0, 10_000_000))]
    pub max_queue: usize,
    /// The SandboxFusion API (`/fusion`): the image every call runs in (`host`: this machine's
    /// root, read-only; any image the provider runs). A call needs the language's tools in it.
    #[arg(long, value_name = "IMAGE", default_value = "host")]
    pub fusion_image: String,
    /// The SandboxFusion API: calls running at once; more wait for a slot, up to their own
    /// `run_timeout`, then answer 504 (which verl retries). Never shed.
    #[arg(long, value_name = "N", default_value_t = crate::fusion::DEFAULT_MAX_CALLS, value_parser = count(1, 100_000))]
    pub fusion_max_calls: usize,
    /// The URL clients reach this server at, for the URLs it hands out (a job's SandboxFusion
    /// URL). Default: http:// and the address it listens on.
    #[arg(long, value_name = "URL")]
    pub public_url: Option<String>,
    /// Log filter (also RUST_LOG).
    #[arg(long, default_value = "info")]
    pub log: String,
}

/// A number of seconds within `min..=max`.
fn seconds(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(min..=max)
}

/// A count within `min..=max`.
fn count(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(min..=max)
}

/// A default bound: a quantity, or none.
#[derive(Debug, Clone, PartialEq)]
pub struct Bound(pub Option<Quantity>);

/// A byte quantity (`2Gi`, `512Mi`, `1073741824`), or `none`.
fn bytes_or_none(text: &str) -> Result<Bound, String> {
    if text == "none" {
        return Ok(Bound(None));
    }
    let q = Quantity::Text(text.to_string());
    match q.value() {
        Ok(v) if (1.0..1e18).contains(&v) => Ok(Bound(Some(q))),
        Ok(_) => Err(format!("`{text}` must be at least one byte and less than an exabyte")),
        Err(e) => Err(e),
    }
}

/// How far the sandboxes' memory limits may add up past the machine's memory: 0 (no admission)
/// or from 0.1 to 100,000.
fn overcommit(text: &str) -> Result<f64, String> {
    let f: f64 = text.parse().map_err(|_| format!("`{text}` is not a number"))?;
    if f == 0.0 || (0.1..=100_000.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("`{text}` must be 0 (no admission) or between 0.1 and 100000"))
    }
}

/// A rate of creates a second: 0 (unlimited) up to the most a job may ask for.
fn rate(text: &str) -> Result<f64, String> {
    let r: f64 = text.parse().map_err(|_| format!("`{text}` is not a number"))?;
    if r.is_finite() && (0.0..=bounds::CREATE_RATE.max).contains(&r) {
        Ok(r)
    } else {
        Err(format!("`{text}` must be between 0 and {}", bounds::CREATE_RATE.max))
    }
}

impl ServeArgs {
    pub fn ready_timeout(&self) -> Duration {
        Duration::from_secs(self.ready_timeout_s)
    }
}

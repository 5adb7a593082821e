//! `sandmand`, the daemon inside every sandbox: it serves the daemon API of the design over TCP or
//! a Unix socket, is the sandbox's init where it can be, and keeps a lease. Start at [`run`], then
//! [`api::router`] for the calls.

pub mod api;
pub mod archive;
pub mod budget;
pub mod children;
pub mod cli;
pub mod error;
pub mod exec;
pub mod extract;
pub mod files;
pub mod fork_server;
pub mod isolate;
pub mod lease;
pub mod observe;
#[cfg(feature = "openapi")]
pub mod openapi;
pub mod owner;
pub mod ports;
pub mod processes;
pub mod run;
pub mod sessions;
pub mod spawn;
pub mod state;
pub mod stream;
pub mod sys;
pub mod tree;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::children::Children;
use crate::spawn::Defaults;
use crate::state::{Config, Daemon};

/// Exit code when the lease lapsed and the daemon killed everything.
pub const EXIT_LEASE_EXPIRED: i32 = 3;

/// Why the daemon could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no token: set SANDMAN_TOKEN or pass --token-file")]
    NoToken,
    #[error("cannot read the token file `{path}`")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the token file `{0}` is empty")]
    EmptyToken(PathBuf),
    #[error("cannot remove the token file `{path}` once read (--consume-token-file)")]
    ConsumeToken {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot make the daemon undumpable as its sandbox's init")]
    Undumpable(#[source] std::io::Error),
    #[error("cannot listen on `{addr}`")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot install the child reaper")]
    Reaper(#[source] std::io::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("serving failed")]
    Serve(#[source] std::io::Error),
}

/// Where to listen: `unix:/path` or `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(String),
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix("unix:") {
            Some("") => Err("`unix:` needs a socket path, as in unix:/run/sandmand.sock".into()),
            Some(path) => Ok(Listen::Unix(PathBuf::from(path))),
            None if s.contains(':') => Ok(Listen::Tcp(s.to_string())),
            None => Err(format!("`{s}` is neither host:port nor unix:/path")),
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(a) => f.write_str(a),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Everything `run` needs, parsed by the binary.
#[derive(Debug)]
pub struct Settings {
    pub listen: Listen,
    pub token: String,
    pub lease: Option<Duration>,
    pub shell: String,
    pub workdir: Option<PathBuf>,
    pub max_upload_bytes: u64,
    pub limits: Limits,
    pub shutdown_grace: Duration,
    /// Prefixes of variables left out of the commands' environment (`--drop-env`).
    pub drop_env: Vec<String>,
    /// Limits set on every process the daemon starts (not on the daemon).
    pub rlimits: sys::Rlimits,
    /// The commands' environment over the daemon's own (`--env-file`).
    pub env: std::collections::BTreeMap<String, String>,
    /// The Unix socket, bound before isolating (whose path the sandbox cannot see); `None`
    /// binds `listen` here.
    pub unix_listener: Option<std::os::unix::net::UnixListener>,
}

/// What the daemon holds and writes on a caller's behalf, and how it serves connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The sandbox's disk: an upload or an archive extraction that would write more is stopped
    /// (`--disk-limit`; 0 = none).
    pub disk_bytes: u64,
    /// A compressed upload may unpack to at most this many times its size (`--max-expansion-ratio`).
    pub expansion_ratio: u64,
    /// The largest `max_output_bytes` of `/v1/exec` and session runs (`--max-output-bytes`).
    pub max_output_bytes: u64,
    /// Command output held in memory at once, over all execs and processes (`--max-buffered-output`).
    pub max_buffered_output: u64,
    /// Connections open at once (`--max-connections`).
    pub max_connections: usize,
    /// A connection that sends no whole request head this long is closed (`--header-read-timeout`).
    pub header_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            disk_bytes: 0,
            expansion_ratio: DEFAULT_EXPANSION_RATIO,
            max_output_bytes: sandman_wire::bounds::MAX_OUTPUT_BYTES.max,
            max_buffered_output: budget::DEFAULT_MAX_BUFFERED_OUTPUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
        }
    }
}

/// The daemon holds at most this fraction (1/n) of its cgroup's memory as buffered output.
const BUFFERED_SHARE_OF_MEMORY: u64 = 4;

/// `--max-expansion-ratio` by default.
pub const DEFAULT_EXPANSION_RATIO: u64 = 100;
/// `--max-connections` by default: the server keeps a few connections per sandbox in its pool.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// `--header-read-timeout` by default: longer than the server keeps an idle connection to a
/// daemon in its pool (30 s), so that the daemon never closes one the server is about to use.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads the token from `SANDMAN_TOKEN`, else from `file`.
pub fn load_token(env: Option<String>, file: Option<&Path>) -> Result<String, StartError> {
    if let Some(t) = env.filter(|t| !t.is_empty()) {
        return Ok(t);
    }
    let Some(path) = file else { return Err(StartError::NoToken) };
    let text =
        std::fs::read_to_string(path).map_err(|source| StartError::TokenFile { path: path.to_path_buf(), source })?;
    let token = text.trim().to_string();
    if token.is_empty() {
        return Err(StartError::EmptyToken(path.to_path_buf()));
    }
    Ok(token)
}

/// How the daemon ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Asked to stop by a signal.
    Stopped,
    /// The lease lapsed.
    LeaseExpired,
}

/// Serves until asked to stop or until the lease lapses, then ends every child.
pub async fn run(mut settings: Settings) -> Result<Ending, StartError> {
    let cancel = CancellationToken::new();
    let children = Children::new();
    if std::process::id() != 1
        && let Err(err) = sys::become_subreaper()
    {
        tracing::warn!(%err, "cannot become a child subreaper; orphans will not be reaped here");
    }
    let reaper = children::install_reaper(children.clone(), cancel.clone()).map_err(StartError::Reaper)?;
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(StartError::Signals)?;
    let mut sigint =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(StartError::Signals)?;

    let mut defaults = Defaults::from_process(settings.shell.clone(), settings.workdir.clone());
    defaults.rlimits = settings.rlimits;
    // A file size limit held by the daemon itself is inherited by every child: a plain command
    // still starts with posix_spawn rather than a fork of the daemon (the process provider gives
    // every sandbox one, its disk size).
    if let Some(bytes) = settings.rlimits.file_size {
        match sys::hold_file_size(bytes) {
            Ok(()) => {
                defaults.file_size_held = true;
                defaults.ignored_signals = defaults.ignored_signals.with(sys::SIGXFSZ);
            }
            Err(err) => tracing::warn!(%err, "cannot hold the file size limit; each command sets it"),
        }
    }
    let env = std::sync::Arc::make_mut(&mut defaults.env);
    env.extend(std::mem::take(&mut settings.env));
    env.retain(|k, _| !settings.drop_env.iter().any(|p| k.starts_with(p.as_str())));
    // Output held for callers counts against the sandbox's memory where the daemon shares its
    // cgroup: a quarter of it at most, so that no caller can have the daemon OOM-killed.
    let mut limits = settings.limits;
    if let Some(memory) = observe::own_memory_limit()
        && memory / BUFFERED_SHARE_OF_MEMORY < limits.max_buffered_output
    {
        limits.max_buffered_output = memory / BUFFERED_SHARE_OF_MEMORY;
        tracing::info!(
            memory,
            max_buffered_output = limits.max_buffered_output,
            "buffered output held to a quarter of the cgroup's memory"
        );
    }
    let config = Config {
        token: settings.token.clone(),
        max_upload_bytes: settings.max_upload_bytes,
        limits,
        shutdown_grace: settings.shutdown_grace,
        listen: settings.listen.to_string(),
        workdir: settings.workdir.clone(),
    };
    let daemon = Daemon::new(config, defaults, children.clone(), settings.lease);
    let app = api::router(daemon.clone());

    let stop = CancellationToken::new();
    let serve_stop = stop.clone();
    let edge = sandman_http::serve::Edge {
        header_read_timeout: settings.limits.header_read_timeout,
        max_connections: settings.limits.max_connections,
        // The daemon stops its children before it stops serving: what is left is brief.
        drain: Duration::from_millis(500),
    };
    let server = match &settings.listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr: addr.clone(), source })?;
            let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| addr.clone());
            tracing::info!(listen = %local, pid = std::process::id(), "sandmand serving");
            // Streamed answers go out as they come, not held for an ACK.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            tokio::spawn(sandman_http::serve::serve(listener, app, edge, serve_stop.cancelled_owned()))
        }
        Listen::Unix(path) => {
            let listen_error = |source| StartError::Listen { addr: settings.listen.to_string(), source };
            let listener = match settings.unix_listener.take() {
                Some(bound) => {
                    bound.set_nonblocking(true).map_err(listen_error)?;
                    tokio::net::UnixListener::from_std(bound).map_err(listen_error)?
                }
                None => {
                    // A socket left by an earlier run would make bind fail.
                    let _ = std::fs::remove_file(path);
                    if let Some(parent) = path.parent() {
                        let _ = std::fs::create_dir_all(parent);
                    }
                    tokio::net::UnixListener::bind(path).map_err(listen_error)?
                }
            };
            tracing::info!(listen = %settings.listen, pid = std::process::id(), "sandmand serving");
            let listener = sandman_http::unix::QuietUnixListener(listener);
            // As its sandbox's init, the daemon tells the sandbox's own processes (which see its
            // socket where the provider mounts it, as in docker) from callers outside: a
            // process of the sandbox gets no health proof, so none can relay the server's
            // challenge to this daemon from a socket put in its place.
            let inside = daemon.pid1.then(|| app.clone().layer(axum::Extension(api::Caller::Inside)));
            let app_for = move |peer: &sandman_http::unix::UnixPeer| match &inside {
                Some(inside) if peer.in_my_pid_namespace() => inside.clone(),
                _ => app.clone(),
            };
            tokio::spawn(sandman_http::serve::serve_by(listener, app_for, edge, serve_stop.cancelled_owned()))
        }
    };

    let ending = tokio::select! {
        _ = sigterm.recv() => Ending::Stopped,
        _ = sigint.recv() => Ending::Stopped,
        _ = daemon.lease.lapsed() => Ending::LeaseExpired,
        res = server => {
            return Err(StartError::Serve(match res {
                Ok(()) => std::io::Error::other("the listener closed"),
                Err(e) => std::io::Error::other(e),
            }));
        }
    };
    match ending {
        Ending::LeaseExpired => {
            let lease = settings.lease.unwrap_or_default();
            tracing::warn!(
                lease_ms = lease.as_millis() as u64,
                children = children.count(),
                "lease lapsed: no authenticated call for the lease period; killing every process and exiting"
            );
            daemon.kill_everything();
        }
        Ending::Stopped => {
            tracing::info!(children = children.count(), "asked to stop; forwarding SIGTERM to every child");
            daemon.signal_all(sys::SIGTERM);
            if daemon.pid1 {
                let _ = sys::kill_all_others(sys::SIGTERM);
            }
            let deadline = tokio::time::sleep(settings.shutdown_grace);
            tokio::pin!(deadline);
            loop {
                if children.count() == 0 {
                    break;
                }
                tokio::select! {
                    _ = &mut deadline => {
                        tracing::warn!(children = children.count(), "children outlived the grace period; killing them");
                        break;
                    }
                    _ = sigterm.recv() => { tracing::warn!("second signal: killing at once"); break; }
                    _ = sigint.recv() => { tracing::warn!("second signal: killing at once"); break; }
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
            daemon.kill_everything();
        }
    }
    stop.cancel();
    daemon.tasks.close();
    // Let the children's exits be reaped and the last answers go out, briefly.
    let _ = tokio::time::timeout(Duration::from_millis(500), daemon.tasks.wait()).await;
    cancel.cancel();
    let _ = reaper.await;
    if let Listen::Unix(path) = &settings.listen {
        let _ = std::fs::remove_file(path);
    }
    Ok(ending)
}

/// Copies this binary to `dest` (mode 0755), for images with no shell or `cp` (the Kubernetes
/// init container runs `sandmand install /.sandman/sandmand`).
pub fn install(dest: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let me = std::env::current_exe()?;
    let tmp = dest.with_extension("sandman-tmp");
    std::fs::copy(&me, &tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, dest)
}

/// Parses `30s`, `5m`, `1500ms`, `2h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len()));
    let n: f64 = num.parse().map_err(|_| format!("`{text}` is not a duration like 30s, 5m or 1500ms"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("`{text}` has an unknown unit (use ms, s, m or h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{text}` is not a valid duration"));
    }
    if secs > MAX_DURATION_S {
        return Err(format!("`{text}` is longer than the longest duration taken, 365 days"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{text}` is not a valid duration: {e}"))
}

/// The longest duration a flag takes: a year, far past any lease or grace a server asks for.
const MAX_DURATION_S: f64 = 365.0 * 86400.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses() {
        assert_eq!("unix:/run/s.sock".parse::<Listen>(), Ok(Listen::Unix("/run/s.sock".into())));
        assert_eq!("0.0.0.0:7778".parse::<Listen>(), Ok(Listen::Tcp("0.0.0.0:7778".into())));
        assert!("unix:".parse::<Listen>().is_err());
        assert!("nowhere".parse::<Listen>().is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5y").is_err());
        // A huge lease is refused, never wrapped or a panic.
        assert!(parse_duration("18446744073709551615s").is_err());
        assert!(parse_duration("100000000000000000000000h").is_err());
    }

    #[test]
    fn token_from_env_first_then_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(load_token(Some("env".into()), Some(&file)).ok().as_deref(), Some("env"));
        assert_eq!(load_token(None, Some(&file)).ok().as_deref(), Some("from-file"));
        assert!(matches!(load_token(None, None), Err(StartError::NoToken)));
        std::fs::write(&file, "  \n").unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(load_token(None, Some(&file)), Err(StartError::EmptyToken(_))));
    }
}

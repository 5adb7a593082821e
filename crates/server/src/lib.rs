//! `sandman serve`: the control plane. It makes sandboxes through one provider, tracks their
//! lifecycle and leases, reclaims the abandoned, and proxies daemon calls. Start at [`run`], then
//! [`service::Service`] for the lifecycle and [`api::router`] for the calls.

pub mod accounting;
pub mod admission;
pub mod api;
pub mod auth;
pub mod conditions;
pub mod config;
pub mod daemon;
pub mod e2b;
pub mod error;
pub mod events;
pub mod fusion;
pub mod journal;
pub mod metrics;
pub mod mirror;
pub mod pool;
pub mod prepare;
pub mod provider;
pub mod proxy;
pub mod replicas;
pub mod sandbox;
pub mod service;
pub mod snapshots_api;
pub mod store;
mod sys;
pub mod ui;

use std::path::PathBuf;
use std::time::Duration;

pub use config::ServeArgs;
use sandman_provider_docker::{DockerConfig, DockerProvider};
use sandman_provider_process::{Isolation, ProcessConfig, ProcessProvider};
pub use sandman_wire::state_dir::default_state_dir;

use crate::api::Limits;
use crate::provider::AnyProvider;
use crate::service::{Service, Settings};

/// The server's version, as `/healthz`, conditions records and the dashboard report it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Why the server could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot use the state directory `{path}`")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unknown provider `{0}`; this build has: {names}", names = provider::NAMES.join(", "))]
    UnknownProvider(String),
    #[error(
        "cannot find the `sandmand` daemon binary, nor this executable to run the embedded one; pass --daemon PATH"
    )]
    NoDaemon,
    #[error("cannot start the `{name}` provider")]
    Provider {
        name: String,
        #[source]
        source: sandman_provider::ProviderError,
    },
    #[error("cannot recover sandboxes from the provider's records")]
    Recover(#[source] error::ServerError),
    #[error("cannot draw random bytes with getrandom(2) (Linux 3.17 or later), which sandbox ids and tokens need")]
    Random(#[source] std::io::Error),
    #[error("cannot run as a replica: {0}")]
    Replicas(String),
    #[error("cannot listen on `{addr}`")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// The first argument that makes the `sandman` binary run as the sandbox daemon.
pub const EMBEDDED_DAEMON_ARG: &str = "__sandmand";

/// What `run` reports as it starts, for the binary to print.
#[derive(Debug, Clone)]
pub struct Started {
    pub listen: String,
    /// The Unix socket it serves on too, if any.
    pub socket: Option<PathBuf>,
    pub token: auth::TokenSource,
    pub recovered: usize,
    pub found_dead: usize,
}

/// The process provider's image store: under the state directory, bounded as told.
fn image_store(args: &ServeArgs, state_dir: &std::path::Path) -> sandman_image::StoreConfig {
    let mut store = sandman_image::StoreConfig::new(state_dir.join("images"));
    store.max_size = args.image_store_max_size.0.as_ref().and_then(|q| q.value().ok()).map(|b| b as u64);
    store.insecure_registries = args.insecure_registries.clone();
    store
}

/// Builds the provider named by `args`.
pub async fn build_provider(args: &ServeArgs, state_dir: &std::path::Path) -> Result<AnyProvider, ServeError> {
    match args.provider.as_str() {
        "process" => {
            // A `sandmand` of its own when one is given or found; else this very binary, which
            // embeds the daemon behind `EMBEDDED_DAEMON_ARG`.
            let (daemon_bin, daemon_args) = match args.daemon.clone().or_else(sandman_provider_process::find_daemon) {
                Some(bin) => (bin, Vec::new()),
                None => {
                    let exe = std::env::current_exe().map_err(|_| ServeError::NoDaemon)?;
                    (exe, vec![EMBEDDED_DAEMON_ARG.into()])
                }
            };
            tracing::info!(daemon = %daemon_bin.display(), embedded = !daemon_args.is_empty(), "process provider");
            let isolation = if args.isolation == "none" { Isolation::None } else { Isolation::Full };
            // The server's own binary is nothing a sandbox should read, or find out where it is.
            let hide = std::env::current_exe().into_iter().collect();
            let network = sandman_provider_process::net::NetConfig {
                subnet: args.sandbox_subnet,
                allow: args.egress_allow.clone(),
                dns: (!args.dns.is_empty()).then(|| args.dns.clone()),
            };
            let defaults = sandman_wire::server::Resources {
                memory: args.default_memory.0.clone(),
                disk: args.default_disk.0.clone(),
                ..Default::default()
            };
            let capacity = (args.memory_overcommit > 0.0).then(|| sandman_provider_process::Capacity {
                overcommit: args.memory_overcommit,
                wait: Duration::from_secs(args.capacity_wait_s),
            });
            let config = ProcessConfig {
                state_dir: state_dir.to_path_buf(),
                daemon_bin,
                daemon_args,
                isolation,
                hide,
                network,
                defaults,
                capacity,
                images: Some(image_store(args, state_dir)),
            };
            ProcessProvider::new(config)
                .map(|p| AnyProvider::Process(Box::new(p)))
                .map_err(|source| ServeError::Provider { name: "process".into(), source })
        }
        "docker" => {
            // The daemon is bind-mounted into images with no libc: it must be the static one
            // (checked by the provider, which names ./scripts/build-daemon when it is not).
            let daemon_bin = args.daemon.clone().or_else(sandman_provider_process::find_daemon).ok_or_else(|| {
                ServeError::Provider {
                    name: "docker".into(),
                    source: sandman_provider::ProviderError::Unsupported(
                        "the docker provider needs the static sandmand: build it with ./scripts/build-daemon and \
                         pass --daemon target/static/x86_64-unknown-linux-gnu/daemon/sandmand"
                            .into(),
                    ),
                }
            })?;
            let egress = sandman_provider_docker::Egress {
                network: args.docker_network.clone(),
                bridge: args.docker_bridge.clone(),
                filter: match args.docker_egress.as_str() {
                    "unfiltered" => sandman_provider_docker::Filter::Unfiltered,
                    _ => sandman_provider_docker::Filter::Filtered,
                },
                allow: args.egress_allow.clone(),
                dns: (!args.dns.is_empty()).then(|| args.dns.clone()),
            };
            let config = DockerConfig { egress, ..DockerConfig::new(state_dir.to_path_buf(), daemon_bin) };
            DockerProvider::connect(config)
                .await
                .map(AnyProvider::Docker)
                .map_err(|source| ServeError::Provider { name: "docker".into(), source })
        }
        "kubernetes" => {
            let config = match &args.kube_config {
                Some(path) => sandman_provider_kube::KubeConfig::from_file(path)
                    .map_err(|e| ServeError::Provider { name: "kubernetes".into(), source: e.into() })?,
                None => sandman_provider_kube::KubeConfig::default(),
            };
            sandman_provider_kube::KubeProvider::connect(config)
                .await
                .map(|p| AnyProvider::Kube(Box::new(p)))
                .map_err(|source| ServeError::Provider { name: "kubernetes".into(), source })
        }
        other => Err(ServeError::UnknownProvider(other.to_string())),
    }
}

/// The Unix socket's name in the state directory, where clients on this machine look first.
pub const SOCKET_FILE: &str = "sandman.sock";

/// Binds the Unix socket at `path`, replacing one a server that is gone left; refuses when a
/// server still answers there (two servers on one state directory would each take the other's
/// sandboxes for their own).
async fn bind_socket(path: &std::path::Path) -> Result<tokio::net::UnixListener, ServeError> {
    if tokio::net::UnixStream::connect(path).await.is_ok() {
        return Err(ServeError::Listen {
            addr: format!("unix:{}", path.display()),
            source: std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "a server already answers there: another server runs on this state directory",
            ),
        });
    }
    let _ = std::fs::remove_file(path);
    tokio::net::UnixListener::bind(path)
        .map_err(|source| ServeError::Listen { addr: format!("unix:{}", path.display()), source })
}

/// Makes the state directory (and its missing parents) 0700, or makes an existing one so: it
/// holds the server's token, its conditions key and every sandbox's records, which no other
/// host user may list, read or write. One that belongs to another user is refused.
fn own_state_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let meta = std::fs::metadata(dir)?;
    let me = sys::euid();
    if meta.uid() != me {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "it belongs to uid {}, and this server runs as uid {me}; give it a directory of its own, or a path below this one for it to make",
                meta.uid()
            ),
        ));
    }
    if meta.mode() & 0o077 != 0 {
        tracing::info!(path = %dir.display(), mode = format!("{:o}", meta.mode() & 0o777), "making the state directory 0700");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Serves until `shutdown` resolves. `on_start` is told where it listens and what it recovered.
pub async fn run(
    args: ServeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_start: impl FnOnce(&Started),
) -> Result<(), ServeError> {
    // Checked once: ids and tokens are drawn later with no way to fail.
    sys::random_bytes(&mut [0u8; 1]).map_err(ServeError::Random)?;
    // Raised first: what the server keeps open for daemons is sized by it.
    let max_connections = connection_limit(args.max_connections);
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    // Absolute: the provider hands its paths to daemons that resolve them elsewhere (an
    // isolated one from the root of a mount namespace of its own).
    let state_dir =
        std::path::absolute(&state_dir).map_err(|source| ServeError::StateDir { path: state_dir.clone(), source })?;
    own_state_dir(&state_dir).map_err(|source| ServeError::StateDir { path: state_dir.clone(), source })?;
    let (token, source) = auth::load_or_generate(std::env::var("SANDMAN_TOKEN").ok(), &state_dir)
        .map_err(|source| ServeError::StateDir { path: state_dir.clone(), source })?;
    // Before the provider: a second server on this state directory stops here, before it
    // touches the first one's sandboxes.
    let socket = match args.socket.as_deref() {
        Some("none") => None,
        Some(path) => Some(PathBuf::from(path)),
        None => Some(state_dir.join(SOCKET_FILE)),
    };
    let unix = match &socket {
        Some(path) => Some(bind_socket(path).await?),
        None => None,
    };
    if args.leader_election {
        return run_replica(args, state_dir, token, source, (unix, socket), max_connections, shutdown, on_start).await;
    }
    let provider = build_provider(&args, &state_dir).await?;
    let settings = settings(&args, &state_dir, store::Store::Dir(state_dir.clone()));
    let service = Service::new(settings, provider, token);
    service.start_background();
    let (recovered, found_dead) = service.recover().await.map_err(ServeError::Recover)?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| ServeError::Listen { addr: args.listen.clone(), source })?;
    let listen = listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| args.listen.clone());
    let app = api::router_with(service.clone(), limits(&args), fusion_config(&args, &listen));
    on_start(&Started { listen, socket: socket.clone(), token: source, recovered, found_dead });
    let edge = edge(&args, max_connections);
    serve_until(
        listener,
        unix,
        app,
        edge,
        service.draining.clone(),
        Duration::from_secs(args.shutdown_drain_s),
        shutdown,
    )
    .await;
    if let Some(path) = &socket {
        let _ = std::fs::remove_file(path);
    }
    stop_service(&service).await;
    Ok(())
}

/// The service's settings from the command line, its documents kept in `store`.
fn settings(args: &ServeArgs, state_dir: &std::path::Path, store: store::Store) -> Settings {
    Settings {
        default_lease: Duration::from_secs(args.default_lease_s.max(1)),
        max_ttl: (args.max_ttl_s > 0).then(|| Duration::from_secs(args.max_ttl_s)),
        ready_timeout: args.ready_timeout(),
        gone_retention: Duration::from_secs(args.gone_retention_s),
        state_dir: state_dir.to_path_buf(),
        create_rate: (args.create_rate > 0.0).then_some(args.create_rate),
        create_burst: args.create_burst.unwrap_or(args.create_rate).max(1.0),
        max_queue: args.max_queue,
        max_output_bytes: args.max_output_bytes,
        daemons: service::Daemons::Real,
        store,
    }
}

fn limits(args: &ServeArgs) -> Limits {
    Limits {
        request_timeout: Duration::from_secs(args.request_timeout_s.max(1)),
        max_concurrent: args.max_concurrent_requests.max(1),
    }
}

fn fusion_config(args: &ServeArgs, listen: &str) -> fusion::FusionConfig {
    fusion::FusionConfig {
        image: args.fusion_image.clone(),
        max_calls: args.fusion_max_calls,
        public_url: args.public_url.clone().unwrap_or_else(|| public_url(listen)),
    }
}

fn edge(args: &ServeArgs, max_connections: usize) -> sandman_http::serve::Edge {
    sandman_http::serve::Edge {
        header_read_timeout: Duration::from_secs(args.header_read_timeout_s),
        max_connections,
        drain: Duration::from_secs(args.shutdown_timeout_s),
    }
}

/// Sandboxes outlive the server on purpose: their records stay with the provider and a
/// restarted server finds them again; their daemons' leases end them if it never returns.
async fn stop_service(service: &Service) {
    service.cancel.cancel();
    service.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), service.tasks.wait()).await;
    service.provider.stop().await;
}

/// Serves `app` on the TCP listener and the Unix socket until `shutdown` resolves; then
/// `draining` is cancelled (so `/readyz` answers 503) and calls are still served for `drain`,
/// then calls in flight get the edge's drain time to finish. A second signal cuts either short.
async fn serve_until(
    listener: tokio::net::TcpListener,
    unix: Option<tokio::net::UnixListener>,
    app: axum::Router,
    edge: sandman_http::serve::Edge,
    draining: tokio_util::sync::CancellationToken,
    drain: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    // No Nagle: a stream's small events (a command's start, its end) go out at once, not
    // 40 ms later behind the client's delayed ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    // Both listeners drain and stop together, at the one shutdown.
    let stop = tokio_util::sync::CancellationToken::new();
    let tcp = sandman_http::serve::serve_draining(
        listener,
        app.clone(),
        edge,
        draining.clone(),
        stop.clone().cancelled_owned(),
    );
    let on_socket = async {
        if let Some(unix) = unix {
            sandman_http::serve::serve_draining(unix, app, edge, draining.clone(), stop.clone().cancelled_owned())
                .await;
        }
    };
    let asked = async {
        shutdown.await;
        draining.cancel();
        if !drain.is_zero() {
            tracing::info!(
                drain_s = drain.as_secs(),
                "draining: /readyz answers 503 and calls are still served until the drain ends (a second signal ends it)"
            );
            tokio::select! {
                () = tokio::time::sleep(drain) => {}
                () = shutdown_signal() => {}
            }
        }
        tracing::info!(timeout_s = edge.drain.as_secs(), "no longer accepting; calls in flight are finishing");
        stop.cancel();
    };
    let serving = async {
        tokio::join!(tcp, on_socket, asked);
    };
    // Once it no longer accepts, one more signal drops the calls still in flight.
    let forced = async {
        stop.cancelled().await;
        shutdown_signal().await;
    };
    tokio::select! {
        () = serving => {}
        () = forced => tracing::warn!("asked again: calls still in flight are dropped"),
    }
}

/// `--leader-election`: one replica of several (see [`replicas`]). It serves at once, passing
/// calls on to the leader, and campaigns for the Lease; once it leads it builds the service
/// from the cluster and serves it. Deposed (the Lease lost, or the shared state written by
/// another replica), it stops at once with an error, for its Deployment to restart it as a
/// follower.
#[allow(clippy::too_many_arguments)]
async fn run_replica(
    args: ServeArgs,
    state_dir: PathBuf,
    token: String,
    source: auth::TokenSource,
    (unix, socket): (Option<tokio::net::UnixListener>, Option<PathBuf>),
    max_connections: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_start: impl FnOnce(&Started),
) -> Result<(), ServeError> {
    if args.provider != "kubernetes" {
        return Err(ServeError::Replicas(format!(
            "--leader-election shares state through the Kubernetes API: it needs --provider kubernetes, not `{}`",
            args.provider
        )));
    }
    let namespace = args.replica_namespace.clone().ok_or_else(|| {
        ServeError::Replicas(
            "--leader-election needs the namespace of the replicas' Lease: pass --replica-namespace, or set \
             POD_NAMESPACE from the downward API"
                .into(),
        )
    })?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| ServeError::Listen { addr: args.listen.clone(), source })?;
    let bound = listener.local_addr().map_err(|source| ServeError::Listen { addr: args.listen.clone(), source })?;
    let listen = bound.to_string();
    let me = match (&args.advertise, std::env::var("POD_IP")) {
        (Some(a), _) => a.clone(),
        (None, Ok(ip)) if !ip.is_empty() => std::net::SocketAddr::new(
            ip.parse().map_err(|e| ServeError::Replicas(format!("POD_IP `{ip}` is not an address: {e}")))?,
            bound.port(),
        )
        .to_string(),
        _ => {
            return Err(ServeError::Replicas(
                "--leader-election needs the address other replicas reach this one at: pass --advertise, or set \
                 POD_IP from the downward API"
                    .into(),
            ));
        }
    };
    let shared = sandman_provider_kube::shared::Shared::connect(&namespace)
        .await
        .map_err(|source| ServeError::Provider { name: "kubernetes".into(), source })?;
    // A replica whose pod was deleted (force-deleted, or its node lost) may run on for a while
    // with a token the API server no longer takes. If it leads, it would fail creates that the
    // next leader would carry out: it stops at once instead, answering nothing more, and its
    // callers (through the other replicas) resend what is safe to the next leader.
    sandman_provider_kube::shared::on_credentials_refused(|what| {
        eprintln!(
            "error: the API server refused this replica's credentials (to {what}): its pod was deleted, or its \
             token revoked; stopping at once so that another replica leads"
        );
        std::process::exit(1);
    });
    let watching = tokio_util::sync::CancellationToken::new();
    let draining = tokio_util::sync::CancellationToken::new();
    let mirror = mirror::Mirror::new(token.clone(), args.max_output_bytes);
    let replica = replicas::Replica::new(me.clone(), shared.leader(watching.clone()), draining.clone(), Some(mirror));
    let following = tokio::spawn(replica.clone().follow(watching.clone()));
    let app = replica.router();
    on_start(&Started { listen: listen.clone(), socket: socket.clone(), token: source, recovered: 0, found_dead: 0 });
    tracing::info!(replica = me, namespace, "serving as a replica; campaigning for the Lease");
    let stop = tokio_util::sync::CancellationToken::new();
    let build = {
        let (args, watching, draining) = (args.clone(), watching.clone(), draining.clone());
        move |shared: sandman_provider_kube::shared::Shared| async move {
            let documents = shared.documents(watching).await.map_err(|e| e.to_string())?;
            let key = shared
                .key(|| {
                    let mut key = vec![0u8; 32];
                    // Checked at start: drawing random bytes works on this machine.
                    let _ = sys::random_bytes(&mut key);
                    key
                })
                .await
                .map_err(|e| e.to_string())?;
            let provider = build_provider(&args, &state_dir).await.map_err(|e| daemon::with_causes(&e))?;
            let fenced = documents.fenced();
            let store = store::Store::Shared { documents, key: key.into() };
            let service = Service::new(settings(&args, &state_dir, store), provider, token);
            service.start_background();
            let (live, dead) = service.recover().await.map_err(|e| e.to_string())?;
            tracing::info!(recovered = live, found_dead = dead, "took over the sandboxes");
            // The replica's drain is the service's.
            let service_draining = service.draining.clone();
            tokio::spawn(async move {
                draining.cancelled().await;
                service_draining.cancel();
            });
            let app = api::router_with(service.clone(), limits(&args), fusion_config(&args, &listen))
                .merge(mirror::leader_routes(service.clone()));
            Ok((app, service, fenced))
        }
    };
    let lead = tokio::spawn(replicas::lead(replica.clone(), shared, stop.clone(), build));
    let serving = serve_until(
        listener,
        unix,
        app,
        edge(&args, max_connections),
        draining,
        Duration::from_secs(args.shutdown_drain_s),
        shutdown,
    );
    let mut lead = std::pin::pin!(lead);
    let outcome = tokio::select! {
        () = serving => None,
        ended = &mut lead => Some(ended),
    };
    let ended = match outcome {
        Some(ended) => ended,
        None => {
            stop.cancel();
            lead.await
        }
    };
    if let Some(path) = &socket {
        let _ = std::fs::remove_file(path);
    }
    if let Some((_, service)) = replica.leading.get() {
        stop_service(service).await;
    }
    watching.cancel();
    let _ = following.await;
    match ended {
        Ok(replicas::Ended::Stopped) => Ok(()),
        Ok(replicas::Ended::Deposed(why)) => Err(ServeError::Replicas(format!("stopped leading: {why}"))),
        Err(e) => Err(ServeError::Replicas(format!("the election task failed: {e}"))),
    }
}

/// The URL clients reach the server at, from the address it listens on: an unspecified
/// address (`0.0.0.0`) is given as this machine's loopback.
fn public_url(listen: &str) -> String {
    match listen.parse::<std::net::SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => format!("http://127.0.0.1:{}", a.port()),
        Ok(a) => format!("http://{a}"),
        Err(_) => format!("http://{listen}"),
    }
}

/// Open files kept for what is not a client connection: the state directory's files, the
/// provider's watches, the logs.
const RESERVED_FILES: u64 = 256;

/// The connection limit this process can hold: `asked`, or less when the open files limit
/// (raised to its hard limit first) cannot hold two descriptors for each connection (its own
/// and, for a proxied call, the daemon's) besides [`RESERVED_FILES`].
fn connection_limit(asked: usize) -> usize {
    let files = match sys::raise_open_files_limit() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open files limit; keeping --max-connections");
            return asked;
        }
    };
    let room = usize::try_from(files.saturating_sub(RESERVED_FILES) / 2).unwrap_or(usize::MAX).max(1);
    if room < asked {
        tracing::warn!(
            max_connections = room,
            asked,
            open_files = files,
            "the open files limit holds fewer connections than --max-connections; raise `ulimit -n` to serve more"
        );
        return room;
    }
    asked
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down; sandboxes keep running and are found again on the next start");
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Regression (issue 29): the state directory was 0755, so any host user could list the
    /// sandboxes' ids and reach into their directories.
    #[test]
    fn the_state_directory_is_made_0700_or_tightened_to_it() {
        let base = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let fresh = base.path().join("a/b/state");
        super::own_state_dir(&fresh).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((mode(&fresh), mode(&base.path().join("a"))), (0o700, 0o700));
        let loose = base.path().join("loose");
        std::fs::create_dir(&loose).unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap_or_else(|e| panic!("{e}"));
        super::own_state_dir(&loose).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mode(&loose), 0o700);
    }
}

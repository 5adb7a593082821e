//! The Docker provider: each sandbox is a container of the requested image, unmodified, with the
//! static `sandmand` bind-mounted read-only as its entry point, reached over a Unix socket in a
//! per-sandbox host directory (so it works with `network: none` and sends nothing to the bridge
//! network). Start at [`DockerProvider::connect`]; `docs/docker-provider.md` describes it whole.
//!
//! The container's labels are the state of record (the spec less its token, which stays in a
//! 0600 file, handed to the daemon through a file it removes once read); one `docker events`
//! stream reports deaths. `container` builds a container from a spec without I/O (the `eval`
//! profile's fixed conditions included) and reads back what was applied, `watch` is the one
//! watcher, `image` pulls and pins an image to its ID, `network` is where egress sandboxes sit
//! and what the host firewall refuses them.

mod container;
mod elf;
mod hostdir;
mod image;
mod network;
pub mod snapshot;
mod watch;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use bollard::Docker;
use bollard::errors::Error as BollardError;
use bollard::models::ContainerSummaryStateEnum;
use bollard::query_parameters::{CreateContainerOptions, ListContainersOptions, RemoveContainerOptions};
use sandman_provider::records;
use sandman_provider::{
    Creating, EVENT_CAPACITY, Ended, Endpoint, NodeProgress, PROGRESS_CAPACITY, Prepared, Progress, Provider,
    ProviderError, ProviderEvent, Record, SandboxSpec,
};
use sandman_wire::server::{Applied, Profile, Reason, Resources};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::container::{
    DAEMON_IN_CONTAINER, EVAL_ENV, EVAL_PIDS, IMAGE_LABEL, JOB_LABEL, MANAGED_BY, MANAGED_BY_VALUE, OWNER_LABEL,
    RUN_IN_CONTAINER, SANDBOX_LABEL, SPEC_LABEL, TOKEN_IN_CONTAINER, container_name,
};
pub use crate::elf::{DaemonBinaryError, check_static};
use crate::hostdir::HostDir;
pub use crate::network::{DEFAULT_BRIDGE, DEFAULT_NETWORK, Egress, Filter, table_of};

/// The engine's address when `DOCKER_HOST` is unset.
pub const DEFAULT_DOCKER_HOST: &str = "unix:///var/run/docker.sock";

/// How long a pull may go without any progress before it fails.
pub const DEFAULT_PULL_STALL: Duration = Duration::from_secs(120);

/// How long connecting to the engine may take at start.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a delete waits for a removal another call started.
const REMOVAL_WAIT: Duration = Duration::from_secs(10);

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// What the provider needs to start.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// The server's state directory; sandboxes' host directories are `state_dir/docker/<id>/`.
    pub state_dir: PathBuf,
    /// The static `sandmand`, bind-mounted into every container.
    pub daemon_bin: PathBuf,
    /// Where the engine answers: `unix:///var/run/docker.sock` (see [`docker_host_from_env`]). It
    /// must run on this machine: sandboxes bind-mount host directories.
    pub docker_host: String,
    /// A pull that makes no progress for this long fails with `image_pull_failed`.
    pub pull_stall: Duration,
    /// Where `network: egress` sandboxes sit and what they may reach.
    pub egress: Egress,
}

impl DockerConfig {
    /// The engine from `DOCKER_HOST` (else the default socket), the default pull stall, and
    /// egress sandboxes on network `sandman` (bridge `smd0`), filtered.
    pub fn new(state_dir: PathBuf, daemon_bin: PathBuf) -> Self {
        DockerConfig {
            state_dir,
            daemon_bin,
            docker_host: docker_host_from_env(),
            pull_stall: DEFAULT_PULL_STALL,
            egress: Egress::default(),
        }
    }
}

/// `$DOCKER_HOST`, else `unix:///var/run/docker.sock`.
pub fn docker_host_from_env() -> String {
    std::env::var("DOCKER_HOST").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| DEFAULT_DOCKER_HOST.to_string())
}

/// What the provider and its watcher share. Each set is locked briefly, never across an await.
#[derive(Debug, Default)]
struct Shared {
    /// Sandboxes whose create is under way: `list` reports them running before they start.
    creating: Creating,
    /// Sandboxes being deleted by this instance: their deaths are no news.
    deleting: Mutex<HashSet<String>>,
    /// Sandboxes whose death was reported, so a resumed stream does not report it twice.
    reported: Mutex<HashSet<String>>,
    /// Sandboxes killed for going over their memory limit (the engine sends many `oom` events).
    oom: Mutex<HashSet<String>>,
}

fn lock(m: &Mutex<HashSet<String>>) -> MutexGuard<'_, HashSet<String>> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn is_deleting(&self, id: &str) -> bool {
        lock(&self.deleting).contains(id)
    }

    fn was_reported(&self, id: &str) -> bool {
        lock(&self.reported).contains(id)
    }

    /// True the first time only.
    fn mark_reported(&self, id: &str) -> bool {
        lock(&self.reported).insert(id.to_string())
    }

    /// True the first time only.
    fn first_oom(&self, id: &str) -> bool {
        lock(&self.oom).insert(id.to_string())
    }

    fn forget(&self, id: &str) {
        lock(&self.reported).remove(id);
        lock(&self.oom).remove(id);
    }
}

/// The Docker provider. Its state of record is the engine's containers (their labels) and the
/// host directories beside them: a second instance on the same state directory (a restarted
/// server) finds every sandbox with [`Provider::list`], and its one events stream covers them all.
#[derive(Debug)]
pub struct DockerProvider {
    docker: Docker,
    config: DockerConfig,
    /// `<state_dir>/docker`, resolved: sandboxes' host directories, and the owner label.
    base: PathBuf,
    owner: String,
    /// The engine's cpu count; a larger cpu limit is refused.
    host_cpus: f64,
    /// The engine's cgroup version (`1` or `2`), reported with what was applied.
    cgroup_version: Option<String>,
    shared: Arc<Shared>,
    /// Handed to the server once.
    events_rx: Mutex<Option<mpsc::Receiver<ProviderEvent>>>,
    /// Where creates' pulls report progress (lossy: a full channel drops a line).
    progress_tx: mpsc::Sender<Progress>,
    /// Handed to the server once.
    progress_rx: Mutex<Option<mpsc::Receiver<Progress>>>,
    /// The watcher; cancelled on shutdown (the containers keep running for the next server).
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl DockerProvider {
    /// Checks that the daemon binary is static, makes `state_dir/docker/`, connects to the engine
    /// (negotiating the API version) and starts watching its events. Fails with a message saying
    /// how to start the engine when it does not answer.
    pub async fn connect(mut config: DockerConfig) -> Result<Self, ProviderError> {
        check_static(&config.daemon_bin).map_err(|e| ProviderError::Unsupported(chain(&e)))?;
        // A bind mount's source must be absolute.
        config.daemon_bin = std::fs::canonicalize(&config.daemon_bin)
            .map_err(|e| ProviderError::io(format!("cannot resolve `{}`", config.daemon_bin.display()), e))?;
        let base = config.state_dir.join("docker");
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&base)
                .map_err(|e| ProviderError::io(format!("cannot create `{}`", base.display()), e))?;
        }
        let base = std::fs::canonicalize(&base)
            .map_err(|e| ProviderError::io(format!("cannot resolve `{}`", base.display()), e))?;
        let owner = base.display().to_string();

        let host = &config.docker_host;
        config.egress.check(host)?;
        let unreachable = |e: &dyn std::fmt::Display| {
            ProviderError::Backend(format!(
                "cannot reach the docker engine at `{host}`: {e}; is it running? Start it with \
                 `dockerd > /var/log/dockerd.log 2>&1 &` (or `systemctl start docker`), or point DOCKER_HOST at it"
            ))
        };
        let address = if host.starts_with('/') { format!("unix://{host}") } else { host.clone() };
        let docker = Docker::connect_with_host(&address).map_err(|e| unreachable(&e))?;
        let docker = match tokio::time::timeout(CONNECT_TIMEOUT, docker.negotiate_version()).await {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => return Err(unreachable(&e)),
            Err(_) => return Err(unreachable(&format!("no answer within {} s", CONNECT_TIMEOUT.as_secs()))),
        };
        let info = docker.info().await.map_err(|e| unreachable(&e))?;
        // Before any sandbox can be made: egress sandboxes' network, and the firewall on it.
        config.egress.prepare(&docker, &base).await?;
        let host_cpus = info.ncpu.unwrap_or(0) as f64;
        let cgroup_version = info.cgroup_version.map(|v| v.to_string());
        tracing::info!(
            engine = %address,
            version = info.server_version.as_deref().unwrap_or("?"),
            cpus = host_cpus,
            daemon = %config.daemon_bin.display(),
            "docker provider"
        );

        let (events_tx, events_rx) = mpsc::channel(EVENT_CAPACITY);
        let (progress_tx, progress_rx) = mpsc::channel(PROGRESS_CAPACITY);
        let shared = Arc::new(Shared::default());
        let tasks = TaskTracker::new();
        let cancel = CancellationToken::new();
        let watcher = watch::Watcher {
            docker: docker.clone(),
            owner: owner.clone(),
            base: base.clone(),
            shared: shared.clone(),
            events: events_tx,
            cancel: cancel.clone(),
            // A moment back: a container that dies while the stream opens is still seen.
            since: watch::since(SystemTime::now() - Duration::from_secs(1)),
        };
        tasks.spawn(watcher.run());
        Ok(DockerProvider {
            docker,
            config,
            base,
            owner,
            host_cpus,
            cgroup_version,
            shared,
            events_rx: Mutex::new(Some(events_rx)),
            progress_tx,
            progress_rx: Mutex::new(Some(progress_rx)),
            tasks,
            cancel,
        })
    }

    /// The host directory of sandbox `id`.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.base.join(id)
    }

    /// Stops watching (the containers keep running, for the next server) and waits for it.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Refuses what this provider cannot honour, before anything is made (for `eval`: cpu or
    /// memory missing or not exactly applicable, an env contradicting its fixed TZ and locale).
    fn refuse(&self, spec: &SandboxSpec) -> Result<container::Limits, ProviderError> {
        check_id(&spec.id)?;
        if spec.image.trim().is_empty() || spec.image.chars().any(char::is_whitespace) {
            return Err(ProviderError::Unsupported(format!("`{}` is not an image reference", spec.image)));
        }
        let socket = HostDir::new(&self.base, &spec.id).socket();
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(ProviderError::Unsupported(format!(
                "the daemon's socket path `{}` is longer than the {MAX_SOCKET_PATH} bytes a Unix socket allows; use a shorter state directory",
                socket.display()
            )));
        }
        container::limits(spec, self.host_cpus)
    }

    async fn make(&self, spec: &SandboxSpec, limits: container::Limits, dir: &HostDir) -> Result<(), ProviderError> {
        let reporter = image::Reporter { id: &spec.id, tx: &self.progress_tx };
        // A snapshot's image is on the engine or nowhere: never pulled.
        self.check_snapshot_image(&spec.image).await?;
        let engine_image = snapshot::engine_image(&spec.image).unwrap_or_else(|| spec.image.clone());
        let pinned = image::ensure(&self.docker, &engine_image, self.config.pull_stall, Some(reporter)).await?;
        let prepared = {
            let (dir, token) = (dir.clone(), spec.token.clone());
            tokio::task::spawn_blocking(move || dir.prepare(&token)).await
        };
        match prepared.map_err(std::io::Error::other).and_then(|r| r) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(ProviderError::Backend(format!(
                    "sandbox `{}` exists already in `{}`",
                    spec.id,
                    dir.root.display()
                )));
            }
            Err(e) => {
                records::remove_dir(dir).await;
                return Err(ProviderError::io(format!("cannot prepare `{}`", dir.root.display()), e));
            }
        }
        let plan = container::Plan {
            spec,
            image_id: &pinned.id,
            image: &pinned.config,
            limits,
            owner: &self.owner,
            daemon_bin: &self.config.daemon_bin,
            dir,
            egress: &self.config.egress,
        };
        let outcome = self.run(spec, &plan).await;
        if outcome.is_err() {
            let _ = self.remove_container(&spec.id).await;
            records::remove_dir(dir).await;
        }
        outcome
    }

    async fn run(&self, spec: &SandboxSpec, plan: &container::Plan<'_>) -> Result<(), ProviderError> {
        let body = container::body(plan)?;
        let name = container_name(&spec.id);
        let options = CreateContainerOptions { name: Some(name.clone()), ..Default::default() };
        match self.docker.create_container(Some(options), body).await {
            Ok(_) => {}
            Err(BollardError::DockerResponseServerError { status_code: 409, message }) => {
                return Err(ProviderError::Backend(format!("a container `{name}` exists already: {message}")));
            }
            Err(e) => return Err(engine_error(&format!("cannot create the container of `{}`", spec.id), e)),
        }
        self.docker.start_container(&name, None).await.map_err(|e| ProviderError::Failed {
            reason: Reason::DaemonStartFailed,
            message: format!("cannot start the container of `{}`: {}", spec.id, engine_message(&e)),
        })?;
        tracing::debug!(sandbox = %spec.id, image = %spec.image, image_id = %plan.image_id, "container started");
        Ok(())
    }

    /// Pauses (`paused`) or unpauses the sandbox's container through the engine; one already
    /// so is fine (the engine's refusal, checked by an inspect).
    async fn set_paused(&self, id: &str, paused: bool) -> Result<(), ProviderError> {
        if check_id(id).is_err() {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let name = container_name(id);
        let done =
            if paused { self.docker.pause_container(&name).await } else { self.docker.unpause_container(&name).await };
        let what = if paused { "pause" } else { "unpause" };
        match done {
            Ok(()) => Ok(()),
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => {
                Err(ProviderError::NotFound(id.to_string()))
            }
            // "already paused" is a 409, "not paused" a 500 on some engines: the state decides.
            Err(e @ BollardError::DockerResponseServerError { .. }) => {
                let state = self.docker.inspect_container(&name, None).await.ok().and_then(|c| c.state);
                if state.and_then(|s| s.paused) == Some(paused) {
                    Ok(())
                } else {
                    Err(engine_error(&format!("cannot {what} container `{name}`"), e))
                }
            }
            Err(e) => Err(engine_error(&format!("cannot {what} container `{name}`"), e)),
        }
    }

    /// Force-removes the container; one that does not exist is fine.
    async fn remove_container(&self, id: &str) -> Result<(), ProviderError> {
        let name = container_name(id);
        let options = RemoveContainerOptions { force: true, v: true, link: false };
        match self.docker.remove_container(&name, Some(options)).await {
            Ok(()) | Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => Ok(()),
            // A removal is already under way (another delete): wait for it to finish.
            Err(BollardError::DockerResponseServerError { status_code: 409, .. }) => {
                let start = tokio::time::Instant::now();
                while start.elapsed() < REMOVAL_WAIT {
                    match self.docker.inspect_container(&name, None).await {
                        Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => return Ok(()),
                        _ => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
                Err(ProviderError::Backend(format!(
                    "container `{name}` is still there {} s after its removal began",
                    REMOVAL_WAIT.as_secs()
                )))
            }
            Err(e) => Err(engine_error(&format!("cannot remove container `{name}`"), e)),
        }
    }

    /// How a container that no longer runs ended: as the watcher recorded it, else from the engine.
    async fn ended(&self, id: &str, dir: &HostDir, spec: Option<&SandboxSpec>) -> Ended {
        let recorded = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || dir.read_ended()).await.ok().flatten()
        };
        if let Some(ended) = recorded {
            return ended;
        }
        let name = container_name(id);
        match self.docker.inspect_container(&name, None).await {
            Ok(c) => {
                let state = c.state.unwrap_or_default();
                let words = watch::last_words(&self.docker, &name, state.exit_code).await;
                container::ended_of(&state, spec, words)
            }
            Err(e) => Ended {
                reason: Reason::ProviderError,
                message: format!("daemon is not running ({})", engine_message(&e)),
            },
        }
    }
}

impl Drop for DockerProvider {
    fn drop(&mut self) {
        // The watcher stops; the containers run on until their lease or the next server's delete.
        self.cancel.cancel();
    }
}

impl Provider for DockerProvider {
    fn name(&self) -> &'static str {
        "docker"
    }

    fn isolation(&self) -> sandman_wire::server::Isolation {
        sandman_wire::server::Isolation::Container
    }

    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        self.refuse(spec).map(|_| ())
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Endpoint, ProviderError> {
        let limits = self.refuse(spec)?;
        let _creating = self.shared.creating.start(&spec.id)?;
        self.shared.forget(&spec.id);
        let dir = HostDir::new(&self.base, &spec.id);
        self.make(spec, limits, &dir).await?;
        Ok(Endpoint::Unix(dir.socket()))
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        if check_id(id).is_err() {
            // No such container or directory can exist.
            return Ok(());
        }
        lock(&self.shared.deleting).insert(id.to_string());
        let dir = HostDir::new(&self.base, id);
        let outcome = async {
            {
                let dir = dir.clone();
                let _ = tokio::task::spawn_blocking(move || dir.mark_deleting()).await;
            }
            self.remove_container(id).await?;
            records::remove_dir(&dir).await;
            if dir.root.exists() {
                return Err(ProviderError::Backend(format!("sandbox `{id}`: cannot remove `{}`", dir.root.display())));
            }
            Ok(())
        }
        .await;
        lock(&self.shared.deleting).remove(id);
        if outcome.is_ok() {
            self.shared.forget(id);
        }
        outcome
    }

    /// The engine's pause: its cgroup freezer freezes every process of the container.
    async fn pause(&self, id: &str) -> Result<(), ProviderError> {
        self.set_paused(id, true).await
    }

    async fn resume(&self, id: &str) -> Result<(), ProviderError> {
        self.set_paused(id, false).await
    }

    /// Every container with this provider's labels, with its spec from the labels and its token
    /// from the host directory. A container that no longer runs is reported ended (as its death
    /// was reported); one whose spec cannot be read is reported ended with a placeholder spec, so
    /// that the server removes it.
    async fn list(&self) -> Result<Vec<Record>, ProviderError> {
        let filters = std::collections::HashMap::from([(
            "label".to_string(),
            vec![format!("{MANAGED_BY}={MANAGED_BY_VALUE}"), format!("{OWNER_LABEL}={}", self.owner)],
        )]);
        let options = ListContainersOptions { all: true, filters: Some(filters), ..Default::default() };
        let found =
            self.docker.list_containers(Some(options)).await.map_err(|e| engine_error("cannot list containers", e))?;
        let creating = self.shared.creating.snapshot();
        let mut records = Vec::with_capacity(found.len());
        for summary in found {
            let labels = summary.labels.unwrap_or_default();
            let Some(id) = labels.get(SANDBOX_LABEL).cloned().filter(|id| check_id(id).is_ok()) else {
                tracing::warn!(container = ?summary.names, "a sandman container without a valid sandbox label; skipped");
                continue;
            };
            let dir = HostDir::new(&self.base, &id);
            let token = {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || dir.read_token())
                    .await
                    .map_err(std::io::Error::other)
                    .and_then(|r| r)
            };
            let endpoint = Endpoint::Unix(dir.socket());
            let parsed = token
                .map_err(|e| format!("cannot read its token `{}`: {e}", dir.token().display()))
                .and_then(|token| container::spec_from_labels(&labels, token));
            let spec = match parsed {
                Ok(spec) => spec,
                // Being made this very moment.
                Err(_) if creating.contains(&id) => continue,
                Err(why) => {
                    tracing::warn!(sandbox = %id, %why, "a sandbox container whose spec cannot be read; reported ended");
                    let ended =
                        Ended { reason: Reason::ProviderError, message: format!("unreadable sandbox record: {why}") };
                    let image = labels.get(IMAGE_LABEL).cloned().or(summary.image).unwrap_or_default();
                    records.push(Record {
                        spec: placeholder(&id, &image),
                        endpoint,
                        ended: Some(ended),
                        claim: None,
                        paused: false,
                        ready: None,
                    });
                    continue;
                }
            };
            let paused = summary.state == Some(ContainerSummaryStateEnum::PAUSED);
            let running = match summary.state {
                Some(ContainerSummaryStateEnum::RUNNING | ContainerSummaryStateEnum::PAUSED) => true,
                Some(ContainerSummaryStateEnum::CREATED) => creating.contains(&id),
                _ => false,
            };
            let ended = if running { None } else { Some(self.ended(&id, &dir, Some(&spec)).await) };
            records.push(Record { spec, endpoint, ended, claim: None, paused, ready: None });
        }
        Ok(records)
    }

    fn events(&self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    fn progress(&self) -> Option<mpsc::Receiver<Progress>> {
        self.progress_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Pulls `image` unless the engine has it (as `create` would).
    async fn prepare(
        &self,
        image: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> Result<Prepared, ProviderError> {
        let _ = progress;
        image::ensure(&self.docker, image, self.config.pull_stall, None).await?;
        Ok(Prepared { nodes_ready: 1, nodes_total: 1 })
    }

    /// From the container's `docker inspect`: the image ID it runs (and its image's repo digests),
    /// the limits, network mode and TZ/locale of its environment as the engine holds them.
    async fn applied(&self, id: &str) -> Result<Applied, ProviderError> {
        check_id(id).map_err(|_| ProviderError::NotFound(id.to_string()))?;
        let name = container_name(id);
        let found = match self.docker.inspect_container(&name, None).await {
            Ok(c) => c,
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => {
                return Err(ProviderError::NotFound(id.to_string()));
            }
            Err(e) => return Err(engine_error(&format!("cannot inspect container `{name}`"), e)),
        };
        // A container of that name made by another state directory is not this provider's.
        let labels = found.config.as_ref().and_then(|c| c.labels.as_ref());
        if labels.and_then(|l| l.get(OWNER_LABEL)) != Some(&self.owner) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        // The image may have been removed since (the container runs on): its digests are then unknown.
        let digests = match found.image.as_deref() {
            Some(image) => match self.docker.inspect_image(image).await {
                Ok(i) => i.repo_digests.unwrap_or_default(),
                Err(e) => {
                    tracing::debug!(sandbox = %id, image, err = %engine_message(&e), "cannot inspect a sandbox's image");
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        Ok(container::applied_of(&found, &digests, self.cgroup_version.as_deref()))
    }

    async fn snapshot(&self, id: &str, snapshot: &str) -> Result<sandman_provider::SnapshotMade, ProviderError> {
        self.take_snapshot(id, snapshot).await
    }

    async fn delete_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        self.remove_snapshot(snapshot).await
    }

    async fn export_snapshot(&self, snapshot: &str, reference: &str) -> Result<String, ProviderError> {
        self.push_snapshot(snapshot, reference).await
    }

    /// The configuration of the image the container was made from (by its ID): its `USER`,
    /// `WORKDIR`, `ENV`, entrypoint and command.
    async fn image_config(&self, id: &str) -> Result<Option<sandman_wire::server::ImageConfig>, ProviderError> {
        check_id(id).map_err(|_| ProviderError::NotFound(id.to_string()))?;
        let name = container_name(id);
        let found = match self.docker.inspect_container(&name, None).await {
            Ok(c) => c,
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => {
                return Err(ProviderError::NotFound(id.to_string()));
            }
            Err(e) => return Err(engine_error(&format!("cannot inspect container `{name}`"), e)),
        };
        let labels = found.config.as_ref().and_then(|c| c.labels.as_ref());
        if labels.and_then(|l| l.get(OWNER_LABEL)) != Some(&self.owner) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let Some(image) = found.image.as_deref() else { return Ok(None) };
        match self.docker.inspect_image(image).await {
            Ok(i) => Ok(i.config.map(|c| image::config_of(&c))),
            // Removed since (the container runs on): unknown, not an error.
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => Ok(None),
            Err(e) => Err(engine_error(&format!("cannot inspect image `{image}`"), e)),
        }
    }
}

/// The spec of a container whose own cannot be read: enough for the server to report and remove it.
fn placeholder(id: &str, image: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.to_string(),
        image: image.to_string(),
        resources: Resources::default(),
        env: Default::default(),
        labels: Default::default(),
        job: None,
        profile: Profile::Default,
        network: Default::default(),
        token: String::new(),
        daemon_lease_s: 0,
        created_at_ms: 0,
        server: Default::default(),
    }
}

/// A sandbox id names a container and a directory.
fn check_id(id: &str) -> Result<(), ProviderError> {
    records::check_id(id, "a container")
}

/// The engine's own words for a failure.
pub(crate) fn engine_message(e: &BollardError) -> String {
    match e {
        BollardError::DockerResponseServerError { message, .. } => message.trim().to_string(),
        BollardError::DockerStreamError { error } => error.trim().to_string(),
        other => chain(other),
    }
}

fn engine_error(what: &str, e: BollardError) -> ProviderError {
    ProviderError::Backend(format!("{what}: {}", engine_message(&e)))
}

/// An error and its causes on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

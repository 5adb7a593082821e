//! The process provider, Sandman's embedded default: each sandbox is a `sandmand` process with
//! its own directory under the server's state directory, reached over a Unix socket. Start at
//! [`ProcessProvider`]; the sandbox directory is described in `docs/process-provider.md`.
//!
//! Isolated (the default, [`Isolation::Full`], which needs root), every sandbox is a sandbox of
//! its own: the daemon starts in a cgroup made for it (pids always limited, cpu and memory when
//! asked), then assembles a private root (an overlay over the host's root with a writable layer
//! in memory, fresh `/proc`, `/sys` and `/dev`, the state directory and the server's binary
//! hidden) in new mount, pid, cgroup, ipc and uts namespaces (and net for `network: none` and
//! `eval`), and becomes root of a user namespace whose ids are an unprivileged host range of
//! its own ([`ids`]). Where the host cannot do that, the provider refuses to start; only
//! [`Isolation::None`], asked for by name, runs sandboxes as plain processes of the server's
//! user (rlimits for memory and file size, nothing else).

mod cgroup;
mod fork_server;
mod ids;
pub mod image;
mod layout;
pub use layout::{RECORDS_TMPFS, Records};
pub mod net;
mod procs;
pub mod room;
pub mod snapshot;
mod spawner;
mod sys;
mod template;
mod watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sandman_provider::records;
use sandman_provider::{
    Creating, EVENT_CAPACITY, Ended, Endpoint, NodeProgress, PROGRESS_CAPACITY, Prepared, Progress, Provider,
    ProviderError, ProviderEvent, Record, SandboxSpec, report_progress,
};
use sandman_wire::server::{Applied, ImageConfig, Network, Profile, Quantity, Reason, Resources};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::layout::SandboxDir;
use crate::procs::ProcId;
use crate::watch::Watch;

/// The only image this provider runs: the host itself.
pub const HOST_IMAGE: &str = "host";

/// The working directory and `HOME` of an isolated sandbox's commands: a directory of its own,
/// fresh and empty, at the path users of other sandbox services expect (E2B's).
pub const SANDBOX_HOME: &str = "/home/user";

/// PATH of an isolated sandbox, and of the daemon when the server has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long a delete waits for a create of the same sandbox to finish.
const CREATE_WAIT: Duration = Duration::from_secs(30);

/// How long a delete waits for a SIGKILLed daemon to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The pids limit of an eval sandbox that asks for none.
pub const EVAL_PIDS: u64 = 1024;

/// The environment every command of an eval sandbox has; a request may not set these otherwise.
pub const EVAL_ENV: [(&str, &str); 3] = [("TZ", "UTC"), ("LANG", "C.UTF-8"), ("LC_ALL", "C.UTF-8")];

/// How long a delete waits for a sandbox's cgroups to empty (tries 50 ms apart) before it kills
/// what is left in them, and then before it gives up.
const CGROUP_TRIES: u32 = 100;
const CGROUP_KILL_AFTER: u32 = 20;

/// How sandboxes are kept apart from the host and from each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Isolation {
    /// A sandbox of its own for each (see the module's documentation); the provider refuses to
    /// start where the host cannot give it.
    #[default]
    Full,
    /// Plain processes of the server's user: no namespaces, no cgroups, the host's file system.
    /// Only for a trusted laptop or a host without user namespaces, and only when asked by name
    /// (`sandman serve --isolation none`); `network: none` and `eval` are refused.
    None,
}

impl Isolation {
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Full => "full",
            Isolation::None => "none",
        }
    }
}

/// The pids limit of a sandbox (default profile) that asks for none.
pub const DEFAULT_PIDS: u64 = 4096;

/// What the provider needs to start.
#[derive(Debug, Clone)]
pub struct ProcessConfig {
    /// The server's state directory; sandboxes live in `state_dir/sandboxes/<id>/`.
    pub state_dir: PathBuf,
    /// The `sandmand` binary (see [`find_daemon`]).
    pub daemon_bin: PathBuf,
    /// Arguments before the daemon's own, when `daemon_bin` is a binary that embeds the daemon
    /// behind a first argument (`sandman __sandmand …`).
    pub daemon_args: Vec<OsString>,
    pub isolation: Isolation,
    /// More host paths isolated sandboxes must not see, beyond the state directory and the
    /// daemon's binary (the server's own binary, its token file when elsewhere).
    pub hide: Vec<PathBuf>,
    /// The sandboxes' networks: their addresses, what they may reach beyond what is refused by
    /// default, their resolvers ([`net`]). Isolated only.
    pub network: net::NetConfig,
    /// What a create that names no `memory` or `disk` gets ([`Provider::defaults`]).
    pub defaults: Resources,
    /// Admission against the machine's memory ([`room`]); `None`: every create goes through.
    pub capacity: Option<Capacity>,
    /// The image store of task images (its root `<state_dir>/images`, its bound, registries);
    /// isolated only: without isolation the provider runs only `host`.
    pub images: Option<sandman_image::StoreConfig>,
}

/// How creates are admitted against the machine's memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// The machine's memory times this is what sandboxes may reserve (their memory limits).
    pub overcommit: f64,
    /// How long a create may wait for memory before it fails `resource_exhausted`.
    pub wait: Duration,
}

/// How a daemon is to be started: its arguments, its own environment, the commands' environment
/// (written to its `env.json`, never the daemon's own), its cgroups and its id range.
#[derive(Debug)]
struct Plan {
    args: Vec<OsString>,
    env: BTreeMap<OsString, OsString>,
    commands_env: BTreeMap<String, String>,
    cgroups: Option<Cgroups>,
    /// The host id of the sandbox's root (isolated only).
    ids: Option<u32>,
}

/// A sandbox's cgroups (`<own>/sandman-<id>`) and what they hold it to.
#[derive(Debug, Clone)]
struct Cgroups {
    dirs: cgroup::Dirs,
    limits: cgroup::Limits,
}

/// A daemon this provider instance watches.
#[derive(Debug, Clone)]
struct Watched {
    daemon: ProcId,
    /// Readable once the daemon has exited; a delete awaits it.
    pidfd: Arc<AsyncFd<OwnedFd>>,
    /// Shared with the daemon's watcher: set before a delete kills it.
    deleting: Arc<AtomicBool>,
}

/// The process provider. Its state of record is the state directory: a second instance on the
/// same directory (a restarted server) finds every sandbox with [`Provider::list`], which also
/// adopts the running daemons it finds so that their deaths are reported as events.
#[derive(Debug)]
pub struct ProcessProvider {
    config: ProcessConfig,
    sandboxes: PathBuf,
    /// Where the sandboxes' directories are kept (isolated: in memory when it can).
    kept: Records,
    /// The server's own cgroups, under which each isolated sandbox gets its own; `None` without
    /// isolation.
    cgroups: Option<cgroup::Dirs>,
    /// The host id ranges of isolated sandboxes (the host's registry behind them); `None` without
    /// isolation.
    ids: Option<ids::IdRanges>,
    /// The host's side of isolated sandboxes' networks; `None` without isolation.
    net: Option<net::HostNetwork>,
    /// The machine's memory as sandboxes reserve it; `None` without admission.
    room: Option<room::Room>,
    /// What no isolated sandbox may see ([`hidden`]), resolved once.
    hidden: Vec<PathBuf>,
    /// Task images, the store opened at the first image asked for (a server that runs only
    /// `host` never takes its lock); `None` without isolation (or a store): `host` only.
    images: Option<image::LazyImages>,
    /// The images of creates that have resolved theirs but not yet recorded it: a prune
    /// spares them. Locked briefly, never across an await.
    resolved: Mutex<HashMap<String, String>>,
    /// Progress of creates that wait for memory, for the server; lossy.
    progress_tx: mpsc::Sender<Progress>,
    /// Handed to the server once.
    progress_rx: Mutex<Option<mpsc::Receiver<Progress>>>,
    /// Daemons whose exit a watcher of this instance awaits, by sandbox id. Locked briefly, never
    /// across an await.
    watched: Mutex<HashMap<String, Watched>>,
    /// Sandboxes whose create is under way: `list` reports them running before their daemon's pid
    /// is written, and does not try to adopt them.
    creating: Creating,
    events_tx: mpsc::Sender<ProviderEvent>,
    /// Handed to the server once.
    events_rx: Mutex<Option<mpsc::Receiver<ProviderEvent>>>,
    /// Where daemons are started from: a thread whose descriptor table does not grow with the
    /// sandboxes, so that a spawn costs the same at the first sandbox and the ten-thousandth.
    spawner: spawner::Spawner,
    /// The mount namespace isolated sandboxes' are copies of (isolated only): held for the
    /// provider's life, so that no daemon's start pays for a `pivot_root` (`template.rs`).
    /// Locked briefly (made again, rarely, under it), never across an await.
    template: Option<Mutex<template::Template>>,
    /// The watcher tasks; cancelled on shutdown (the daemons keep running for the next server).
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl ProcessProvider {
    /// Checks the daemon binary, makes `state_dir/sandboxes/`, and, isolated, that this host can
    /// isolate: root, a writable cgroup per controller, and a real trial of the daemon's
    /// isolation. Fails, naming what is missing, when it cannot.
    pub fn new(config: ProcessConfig) -> Result<Self, ProviderError> {
        if !config.daemon_bin.is_file() {
            return Err(ProviderError::io(
                format!("cannot use `{}` as the sandbox daemon", config.daemon_bin.display()),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no such file (set SANDMAN_DAEMON or put sandmand on PATH)",
                ),
            ));
        }
        let sandboxes = config.state_dir.join("sandboxes");
        std::fs::create_dir_all(&sandboxes)
            .map_err(|e| ProviderError::io(format!("cannot create `{}`", sandboxes.display()), e))?;
        let mut template = None;
        let mut kept = Records::Disk;
        let mut ranges = None;
        let mut network = None;
        let mut images = None;
        let cgroups = match config.isolation {
            Isolation::None => {
                tracing::warn!(
                    state = %config.state_dir.display(),
                    "process provider: isolation is off (--isolation none): sandboxes are plain processes of this user, with the host's file system"
                );
                None
            }
            Isolation::Full => {
                let cannot = |why: String| {
                    ProviderError::Unsupported(format!(
                        "this host cannot isolate sandboxes: {why}; pass --isolation none to run them as plain processes (trusted code only)"
                    ))
                };
                if sys::euid() != 0 {
                    return Err(cannot("isolation needs root (user namespaces with a range of host ids, cgroups, mounts), and the server is not root".into()));
                }
                kept = layout::keep_in_memory(&sandboxes);
                let self_cgroup = std::fs::read_to_string("/proc/self/cgroup")
                    .map_err(|e| ProviderError::io("cannot read /proc/self/cgroup", e))?;
                let own = cgroup::Dirs::own(&self_cgroup, Path::new(cgroup::MOUNT))
                    .map_err(|why| cannot(format!("each sandbox needs cgroups of its own: {why}")))?;
                let registry =
                    ids::Registry::open(Path::new(ids::REGISTRY_DIR), &resolve(&config.state_dir)).map_err(|e| {
                        ProviderError::io(format!("cannot open the host's id registry `{}`", ids::REGISTRY_DIR), e)
                    })?;
                ranges = Some(ids::IdRanges::recover(registry, &layout::taken_slots(&sandboxes)).map_err(|e| {
                    ProviderError::io(
                        format!("cannot bring the host's id registry `{}` up to date", ids::REGISTRY_DIR),
                        e,
                    )
                })?);
                let made = template::Template::start(
                    &config.daemon_bin,
                    &config.daemon_args,
                    &config.state_dir.join("isolation-template"),
                )
                .map_err(|e| cannot(format!("cannot make the mount namespace sandboxes copy: {e}")))?;
                check_isolation(&config, made.ns()).map_err(cannot)?;
                network = Some(
                    net::HostNetwork::setup(&config.network, &resolve(&config.state_dir), ids::SLOTS)
                        .map_err(|why| cannot(format!("cannot give sandboxes networks of their own: {why}")))?,
                );
                if let Some(store) = &config.images {
                    images = Some(image::LazyImages::new(store.clone()));
                }
                template = Some(Mutex::new(made));
                tracing::info!(state = %config.state_dir.display(), "process provider: every sandbox is isolated (user namespace, private root, cgroups)");
                Some(own)
            }
        };
        let spawner = spawner::Spawner::start()
            .map_err(|e| ProviderError::io("cannot start the thread that starts daemons (unshare(CLONE_FILES))", e))?;
        let (events_tx, events_rx) = mpsc::channel(EVENT_CAPACITY);
        let (progress_tx, progress_rx) = mpsc::channel(PROGRESS_CAPACITY);
        let room = match config.capacity {
            Some(c) => Some(
                room::Room::of_machine(c.overcommit)
                    .map_err(|e| ProviderError::io("cannot read the machine's memory", e))?,
            ),
            None => None,
        };
        Ok(ProcessProvider {
            hidden: hidden(&config),
            template,
            spawner,
            config,
            sandboxes,
            kept,
            cgroups,
            ids: ranges,
            net: network,
            watched: Mutex::default(),
            creating: Creating::default(),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
            room,
            images,
            resolved: Mutex::default(),
            progress_tx,
            progress_rx: Mutex::new(Some(progress_rx)),
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
        })
    }

    /// The image store (`GET /v1/images`): each image with how many sandboxes run it, the
    /// store's size and its bound. Unsupported without one (isolation off).
    pub async fn images(&self) -> Result<sandman_wire::server::ImageList, ProviderError> {
        let (images, in_use) = self.store_and_use().await?;
        let store = images.store();
        let list = store
            .list()
            .into_iter()
            .map(|i| sandman_wire::server::StoredImage {
                sandboxes: in_use.count(&i.id) as u64,
                id: i.id,
                manifest_digest: i.manifest_digest,
                references: i.references,
                size: i.size,
                layers: i.layers as u64,
                last_used_ms: i
                    .last_used
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
            })
            .collect();
        let max_size = self.config.images.as_ref().and_then(|c| c.max_size);
        Ok(sandman_wire::server::ImageList { images: list, size: store.size(), max_size })
    }

    /// Removes an image no sandbox runs (by reference, id, or 12+ hex digits of it): one that
    /// other references still name is only untagged.
    pub async fn remove_image(&self, what: &str) -> Result<sandman_wire::server::ImagesRemoved, ProviderError> {
        let (images, in_use) = self.store_and_use().await?;
        let (store, what) = (images.clone(), what.to_string());
        let removed = tokio::task::spawn_blocking(move || store.store().remove(&what, &in_use))
            .await
            .map_err(|e| ProviderError::io("cannot remove an image", std::io::Error::other(e)))?
            .map_err(image_error)?;
        Ok(match removed {
            sandman_image::Removed::Untagged { reference } => {
                sandman_wire::server::ImagesRemoved { untagged: Some(reference), ..Default::default() }
            }
            sandman_image::Removed::Deleted { id, freed } => {
                sandman_wire::server::ImagesRemoved { images: vec![id], untagged: None, freed }
            }
        })
    }

    /// Removes every image no sandbox runs (as `docker image prune -a`), with the layers no
    /// other image keeps. The store's own pruning, after each pull, stops at its bound instead.
    pub async fn prune_images(&self) -> Result<sandman_wire::server::ImagesRemoved, ProviderError> {
        let (images, in_use) = self.store_and_use().await?;
        let store = images.clone();
        tokio::task::spawn_blocking(move || {
            let mut removed = sandman_wire::server::ImagesRemoved::default();
            for image in store.store().list().into_iter().filter(|i| in_use.count(&i.id) == 0) {
                match store.store().remove(&image.id, &in_use) {
                    Ok(sandman_image::Removed::Deleted { id, freed }) => {
                        removed.images.push(id);
                        removed.freed += freed;
                    }
                    Ok(sandman_image::Removed::Untagged { .. }) => {}
                    // Taken by a create meanwhile, or gone already: not this prune's.
                    Err(sandman_image::ImageError::InUse { .. } | sandman_image::ImageError::NotInStore(_)) => {}
                    Err(e) => return Err(image_error(e)),
                }
            }
            Ok(removed)
        })
        .await
        .map_err(|e| ProviderError::io("cannot prune the image store", std::io::Error::other(e)))?
    }

    /// The store, and the images the sandboxes (and creates under way) run.
    async fn store_and_use(&self) -> Result<(image::Images, sandman_image::InUse), ProviderError> {
        let Some(lazy) = &self.images else {
            return Err(ProviderError::Unsupported(
                "this server runs no image store: the process provider's isolation is off (--isolation none)".into(),
            ));
        };
        let images = lazy.get().await?.clone();
        let creating: Vec<String> =
            self.resolved.lock().unwrap_or_else(PoisonError::into_inner).values().cloned().collect();
        let sandboxes = self.sandboxes.clone();
        let in_use = tokio::task::spawn_blocking(move || image::in_use(&sandboxes, &creating))
            .await
            .map_err(|e| ProviderError::io("cannot read the sandboxes' images", std::io::Error::other(e)))?;
        Ok((images, in_use))
    }

    /// How this provider's sandboxes are isolated.
    pub fn isolation_mode(&self) -> Isolation {
        self.config.isolation
    }

    /// The directory of sandbox `id`.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes.join(id)
    }

    /// Stops watching (the daemons keep running, for the next server to adopt) and waits for the
    /// watchers to end.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        if self.kept == Records::Tmpfs {
            let sandboxes = self.sandboxes.clone();
            let _ = tokio::task::spawn_blocking(move || layout::release_records(&sandboxes)).await;
        }
    }

    /// Where the sandboxes' directories are kept.
    pub fn records(&self) -> Records {
        self.kept
    }

    /// Checks the spec; touches nothing. Refuses what this provider cannot honour, before anything
    /// is made; isolated, answers with the cgroups to make.
    fn refuse(&self, spec: &SandboxSpec) -> Result<Option<Cgroups>, ProviderError> {
        check_id(&spec.id)?;
        if spec.image != HOST_IMAGE {
            if self.images.is_none() {
                return Err(ProviderError::Unsupported(format!(
                    "image `{}` needs isolation (its layers are a sandbox's root in a user namespace of its own), and the process provider's isolation is off (--isolation none): it runs only `{HOST_IMAGE}`",
                    spec.image
                )));
            }
            image::Images::check(&spec.image)?;
        }
        if spec.profile == Profile::Eval {
            return self.refuse_eval(spec).map(Some);
        }
        let Some(own) = &self.cgroups else {
            if spec.network == Network::None {
                return Err(ProviderError::Unsupported(
                    "network: none needs a network namespace, and the process provider's isolation is off (--isolation none)"
                        .into(),
                ));
            }
            return Ok(None);
        };
        let cpu = match &spec.resources.cpu {
            None => None,
            Some(q) => Some(cores_of(q)?),
        };
        let memory = bytes_of("memory", spec.resources.memory.as_ref())?;
        let pids = spec.resources.pids.unwrap_or(DEFAULT_PIDS);
        if pids == 0 {
            return Err(ProviderError::Unsupported("resources.pids must be at least 1".into()));
        }
        let limits = cgroup::Limits { cpu, memory, no_swap: false, pids };
        Ok(Some(Cgroups { dirs: own.child(&spec.id, &limits), limits }))
    }

    /// What eval needs, each refusal naming what is missing: fixed cpu and memory in the spec, the
    /// fixed environment not overridden, isolation (for a network namespace with only loopback
    /// and cgroups), and a way to hold swap to nothing.
    fn refuse_eval(&self, spec: &SandboxSpec) -> Result<Cgroups, ProviderError> {
        let refuse = |why: String| ProviderError::Unsupported(format!("eval on the process provider {why}"));
        let cpu = match &spec.resources.cpu {
            None => return Err(refuse("needs resources.cpu: eval fixes the cpu a sandbox gets".into())),
            Some(q) => cores_of(q)?,
        };
        let Some(memory) = bytes_of("memory", spec.resources.memory.as_ref())? else {
            return Err(refuse("needs resources.memory: eval fixes the memory a sandbox gets".into()));
        };
        let pids = spec.resources.pids.unwrap_or(EVAL_PIDS);
        if pids == 0 {
            return Err(refuse("needs resources.pids of at least 1".into()));
        }
        let overridden: Vec<String> = EVAL_ENV
            .iter()
            .filter(|(k, v)| spec.env.get(*k).is_some_and(|set| set != v))
            .map(|(k, v)| format!("{k} (eval fixes it to {v})"))
            .collect();
        if !overridden.is_empty() {
            return Err(refuse(format!("cannot set {} in env", overridden.join(", "))));
        }
        let Some(own) = &self.cgroups else {
            return Err(refuse(
                "needs isolation (a network namespace with only loopback, cgroups of its own), and the process provider's isolation is off (--isolation none)"
                    .into(),
            ));
        };
        // Unknown counts as swap being there.
        if cgroup::host_swap().is_none_or(|swap| swap > 0) && !own.accounts_swap() {
            return Err(refuse(format!(
                "cannot hold swap to nothing beyond memory: the host has swap, and the memory cgroup `{}` does not account it (boot with swapaccount=1, or turn swap off)",
                own.memory.as_deref().unwrap_or(Path::new("")).display()
            )));
        }
        let limits = cgroup::Limits { cpu: Some(cpu), memory: Some(memory), no_swap: true, pids };
        Ok(Cgroups { dirs: own.child(&spec.id, &limits), limits })
    }

    /// Settles the daemon's command line and environments; touches nothing. `ids` is the host
    /// id of an isolated sandbox's root.
    fn plan(
        &self,
        spec: &SandboxSpec,
        dir: &SandboxDir,
        slot: Option<u32>,
        image: Option<&image::SandboxImage>,
    ) -> Result<Plan, ProviderError> {
        let ids = slot.map(ids::base_of);
        let cgroups = self.refuse(spec)?;
        let socket = dir.socket();
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(ProviderError::Unsupported(format!(
                "the daemon's socket path `{}` is longer than the {MAX_SOCKET_PATH} bytes a Unix socket allows; use a shorter state directory",
                socket.display()
            )));
        }

        let mut args: Vec<OsString> = Vec::new();
        let mut arg = |flag: &str, value: OsString| {
            args.push(flag.into());
            args.push(value);
        };
        let mut listen = OsString::from("unix:");
        listen.push(&socket);
        arg("--listen", listen);
        arg("--token-file", dir.token().into());
        // Isolated, a path inside the sandbox, which shows nothing of the host's: the image's, or
        // for `host` the sandbox's own home.
        let workdir = match (ids, image) {
            (Some(_), Some(image)) => image.workdir(),
            (Some(_), None) => PathBuf::from(SANDBOX_HOME),
            (None, _) => dir.work(),
        };
        arg("--workdir", workdir.into());
        arg("--exit-file", dir.exit_file().into());
        arg("--env-file", dir.env_file().into());
        if spec.daemon_lease_s > 0 {
            arg("--lease", format!("{}s", spec.daemon_lease_s).into());
        }
        let rlimits = rlimits_of(spec, self.config.isolation)?;
        if let Some(bytes) = rlimits.address_space {
            arg("--rlimit-as", bytes.to_string().into());
        }
        if let Some(bytes) = rlimits.file_size {
            arg("--rlimit-fsize", bytes.to_string().into());
            arg("--disk-limit", bytes.to_string().into());
        }
        for cgroup in cgroups.iter().flat_map(|c| c.dirs.unique()) {
            arg("--cgroup", cgroup.into());
        }
        if let Some(ids) = ids {
            arg("--isolate-ids", ids.to_string().into());
            arg("--isolate-root", dir.rootfs().into());
            if let Some(template) = &self.template {
                let mut template = template.lock().unwrap_or_else(PoisonError::into_inner);
                let ns = template.current().map_err(|e| {
                    ProviderError::io("cannot make again the mount namespace sandboxes copy (its process died)", e)
                })?;
                arg("--isolate-template", ns.into());
            }
            if let Some(bytes) = bytes_of("disk", spec.resources.disk.as_ref())? {
                arg("--isolate-layer-bytes", bytes.to_string().into());
            }
            for hidden in &self.hidden {
                arg("--isolate-hide", hidden.into());
            }
            for lower in image.iter().flat_map(|i| i.lowerdirs()) {
                arg("--isolate-lower", lower.into());
            }
            // A sandbox of an image is a machine of its own, named by its id, as a container is
            // by its; `host` keeps this machine's name, which this machine's /etc/hosts knows.
            if image.is_some() {
                arg("--isolate-hostname", hostname_of(&spec.id).into());
            }
            // A network namespace of its own always; with a way out for `egress`.
            if let (Some(net), Some(slot), false) = (&self.net, slot, loopback_only(spec)) {
                arg("--isolate-veth", net::HostNetwork::veth(slot).into());
                arg("--isolate-addr", net.addr(slot).to_string().into());
                arg("--isolate-group", net.group.to_string().into());
                for server in net.dns() {
                    arg("--isolate-dns", server.to_string().into());
                }
            }
            args.push("--isolate".into());
            args.push("--isolate-net".into());
        }
        let env = daemon_env(spec, dir, ids.is_some(), image);
        let commands_env = commands_env(spec, image)?;
        Ok(Plan { args, env, commands_env, cgroups, ids })
    }

    /// Starts the daemon of a prepared directory (from the spawner thread) and its watcher.
    async fn start(&self, spec: &SandboxSpec, dir: &SandboxDir, plan: Plan) -> Result<(), ProviderError> {
        let Plan { args, env, ids, .. } = plan;
        // Isolated, the daemon enters no host directory but the sandbox's own (its waiter stays
        // there); without isolation, the commands' working directory.
        let cwd = if ids.is_some() { dir.root.clone() } else { dir.work() };
        let (bin, daemon_args, log) = (self.config.daemon_bin.clone(), self.config.daemon_args.clone(), dir.log());
        let start_failed = |what: String| ProviderError::Failed { reason: Reason::DaemonStartFailed, message: what };
        // Isolated, through the fork server (`fork_server.rs`): a fork of a daemon already past
        // its start-up, instead of an exec of the binary per sandbox.
        let forked = ids.is_some();
        // A std child, dropped at once (that neither kills nor reaps it): tokio's would keep a
        // pidfd of its own beside the one the watcher waits on, and at tens of thousands of
        // sandboxes every descriptor per sandbox counts. Everything the spawn opens (the log,
        // /dev/null) is opened and closed on the spawner thread.
        let spawned = self
            .spawner
            .run(move || {
                use std::os::fd::AsFd;
                use std::os::unix::fs::OpenOptionsExt;
                use std::os::unix::process::CommandExt;
                let log = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(&log)?;
                if forked {
                    let req = sandman_wire::fork_server::ForkRequest {
                        cwd: cwd.clone(),
                        argv: std::iter::once(bin.clone().into_os_string())
                            .chain(daemon_args.iter().cloned())
                            .chain(args.iter().cloned())
                            .collect(),
                        dispatch: daemon_args.len(),
                        env: env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                    };
                    if let Some(started) = fork_server::start_daemon(&bin, &daemon_args, &req, log.as_fd()) {
                        return started.map(|pid| pid as u32);
                    }
                    // No fork server on this kernel: executed, as without isolation.
                }
                std::process::Command::new(&bin)
                    .args(&daemon_args)
                    .args(&args)
                    .env_clear()
                    .envs(&env)
                    .current_dir(cwd)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(log)
                    // Its own group: a ^C or SIGTERM to the server's group does not reach it.
                    .process_group(0)
                    .spawn()
                    .map(|child| child.id())
            })
            .await
            .and_then(|spawned| spawned);
        let child = spawned.map_err(|e| {
            exhausted(&e).unwrap_or_else(|| {
                start_failed(format!("cannot start the daemon `{}`: {e}", self.config.daemon_bin.display()))
            })
        })?;
        // Not reaped: the watcher reaps it through `pid`.
        let pid = child as i32;
        // Not yet reaped (only the watcher reaps it), so neither the pid nor /proc entry can name
        // another process yet.
        let watched = ProcId::of(pid)
            .ok_or_else(|| std::io::Error::other("no /proc entry"))
            .and_then(|daemon| Ok((daemon, sys::async_pidfd(pid)?)));
        let (daemon, pidfd) = match watched {
            Ok(w) => w,
            Err(e) => {
                let _ = sys::kill(pid, sys::SIGKILL, true);
                return Err(exhausted(&e).unwrap_or_else(|| {
                    start_failed(format!("cannot watch the daemon (pid {pid}; pidfd needs Linux 5.3): {e}"))
                }));
            }
        };
        let pid_written = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || dir.write_pid(daemon)).await
        };
        if let Err(e) = flatten(pid_written) {
            let _ = sys::kill(pid, sys::SIGKILL, true);
            return Err(ProviderError::io(format!("cannot write `{}`", dir.pid_file().display()), e));
        }
        let deleting = Arc::new(AtomicBool::new(false));
        let pidfd = Arc::new(pidfd);
        self.lock_watched()
            .insert(spec.id.clone(), Watched { daemon, pidfd: pidfd.clone(), deleting: deleting.clone() });
        let watch = self.watch(spec, dir, deleting);
        self.tasks.spawn(watch.child(pid, pidfd));
        tracing::debug!(sandbox = %spec.id, pid, "daemon started");
        Ok(())
    }

    fn watch(&self, spec: &SandboxSpec, dir: &SandboxDir, deleting: Arc<AtomicBool>) -> Watch {
        Watch {
            id: spec.id.clone(),
            dir: dir.clone(),
            daemon_lease_s: spec.daemon_lease_s,
            deleting,
            events: self.events_tx.clone(),
            cancel: self.cancel.clone(),
        }
    }

    /// Watches a running daemon an earlier server started. Returns false when the process at the
    /// recorded pid turns out not to be it.
    fn adopt(&self, spec: &SandboxSpec, daemon: ProcId) -> bool {
        let dir = SandboxDir::new(&self.sandboxes, &spec.id);
        let Ok(pidfd) = sys::async_pidfd(daemon.pid) else { return false };
        // Checked after opening: the pidfd now pins one process, and this says it is ours.
        if !daemon.is_running() {
            return false;
        }
        let pidfd = Arc::new(pidfd);
        let deleting = Arc::new(AtomicBool::new(false));
        {
            let mut watched = self.lock_watched();
            if watched.contains_key(&spec.id) {
                return true;
            }
            watched.insert(spec.id.clone(), Watched { daemon, pidfd: pidfd.clone(), deleting: deleting.clone() });
        }
        tracing::info!(sandbox = %spec.id, pid = daemon.pid, "watching a daemon started by an earlier server");
        self.tasks.spawn(self.watch(spec, &dir, deleting).pidfd(pidfd));
        true
    }

    fn lock_watched(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watched>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for memory for `spec` (its `resources.memory`), when creates are admitted against
    /// the machine's, telling the server where it waits; a create that can never fit, or waits
    /// too long, fails `resource_exhausted`. Answers the reservation, which a failed create gives
    /// back.
    async fn admit<'a>(&'a self, spec: &'a SandboxSpec) -> Result<Option<Reserved<'a>>, ProviderError> {
        let (Some(room), Some(capacity)) = (&self.room, &self.config.capacity) else { return Ok(None) };
        let ask = bytes_of("memory", spec.resources.memory.as_ref())?.unwrap_or(0);
        let deadline = tokio::time::Instant::now() + capacity.wait;
        room.admit(&spec.id, ask, deadline, |w| {
            tracing::info!(sandbox = %spec.id, "{w}");
            report_progress(&self.progress_tx, &spec.id, w.to_string());
        })
        .await
        .map_err(|e| ProviderError::Failed { reason: Reason::ResourceExhausted, message: e.to_string() })?;
        Ok(Some(Reserved { room, id: &spec.id, kept: false }))
    }

    /// The image `spec` names, pulled or imported when the store has none; `None` for `host`.
    /// After a pull, the store is pruned to its bound, sparing every image a sandbox runs or a
    /// create under way has resolved.
    async fn resolve_image(&self, spec: &SandboxSpec) -> Result<Option<image::SandboxImage>, ProviderError> {
        let Some(images) = self.images.as_ref().filter(|_| spec.image != HOST_IMAGE) else { return Ok(None) };
        let images = images.get().await?;
        // A snapshot's image is in the store or nowhere: nothing is pulled for it.
        let snapshot = snapshot::store_reference(&spec.image);
        if let Some(reference) = &snapshot
            && images.store().find(reference).is_none()
        {
            return Err(ProviderError::Failed {
                reason: Reason::ImagePullFailed,
                message: format!("`{}`: no such snapshot in the image store", spec.image),
            });
        }
        let reference = snapshot.map_or_else(|| spec.image.clone(), |r| format!("docker://{r}"));
        let (resolved, pulled) = images.resolve(&spec.id, &reference, &self.progress_tx).await?;
        if pulled {
            let (images, sandboxes) = (images.clone(), self.sandboxes.clone());
            let creating: Vec<String> = {
                let mut r = self.resolved.lock().unwrap_or_else(PoisonError::into_inner);
                r.insert(spec.id.clone(), resolved.id.clone());
                r.values().cloned().collect()
            };
            self.tasks.spawn_blocking(move || images.prune(&image::in_use(&sandboxes, &creating)));
        }
        Ok(Some(resolved))
    }

    /// Gives back the id range whose root is `base` (a sandbox's `ids`).
    fn free_ids(&self, base: Option<u32>) {
        if let (Some(ranges), Some(slot)) = (&self.ids, base.and_then(ids::slot_of)) {
            ranges.free(slot);
        }
    }

    /// Removes what a killed server left of a sandbox it never finished making: whatever runs in
    /// its cgroups, the cgroups, the directory, its id range.
    async fn purge(&self, dir: &SandboxDir) -> Result<(), ProviderError> {
        let (cgroups, ids) = {
            let dir = dir.clone();
            flatten(tokio::task::spawn_blocking(move || Ok((dir.read_cgroups(), dir.read_ids()))).await)
                .map_err(|e| ProviderError::io("cannot read an unfinished sandbox", e))?
        };
        if let Some(dirs) = &cgroups {
            remove_cgroups(dirs)
                .await
                .map_err(|e| ProviderError::io(format!("cannot remove the cgroups of `{}`", dir.root.display()), e))?;
        }
        records::remove_dir(dir).await;
        self.free_ids(ids);
        Ok(())
    }
}

/// A sandbox's hostname: its id as one DNS label spells it (what else an id may hold, `_` and
/// `.`, as `-`; at most 63 characters).
fn hostname_of(id: &str) -> String {
    let label: String = id.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).take(63).collect();
    let label = label.trim_matches('-');
    if label.is_empty() { "sandbox".to_string() } else { label.to_string() }
}

/// An image store's refusal: what is in use or unknown is the caller's to fix.
fn image_error(e: sandman_image::ImageError) -> ProviderError {
    match e {
        sandman_image::ImageError::NotInStore { .. } => ProviderError::NotFound(e.to_string()),
        sandman_image::ImageError::InUse { .. } => ProviderError::Claimed(e.to_string()),
        other => ProviderError::Unsupported(other.to_string()),
    }
}

/// A create stopped by a limit of the server or the machine, as `resource_exhausted` naming
/// that limit; `None` for any other failure.
fn exhausted(err: &std::io::Error) -> Option<ProviderError> {
    let limit = match err.raw_os_error()? {
        libc::EMFILE => format!("the server's open files limit (RLIMIT_NOFILE, {})", sys::open_files_limit()),
        libc::ENFILE => "the system's open files limit (fs.file-max)".to_string(),
        libc::EAGAIN => {
            "the kernel's limits on processes (kernel.pid_max, kernel.threads-max, RLIMIT_NPROC)".to_string()
        }
        _ => return None,
    };
    Some(ProviderError::Failed {
        reason: Reason::ResourceExhausted,
        message: format!("cannot hold one more sandbox: {limit} is reached ({err})"),
    })
}

/// A create's resolved image, spared by prunes until the create has recorded it (or failed).
struct Resolved<'a> {
    resolved: &'a Mutex<HashMap<String, String>>,
    id: String,
}

impl<'a> Resolved<'a> {
    fn new(resolved: &'a Mutex<HashMap<String, String>>, id: &str, image: &str) -> Self {
        resolved.lock().unwrap_or_else(PoisonError::into_inner).insert(id.to_string(), image.to_string());
        Resolved { resolved, id: id.to_string() }
    }
}

impl Drop for Resolved<'_> {
    fn drop(&mut self) {
        self.resolved.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

/// A create's memory reservation: given back when the create fails (dropped), kept once it
/// succeeds, until the sandbox's delete.
struct Reserved<'a> {
    room: &'a room::Room,
    id: &'a str,
    kept: bool,
}

impl Reserved<'_> {
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.room.release(self.id);
        }
    }
}

impl Drop for ProcessProvider {
    fn drop(&mut self) {
        // Watchers stop; the daemons run on until their lease or the next server's delete.
        self.cancel.cancel();
        // With no sandbox left, the tmpfs their directories were on is given back, as at
        // `shutdown`.
        if self.kept == Records::Tmpfs {
            layout::release_records(&self.sandboxes);
        }
    }
}

impl Provider for ProcessProvider {
    fn name(&self) -> &'static str {
        "process"
    }

    fn isolation(&self) -> sandman_wire::server::Isolation {
        match self.config.isolation {
            Isolation::Full => sandman_wire::server::Isolation::UserNamespace,
            Isolation::None => sandman_wire::server::Isolation::None,
        }
    }

    fn defaults(&self) -> Resources {
        match self.config.isolation {
            Isolation::Full => self.config.defaults.clone(),
            // Without cgroups memory could only be `RLIMIT_AS`, per process: a default of that
            // would stop runtimes that reserve more address space than they use (a JVM asks for
            // 1 GiB of class space at start) in every create that names no memory.
            Isolation::None => Resources { disk: self.config.defaults.disk.clone(), ..Resources::default() },
        }
    }

    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        self.refuse(spec).map(|_| ())
    }

    fn progress(&self) -> Option<mpsc::Receiver<Progress>> {
        self.progress_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    async fn prepare(
        &self,
        image: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> Result<Prepared, ProviderError> {
        match self.images.as_ref().filter(|_| image != HOST_IMAGE) {
            Some(images) => images.get().await?.prepare(image, progress).await?,
            None => {
                let _ = progress.send(NodeProgress {
                    node: "localhost".into(),
                    state: sandman_provider::NodeState::Ready,
                    message: format!("`{image}` is this host's own root"),
                    nodes_total: 1,
                });
            }
        }
        Ok(Prepared { nodes_ready: 1, nodes_total: 1 })
    }

    /// The image's configuration, as the sandbox's directory recorded it; none for `host`.
    async fn image_config(&self, id: &str) -> Result<Option<ImageConfig>, ProviderError> {
        if check_id(id).is_err() {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let dir = SandboxDir::new(&self.sandboxes, id);
        let image = tokio::task::spawn_blocking(move || dir.read_image())
            .await
            .map_err(|e| ProviderError::io("cannot read a sandbox's image", std::io::Error::other(e)))?;
        Ok(image.map(|i| i.config))
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Endpoint, ProviderError> {
        let dir = SandboxDir::new(&self.sandboxes, &spec.id);
        // Everything refusable is refused before anything is made.
        self.refuse(spec)?;
        let _creating = self.creating.start(&spec.id)?;
        let reserved = self.admit(spec).await?;
        let image = self.resolve_image(spec).await?;
        let _resolved = image.as_ref().map(|i| Resolved::new(&self.resolved, &spec.id, &i.id));
        let slot = match &self.ids {
            Some(ranges) => Some(ranges.take(&spec.id)?),
            None => None,
        };
        let plan = self.plan(spec, &dir, slot.as_ref().map(|s| s.slot), image.as_ref())?;
        // Write-ahead: the record, the id range and the cgroups' names are on disk before the
        // cgroups and the daemon exist, so that a server killed at any moment leaves nothing a
        // restarted one cannot find (`list`) and remove.
        let prepared = {
            let (dir, spec) = (dir.clone(), spec.clone());
            let extra = layout::Extra {
                commands_env: plan.commands_env.clone(),
                ids: plan.ids,
                cgroups: plan.cgroups.as_ref().map(|c| c.dirs.clone()),
                image: image.clone(),
            };
            tokio::task::spawn_blocking(move || dir.prepare(&spec, &extra)).await
        };
        match flatten(prepared) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(ProviderError::Backend(format!(
                    "sandbox `{}` exists already in `{}`",
                    spec.id,
                    dir.root.display()
                )));
            }
            Err(e) => {
                records::remove_dir(&dir).await;
                return Err(exhausted(&e)
                    .unwrap_or_else(|| ProviderError::io(format!("cannot prepare `{}`", dir.root.display()), e)));
            }
        }
        let cgroups = plan.cgroups.clone();
        if let Some(c) = &cgroups
            && let Err(e) = make_cgroups(c).await
        {
            records::remove_dir(&dir).await;
            return Err(e);
        }
        if let Err(e) = self.start(spec, &dir, plan).await {
            if let Some(c) = &cgroups
                && let Err(err) = remove_cgroups(&c.dirs).await
            {
                tracing::warn!(sandbox = %spec.id, %err, "cannot remove the cgroups of a sandbox whose daemon did not start");
            }
            records::remove_dir(&dir).await;
            return Err(e);
        }
        if let Some(slot) = slot {
            slot.keep();
        }
        if let Some(reserved) = reserved {
            reserved.keep();
        }
        Ok(Endpoint::Unix(dir.socket()))
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        if check_id(id).is_err() {
            // No such directory can exist.
            return Ok(());
        }
        // A create of the same sandbox still under way finishes first (fails or succeeds), so that
        // nothing it makes after this delete looked is left behind; one still waiting for memory
        // is called off, rather than made when memory frees only to be deleted.
        if let Some(room) = &self.room {
            room.cancel(id);
        }
        let started = tokio::time::Instant::now();
        while self.creating.contains(id) && started.elapsed() < CREATE_WAIT {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let dir = SandboxDir::new(&self.sandboxes, id);
        let watched = self.lock_watched().get(id).cloned();
        if let Some(w) = &watched {
            w.deleting.store(true, Ordering::SeqCst);
        }
        let found = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || {
                if !dir.root.is_dir() {
                    return None;
                }
                dir.mark_deleting();
                let cgroups = dir.read_cgroups();
                // A paused sandbox's processes are thawed, to take their SIGKILL at once.
                if let Some(c) = &cgroups {
                    c.thaw_now();
                }
                Some((dir.read_pid(), cgroups, dir.read_ids()))
            })
            .await
            .ok()
            .flatten()
        };
        let Some((recorded, cgroups, ids)) = found else {
            self.lock_watched().remove(id);
            return Ok(());
        };
        let target = match watched {
            Some(w) => Some((w.daemon, w.pidfd)),
            None => recorded.and_then(|daemon| {
                let pidfd = sys::async_pidfd(daemon.pid).ok()?;
                // After opening: the pidfd pins one process, and this says it is the daemon.
                daemon.is_running().then_some(())?;
                Some((daemon, Arc::new(pidfd)))
            }),
        };
        if let Some((daemon, pidfd)) = target {
            let _ = tokio::task::spawn_blocking(move || procs::kill_tree(daemon)).await;
            if tokio::time::timeout(KILL_WAIT, pidfd.readable()).await.is_err() {
                return Err(ProviderError::Backend(format!(
                    "sandbox `{id}`: its daemon (pid {}) still runs {} s after SIGKILL",
                    daemon.pid,
                    KILL_WAIT.as_secs()
                )));
            }
        }
        self.lock_watched().remove(id);
        // Before the directory: a delete that fails here is retried, and finds the cgroups again
        // in the directory's `cgroups.json`. Whatever is still in them (a daemon started by a
        // server killed before it wrote its pid) is killed there.
        if let Some(dirs) = &cgroups
            && let Err(e) = remove_cgroups(dirs).await
        {
            return Err(ProviderError::io(format!("sandbox `{id}`: cannot remove its cgroups"), e));
        }
        records::remove_dir(&dir).await;
        if dir.root.exists() {
            return Err(ProviderError::Backend(format!("sandbox `{id}`: cannot remove `{}`", dir.root.display())));
        }
        self.free_ids(ids);
        if let Some(room) = &self.room {
            room.release(id);
        }
        Ok(())
    }

    /// Reads every `sandboxes/*/record.json`. The first time it sees a running daemon this instance
    /// did not start (after a server restart), it adopts it: a watcher awaits its pidfd and reports
    /// its death. A daemon a killed server started but never recorded the pid of is found in its
    /// sandbox's cgroup and adopted too. What a killed server left half made (a directory without
    /// a record, a record whose daemon never started) is removed, cgroups and all: its create
    /// never answered, so a retry makes it anew.
    async fn list(&self) -> Result<Vec<Record>, ProviderError> {
        let sandboxes = self.sandboxes.clone();
        let creating = self.creating.snapshot();
        let scanned = tokio::task::spawn_blocking(move || scan(&sandboxes, &creating))
            .await
            .map_err(|e| ProviderError::io("cannot list sandboxes", std::io::Error::other(e)))?
            .map_err(|e| ProviderError::io(format!("cannot read `{}`", self.sandboxes.display()), e))?;
        for dir in scanned.unfinished {
            tracing::info!(path = %dir.root.display(), "removing a sandbox whose create a stopped server left unfinished");
            if let Err(err) = self.purge(&dir).await {
                tracing::warn!(path = %dir.root.display(), %err, "cannot remove an unfinished sandbox");
            }
        }
        let mut records = Vec::with_capacity(scanned.found.len());
        if let Some(room) = &self.room {
            // What a restarted server finds holds its memory until it is deleted; a create under
            // way holds its own already.
            for (record, _) in scanned.found.iter().filter(|(r, _)| !self.creating.contains(&r.spec.id)) {
                let bytes = bytes_of("memory", record.spec.resources.memory.as_ref()).ok().flatten().unwrap_or(0);
                room.hold(&record.spec.id, bytes);
            }
        }
        for (mut record, running) in scanned.found {
            let Some(daemon) = running else {
                records.push(record);
                continue;
            };
            let known = self.lock_watched().contains_key(&record.spec.id);
            if !known && !self.adopt(&record.spec, daemon) {
                record.ended = Some(not_running());
            }
            records.push(record);
        }
        Ok(records)
    }

    fn events(&self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Read back from the sandbox's cgroup files (eval), the daemon's namespaces (`/proc`), and
    /// the environment and rlimits the provider gave its daemon.
    async fn snapshot(&self, id: &str, snapshot: &str) -> Result<sandman_provider::SnapshotMade, ProviderError> {
        self.take_snapshot(id, snapshot).await
    }

    async fn delete_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        self.remove_snapshot(snapshot).await
    }

    async fn export_snapshot(&self, snapshot: &str, reference: &str) -> Result<String, ProviderError> {
        self.push_snapshot(snapshot, reference).await
    }

    async fn applied(&self, id: &str) -> Result<Applied, ProviderError> {
        if check_id(id).is_err() {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let dir = SandboxDir::new(&self.sandboxes, id);
        let (id, isolation) = (id.to_string(), self.config.isolation);
        tokio::task::spawn_blocking(move || applied_of(&dir, &id, isolation))
            .await
            .map_err(|e| ProviderError::io("cannot read what was applied", std::io::Error::other(e)))?
    }

    /// Freezes the sandbox's cgroup (cgroup v2's freezer; see [`cgroup::Dirs::freeze`]).
    async fn pause(&self, id: &str) -> Result<(), ProviderError> {
        self.freeze(id, true).await
    }

    async fn resume(&self, id: &str) -> Result<(), ProviderError> {
        self.freeze(id, false).await
    }
}

/// The longest a pause or resume waits for the kernel to freeze or thaw every process of the
/// sandbox. Freezing takes microseconds per process; one stuck in an uninterruptible wait (a
/// hung NFS read) holds the freeze up, and past this the pause fails rather than wait for it.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

impl ProcessProvider {
    /// One blocking task: the sandbox's `cgroups.json` read, its cgroup frozen or thawed.
    async fn freeze(&self, id: &str, frozen: bool) -> Result<(), ProviderError> {
        let dir = self.freezable_dir(id)?;
        let id = id.to_string();
        tokio::task::spawn_blocking(move || cgroups_of(&dir, &id)?.freeze(frozen, FREEZE_TIMEOUT))
            .await
            .map_err(|e| ProviderError::io("cannot freeze or thaw a cgroup", std::io::Error::other(e)))?
    }

    /// The directory of sandbox `id`, which has cgroups of its own; refused without isolation.
    fn freezable_dir(&self, id: &str) -> Result<SandboxDir, ProviderError> {
        if check_id(id).is_err() {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        if self.cgroups.is_none() {
            return Err(ProviderError::Unsupported(
                "the process provider cannot pause a sandbox without isolation (--isolation none): its processes have no cgroup of their own to freeze".into(),
            ));
        }
        Ok(SandboxDir::new(&self.sandboxes, id))
    }

    /// Microseconds of CPU sandbox `id`'s processes have used, from its v2 cgroup (the one
    /// that pauses it); `None` without one.
    pub async fn cpu_usage_usec(&self, id: &str) -> Option<u64> {
        let dir = self.freezable_dir(id).ok()?;
        let id = id.to_string();
        tokio::task::spawn_blocking(move || cgroups_of(&dir, &id).ok()?.cpu_usage_usec()).await.ok().flatten()
    }
}

/// The cgroups of the sandbox in `dir`, as its `cgroups.json` says. Blocking.
fn cgroups_of(dir: &SandboxDir, id: &str) -> Result<cgroup::Dirs, ProviderError> {
    if !dir.root.is_dir() {
        return Err(ProviderError::NotFound(id.to_string()));
    }
    dir.read_cgroups().ok_or_else(|| ProviderError::Backend(format!("sandbox `{id}` has no cgroups recorded")))
}

/// `Provider::applied`, blocking.
fn applied_of(dir: &SandboxDir, id: &str, isolation: Isolation) -> Result<Applied, ProviderError> {
    let spec = match dir.read_spec() {
        Ok(spec) => spec,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ProviderError::NotFound(id.to_string())),
        Err(e) => return Err(ProviderError::io(format!("cannot read `{}`", dir.record().display()), e)),
    };
    let cgroups = dir.read_cgroups();
    let limits = cgroups.as_ref().map(|c| c.read_back(cgroup::host_swap())).unwrap_or_default();
    // Only a running daemon's namespaces can be read; the spec says what it was started with.
    let namespaces = dir.read_pid().filter(ProcId::is_running).map(|d| procs::namespaces_apart(d.pid));
    let isolated = isolation == Isolation::Full;
    // Isolated, a sandbox has a network of its own: loopback only, or a way out.
    let loopback = isolated && loopback_only(&spec);
    let image = dir.read_image();
    let env = daemon_env(&spec, dir, isolated, image.as_ref());
    let var = |k: &str| env.get(std::ffi::OsStr::new(k)).map(|v| v.to_string_lossy().into_owned());
    let rlimits = rlimits_of(&spec, isolation)?;
    let details = BTreeMap::from([
        ("cgroups".to_string(), serde_json::to_value(&cgroups).unwrap_or_default()),
        ("namespaces".to_string(), serde_json::to_value(&namespaces).unwrap_or_default()),
        ("rlimits".to_string(), serde_json::json!({"as": rlimits.address_space, "fsize": rlimits.file_size})),
        (
            "isolation".to_string(),
            serde_json::json!({
                "mode": isolation.as_str(),
                "host_ids": dir.read_ids().map(|first| serde_json::json!({"first": first, "count": ids::PER_SANDBOX})),
            }),
        ),
    ]);
    Ok(Applied {
        image: Some(image.map_or_else(|| HOST_IMAGE.to_string(), |i| format!("{}@{}", i.reference, i.id))),
        cpu: limits.cpu,
        memory: limits.memory,
        swap: limits.swap,
        pids: limits.pids,
        network: Some(if loopback { "none" } else { "egress" }.to_string()),
        timezone: var("TZ"),
        locale: var("LC_ALL").or_else(|| var("LANG")),
        details,
    })
}

/// Whether an isolated sandbox's network is loopback only (no veth to the host).
fn loopback_only(spec: &SandboxSpec) -> bool {
    spec.network == Network::None || spec.profile == Profile::Eval
}

/// The limits the daemon sets on each command it starts. Isolated, memory is the sandbox's
/// cgroup's, never `RLIMIT_AS`, which counts address space and breaks runtimes that reserve
/// more than they use; only without isolation (no cgroups) is it the address space.
#[derive(Debug, Clone, Copy, Default)]
struct Rlimits {
    address_space: Option<u64>,
    file_size: Option<u64>,
}

fn rlimits_of(spec: &SandboxSpec, isolation: Isolation) -> Result<Rlimits, ProviderError> {
    let memory = bytes_of("memory", spec.resources.memory.as_ref())?;
    Ok(Rlimits {
        address_space: memory.filter(|_| isolation == Isolation::None && spec.profile != Profile::Eval),
        file_size: bytes_of("disk", spec.resources.disk.as_ref())?,
    })
}

/// The daemon's own environment: never the server's (its credentials, its RUST_LOG), never the
/// request's (which goes to the commands through `env.json`, so that nothing a caller sends,
/// `LD_PRELOAD` say, reaches the daemon). Eval takes nothing from the host (not even `PATH`)
/// and fixes [`EVAL_ENV`].
fn daemon_env(
    spec: &SandboxSpec,
    dir: &SandboxDir,
    isolated: bool,
    image: Option<&image::SandboxImage>,
) -> BTreeMap<OsString, OsString> {
    let eval = spec.profile == Profile::Eval;
    let mut env: BTreeMap<OsString, OsString> = BTreeMap::new();
    // An isolated sandbox takes no path of the host's (the server's PATH names its own places).
    let host_path = std::env::var_os("PATH").filter(|_| !eval && !isolated);
    env.insert("PATH".into(), host_path.unwrap_or_else(|| DEFAULT_PATH.into()));
    if image.is_none() {
        env.insert("LANG".into(), "C.UTF-8".into());
    }
    if eval {
        env.extend(EVAL_ENV.iter().map(|(k, v)| (k.into(), v.into())));
    }
    if image.is_some() {
        // As Docker runs an image: root's home, unless the image's own environment (which the
        // commands get over this) says otherwise.
        env.insert("HOME".into(), "/root".into());
    } else if isolated {
        env.insert("HOME".into(), SANDBOX_HOME.into());
    } else {
        env.insert("HOME".into(), dir.work().into());
        // Its own /tmp is a namespace away; TMPDIR is what it can have.
        env.insert("TMPDIR".into(), dir.tmp().into());
    }
    env
}

/// The commands' environment: the image's (`ENV`), then the request's over it, checked;
/// `SANDMAN_*` left out (the daemon hides them from commands anyway). Neither ever becomes the
/// daemon's own.
fn commands_env(
    spec: &SandboxSpec,
    image: Option<&image::SandboxImage>,
) -> Result<BTreeMap<String, String>, ProviderError> {
    let mut env = BTreeMap::new();
    for (k, v) in image.iter().flat_map(|i| &i.config.env) {
        if !k.is_empty() && !k.contains('=') && !k.contains('\0') && !v.contains('\0') && !k.starts_with("SANDMAN_") {
            env.insert(k.clone(), v.clone());
        }
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ProviderError::Unsupported(format!("invalid environment variable `{k}`")));
        }
        if !k.starts_with("SANDMAN_") {
            env.insert(k.clone(), v.clone());
        }
    }
    Ok(env)
}

/// Makes a sandbox's cgroups (their names are in its `cgroups.json` already) and writes their
/// limits.
async fn make_cgroups(c: &Cgroups) -> Result<(), ProviderError> {
    let c = c.clone();
    let host_swap = cgroup::host_swap().unwrap_or(u64::MAX);
    tokio::task::spawn_blocking(move || cgroup::create(&c.dirs, c.limits, host_swap))
        .await
        .map_err(|e| ProviderError::io("cannot make the sandbox's cgroups", std::io::Error::other(e)))?
}

/// Removes a sandbox's cgroups once they are empty: a killed sandbox's pid namespace empties a
/// moment after its init dies. What is still in them after a second is SIGKILLed; after five
/// the last error is returned.
async fn remove_cgroups(dirs: &cgroup::Dirs) -> std::io::Result<()> {
    let mut last = std::io::Error::other("not tried");
    for attempt in 0..CGROUP_TRIES {
        let d = dirs.clone();
        let removed = tokio::task::spawn_blocking(move || {
            if attempt >= CGROUP_KILL_AFTER {
                d.kill_members();
            }
            d.remove()
        })
        .await;
        match flatten(removed) {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(last)
}

/// What [`scan`] found: records (with the daemon when it runs), and what a killed server left
/// unfinished.
#[derive(Debug, Default)]
struct Scanned {
    found: Vec<(Record, Option<ProcId>)>,
    unfinished: Vec<SandboxDir>,
}

/// Every record under `sandboxes`, with the daemon when it runs. A daemon whose pid was never
/// written (its server was killed between starting it and writing `daemon.pid`) is found in
/// its cgroup, and its pid written now. Blocking.
fn scan(sandboxes: &Path, creating: &HashSet<String>) -> std::io::Result<Scanned> {
    let entries = match std::fs::read_dir(sandboxes) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Scanned::default()),
        Err(e) => return Err(e),
    };
    let mut out = Scanned::default();
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().map(str::to_string) else { continue };
        if check_id(&id).is_err() || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = SandboxDir::new(sandboxes, &id);
        let spec = match dir.read_spec() {
            Ok(spec) => spec,
            // Being made this very moment: its record is not written yet.
            Err(_) if creating.contains(&id) => continue,
            // Killed while its directory was being made, before its record was written.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                out.unfinished.push(dir);
                continue;
            }
            // Torn (its blocks lost in a crash: records are not synced) with no daemon running:
            // a sandbox that died with the machine, whose create nobody can report; removed.
            Err(err) if !dir.read_pid().is_some_and(|d| d.is_running()) => {
                tracing::warn!(sandbox = %id, %err, path = %dir.record().display(), "removing a sandbox whose record cannot be read and whose daemon is not running");
                out.unfinished.push(dir);
                continue;
            }
            Err(err) => {
                tracing::warn!(sandbox = %id, %err, path = %dir.record().display(), "skipping an unreadable sandbox record");
                continue;
            }
        };
        let endpoint = Endpoint::Unix(dir.socket());
        let paused = dir.read_cgroups().is_some_and(|c| c.is_frozen());
        let record =
            |ended| Record { spec: spec.clone(), endpoint: endpoint.clone(), ended, claim: None, paused, ready: None };
        if creating.contains(&id) {
            out.found.push((record(None), None));
            continue;
        }
        if let Some(ended) = dir.read_ended() {
            out.found.push((record(Some(ended)), None));
            continue;
        }
        if let Some(daemon) = dir.read_pid() {
            let running = daemon.is_running().then_some(daemon);
            let ended = running.is_none().then(|| watch::ended_of(&dir, spec.daemon_lease_s));
            out.found.push((record(ended), running));
            continue;
        }
        // No pid written: either the daemon runs, unrecorded, in its cgroup, or it never started.
        let found = dir.read_cgroups().and_then(|c| procs::top_of(&c.members()));
        match found {
            Some(daemon) => {
                if let Err(err) = dir.write_pid(daemon) {
                    tracing::warn!(sandbox = %id, %err, "cannot write the pid of a daemon found in its cgroup");
                }
                tracing::info!(sandbox = %id, pid = daemon.pid, "found a daemon whose pid was never written, in its cgroup");
                out.found.push((record(None), Some(daemon)));
            }
            None if dir.exit_code().is_some() => {
                out.found.push((record(Some(watch::ended_of(&dir, spec.daemon_lease_s))), None));
            }
            None => out.unfinished.push(dir),
        }
    }
    Ok(out)
}

fn not_running() -> Ended {
    Ended { reason: Reason::ProviderError, message: "daemon is not running".into() }
}

/// Runs the daemon's isolation once, as a sandbox would get it, and reports why it failed: the
/// provider starts only where sandboxes can be isolated. Blocking; at start.
fn check_isolation(config: &ProcessConfig, template: &Path) -> Result<(), String> {
    let dir = config.state_dir.join("isolation-check");
    let _ = std::fs::remove_dir_all(&dir);
    let root = dir.join("root");
    std::fs::create_dir_all(&root).map_err(|e| format!("cannot make `{}`: {e}", root.display()))?;
    let mut cmd = std::process::Command::new(&config.daemon_bin);
    cmd.args(&config.daemon_args)
        .arg("--check-isolation")
        .arg("--isolate")
        .arg("--isolate-net")
        .arg("--isolate-ids")
        .arg(ids::base_of(ids::CHECK_SLOT).to_string())
        .arg("--isolate-root")
        .arg(&root)
        .arg("--isolate-template")
        .arg(template)
        .arg("--workdir")
        .arg(SANDBOX_HOME)
        .arg("--isolate-hide")
        .arg(resolve(&config.state_dir))
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let out = cmd.output().map_err(|e| format!("cannot run `{}`: {e}", config.daemon_bin.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    let words = said.lines().filter(|l| l.starts_with("error:") || l.starts_with("  caused by:")).map(str::trim);
    Err(words.collect::<Vec<_>>().join(" ").trim_start_matches("error: ").to_string())
}

/// A sandbox id names a directory.
fn check_id(id: &str) -> Result<(), ProviderError> {
    records::check_id(id, "a directory")
}

/// A cpu quantity in cores, within what a CFS quota can hold.
fn cores_of(q: &Quantity) -> Result<f64, ProviderError> {
    let cpu = q.value().map_err(|e| ProviderError::Unsupported(format!("resources.cpu: {e}")))?;
    if !(cpu * (cgroup::PERIOD_US as f64) >= cgroup::MIN_QUOTA_US as f64 && cpu <= 1e6) {
        return Err(ProviderError::Unsupported(format!(
            "resources.cpu must be between 0.01 and a million cores, not {cpu}"
        )));
    }
    Ok(cpu)
}

/// A memory or disk quantity in bytes.
fn bytes_of(what: &str, q: Option<&Quantity>) -> Result<Option<u64>, ProviderError> {
    let Some(q) = q else { return Ok(None) };
    let v = q.value().map_err(|e| ProviderError::Unsupported(format!("resources.{what}: {e}")))?;
    if v < 1.0 || v >= u64::MAX as f64 {
        return Err(ProviderError::Unsupported(format!("resources.{what} must be at least one byte")));
    }
    Ok(Some(v.round() as u64))
}

fn flatten<T>(r: Result<std::io::Result<T>, tokio::task::JoinError>) -> std::io::Result<T> {
    r.map_err(std::io::Error::other)?
}

/// What no isolated sandbox may see: the state directory (every sandbox's token and files, the
/// server's token and keys), the daemon's and the server's binaries; their symbolic links
/// resolved (a `canonicalize` walks every component), once for the provider's life.
fn hidden(config: &ProcessConfig) -> Vec<PathBuf> {
    let mut out = vec![resolve(&config.state_dir), resolve(&config.daemon_bin)];
    out.extend(config.hide.iter().map(|p| resolve(p)));
    out.dedup();
    out
}

/// `path` with symlinks resolved as far as it exists.
fn resolve(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()))
}

/// Finds `sandmand`: `$SANDMAN_DAEMON` when set, else next to the current executable, else on
/// `PATH`.
pub fn find_daemon() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SANDMAN_DAEMON").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("sandmand")));
    if let Some(p) = beside.filter(|p| is_executable(p)) {
        return Some(p);
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("sandmand")).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 16): a server out of descriptors failed creates with "cannot prepare";
    /// now the create is refused naming the limit.
    #[test]
    fn running_out_of_descriptors_or_processes_is_resource_exhausted_naming_the_limit() {
        let e = exhausted(&std::io::Error::from_raw_os_error(libc::EMFILE));
        assert_eq!(e.as_ref().map(ProviderError::reason), Some(Reason::ResourceExhausted));
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("RLIMIT_NOFILE"), "{msg}");
        let e = exhausted(&std::io::Error::from_raw_os_error(libc::EAGAIN)).map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("kernel.pid_max"));
        assert!(exhausted(&std::io::Error::from_raw_os_error(libc::ENOENT)).is_none());
    }

    #[test]
    fn a_sandboxs_hostname_is_its_id_as_a_dns_label() {
        assert_eq!(hostname_of("sb-9c3694e8b5b8"), "sb-9c3694e8b5b8");
        assert_eq!(hostname_of("pool_a.1"), "pool-a-1");
        assert_eq!(hostname_of("_x_"), "x");
        assert_eq!(hostname_of("__"), "sandbox");
        assert_eq!(hostname_of(&"a".repeat(128)), "a".repeat(63));
    }

    #[test]
    fn eval_fixes_the_environment_and_takes_no_path_from_the_host() {
        let dir = SandboxDir::new(Path::new("/var/lib/sandman/sandboxes"), "e1");
        let mut spec = sandman_provider::conformance::spec("e1", HOST_IMAGE);
        let plain = daemon_env(&spec, &dir, false, None);
        assert_eq!(plain.get(std::ffi::OsStr::new("PATH")), std::env::var_os("PATH").as_ref());
        assert!(!plain.contains_key(std::ffi::OsStr::new("TZ")) && !plain.contains_key(std::ffi::OsStr::new("LC_ALL")));
        // Isolated, nothing of the host's paths: neither the server's PATH nor its state directory.
        let isolated = daemon_env(&spec, &dir, true, None);
        let get = |k: &str| isolated.get(std::ffi::OsStr::new(k)).and_then(|v| v.to_str());
        assert_eq!((get("PATH"), get("HOME"), get("TMPDIR")), (Some(DEFAULT_PATH), Some(SANDBOX_HOME), None));
        spec.profile = Profile::Eval;
        let eval = daemon_env(&spec, &dir, true, None);
        let get = |k: &str| eval.get(std::ffi::OsStr::new(k)).and_then(|v| v.to_str());
        assert_eq!(get("PATH"), Some(DEFAULT_PATH));
        for (k, v) in EVAL_ENV {
            assert_eq!(get(k), Some(v), "{k}");
        }
        assert_eq!(get("HOME"), Some(SANDBOX_HOME));
    }

    #[test]
    fn a_requests_environment_never_becomes_the_daemons_own() {
        let dir = SandboxDir::new(Path::new("/var/lib/sandman/sandboxes"), "e2");
        let mut spec = sandman_provider::conformance::spec("e2", HOST_IMAGE);
        spec.env.insert("LD_PRELOAD".into(), "/tmp/evil.so".into());
        spec.env.insert("SANDMAN_TOKEN".into(), "hijack".into());
        let daemon = daemon_env(&spec, &dir, true, None);
        assert!(!daemon.contains_key(std::ffi::OsStr::new("LD_PRELOAD")), "{daemon:?}");
        assert!(!daemon.contains_key(std::ffi::OsStr::new("CONFORMANCE")), "{daemon:?}");
        let commands = commands_env(&spec, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(commands.get("LD_PRELOAD").map(String::as_str), Some("/tmp/evil.so"));
        assert_eq!(commands.get("CONFORMANCE").map(String::as_str), Some("yes"));
        assert!(!commands.contains_key("SANDMAN_TOKEN"));
        spec.env.insert("A=B".into(), "x".into());
        assert!(commands_env(&spec, None).is_err());
    }

    #[test]
    fn memory_is_an_address_space_rlimit_only_without_isolation() {
        let mut spec = sandman_provider::conformance::spec("r1", HOST_IMAGE);
        spec.resources.memory = Some(Quantity::Text("1Gi".into()));
        let r = |spec: &SandboxSpec, i| rlimits_of(spec, i).ok().and_then(|r| r.address_space);
        assert_eq!(r(&spec, Isolation::None), Some(1 << 30));
        assert_eq!(r(&spec, Isolation::Full), None);
        spec.profile = Profile::Eval;
        assert_eq!(r(&spec, Isolation::None), None);
    }

    #[test]
    fn cpu_quantities_must_fit_a_cfs_quota() {
        assert_eq!(cores_of(&Quantity::Text("500m".into())).ok(), Some(0.5));
        for bad in ["1m", "2000000", "NaN"] {
            assert!(cores_of(&Quantity::Text(bad.into())).is_err(), "{bad}");
        }
    }

    #[test]
    fn quantities_become_bytes() {
        let q = Quantity::Text("512Mi".into());
        assert_eq!(bytes_of("memory", Some(&q)).ok().flatten(), Some(512 << 20));
        assert!(bytes_of("memory", Some(&Quantity::Text("lots".into()))).is_err());
        assert_eq!(bytes_of("disk", None).ok().flatten(), None);
    }
}

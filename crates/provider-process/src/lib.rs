//! The process provider, Sandman's embedded default: each sandbox is a `sandmand` process with
//! its own directory under the server's state directory, reached over a Unix socket, and in its
//! own namespaces when the server runs as root. Start at [`ProcessProvider`]; the sandbox
//! directory is described in `docs/process-provider.md`.
//!
//! In the default profile it does not limit cpu (ignored), or pids (rlimits cannot:
//! `RLIMIT_NPROC` counts per user and root ignores it); `memory` becomes `RLIMIT_AS` and `disk`
//! `RLIMIT_FSIZE` of every process the daemon starts. The `eval` profile puts each sandbox in
//! cgroups of its own with fixed cpu, memory, swap and pids limits (`cgroup`), in a network
//! namespace with only loopback, with a fixed timezone and locale. Namespaces keep sandboxes from
//! seeing each other's processes, `/tmp`, hostname and (with `network: none` or `eval`) network;
//! they are not a security boundary: the host's file system stays visible. Use the docker or
//! kubernetes provider for untrusted code.

mod cgroup;
mod layout;
mod procs;
mod sys;
mod watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sandman_provider::{
    Creating, EVENT_CAPACITY, Ended, Endpoint, Provider, ProviderError, ProviderEvent, Record, SandboxSpec,
};
use sandman_wire::server::{Applied, Network, Profile, Quantity, Reason};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::layout::SandboxDir;
use crate::procs::ProcId;
use crate::watch::Watch;

/// The only image this provider runs: the host itself.
pub const HOST_IMAGE: &str = "host";

/// PATH of the daemon when the server has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

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

/// Whether sandboxes get their own namespaces (mount, pid, ipc, uts; net for `network: none`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Isolation {
    /// When the server runs as root and the state directory is not under `/tmp`.
    #[default]
    Auto,
    /// Never: sandboxes are plain processes of the host.
    Off,
    /// Always: the provider refuses to start when it cannot.
    Required,
}

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
    pub isolate: Isolation,
}

/// Whether this provider's sandboxes are isolated, and why not when they are not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Namespaces {
    Used,
    /// `Isolation::Off`.
    Off,
    /// The server is not root.
    NotRoot,
    /// The state directory is under `/tmp`, which an isolated sandbox replaces with its own.
    StateUnderTmp,
}

/// How a daemon is to be started: its arguments, its whole environment, and for eval the cgroups
/// to make first.
#[derive(Debug)]
struct Plan {
    args: Vec<OsString>,
    env: BTreeMap<OsString, OsString>,
    cgroups: Option<Eval>,
}

/// An eval sandbox's cgroups (`<own>/sandman-<id>`) and what they hold it to.
#[derive(Debug, Clone)]
struct Eval {
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
    namespaces: Namespaces,
    /// Daemons whose exit a watcher of this instance awaits, by sandbox id. Locked briefly, never
    /// across an await.
    watched: Mutex<HashMap<String, Watched>>,
    /// Sandboxes whose create is under way: `list` reports them running before their daemon's pid
    /// is written, and does not try to adopt them.
    creating: Creating,
    events_tx: mpsc::Sender<ProviderEvent>,
    /// Handed to the server once.
    events_rx: Mutex<Option<mpsc::Receiver<ProviderEvent>>>,
    /// The watcher tasks; cancelled on shutdown (the daemons keep running for the next server).
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl ProcessProvider {
    /// Checks the daemon binary, makes `state_dir/sandboxes/`, and settles whether sandboxes will
    /// be isolated. `Isolation::Required` fails here when isolation is impossible.
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
        let under_tmp = resolve(&sandboxes).starts_with("/tmp");
        let namespaces = plan_namespaces(config.isolate, sys::euid() == 0, under_tmp)?;
        match namespaces {
            Namespaces::Used => {
                tracing::info!(state = %config.state_dir.display(), "process provider: sandboxes get their own namespaces")
            }
            Namespaces::StateUnderTmp => tracing::warn!(
                state = %config.state_dir.display(),
                "process provider: the state directory is under /tmp, which an isolated sandbox replaces; sandboxes run without namespaces"
            ),
            Namespaces::Off | Namespaces::NotRoot => {
                tracing::info!(why = ?namespaces, "process provider: sandboxes run without namespaces")
            }
        }
        let (events_tx, events_rx) = mpsc::channel(EVENT_CAPACITY);
        Ok(ProcessProvider {
            config,
            sandboxes,
            namespaces,
            watched: Mutex::default(),
            creating: Creating::default(),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
        })
    }

    /// Whether sandboxes get their own namespaces, and why not.
    pub fn namespaces(&self) -> Namespaces {
        self.namespaces
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
    }

    /// Checks the spec; touches nothing. Refuses what this provider cannot honour, before anything
    /// is made; for eval, answers with the cgroups to make.
    fn refuse(&self, spec: &SandboxSpec) -> Result<Option<Eval>, ProviderError> {
        check_id(&spec.id)?;
        if spec.image != HOST_IMAGE {
            return Err(ProviderError::Unsupported(format!(
                "image `{}` needs the docker or kubernetes provider; the process provider runs only `{HOST_IMAGE}`",
                spec.image
            )));
        }
        if spec.profile == Profile::Eval {
            return self.refuse_eval(spec).map(Some);
        }
        let isolated = self.namespaces == Namespaces::Used;
        if spec.network == Network::None && !isolated {
            return Err(ProviderError::Unsupported(match self.namespaces {
                Namespaces::NotRoot => "network: none needs root for a network namespace; the server is not root".into(),
                Namespaces::Off => "network: none needs a network namespace, and the process provider's isolation is off".into(),
                _ => "network: none needs a network namespace, and sandboxes are not isolated: the state directory is under /tmp".into(),
            }));
        }
        Ok(None)
    }

    /// What eval needs, each refusal naming what is missing: fixed cpu and memory in the spec, the
    /// fixed environment not overridden, root, the namespaces (for a network namespace with only
    /// loopback), writable cpu, memory and pids cgroups, and a way to hold swap to nothing.
    fn refuse_eval(&self, spec: &SandboxSpec) -> Result<Eval, ProviderError> {
        let refuse = |why: String| ProviderError::Unsupported(format!("eval on the process provider {why}"));
        let cpu = match &spec.resources.cpu {
            None => return Err(refuse("needs resources.cpu: eval fixes the cpu a sandbox gets".into())),
            Some(q) => q.value().map_err(|e| ProviderError::Unsupported(format!("resources.cpu: {e}")))?,
        };
        if cpu * (cgroup::PERIOD_US as f64) < cgroup::MIN_QUOTA_US as f64 || cpu > 1e6 {
            return Err(refuse(format!("needs resources.cpu between 0.01 and a million cores, not {cpu}")));
        }
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
        if sys::euid() != 0 {
            return Err(refuse("needs root for its cgroups and namespaces; the server is not root".into()));
        }
        match self.namespaces {
            Namespaces::Used => {}
            Namespaces::Off => {
                return Err(refuse(
                    "needs namespaces (a network namespace with only loopback), and the process provider's isolation is off"
                        .into(),
                ));
            }
            Namespaces::NotRoot => {
                return Err(refuse(
                    "needs namespaces (a network namespace with only loopback), which need root".into(),
                ));
            }
            Namespaces::StateUnderTmp => {
                return Err(refuse(
                    "needs namespaces (a network namespace with only loopback), and sandboxes are not isolated: the state directory is under /tmp"
                        .into(),
                ));
            }
        }
        let self_cgroup = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| ProviderError::io("cannot read /proc/self/cgroup", e))?;
        let own = cgroup::Dirs::own(&self_cgroup, Path::new(cgroup::MOUNT))
            .map_err(|why| refuse(format!("needs writable cpu, memory and pids cgroups: {why}")))?;
        // Unknown counts as swap being there.
        if cgroup::host_swap().is_none_or(|swap| swap > 0) && !own.accounts_swap() {
            return Err(refuse(format!(
                "cannot hold swap to nothing beyond memory: the host has swap, and the memory cgroup `{}` does not account it (boot with swapaccount=1, or turn swap off)",
                own.memory.display()
            )));
        }
        Ok(Eval { dirs: own.child(&spec.id), limits: cgroup::Limits { cpu, memory, pids } })
    }

    /// Settles the daemon's command line and environment; touches nothing.
    fn plan(&self, spec: &SandboxSpec, dir: &SandboxDir) -> Result<Plan, ProviderError> {
        let eval = self.refuse(spec)?;
        let isolated = self.namespaces == Namespaces::Used;
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
        arg("--workdir", dir.work().into());
        arg("--exit-file", dir.exit_file().into());
        if spec.daemon_lease_s > 0 {
            arg("--lease", format!("{}s", spec.daemon_lease_s).into());
        }
        let rlimits = rlimits_of(spec)?;
        if let Some(bytes) = rlimits.address_space {
            arg("--rlimit-as", bytes.to_string().into());
        }
        if let Some(bytes) = rlimits.file_size {
            arg("--rlimit-fsize", bytes.to_string().into());
            arg("--disk-limit", bytes.to_string().into());
        }
        for cgroup in eval.iter().flat_map(|e| e.dirs.unique()) {
            arg("--cgroup", cgroup.into());
        }
        if isolated {
            args.push("--isolate".into());
            args.push("--isolate-tmp".into());
            args.push(dir.tmp().into());
            if own_network(spec) {
                args.push("--isolate-net".into());
            }
        }
        let env = daemon_env(spec, dir, isolated)?;
        Ok(Plan { args, env, cgroups: eval })
    }

    /// Starts the daemon of a prepared directory and its watcher.
    async fn start(
        &self,
        spec: &SandboxSpec,
        dir: &SandboxDir,
        plan: Plan,
        log: std::fs::File,
    ) -> Result<(), ProviderError> {
        let Plan { args, env, .. } = plan;
        let mut cmd = tokio::process::Command::new(&self.config.daemon_bin);
        cmd.args(&self.config.daemon_args);
        cmd.args(&args)
            .env_clear()
            .envs(&env)
            .current_dir(dir.work())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            // Its own group: a ^C or SIGTERM to the server's group does not reach it.
            .process_group(0);
        let start_failed = |what: String| ProviderError::Failed { reason: Reason::DaemonStartFailed, message: what };
        let child = cmd.spawn().map_err(|e| {
            start_failed(format!("cannot start the daemon `{}`: {e}", self.config.daemon_bin.display()))
        })?;
        let Some(pid) = child.id().map(|p| p as i32) else {
            return Err(start_failed("the daemon exited before it could be watched".into()));
        };
        // Not yet reaped (only the watcher reaps it), so neither the pid nor /proc entry can name
        // another process yet.
        let watched = ProcId::of(pid)
            .ok_or_else(|| std::io::Error::other("no /proc entry"))
            .and_then(|daemon| Ok((daemon, sys::async_pidfd(pid)?)));
        let (daemon, pidfd) = match watched {
            Ok(w) => w,
            Err(e) => {
                let _ = sys::kill(pid, sys::SIGKILL, true);
                return Err(start_failed(format!("cannot watch the daemon (pid {pid}; pidfd needs Linux 5.3): {e}")));
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
        self.lock_watched()
            .insert(spec.id.clone(), Watched { daemon, pidfd: Arc::new(pidfd), deleting: deleting.clone() });
        let watch = self.watch(spec, dir, deleting);
        self.tasks.spawn(watch.child(child));
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
}

impl Drop for ProcessProvider {
    fn drop(&mut self) {
        // Watchers stop; the daemons run on until their lease or the next server's delete.
        self.cancel.cancel();
    }
}

impl Provider for ProcessProvider {
    fn name(&self) -> &'static str {
        "process"
    }

    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        self.refuse(spec).map(|_| ())
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Endpoint, ProviderError> {
        let dir = SandboxDir::new(&self.sandboxes, &spec.id);
        // Everything refusable is refused before anything is made.
        let plan = self.plan(spec, &dir)?;
        let _creating = self.creating.start(&spec.id)?;
        let prepared = {
            let (dir, spec) = (dir.clone(), spec.clone());
            tokio::task::spawn_blocking(move || dir.prepare(&spec)).await
        };
        let log = match flatten(prepared) {
            Ok(log) => log,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(ProviderError::Backend(format!(
                    "sandbox `{}` exists already in `{}`",
                    spec.id,
                    dir.root.display()
                )));
            }
            Err(e) => {
                remove_dir(&dir).await;
                return Err(ProviderError::io(format!("cannot prepare `{}`", dir.root.display()), e));
            }
        };
        let cgroups = plan.cgroups.clone();
        if let Some(eval) = &cgroups
            && let Err(e) = make_cgroups(&dir, eval).await
        {
            remove_dir(&dir).await;
            return Err(e);
        }
        if let Err(e) = self.start(spec, &dir, plan, log).await {
            if let Some(eval) = &cgroups
                && let Err(err) = remove_cgroups(&eval.dirs).await
            {
                tracing::warn!(sandbox = %spec.id, %err, "cannot remove the cgroups of a sandbox whose daemon did not start");
            }
            remove_dir(&dir).await;
            return Err(e);
        }
        Ok(Endpoint::Unix(dir.socket()))
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        if check_id(id).is_err() {
            // No such directory can exist.
            return Ok(());
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
                let _ = std::fs::write(dir.deleting(), b"");
                Some((dir.read_pid(), dir.read_cgroups()))
            })
            .await
            .ok()
            .flatten()
        };
        let Some((recorded, cgroups)) = found else {
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
        // in the directory's `cgroups.json`.
        if let Some(dirs) = &cgroups
            && let Err(e) = remove_cgroups(dirs).await
        {
            return Err(ProviderError::io(format!("sandbox `{id}`: cannot remove its cgroups"), e));
        }
        remove_dir(&dir).await;
        if dir.root.exists() {
            return Err(ProviderError::Backend(format!("sandbox `{id}`: cannot remove `{}`", dir.root.display())));
        }
        Ok(())
    }

    /// Reads every `sandboxes/*/record.json`. The first time it sees a running daemon this instance
    /// did not start (after a server restart), it adopts it: a watcher awaits its pidfd and reports
    /// its death.
    async fn list(&self) -> Result<Vec<Record>, ProviderError> {
        let sandboxes = self.sandboxes.clone();
        let creating = self.creating.snapshot();
        let found = tokio::task::spawn_blocking(move || scan(&sandboxes, &creating))
            .await
            .map_err(|e| ProviderError::io("cannot list sandboxes", std::io::Error::other(e)))?
            .map_err(|e| ProviderError::io(format!("cannot read `{}`", self.sandboxes.display()), e))?;
        let mut records = Vec::with_capacity(found.len());
        for (mut record, running) in found {
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
    async fn applied(&self, id: &str) -> Result<Applied, ProviderError> {
        if check_id(id).is_err() {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let dir = SandboxDir::new(&self.sandboxes, id);
        let (id, isolated) = (id.to_string(), self.namespaces == Namespaces::Used);
        tokio::task::spawn_blocking(move || applied_of(&dir, &id, isolated))
            .await
            .map_err(|e| ProviderError::io("cannot read what was applied", std::io::Error::other(e)))?
    }
}

/// `Provider::applied`, blocking.
fn applied_of(dir: &SandboxDir, id: &str, isolated: bool) -> Result<Applied, ProviderError> {
    let spec = match dir.read_spec() {
        Ok(spec) => spec,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ProviderError::NotFound(id.to_string())),
        Err(e) => return Err(ProviderError::io(format!("cannot read `{}`", dir.record().display()), e)),
    };
    let cgroups = dir.read_cgroups();
    let limits = cgroups.as_ref().map(|c| c.read_back(cgroup::host_swap())).unwrap_or_default();
    // Only a running daemon's namespaces can be read; the spec says what it was started with.
    let namespaces = dir.read_pid().filter(ProcId::is_running).map(|d| procs::namespaces_apart(d.pid));
    let own_net = match &namespaces {
        Some(ns) => ns.contains(&"net"),
        None => isolated && own_network(&spec),
    };
    let env = daemon_env(&spec, dir, isolated)?;
    let var = |k: &str| env.get(std::ffi::OsStr::new(k)).map(|v| v.to_string_lossy().into_owned());
    let rlimits = rlimits_of(&spec)?;
    let details = BTreeMap::from([
        ("cgroups".to_string(), serde_json::to_value(&cgroups).unwrap_or_default()),
        ("namespaces".to_string(), serde_json::to_value(&namespaces).unwrap_or_default()),
        ("rlimits".to_string(), serde_json::json!({"as": rlimits.address_space, "fsize": rlimits.file_size})),
    ]);
    Ok(Applied {
        image: Some(HOST_IMAGE.to_string()),
        cpu: limits.cpu,
        memory: limits.memory,
        swap: limits.swap,
        pids: limits.pids,
        network: Some(if own_net { "none" } else { "egress" }.to_string()),
        timezone: var("TZ"),
        locale: var("LC_ALL").or_else(|| var("LANG")),
        details,
    })
}

/// Whether the sandbox gets a network namespace of its own, with only loopback.
fn own_network(spec: &SandboxSpec) -> bool {
    spec.network == Network::None || spec.profile == Profile::Eval
}

/// The limits the daemon sets on each command it starts. Eval's memory is its cgroup's, never
/// `RLIMIT_AS`, which counts address space and breaks runtimes that reserve more than they use.
#[derive(Debug, Clone, Copy, Default)]
struct Rlimits {
    address_space: Option<u64>,
    file_size: Option<u64>,
}

fn rlimits_of(spec: &SandboxSpec) -> Result<Rlimits, ProviderError> {
    let memory = bytes_of("memory", spec.resources.memory.as_ref())?;
    Ok(Rlimits {
        address_space: memory.filter(|_| spec.profile != Profile::Eval),
        file_size: bytes_of("disk", spec.resources.disk.as_ref())?,
    })
}

/// The daemon's whole environment, which every command inherits: never the server's own (its
/// credentials, its RUST_LOG). Eval takes nothing from the host (not even `PATH`) and fixes
/// [`EVAL_ENV`].
fn daemon_env(
    spec: &SandboxSpec,
    dir: &SandboxDir,
    isolated: bool,
) -> Result<BTreeMap<OsString, OsString>, ProviderError> {
    let eval = spec.profile == Profile::Eval;
    let mut env: BTreeMap<OsString, OsString> = BTreeMap::new();
    let host_path = std::env::var_os("PATH").filter(|_| !eval);
    env.insert("PATH".into(), host_path.unwrap_or_else(|| DEFAULT_PATH.into()));
    env.insert("HOME".into(), dir.work().into());
    env.insert("LANG".into(), "C.UTF-8".into());
    if eval {
        env.extend(EVAL_ENV.iter().map(|(k, v)| (k.into(), v.into())));
    }
    if !isolated {
        // Its own /tmp is a namespace away; TMPDIR is what it can have.
        env.insert("TMPDIR".into(), dir.tmp().into());
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ProviderError::Unsupported(format!("invalid environment variable `{k}`")));
        }
        // The daemon would take SANDMAN_TOKEN for its token, and hides SANDMAN_* from commands
        // anyway.
        if k.starts_with("SANDMAN_") {
            continue;
        }
        env.insert(k.into(), v.into());
    }
    Ok(env)
}

/// Records an eval sandbox's cgroups in its directory, then makes them: a crash in between
/// leaves a record that a delete follows, never a cgroup nobody knows of.
async fn make_cgroups(dir: &SandboxDir, eval: &Eval) -> Result<(), ProviderError> {
    let (dir, eval) = (dir.clone(), eval.clone());
    let host_swap = cgroup::host_swap().unwrap_or(u64::MAX);
    tokio::task::spawn_blocking(move || {
        dir.write_cgroups(&eval.dirs)
            .map_err(|e| ProviderError::io(format!("cannot write `{}`", dir.cgroups().display()), e))?;
        cgroup::create(&eval.dirs, eval.limits, host_swap)
    })
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

/// Every record under `sandboxes`, with the daemon when it runs. Blocking.
fn scan(sandboxes: &Path, creating: &HashSet<String>) -> std::io::Result<Vec<(Record, Option<ProcId>)>> {
    let entries = match std::fs::read_dir(sandboxes) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
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
            Err(err) => {
                tracing::warn!(sandbox = %id, %err, path = %dir.record().display(), "skipping an unreadable sandbox record");
                continue;
            }
        };
        let endpoint = Endpoint::Unix(dir.socket());
        if creating.contains(&id) {
            out.push((Record { spec, endpoint, ended: None, claim: None }, None));
            continue;
        }
        if let Some(ended) = dir.read_ended() {
            out.push((Record { spec, endpoint, ended: Some(ended), claim: None }, None));
            continue;
        }
        match dir.read_pid().filter(ProcId::is_running) {
            Some(daemon) => out.push((Record { spec, endpoint, ended: None, claim: None }, Some(daemon))),
            None => out.push((Record { spec, endpoint, ended: Some(not_running()), claim: None }, None)),
        }
    }
    Ok(out)
}

fn not_running() -> Ended {
    Ended { reason: Reason::ProviderError, message: "daemon is not running".into() }
}

/// Whether sandboxes get namespaces; an error when `Required` cannot be met.
fn plan_namespaces(mode: Isolation, root: bool, state_under_tmp: bool) -> Result<Namespaces, ProviderError> {
    match (mode, root, state_under_tmp) {
        (Isolation::Off, _, _) => Ok(Namespaces::Off),
        (Isolation::Auto, false, _) => Ok(Namespaces::NotRoot),
        (Isolation::Auto, true, true) => Ok(Namespaces::StateUnderTmp),
        (Isolation::Required, false, _) => Err(ProviderError::Unsupported(
            "isolation is required, but namespaces need root and the server is not root".into(),
        )),
        (Isolation::Required, true, true) => Err(ProviderError::Unsupported(
            "isolation is required, but the state directory is under /tmp, which an isolated sandbox replaces; move it"
                .into(),
        )),
        (_, true, false) => Ok(Namespaces::Used),
    }
}

/// A sandbox id names a directory: letters, digits, `-`, `_`, `.`; not starting with `.`.
fn check_id(id: &str) -> Result<(), ProviderError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ProviderError::Unsupported(format!(
            "sandbox id `{id}` cannot name a directory: use letters, digits, `-`, `_` and `.`"
        )))
    }
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

/// Removes a sandbox directory, retrying briefly: the processes of a killed sandbox may still be
/// writing into it for a moment while they die.
async fn remove_dir(dir: &SandboxDir) {
    for attempt in 0..20 {
        let d = dir.clone();
        match tokio::task::spawn_blocking(move || d.remove()).await {
            Ok(Ok(())) => return,
            Ok(Err(err)) if attempt == 19 => {
                tracing::warn!(%err, path = %dir.root.display(), "cannot remove a sandbox directory")
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn flatten<T>(r: Result<std::io::Result<T>, tokio::task::JoinError>) -> std::io::Result<T> {
    r.map_err(std::io::Error::other)?
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

    #[test]
    fn namespaces_need_root_and_a_state_dir_outside_tmp() {
        assert_eq!(plan_namespaces(Isolation::Auto, true, false).ok(), Some(Namespaces::Used));
        assert_eq!(plan_namespaces(Isolation::Auto, false, false).ok(), Some(Namespaces::NotRoot));
        assert_eq!(plan_namespaces(Isolation::Auto, true, true).ok(), Some(Namespaces::StateUnderTmp));
        assert_eq!(plan_namespaces(Isolation::Off, true, false).ok(), Some(Namespaces::Off));
        assert!(plan_namespaces(Isolation::Required, false, false).is_err());
        assert!(plan_namespaces(Isolation::Required, true, true).is_err());
        assert_eq!(plan_namespaces(Isolation::Required, true, false).ok(), Some(Namespaces::Used));
    }

    #[test]
    fn ids_are_single_path_components() {
        assert!(check_id("sb-42_x.1").is_ok());
        for bad in ["", ".", "..", "../x", "a/b", ".hidden", "a b"] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn eval_fixes_the_environment_and_takes_no_path_from_the_host() {
        let dir = SandboxDir::new(Path::new("/var/lib/sandman/sandboxes"), "e1");
        let mut spec = sandman_provider::conformance::spec("e1", HOST_IMAGE);
        spec.env.insert("SANDMAN_TOKEN".into(), "hijack".into());
        let plain = daemon_env(&spec, &dir, true).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plain.get(std::ffi::OsStr::new("PATH")), std::env::var_os("PATH").as_ref());
        assert!(!plain.contains_key(std::ffi::OsStr::new("TZ")) && !plain.contains_key(std::ffi::OsStr::new("LC_ALL")));
        spec.profile = Profile::Eval;
        let eval = daemon_env(&spec, &dir, true).unwrap_or_else(|e| panic!("{e}"));
        let get = |k: &str| eval.get(std::ffi::OsStr::new(k)).and_then(|v| v.to_str());
        assert_eq!(get("PATH"), Some(DEFAULT_PATH));
        for (k, v) in EVAL_ENV {
            assert_eq!(get(k), Some(v), "{k}");
        }
        assert_eq!(get("CONFORMANCE"), Some("yes"));
        assert_eq!(get("SANDMAN_TOKEN"), None);
        assert_eq!(get("HOME"), Some("/var/lib/sandman/sandboxes/e1/work"));
    }

    #[test]
    fn eval_memory_is_never_an_address_space_rlimit() {
        let mut spec = sandman_provider::conformance::spec("r1", HOST_IMAGE);
        spec.resources.memory = Some(Quantity::Text("1Gi".into()));
        assert_eq!(rlimits_of(&spec).ok().and_then(|r| r.address_space), Some(1 << 30));
        spec.profile = Profile::Eval;
        assert_eq!(rlimits_of(&spec).ok().map(|r| r.address_space), Some(None));
    }

    #[test]
    fn quantities_become_bytes() {
        let q = Quantity::Text("512Mi".into());
        assert_eq!(bytes_of("memory", Some(&q)).ok().flatten(), Some(512 << 20));
        assert!(bytes_of("memory", Some(&Quantity::Text("lots".into()))).is_err());
        assert_eq!(bytes_of("disk", None).ok().flatten(), None);
    }
}

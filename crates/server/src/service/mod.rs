//! `Service`, the control plane: the composition of its parts, each in its own module with the
//! state it owns, which the HTTP layer (`crate::api`, `crate::proxy`, `crate::e2b`, `crate::ui`)
//! calls. Where things live:
//!
//! - [`lifecycle`]: a create from request to ready (or failed), release, and the end of every
//!   sandbox with its accounting record. Start at [`Service::create`].
//! - [`request`]: checking a create request and turning it into a spec.
//! - [`table`]: every sandbox known, by id, idempotency key and job.
//! - [`queue`]: admission (the global rate, job weights and rates, the bounded queue) and the
//!   task that admits queued creates.
//! - [`jobs`]: jobs' quotas, heartbeats, usage and deletion.
//! - [`pools`]: warm pools, claims and refills.
//! - [`leases`]: leases, keepalives and the one reaper for every timer.
//! - [`recovery`]: finding the provider's sandboxes again at start, and its events.
//! - [`conditions`]: signed conditions records.
//! - [`prepare`]: preparing images and holding creates until enough nodes have them.
//! - [`snapshots`]: snapshots of sandboxes' files, kept until deleted or their job is, and forks.
//! - [`pause`]: pausing and resuming sandboxes, and resuming one a call finds paused.

mod conditions;
mod images;
mod jobs;
mod leases;
mod lifecycle;
mod pause;
mod pools;
mod prepare;
mod queue;
mod recovery;
#[cfg(test)]
mod replica_tests;
mod request;
mod snapshots;
mod table;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandman_provider::{Endpoint, Provider};
use sandman_wire::bounds;
use sandman_wire::server::{ListQuery, Profile, Sandbox as WireSandbox, SandboxState};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accounting::Accounting;
use crate::conditions::Signer;
use crate::daemon::{self, DaemonClient, Identities};
use crate::error::{ServerError, ServerResult};
use crate::events::Events;
use crate::journal::ReadyJournal;
use crate::metrics::Metrics;
use crate::prepare::Gates;
use crate::provider::AnyProvider;
use crate::proxy::Route;
use crate::sandbox::{Backend, Sandbox};
use crate::store::Store;

use self::jobs::Jobs;
use self::leases::Leases;
use self::pools::WarmPools;
use self::queue::Queue;
use self::table::Table;

/// The server's settings, from `ServeArgs`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub default_lease: Duration,
    pub max_ttl: Option<Duration>,
    pub ready_timeout: Duration,
    pub gone_retention: Duration,
    /// Where claims, accounting and the ready journal are kept across restarts.
    pub state_dir: PathBuf,
    /// Where jobs, pools, snapshots and the conditions key are kept: the state directory, or
    /// the cluster when several replicas share them.
    pub store: Store,
    /// Creates admitted a second, over all jobs (`None`: unlimited).
    pub create_rate: Option<f64>,
    /// Creates admitted at once after a quiet spell.
    pub create_burst: f64,
    /// Most creates waiting for admission; past it a create gets 429 with `Retry-After`.
    pub max_queue: usize,
    /// The largest `max_output_bytes` of a proxied `/exec` or session run (`--max-output-bytes`).
    pub max_output_bytes: u64,
    pub daemons: Daemons,
}

impl Settings {
    /// The defaults of `sandman serve`, keeping state in `state_dir`.
    pub fn new(state_dir: PathBuf) -> Self {
        Settings {
            default_lease: Duration::from_secs(600),
            max_ttl: Some(Duration::from_secs(86400)),
            ready_timeout: Duration::from_secs(120),
            gone_retention: Duration::from_secs(3600),
            create_rate: Some(DEFAULT_CREATE_RATE),
            create_burst: DEFAULT_CREATE_RATE,
            max_queue: DEFAULT_MAX_QUEUE,
            max_output_bytes: bounds::MAX_OUTPUT_BYTES.max,
            daemons: Daemons::Real,
            store: Store::Dir(state_dir.clone()),
            state_dir,
        }
    }
}

/// `--create-rate` by default.
pub const DEFAULT_CREATE_RATE: f64 = 50.0;
/// `--max-queue` by default.
pub const DEFAULT_MAX_QUEUE: usize = 10_000;

/// Whether the provider's sandboxes run a daemon the server talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daemons {
    /// Every sandbox runs `sandmand`: readiness is its health check; setup commands, usage and
    /// lease renewals go to it.
    Real,
    /// The provider's sandboxes have no daemon (the fake provider, in tests and benchmarks of
    /// admission and pools): a sandbox is ready once the provider has made it, nothing is sent
    /// to a daemon, and a setup command fails the sandbox with `setup_failed`.
    Absent,
}

/// Extra time the daemon's own lease gets beyond the server's, so the server reclaims first.
pub const DAEMON_LEASE_SLACK_S: u64 = 60;
/// How long past a timer's deadline a ready sandbox counts as missed by the reaper (the
/// `sandman_sandboxes_past_deadline` gauge).
const REAPER_GRACE: Duration = Duration::from_secs(60);

/// The control plane: settings, the provider, and the parts below, each owning its state behind
/// its own lock, none held across `.await`. Lock order, where one is taken under another: table,
/// then jobs, then pools, then the queue.
#[derive(Debug)]
pub struct Service {
    pub settings: Settings,
    pub provider: AnyProvider,
    pub token: String,
    table: Table,
    jobs: Jobs,
    pools: WarmPools,
    queue: Queue,
    leases: Leases,
    snapshots: snapshots::Snapshots,
    /// Sandboxes that became ready, for a restarted server to tell them from interrupted creates.
    ready_journal: ReadyJournal,
    pub accounting: Accounting,
    pub events: Events,
    /// Signs conditions records; why not, when the key could not be read or made.
    signer: Result<Signer, String>,
    /// Gates holding a job's creates of an image until enough nodes have it.
    pub gates: Gates,
    pub metrics: Metrics,
    /// The daemons' tokens, which every new connection of `daemons` must prove.
    pub identities: Arc<Identities>,
    pub daemons: DaemonClient,
    /// Creates in flight, reclaims, keepalives, refills: every task the service spawns.
    pub tasks: TaskTracker,
    pub cancel: CancellationToken,
    /// Cancelled when shutdown begins: from then on `GET /readyz` answers 503 (see `run`).
    pub draining: CancellationToken,
    /// KiB of request bodies the proxy may hold whole at once (see [`Service::hold_body`]).
    pub(crate) bodies: Arc<Semaphore>,
}

/// Sleeps until `at`, or for ever without one: the wait of a task that owns a schedule.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Request bodies the proxy holds whole at once, at most: 256 MiB, in KiB.
pub(crate) const BODY_BUDGET_KIB: usize = 256 * 1024;

impl Service {
    pub fn new(settings: Settings, provider: AnyProvider, token: String) -> Arc<Self> {
        let now = Instant::now();
        let jobs = Jobs::open(&settings.store);
        let queue = Queue::new(&settings, jobs.tenants(), now);
        let metrics = Metrics::default();
        metrics.create_rate_allowed.set(queue.rate().unwrap_or(0.0));
        let identities = Arc::new(Identities::default());
        Arc::new(Service {
            provider,
            token,
            table: Table::default(),
            jobs,
            pools: WarmPools::open(&settings.state_dir, &settings.store),
            queue,
            leases: Leases::default(),
            snapshots: snapshots::Snapshots::open(&settings.store),
            ready_journal: ReadyJournal::open(&settings.state_dir),
            accounting: Accounting::open_with(&settings.state_dir, &settings.store),
            events: Events::default(),
            signer: settings.store.signer(),
            gates: Gates::default(),
            metrics,
            daemons: daemon::client(identities.clone()),
            identities,
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
            draining: CancellationToken::new(),
            bodies: Arc::new(Semaphore::new(BODY_BUDGET_KIB)),
            settings,
        })
    }

    /// The provider's name and isolation, as every sandbox reports them.
    pub fn backend(&self) -> Backend {
        Backend { name: self.provider.name(), isolation: self.provider.isolation() }
    }

    /// Starts the reaper, the admission task and the watcher of provider events.
    pub fn start_background(self: &Arc<Self>) {
        let me = self.clone();
        self.tasks.spawn(async move { me.reaper().await });
        let me = self.clone();
        self.tasks.spawn(async move { me.admission_loop().await });
        if let Some(rx) = self.provider.events() {
            self.drain(rx, |me, ev| async move { me.provider_event(ev).await });
        }
        if let Some(rx) = self.provider.progress() {
            self.drain(rx, |me, p| async move { me.provider_progress(p) });
        }
    }

    /// Hands what `rx` receives to `each`, one at a time, until the channel closes or the
    /// service stops.
    fn drain<T, F>(
        self: &Arc<Self>,
        mut rx: tokio::sync::mpsc::Receiver<T>,
        each: impl Fn(Arc<Self>, T) -> F + Send + 'static,
    ) where
        T: Send + 'static,
        F: Future<Output = ()> + Send,
    {
        let me = self.clone();
        self.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = me.cancel.cancelled() => return,
                    got = rx.recv() => match got {
                        Some(got) => each(me.clone(), got).await,
                        None => return,
                    },
                }
            }
        });
    }

    pub fn get(&self, id: &str) -> ServerResult<Arc<Sandbox>> {
        self.table.get(id).ok_or_else(|| ServerError::NotFound(format!("no sandbox `{id}`")))
    }

    pub fn list(&self, q: &ListQuery) -> ServerResult<Vec<WireSandbox>> {
        let label = match &q.label {
            Some(l) => Some(
                l.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .ok_or_else(|| ServerError::InvalidArgument(format!("label filter `{l}` must be key=value")))?,
            ),
            None => None,
        };
        let all = match &q.job {
            Some(job) => self.table.of_job(job),
            None => self.table.snapshot(),
        };
        let mut out: Vec<WireSandbox> = all
            .iter()
            .filter(|s| label.as_ref().is_none_or(|(k, v)| s.spec.labels.get(k) == Some(v)))
            .map(|s| s.to_wire())
            .filter(|s| q.state.is_none_or(|st| s.state == st))
            .collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    /// The daemon endpoint, token and claimer's environment of a ready sandbox, for a proxied
    /// call; counts as a call, and holds the sandbox's lease until the target's `held` is dropped.
    pub fn call_target(&self, id: &str) -> ServerResult<CallTarget> {
        let sb = self.get(id)?;
        let mut inner = sb.lock();
        match inner.state {
            SandboxState::Ready => {}
            SandboxState::Paused => return Err(ServerError::Paused(id.to_string())),
            s if s.is_terminal() => {
                drop(inner);
                return Err(sb.gone_error());
            }
            s => return Err(ServerError::Conflict(format!("sandbox `{id}` is {s}, not ready"))),
        }
        let endpoint =
            inner.endpoint.clone().ok_or_else(|| ServerError::Internal(format!("sandbox `{id}` has no endpoint")))?;
        let now = Instant::now();
        inner.timers.begin(now);
        inner.daemon_touched = now;
        let route = route_of(&sb, &inner, endpoint);
        Ok(CallTarget { held: CallUnderWay(Arc::clone(&sb)), route })
    }

    /// The route of sandbox `id` while a proxied call may go straight to its daemon: it is
    /// ready, and not a pool's unclaimed sandbox (whose claim changes what its calls get). What
    /// the leader tells follower replicas (`crate::mirror`).
    pub fn route(&self, id: &str) -> Option<Route> {
        let sb = self.table.get(id)?;
        if sb.is_unclaimed_pool_member() {
            return None;
        }
        let inner = sb.lock();
        let endpoint = inner.endpoint.clone().filter(|_| inner.state == SandboxState::Ready)?;
        Some(route_of(&sb, &inner, endpoint))
    }

    /// A share of the budget of bodies the proxy reads whole ([`crate::proxy::hold_body`]).
    pub fn hold_body(&self, headers: &http::HeaderMap) -> ServerResult<tokio::sync::OwnedSemaphorePermit> {
        crate::proxy::hold_body(&self.bodies, headers)
    }

    /// Brings the gauges computed on demand up to date (queue depth, achieved rate, pool
    /// sizes); called before every scrape.
    pub fn refresh_gauges(&self) {
        self.metrics.queue_depth.set(self.queue.queued() as i64);
        self.metrics.create_rate_achieved.set(self.queue.achieved_rate(Instant::now()));
        let _ = self.pool_list();
        let all = self.snapshot();
        self.metrics.job_states(all.iter().filter_map(|sb| sb.spec.job.as_deref().map(|j| (j, sb.state()))));
        // A timer's deadline a minute past with the sandbox still ready: the reaper missed it.
        let now = Instant::now();
        let overdue = all
            .iter()
            .filter(|sb| !sb.is_unclaimed_pool_member())
            .filter(|sb| {
                let inner = sb.lock();
                inner.state == SandboxState::Ready
                    && crate::sandbox::later(inner.timers.next_deadline().0, REAPER_GRACE) <= now
            })
            .count();
        self.metrics.past_deadline.set(overdue as i64);
    }

    /// Number of sandboxes known, ended ones included.
    pub fn count(&self) -> usize {
        self.table.len()
    }

    /// Creates waiting for admission.
    pub fn queued(&self) -> usize {
        self.queue.queued()
    }

    /// Every sandbox known, ended ones included: a snapshot of the table for the dashboard's
    /// listing and summaries (`crate::ui`), which read it without holding the table's lock.
    pub fn snapshot(&self) -> Vec<Arc<Sandbox>> {
        self.table.snapshot()
    }

    /// Every job with a quota (PUT) or with sandboxes still known, by name.
    pub fn job_names(&self) -> Vec<String> {
        let mut names = self.table.job_names();
        names.extend(self.jobs.names());
        names.into_iter().collect()
    }
}

/// Where a proxied call goes, and the claimer's environment merged into it.
#[derive(Debug)]
pub struct CallTarget {
    /// The call is under way while this lives: keep it until the answer has been sent.
    pub held: CallUnderWay,
    pub route: Route,
}

fn route_of(sb: &Sandbox, inner: &crate::sandbox::Inner, endpoint: Endpoint) -> Route {
    Route {
        endpoint,
        token: sb.spec.token.clone(),
        env: sb.env_overlay.clone(),
        eval: sb.spec.profile == Profile::Eval,
        user: crate::sandbox::default_user(sb.spec.server.user.as_deref(), inner.image_config.as_ref()),
    }
}

/// A proxied call under way on a sandbox: its lease and idle timeout do not run out until this
/// is dropped, which counts as activity.
#[derive(Debug)]
pub struct CallUnderWay(Arc<Sandbox>);

impl Drop for CallUnderWay {
    fn drop(&mut self) {
        self.0.lock().timers.end(Instant::now());
    }
}

//! `Service`, the control plane's state and lifecycle: admitting creates (the global rate, job
//! quotas and weights, the bounded queue; see [`crate::admission`]), claiming from warm pools
//! and refilling them ([`crate::pool`]), bringing sandboxes to ready (setup commands included),
//! releasing and reclaiming them with a reason and an accounting record, jobs and heartbeats,
//! preparing images, recovery from the provider's records after a restart, and the one reaper
//! for every timer. Start at [`Service::create`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sandman_provider::{Endpoint, Progress, Provider, ProviderError, ProviderEvent, SandboxSpec, ServerMeta};
use sandman_wire::bounds;
use sandman_wire::daemon::{ExecRequest, ExecResult, Info, Observed, Usage};
use sandman_wire::server::{
    Asked, ConditionsRecord, CreateSandbox, Job, JobAction, JobSpec, JobUsage, ListQuery, Pool, PoolSpec, Profile,
    Reason, Sandbox as WireSandbox, SandboxState, SignedConditions, UsageRecord, Verification,
};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accounting::Accounting;
use crate::admission::{Admission, Offer, RateMeter, Tenant, Ticket};
use crate::conditions::{self, KEY_FILE, Signer};
use crate::daemon::{self, DaemonClient};
use crate::error::{ServerError, ServerResult};
use crate::events::Events;
use crate::journal::ReadyJournal;
use crate::metrics::{Metrics, PoolLabel, ProviderLabel};
use crate::pool::{self, Claim, ClaimJournal, POOL_LABEL, Pools, Put};
use crate::prepare::{self, Gates};
use crate::provider::AnyProvider;
use crate::sandbox::{Backend, Sandbox, Timers, now_ms};

/// The server's settings, from `ServeArgs`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub default_lease: Duration,
    pub max_ttl: Option<Duration>,
    pub ready_timeout: Duration,
    pub gone_retention: Duration,
    /// Where jobs, pools, claims and accounting are kept across restarts.
    pub state_dir: PathBuf,
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
            state_dir,
            create_rate: Some(DEFAULT_CREATE_RATE),
            create_burst: DEFAULT_CREATE_RATE,
            max_queue: DEFAULT_MAX_QUEUE,
            max_output_bytes: bounds::MAX_OUTPUT_BYTES.max,
            daemons: Daemons::Real,
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
/// Daemon keepalives the server sends at once on behalf of heartbeats.
const KEEPALIVE_CONCURRENCY: usize = 64;
/// How often, at most, queued creates are told their new place (see `Admission::progress`).
const QUEUE_PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Output kept from a setup command, and how much of its tail a failure message shows.
const SETUP_OUTPUT_BYTES: u64 = 64 * 1024;
const SETUP_TAIL_CHARS: usize = 2000;
/// How long past a timer's deadline a ready sandbox counts as missed by the reaper (the
/// `sandman_sandboxes_past_deadline` gauge).
const REAPER_GRACE: Duration = Duration::from_secs(60);
/// How long a release waits for the daemon's usage figures before going on without them.
const USAGE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
struct Table {
    by_id: HashMap<String, Arc<Sandbox>>,
    /// idempotency key → sandbox id.
    by_key: HashMap<String, String>,
    /// job → its sandboxes (ended ones too, until forgotten).
    by_job: HashMap<String, HashSet<String>>,
}

impl Table {
    fn insert(&mut self, sb: &Arc<Sandbox>) {
        let id = sb.id().to_string();
        if let Some(k) = &sb.spec.server.idempotency_key {
            self.by_key.insert(k.clone(), id.clone());
        }
        if let Some(job) = &sb.spec.job {
            self.by_job.entry(job.clone()).or_default().insert(id.clone());
        }
        self.by_id.insert(id, sb.clone());
    }

    fn live_of_job(&self, job: &str) -> u64 {
        self.by_job
            .get(job)
            .into_iter()
            .flatten()
            .filter(|id| self.by_id.get(*id).is_some_and(|s| !s.state().is_terminal()))
            .count() as u64
    }
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct JobEntry {
    spec: JobSpec,
    created: u64,
    last_heartbeat_ms: Option<u64>,
}

/// A create request, checked and turned into what it makes.
#[derive(Debug)]
struct Parsed {
    spec: SandboxSpec,
    lease: Duration,
    idle: Option<Duration>,
    ttl: Option<Duration>,
}

/// How a create was served.
#[derive(Debug)]
enum Served {
    /// A retry under a known idempotency key.
    Existing,
    /// Claimed from this pool; it runs the claimer's setup first when `setup` is true.
    Claimed { pool: String, setup: bool },
    /// A new sandbox, admitted at once or queued.
    Fresh(Offer),
}

#[derive(Debug)]
pub struct Service {
    pub settings: Settings,
    pub provider: AnyProvider,
    pub token: String,
    /// Every sandbox known, with its indexes. Never held across `.await`. Lock order: table,
    /// then jobs, then pools, then admission.
    table: Mutex<Table>,
    /// Jobs by name. Never held across `.await`.
    jobs: Mutex<BTreeMap<String, JobEntry>>,
    /// Warm pools and their unclaimed members. Never held across `.await`.
    pools: Mutex<Pools>,
    /// Rates, tenants and the queue of creates. Never held across `.await`.
    admission: Mutex<Admission>,
    /// Wakes the admission task when a create is queued or a rate changes.
    admission_wake: Notify,
    /// Creates admitted over the last seconds, for the achieved-rate gauge.
    meter: Mutex<RateMeter>,
    claims: ClaimJournal,
    /// Sandboxes that became ready, for a restarted server to tell them from interrupted creates.
    ready_journal: ReadyJournal,
    pub accounting: Accounting,
    pub events: Events,
    /// Signs conditions records; why not, when the key could not be read or made.
    signer: Result<Signer, String>,
    /// Gates holding a job's creates of an image until enough nodes have it.
    pub gates: Gates,
    pub metrics: Metrics,
    pub daemons: DaemonClient,
    /// Creates in flight, reclaims, keepalives, refills: every task the service spawns.
    pub tasks: TaskTracker,
    pub cancel: CancellationToken,
    /// When each sandbox should next be looked at by the reaper: (when, id). A renewal does not
    /// touch it; the reaper re-reads the timers when the entry comes due and reschedules.
    schedule: Mutex<BTreeSet<(Instant, String)>>,
    /// Wakes the reaper when an earlier entry is scheduled.
    reaper_wake: Notify,
    keepalives: Arc<Semaphore>,
    /// KiB of request bodies the proxy may hold whole at once (see [`Service::hold_body`]).
    bodies: Arc<Semaphore>,
}

/// Request bodies the proxy holds whole at once, at most: 256 MiB, in KiB.
const BODY_BUDGET_KIB: usize = 256 * 1024;

impl Service {
    pub fn new(settings: Settings, provider: AnyProvider, token: String) -> Arc<Self> {
        let now = Instant::now();
        let jobs = load_jobs(&settings.state_dir);
        let mut admission = Admission::new(settings.create_rate, settings.create_burst, settings.max_queue, now);
        for (name, entry) in &jobs {
            admission.set_tenant(Tenant::Job(name.clone()), entry.spec.weight, entry.spec.create_rate, now);
        }
        let metrics = Metrics::default();
        metrics.create_rate_allowed.set(admission.rate().unwrap_or(0.0));
        let pools = Pools::new(pool::load_specs(&settings.state_dir));
        let claims = ClaimJournal::open(&settings.state_dir);
        let ready_journal = ReadyJournal::open(&settings.state_dir);
        let accounting = Accounting::open(&settings.state_dir);
        Arc::new(Service {
            provider,
            token,
            table: Mutex::default(),
            jobs: Mutex::new(jobs),
            pools: Mutex::new(pools),
            admission: Mutex::new(admission),
            admission_wake: Notify::new(),
            meter: Mutex::new(RateMeter::new(now)),
            claims,
            ready_journal,
            accounting,
            events: Events::default(),
            signer: Signer::open(&settings.state_dir).map_err(|e| {
                format!("cannot read or make the signing key {}: {e}", settings.state_dir.join(KEY_FILE).display())
            }),
            gates: Gates::default(),
            metrics,
            daemons: daemon::client(),
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
            schedule: Mutex::default(),
            reaper_wake: Notify::new(),
            keepalives: Arc::new(Semaphore::new(KEEPALIVE_CONCURRENCY)),
            bodies: Arc::new(Semaphore::new(BODY_BUDGET_KIB)),
            settings,
        })
    }

    /// The provider's name and isolation, as every sandbox reports them.
    pub fn backend(&self) -> Backend {
        Backend { name: self.provider.name(), isolation: self.provider.isolation() }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn jobs(&self) -> MutexGuard<'_, BTreeMap<String, JobEntry>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pools(&self) -> MutexGuard<'_, Pools> {
        self.pools.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn admission(&self) -> MutexGuard<'_, Admission> {
        self.admission.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn meter(&self) -> MutexGuard<'_, RateMeter> {
        self.meter.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the reaper, the admission task and the watcher of provider events.
    pub fn start_background(self: &Arc<Self>) {
        let me = self.clone();
        self.tasks.spawn(async move { me.reaper().await });
        let me = self.clone();
        self.tasks.spawn(async move { me.admission_loop().await });
        if let Some(mut rx) = self.provider.events() {
            let me = self.clone();
            self.tasks.spawn(async move {
                loop {
                    tokio::select! {
                        _ = me.cancel.cancelled() => return,
                        ev = rx.recv() => match ev {
                            Some(ev) => me.provider_event(ev).await,
                            None => return,
                        },
                    }
                }
            });
        }
        if let Some(mut rx) = self.provider.progress() {
            let me = self.clone();
            self.tasks.spawn(async move {
                loop {
                    tokio::select! {
                        _ = me.cancel.cancelled() => return,
                        p = rx.recv() => match p {
                            Some(p) => me.provider_progress(p),
                            None => return,
                        },
                    }
                }
            });
        }
    }

    pub fn get(&self, id: &str) -> ServerResult<Arc<Sandbox>> {
        self.table().by_id.get(id).cloned().ok_or_else(|| ServerError::NotFound(format!("no sandbox `{id}`")))
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
        let all: Vec<Arc<Sandbox>> = {
            let table = self.table();
            match &q.job {
                Some(job) => {
                    table.by_job.get(job).into_iter().flatten().filter_map(|id| table.by_id.get(id).cloned()).collect()
                }
                None => table.by_id.values().cloned().collect(),
            }
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

    /// Fills in a create that names a pool from the pool's spec, refusing one that asks for
    /// other sandboxes than the pool makes.
    fn apply_pool(req: &mut CreateSandbox, name: &str, pool: &PoolSpec) -> ServerResult<()> {
        let differs = |what: &str, theirs: String, ours: String| {
            ServerError::InvalidArgument(format!(
                "the create names pool `{name}`, whose {what} is {ours}, not {theirs}"
            ))
        };
        if req.image.is_empty() {
            req.image = pool.image.clone();
        } else if req.image != pool.image {
            return Err(differs("image", format!("`{}`", req.image), format!("`{}`", pool.image)));
        }
        if req.resources == Default::default() {
            req.resources = pool.resources.clone();
        } else if req.resources != pool.resources {
            return Err(differs("resources", format!("{:?}", req.resources), format!("{:?}", pool.resources)));
        }
        if req.profile == Default::default() {
            req.profile = pool.profile;
        } else if req.profile != pool.profile {
            return Err(differs("profile", format!("{:?}", req.profile), format!("{:?}", pool.profile)));
        }
        if req.network == Default::default() {
            req.network = pool.network;
        } else if req.network != pool.network {
            return Err(differs("network", format!("{:?}", req.network), format!("{:?}", pool.network)));
        }
        Ok(())
    }

    /// Refuses a request naming a provider other than this server's.
    fn check_provider(&self, asked: Option<&str>) -> ServerResult<()> {
        match asked {
            Some(p) if p != self.provider.name() => Err(ServerError::InvalidArgument(format!(
                "provider `{p}` is not served here; this server runs the `{}` provider",
                self.provider.name()
            ))),
            _ => Ok(()),
        }
    }

    /// Checks a create request and turns it into a spec.
    fn parse_create(&self, req: &CreateSandbox) -> ServerResult<Parsed> {
        // Every number first: nothing below may add, multiply or convert one out of range.
        req.check_bounds().map_err(bad_number)?;
        if req.image.trim().is_empty() {
            return Err(ServerError::InvalidArgument("`image` is required (or `pool`)".into()));
        }
        self.check_provider(req.provider.as_deref())?;
        check_resources(&req.resources)?;
        if let Some(user) = &req.user {
            check_user(user)?;
        }
        check_env(&req.env)?;
        if req.profile == Profile::Eval {
            conditions::check_eval_env(&req.env).map_err(ServerError::InvalidArgument)?;
        }
        for k in req.labels.keys() {
            if k.is_empty() || k.len() > 63 || !k.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c)) {
                return Err(ServerError::InvalidArgument(format!("invalid label key `{k}`")));
            }
            if k.starts_with("sandman.dev/") {
                return Err(ServerError::InvalidArgument(format!("label key `{k}` is reserved for the server")));
            }
        }
        check_setup(&req.setup)?;
        if let Some(job) = &req.job
            && (job.is_empty() || job.contains('/'))
        {
            return Err(ServerError::InvalidArgument(format!("invalid job name `{job}`")));
        }
        let job_lease = req.job.as_ref().and_then(|j| self.jobs().get(j).and_then(|e| e.spec.lease_s));
        let lease_s = req.lease_s.or(job_lease).unwrap_or(self.settings.default_lease.as_secs());
        // A job's lease and the server's default were bounded when they were set.
        let lease_s = bounds::LEASE_S.check(lease_s).map_err(bad_number)?;
        let ttl = match (req.ttl_s, self.settings.max_ttl) {
            (Some(t), Some(max)) if Duration::from_secs(t) > max => {
                return Err(ServerError::InvalidArgument(format!(
                    "`ttl_s` is {t}; it must be between 1 and this server's maximum of {} (--max-ttl-s)",
                    max.as_secs()
                )));
            }
            (Some(t), _) => Some(Duration::from_secs(t)),
            (None, max) => max,
        };
        let idle = req.idle_timeout_s.map(Duration::from_secs);
        let spec = SandboxSpec {
            id: new_id(),
            image: req.image.clone(),
            resources: req.resources.clone(),
            env: req.env.clone(),
            labels: req.labels.clone(),
            job: req.job.clone(),
            profile: req.profile,
            network: req.network,
            token: random_hex(),
            daemon_lease_s: lease_s.saturating_add(DAEMON_LEASE_SLACK_S),
            created_at_ms: now_ms(),
            server: ServerMeta {
                lease_s,
                idle_timeout_s: req.idle_timeout_s,
                ttl_s: ttl.map(|t| t.as_secs()),
                idempotency_key: req.idempotency_key.clone(),
                user: req.user.clone(),
            },
        };
        Ok(Parsed { spec, lease: Duration::from_secs(lease_s), idle, ttl })
    }

    /// Refuses a create that would take `job` past its `max_sandboxes`.
    fn check_quota(&self, table: &Table, job: Option<&str>) -> ServerResult<()> {
        let Some(job) = job else { return Ok(()) };
        let Some(max) = self.jobs().get(job).and_then(|j| j.spec.max_sandboxes) else { return Ok(()) };
        let live = table.live_of_job(job);
        if live >= max {
            return Err(ServerError::QuotaExceeded(format!(
                "job `{job}` has {live} live sandboxes, its max_sandboxes quota"
            )));
        }
        Ok(())
    }

    /// Creates a sandbox (or finds the one created under the same idempotency key, or claims
    /// one from a warm pool) and, unless `wait` is false, answers once it is ready or has
    /// failed, or `wait_timeout_s` has passed.
    pub async fn create(self: &Arc<Self>, mut req: CreateSandbox) -> ServerResult<WireSandbox> {
        let started = Instant::now();
        let pool = self.pools().for_create(&req, self.provider.name());
        if let Some(name) = req.pool.clone() {
            let Some((_, spec)) = &pool else {
                return Err(ServerError::InvalidArgument(format!(
                    "no pool `{name}`; create it with PUT /v1/pools/{name}"
                )));
            };
            Self::apply_pool(&mut req, &name, spec)?;
        }
        let mut parsed = self.parse_create(&req)?;
        self.provider.check(&parsed.spec).map_err(ServerError::Provider)?;
        let deadline = req.wait_timeout_s.map(|s| crate::sandbox::later(started, Duration::from_secs(s)));
        // A claim needs a pool whose sandboxes' daemons keep a lease as long as this one's.
        let claimable = pool
            .as_ref()
            .filter(|(_, p)| parsed.spec.server.lease_s <= self.pool_lease_s(p))
            .map(|(name, p)| (name.clone(), p.setup.clone()));
        // A cold create from a named pool runs the pool's setup, then the request's.
        let cold_setup: Vec<String> = match (&req.pool, &pool) {
            (Some(_), Some((_, p))) => p.setup.iter().chain(&req.setup).cloned().collect(),
            _ => req.setup.clone(),
        };
        let (sandbox, served) = {
            let mut table = self.table();
            let existing = req
                .idempotency_key
                .as_ref()
                .and_then(|k| table.by_key.get(k))
                .and_then(|id| table.by_id.get(id))
                // A create given up by its caller while queued made nothing: a retry starts anew.
                .filter(|sb| !sb.abandoned.load(std::sync::atomic::Ordering::Relaxed))
                .cloned();
            match existing {
                Some(sb) => {
                    same_request(&sb, &req)?;
                    (sb, Served::Existing)
                }
                None => {
                    self.check_quota(&table, parsed.spec.job.as_deref())?;
                    let claimed = claimable.and_then(|(name, pool_setup)| {
                        let setup = if req.setup == pool_setup { Vec::new() } else { req.setup.clone() };
                        self.claim_locked(&mut table, &name, &parsed, &req, setup)
                            .map(|(sb, setup)| (sb, Served::Claimed { pool: name, setup }))
                    });
                    match claimed {
                        Some(c) => c,
                        None => {
                            // 48 random bits rarely meet twice, but never is the promise.
                            while table.by_id.contains_key(&parsed.spec.id) {
                                parsed.spec.id = new_id();
                            }
                            let tenant = Tenant::of_job(parsed.spec.job.as_deref());
                            let offer = self.admission().offer(tenant, &parsed.spec.id, Instant::now());
                            let state = match offer {
                                Offer::Admitted => SandboxState::Creating,
                                Offer::Queued { .. } => SandboxState::Queued,
                                Offer::Full { retry_after } => {
                                    self.metrics.queue_rejected.inc();
                                    return Err(ServerError::QueueFull {
                                        queued: self.admission().queued(),
                                        retry_after_s: retry_after.as_secs().max(1),
                                    });
                                }
                            };
                            let timers = Timers::new(Instant::now(), parsed.lease, parsed.idle, parsed.ttl);
                            let mut sb = Sandbox::new(parsed.spec, self.backend(), state, timers);
                            sb.setup = cold_setup;
                            let sb = Arc::new(sb);
                            table.insert(&sb);
                            (sb, Served::Fresh(offer))
                        }
                    }
                }
            }
        };
        match served {
            Served::Existing => {}
            Served::Claimed { pool, setup } => {
                let claim = Claim {
                    spec: sandbox.spec.clone(),
                    env: (*sandbox.env_overlay).clone(),
                    claimed_ms: sandbox.claimed_ms.unwrap_or_else(now_ms),
                    pool_created_ms: sandbox.pool_created_ms.unwrap_or(0),
                };
                // Where the provider's records are shared (Kubernetes), the claim is written
                // there, conditionally: another server may have taken this sandbox first.
                if let Err(e) = self.provider.claim(&claim).await {
                    self.claim_lost(&sandbox, &pool, e).await;
                    return Box::pin(self.create(req)).await;
                }
                self.claimed(&sandbox, &pool, setup, &claim, started)
            }
            Served::Fresh(offer) => {
                self.count_created(&sandbox, true);
                match offer {
                    Offer::Queued { position, wait } => {
                        self.metrics.moved(None, SandboxState::Queued);
                        self.events.emit_queued(sandbox.id(), sandbox.spec.job.as_deref(), position, wait);
                        self.admission_wake.notify_one();
                    }
                    _ => {
                        self.metrics.moved(None, SandboxState::Creating);
                        self.metrics.admitted("immediate", 1);
                        self.meter().add(Instant::now(), 1);
                        self.events.emit(sandbox.id(), sandbox.spec.job.as_deref(), SandboxState::Creating, None, None);
                        let me = self.clone();
                        let sb = sandbox.clone();
                        self.tasks.spawn(async move { me.bring_up(sb).await });
                    }
                }
                if let Some((name, _)) = &pool {
                    // A create the pool could not serve: demand it missed, and make sure it is
                    // refilling.
                    self.pools().missed(name);
                    self.refill(name);
                }
            }
        }
        if !req.wait {
            return Ok(sandbox.to_wire());
        }
        let mut guard = AbandonGuard { service: self, sb: &sandbox, armed: true };
        let settled = self.wait_settled(&sandbox, deadline).await;
        guard.armed = false;
        settled
    }

    /// Counts a new sandbox of its job; `made` when the provider makes it (not a claim).
    fn count_created(&self, sb: &Sandbox, made: bool) {
        if made {
            self.metrics.created.get_or_create(&ProviderLabel { provider: self.provider.name().into() }).inc();
        }
        if let Some(job) = &sb.spec.job
            && let Some(j) = self.jobs().get_mut(job)
        {
            j.created += 1;
        }
    }

    /// Waits until the sandbox is ready or has ended. With a deadline, the whole wait (queue
    /// included) is bounded, and a create still queued at it is taken off the queue; without,
    /// the queue is waited out, then the ready timeout.
    async fn wait_settled(self: &Arc<Self>, sb: &Arc<Sandbox>, deadline: Option<Instant>) -> ServerResult<WireSandbox> {
        let mut rx = sb.subscribe();
        let settled = |s: &SandboxState| !matches!(s, SandboxState::Queued | SandboxState::Creating);
        let limit = self.settings.ready_timeout + Duration::from_secs(5);
        let in_time = match deadline {
            Some(at) => tokio::time::timeout_at(at, rx.wait_for(settled)).await.is_ok(),
            None => {
                let _ = rx.wait_for(|s| *s != SandboxState::Queued).await;
                tokio::time::timeout(limit, rx.wait_for(settled)).await.is_ok()
            }
        };
        if !in_time {
            if sb.state() == SandboxState::Queued {
                let message = "its wait_timeout_s passed while it was queued for admission".to_string();
                if self.cancel_queued(sb, Reason::QueueTimeout, Some(message)) {
                    return Err(ServerError::Timeout(format!(
                        "sandbox `{}` was still queued for admission at its wait_timeout_s; it was taken off the queue (queue_timeout)",
                        sb.id()
                    )));
                }
            }
            let by = match deadline {
                Some(_) => "by its wait_timeout_s".to_string(),
                None => format!("after {} s", limit.as_secs()),
            };
            return Err(ServerError::Timeout(format!(
                "sandbox `{}` is not ready {by}; it is still being created (GET it later)",
                sb.id()
            )));
        }
        match sb.state() {
            SandboxState::Ready => Ok(sb.to_wire()),
            SandboxState::Failed => {
                let inner = sb.lock();
                Err(ServerError::Failed {
                    id: sb.id().to_string(),
                    reason: inner.reason.unwrap_or(Reason::ProviderError),
                    message: inner.message.clone().unwrap_or_default(),
                })
            }
            _ => Err(sb.gone_error()),
        }
    }

    /// Takes a queued create off the queue and ends it with `reason`; false when it was no
    /// longer queued (admission took it first).
    fn cancel_queued(self: &Arc<Self>, sb: &Arc<Sandbox>, reason: Reason, message: Option<String>) -> bool {
        self.admission().remove(sb.id());
        match sb.transition(SandboxState::Gone, Some(reason), message) {
            Ok(prev) => {
                self.ended(sb, prev, None);
                true
            }
            Err(_) => false,
        }
    }

    // ---- admission ----

    /// One task admits every queued create: it sleeps until the next token is due (the global
    /// one, or a job's own) or a create is queued, then admits what the rates allow.
    async fn admission_loop(self: Arc<Self>) {
        let mut told = Instant::now();
        loop {
            let now = Instant::now();
            let (admitted, next) = self.admission().admit(now);
            if !admitted.is_empty() {
                let n = admitted.len() as u64;
                self.metrics.admitted("queue", n);
                self.meter().add(now, n);
                if now.saturating_duration_since(told) >= QUEUE_PROGRESS_EVERY {
                    told = now;
                    self.tell_queue_progress();
                }
            }
            for (_, ticket) in admitted {
                self.start_admitted(ticket, now);
            }
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = self.admission_wake.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Tells queued creates whose place moved enough where they now stand, as events.
    fn tell_queue_progress(&self) {
        let moved = self.admission().progress();
        for (id, tenant, position, wait) in moved {
            let job = match &tenant {
                Tenant::Job(j) => Some(j.as_str()),
                Tenant::NoJob | Tenant::Pool(_) => None,
            };
            self.events.emit_queued(&id, job, position, wait);
        }
    }

    fn start_admitted(self: &Arc<Self>, ticket: Ticket, now: Instant) {
        let Ok(sb) = self.get(&ticket.id) else { return };
        let waited = now.saturating_duration_since(ticket.enqueued);
        // A create released or timed out meanwhile has left `queued` already: nothing to do.
        let Ok(prev) = sb.transition(SandboxState::Creating, None, None) else { return };
        self.metrics.moved(Some(prev), SandboxState::Creating);
        self.metrics.queue_wait.observe(waited.as_secs_f64());
        self.events.emit(
            sb.id(),
            sb.spec.job.as_deref(),
            SandboxState::Creating,
            None,
            Some(format!("admitted after {} ms in the queue", waited.as_millis())),
        );
        let me = self.clone();
        self.tasks.spawn(async move { me.bring_up(sb).await });
    }

    /// Makes the sandbox in the provider, waits for its daemon, runs its setup commands.
    async fn bring_up(self: Arc<Self>, sb: Arc<Sandbox>) {
        if let Some(gate) = self.gates.waiter(sb.spec.job.as_deref(), &sb.spec.image) {
            let job = sb.spec.job.as_deref();
            let held = format!("held until enough nodes have `{}` (POST /v1/prepare with hold_until)", sb.spec.image);
            self.events.emit(sb.id(), job, SandboxState::Creating, None, Some(held));
            let mut state = sb.subscribe();
            tokio::select! {
                () = prepare::pass(gate) => {}
                _ = state.wait_for(|s| *s != SandboxState::Creating) => return,
            }
        }
        // The ready timeout counts from here: a hold is not the provider's slowness.
        let started = Instant::now();
        let endpoint = match self.provider.create(&sb.spec).await {
            Ok(e) => e,
            // Released while the provider was making it: the release removes it and says why.
            Err(_) if sb.state() == SandboxState::Releasing => return,
            Err(e) => {
                tracing::warn!(sandbox = sb.id(), error = %e, "create failed");
                self.fail(&sb, e.reason(), e.to_string()).await;
                return;
            }
        };
        sb.lock().endpoint = Some(endpoint.clone());
        self.learn_image_config(&sb).await;
        if sb.state() != SandboxState::Creating {
            // Released while the provider was creating it: make sure nothing is left.
            let _ = self.provider.delete(sb.id()).await;
            return;
        }
        if self.settings.daemons == Daemons::Real {
            let limit = self.settings.ready_timeout.saturating_sub(started.elapsed());
            if let Err(last) = daemon::wait_healthy(&self.daemons, &endpoint, &sb.spec.token, limit).await {
                let msg =
                    format!("the daemon did not answer within {} s: {last}", self.settings.ready_timeout.as_secs());
                self.fail(&sb, Reason::ReadyTimeout, msg).await;
                return;
            }
        }
        if let Err(msg) = self.run_setup(&sb, &endpoint, &sb.setup).await {
            self.fail(&sb, Reason::SetupFailed, msg).await;
            return;
        }
        if sb.spec.profile == Profile::Eval {
            // An eval sandbox is ready only once its conditions are recorded and match.
            match self.take_conditions(&sb, &endpoint).await {
                Ok(signed) if signed.record.mismatches.is_empty() => sb.lock().conditions = Some(signed),
                Ok(signed) => {
                    let what: Vec<String> = signed
                        .record
                        .mismatches
                        .iter()
                        .map(|m| format!("{} applied {} but observed {}", m.field, m.applied, m.observed))
                        .collect();
                    sb.lock().conditions = Some(signed);
                    self.fail(&sb, Reason::ConditionsMismatch, what.join("; ")).await;
                    return;
                }
                Err(e) => {
                    self.fail(&sb, Reason::ConditionsMismatch, format!("its conditions could not be recorded: {e}"))
                        .await;
                    return;
                }
            }
        }
        // Before it is ready: a server killed from here on finds it ready at its next start.
        self.journal_ready(sb.id());
        match sb.transition(SandboxState::Ready, None, None) {
            Ok(prev) => {
                {
                    let mut inner = sb.lock();
                    let now = Instant::now();
                    inner.timers.call(now);
                    inner.daemon_touched = now;
                }
                self.metrics.moved(Some(prev), SandboxState::Ready);
                self.metrics.create_to_ready.observe(started.elapsed().as_secs_f64());
                self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Ready, None, None);
                self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
                if let Some(name) = sb.pool().filter(|_| sb.claimed_ms.is_none())
                    && !self.pools().joined(name, sb.id())
                {
                    // Its pool was deleted or changed while it came up.
                    let _ = self.release(sb.id(), Reason::Released).await;
                }
            }
            Err(_) => {
                let _ = self.provider.delete(sb.id()).await;
            }
        }
    }

    /// Asks the provider for the image's configuration (its user becomes the sandbox's default
    /// when the create named none). A provider that cannot tell only leaves it unknown.
    async fn learn_image_config(&self, sb: &Sandbox) {
        match self.provider.image_config(sb.id()).await {
            Ok(config) => sb.lock().image_config = config,
            Err(e) => tracing::warn!(sandbox = sb.id(), error = %e, "cannot read the image's configuration"),
        }
    }

    /// Runs setup commands in order through the daemon; the first that fails (or cannot run)
    /// fails the sandbox with its output's tail.
    async fn run_setup(&self, sb: &Sandbox, endpoint: &Endpoint, commands: &[String]) -> Result<(), String> {
        for cmd in commands {
            if self.settings.daemons == Daemons::Absent {
                return Err(format!("setup command `{cmd}` cannot run: this server's sandboxes have no daemon"));
            }
            let req = ExecRequest {
                command: Some(cmd.clone()),
                timeout_ms: Some(self.settings.ready_timeout.as_millis() as u64),
                max_output_bytes: Some(SETUP_OUTPUT_BYTES),
                ..Default::default()
            };
            let result: ExecResult =
                daemon::call_json(&self.daemons, endpoint, &sb.spec.token, http::Method::POST, "/v1/exec", Some(&req))
                    .await
                    .map_err(|e| format!("setup command `{cmd}` could not run: {e}"))?;
            if result.status.exit_code == Some(0) {
                continue;
            }
            let how = match (result.status.timed_out, result.status.exit_code, result.status.signal) {
                (true, _, _) => format!("timed out after {} s", self.settings.ready_timeout.as_secs()),
                (_, Some(code), _) => format!("exited with {code}"),
                (_, None, Some(sig)) => format!("was killed by signal {sig}"),
                _ => "failed".to_string(),
            };
            let output = if result.stderr.trim().is_empty() { &result.stdout } else { &result.stderr };
            return Err(format!("setup command `{cmd}` {how}: {}", tail(output.trim_end(), SETUP_TAIL_CHARS)));
        }
        Ok(())
    }

    /// Ends a sandbox that could not be brought up (or died), cleaning up the provider's side.
    async fn fail(self: &Arc<Self>, sb: &Arc<Sandbox>, reason: Reason, message: String) {
        let Ok(prev) = sb.transition(SandboxState::Failed, Some(reason), Some(message)) else { return };
        self.ended(sb, prev, None);
        if let Err(e) = self.provider.delete(sb.id()).await {
            tracing::warn!(sandbox = sb.id(), error = %e, "cleanup after failure failed");
        }
    }

    /// Records that sandbox `id` is ready, and keeps the journal a few times the live sandboxes
    /// at most.
    fn journal_ready(&self, id: &str) {
        self.ready_journal.ready(id);
        let table = self.table();
        let ready = || {
            let mut ids: Vec<&str> = table
                .by_id
                .values()
                .filter(|sb| matches!(sb.state(), SandboxState::Ready | SandboxState::Releasing))
                .map(|sb| sb.id())
                .collect();
            ids.push(id);
            ids
        };
        self.ready_journal.compact_if_grown(ready, table.by_id.len());
    }

    /// After a sandbox's move to `gone` or `failed` from `prev`: the gauges and counters, the
    /// event, the accounting record, its pool's bookkeeping, and its retention.
    fn ended(self: &Arc<Self>, sb: &Arc<Sandbox>, prev: SandboxState, usage: Option<Usage>) {
        let (state, reason, message, ready_ms, ended_ms) = {
            let inner = sb.lock();
            (
                inner.state,
                inner.reason.unwrap_or(Reason::Released),
                inner.message.clone(),
                inner.ready_at_ms,
                inner.ended_at_ms.unwrap_or_else(now_ms),
            )
        };
        self.metrics.moved(Some(prev), state);
        self.metrics.ended(reason);
        self.events.emit(sb.id(), sb.spec.job.as_deref(), state, Some(reason), message.clone());
        let record = UsageRecord {
            sandbox: sb.id().to_string(),
            job: sb.spec.job.clone(),
            image: sb.spec.image.clone(),
            provider: sb.provider.name.to_string(),
            pool: sb.pool().map(str::to_string),
            claimed_ms: sb.claimed_ms,
            created_ms: sb.spec.created_at_ms,
            ready_ms,
            ended_ms,
            state,
            reason,
            wall_seconds: ended_ms.saturating_sub(sb.spec.created_at_ms) as f64 / 1000.0,
            cpu_seconds: usage.map(|u| (u.cpu_user_ms + u.cpu_system_ms) as f64 / 1000.0),
            peak_memory_kib: usage.map(|u| u.max_rss_kib),
            pool_idle_seconds: sb.claimed_ms.zip(sb.pool_created_ms).map(|(c, p)| c.saturating_sub(p) as f64 / 1000.0),
            conditions: sb.lock().conditions.clone(),
        };
        self.accounting.record(&record, &self.metrics);
        if let Some(name) = sb.pool().filter(|_| sb.claimed_ms.is_none()) {
            let failed = (state == SandboxState::Failed).then(|| message.unwrap_or_else(|| reason.to_string()));
            self.pools().left(name, sb.id(), failed.as_deref(), Instant::now());
            self.refill(name);
        }
        self.schedule_check(sb.id(), crate::sandbox::later(Instant::now(), self.settings.gone_retention));
    }

    /// Releases a sandbox with `reason`. Releasing one that has ended answers `gone`; one still
    /// queued is taken off the queue and is gone at once.
    pub async fn release(self: &Arc<Self>, id: &str, reason: Reason) -> ServerResult<WireSandbox> {
        let sb = self.get(id)?;
        if sb.state() == SandboxState::Queued && self.cancel_queued(&sb, reason, None) {
            return Ok(sb.to_wire());
        }
        let prev = match sb.transition(SandboxState::Releasing, Some(reason), None) {
            Ok(prev) => prev,
            Err(_) if sb.state().is_terminal() => return Err(sb.gone_error()),
            Err(e) => return Err(e),
        };
        self.metrics.moved(Some(prev), SandboxState::Releasing);
        self.events.emit(id, sb.spec.job.as_deref(), SandboxState::Releasing, Some(reason), None);
        let usage = if prev == SandboxState::Ready { self.usage_of(&sb).await } else { None };
        let result = self.provider.delete(id).await;
        let (next, reason, message) = match result {
            Ok(()) => (SandboxState::Gone, reason, None),
            Err(e) => {
                tracing::error!(sandbox = id, error = %e, "provider could not delete the sandbox");
                (SandboxState::Failed, Reason::ProviderError, Some(format!("release failed: {e}")))
            }
        };
        if sb.transition(next, Some(reason), message).is_ok() {
            self.ended(&sb, SandboxState::Releasing, usage);
        }
        Ok(sb.to_wire())
    }

    /// What the daemon reports its finished commands used, asked just before a release.
    async fn usage_of(&self, sb: &Sandbox) -> Option<Usage> {
        if self.settings.daemons == Daemons::Absent {
            return None;
        }
        let endpoint = sb.lock().endpoint.clone()?;
        let call = daemon::call_json::<(), Info>(
            &self.daemons,
            &endpoint,
            &sb.spec.token,
            http::Method::GET,
            "/v1/info",
            None,
        );
        match tokio::time::timeout(USAGE_TIMEOUT, call).await {
            Ok(Ok(info)) => info.children_usage,
            _ => None,
        }
    }

    /// The daemon endpoint, token and claimer's environment of a ready sandbox, for a proxied
    /// call; counts as a call, and holds the sandbox's lease until the target's `held` is dropped.
    pub fn call_target(&self, id: &str) -> ServerResult<CallTarget> {
        let sb = self.get(id)?;
        let mut inner = sb.lock();
        match inner.state {
            SandboxState::Ready => {}
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
        Ok(CallTarget {
            held: CallUnderWay(Arc::clone(&sb)),
            endpoint,
            token: sb.spec.token.clone(),
            env: sb.env_overlay.clone(),
            eval: sb.spec.profile == Profile::Eval,
            user: crate::sandbox::default_user(sb.spec.server.user.as_deref(), inner.image_config.as_ref()),
        })
    }

    /// A share of the budget of bodies the proxy reads whole, for one body of the size its
    /// `content-length` says (the JSON limit when it says none), held until the permit is
    /// dropped; `503 unavailable` when the budget is spent, rather than memory without bound.
    pub fn hold_body(&self, headers: &http::HeaderMap) -> ServerResult<tokio::sync::OwnedSemaphorePermit> {
        let limit = sandman_http::extract::MAX_JSON_BODY as u64;
        let len = headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(limit, |n| n.min(limit));
        let kib = u32::try_from(len.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
        Arc::clone(&self.bodies).try_acquire_many_owned(kib).map_err(|_| {
            ServerError::Unavailable(format!(
                "the server holds {} MiB of request bodies at once, its most; retry shortly",
                BODY_BUDGET_KIB / 1024
            ))
        })
    }

    /// Renews the lease of a live sandbox, passing the renewal on to its daemon when the
    /// daemon's own lease is a third gone.
    pub fn keepalive(self: &Arc<Self>, id: &str) -> ServerResult<WireSandbox> {
        let sb = self.get(id)?;
        if sb.state().is_terminal() {
            return Err(sb.gone_error());
        }
        self.renew(&sb);
        Ok(sb.to_wire())
    }

    /// Ends a sandbox `timeout` from now, sooner or later than it would have (E2B's
    /// `set_timeout`): its lifetime is moved, and its lease renewed (its daemon's at once).
    pub fn set_end_in(self: &Arc<Self>, id: &str, timeout: Duration) -> ServerResult<WireSandbox> {
        let sb = self.get(id)?;
        if sb.state().is_terminal() {
            return Err(sb.gone_error());
        }
        let at = {
            let mut inner = sb.lock();
            let ttl = Instant::now().saturating_duration_since(inner.timers.created).saturating_add(timeout);
            if let Some(max) = self.settings.max_ttl
                && ttl > max
            {
                return Err(ServerError::InvalidArgument(format!(
                    "a timeout of {} s would take sandbox `{id}` past this server's maximum lifetime of {} s \
                     (--max-ttl-s)",
                    timeout.as_secs(),
                    max.as_secs()
                )));
            }
            inner.timers.ttl = Some(ttl);
            inner.timers.next_deadline().0
        };
        self.renew_forcing(&sb, true);
        self.schedule_check(sb.id(), at);
        Ok(sb.to_wire())
    }

    fn renew(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        self.renew_forcing(sb, false);
    }

    /// Renews the lease; passes it on to the daemon when its own lease is a third gone, or
    /// at once with `force`.
    fn renew_forcing(self: &Arc<Self>, sb: &Arc<Sandbox>, force: bool) {
        let now = Instant::now();
        let touch = {
            let mut inner = sb.lock();
            inner.timers.renew(now);
            let third = Duration::from_secs(sb.spec.daemon_lease_s) / 3;
            let due = inner.state == SandboxState::Ready
                && (force || now.saturating_duration_since(inner.daemon_touched) >= third);
            if due {
                inner.daemon_touched = now;
            }
            due.then(|| inner.endpoint.clone()).flatten()
        };
        if let Some(endpoint) = touch.filter(|_| self.settings.daemons == Daemons::Real) {
            let me = self.clone();
            let token = sb.spec.token.clone();
            let id = sb.id().to_string();
            self.tasks.spawn(async move {
                let Ok(_permit) = me.keepalives.clone().acquire_owned().await else { return };
                if let Err(e) = daemon::call(&me.daemons, &endpoint, &token, http::Method::POST, "/v1/keepalive").await
                {
                    tracing::warn!(sandbox = id, error = %e, "daemon keepalive failed");
                }
            });
        }
    }

    // ---- jobs ----

    pub fn put_job(&self, name: &str, spec: JobSpec) -> ServerResult<Job> {
        if name.is_empty() || name.contains('/') {
            return Err(ServerError::InvalidArgument(format!("invalid job name `{name}`")));
        }
        spec.check_bounds().map_err(bad_number)?;
        {
            let mut jobs = self.jobs();
            let entry = jobs.entry(name.to_string()).or_default();
            entry.spec = spec.clone();
            save_jobs(&self.settings.state_dir, &jobs);
        }
        self.admission().set_tenant(Tenant::Job(name.to_string()), spec.weight, spec.create_rate, Instant::now());
        self.admission_wake.notify_one();
        self.job(name)
    }

    pub fn job(&self, name: &str) -> ServerResult<Job> {
        let live = self.job_members(name).iter().filter(|s| !s.state().is_terminal()).count() as u64;
        // `job_members` locks the table before the jobs are locked (as `create` does), never while
        // holding them.
        let jobs = self.jobs();
        let entry = jobs.get(name);
        // A job exists while it has a spec (PUT) or live sandboxes; ended ones are history.
        if entry.is_none() && live == 0 {
            return Err(ServerError::NotFound(format!("no job `{name}`")));
        }
        let entry = entry.cloned().unwrap_or_default();
        Ok(Job {
            name: name.to_string(),
            spec: entry.spec,
            live,
            created: entry.created,
            last_heartbeat_ms: entry.last_heartbeat_ms,
        })
    }

    /// The sums of the job's accounting records, and its live sandboxes.
    pub fn job_usage(&self, name: &str) -> ServerResult<JobUsage> {
        let live = self.job_members(name).iter().filter(|s| !s.state().is_terminal()).count() as u64;
        let known = self.jobs().contains_key(name);
        match self.accounting.usage(name) {
            Some(u) => Ok(JobUsage { live, ..u }),
            None if known || live > 0 => Ok(JobUsage { job: name.to_string(), live, ..Default::default() }),
            None => Err(ServerError::NotFound(format!("no job `{name}`"))),
        }
    }

    fn job_members(&self, name: &str) -> Vec<Arc<Sandbox>> {
        let table = self.table();
        table.by_job.get(name).into_iter().flatten().filter_map(|id| table.by_id.get(id).cloned()).collect()
    }

    /// One heartbeat renews the lease of every live sandbox of the job.
    pub fn heartbeat(self: &Arc<Self>, name: &str) -> ServerResult<JobAction> {
        self.metrics.heartbeats.inc();
        let members = self.job_members(name);
        let known = self.jobs().contains_key(name);
        if members.is_empty() && !known {
            return Err(ServerError::NotFound(format!("no job `{name}`")));
        }
        let mut n = 0;
        for sb in members.iter().filter(|s| !s.state().is_terminal()) {
            self.renew(sb);
            n += 1;
        }
        if let Some(j) = self.jobs().get_mut(name) {
            j.last_heartbeat_ms = Some(now_ms());
        }
        Ok(JobAction { job: name.to_string(), sandboxes: n })
    }

    /// Releases every sandbox of the job (reason `job_deleted`), those it was still queueing
    /// included, and forgets its quota.
    pub async fn delete_job(self: &Arc<Self>, name: &str) -> ServerResult<JobAction> {
        // Off the queue first, all at once, so that nothing of the job is admitted meanwhile.
        let queued = self.admission().remove_tenant(&Tenant::Job(name.to_string()));
        let members = self.job_members(name);
        let known = {
            let mut jobs = self.jobs();
            let known = jobs.remove(name).is_some();
            if known {
                save_jobs(&self.settings.state_dir, &jobs);
            }
            known
        };
        if members.is_empty() && !known {
            return Err(ServerError::NotFound(format!("no job `{name}`")));
        }
        tracing::info!(job = name, queued = queued.len(), "deleting a job");
        let live: Vec<_> = members.into_iter().filter(|s| !s.state().is_terminal()).collect();
        let releases = live.iter().map(|sb| self.release(sb.id(), Reason::JobDeleted));
        let results = futures_util::future::join_all(releases).await;
        let n = results.iter().filter(|r| r.is_ok()).count() as u64;
        Ok(JobAction { job: name.to_string(), sandboxes: n })
    }

    // ---- warm pools ----

    /// The longest lease a claim from this pool may have: its members' daemons keep that long
    /// plus the slack.
    fn pool_lease_s(&self, spec: &PoolSpec) -> u64 {
        spec.lease_s.unwrap_or(self.settings.default_lease.as_secs()).clamp(1, bounds::LEASE_S.max)
    }

    /// Creates or changes a pool; it fills in the background.
    pub fn put_pool(self: &Arc<Self>, name: &str, spec: PoolSpec) -> ServerResult<Pool> {
        if name.is_empty() || name.len() > 63 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(ServerError::InvalidArgument(format!(
                "invalid pool name `{name}`: up to 63 letters, digits, `-`, `_` and `.`"
            )));
        }
        if spec.image.trim().is_empty() {
            return Err(ServerError::InvalidArgument("`image` is required".into()));
        }
        self.check_provider(spec.provider.as_deref())?;
        spec.check_bounds().map_err(bad_number)?;
        let max = spec.max.unwrap_or(spec.min_ready);
        if max < spec.min_ready || max > pool::MAX_POOL_SIZE {
            return Err(ServerError::InvalidArgument(format!(
                "`max` ({max}) must be at least `min_ready` ({}) and at most {}",
                spec.min_ready,
                pool::MAX_POOL_SIZE
            )));
        }
        check_resources(&spec.resources)?;
        check_env(&spec.env)?;
        check_setup(&spec.setup)?;
        let probe = self.pool_member_spec(name, &spec);
        self.provider.check(&probe).map_err(ServerError::Provider)?;
        let outcome = {
            let mut pools = self.pools();
            let outcome = pools.put(name, spec);
            pool::save_specs(&self.settings.state_dir, &pools.specs());
            outcome
        };
        let gone = match outcome {
            Put::Created => Vec::new(),
            Put::Resized { excess } => excess,
            Put::Replaced { old } => old,
        };
        self.release_in_background(gone, format!("pool `{name}` changed"));
        self.refill(name);
        self.pool(name)
    }

    /// Forgets a pool and releases its unclaimed sandboxes; claimed ones are their claimers'.
    pub fn delete_pool(self: &Arc<Self>, name: &str) -> ServerResult<Pool> {
        let report = self.pool(name)?;
        let removed = {
            let mut pools = self.pools();
            let removed = pools.remove(name);
            pool::save_specs(&self.settings.state_dir, &pools.specs());
            removed
        };
        if let Some(p) = removed {
            self.release_in_background(
                p.ready.into_iter().chain(p.creating.into_keys()).collect(),
                format!("pool `{name}` deleted"),
            );
        }
        self.metrics.pool_removed(name);
        Ok(report)
    }

    fn release_in_background(self: &Arc<Self>, ids: Vec<String>, why: String) {
        if ids.is_empty() {
            return;
        }
        tracing::info!(sandboxes = ids.len(), why, "releasing unclaimed pool sandboxes");
        let me = self.clone();
        self.tasks.spawn(async move {
            let releases = ids.iter().map(|id| me.release(id, Reason::Released));
            futures_util::future::join_all(releases).await;
        });
    }

    pub fn pool(&self, name: &str) -> ServerResult<Pool> {
        self.pool_list()
            .into_iter()
            .find(|p| p.name == name)
            .ok_or_else(|| ServerError::NotFound(format!("no pool `{name}`")))
    }

    /// Every pool with its sizes; also sets the pool gauges.
    pub fn pool_list(&self) -> Vec<Pool> {
        let mut claimed: HashMap<String, u64> = HashMap::new();
        for sb in self.table().by_id.values() {
            if let (Some(p), Some(_)) = (sb.pool(), sb.claimed_ms)
                && !sb.state().is_terminal()
            {
                *claimed.entry(p.to_string()).or_default() += 1;
            }
        }
        let pools = self.pools();
        let now = Instant::now();
        pools
            .iter()
            .map(|(name, p)| {
                let autoscale = p.spec.autoscale;
                let pool = Pool {
                    name: name.clone(),
                    spec: p.spec.clone(),
                    ready: p.ready.len() as u64,
                    creating: p.creating.len() as u64,
                    claimed: claimed.get(name).copied().unwrap_or(0),
                    claims: p.claims,
                    target: p.target(now),
                    claim_rate: autoscale.then(|| p.claim_rate(now)),
                    refill_seconds: p.refill_time().filter(|_| autoscale).map(|d| d.as_secs_f64()),
                    last_error: p.last_error.clone(),
                };
                self.metrics.pool_sizes(name, pool.ready, pool.creating, pool.claimed);
                pool
            })
            .collect()
    }

    /// The spec of a new member of pool `name`: no job, the pool's label, a lease the pool
    /// renews while it is unclaimed.
    pub(crate) fn pool_member_spec(&self, name: &str, spec: &PoolSpec) -> SandboxSpec {
        let lease_s = self.pool_lease_s(spec);
        SandboxSpec {
            id: new_id(),
            image: spec.image.clone(),
            resources: spec.resources.clone(),
            env: spec.env.clone(),
            labels: BTreeMap::from([(POOL_LABEL.to_string(), name.to_string())]),
            job: None,
            profile: spec.profile,
            network: spec.network,
            token: random_hex(),
            daemon_lease_s: lease_s.saturating_add(DAEMON_LEASE_SLACK_S),
            created_at_ms: now_ms(),
            server: ServerMeta { lease_s, ..ServerMeta::default() },
        }
    }

    /// Brings the pool back to `min_ready` through admission (as the pool's own tenant,
    /// counted against no job). While its refills fail, it backs off and tries again later.
    fn refill(self: &Arc<Self>, name: &str) {
        let now = Instant::now();
        let (specs, setup, retry) = {
            let mut pools = self.pools();
            let (n, retry) = pools.deficit(name, now);
            let Some(p) = pools.get(name) else { return };
            let spec = p.spec.clone();
            let specs: Vec<SandboxSpec> = (0..n).map(|_| self.pool_member_spec(name, &spec)).collect();
            for s in &specs {
                pools.reserve(name, &s.id);
            }
            (specs, spec.setup, retry)
        };
        if let Some(at) = retry {
            let me = self.clone();
            let name = name.to_string();
            self.tasks.spawn(async move {
                tokio::select! {
                    _ = me.cancel.cancelled() => {}
                    _ = tokio::time::sleep_until(at) => me.refill(&name),
                }
            });
            return;
        }
        let mut specs = specs.into_iter();
        while let Some(spec) = specs.next() {
            let lease = Duration::from_secs(spec.server.lease_s);
            let id = spec.id.clone();
            let (sb, offer) = {
                let mut table = self.table();
                let offer = self.admission().offer(Tenant::Pool(name.to_string()), &id, now);
                let state = match offer {
                    Offer::Admitted => SandboxState::Creating,
                    Offer::Queued { .. } => SandboxState::Queued,
                    Offer::Full { .. } => {
                        drop(table);
                        // Give back this and the remaining reservations, and try again later.
                        let mut pools = self.pools();
                        pools.left(name, &id, Some("the admission queue is full"), now);
                        for rest in specs {
                            pools.left(name, &rest.id, None, now);
                        }
                        drop(pools);
                        self.refill(name);
                        return;
                    }
                };
                let mut sb = Sandbox::new(spec, self.backend(), state, Timers::new(now, lease, None, None));
                sb.setup = setup.clone();
                let sb = Arc::new(sb);
                table.insert(&sb);
                (sb, offer)
            };
            self.count_created(&sb, true);
            match offer {
                Offer::Queued { position, wait } => {
                    self.metrics.moved(None, SandboxState::Queued);
                    self.events.emit_queued(sb.id(), None, position, wait);
                    self.admission_wake.notify_one();
                }
                _ => {
                    self.metrics.moved(None, SandboxState::Creating);
                    self.metrics.admitted("immediate", 1);
                    self.meter().add(now, 1);
                    self.events.emit(
                        sb.id(),
                        None,
                        SandboxState::Creating,
                        None,
                        Some(format!("refilling pool `{name}`")),
                    );
                    let me = self.clone();
                    self.tasks.spawn(async move { me.bring_up(sb).await });
                }
            }
        }
    }

    fn refill_all(self: &Arc<Self>) {
        let names: Vec<String> = self.pools().iter().map(|(n, _)| n.clone()).collect();
        for name in names {
            self.refill(&name);
        }
    }

    /// Claims a ready member of pool `name` for this create, under the table's lock: pops it
    /// from the pool's ready queue and registers it again under the claimer's job, labels,
    /// lease, lifetime and key (same id, daemon and endpoint; nothing is recreated). Answers
    /// it, and whether it still has the claimer's `setup` to run (then it is `creating`).
    fn claim_locked(
        &self,
        table: &mut Table,
        name: &str,
        parsed: &Parsed,
        req: &CreateSandbox,
        setup: Vec<String>,
    ) -> Option<(Arc<Sandbox>, bool)> {
        loop {
            let id = self.pools().claim(name)?;
            let Some(old) = table.by_id.get(&id).cloned() else { continue };
            if old.state() != SandboxState::Ready || old.claimed_ms.is_some() {
                continue;
            }
            let now = Instant::now();
            let claimed_ms = now_ms();
            let mut labels = req.labels.clone();
            labels.insert(POOL_LABEL.to_string(), name.to_string());
            let spec = SandboxSpec {
                id: id.clone(),
                labels,
                job: req.job.clone(),
                created_at_ms: claimed_ms,
                server: parsed.spec.server.clone(),
                ..old.spec.clone()
            };
            let has_setup = !setup.is_empty();
            let state = if has_setup { SandboxState::Creating } else { SandboxState::Ready };
            let mut sb =
                Sandbox::new(spec, self.backend(), state, Timers::new(now, parsed.lease, parsed.idle, parsed.ttl));
            sb.setup = setup;
            sb.env_overlay = Arc::new(req.env.clone());
            sb.claimed_ms = Some(claimed_ms);
            sb.pool_created_ms = Some(old.spec.created_at_ms);
            {
                let mut inner = sb.lock();
                inner.endpoint = old.lock().endpoint.clone();
                inner.daemon_touched = old.lock().daemon_touched;
                // Taken when the pool's sandbox became ready; the sandbox is the same.
                inner.conditions = old.lock().conditions.clone();
                if !has_setup {
                    inner.ready_at_ms = Some(claimed_ms);
                }
            }
            let sb = Arc::new(sb);
            table.insert(&sb);
            return Some((sb, has_setup));
        }
    }

    /// After a claim, outside the table's lock: the journal, metrics, event, timers; the
    /// claimer's setup, when it has one; and the pool's refill.
    fn claimed(self: &Arc<Self>, sb: &Arc<Sandbox>, pool: &str, setup: bool, claim: &Claim, started: Instant) {
        self.claims.append(claim);
        self.count_created(sb, false);
        self.metrics.pool_claims.get_or_create(&PoolLabel { pool: pool.to_string() }).inc();
        let message = Some(format!("claimed from pool `{pool}`"));
        if setup {
            self.metrics.moved(Some(SandboxState::Ready), SandboxState::Creating);
            self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Creating, None, message);
            let me = self.clone();
            let sb = sb.clone();
            self.tasks.spawn(async move { me.finish_claim(sb).await });
        } else {
            self.metrics.claim_latency.observe(started.elapsed().as_secs_f64());
            self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Ready, None, message);
            self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
        }
        self.refill(pool);
    }

    /// A claim the provider could not record: another server took the sandbox first (it is
    /// theirs now: forgotten here, not deleted), or the provider failed (the sandbox is ended,
    /// since whether anyone else holds it is unknown). The pool refills; the create is retried.
    async fn claim_lost(self: &Arc<Self>, sb: &Arc<Sandbox>, pool: &str, err: ProviderError) {
        match err {
            ProviderError::Claimed(message) => {
                tracing::info!(sandbox = sb.id(), pool, %message, "a pool sandbox was claimed elsewhere first");
                self.forget(sb);
            }
            other => {
                tracing::warn!(sandbox = sb.id(), pool, error = %other, "the provider could not record a claim");
                self.fail(sb, Reason::ProviderError, format!("its claim could not be recorded: {other}")).await;
            }
        }
        self.refill(pool);
    }

    /// Runs a claimer's setup commands in its claimed sandbox, then reports it ready.
    async fn finish_claim(self: Arc<Self>, sb: Arc<Sandbox>) {
        let Some(endpoint) = sb.lock().endpoint.clone() else { return };
        if let Err(msg) = self.run_setup(&sb, &endpoint, &sb.setup).await {
            self.fail(&sb, Reason::SetupFailed, msg).await;
            return;
        }
        if let Ok(prev) = sb.transition(SandboxState::Ready, None, None) {
            sb.lock().timers.call(Instant::now());
            self.metrics.moved(Some(prev), SandboxState::Ready);
            self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Ready, None, None);
            self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
        }
    }

    // ---- conditions ----

    /// The sandbox's signed conditions record: taken once (at readiness for `eval` sandboxes,
    /// at the first ask for others) and kept, then written with its accounting record.
    pub async fn conditions(&self, id: &str) -> ServerResult<SignedConditions> {
        let sb = self.get(id)?;
        let (state, endpoint, kept) = {
            let inner = sb.lock();
            (inner.state, inner.endpoint.clone(), inner.conditions.clone())
        };
        if let Some(kept) = kept {
            return Ok(kept);
        }
        let endpoint = match (state, endpoint) {
            (SandboxState::Ready, Some(e)) => e,
            (SandboxState::Queued | SandboxState::Creating, _) => {
                return Err(ServerError::Conflict(format!(
                    "sandbox `{id}` is {}; its conditions are recorded once it is ready",
                    state.as_str()
                )));
            }
            _ => return Err(sb.gone_error()),
        };
        let signed = self.take_conditions(&sb, &endpoint).await.map_err(ServerError::Unavailable)?;
        Ok(sb.lock().conditions.get_or_insert(signed).clone())
    }

    /// Asks the provider what it applied and the daemon what it observes, and signs the record.
    async fn take_conditions(&self, sb: &Sandbox, endpoint: &Endpoint) -> Result<SignedConditions, String> {
        let signer = self.signer.as_ref().map_err(Clone::clone)?;
        if self.settings.daemons == Daemons::Absent {
            return Err("this server's sandboxes have no daemon to observe them".into());
        }
        let applied = self
            .provider
            .applied(sb.id())
            .await
            .map_err(|e| format!("the provider could not say what it applied: {e}"))?;
        let observed: Observed = daemon::call_json::<(), _>(
            &self.daemons,
            endpoint,
            &sb.spec.token,
            http::Method::GET,
            "/v1/conditions",
            None,
        )
        .await
        .map_err(|e| format!("the daemon could not report what it observes: {e}"))?;
        let mismatches = conditions::mismatches(&applied, &observed);
        Ok(signer.sign(ConditionsRecord {
            sandbox: sb.id().to_string(),
            job: sb.spec.job.clone(),
            provider: self.provider.name().to_string(),
            isolation: Some(self.provider.isolation()),
            server_version: crate::api::VERSION.to_string(),
            recorded_ms: now_ms(),
            asked: Asked {
                image: sb.spec.image.clone(),
                resources: sb.spec.resources.clone(),
                profile: sb.spec.profile,
                network: sb.spec.network,
            },
            applied,
            observed,
            mismatches,
        }))
    }

    /// Whether a signed conditions record is intact and signed by this server.
    pub fn verify(&self, signed: &serde_json::Value) -> ServerResult<Verification> {
        let signer = self.signer.as_ref().map_err(|e| ServerError::Unavailable(e.clone()))?;
        Ok(signer.verify(signed))
    }

    // ---- metrics ----

    /// Brings the gauges computed on demand up to date (queue depth, achieved rate, pool
    /// sizes); called before every scrape.
    pub fn refresh_gauges(&self) {
        self.metrics.queue_depth.set(self.admission().queued() as i64);
        self.metrics.create_rate_achieved.set(self.meter().rate(Instant::now()));
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

    // ---- recovery and provider events ----

    /// Finds every sandbox in the provider's records again after a (re)start: claimed pool
    /// sandboxes as their claimers made them (from the claims file), unclaimed ones back in
    /// their pools, then refills the pools.
    pub async fn recover(self: &Arc<Self>) -> ServerResult<(usize, usize)> {
        let records = self.provider.list().await.map_err(ServerError::Provider)?;
        let mut claims = self.claims.take_found();
        // Without a journal (a first start) every running sandbox counts as ready.
        let journal = self.ready_journal.take_found();
        let mut ready_ids = Vec::new();
        let mut live_claims = Vec::new();
        let mut orphans = Vec::new();
        let (mut live, mut dead) = (0, 0);
        let now = Instant::now();
        let now_wall = now_ms();
        for record in records {
            // The provider's own record of a claim (Kubernetes keeps it on the pod) serves when
            // this server's claims file does not have it (a new state directory).
            let claim = claims.remove(&record.spec.id).or(record.claim);
            let spec = claim.as_ref().map_or(record.spec, |c| c.spec.clone());
            let age = Duration::from_millis(now_wall.saturating_sub(spec.created_at_ms));
            let lease = Duration::from_secs(spec.server.lease_s.max(1));
            let mut timers = Timers::new(
                now,
                lease,
                spec.server.idle_timeout_s.map(Duration::from_secs),
                spec.server.ttl_s.map(Duration::from_secs),
            );
            timers.created = now.checked_sub(age).unwrap_or(now);
            let mut sb = Sandbox::new(spec.clone(), self.backend(), SandboxState::Creating, timers);
            if let Some(c) = &claim {
                sb.env_overlay = Arc::new(c.env.clone());
                sb.claimed_ms = Some(c.claimed_ms);
                sb.pool_created_ms = Some(c.pool_created_ms);
            }
            let sb = Arc::new(sb);
            sb.lock().endpoint = Some(record.endpoint);
            {
                let mut table = self.table();
                if table.by_id.contains_key(&spec.id) {
                    continue;
                }
                table.insert(&sb);
            }
            self.metrics.moved(None, SandboxState::Creating);
            // A claimed sandbox was ready as a member of its pool.
            let was_ready = claim.is_some() || journal.as_ref().is_none_or(|j| j.contains(&spec.id));
            if !was_ready {
                dead += 1;
                // Its create never answered: a retry under its key makes a new one.
                sb.abandoned.store(true, std::sync::atomic::Ordering::Relaxed);
                let message = "the server stopped while creating it, before it was ready; create it again".to_string();
                if let Ok(prev) = sb.transition(SandboxState::Failed, Some(Reason::CreateInterrupted), Some(message)) {
                    self.ended(&sb, prev, None);
                }
                let me = self.clone();
                self.tasks.spawn(async move {
                    if let Err(e) = me.provider.delete(sb.id()).await {
                        tracing::warn!(sandbox = sb.id(), error = %e, "cannot remove a sandbox whose create was interrupted");
                    }
                });
                continue;
            }
            match record.ended.or_else(|| unrecoverable(&spec)) {
                Some(ended) => {
                    dead += 1;
                    self.fail(&sb, ended.reason, format!("found ended after a server restart: {}", ended.message))
                        .await;
                }
                None => {
                    live += 1;
                    self.learn_image_config(&sb).await;
                    if sb.transition(SandboxState::Ready, None, Some("recovered after a server restart".into())).is_ok()
                    {
                        ready_ids.push(spec.id.clone());
                        self.metrics.moved(Some(SandboxState::Creating), SandboxState::Ready);
                        self.events.emit(
                            sb.id(),
                            spec.job.as_deref(),
                            SandboxState::Ready,
                            None,
                            Some("recovered".into()),
                        );
                        self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
                        // Renew the daemon's lease now: it may have been counting down while
                        // the server was away.
                        self.renew_daemon_now(&sb);
                        if let Some(c) = claim {
                            live_claims.push(c);
                        } else if let Some(name) = sb.pool()
                            && !self.pools().adopt(name, sb.id(), &sb.spec)
                        {
                            orphans.push(sb.id().to_string());
                        }
                    }
                }
            }
        }
        self.claims.compact(&live_claims);
        self.ready_journal.compact(ready_ids.iter().map(String::as_str));
        self.release_in_background(orphans, "its pool is gone or full".into());
        self.refill_all();
        Ok((live, dead))
    }

    fn renew_daemon_now(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        self.renew_forcing(sb, true);
    }

    /// A line of progress on a create (an image pull): logged, and an event for whoever waits.
    fn provider_progress(&self, p: Progress) {
        let Ok(sb) = self.get(&p.id) else { return };
        if sb.state() != SandboxState::Creating {
            return;
        }
        tracing::info!(sandbox = p.id, message = p.message, "creating");
        self.events.emit_progress(
            sb.id(),
            sb.spec.job.as_deref(),
            sb.spec.server.idempotency_key.as_deref(),
            p.message,
        );
    }

    async fn provider_event(self: &Arc<Self>, ev: ProviderEvent) {
        let Ok(sb) = self.get(&ev.id) else { return };
        let state = sb.state();
        if state.is_terminal() || state == SandboxState::Releasing {
            return;
        }
        let reason = if state == SandboxState::Creating && ev.ended.reason == Reason::ProviderError {
            Reason::DaemonStartFailed
        } else {
            ev.ended.reason
        };
        tracing::warn!(sandbox = ev.id, %reason, message = ev.ended.message, "sandbox died");
        self.fail(&sb, reason, ev.ended.message).await;
    }

    // ---- the reaper ----

    fn schedule_check(&self, id: &str, at: Instant) {
        let earliest = {
            let mut s = self.schedule.lock().unwrap_or_else(PoisonError::into_inner);
            s.insert((at, id.to_string()));
            s.first().map(|(t, _)| *t) == Some(at)
        };
        if earliest {
            self.reaper_wake.notify_one();
        }
    }

    /// One task for every timer of every sandbox: it sleeps until the earliest scheduled check,
    /// re-reads that sandbox's timers, and reclaims it, reschedules it, or forgets it.
    async fn reaper(self: Arc<Self>) {
        loop {
            let next = self.schedule.lock().unwrap_or_else(PoisonError::into_inner).first().map(|(t, _)| *t);
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = self.reaper_wake.notified() => continue,
                _ = sleep => {}
            }
            let now = Instant::now();
            let due: Vec<String> = {
                let mut s = self.schedule.lock().unwrap_or_else(PoisonError::into_inner);
                let mut due = Vec::new();
                while let Some((t, _)) = s.first() {
                    if *t > now {
                        break;
                    }
                    if let Some((_, id)) = s.pop_first() {
                        due.push(id);
                    }
                }
                due
            };
            for id in due {
                self.check(&id, now).await;
            }
        }
    }

    async fn check(self: &Arc<Self>, id: &str, now: Instant) {
        let Ok(sb) = self.get(id) else { return };
        let (state, due, next, ended_at) = {
            let inner = sb.lock();
            (inner.state, inner.timers.due(now), inner.timers.next_check(now), inner.ended_at)
        };
        if state.is_terminal() {
            let retained_until = ended_at.map(|t| crate::sandbox::later(t, self.settings.gone_retention));
            if retained_until.is_some_and(|t| t <= now) {
                self.forget(&sb);
            } else if let Some(t) = retained_until {
                self.schedule_check(id, t);
            }
            return;
        }
        if state != SandboxState::Ready {
            return;
        }
        match due {
            // The pool keeps its unclaimed sandboxes: renew their leases, the daemon's too.
            Some(_) if sb.is_unclaimed_pool_member() => {
                sb.lock().timers.renew(now);
                self.renew_daemon_now(&sb);
                self.schedule_check(id, sb.lock().timers.next_deadline().0);
            }
            Some(reason) => {
                tracing::info!(sandbox = id, %reason, "reclaiming");
                let me = self.clone();
                let id = id.to_string();
                self.tasks.spawn(async move {
                    let _ = me.release(&id, reason).await;
                });
            }
            None => self.schedule_check(id, next),
        }
    }

    fn forget(&self, sb: &Sandbox) {
        let mut table = self.table();
        // A claimed pool sandbox replaced its pool's record of it under the same id.
        if table.by_id.get(sb.id()).is_some_and(|s| std::ptr::eq(s.as_ref(), sb)) {
            table.by_id.remove(sb.id());
        }
        if let Some(k) = &sb.spec.server.idempotency_key
            && table.by_key.get(k).map(String::as_str) == Some(sb.id())
        {
            table.by_key.remove(k);
        }
        if let Some(job) = &sb.spec.job
            && let Some(set) = table.by_job.get_mut(job)
        {
            set.remove(sb.id());
            if set.is_empty() {
                table.by_job.remove(job);
            }
        }
        self.metrics.forgotten(sb.state());
    }

    /// Number of sandboxes known, ended ones included.
    pub fn count(&self) -> usize {
        self.table().by_id.len()
    }

    /// Creates waiting for admission.
    pub fn queued(&self) -> usize {
        self.admission().queued()
    }

    /// Every sandbox known, ended ones included: a snapshot of the table for the dashboard's
    /// listing and summaries (`crate::ui`), which read it without holding the table's lock.
    pub fn snapshot(&self) -> Vec<Arc<Sandbox>> {
        self.table().by_id.values().cloned().collect()
    }

    /// Every job with a quota (PUT) or with sandboxes still known, by name.
    pub fn job_names(&self) -> Vec<String> {
        let mut names: BTreeSet<String> = self.table().by_job.keys().cloned().collect();
        names.extend(self.jobs().keys().cloned());
        names.into_iter().collect()
    }
}

/// Takes a waiting create off the admission queue when its caller goes away (the request is
/// dropped) before it is admitted: nothing is made for nobody. Disarmed once the wait ends.
struct AbandonGuard<'a> {
    service: &'a Arc<Service>,
    sb: &'a Arc<Sandbox>,
    armed: bool,
}

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        if !self.armed || self.sb.state() != SandboxState::Queued {
            return;
        }
        let message = "its caller went away while it was queued for admission".to_string();
        if self.service.cancel_queued(self.sb, Reason::Released, Some(message)) {
            self.sb.abandoned.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(sandbox = self.sb.id(), "a queued create's caller went away; taken off the queue");
        }
    }
}

/// Where a proxied call goes, and the claimer's environment merged into it.
#[derive(Debug)]
pub struct CallTarget {
    /// The call is under way while this lives: keep it until the answer has been sent.
    pub held: CallUnderWay,
    pub endpoint: Endpoint,
    pub token: String,
    pub env: Arc<BTreeMap<String, String>>,
    /// An `eval` sandbox: its commands may not change the environment eval fixes.
    pub eval: bool,
    /// The sandbox's default user, given to its commands that name none.
    pub user: Option<String>,
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

/// A create's `user`: a name or `uid`, optionally `:group` or `:gid`, as the daemon resolves it.
fn check_user(user: &str) -> ServerResult<()> {
    let ok_part = |p: &str| {
        !p.is_empty() && p.len() <= 64 && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    let ok = match user.split_once(':') {
        Some((u, g)) => ok_part(u) && ok_part(g),
        None => ok_part(user),
    };
    if ok {
        Ok(())
    } else {
        Err(ServerError::InvalidArgument(format!(
            "`user` `{user}` is not a user name or uid, optionally with `:group` or `:gid`"
        )))
    }
}

fn check_resources(r: &sandman_wire::server::Resources) -> ServerResult<()> {
    r.check_bounds().map_err(bad_number)
}

/// A record whose numbers no server could have written (an older server took any lease): it is
/// ended at start with the reason, and its remains removed, rather than served with timers that
/// cannot be computed.
fn unrecoverable(spec: &SandboxSpec) -> Option<sandman_provider::Ended> {
    let server = &spec.server;
    let daemon_lease = bounds::Bound::new(
        "daemon_lease_s",
        0,
        bounds::LEASE_S.max.saturating_add(DAEMON_LEASE_SLACK_S),
        bounds::Unit::Seconds,
    );
    // A lease of 0 is read as 1, as it always was.
    let checked = bounds::LEASE_S
        .check(server.lease_s.max(1))
        .and_then(|_| bounds::IDLE_TIMEOUT_S.check_opt(server.idle_timeout_s))
        .and_then(|()| bounds::TTL_S.check_opt(server.ttl_s))
        .and_then(|()| daemon_lease.check(spec.daemon_lease_s));
    checked.err().map(|e| sandman_provider::Ended {
        reason: Reason::ProviderError,
        message: format!("its record cannot be recovered: {e}"),
    })
}

/// A caller's number out of its range: `400 invalid_argument` naming the field and the range.
fn bad_number(e: bounds::OutOfRange) -> ServerError {
    ServerError::InvalidArgument(e.to_string())
}

fn check_env(env: &BTreeMap<String, String>) -> ServerResult<()> {
    for k in env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ServerError::InvalidArgument(format!("invalid environment variable name `{k}`")));
        }
    }
    Ok(())
}

fn check_setup(setup: &[String]) -> ServerResult<()> {
    if setup.len() > 64 {
        return Err(ServerError::InvalidArgument("`setup` takes at most 64 commands".into()));
    }
    if setup.iter().any(|c| c.trim().is_empty() || c.contains('\0')) {
        return Err(ServerError::InvalidArgument("every `setup` command must be a non-empty shell string".into()));
    }
    Ok(())
}

/// The last `n` characters of `text`.
fn tail(text: &str, n: usize) -> String {
    let count = text.chars().count();
    if count <= n {
        return text.to_string();
    }
    let skip: String = text.chars().skip(count - n).collect();
    format!("…{skip}")
}

fn new_id() -> String {
    format!("sb-{}", &random_hex()[..12])
}

/// Refuses a retried create whose idempotency key names a sandbox made from a different request:
/// answering that sandbox would hand the caller something it did not ask for.
fn same_request(sb: &Sandbox, req: &CreateSandbox) -> ServerResult<()> {
    let have = sb.to_wire();
    let mut differs = Vec::new();
    if have.image != req.image {
        differs.push("image");
    }
    if have.job != req.job {
        differs.push("job");
    }
    if have.profile != req.profile {
        differs.push("profile");
    }
    if have.network != req.network {
        differs.push("network");
    }
    if have.labels != req.labels {
        differs.push("labels");
    }
    if differs.is_empty() {
        return Ok(());
    }
    Err(ServerError::Conflict(format!(
        "idempotency key `{}` was used for sandbox `{}` with a different {}",
        req.idempotency_key.as_deref().unwrap_or_default(),
        have.id,
        differs.join(", ")
    )))
}

fn jobs_file(state_dir: &std::path::Path) -> PathBuf {
    state_dir.join("jobs.json")
}

fn load_jobs(state_dir: &std::path::Path) -> BTreeMap<String, JobEntry> {
    std::fs::read(jobs_file(state_dir)).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

fn save_jobs(state_dir: &std::path::Path, jobs: &BTreeMap<String, JobEntry>) {
    let path = jobs_file(state_dir);
    let tmp = path.with_extension("json.tmp");
    let result = serde_json::to_vec_pretty(jobs)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = result {
        tracing::error!(path = %path.display(), error = %e, "cannot save jobs");
    }
}

/// 128 random bits as hex, from the `getrandom` system call: no descriptor to run out of, and
/// no fallback (to a clock, say) that could hand two sandboxes the same id or a guessable token.
/// The server checks at start that the call works (`run`); it cannot fail after.
pub fn random_hex() -> String {
    let mut buf = [0u8; 16];
    if let Err(e) = crate::sys::random_bytes(&mut buf) {
        // Unreachable past the start-up check: getrandom(2) fails only where it does not exist.
        panic!("getrandom(2) failed after working at start: {e}");
    }
    hex::encode(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_provider::fake::FakeProvider;
    use sandman_wire::server::{PreparePhase, PrepareRequest};

    fn settings(dir: &std::path::Path) -> Settings {
        Settings {
            default_lease: Duration::from_secs(30),
            max_ttl: None,
            ready_timeout: Duration::from_secs(5),
            gone_retention: Duration::from_secs(60),
            ..Settings::new(dir.to_path_buf())
        }
    }

    fn service_with(settings: Settings) -> Arc<Service> {
        let dir = settings.state_dir.clone();
        let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("nowhere.sock"))));
        let s = Service::new(settings, provider, "t".into());
        s.start_background();
        s
    }

    fn service(dir: &std::path::Path) -> Arc<Service> {
        service_with(settings(dir))
    }

    /// A service whose fake sandboxes are ready as soon as the provider has made them, with a
    /// global create rate of `rate` a second, bursts of one.
    fn admitting(dir: &std::path::Path, rate: f64, max_queue: usize) -> Arc<Service> {
        service_with(Settings {
            create_rate: Some(rate),
            create_burst: 1.0,
            max_queue,
            daemons: Daemons::Absent,
            ..settings(dir)
        })
    }

    fn fake(s: &Service) -> &FakeProvider {
        match &s.provider {
            AnyProvider::Fake(f) => f,
            _ => unreachable!(),
        }
    }

    /// A sandbox already in the provider's records, found by `recover` and so ready at once.
    async fn ready_sandbox(
        s: &Arc<Service>,
        id: &str,
        job: Option<&str>,
        lease_s: u64,
        idle: Option<u64>,
        ttl: Option<u64>,
    ) {
        let mut spec = sandman_provider::conformance::spec(id, "any");
        spec.job = job.map(str::to_string);
        spec.created_at_ms = now_ms();
        spec.server = ServerMeta { lease_s, idle_timeout_s: idle, ttl_s: ttl, ..ServerMeta::default() };
        fake(s).create(&spec).await.unwrap_or_else(|e| panic!("{e}"));
        s.recover().await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.get(id).map(|sb| sb.state()).ok(), Some(SandboxState::Ready));
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    fn ended(s: &Service, id: &str) -> (SandboxState, Option<Reason>) {
        let w = s.get(id).map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
        (w.state, w.reason)
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_reclaims_unless_renewed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        ready_sandbox(&s, "sb-a", None, 10, None, None).await;
        tokio::time::advance(Duration::from_secs(8)).await;
        settle().await;
        s.keepalive("sb-a").unwrap_or_else(|e| panic!("{e}"));
        tokio::time::advance(Duration::from_secs(8)).await;
        settle().await;
        assert_eq!(ended(&s, "sb-a").0, SandboxState::Ready, "reclaimed although renewed 8 s ago");
        tokio::time::advance(Duration::from_secs(3)).await;
        settle().await;
        assert_eq!(ended(&s, "sb-a"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
        assert_eq!(fake(&s).count(), 0, "the provider still holds the reclaimed sandbox");
        // Calls on it answer gone with the reason, for the retention period, then not found.
        assert!(matches!(s.call_target("sb-a"), Err(ServerError::Gone { reason: Reason::LeaseExpired, .. })));
        tokio::time::advance(Duration::from_secs(61)).await;
        settle().await;
        assert!(matches!(s.get("sb-a"), Err(ServerError::NotFound(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timeout_and_lifetime_have_their_reasons() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        ready_sandbox(&s, "sb-idle", None, 1000, Some(20), None).await;
        ready_sandbox(&s, "sb-ttl", None, 1000, None, Some(30)).await;
        for _ in 0..4 {
            tokio::time::advance(Duration::from_secs(5)).await;
            settle().await;
            // Keepalives renew the lease but are not activity.
            let _ = s.keepalive("sb-idle");
            let _ = s.call_target("sb-ttl");
        }
        settle().await;
        assert_eq!(ended(&s, "sb-idle"), (SandboxState::Gone, Some(Reason::IdleExpired)));
        assert_eq!(ended(&s, "sb-ttl").0, SandboxState::Ready);
        tokio::time::advance(Duration::from_secs(11)).await;
        settle().await;
        assert_eq!(ended(&s, "sb-ttl"), (SandboxState::Gone, Some(Reason::TtlExpired)));
    }

    #[tokio::test(start_paused = true)]
    async fn one_heartbeat_keeps_a_whole_job_alive_and_delete_releases_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        for i in 0..5 {
            ready_sandbox(&s, &format!("sb-j{i}"), Some("train"), 10, None, None).await;
        }
        ready_sandbox(&s, "sb-other", Some("other"), 10, None, None).await;
        for _ in 0..3 {
            tokio::time::advance(Duration::from_secs(6)).await;
            settle().await;
            assert_eq!(s.heartbeat("train").map(|a| a.sandboxes).ok(), Some(5));
        }
        assert_eq!(ended(&s, "sb-other"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
        for i in 0..5 {
            assert_eq!(ended(&s, &format!("sb-j{i}")).0, SandboxState::Ready);
        }
        let action = s.delete_job("train").await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(action.sandboxes, 5);
        for i in 0..5 {
            assert_eq!(ended(&s, &format!("sb-j{i}")), (SandboxState::Gone, Some(Reason::JobDeleted)));
        }
        assert_eq!(fake(&s).count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_create_reports_its_reason_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        fake(&s).fail_image("ghost:latest");
        let req = CreateSandbox { image: "ghost:latest".into(), wait: true, ..Default::default() };
        match s.create(req).await {
            Err(ServerError::Failed { reason, message, .. }) => {
                assert_eq!(reason, Reason::ImagePullFailed);
                assert!(message.contains("ghost:latest"), "{message}");
            }
            other => panic!("expected a failed create, got {other:?}"),
        }
        assert_eq!(fake(&s).count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_spec_the_provider_cannot_run_is_refused_before_anything_exists() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        let req = CreateSandbox {
            image: sandman_provider::fake::UNSUPPORTED_IMAGE.into(),
            wait: false,
            ..Default::default()
        };
        let err = s.create(req).await.err().unwrap_or_else(|| panic!("accepted"));
        assert_eq!(err.code(), sandman_wire::ErrorCode::InvalidArgument);
        assert_eq!(s.count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reused_idempotency_key_with_another_request_is_a_conflict() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        let req = CreateSandbox {
            image: "any".into(),
            wait: false,
            idempotency_key: Some("k2".into()),
            ..Default::default()
        };
        s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
        let other = CreateSandbox { image: "other".into(), ..req };
        let err = s.create(other).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("different image"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_deleted_job_is_not_found() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        ready_sandbox(&s, "sb-d1", Some("gone-job"), 100, None, None).await;
        assert!(s.job("gone-job").is_ok());
        s.delete_job("gone-job").await.unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(s.job("gone-job"), Err(ServerError::NotFound(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn idempotent_creates_return_one_sandbox() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        let req = CreateSandbox {
            image: "any".into(),
            wait: false,
            idempotency_key: Some("k1".into()),
            ..Default::default()
        };
        let a = s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
        let b = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.id, b.id);
        settle().await;
        assert_eq!(fake(&s).count(), 1);
        assert_eq!(s.count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn job_quota_is_enforced_and_named() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        s.put_job("q", JobSpec { max_sandboxes: Some(2), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
        let req = CreateSandbox { image: "any".into(), wait: false, job: Some("q".into()), ..Default::default() };
        s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
        s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
        match s.create(req).await {
            Err(e @ ServerError::QuotaExceeded(_)) => assert!(e.to_string().contains("max_sandboxes"), "{e}"),
            other => panic!("expected quota_exceeded, got {other:?}"),
        }
        assert!(s.put_job("q", JobSpec { create_rate: Some(-5.0), ..Default::default() }).is_err());
        assert!(s.put_job("q", JobSpec { weight: Some(0.0), ..Default::default() }).is_err());
        assert!(s.put_job("q", JobSpec { create_rate: Some(5.0), weight: Some(2.0), ..Default::default() }).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_sandbox_the_provider_sees_die_is_failed_with_its_reason() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        ready_sandbox(&s, "sb-oom", None, 100, None, None).await;
        fake(&s).kill("sb-oom", Reason::OomKilled, "OOMKilled").await;
        settle().await;
        let w = s.get("sb-oom").map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (w.state, w.reason, w.message.as_deref()),
            (SandboxState::Failed, Some(Reason::OomKilled), Some("OOMKilled"))
        );
    }

    fn create_req(job: Option<&str>, wait: bool) -> CreateSandbox {
        CreateSandbox { image: "any".into(), wait, job: job.map(str::to_string), ..Default::default() }
    }

    fn states_of(s: &Service, job: &str) -> HashMap<SandboxState, usize> {
        let mut out = HashMap::new();
        let q = ListQuery { job: Some(job.into()), ..Default::default() };
        for sb in s.list(&q).unwrap_or_default() {
            *out.entry(sb.state).or_default() += 1;
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn two_jobs_queueing_share_the_create_rate_by_weight() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 100.0, 100_000);
        s.put_job("light", JobSpec { weight: Some(1.0), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
        s.put_job("heavy", JobSpec { weight: Some(3.0), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
        let mut ids = HashSet::new();
        for _ in 0..1500 {
            for job in ["light", "heavy"] {
                let sb = s.create(create_req(Some(job), false)).await.unwrap_or_else(|e| panic!("{e}"));
                assert!(ids.insert(sb.id));
            }
        }
        // 10 s of a 100/s rate: about 1000 creates, while both jobs still queue.
        tokio::time::sleep(Duration::from_secs(10)).await;
        settle().await;
        let light = states_of(&s, "light").get(&SandboxState::Ready).copied().unwrap_or(0) as f64;
        let heavy = states_of(&s, "heavy").get(&SandboxState::Ready).copied().unwrap_or(0) as f64;
        assert!((light + heavy - 1000.0).abs() <= 3.0, "the global rate was not held: {}", light + heavy);
        let ratio = heavy / light;
        assert!((ratio - 3.0).abs() / 3.0 < 0.10, "heavy/light = {ratio} ({light} vs {heavy})");
        assert_eq!(fake(&s).count() as f64, light + heavy, "every admitted create made exactly one sandbox");
        assert_eq!(s.queued() as f64, 3000.0 - light - heavy);
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_queue_bound_a_create_is_refused_with_a_retry_time() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1.0, 5);
        for _ in 0..6 {
            s.create(create_req(None, false)).await.unwrap_or_else(|e| panic!("{e}"));
        }
        match s.create(create_req(None, false)).await {
            Err(ServerError::QueueFull { queued: 5, retry_after_s }) => assert!(retry_after_s >= 1),
            other => panic!("expected a full queue, got {other:?}"),
        }
        assert_eq!(s.count(), 6, "the refused create left nothing behind");
    }

    #[tokio::test(start_paused = true)]
    async fn a_create_still_queued_at_its_wait_timeout_is_taken_off_the_queue() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 0.1, 100);
        s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
        let req = CreateSandbox { wait_timeout_s: Some(2), ..create_req(Some("j"), true) };
        match s.create(req).await {
            Err(ServerError::Timeout(m)) => assert!(m.contains("queue_timeout"), "{m}"),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert_eq!(states_of(&s, "j").get(&SandboxState::Gone), Some(&1));
        let gone = s.list(&ListQuery { job: Some("j".into()), ..Default::default() }).unwrap_or_default();
        assert_eq!(gone[0].reason, Some(Reason::QueueTimeout));
        assert_eq!(s.queued(), 0);
        tokio::time::sleep(Duration::from_secs(20)).await;
        let made = fake(&s).list().await.unwrap_or_default();
        assert_eq!(made.len(), 1);
        assert!(made.iter().all(|r| r.spec.job.is_none()), "the timed-out create was made anyway");
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_create_whose_caller_goes_away_is_taken_off_the_queue_and_a_retry_starts_anew() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 0.1, 100);
        s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
        let req = CreateSandbox { idempotency_key: Some("k".into()), ..create_req(Some("j"), true) };
        let waiting = {
            let (s, req) = (s.clone(), req.clone());
            tokio::spawn(async move { s.create(req).await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(s.queued(), 1);
        // The caller hangs up: its request future is dropped.
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(s.queued(), 0);
        let gone = s.list(&ListQuery { job: Some("j".into()), ..Default::default() }).unwrap_or_default();
        assert_eq!((gone.len(), gone[0].state, gone[0].reason), (1, SandboxState::Gone, Some(Reason::Released)));
        assert!(gone[0].message.as_deref().is_some_and(|m| m.contains("went away")), "{:?}", gone[0].message);
        // A retry with the same key is a new create, not the abandoned one.
        let retry = s.create(CreateSandbox { wait: false, ..req }).await.unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(retry.id, gone[0].id);
        assert_eq!(retry.state, SandboxState::Queued);
        tokio::time::sleep(Duration::from_secs(30)).await;
        let made: Vec<String> = fake(&s).list().await.unwrap_or_default().into_iter().map(|r| r.spec.id).collect();
        assert!(made.contains(&retry.id) && !made.contains(&gone[0].id), "{made:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn queued_creates_hear_their_place_move_a_few_times_not_at_every_admission() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 10.0, 10_000);
        let mut ids = Vec::new();
        for _ in 0..200 {
            ids.push(s.create(create_req(Some("q"), false)).await.unwrap_or_else(|e| panic!("{e}")).id);
        }
        tokio::time::sleep(Duration::from_secs(25)).await;
        let events = s.events.list(&crate::events::Filter { job: Some("q"), idempotency_key: None }, 0);
        let told = |id: &str| -> Vec<u64> {
            events
                .iter()
                .filter(|e| e.sandbox == id && e.state == Some(SandboxState::Queued))
                .filter_map(|e| e.queue_position)
                .collect()
        };
        let last = told(&ids[199]);
        // First told its place at the back, then told again as it moved up, always forward.
        assert!(last.len() >= 4, "{last:?}");
        assert!(last.windows(2).all(|w| w[1] < w[0]), "{last:?}");
        assert!(last[0] >= 190 && *last.last().unwrap_or(&u64::MAX) <= 10, "{last:?}");
        // About log2(position) times each, not once per admission (that would be ~20,000).
        let all: usize = ids.iter().map(|id| told(id).len()).sum();
        assert!(all < 200 * 10, "{all}");
        let waits: Vec<u64> = events
            .iter()
            .filter(|e| e.sandbox == ids[199] && e.state == Some(SandboxState::Queued))
            .filter_map(|e| e.estimated_wait_ms)
            .collect();
        assert!(waits.windows(2).all(|w| w[1] < w[0]), "{waits:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_job_create_rate_and_quota_hold_while_others_go_on() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        let spec = JobSpec { max_sandboxes: Some(30), create_rate: Some(2.0), ..Default::default() };
        s.put_job("capped", spec).unwrap_or_else(|e| panic!("{e}"));
        for _ in 0..30 {
            s.create(create_req(Some("capped"), false)).await.unwrap_or_else(|e| panic!("{e}"));
        }
        // Queued creates count against the quota.
        match s.create(create_req(Some("capped"), false)).await {
            Err(e @ ServerError::QuotaExceeded(_)) => assert!(e.to_string().contains("max_sandboxes"), "{e}"),
            other => panic!("expected quota_exceeded, got {other:?}"),
        }
        for _ in 0..50 {
            s.create(create_req(Some("free"), false)).await.unwrap_or_else(|e| panic!("{e}"));
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        settle().await;
        // Its bucket: 2 at once, then 2 a second.
        let capped = states_of(&s, "capped").get(&SandboxState::Ready).copied().unwrap_or(0);
        assert!((11..=13).contains(&capped), "capped job got {capped} in 5 s");
        assert_eq!(states_of(&s, "free").get(&SandboxState::Ready), Some(&50));
    }

    #[tokio::test(start_paused = true)]
    async fn a_job_deleted_mid_burst_releases_what_it_had_and_what_it_queued() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 10.0, 10_000);
        for _ in 0..100 {
            s.create(create_req(Some("doomed"), false)).await.unwrap_or_else(|e| panic!("{e}"));
            s.create(create_req(Some("other"), false)).await.unwrap_or_else(|e| panic!("{e}"));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        settle().await;
        let before = states_of(&s, "doomed");
        assert!(before.get(&SandboxState::Ready).is_some_and(|n| *n >= 5), "{before:?}");
        assert!(before.get(&SandboxState::Queued).is_some_and(|n| *n >= 80), "{before:?}");
        let action = s.delete_job("doomed").await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(action.sandboxes, 100);
        let after = s.list(&ListQuery { job: Some("doomed".into()), ..Default::default() }).unwrap_or_default();
        assert!(after.iter().all(|sb| sb.state == SandboxState::Gone && sb.reason == Some(Reason::JobDeleted)));
        tokio::time::sleep(Duration::from_secs(10)).await;
        settle().await;
        let made: Vec<_> = fake(&s).list().await.unwrap_or_default();
        assert!(made.iter().all(|r| r.spec.job.as_deref() == Some("other")), "a deleted job's create was made");
        assert_eq!(s.job_usage("other").map(|u| u.live).ok(), Some(100));
    }

    fn pool_spec(min: u64) -> PoolSpec {
        PoolSpec { image: "any".into(), min_ready: min, ..Default::default() }
    }

    async fn pool_ready(s: &Service, name: &str) -> u64 {
        settle().await;
        s.pool(name).map(|p| p.ready).unwrap_or(0)
    }

    #[tokio::test(start_paused = true)]
    async fn a_pool_fills_claims_hand_out_distinct_sandboxes_and_it_refills() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        s.put_pool("warm", pool_spec(20)).unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(pool_ready(&s, "warm").await, 20);
        let mut claims = Vec::new();
        for i in 0..20 {
            let s = s.clone();
            claims.push(tokio::spawn(async move {
                let req = CreateSandbox {
                    pool: Some("warm".into()),
                    image: String::new(),
                    job: Some("j".into()),
                    labels: BTreeMap::from([("n".to_string(), i.to_string())]),
                    env: BTreeMap::from([("TASK".to_string(), i.to_string())]),
                    ..Default::default()
                };
                s.create(req).await.unwrap_or_else(|e| panic!("{e}"))
            }));
        }
        let mut ids = HashSet::new();
        for c in claims {
            let sb = c.await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(sb.state, SandboxState::Ready);
            assert_eq!(sb.labels.get(POOL_LABEL).map(String::as_str), Some("warm"));
            let n = sb.labels.get("n").cloned().unwrap_or_default();
            let target = s.call_target(&sb.id).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(target.env.get("TASK"), Some(&n), "the claimer's env is kept for its calls");
            assert!(ids.insert(sb.id), "a sandbox was handed out twice");
        }
        assert_eq!(s.job("j").map(|j| j.live).ok(), Some(20));
        let p = s.pool("warm").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.claimed, p.claims), (20, 20));
        // Claims made no sandbox of their own: 20 made to fill, 20 to refill.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(pool_ready(&s, "warm").await, 20);
        assert_eq!(fake(&s).count(), 40);
        // A claimed sandbox is its job's: its lease reclaims it, while the pool's idle ones stay.
        tokio::time::sleep(Duration::from_secs(31)).await;
        settle().await;
        // Never PUT and with no live sandbox left, the job no longer exists.
        assert!(matches!(s.job("j"), Err(ServerError::NotFound(_))));
        assert_eq!(pool_ready(&s, "warm").await, 20);
        // Deleting the pool releases its unclaimed sandboxes.
        s.delete_pool("warm").unwrap_or_else(|e| panic!("{e}"));
        settle().await;
        assert_eq!(fake(&s).count(), 0);
        assert!(s.pool("warm").is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn an_autoscaled_pool_keeps_what_demand_asks_for_within_its_bounds() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        fake(&s).set_create_delay(Duration::from_secs(2));
        let spec = PoolSpec { max: Some(40), autoscale: true, ..pool_spec(2) };
        s.put_pool("auto", spec).unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_secs(3)).await;
        let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.ready, p.target, p.claim_rate), (2, 2, Some(0.0)), "{p:?}");
        // 10 creates a second for 40 s (the rate is over the last 30 s), each refill taking 2 s:
        // about 20 wanted at once.
        let claim =
            || CreateSandbox { pool: Some("auto".into()), image: String::new(), wait: false, ..Default::default() };
        for _ in 0..400 {
            s.create(claim()).await.unwrap_or_else(|e| panic!("{e}"));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
        let rate = p.claim_rate.unwrap_or(0.0);
        let refill = p.refill_seconds.unwrap_or(0.0);
        assert!((9.0..=11.0).contains(&rate), "{p:?}");
        assert!((1.9..=2.3).contains(&refill), "{p:?}");
        assert!((18..=24).contains(&p.target), "{p:?}");
        assert!(p.ready + p.creating >= p.target - 1, "not refilling to its target: {p:?}");
        // A burst past the bound is held to `max`.
        for _ in 0..600 {
            s.create(claim()).await.unwrap_or_else(|e| panic!("{e}"));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.target, 40, "{p:?}");
        assert!(p.ready + p.creating <= 40, "{p:?}");
        // Demand gone, the target falls back to `min_ready`.
        tokio::time::sleep(Duration::from_secs(40)).await;
        let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.target, p.claim_rate), (2, Some(0.0)), "{p:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pool_sandbox_another_server_claimed_first_is_left_to_it_and_another_is_claimed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        s.put_pool("warm", pool_spec(3)).unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(pool_ready(&s, "warm").await, 3);
        fake(&s).claim_elsewhere(2);
        let req = CreateSandbox {
            pool: Some("warm".into()),
            image: String::new(),
            job: Some("j".into()),
            ..Default::default()
        };
        let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
        let lost = fake(&s).claimed_elsewhere();
        assert_eq!(lost.len(), 2);
        assert!(!lost.contains(&sb.id));
        assert_eq!((sb.state, sb.labels.get(POOL_LABEL).map(String::as_str)), (SandboxState::Ready, Some("warm")));
        // The claim is in the provider's records; the lost ones are the other server's: not
        // deleted, not known here any more.
        let records = fake(&s).list().await.unwrap_or_default();
        let mine = records.iter().find(|r| r.spec.id == sb.id).and_then(|r| r.claim.clone());
        assert_eq!(mine.map(|c| c.spec.job), Some(Some("j".to_string())));
        for id in &lost {
            assert!(records.iter().any(|r| &r.spec.id == id), "a sandbox claimed elsewhere was deleted");
            assert!(matches!(s.get(id), Err(ServerError::NotFound(_))), "{id} is still known here");
        }
        assert_eq!(s.job("j").map(|j| j.live).ok(), Some(1));
        // The pool makes up for all three.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(pool_ready(&s, "warm").await, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_the_provider_kept_is_recovered_without_the_claims_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        // A pool sandbox claimed by an earlier server whose state directory is gone: no pools,
        // no claims file here, only what the provider kept.
        let mut pooled = sandman_provider::conformance::spec("sb-pooled", "any");
        pooled.labels = BTreeMap::from([(POOL_LABEL.to_string(), "gone-pool".to_string())]);
        pooled.created_at_ms = now_ms();
        pooled.server = ServerMeta { lease_s: 600, ..Default::default() };
        fake(&s).create(&pooled).await.unwrap_or_else(|e| panic!("{e}"));
        let mut claimed = pooled.clone();
        claimed.job = Some("j".into());
        claimed.labels.insert("task".into(), "7".into());
        let claim = Claim {
            spec: claimed,
            env: BTreeMap::from([("TASK".to_string(), "7".to_string())]),
            claimed_ms: now_ms(),
            pool_created_ms: pooled.created_at_ms,
        };
        fake(&s).claim(&claim).await.unwrap_or_else(|e| panic!("{e}"));
        s.recover().await.unwrap_or_else(|e| panic!("{e}"));
        settle().await;
        let sb = s.get("sb-pooled").map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((sb.state, sb.job.as_deref()), (SandboxState::Ready, Some("j")));
        assert_eq!(s.call_target("sb-pooled").map(|t| t.env.get("TASK").cloned()).ok(), Some(Some("7".into())));
        // Not an orphan of a pool this server does not know: still in the provider.
        assert_eq!(fake(&s).count(), 1);
    }

    /// A record an older server wrote with a lease no timer can hold: before, the restarted
    /// server panicked at start and stayed down. Now it is ended with the reason, its remains
    /// removed, and everything else served.
    #[tokio::test(start_paused = true)]
    async fn a_restart_after_an_unrecoverable_record_reports_it_ended_and_serves() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        let mut bad = sandman_provider::conformance::spec("sb-huge", "any");
        bad.created_at_ms = now_ms();
        bad.daemon_lease_s = 59; // what `u64::MAX + 60` wrapped to
        bad.server = ServerMeta { lease_s: u64::MAX, ttl_s: Some(u64::MAX), ..Default::default() };
        fake(&s).create(&bad).await.unwrap_or_else(|e| panic!("{e}"));
        let mut good = sandman_provider::conformance::spec("sb-good", "any");
        good.created_at_ms = now_ms();
        good.server = ServerMeta { lease_s: 600, ..Default::default() };
        fake(&s).create(&good).await.unwrap_or_else(|e| panic!("{e}"));
        let (live, dead) = s.recover().await.unwrap_or_else(|e| panic!("{e}"));
        settle().await;
        assert_eq!((live, dead), (1, 1));
        let sb = s.get("sb-huge").map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((sb.state, sb.reason), (SandboxState::Failed, Some(Reason::ProviderError)));
        let message = sb.message.unwrap_or_default();
        assert!(
            message.contains("cannot be recovered") && message.contains("`lease_s` is 18446744073709551615"),
            "{message}"
        );
        // Its remains are gone; the good one, the list and the reaper go on.
        assert_eq!(fake(&s).count(), 1);
        let listed = s.list(&ListQuery::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(listed.len(), 2);
        tokio::time::advance(Duration::from_secs(601)).await;
        settle().await;
        assert_eq!(ended(&s, "sb-good"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
    }

    /// Timers saturate rather than overflow, whatever a record holds.
    #[tokio::test(start_paused = true)]
    async fn timers_of_any_length_never_overflow() {
        let t0 = Instant::now();
        let t = Timers::new(t0, Duration::MAX, Some(Duration::MAX), Some(Duration::from_secs(u64::MAX)));
        assert!(t.next_deadline().0 > t0 + Duration::from_secs(365 * 86400));
        assert_eq!(t.due(t0 + Duration::from_secs(86400)), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_create_matching_a_pool_claims_from_it_and_a_pool_that_cannot_fill_backs_off() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        s.put_pool("warm", pool_spec(2)).unwrap_or_else(|e| panic!("{e}"));
        settle().await;
        let sb = s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sb.labels.get(POOL_LABEL).map(String::as_str), Some("warm"), "not claimed");
        fake(&s).fail_image("ghost");
        s.put_pool("broken", PoolSpec { image: "ghost".into(), min_ready: 3, ..Default::default() })
            .unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_secs(30)).await;
        settle().await;
        let p = s.pool("broken").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.ready, 0);
        assert!(p.last_error.is_some_and(|e| e.contains("ghost")));
        // Backing off: a handful of tries in 30 s, not a hot loop.
        let failed = s.metrics.encode();
        let tries = failed
            .lines()
            .find(|l| l.starts_with("sandman_sandboxes_ended_total{reason=\"image_pull_failed\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        assert!((3..=40).contains(&tries), "{tries} failed refills in 30 s");
    }

    #[tokio::test(start_paused = true)]
    async fn setup_commands_that_cannot_run_fail_the_sandbox_with_their_reason() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        let req = CreateSandbox { setup: vec!["pip install x".into()], ..create_req(Some("j"), true) };
        match s.create(req).await {
            Err(ServerError::Failed { reason: Reason::SetupFailed, message, .. }) => {
                assert!(message.contains("pip install x"), "{message}")
            }
            other => panic!("expected setup_failed, got {other:?}"),
        }
        settle().await;
        assert_eq!(fake(&s).count(), 0);
        let u = s.job_usage("j").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((u.sandboxes, u.by_reason.get("setup_failed")), (1, Some(&1)));
    }

    #[tokio::test(start_paused = true)]
    async fn prepare_reports_each_image_and_each_node() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        fake(&s).fail_image("ghost");
        fake(&s).set_nodes(3, Duration::from_secs(1));
        let req = PrepareRequest {
            images: vec!["any".into(), "ghost".into(), sandman_provider::fake::UNSUPPORTED_IMAGE.into()],
            job: Some("j".into()),
            hold_until: None,
        };
        let out = s.prepare(req).await.unwrap_or_else(|e| panic!("{e}"));
        let oks: Vec<bool> = out.images.iter().map(|i| i.ok).collect();
        assert_eq!(oks, [true, false, false]);
        assert_eq!((out.images[0].nodes_ready, out.images[0].nodes_total), (3, 3));
        assert!(out.images[1].message.as_deref().is_some_and(|m| m.contains("pull access denied")));
        let events = s.events.list(&crate::events::Filter { job: Some("j"), idempotency_key: None }, 0);
        assert!(events.iter().all(|e| e.kind == sandman_wire::server::EventKind::Prepare && e.image.is_some()));
        let ready: Vec<(Option<u32>, Option<u32>)> = events
            .iter()
            .filter(|e| e.phase == Some(PreparePhase::Pulling) && e.message.as_deref() == Some("any is ready"))
            .map(|e| (e.nodes_ready, e.nodes_total))
            .collect();
        assert_eq!(ready, [(Some(1), Some(3)), (Some(2), Some(3)), (Some(3), Some(3))]);
        // Started and an end for each image, and a pulling and a ready line per node for `any`.
        assert_eq!(events.len(), 6 + 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_prepare_holds_its_jobs_creates_until_enough_nodes_have_the_image() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        fake(&s).set_nodes(4, Duration::from_secs(10));
        let bad = PrepareRequest { images: vec!["host".into()], job: None, hold_until: Some(0.5) };
        assert!(matches!(s.prepare(bad).await, Err(ServerError::InvalidArgument(_))));
        let bad = PrepareRequest { images: vec!["host".into()], job: Some("j".into()), hold_until: Some(1.5) };
        assert!(matches!(s.prepare(bad).await, Err(ServerError::InvalidArgument(_))));

        let started = Instant::now();
        let prep = {
            let s = s.clone();
            let req = PrepareRequest { images: vec!["any".into()], job: Some("j".into()), hold_until: Some(0.5) };
            tokio::spawn(async move { s.prepare(req).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        // A held create waits as long as its wait_timeout_s allows (the ready timeout is 10 s).
        let held = CreateSandbox { wait_timeout_s: Some(60), ..create_req(Some("j"), true) };
        let (held, other) = tokio::join!(s.create(held), s.create(create_req(Some("k"), true)));
        let held = held.unwrap_or_else(|e| panic!("{e}"));
        other.unwrap_or_else(|e| panic!("{e}"));
        // Two of the four nodes have it after 20 s: the held create went on then, not before.
        assert_eq!(held.state, SandboxState::Ready);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(20) && waited < Duration::from_secs(30), "{waited:?}");
        let out = prep.await.unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((out.images[0].nodes_ready, out.images[0].nodes_total), (4, 4));
        // The gate is gone with the prepare: a later create is not held.
        let again = Instant::now();
        s.create(create_req(Some("j"), true)).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(again.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn every_ended_sandbox_has_an_accounting_record() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        let a = s.create(create_req(Some("acct"), true)).await.unwrap_or_else(|e| panic!("{e}"));
        let _b = s.create(create_req(Some("acct"), true)).await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_secs(3)).await;
        s.release(&a.id, Reason::Released).await.unwrap_or_else(|e| panic!("{e}"));
        s.delete_job("acct").await.unwrap_or_else(|e| panic!("{e}"));
        let u = s.job_usage("acct").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((u.sandboxes, u.live), (2, 0));
        assert_eq!((u.by_reason.get("released"), u.by_reason.get("job_deleted")), (Some(&1), Some(&1)));
        let lines = std::fs::read_to_string(dir.path().join(crate::accounting::FILE)).unwrap_or_default();
        let recs: Vec<UsageRecord> = lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        assert_eq!(recs.len(), 2);
        assert!(recs.iter().all(|r| r.provider == "fake" && r.ready_ms.is_some() && r.cpu_seconds.is_none()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pulls_progress_is_an_event_of_its_create_tagged_with_the_idempotency_key() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = admitting(dir.path(), 1000.0, 10_000);
        fake(&s).pull_progress("slow:1", &["pulling slow:1: 0/2 layers", "pulling slow:1: 1/2 layers, 3/8 MiB"]);
        let mut live = s.events.subscribe();
        let req = CreateSandbox {
            image: "slow:1".into(),
            idempotency_key: Some("k-1".into()),
            job: Some("j".into()),
            wait: true,
            ..Default::default()
        };
        let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sb.state, SandboxState::Ready);
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let e = tokio::time::timeout(Duration::from_secs(5), live.recv())
                .await
                .unwrap_or_else(|_| panic!("no progress event; saw {seen:?}"))
                .unwrap_or_else(|e| panic!("{e}"));
            if e.idempotency_key.is_some() {
                seen.push(e);
            }
        }
        let filter = crate::events::Filter { job: None, idempotency_key: Some("k-1") };
        let listed = s.events.list(&filter, 0);
        assert_eq!(listed, seen, "GET /v1/events?idempotency_key= lists what followers saw");
        for e in &listed {
            assert_eq!(
                (e.sandbox.as_str(), e.state, e.job.as_deref()),
                (sb.id.as_str(), Some(SandboxState::Creating), Some("j"))
            );
        }
        assert_eq!(listed[1].message.as_deref(), Some("pulling slow:1: 1/2 layers, 3/8 MiB"));
        // Another create's events are not tagged: the filter leaves them out.
        s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.events.list(&filter, 0).len(), 2);
    }
}

//! `Service`, the control plane's state and lifecycle: creating sandboxes (idempotently),
//! bringing them to ready, releasing and reclaiming them with a reason, jobs and heartbeats,
//! recovery from the provider's records after a restart, and the one reaper for every timer.
//! Start at [`Service::create`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sandman_provider::{Endpoint, Provider, ProviderEvent, SandboxSpec, ServerMeta};
use sandman_wire::server::{
    CreateSandbox, Job, JobAction, JobSpec, ListQuery, Reason, Sandbox as WireSandbox, SandboxState,
};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::{self, DaemonClient};
use crate::error::{ServerError, ServerResult};
use crate::events::Events;
use crate::metrics::{Metrics, ProviderLabel};
use crate::provider::AnyProvider;
use crate::sandbox::{Sandbox, Timers, now_ms};

/// The server's settings, from `ServeArgs`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub default_lease: Duration,
    pub max_ttl: Option<Duration>,
    pub ready_timeout: Duration,
    pub gone_retention: Duration,
    /// Where jobs are kept across restarts.
    pub state_dir: PathBuf,
}

/// Extra time the daemon's own lease gets beyond the server's, so the server reclaims first.
pub const DAEMON_LEASE_SLACK_S: u64 = 60;
/// Daemon keepalives the server sends at once on behalf of heartbeats.
const KEEPALIVE_CONCURRENCY: usize = 64;

#[derive(Debug, Default)]
struct Table {
    by_id: HashMap<String, Arc<Sandbox>>,
    /// idempotency key → sandbox id.
    by_key: HashMap<String, String>,
    /// job → its sandboxes (ended ones too, until forgotten).
    by_job: HashMap<String, HashSet<String>>,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct JobEntry {
    spec: JobSpec,
    created: u64,
    last_heartbeat_ms: Option<u64>,
}

#[derive(Debug)]
pub struct Service {
    pub settings: Settings,
    pub provider: AnyProvider,
    pub token: String,
    /// Every sandbox known, with its indexes. Never held across `.await`.
    table: Mutex<Table>,
    /// Jobs by name. Never held across `.await`.
    jobs: Mutex<BTreeMap<String, JobEntry>>,
    pub events: Events,
    pub metrics: Metrics,
    pub daemons: DaemonClient,
    /// Creates in flight, reclaims, keepalives: every task the service spawns.
    pub tasks: TaskTracker,
    pub cancel: CancellationToken,
    /// When each sandbox should next be looked at by the reaper: (when, id). A renewal does not
    /// touch it; the reaper re-reads the timers when the entry comes due and reschedules.
    schedule: Mutex<BTreeSet<(Instant, String)>>,
    /// Wakes the reaper when an earlier entry is scheduled.
    reaper_wake: Notify,
    keepalives: Arc<Semaphore>,
}

impl Service {
    pub fn new(settings: Settings, provider: AnyProvider, token: String) -> Arc<Self> {
        let jobs = load_jobs(&settings.state_dir);
        Arc::new(Service {
            settings,
            provider,
            token,
            table: Mutex::default(),
            jobs: Mutex::new(jobs),
            events: Events::default(),
            metrics: Metrics::default(),
            daemons: daemon::client(),
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
            schedule: Mutex::default(),
            reaper_wake: Notify::new(),
            keepalives: Arc::new(Semaphore::new(KEEPALIVE_CONCURRENCY)),
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn jobs(&self) -> MutexGuard<'_, BTreeMap<String, JobEntry>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the reaper and the watcher of provider events.
    pub fn start_background(self: &Arc<Self>) {
        let me = self.clone();
        self.tasks.spawn(async move { me.reaper().await });
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

    /// Checks a create request and turns it into a spec.
    fn parse_create(
        &self,
        req: &CreateSandbox,
    ) -> ServerResult<(SandboxSpec, Duration, Option<Duration>, Option<Duration>)> {
        if req.image.trim().is_empty() {
            return Err(ServerError::InvalidArgument("`image` is required".into()));
        }
        if let Some(p) = &req.provider
            && p != self.provider.name()
        {
            return Err(ServerError::InvalidArgument(format!(
                "provider `{p}` is not served here; this server runs the `{}` provider",
                self.provider.name()
            )));
        }
        if req.pool.is_some() {
            return Err(ServerError::InvalidArgument("warm pools are not available on this server".into()));
        }
        for (name, q) in [("cpu", &req.resources.cpu), ("memory", &req.resources.memory), ("disk", &req.resources.disk)]
        {
            if let Some(q) = q {
                q.value().map_err(|e| ServerError::InvalidArgument(format!("resources.{name}: {e}")))?;
            }
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ServerError::InvalidArgument(format!("invalid environment variable name `{k}`")));
            }
        }
        for k in req.labels.keys() {
            if k.is_empty() || k.len() > 63 || !k.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c)) {
                return Err(ServerError::InvalidArgument(format!("invalid label key `{k}`")));
            }
        }
        if let Some(job) = &req.job
            && (job.is_empty() || job.contains('/'))
        {
            return Err(ServerError::InvalidArgument(format!("invalid job name `{job}`")));
        }
        let job_lease = req.job.as_ref().and_then(|j| self.jobs().get(j).and_then(|e| e.spec.lease_s));
        let lease_s = req.lease_s.or(job_lease).unwrap_or(self.settings.default_lease.as_secs());
        if lease_s == 0 {
            return Err(ServerError::InvalidArgument("`lease_s` must be at least 1".into()));
        }
        let ttl = match (req.ttl_s, self.settings.max_ttl) {
            (Some(t), Some(max)) if Duration::from_secs(t) > max => {
                return Err(ServerError::InvalidArgument(format!(
                    "`ttl_s` {t} is over this server's maximum of {}",
                    max.as_secs()
                )));
            }
            (Some(0), _) => return Err(ServerError::InvalidArgument("`ttl_s` must be at least 1".into())),
            (Some(t), _) => Some(Duration::from_secs(t)),
            (None, max) => max,
        };
        let idle = match req.idle_timeout_s {
            Some(0) => return Err(ServerError::InvalidArgument("`idle_timeout_s` must be at least 1".into())),
            other => other.map(Duration::from_secs),
        };
        let id = format!("sb-{}", &random_hex()[..12]);
        let spec = SandboxSpec {
            id,
            image: req.image.clone(),
            resources: req.resources.clone(),
            env: req.env.clone(),
            labels: req.labels.clone(),
            job: req.job.clone(),
            profile: req.profile,
            network: req.network,
            token: random_hex(),
            daemon_lease_s: lease_s + DAEMON_LEASE_SLACK_S,
            created_at_ms: now_ms(),
            server: ServerMeta {
                lease_s,
                idle_timeout_s: req.idle_timeout_s,
                ttl_s: ttl.map(|t| t.as_secs()),
                idempotency_key: req.idempotency_key.clone(),
            },
        };
        Ok((spec, Duration::from_secs(lease_s), idle, ttl))
    }

    /// Creates a sandbox (or finds the one created under the same idempotency key) and, unless
    /// `wait` is false, answers once it is ready or has failed.
    pub async fn create(self: &Arc<Self>, req: CreateSandbox) -> ServerResult<WireSandbox> {
        let (spec, lease, idle, ttl) = self.parse_create(&req)?;
        self.provider.check(&spec).map_err(ServerError::Provider)?;
        let wait = req.wait.then(|| {
            req.wait_timeout_s.map(Duration::from_secs).unwrap_or(self.settings.ready_timeout + Duration::from_secs(5))
        });
        let (sandbox, fresh) = {
            let mut table = self.table();
            let existing = req
                .idempotency_key
                .as_ref()
                .and_then(|k| table.by_key.get(k))
                .and_then(|id| table.by_id.get(id))
                .cloned();
            match existing {
                Some(sb) => (sb, false),
                None => {
                    if let Some(job) = &spec.job
                        && let Some(max) = self.jobs().get(job).and_then(|j| j.spec.max_sandboxes)
                    {
                        let live = table
                            .by_job
                            .get(job)
                            .into_iter()
                            .flatten()
                            .filter(|id| table.by_id.get(*id).is_some_and(|s| !s.state().is_terminal()))
                            .count() as u64;
                        if live >= max {
                            return Err(ServerError::QuotaExceeded(format!(
                                "job `{job}` has {live} live sandboxes, its max_sandboxes quota"
                            )));
                        }
                    }
                    let timers = Timers::new(Instant::now(), lease, idle, ttl);
                    let sb = Arc::new(Sandbox::new(spec.clone(), self.provider.name(), SandboxState::Creating, timers));
                    table.by_id.insert(spec.id.clone(), sb.clone());
                    if let Some(k) = &req.idempotency_key {
                        table.by_key.insert(k.clone(), spec.id.clone());
                    }
                    if let Some(job) = &spec.job {
                        table.by_job.entry(job.clone()).or_default().insert(spec.id.clone());
                    }
                    (sb, true)
                }
            }
        };
        if fresh {
            self.metrics.created.get_or_create(&ProviderLabel { provider: self.provider.name().into() }).inc();
            self.metrics.moved(None, SandboxState::Creating);
            self.events.emit(sandbox.id(), sandbox.spec.job.as_deref(), SandboxState::Creating, None, None);
            if let Some(job) = &sandbox.spec.job
                && let Some(j) = self.jobs().get_mut(job)
            {
                j.created += 1;
            }
            let me = self.clone();
            let sb = sandbox.clone();
            self.tasks.spawn(async move { me.bring_up(sb).await });
        }
        let Some(limit) = wait else { return Ok(sandbox.to_wire()) };
        let mut rx = sandbox.subscribe();
        let settled =
            tokio::time::timeout(limit, rx.wait_for(|s| !matches!(s, SandboxState::Queued | SandboxState::Creating)))
                .await;
        match (settled, sandbox.state()) {
            (Err(_), _) => Err(ServerError::Timeout(format!(
                "sandbox `{}` is not ready after {} s; it is still being created (GET it later)",
                sandbox.id(),
                limit.as_secs()
            ))),
            (_, SandboxState::Ready) => Ok(sandbox.to_wire()),
            (_, SandboxState::Failed) => {
                let inner = sandbox.lock();
                Err(ServerError::Failed {
                    id: sandbox.id().to_string(),
                    reason: inner.reason.unwrap_or(Reason::ProviderError),
                    message: inner.message.clone().unwrap_or_default(),
                })
            }
            _ => Err(sandbox.gone_error()),
        }
    }

    /// Makes the sandbox in the provider and waits for its daemon.
    async fn bring_up(self: Arc<Self>, sb: Arc<Sandbox>) {
        let started = Instant::now();
        let endpoint = match self.provider.create(&sb.spec).await {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(sandbox = sb.id(), error = %e, "create failed");
                self.fail(&sb, e.reason(), e.to_string()).await;
                return;
            }
        };
        sb.lock().endpoint = Some(endpoint.clone());
        if sb.state() != SandboxState::Creating {
            // Released while the provider was creating it: make sure nothing is left.
            let _ = self.provider.delete(sb.id()).await;
            return;
        }
        let limit = self.settings.ready_timeout.saturating_sub(started.elapsed());
        match daemon::wait_healthy(&self.daemons, &endpoint, &sb.spec.token, limit).await {
            Ok(()) => match sb.transition(SandboxState::Ready, None, None) {
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
                }
                Err(_) => {
                    let _ = self.provider.delete(sb.id()).await;
                }
            },
            Err(last) => {
                let msg =
                    format!("the daemon did not answer within {} s: {last}", self.settings.ready_timeout.as_secs());
                self.fail(&sb, Reason::ReadyTimeout, msg).await;
            }
        }
    }

    /// Ends a sandbox that could not be brought up (or died), cleaning up the provider's side.
    async fn fail(&self, sb: &Arc<Sandbox>, reason: Reason, message: String) {
        let Ok(prev) = sb.transition(SandboxState::Failed, Some(reason), Some(message.clone())) else { return };
        self.metrics.moved(Some(prev), SandboxState::Failed);
        self.metrics.ended(reason);
        self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Failed, Some(reason), Some(message));
        if let Err(e) = self.provider.delete(sb.id()).await {
            tracing::warn!(sandbox = sb.id(), error = %e, "cleanup after failure failed");
        }
        self.schedule_check(sb.id(), Instant::now() + self.settings.gone_retention);
    }

    /// Releases a sandbox with `reason`. Releasing one that has ended answers `gone`.
    pub async fn release(&self, id: &str, reason: Reason) -> ServerResult<WireSandbox> {
        let sb = self.get(id)?;
        let prev = match sb.transition(SandboxState::Releasing, Some(reason), None) {
            Ok(prev) => prev,
            Err(_) if sb.state().is_terminal() => return Err(sb.gone_error()),
            Err(e) => return Err(e),
        };
        self.metrics.moved(Some(prev), SandboxState::Releasing);
        self.events.emit(id, sb.spec.job.as_deref(), SandboxState::Releasing, Some(reason), None);
        let result = self.provider.delete(id).await;
        let (next, reason, message) = match result {
            Ok(()) => (SandboxState::Gone, reason, None),
            Err(e) => {
                tracing::error!(sandbox = id, error = %e, "provider could not delete the sandbox");
                (SandboxState::Failed, Reason::ProviderError, Some(format!("release failed: {e}")))
            }
        };
        if sb.transition(next, Some(reason), message.clone()).is_ok() {
            self.metrics.moved(Some(SandboxState::Releasing), next);
            self.metrics.ended(reason);
            self.events.emit(id, sb.spec.job.as_deref(), next, Some(reason), message);
        }
        self.schedule_check(id, Instant::now() + self.settings.gone_retention);
        Ok(sb.to_wire())
    }

    /// The daemon endpoint and token of a ready sandbox, for a proxied call; counts as a call.
    pub fn call_target(&self, id: &str) -> ServerResult<(Endpoint, String)> {
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
        let now = Instant::now();
        inner.timers.call(now);
        inner.daemon_touched = now;
        let endpoint =
            inner.endpoint.clone().ok_or_else(|| ServerError::Internal(format!("sandbox `{id}` has no endpoint")))?;
        Ok((endpoint, sb.spec.token.clone()))
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

    fn renew(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        let now = Instant::now();
        let touch = {
            let mut inner = sb.lock();
            inner.timers.renew(now);
            let third = Duration::from_secs(sb.spec.daemon_lease_s) / 3;
            let due = inner.state == SandboxState::Ready && now.duration_since(inner.daemon_touched) >= third;
            if due {
                inner.daemon_touched = now;
            }
            due.then(|| inner.endpoint.clone()).flatten()
        };
        if let Some(endpoint) = touch {
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
        if spec.create_rate.is_some() || spec.weight.is_some() {
            return Err(ServerError::InvalidArgument(
                "`create_rate` and `weight` need admission control, which this server does not run; set `max_sandboxes` and `lease_s`".into(),
            ));
        }
        if spec.lease_s == Some(0) {
            return Err(ServerError::InvalidArgument("`lease_s` must be at least 1".into()));
        }
        {
            let mut jobs = self.jobs();
            let entry = jobs.entry(name.to_string()).or_default();
            entry.spec = spec;
            save_jobs(&self.settings.state_dir, &jobs);
        }
        self.job(name)
    }

    pub fn job(&self, name: &str) -> ServerResult<Job> {
        let live = self.job_members(name).iter().filter(|s| !s.state().is_terminal()).count() as u64;
        // The table is always locked before the jobs (as `create` does), never while holding them.
        let in_table = self.table().by_job.contains_key(name);
        let jobs = self.jobs();
        let entry = jobs.get(name);
        if entry.is_none() && live == 0 && !in_table {
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

    /// Releases every sandbox of the job (reason `job_deleted`) and forgets its quota.
    pub async fn delete_job(&self, name: &str) -> ServerResult<JobAction> {
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
        let live: Vec<_> = members.into_iter().filter(|s| !s.state().is_terminal()).collect();
        let releases = live.iter().map(|sb| self.release(sb.id(), Reason::JobDeleted));
        let results = futures_util::future::join_all(releases).await;
        let n = results.iter().filter(|r| r.is_ok()).count() as u64;
        Ok(JobAction { job: name.to_string(), sandboxes: n })
    }

    // ---- recovery and provider events ----

    /// Finds every sandbox in the provider's records again after a (re)start.
    pub async fn recover(self: &Arc<Self>) -> ServerResult<(usize, usize)> {
        let records = self.provider.list().await.map_err(ServerError::Provider)?;
        let (mut live, mut dead) = (0, 0);
        let now = Instant::now();
        let now_wall = now_ms();
        for record in records {
            let spec = record.spec;
            let age = Duration::from_millis(now_wall.saturating_sub(spec.created_at_ms));
            let lease = Duration::from_secs(spec.server.lease_s.max(1));
            let mut timers = Timers::new(
                now,
                lease,
                spec.server.idle_timeout_s.map(Duration::from_secs),
                spec.server.ttl_s.map(Duration::from_secs),
            );
            timers.created = now.checked_sub(age).unwrap_or(now);
            let sb = Arc::new(Sandbox::new(spec.clone(), self.provider.name(), SandboxState::Creating, timers));
            sb.lock().endpoint = Some(record.endpoint);
            {
                let mut table = self.table();
                if table.by_id.contains_key(&spec.id) {
                    continue;
                }
                table.by_id.insert(spec.id.clone(), sb.clone());
                if let Some(k) = &spec.server.idempotency_key {
                    table.by_key.insert(k.clone(), spec.id.clone());
                }
                if let Some(job) = &spec.job {
                    table.by_job.entry(job.clone()).or_default().insert(spec.id.clone());
                }
            }
            self.metrics.moved(None, SandboxState::Creating);
            match record.ended {
                Some(ended) => {
                    dead += 1;
                    self.fail(&sb, ended.reason, format!("found ended after a server restart: {}", ended.message))
                        .await;
                }
                None => {
                    live += 1;
                    if sb.transition(SandboxState::Ready, None, Some("recovered after a server restart".into())).is_ok()
                    {
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
                    }
                }
            }
        }
        Ok((live, dead))
    }

    fn renew_daemon_now(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        sb.lock().daemon_touched = Instant::now() - Duration::from_secs(sb.spec.daemon_lease_s);
        self.renew(sb);
    }

    async fn provider_event(&self, ev: ProviderEvent) {
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
            (inner.state, inner.timers.due(now), inner.timers.next_deadline().0, inner.ended_at)
        };
        if state.is_terminal() {
            if ended_at.is_some_and(|t| t + self.settings.gone_retention <= now) {
                self.forget(&sb);
            } else if let Some(t) = ended_at {
                self.schedule_check(id, t + self.settings.gone_retention);
            }
            return;
        }
        if state != SandboxState::Ready {
            return;
        }
        match due {
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
        table.by_id.remove(sb.id());
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

/// 128 random bits as hex.
pub fn random_hex() -> String {
    crate::auth::random_token().map(|t| t[..32].to_string()).unwrap_or_else(|_| format!("{:032x}", now_ms()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_provider::fake::FakeProvider;

    fn service(dir: &std::path::Path) -> Arc<Service> {
        let settings = Settings {
            default_lease: Duration::from_secs(30),
            max_ttl: None,
            ready_timeout: Duration::from_secs(5),
            gone_retention: Duration::from_secs(60),
            state_dir: dir.to_path_buf(),
        };
        let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("nowhere.sock"))));
        let s = Service::new(settings, provider, "t".into());
        s.start_background();
        s
    }

    fn fake(s: &Service) -> &FakeProvider {
        match &s.provider {
            AnyProvider::Fake(f) => f,
            AnyProvider::Process(_) => unreachable!(),
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
        spec.server = ServerMeta { lease_s, idle_timeout_s: idle, ttl_s: ttl, idempotency_key: None };
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
        assert!(s.put_job("q", JobSpec { create_rate: Some(5.0), ..Default::default() }).is_err());
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
}

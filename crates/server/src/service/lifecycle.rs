//! A sandbox's life: a create from request to ready (admitted at once, queued, or claimed from
//! a warm pool; setup commands and an eval sandbox's conditions included), its release, and its
//! end with the event, the accounting record and its retention.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sandman_provider::identity::Unproven;
use sandman_provider::{Endpoint, Provider};
use sandman_wire::daemon::{ExecRequest, ExecResult, Info, Usage};
use sandman_wire::server::{CreateSandbox, Profile, Reason, Sandbox as WireSandbox, SandboxState, UsageRecord};
use tokio::time::Instant;

use super::request::{new_id, same_request};
use super::{Daemons, Service};
use crate::admission::{Offer, Tenant};
use crate::daemon::{self, CallError};
use crate::error::{ServerError, ServerResult};
use crate::metrics::ProviderLabel;
use crate::pool::Claim;
use crate::prepare;
use crate::sandbox::{Recorded, Sandbox, Timers, now_ms};

/// Output kept from a setup command, and how much of its tail a failure message shows.
const SETUP_OUTPUT_BYTES: u64 = 64 * 1024;
const SETUP_TAIL_CHARS: usize = 2000;
/// How long a release waits for the daemon's usage figures before going on without them.
const USAGE_TIMEOUT: Duration = Duration::from_secs(1);

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

impl Service {
    /// Creates a sandbox (or finds the one created under the same idempotency key, or claims
    /// one from a warm pool) and, unless `wait` is false, answers once it is ready or has
    /// failed, or `wait_timeout_s` has passed.
    pub async fn create(self: &Arc<Self>, mut req: CreateSandbox) -> ServerResult<WireSandbox> {
        let started = Instant::now();
        let pool = self.pools.lock().for_create(&req, self.provider.name());
        if let Some(name) = req.pool.clone() {
            let Some((_, spec)) = &pool else {
                return Err(ServerError::InvalidArgument(format!(
                    "no pool `{name}`; create it with PUT /v1/pools/{name}"
                )));
            };
            Self::apply_pool(&mut req, &name, spec)?;
        }
        let mut parsed = self.parse_create(&req)?;
        self.check_snapshot_image(&parsed.spec.image)?;
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
            let mut table = self.table.lock();
            let existing = req.idempotency_key.as_ref().and_then(|k| table.under_key(k));
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
                            while table.contains(&parsed.spec.id) {
                                parsed.spec.id = new_id();
                            }
                            let tenant = Tenant::of_job(parsed.spec.job.as_deref());
                            let offer = self.queue.offer(tenant, &parsed.spec.id, Instant::now());
                            let state = match offer {
                                Offer::Admitted => SandboxState::Creating,
                                Offer::Queued { .. } => SandboxState::Queued,
                                Offer::Full { retry_after } => {
                                    self.metrics.queue_rejected.inc();
                                    return Err(ServerError::QueueFull {
                                        queued: self.queue.queued(),
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
                        self.queue.wake();
                    }
                    _ => {
                        self.metrics.moved(None, SandboxState::Creating);
                        self.metrics.admitted("immediate", 1);
                        self.queue.admitted(Instant::now(), 1);
                        self.events.emit(sandbox.id(), sandbox.spec.job.as_deref(), SandboxState::Creating, None, None);
                        let me = self.clone();
                        let sb = sandbox.clone();
                        self.tasks.spawn(async move { me.bring_up(sb).await });
                    }
                }
                if let Some((name, _)) = &pool {
                    // A create the pool could not serve: demand it missed, and make sure it is
                    // refilling.
                    self.pools.lock().missed(name);
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
    pub(super) fn count_created(&self, sb: &Sandbox, made: bool) {
        if made {
            self.metrics.created.get_or_create(&ProviderLabel { provider: self.provider.name().into() }).inc();
        }
        if let Some(job) = &sb.spec.job {
            self.jobs.count_created(job);
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
        self.queue.remove(sb.id());
        match sb.transition(SandboxState::Gone, Some(reason), message) {
            Ok(prev) => {
                self.ended(sb, prev, None);
                true
            }
            Err(_) => false,
        }
    }

    /// Makes the sandbox in the provider, waits for its daemon, runs its setup commands.
    pub(super) async fn bring_up(self: Arc<Self>, sb: Arc<Sandbox>) {
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
        let asked = Instant::now();
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
        // The ready timeout counts from here: the daemon's start. What the provider waited for
        // before (a hold, an image's pull, memory on the machine) is bounded by its own limits.
        let started = Instant::now();
        sb.lock().endpoint = Some(endpoint.clone());
        // From here on, every connection to the daemon must prove the sandbox's token first.
        self.identities.register(&endpoint, &sb.spec.token);
        self.learn_image_config(&sb).await;
        if sb.state() != SandboxState::Creating {
            // Released while the provider was creating it: make sure nothing is left.
            let _ = self.provider.delete(sb.id()).await;
            return;
        }
        // A provider that proved the daemon in its create is not asked twice.
        if self.settings.daemons == Daemons::Real && !self.provider.proves_daemon() {
            let limit = self.settings.ready_timeout.saturating_sub(started.elapsed());
            if let Err(e) = daemon::wait_healthy(&self.daemons, &endpoint, limit).await {
                let message = match &e {
                    Unproven::Silent { last } => {
                        format!("the daemon did not answer within {} s: {last}", self.settings.ready_timeout.as_secs())
                    }
                    _ => e.to_string(),
                };
                self.fail(&sb, e.reason(), message).await;
                return;
            }
        }
        // Before anything of the sandbox's own runs, setup included.
        if self.record_conditions(&sb, &endpoint).await.is_err() {
            return;
        }
        if let Err(e) = self.run_setup(&sb, &endpoint, &sb.setup).await {
            match e {
                SetupError::Daemon(CallError::Unproven(why)) => self.distrust(&sb, &why).await,
                e => self.fail(&sb, Reason::SetupFailed, e.to_string()).await,
            }
            return;
        }
        // Before it is ready: a server killed from here on (or a replica taking over) finds it
        // ready at its next start, with its record.
        if let Err(e) = self.journal_ready(&sb).await {
            self.fail(&sb, Reason::ProviderError, format!("cannot record that it is ready: {e}")).await;
            return;
        }
        match sb.transition(SandboxState::Ready, None, None) {
            Ok(prev) => {
                {
                    let mut inner = sb.lock();
                    let now = Instant::now();
                    inner.timers.call(now);
                    inner.daemon_touched = now;
                }
                self.metrics.moved(Some(prev), SandboxState::Ready);
                self.metrics.create_to_ready.observe(asked.elapsed().as_secs_f64());
                self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Ready, None, None);
                self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
                if let Some(name) = sb.pool().filter(|_| sb.claimed_ms.is_none())
                    && !self.pools.lock().joined(name, sb.id())
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
    pub(super) async fn learn_image_config(&self, sb: &Sandbox) {
        match self.provider.image_config(sb.id()).await {
            Ok(config) => sb.lock().image_config = config,
            Err(e) => tracing::warn!(sandbox = sb.id(), error = %e, "cannot read the image's configuration"),
        }
    }

    /// Takes the sandbox's conditions record, and keeps it: as it becomes ready, before its first
    /// command runs (setup included), so that nothing of its own has run in it yet, and never
    /// again. An `eval` sandbox fails when the record cannot be taken or shows a mismatch;
    /// another goes on without one, kept as missing with the reason. `Err` when the sandbox
    /// failed here.
    pub(super) async fn record_conditions(self: &Arc<Self>, sb: &Arc<Sandbox>, endpoint: &Endpoint) -> Result<(), ()> {
        if self.settings.daemons == Daemons::Absent {
            return Ok(());
        }
        let eval = sb.spec.profile == Profile::Eval;
        match self.take_conditions(sb, endpoint).await {
            Ok(signed) if !eval || signed.record.mismatches.is_empty() => {
                sb.lock().conditions = Recorded::Taken(Box::new(signed));
                Ok(())
            }
            Ok(signed) => {
                let what: Vec<String> = signed
                    .record
                    .mismatches
                    .iter()
                    .map(|m| format!("{} applied {} but observed {}", m.field, m.applied, m.observed))
                    .collect();
                sb.lock().conditions = Recorded::Taken(Box::new(signed));
                self.fail(sb, Reason::ConditionsMismatch, what.join("; ")).await;
                Err(())
            }
            Err(CallError::Unproven(why)) => {
                self.distrust(sb, &why).await;
                Err(())
            }
            Err(e) if eval => {
                self.fail(sb, Reason::ConditionsMismatch, format!("its conditions could not be recorded: {e}")).await;
                Err(())
            }
            Err(e) => {
                tracing::warn!(sandbox = sb.id(), error = %e, "cannot record a sandbox's conditions; it goes on without a record");
                sb.lock().conditions = Recorded::Missing(format!("none could be taken as it became ready: {e}"));
                Ok(())
            }
        }
    }

    /// Runs setup commands in order through the daemon; the first that fails (or cannot run)
    /// fails the sandbox with its output's tail.
    pub(super) async fn run_setup(
        &self,
        sb: &Sandbox,
        endpoint: &Endpoint,
        commands: &[String],
    ) -> Result<(), SetupError> {
        for cmd in commands {
            if self.settings.daemons == Daemons::Absent {
                return Err(SetupError::Failed(format!(
                    "setup command `{cmd}` cannot run: this server's sandboxes have no daemon"
                )));
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
                    .map_err(|e| match e {
                        CallError::Unproven(why) => SetupError::Daemon(CallError::Unproven(why)),
                        e => SetupError::Failed(format!("setup command `{cmd}` could not run: {e}")),
                    })?;
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
            return Err(SetupError::Failed(format!(
                "setup command `{cmd}` {how}: {}",
                tail(output.trim_end(), SETUP_TAIL_CHARS)
            )));
        }
        Ok(())
    }

    /// What answered at the sandbox's daemon's address did not prove the sandbox's token on a
    /// new connection: something took the daemon's socket or port (the sandbox's own code). The
    /// sandbox is no longer trusted: it fails with `daemon_untrusted`, the event says why, and it
    /// is removed; nothing but the challenge was sent there, and nothing is tried there again.
    pub(crate) async fn distrust(self: &Arc<Self>, sb: &Arc<Sandbox>, why: &Unproven) {
        tracing::warn!(
            sandbox = sb.id(),
            %why,
            "a new connection to the sandbox's daemon failed its identity proof; the sandbox is no longer trusted"
        );
        let message = format!(
            "what answers at its daemon's address did not prove the sandbox's token on a new connection ({why}); \
             it is no longer trusted, and nothing was sent there"
        );
        self.fail(sb, Reason::DaemonUntrusted, message).await;
    }

    /// Ends a sandbox that could not be brought up (or died), cleaning up the provider's side.
    pub(super) async fn fail(self: &Arc<Self>, sb: &Arc<Sandbox>, reason: Reason, message: String) {
        let Ok(prev) = sb.transition(SandboxState::Failed, Some(reason), Some(message)) else { return };
        self.ended(sb, prev, None);
        if let Err(e) = self.provider.delete(sb.id()).await {
            tracing::warn!(sandbox = sb.id(), error = %e, "cleanup after failure failed");
        }
    }

    /// Records that the sandbox is ready, with its conditions record, and keeps the journal a
    /// few times the live sandboxes at most. Where replicas share the provider, the record goes
    /// to the provider (a new leader has no journal of the old one's).
    async fn journal_ready(&self, sb: &Sandbox) -> Result<(), sandman_provider::ProviderError> {
        let conditions = sb.lock().conditions.clone();
        if self.settings.store.is_shared() {
            let line = crate::journal::ready_line(sb.id(), conditions.taken());
            return self.provider.mark_ready(sb.id(), &line).await;
        }
        self.ready_journal.ready(sb.id(), conditions.taken());
        let ready = || {
            let mut lines = self.table.ready_lines();
            lines.push(crate::journal::ready_line(sb.id(), conditions.taken()));
            lines
        };
        self.ready_journal.compact_if_grown(ready, self.table.len());
        Ok(())
    }

    /// After a sandbox's move to `gone` or `failed` from `prev`: the gauges and counters, the
    /// event, the accounting record, its pool's bookkeeping, and its retention.
    pub(super) fn ended(self: &Arc<Self>, sb: &Arc<Sandbox>, prev: SandboxState, usage: Option<Usage>) {
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
        if let Some(endpoint) = sb.lock().endpoint.clone() {
            self.identities.forget(&endpoint, &sb.spec.token);
        }
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
            conditions: sb.lock().conditions.taken().cloned(),
        };
        self.accounting.record(&record, &self.metrics);
        if let Some(name) = sb.pool().filter(|_| sb.claimed_ms.is_none()) {
            let failed = (state == SandboxState::Failed).then(|| message.unwrap_or_else(|| reason.to_string()));
            self.pools.lock().left(name, sb.id(), failed.as_deref(), Instant::now());
            self.refill(name);
        }
        self.schedule_check(sb.id(), crate::sandbox::later(Instant::now(), self.settings.gone_retention));
    }

    /// Forgets an ended sandbox once its retention is over (or another server claimed it).
    pub(super) fn forget(&self, sb: &Sandbox) {
        if let Some(endpoint) = sb.lock().endpoint.clone() {
            self.identities.forget(&endpoint, &sb.spec.token);
        }
        self.table.forget(sb);
        self.metrics.forgotten(sb.state());
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
            self.sb.abandoned.store(true, Ordering::Relaxed);
            tracing::info!(sandbox = self.sb.id(), "a queued create's caller went away; taken off the queue");
        }
    }
}

/// Why setup commands did not all succeed.
#[derive(Debug, thiserror::Error)]
pub(super) enum SetupError {
    /// One exited non-zero, timed out, or could not run: said whole, with its output's tail.
    #[error("{0}")]
    Failed(String),
    /// A new connection to the daemon failed its proof.
    #[error("{0}")]
    Daemon(CallError),
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

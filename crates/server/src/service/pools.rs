//! Warm pools: their specs (kept across restarts), filling and refilling them through
//! admission, claims that hand a ready member to a create, and the journal of claims. The pools'
//! own bookkeeping is [`crate::pool`]'s.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sandman_provider::{Provider, ProviderError, SandboxSpec, ServerMeta};
use sandman_wire::bounds;
use sandman_wire::server::{CreateSandbox, Pool, PoolSpec, Reason, SandboxState};
use tokio::time::Instant;

use super::request::{Parsed, bad_number, check_env, check_resources, check_setup, new_id};
use super::table::Index;
use super::{DAEMON_LEASE_SLACK_S, Service};
use crate::admission::{Offer, Tenant};
use crate::error::{ServerError, ServerResult};
use crate::metrics::PoolLabel;
use crate::pool::{self, Claim, ClaimJournal, POOL_LABEL, Pools, Put};
use crate::sandbox::{Sandbox, Timers, now_ms};
use crate::store::{self, Store};
use crate::sys::random_hex;

/// The pools and their unclaimed members, where their specs are kept, and the journal of claims.
#[derive(Debug)]
pub(super) struct WarmPools {
    store: Store,
    pools: Mutex<Pools>,
    claims: ClaimJournal,
}

impl WarmPools {
    pub(super) fn open(state_dir: &Path, store: &Store) -> WarmPools {
        WarmPools {
            store: store.clone(),
            pools: Mutex::new(Pools::new(store.load(store::POOLS))),
            claims: ClaimJournal::open(state_dir),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Pools> {
        self.pools.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn claims(&self) -> &ClaimJournal {
        &self.claims
    }

    /// Keeps the pools' specs for the next start.
    fn save(&self, pools: &Pools) {
        self.store.save(store::POOLS, &pools.specs());
    }
}

impl Service {
    /// The longest lease a claim from this pool may have: its members' daemons keep that long
    /// plus the slack.
    pub(super) fn pool_lease_s(&self, spec: &PoolSpec) -> u64 {
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
            let mut pools = self.pools.lock();
            let outcome = pools.put(name, spec);
            self.pools.save(&pools);
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
            let mut pools = self.pools.lock();
            let removed = pools.remove(name);
            self.pools.save(&pools);
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

    pub(super) fn release_in_background(self: &Arc<Self>, ids: Vec<String>, why: String) {
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
        let claimed = self.table.claimed_per_pool();
        let pools = self.pools.lock();
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
    pub(super) fn refill(self: &Arc<Self>, name: &str) {
        let now = Instant::now();
        let (specs, setup, retry) = {
            let mut pools = self.pools.lock();
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
                let mut table = self.table.lock();
                let offer = self.queue.offer(Tenant::Pool(name.to_string()), &id, now);
                let state = match offer {
                    Offer::Admitted => SandboxState::Creating,
                    Offer::Queued { .. } => SandboxState::Queued,
                    Offer::Full { .. } => {
                        drop(table);
                        // Give back this and the remaining reservations, and try again later.
                        let mut pools = self.pools.lock();
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
                    self.queue.wake();
                }
                _ => {
                    self.metrics.moved(None, SandboxState::Creating);
                    self.metrics.admitted("immediate", 1);
                    self.queue.admitted(now, 1);
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

    pub(super) fn refill_all(self: &Arc<Self>) {
        let names: Vec<String> = self.pools.lock().iter().map(|(n, _)| n.clone()).collect();
        for name in names {
            self.refill(&name);
        }
    }

    /// Claims a ready member of pool `name` for this create, under the table's lock: pops it
    /// from the pool's ready queue and registers it again under the claimer's job, labels,
    /// lease, lifetime and key (same id, daemon and endpoint; nothing is recreated). Answers
    /// it, and whether it still has the claimer's `setup` to run (then it is `creating`).
    pub(super) fn claim_locked(
        &self,
        table: &mut Index,
        name: &str,
        parsed: &Parsed,
        req: &CreateSandbox,
        setup: Vec<String>,
    ) -> Option<(Arc<Sandbox>, bool)> {
        loop {
            let id = self.pools.lock().claim(name)?;
            let Some(old) = table.get(&id) else { continue };
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
    pub(super) fn claimed(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        pool: &str,
        setup: bool,
        claim: &Claim,
        started: Instant,
    ) {
        self.pools.claims().append(claim);
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
    pub(super) async fn claim_lost(self: &Arc<Self>, sb: &Arc<Sandbox>, pool: &str, err: ProviderError) {
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
        if let Err(e) = self.run_setup(&sb, &endpoint, &sb.setup).await {
            match e {
                super::lifecycle::SetupError::Daemon(crate::daemon::CallError::Unproven(why)) => {
                    self.distrust(&sb, &why).await;
                }
                e => self.fail(&sb, Reason::SetupFailed, e.to_string()).await,
            }
            return;
        }
        if let Ok(prev) = sb.transition(SandboxState::Ready, None, None) {
            sb.lock().timers.call(Instant::now());
            self.metrics.moved(Some(prev), SandboxState::Ready);
            self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Ready, None, None);
            self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
        }
    }
}

//! Warm pools: named sets of ready, unclaimed sandboxes that a create claims at once instead of
//! waiting for a cold create. [`Pools`] is the registry (specs, the ready queue each claim pops
//! under one lock, the members being created, refill back-off), persisted in
//! `<state-dir>/pools.json`; [`ClaimJournal`] records each claim in `<state-dir>/pool-claims.jsonl`
//! so that a restarted server knows a claimed sandbox from an idle one. The service's side
//! (claim, refill, release) is in `service.rs`, starting at `Service::put_pool`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

pub use sandman_provider::Claim;
use sandman_provider::SandboxSpec;
use sandman_wire::server::{CreateSandbox, PoolSpec};

use crate::journal::Journal;
use tokio::time::Instant;

/// The label that marks a pool's sandboxes (in the provider's records too, for recovery).
pub use sandman_provider::POOL_LABEL;
/// Pools kept across restarts.
/// Claims kept across restarts.
pub const CLAIMS_FILE: &str = "pool-claims.jsonl";
/// Most sandboxes one pool may keep.
pub const MAX_POOL_SIZE: u64 = 10_000;
/// Longest pause between refills that keep failing.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// The window an autoscaled pool measures its claim rate over.
const DEMAND_WINDOW: Duration = Duration::from_secs(30);
/// Weight of the newest refill in the refill-time average.
const REFILL_EWMA: f64 = 0.2;

/// One pool: its spec and its unclaimed members.
#[derive(Debug)]
pub struct PoolState {
    pub spec: PoolSpec,
    /// Ready members, oldest first; a claim pops the front.
    pub ready: VecDeque<String>,
    /// Members being created (queued for admission, or coming up), since when.
    pub creating: HashMap<String, Instant>,
    /// Claims served since the server started.
    pub claims: u64,
    /// The last refill failure, until a refill succeeds.
    pub last_error: Option<String>,
    /// Refills that failed in a row.
    failures: u32,
    /// While backing off: no refill before this.
    pub retry_at: Option<Instant>,
    /// Creates it served or would have (none was ready) over the last [`DEMAND_WINDOW`],
    /// oldest first (for `autoscale`).
    recent_claims: VecDeque<Instant>,
    /// How long refills took lately (moving average), once one has.
    refill_time: Option<Duration>,
}

impl PoolState {
    fn new(spec: PoolSpec) -> Self {
        PoolState {
            spec,
            ready: VecDeque::new(),
            creating: HashMap::new(),
            claims: 0,
            last_error: None,
            failures: 0,
            retry_at: None,
            recent_claims: VecDeque::new(),
            refill_time: None,
        }
    }

    /// Claims a second over the last [`DEMAND_WINDOW`], the creates it had nothing ready for
    /// counted in.
    pub fn claim_rate(&self, now: Instant) -> f64 {
        let since = now.checked_sub(DEMAND_WINDOW);
        let n = self.recent_claims.iter().filter(|t| since.is_none_or(|s| **t >= s)).count();
        n as f64 / DEMAND_WINDOW.as_secs_f64()
    }

    fn asked(&mut self, now: Instant) {
        self.recent_claims.push_back(now);
        while self.recent_claims.front().is_some_and(|t| now.saturating_duration_since(*t) > DEMAND_WINDOW) {
            self.recent_claims.pop_front();
        }
    }

    pub fn refill_time(&self) -> Option<Duration> {
        self.refill_time
    }

    /// How many unclaimed members it keeps: `min_ready`, or with `autoscale` the claims a
    /// refill takes to replace at the recent rate, within `min_ready..=max`.
    pub fn target(&self, now: Instant) -> u64 {
        let floor = self.spec.min_ready.min(self.max());
        if !self.spec.autoscale {
            return floor;
        }
        let refill = self.refill_time.map_or(0.0, |d| d.as_secs_f64());
        let demand = (self.claim_rate(now) * refill).ceil() as u64;
        demand.clamp(floor, self.max())
    }

    pub fn max(&self) -> u64 {
        self.spec.max.unwrap_or(self.spec.min_ready).max(self.spec.min_ready)
    }

    fn unclaimed(&self) -> u64 {
        (self.ready.len() + self.creating.len()) as u64
    }
}

/// What a `PUT` changed.
#[derive(Debug, PartialEq, Eq)]
pub enum Put {
    Created,
    /// Only the sizes changed; these ready members are beyond the new `max` and go.
    Resized {
        excess: Vec<String>,
    },
    /// The sandboxes it makes changed; every unclaimed member of the old spec goes.
    Replaced {
        old: Vec<String>,
    },
}

/// Every pool, by name.
#[derive(Debug, Default)]
pub struct Pools {
    pools: BTreeMap<String, PoolState>,
}

/// Whether two specs make the same sandboxes (everything but the sizes).
fn same_sandboxes(a: &PoolSpec, b: &PoolSpec) -> bool {
    a.image == b.image
        && a.provider == b.provider
        && a.resources == b.resources
        && a.profile == b.profile
        && a.network == b.network
        && a.env == b.env
        && a.setup == b.setup
        && a.lease_s == b.lease_s
}

impl Pools {
    pub fn new(specs: BTreeMap<String, PoolSpec>) -> Self {
        Pools { pools: specs.into_iter().map(|(n, s)| (n, PoolState::new(s))).collect() }
    }

    pub fn get(&self, name: &str) -> Option<&PoolState> {
        self.pools.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &PoolState)> {
        self.pools.iter()
    }

    pub fn specs(&self) -> BTreeMap<String, PoolSpec> {
        self.pools.iter().map(|(n, p)| (n.clone(), p.spec.clone())).collect()
    }

    pub fn put(&mut self, name: &str, spec: PoolSpec) -> Put {
        let Some(pool) = self.pools.get_mut(name) else {
            self.pools.insert(name.to_string(), PoolState::new(spec));
            return Put::Created;
        };
        if same_sandboxes(&pool.spec, &spec) {
            pool.spec = spec;
            let mut excess = Vec::new();
            while pool.unclaimed() > pool.max()
                && let Some(id) = pool.ready.pop_back()
            {
                excess.push(id);
            }
            return Put::Resized { excess };
        }
        let old = std::mem::replace(pool, PoolState::new(spec));
        Put::Replaced { old: old.ready.into_iter().chain(old.creating.into_keys()).collect() }
    }

    /// Forgets a pool; answers it with its unclaimed members.
    pub fn remove(&mut self, name: &str) -> Option<PoolState> {
        self.pools.remove(name)
    }

    /// Pops a ready member: two claims never get the same one.
    pub fn claim(&mut self, name: &str) -> Option<String> {
        let pool = self.pools.get_mut(name)?;
        let id = pool.ready.pop_front()?;
        pool.claims += 1;
        pool.asked(Instant::now());
        Some(id)
    }

    /// A create the pool matched but had no ready member for: demand all the same.
    pub fn missed(&mut self, name: &str) {
        if let Some(pool) = self.pools.get_mut(name) {
            pool.asked(Instant::now());
        }
    }

    /// A member came up: it joins the ready queue. False when it is no longer a member (its
    /// pool was deleted or replaced meanwhile), and must go.
    pub fn joined(&mut self, name: &str, id: &str) -> bool {
        let Some(pool) = self.pools.get_mut(name) else { return false };
        let Some(since) = pool.creating.remove(id) else { return false };
        let took = Instant::now().saturating_duration_since(since);
        pool.refill_time = Some(match pool.refill_time {
            None => took,
            Some(avg) => avg.mul_f64(1.0 - REFILL_EWMA) + took.mul_f64(REFILL_EWMA),
        });
        pool.ready.push_back(id.to_string());
        pool.failures = 0;
        pool.last_error = None;
        pool.retry_at = None;
        true
    }

    /// A ready member found again after a restart. False when its pool is gone or full.
    pub fn adopt(&mut self, name: &str, id: &str, spec: &SandboxSpec) -> bool {
        let Some(pool) = self.pools.get_mut(name) else { return false };
        if pool.unclaimed() >= pool.max() || !matches_spec(&pool.spec, spec) {
            return false;
        }
        pool.ready.push_back(id.to_string());
        true
    }

    /// A member ended (or was released) unclaimed. When it failed before it was ever ready,
    /// refills back off, doubling up to a minute.
    pub fn left(&mut self, name: &str, id: &str, failed: Option<&str>, now: Instant) {
        let Some(pool) = self.pools.get_mut(name) else { return };
        let was_creating = pool.creating.remove(id).is_some();
        if let Some(i) = pool.ready.iter().position(|r| r == id) {
            pool.ready.remove(i);
        }
        if was_creating && let Some(message) = failed {
            pool.failures = pool.failures.saturating_add(1);
            pool.last_error = Some(message.to_string());
            let pause = Duration::from_millis(500u64.saturating_mul(1 << pool.failures.min(8))).min(MAX_BACKOFF);
            pool.retry_at = Some(now + pause);
        }
    }

    /// How many members the pool needs to be back at its target (see [`PoolState::target`]); the
    /// caller creates that many under the ids it reserves with [`Pools::reserve`]. While
    /// refills back off, none (and the time to try again).
    pub fn deficit(&self, name: &str, now: Instant) -> (u64, Option<Instant>) {
        let Some(pool) = self.pools.get(name) else { return (0, None) };
        if let Some(at) = pool.retry_at
            && at > now
        {
            return (0, Some(at));
        }
        (pool.target(now).saturating_sub(pool.unclaimed()), None)
    }

    pub fn reserve(&mut self, name: &str, id: &str) {
        if let Some(pool) = self.pools.get_mut(name) {
            pool.creating.insert(id.to_string(), Instant::now());
        }
    }

    /// The pool a create is served from: the one it names, else the first whose sandboxes it
    /// matches exactly (image, resources, profile, network, provider).
    pub fn for_create(&self, req: &CreateSandbox, provider: &str) -> Option<(String, PoolSpec)> {
        if let Some(name) = &req.pool {
            return self.pools.get(name).map(|p| (name.clone(), p.spec.clone()));
        }
        self.pools
            .iter()
            .find(|(_, p)| {
                p.spec.image == req.image
                    && p.spec.resources == req.resources
                    && p.spec.profile == req.profile
                    && p.spec.network == req.network
                    && p.spec.provider.as_deref().is_none_or(|x| x == provider)
                    && req.provider.as_deref().is_none_or(|x| x == provider)
            })
            .map(|(n, p)| (n.clone(), p.spec.clone()))
    }
}

/// Whether a sandbox was made from this pool spec (so that a restart keeps members of a pool
/// that has changed since only if they still fit it).
fn matches_spec(pool: &PoolSpec, spec: &SandboxSpec) -> bool {
    pool.image == spec.image
        && pool.resources == spec.resources
        && pool.profile == spec.profile
        && pool.network == spec.network
        && pool.env == spec.env
}

/// The claims file: one JSON line appended per claim (a few microseconds, so a claim stays
/// fast), read back and compacted to the live claims at start.
#[derive(Debug)]
pub struct ClaimJournal {
    journal: Journal,
    /// What the file held at start, until recovery takes it.
    found: Mutex<HashMap<String, Claim>>,
}

impl ClaimJournal {
    pub fn open(state_dir: &Path) -> Self {
        let (journal, lines) = Journal::open(state_dir.join(CLAIMS_FILE));
        let found = lines
            .unwrap_or_default()
            .iter()
            .filter_map(|line| serde_json::from_str::<Claim>(line).ok())
            .map(|c| (c.spec.id.clone(), c))
            .collect();
        ClaimJournal { journal, found: Mutex::new(found) }
    }

    pub fn append(&self, claim: &Claim) {
        if let Ok(line) = serde_json::to_string(claim) {
            self.journal.append(&line);
        }
    }

    /// The claims found at start (once).
    pub fn take_found(&self) -> HashMap<String, Claim> {
        std::mem::take(&mut *self.found.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Rewrites the file with only `live`, the claims of sandboxes that still exist.
    pub fn compact(&self, live: &[Claim]) {
        let lines: Vec<String> = live.iter().filter_map(|c| serde_json::to_string(c).ok()).collect();
        self.journal.rewrite(lines.iter().map(String::as_str));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(min: u64, max: Option<u64>) -> PoolSpec {
        PoolSpec { image: "host".into(), min_ready: min, max, ..Default::default() }
    }

    #[tokio::test(start_paused = true)]
    async fn claims_pop_distinct_members_and_refills_make_up_the_deficit() {
        let now = Instant::now();
        let mut pools = Pools::default();
        assert_eq!(pools.put("p", spec(3, Some(5))), Put::Created);
        assert_eq!(pools.deficit("p", now), (3, None));
        for id in ["a", "b", "c"] {
            pools.reserve("p", id);
        }
        assert_eq!(pools.deficit("p", now), (0, None));
        assert!(pools.joined("p", "a") && pools.joined("p", "b"));
        assert!(!pools.joined("p", "zz"), "not a member");
        assert_eq!(pools.claim("p").as_deref(), Some("a"));
        assert_eq!(pools.claim("p").as_deref(), Some("b"));
        assert_eq!(pools.claim("p"), None);
        assert_eq!(pools.deficit("p", now), (2, None));
        assert_eq!(pools.get("p").map(|p| p.claims), Some(2));
    }

    #[tokio::test(start_paused = true)]
    async fn failing_refills_back_off() {
        let now = Instant::now();
        let mut pools = Pools::default();
        pools.put("p", spec(1, None));
        pools.reserve("p", "a");
        pools.left("p", "a", Some("pull access denied"), now);
        let (n, retry) = pools.deficit("p", now);
        assert_eq!(n, 0);
        assert_eq!(retry, Some(now + Duration::from_secs(1)));
        assert_eq!(pools.get("p").and_then(|p| p.last_error.clone()).as_deref(), Some("pull access denied"));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(pools.deficit("p", Instant::now()).0, 1);
    }

    #[test]
    fn a_resize_keeps_members_and_a_new_image_replaces_them() {
        let mut pools = Pools::default();
        pools.put("p", spec(3, None));
        for id in ["a", "b", "c"] {
            pools.reserve("p", id);
            pools.joined("p", id);
        }
        assert_eq!(pools.put("p", spec(1, Some(1))), Put::Resized { excess: vec!["c".into(), "b".into()] });
        let mut other = spec(1, None);
        other.image = "python".into();
        assert_eq!(pools.put("p", other), Put::Replaced { old: vec!["a".into()] });
    }

    #[test]
    fn creates_match_a_pool_by_what_they_make() {
        let mut pools = Pools::default();
        pools.put("p", spec(1, None));
        let req = CreateSandbox { image: "host".into(), ..Default::default() };
        assert_eq!(pools.for_create(&req, "process").map(|(n, _)| n).as_deref(), Some("p"));
        let cpu = CreateSandbox {
            resources: sandman_wire::server::Resources {
                cpu: Some(sandman_wire::server::Quantity::Number(1.0)),
                ..Default::default()
            },
            ..req.clone()
        };
        assert!(pools.for_create(&cpu, "process").is_none());
        let named = CreateSandbox { pool: Some("nope".into()), ..req };
        assert!(pools.for_create(&named, "process").is_none());
    }

    #[test]
    fn the_journal_survives_a_restart_and_compacts() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut s = sandman_provider::conformance::spec("sb-1", "host");
        s.job = Some("j".into());
        let claim = Claim { spec: s, env: BTreeMap::new(), claimed_ms: 5, pool_created_ms: 1 };
        let j = ClaimJournal::open(dir.path());
        j.append(&claim);
        drop(j);
        let j = ClaimJournal::open(dir.path());
        let found = j.take_found();
        assert_eq!(found.get("sb-1"), Some(&claim));
        j.compact(&[]);
        assert!(ClaimJournal::open(dir.path()).take_found().is_empty());
    }
}

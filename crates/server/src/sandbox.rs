//! One sandbox as the server tracks it: its spec, its lifecycle state with guarded transitions,
//! and the three timers (lease, idle, lifetime) that the reaper enforces.
// No arithmetic here may overflow on a caller's number or a record's: timers saturate.
#![deny(clippy::arithmetic_side_effects)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sandman_provider::{Endpoint, SandboxSpec};
use sandman_wire::server::{ImageConfig, Isolation, Reason, Sandbox as WireSandbox, SandboxState, SignedConditions};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::ServerError;

/// Milliseconds since the Unix epoch, for the wire.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Wall-clock milliseconds of a monotonic instant.
fn wall_ms(at: Instant) -> u64 {
    let now = Instant::now();
    let wall = now_ms();
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if at >= now {
        wall.saturating_add(ms(at.saturating_duration_since(now)))
    } else {
        wall.saturating_sub(ms(now.saturating_duration_since(at)))
    }
}

/// How far [`later`] looks at most: further than any bounded lease, lifetime or timeout.
const FAR: Duration = Duration::from_secs(100 * 365 * 86400);

/// `at + d`, saturating at about a century from `at`: a timer never panics, whatever a record
/// or a setting holds.
pub fn later(at: Instant, d: Duration) -> Instant {
    at.checked_add(d.min(FAR)).or_else(|| at.checked_add(Duration::from_secs(86400))).unwrap_or(at)
}

/// The lease, idle and lifetime timers of a sandbox. Pure: the reaper asks it when the sandbox
/// is due and why.
#[derive(Debug, Clone)]
pub struct Timers {
    pub lease: Duration,
    pub idle: Option<Duration>,
    pub ttl: Option<Duration>,
    pub created: Instant,
    /// The last call on the sandbox (proxied daemon calls, create).
    pub last_call: Instant,
    /// The last renewal of the lease (any call, a keepalive, a job heartbeat).
    pub last_renew: Instant,
    /// Proxied calls under way (an exec, a followed output stream): while there is one, neither
    /// the lease nor the idle timeout runs out; the lifetime still does.
    pub in_flight: u32,
    /// Since when the sandbox is paused: its lease and idle timeout stand still (neither runs
    /// out) until it resumes; its lifetime still counts.
    pub paused: Option<Instant>,
}

impl Timers {
    pub fn new(now: Instant, lease: Duration, idle: Option<Duration>, ttl: Option<Duration>) -> Self {
        Timers { lease, idle, ttl, created: now, last_call: now, last_renew: now, in_flight: 0, paused: None }
    }

    pub fn lease_expires(&self) -> Instant {
        later(self.last_renew, self.lease)
    }

    pub fn idle_expires(&self) -> Option<Instant> {
        self.idle.map(|i| later(self.last_call, i))
    }

    pub fn ttl_expires(&self) -> Option<Instant> {
        self.ttl.map(|t| later(self.created, t))
    }

    /// The earliest deadline and the reason it would end the sandbox with. Paused, only the
    /// lifetime runs.
    pub fn next_deadline(&self) -> (Instant, Reason) {
        if let Some(at) = self.paused {
            return match self.ttl_expires() {
                Some(t) => (t, Reason::TtlExpired),
                None => (later(at, FAR), Reason::LeaseExpired),
            };
        }
        let mut best = (self.lease_expires(), Reason::LeaseExpired);
        if let Some(i) = self.idle_expires()
            && i < best.0
        {
            best = (i, Reason::IdleExpired);
        }
        if let Some(t) = self.ttl_expires()
            && t <= best.0
        {
            best = (t, Reason::TtlExpired);
        }
        best
    }

    /// The reason the sandbox is due at `now`, if it is.
    pub fn due(&self, now: Instant) -> Option<Reason> {
        let (at, reason) = self.held(now).next_deadline();
        (at <= now).then_some(reason)
    }

    /// When the reaper should look again, seen at `now`: the next deadline, or while a call is
    /// under way, the earliest it could be once the call ends now.
    pub fn next_check(&self, now: Instant) -> Instant {
        self.held(now).next_deadline().0
    }

    /// The timers as they stand at `now`: a call under way counts as a call at `now`.
    fn held(&self, now: Instant) -> Timers {
        let mut t = self.clone();
        if t.in_flight > 0 {
            t.call(now);
        }
        t
    }

    /// A proxied call starts: activity now, and the lease held until [`Timers::end`].
    pub fn begin(&mut self, now: Instant) {
        self.call(now);
        self.in_flight = self.in_flight.saturating_add(1);
    }

    /// A proxied call ended (its answer sent in full, or its client gone): activity now.
    pub fn end(&mut self, now: Instant) {
        self.call(now);
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// A call on the sandbox: counts as activity and renews the lease.
    pub fn call(&mut self, now: Instant) {
        self.last_call = now;
        self.last_renew = now;
    }

    /// The sandbox is paused: its lease and idle timeout stop.
    pub fn pause(&mut self, now: Instant) {
        self.paused.get_or_insert(now);
    }

    /// The sandbox runs again: resuming counts as a call, so its lease and idle timeout start
    /// afresh.
    pub fn resume(&mut self, now: Instant) {
        self.paused = None;
        self.call(now);
    }

    /// A keepalive or heartbeat: renews the lease only.
    pub fn renew(&mut self, now: Instant) {
        self.last_renew = now;
    }
}

#[derive(Debug)]
pub struct Inner {
    pub state: SandboxState,
    pub reason: Option<Reason>,
    pub message: Option<String>,
    pub endpoint: Option<Endpoint>,
    pub ready_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    pub ended_at: Option<Instant>,
    pub timers: Timers,
    /// When the daemon's own lease was last renewed by the server.
    pub daemon_touched: Instant,
    /// The signed conditions record: taken once, before anything runs in the sandbox.
    pub conditions: Recorded,
    /// The image's configuration, once the provider told it (see `Provider::image_config`).
    pub image_config: Option<ImageConfig>,
}

#[derive(Debug)]
pub struct Sandbox {
    pub spec: SandboxSpec,
    pub provider: Backend,
    /// Shell commands run through the daemon before it is reported ready.
    pub setup: Vec<String>,
    /// The claimer's environment, merged into the `env` of its exec, process and session calls
    /// (a claimed pool sandbox's daemon keeps the pool's environment).
    pub env_overlay: Arc<BTreeMap<String, String>>,
    /// When a create claimed it from its pool.
    pub claimed_ms: Option<u64>,
    /// For a claimed sandbox, when its pool made it.
    pub pool_created_ms: Option<u64>,
    /// A create whose caller went away while it was queued: taken off the queue, and not what
    /// a retry with its idempotency key answers.
    pub abandoned: std::sync::atomic::AtomicBool,
    /// Lifecycle and timers. Held only for reads and transitions, never across `.await`.
    inner: Mutex<Inner>,
    /// The current state, for creates that wait for readiness.
    state_tx: watch::Sender<SandboxState>,
    /// Held across a pause or a resume (the provider's freeze or thaw), so that they happen one
    /// at a time and each sees the state the one before left.
    pub pausing: tokio::sync::Mutex<()>,
}

impl Sandbox {
    pub fn new(spec: SandboxSpec, provider: Backend, state: SandboxState, timers: Timers) -> Self {
        let now = timers.created;
        Sandbox {
            spec,
            provider,
            setup: Vec::new(),
            env_overlay: Arc::default(),
            claimed_ms: None,
            pool_created_ms: None,
            abandoned: Default::default(),
            inner: Mutex::new(Inner {
                state,
                reason: None,
                message: None,
                endpoint: None,
                ready_at_ms: None,
                ended_at_ms: None,
                ended_at: None,
                timers,
                daemon_touched: now,
                conditions: Recorded::NotYet,
                image_config: None,
            }),
            state_tx: watch::Sender::new(state),
            pausing: tokio::sync::Mutex::new(()),
        }
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    /// The warm pool it was made for, from its labels.
    pub fn pool(&self) -> Option<&str> {
        self.spec.labels.get(crate::pool::POOL_LABEL).map(String::as_str)
    }

    /// A pool's sandbox that no create has claimed: the pool keeps it alive, no timer ends it.
    pub fn is_unclaimed_pool_member(&self) -> bool {
        self.pool().is_some() && self.claimed_ms.is_none()
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn state(&self) -> SandboxState {
        self.lock().state
    }

    pub fn subscribe(&self) -> watch::Receiver<SandboxState> {
        self.state_tx.subscribe()
    }

    /// Moves to `next` if the lifecycle allows it; a wrong transition is a typed error.
    pub fn transition(
        &self,
        next: SandboxState,
        reason: Option<Reason>,
        message: Option<String>,
    ) -> Result<SandboxState, ServerError> {
        let prev = {
            let mut inner = self.lock();
            let prev = inner.state;
            if !prev.can_become(next) {
                return Err(ServerError::Conflict(format!(
                    "sandbox `{}` is {prev}; it cannot become {next}",
                    self.spec.id
                )));
            }
            inner.state = next;
            if reason.is_some() {
                inner.reason = reason;
            }
            if message.is_some() {
                inner.message = message;
            }
            match next {
                // Resumed: it was ready before.
                SandboxState::Ready if prev == SandboxState::Paused => {}
                SandboxState::Ready => inner.ready_at_ms = Some(now_ms()),
                SandboxState::Gone | SandboxState::Failed => {
                    inner.ended_at_ms = Some(now_ms());
                    inner.ended_at = Some(Instant::now());
                }
                _ => {}
            }
            prev
        };
        self.state_tx.send_replace(next);
        Ok(prev)
    }

    /// The error a call on an ended sandbox answers with.
    pub fn gone_error(&self) -> ServerError {
        let inner = self.lock();
        ServerError::Gone {
            id: self.spec.id.clone(),
            reason: inner.reason.unwrap_or(Reason::Released),
            message: inner.message.clone(),
        }
    }

    /// The user its commands run as unless a call names one: the create's, else the image's.
    pub fn default_user(&self) -> Option<String> {
        let inner = self.lock();
        default_user(self.spec.server.user.as_deref(), inner.image_config.as_ref())
    }

    pub fn to_wire(&self) -> WireSandbox {
        let inner = self.lock();
        let live = !inner.state.is_terminal();
        let paused = inner.timers.paused.map(wall_ms);
        // Paused, the lease and idle timeout stand still: they have no time to run out at.
        let running = live && paused.is_none();
        WireSandbox {
            id: self.spec.id.clone(),
            image: self.spec.image.clone(),
            provider: self.provider.name.to_string(),
            state: inner.state,
            reason: inner.reason,
            message: inner.message.clone(),
            job: self.spec.job.clone(),
            labels: self.spec.labels.clone(),
            profile: self.spec.profile,
            network: self.spec.network,
            resources: self.spec.resources.clone(),
            created_at_ms: self.spec.created_at_ms,
            ready_at_ms: inner.ready_at_ms,
            ended_at_ms: inner.ended_at_ms,
            lease_expires_at_ms: running.then(|| wall_ms(inner.timers.lease_expires())),
            idle_expires_at_ms: if running { inner.timers.idle_expires().map(wall_ms) } else { None },
            ttl_expires_at_ms: if live { inner.timers.ttl_expires().map(wall_ms) } else { None },
            lease_s: inner.timers.lease.as_secs(),
            isolation: Some(self.provider.isolation),
            user: default_user(self.spec.server.user.as_deref(), inner.image_config.as_ref()),
            image_config: inner.image_config.clone(),
            paused_at_ms: paused,
            auto_resume: self.spec.server.auto_resume,
        }
    }
}

/// A sandbox's signed conditions record: taken once, as it becomes ready and before any
/// command of its own runs (setup included), kept in the ready journal, and never taken again:
/// a daemon that has run the sandbox's code may no longer be the daemon, or tell the truth.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Recorded {
    /// Not taken yet: the sandbox is being created (or its server's sandboxes have no daemon).
    #[default]
    NotYet,
    /// Boxed: a record is some kilobytes, and most sandboxes' lifecycles are read far more
    /// often than their records.
    Taken(Box<SignedConditions>),
    /// None was taken when it was due (the key or the daemon could not give one, or the sandbox
    /// was recovered from a server that kept none), and none will be: why.
    Missing(String),
}

impl Recorded {
    pub fn taken(&self) -> Option<&SignedConditions> {
        match self {
            Recorded::Taken(signed) => Some(signed.as_ref()),
            _ => None,
        }
    }
}

/// Which provider holds a sandbox, and how it isolates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backend {
    pub name: &'static str,
    pub isolation: Isolation,
}

/// The create's user, else the image's `USER`; none when neither names one.
pub fn default_user(asked: Option<&str>, image: Option<&ImageConfig>) -> Option<String> {
    asked.or_else(|| image.and_then(|c| c.user.as_deref())).filter(|u| !u.is_empty()).map(str::to_string)
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_earliest_timer_wins_and_names_itself() {
        let t0 = Instant::now();
        let mut t =
            Timers::new(t0, Duration::from_secs(60), Some(Duration::from_secs(30)), Some(Duration::from_secs(100)));
        assert_eq!(t.next_deadline(), (t0 + Duration::from_secs(30), Reason::IdleExpired));
        assert_eq!(t.due(t0 + Duration::from_secs(29)), None);
        assert_eq!(t.due(t0 + Duration::from_secs(30)), Some(Reason::IdleExpired));
        // A keepalive renews the lease but is not activity.
        t.renew(t0 + Duration::from_secs(50));
        assert_eq!(t.next_deadline().1, Reason::IdleExpired);
        // A call is both; then the lifetime comes first.
        t.call(t0 + Duration::from_secs(80));
        assert_eq!(t.next_deadline(), (t0 + Duration::from_secs(100), Reason::TtlExpired));
    }

    #[tokio::test(start_paused = true)]
    async fn lease_alone() {
        let t0 = Instant::now();
        let mut t = Timers::new(t0, Duration::from_secs(10), None, None);
        t.renew(t0 + Duration::from_secs(8));
        assert_eq!(t.due(t0 + Duration::from_secs(17)), None);
        assert_eq!(t.due(t0 + Duration::from_secs(18)), Some(Reason::LeaseExpired));
    }

    /// Before, a sandbox was reclaimed for its lease in the middle of an exec longer than the
    /// lease, and its daemon killed the command.
    #[tokio::test(start_paused = true)]
    async fn a_call_under_way_holds_the_lease_and_idle_timeout_but_not_the_lifetime() {
        let t0 = Instant::now();
        let mut t =
            Timers::new(t0, Duration::from_secs(10), Some(Duration::from_secs(20)), Some(Duration::from_secs(100)));
        t.begin(t0 + Duration::from_secs(1));
        let late = t0 + Duration::from_secs(60);
        assert_eq!(t.due(late), None);
        assert_eq!(t.next_check(late), late + Duration::from_secs(10), "looked at again a lease after now");
        // Two calls: the lease is held until the last ends.
        t.begin(late);
        t.end(late + Duration::from_secs(5));
        assert_eq!(t.due(late + Duration::from_secs(30)), None);
        let ended = t0 + Duration::from_secs(70);
        t.end(ended);
        assert_eq!(t.in_flight, 0);
        assert_eq!(t.due(ended + Duration::from_secs(9)), None);
        assert_eq!(t.due(ended + Duration::from_secs(10)), Some(Reason::LeaseExpired));
        // The lifetime ends the sandbox whatever is under way.
        t.begin(ended + Duration::from_secs(5));
        assert_eq!(t.due(t0 + Duration::from_secs(100)), Some(Reason::TtlExpired));
    }
}

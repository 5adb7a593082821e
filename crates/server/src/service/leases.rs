//! Leases and timers: keepalives (passed on to the daemon when its own lease is a third gone),
//! moving a sandbox's end, and the one reaper for every timer of every sandbox.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sandman_wire::server::{Sandbox as WireSandbox, SandboxState};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

use super::{Daemons, Service};
use crate::daemon;
use crate::error::{ServerError, ServerResult};
use crate::sandbox::Sandbox;

/// Daemon keepalives the server sends at once on behalf of heartbeats.
const KEEPALIVE_CONCURRENCY: usize = 64;

/// When each sandbox should next be looked at by the reaper: (when, id). A renewal does not
/// touch it; the reaper re-reads the timers when the entry comes due and reschedules.
#[derive(Debug)]
pub(super) struct Leases {
    schedule: Mutex<BTreeSet<(Instant, String)>>,
    /// Wakes the reaper when an earlier entry is scheduled.
    wake: Notify,
    keepalives: Arc<Semaphore>,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            schedule: Mutex::default(),
            wake: Notify::new(),
            keepalives: Arc::new(Semaphore::new(KEEPALIVE_CONCURRENCY)),
        }
    }
}

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<(Instant, String)>> {
        self.schedule.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Has sandbox `id` looked at `at`; wakes the reaper when that is the earliest entry.
    fn schedule(&self, id: &str, at: Instant) {
        let earliest = {
            let mut s = self.lock();
            s.insert((at, id.to_string()));
            s.first().map(|(t, _)| *t) == Some(at)
        };
        if earliest {
            self.wake.notify_one();
        }
    }

    fn next(&self) -> Option<Instant> {
        self.lock().first().map(|(t, _)| *t)
    }

    /// Takes the entries due by `now` off the schedule.
    fn take_due(&self, now: Instant) -> Vec<String> {
        let mut s = self.lock();
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
    }
}

impl Service {
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

    pub(super) fn renew(self: &Arc<Self>, sb: &Arc<Sandbox>) {
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
                let Ok(_permit) = me.leases.keepalives.clone().acquire_owned().await else { return };
                match daemon::call(&me.daemons, &endpoint, &token, http::Method::POST, "/v1/keepalive").await {
                    Ok(_) => {}
                    Err(daemon::CallError::Unproven(why)) => {
                        if let Ok(sb) = me.get(&id) {
                            me.distrust(&sb, &why).await;
                        }
                    }
                    Err(e) => tracing::warn!(sandbox = id, error = %e, "daemon keepalive failed"),
                }
            });
        }
    }

    pub(super) fn renew_daemon_now(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        self.renew_forcing(sb, true);
    }

    pub(super) fn schedule_check(&self, id: &str, at: Instant) {
        self.leases.schedule(id, at);
    }

    /// One task for every timer of every sandbox: it sleeps until the earliest scheduled check,
    /// re-reads that sandbox's timers, and reclaims it, reschedules it, or forgets it.
    pub(super) async fn reaper(self: Arc<Self>) {
        loop {
            let next = self.leases.next();
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = self.leases.wake.notified() => continue,
                () = super::sleep_until(next) => {}
            }
            let now = Instant::now();
            for id in self.leases.take_due(now) {
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
        // A paused sandbox's timers say only its lifetime is due.
        if !matches!(state, SandboxState::Ready | SandboxState::Paused) {
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
}

//! Admission: the global create rate, jobs' weights and rates, the bounded queue of creates
//! (the rules are [`crate::admission`]'s), and the one task that admits queued creates.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sandman_wire::server::SandboxState;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Service, Settings};
use crate::admission::{Admission, Offer, RateMeter, Tenant, Ticket};

/// How often, at most, queued creates are told their new place (see `Admission::progress`).
const QUEUE_PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// The admission state, the wake-up of its task, and the meter of the rate achieved.
#[derive(Debug)]
pub(super) struct Queue {
    admission: Mutex<Admission>,
    /// Wakes the admission task when a create is queued or a rate changes.
    wake: Notify,
    /// Creates admitted over the last seconds, for the achieved-rate gauge.
    meter: Mutex<RateMeter>,
}

impl Queue {
    pub(super) fn new(settings: &Settings, tenants: Vec<(Tenant, Option<f64>, Option<f64>)>, now: Instant) -> Queue {
        let mut admission = Admission::new(settings.create_rate, settings.create_burst, settings.max_queue, now);
        for (tenant, weight, rate) in tenants {
            admission.set_tenant(tenant, weight, rate, now);
        }
        Queue { admission: Mutex::new(admission), wake: Notify::new(), meter: Mutex::new(RateMeter::new(now)) }
    }

    fn lock(&self) -> MutexGuard<'_, Admission> {
        self.admission.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The global create rate (`None`: unlimited).
    pub(super) fn rate(&self) -> Option<f64> {
        self.lock().rate()
    }

    pub(super) fn queued(&self) -> usize {
        self.lock().queued()
    }

    /// Admits the create `id` of `tenant` now, queues it, or refuses it (the queue is full).
    /// Whoever queues one wakes the admission task ([`Queue::wake`]) once it is in the table.
    pub(super) fn offer(&self, tenant: Tenant, id: &str, now: Instant) -> Offer {
        self.lock().offer(tenant, id, now)
    }

    /// Wakes the admission task: a create was queued.
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Takes a queued create off the queue; false when it was not there.
    pub(super) fn remove(&self, id: &str) -> bool {
        self.lock().remove(id)
    }

    /// Takes every queued create of `tenant` off the queue, and forgets its weight and rate.
    pub(super) fn remove_tenant(&self, tenant: &Tenant) -> Vec<String> {
        self.lock().remove_tenant(tenant)
    }

    pub(super) fn set_tenant(&self, tenant: Tenant, weight: Option<f64>, rate: Option<f64>, now: Instant) {
        self.lock().set_tenant(tenant, weight, rate, now);
        self.wake.notify_one();
    }

    /// Creates admitted a second over the last seconds.
    pub(super) fn achieved_rate(&self, now: Instant) -> f64 {
        self.meter.lock().unwrap_or_else(PoisonError::into_inner).rate(now)
    }

    /// Counts creates admitted, for the achieved rate.
    pub(super) fn admitted(&self, now: Instant, n: u64) {
        self.meter.lock().unwrap_or_else(PoisonError::into_inner).add(now, n);
    }
}

impl Service {
    /// One task admits every queued create: it sleeps until the next token is due (the global
    /// one, or a job's own) or a create is queued, then admits what the rates allow.
    pub(super) async fn admission_loop(self: Arc<Self>) {
        let mut told = Instant::now();
        loop {
            let now = Instant::now();
            let (admitted, next) = self.queue.lock().admit(now);
            if !admitted.is_empty() {
                let n = admitted.len() as u64;
                self.metrics.admitted("queue", n);
                self.queue.admitted(now, n);
                if now.saturating_duration_since(told) >= QUEUE_PROGRESS_EVERY {
                    told = now;
                    self.tell_queue_progress();
                }
            }
            for (_, ticket) in admitted {
                self.start_admitted(ticket, now);
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = self.queue.wake.notified() => {}
                () = super::sleep_until(next) => {}
            }
        }
    }

    /// Tells queued creates whose place moved enough where they now stand, as events.
    fn tell_queue_progress(&self) {
        let moved = self.queue.lock().progress();
        for (id, tenant, position, wait) in moved {
            let job = match &tenant {
                Tenant::Job(j) => Some(j.as_str()),
                Tenant::NoJob | Tenant::Pool(_) => None,
            };
            self.events.emit_queued(&id, job, position, wait);
        }
    }

    fn start_admitted(self: &Arc<Self>, ticket: Ticket, now: Instant) {
        let Some(sb) = self.table.get(&ticket.id) else { return };
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
}

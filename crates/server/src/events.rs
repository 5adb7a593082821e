//! Lifecycle events: a bounded ring of the recent ones for `GET /v1/events`, and a broadcast for
//! followers.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use std::time::Duration;

use sandman_wire::server::{Event, EventKind, PreparePhase, Reason, SandboxState};
use tokio::sync::broadcast;

use crate::sandbox::now_ms;

/// Recent events kept for listing.
pub const RING: usize = 10_000;
/// Events a slow follower may fall behind before it is told it lagged.
pub const FOLLOW_BACKLOG: usize = 4096;

#[derive(Debug)]
pub struct Events {
    /// The recent events and the last sequence number given out; one lock so that sequence
    /// order and ring order agree.
    ring: Mutex<(VecDeque<Event>, u64)>,
    tx: broadcast::Sender<Event>,
}

impl Default for Events {
    fn default() -> Self {
        Events { ring: Mutex::new((VecDeque::new(), 0)), tx: broadcast::Sender::new(FOLLOW_BACKLOG) }
    }
}

impl Events {
    /// A sandbox changed state.
    pub fn emit(
        &self,
        sandbox: &str,
        job: Option<&str>,
        state: SandboxState,
        reason: Option<Reason>,
        message: Option<String>,
    ) {
        let mut e = blank(EventKind::Sandbox, job);
        e.sandbox = sandbox.to_string();
        e.state = Some(state);
        e.reason = reason;
        e.message = message;
        self.push(e);
    }

    /// A create was queued for admission: where it stands, and about how long it will wait.
    pub fn emit_queued(&self, sandbox: &str, job: Option<&str>, position: u64, wait: Option<Duration>) {
        let mut e = blank(EventKind::Sandbox, job);
        e.sandbox = sandbox.to_string();
        e.state = Some(SandboxState::Queued);
        e.queue_position = Some(position);
        e.estimated_wait_ms = wait.map(|w| w.as_millis() as u64);
        self.push(e);
    }

    /// Progress of a sandbox still `creating` (an image pull), tagged with its create's idempotency
    /// key so that the caller, who does not know the id yet, can follow it.
    pub fn emit_progress(&self, sandbox: &str, job: Option<&str>, idempotency_key: Option<&str>, message: String) {
        let mut e = blank(EventKind::Sandbox, job);
        e.sandbox = sandbox.to_string();
        e.state = Some(SandboxState::Creating);
        e.message = Some(message);
        e.idempotency_key = idempotency_key.map(str::to_string);
        self.push(e);
    }

    /// A SandboxFusion API call the service failed (`SandboxError`, or not started in time), on
    /// `sandbox` when it had one.
    pub fn emit_fusion(&self, sandbox: Option<&str>, job: Option<&str>, message: String) {
        let mut e = blank(EventKind::Fusion, job);
        e.sandbox = sandbox.unwrap_or_default().to_string();
        e.message = Some(message);
        self.push(e);
    }

    /// Progress of preparing an image.
    pub fn emit_prepare(&self, image: &str, job: Option<&str>, phase: PreparePhase, message: Option<String>) {
        let mut e = blank(EventKind::Prepare, job);
        e.image = Some(image.to_string());
        e.phase = Some(phase);
        e.message = message;
        self.push(e);
    }

    /// How one node gets on preparing an image.
    pub fn emit_node(&self, image: &str, job: Option<&str>, node: &str, message: String, ready: u32, total: u32) {
        let mut e = blank(EventKind::Prepare, job);
        e.image = Some(image.to_string());
        e.phase = Some(PreparePhase::Pulling);
        e.node = Some(node.to_string());
        e.message = Some(message);
        e.nodes_ready = Some(ready);
        e.nodes_total = Some(total);
        self.push(e);
    }

    fn push(&self, mut event: Event) {
        {
            let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
            ring.1 += 1;
            event.seq = ring.1;
            event.time_ms = now_ms();
            ring.0.push_back(event.clone());
            if ring.0.len() > RING {
                ring.0.pop_front();
            }
        }
        // No follower is fine.
        let _ = self.tx.send(event);
    }

    /// Events after `after` that `filter` takes.
    pub fn list(&self, filter: &Filter<'_>, after: u64) -> Vec<Event> {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        ring.0.iter().filter(|e| e.seq > after && filter.takes(e)).cloned().collect()
    }

    /// The sequence number of the latest event (0 before the first): where a follower that
    /// wants no backlog starts (`after=`).
    pub fn last_seq(&self) -> u64 {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner).1
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}

/// Which events a listing or a follower wants: those of a job, those of a create (by its
/// idempotency key), or all.
#[derive(Debug, Clone, Copy, Default)]
pub struct Filter<'a> {
    pub job: Option<&'a str>,
    pub idempotency_key: Option<&'a str>,
}

impl Filter<'_> {
    pub fn takes(&self, e: &Event) -> bool {
        (self.job.is_none() || e.job.as_deref() == self.job)
            && (self.idempotency_key.is_none() || e.idempotency_key.as_deref() == self.idempotency_key)
    }
}

fn blank(kind: EventKind, job: Option<&str>) -> Event {
    Event {
        seq: 0,
        time_ms: 0,
        kind,
        sandbox: String::new(),
        job: job.map(str::to_string),
        state: None,
        reason: None,
        message: None,
        queue_position: None,
        estimated_wait_ms: None,
        image: None,
        phase: None,
        node: None,
        nodes_ready: None,
        nodes_total: None,
        idempotency_key: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_filters_by_job_and_sequence() {
        let ev = Events::default();
        ev.emit("a", Some("j1"), SandboxState::Creating, None, None);
        ev.emit("b", Some("j2"), SandboxState::Creating, None, None);
        ev.emit("a", Some("j1"), SandboxState::Ready, None, None);
        ev.emit_progress("c", Some("j1"), Some("k"), "pulling busybox: 0/1 layers".into());
        let job = |job| Filter { job: Some(job), idempotency_key: None };
        assert_eq!(ev.list(&job("j1"), 0).len(), 3);
        assert_eq!(ev.list(&Filter::default(), 2).len(), 2);
        assert_eq!(ev.list(&Filter::default(), 2)[0].state, Some(SandboxState::Ready));
        let create = ev.list(&Filter { job: None, idempotency_key: Some("k") }, 0);
        assert_eq!(create.len(), 1);
        assert_eq!((create[0].sandbox.as_str(), create[0].state), ("c", Some(SandboxState::Creating)));
    }
}

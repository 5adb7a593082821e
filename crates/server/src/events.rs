//! Lifecycle events: a bounded ring of the recent ones for `GET /v1/events`, and a broadcast for
//! followers.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use sandman_wire::server::{Event, Reason, SandboxState};
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
    pub fn emit(
        &self,
        sandbox: &str,
        job: Option<&str>,
        state: SandboxState,
        reason: Option<Reason>,
        message: Option<String>,
    ) {
        let event = {
            let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
            ring.1 += 1;
            let event = Event {
                seq: ring.1,
                time_ms: now_ms(),
                sandbox: sandbox.to_string(),
                job: job.map(str::to_string),
                state,
                reason,
                message,
            };
            ring.0.push_back(event.clone());
            if ring.0.len() > RING {
                ring.0.pop_front();
            }
            event
        };
        // No follower is fine.
        let _ = self.tx.send(event);
    }

    /// Events after `after`, of `job` when given.
    pub fn list(&self, job: Option<&str>, after: u64) -> Vec<Event> {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        ring.0.iter().filter(|e| e.seq > after && (job.is_none() || e.job.as_deref() == job)).cloned().collect()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
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
        assert_eq!(ev.list(Some("j1"), 0).len(), 2);
        assert_eq!(ev.list(None, 2).len(), 1);
        assert_eq!(ev.list(None, 2)[0].state, SandboxState::Ready);
    }
}

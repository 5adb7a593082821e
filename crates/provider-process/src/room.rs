//! Admission against the machine's memory: every sandbox reserves its memory limit, and a create
//! goes through only while what the sandboxes reserve stays within the machine's memory times
//! an overcommit (`sandman serve --memory-overcommit`), as the kubernetes provider admits creates
//! against its nodes' allocatable. The rest wait, first come first served, told their place; one
//! that could never fit is refused at once, and one that waits past its deadline fails. Start at
//! [`Room::admit`].

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Mutex, PoisonError};

use tokio::sync::Notify;
use tokio::time::Instant;

/// What a waiting create is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// Creates ahead of it.
    pub ahead: usize,
    pub reserved: u64,
    pub total: u64,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "waiting for memory: {} of the machine's {} are reserved by sandboxes (--memory-overcommit), {} create(s) ahead",
            gib(self.reserved),
            gib(self.total),
            self.ahead
        )
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// Why a create was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoomError {
    #[error("resources.memory {} is more than the {} this machine may reserve for sandboxes (its memory times --memory-overcommit): it can never start here", gib(*ask), gib(*total))]
    NeverFits { ask: u64, total: u64 },
    #[error("waited {waited_s} s for memory and none freed: {waiting}")]
    TimedOut { waited_s: u64, waiting: Waiting },
    #[error("the sandbox was deleted while it waited for memory")]
    Cancelled,
}

/// The machine's memory as sandboxes reserve it.
#[derive(Debug)]
pub struct Room {
    total: u64,
    /// Locked briefly, never across an await.
    state: Mutex<State>,
    /// Told whenever memory is given back or a waiter leaves.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Each sandbox's reservation, by id.
    held: HashMap<String, u64>,
    reserved: u64,
    /// The creates waiting, by arrival: what each asks, for which sandbox.
    queue: BTreeMap<u64, (u64, String)>,
    /// Sandboxes whose wait was called off (a delete came while they waited).
    cancelled: std::collections::HashSet<String>,
    next_ticket: u64,
}

impl Room {
    /// `total` bytes to share: the machine's memory times the overcommit.
    pub fn new(total: u64) -> Room {
        Room { total, state: Mutex::default(), changed: Notify::new() }
    }

    /// The machine's memory (`MemTotal`) times `overcommit`.
    pub fn of_machine(overcommit: f64) -> std::io::Result<Room> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")?;
        let kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no MemTotal in /proc/meminfo"))?;
        Ok(Room::new(((kib * 1024) as f64 * overcommit) as u64))
    }

    /// A sandbox found at start holds its reservation.
    pub fn hold(&self, id: &str, bytes: u64) {
        let mut s = self.lock();
        if let Some(old) = s.held.insert(id.to_string(), bytes) {
            s.reserved -= old;
        }
        s.reserved += bytes;
    }

    /// A sandbox is gone (or its create failed): its reservation is free.
    pub fn release(&self, id: &str) {
        let mut s = self.lock();
        if let Some(bytes) = s.held.remove(id) {
            s.reserved -= bytes;
            drop(s);
            self.changed.notify_waiters();
        }
    }

    /// Calls off the wait of sandbox `id`, if it waits: its `admit` answers
    /// [`RoomError::Cancelled`] at once, and those behind it move up.
    pub fn cancel(&self, id: &str) {
        let mut s = self.lock();
        if s.queue.values().any(|(_, waiting)| waiting == id) {
            s.cancelled.insert(id.to_string());
            drop(s);
            self.changed.notify_waiters();
        }
    }

    /// Waits until `ask` bytes fit, first come first served, telling `waiting` each time its
    /// place changes; then holds them for `id`. Refuses at once what could never fit, and gives
    /// up at `deadline`.
    pub async fn admit(
        &self,
        id: &str,
        ask: u64,
        deadline: Instant,
        mut waiting: impl FnMut(&Waiting),
    ) -> Result<(), RoomError> {
        if ask > self.total {
            return Err(RoomError::NeverFits { ask, total: self.total });
        }
        let started = Instant::now();
        let ticket = {
            let mut s = self.lock();
            let t = s.next_ticket;
            s.next_ticket += 1;
            s.queue.insert(t, (ask, id.to_string()));
            t
        };
        let _queued = Queued { room: self, ticket };
        let mut last = None;
        loop {
            // Registered before the state is read, so that no change between is missed.
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let wait = {
                let mut s = self.lock();
                if s.cancelled.remove(id) {
                    return Err(RoomError::Cancelled);
                }
                let ahead = s.queue.range(..ticket).count();
                if ahead == 0 && s.reserved + ask <= self.total {
                    s.queue.remove(&ticket);
                    s.held.insert(id.to_string(), ask);
                    s.reserved += ask;
                    drop(s);
                    // The next in line may fit too.
                    self.changed.notify_waiters();
                    return Ok(());
                }
                Waiting { ahead, reserved: s.reserved, total: self.total }
            };
            if last.as_ref() != Some(&wait) {
                waiting(&wait);
                last = Some(wait.clone());
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(RoomError::TimedOut { waited_s: started.elapsed().as_secs(), waiting: wait });
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A place in the queue, given up however the wait ends.
struct Queued<'a> {
    room: &'a Room,
    ticket: u64,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let mut s = self.room.lock();
        if s.queue.remove(&self.ticket).is_some() {
            drop(s);
            self.room.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// Regression: a sandbox released while its create waited for memory kept its place, then
    /// was made (and at once deleted) when memory freed, ahead of the creates behind it.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_ends_at_once_and_those_behind_move_up() {
        let room = Arc::new(Room::new(10));
        room.admit("a", 10, far(), |_| {}).await.unwrap_or_else(|e| panic!("{e}"));
        let r = room.clone();
        let b = tokio::spawn(async move { r.admit("b", 5, far(), |_| {}).await });
        tokio::task::yield_now().await;
        let r = room.clone();
        let c = tokio::spawn(async move { r.admit("c", 5, far(), |_| {}).await });
        tokio::task::yield_now().await;
        room.cancel("b");
        assert_eq!(b.await.ok(), Some(Err(RoomError::Cancelled)));
        room.release("a");
        assert_eq!(c.await.ok(), Some(Ok(())));
        // Calling off what does not wait leaves nothing behind to refuse a later wait.
        room.cancel("d");
        room.admit("d", 5, far(), |_| {}).await.unwrap_or_else(|e| panic!("{e}"));
    }

    #[tokio::test(start_paused = true)]
    async fn creates_wait_in_order_for_memory_given_back() {
        let room = Arc::new(Room::new(10));
        room.admit("a", 6, far(), |_| {}).await.unwrap_or_else(|e| panic!("{e}"));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (r, t) = (room.clone(), tx.clone());
        let b = tokio::spawn(async move { r.admit("b", 6, far(), |w| drop(t.send(("b", w.clone())))).await });
        let (r, t) = (room.clone(), tx.clone());
        tokio::task::yield_now().await;
        // Fits now, but comes after b: it waits its turn.
        let c = tokio::spawn(async move { r.admit("c", 1, far(), |w| drop(t.send(("c", w.clone())))).await });
        tokio::task::yield_now().await;
        let told: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(told[0], ("b", Waiting { ahead: 0, reserved: 6, total: 10 }));
        assert_eq!(told[1], ("c", Waiting { ahead: 1, reserved: 6, total: 10 }));
        assert!(!b.is_finished() && !c.is_finished());
        room.release("a");
        assert!(b.await.is_ok_and(|r| r.is_ok()));
        assert!(c.await.is_ok_and(|r| r.is_ok()));
        assert_eq!(room.lock().reserved, 7);
    }

    #[tokio::test(start_paused = true)]
    async fn what_can_never_fit_is_refused_at_once_and_a_long_wait_ends() {
        let room = Room::new(10);
        let never = room.admit("big", 11, far(), |_| {}).await;
        assert!(matches!(never, Err(RoomError::NeverFits { ask: 11, total: 10 })), "{never:?}");
        room.hold("found-at-start", 8);
        let late = room.admit("x", 4, Instant::now() + Duration::from_secs(30), |_| {}).await;
        let msg = late.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("waited 30 s") && msg.contains("0 create(s) ahead"), "{msg}");
        // The timed-out create left the queue: the next one is first in line.
        room.release("found-at-start");
        assert!(room.admit("y", 4, far(), |_| {}).await.is_ok());
    }
}

//! The daemon's dead-man switch: with no authenticated call for the lease period, it kills every
//! process it started and exits, so that a sandbox dies even when its server is gone for good.
//! Time the daemon spends frozen (its sandbox paused) does not count: nobody could call it then.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
pub struct Lease {
    period: Option<Duration>,
    /// Written by every call, read by the watcher.
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// When the last authenticated call arrived or ended.
    last: Instant,
    /// Calls under way (a long exec, a followed output): the lease does not lapse while there
    /// is one.
    in_flight: u32,
}

impl Lease {
    pub fn new(period: Option<Duration>) -> Self {
        Lease { period, state: Mutex::new(State { last: Instant::now(), in_flight: 0 }) }
    }

    pub fn period(&self) -> Option<Duration> {
        self.period
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Renews the lease (any authenticated call does).
    pub fn renew(&self) {
        self.state().last = Instant::now();
    }

    /// Renews the lease and holds it until the answer is dropped: a call under way.
    pub fn hold(self: &Arc<Self>) -> Held {
        let mut state = self.state();
        state.last = Instant::now();
        state.in_flight = state.in_flight.saturating_add(1);
        Held(Arc::clone(self))
    }

    fn deadline(&self) -> Option<Instant> {
        let state = self.state();
        // While a call is under way the lease is as good as renewed now.
        let last = if state.in_flight > 0 { Instant::now() } else { state.last };
        // A lease too long to add (no server asks for one) never lapses.
        self.period.and_then(|p| last.checked_add(p))
    }

    /// Time left before the lease lapses; `None` when no lease is kept.
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline().map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Resolves when the lease lapses; never when no lease is kept. It looks at the clock at
    /// least every [`TICK`]: a wake much later than asked for means the daemon did not run
    /// meanwhile (its sandbox was paused, its processes frozen), and that time is given back
    /// to the lease, so that a resumed sandbox's daemon does not end it before its server's
    /// renewal arrives.
    pub async fn lapsed(&self) {
        loop {
            let Some(deadline) = self.deadline() else {
                return std::future::pending().await;
            };
            let now = Instant::now();
            if deadline <= now {
                return;
            }
            let wake = now.checked_add(TICK).map_or(deadline, |tick| tick.min(deadline));
            tokio::time::sleep_until(wake).await;
            let late = Instant::now().saturating_duration_since(wake);
            if late > LATE {
                self.stood_still(late);
            }
        }
    }

    /// The daemon was frozen for about `gap`: the lease stood still meanwhile.
    fn stood_still(&self, gap: Duration) {
        let mut state = self.state();
        let now = Instant::now();
        state.last = state.last.checked_add(gap).map_or(now, |t| t.min(now));
    }
}

/// The longest the lease's watcher sleeps between two looks at the clock: a freeze longer than
/// this (and [`LATE`]) is noticed, and the lease loses at most this much to it. The server
/// renews the daemon's lease well before it runs out, a minute beyond its own, so the loss never
/// ends a sandbox.
const TICK: Duration = Duration::from_secs(10);

/// How much later than asked a wake must be to count as a freeze rather than a busy machine.
const LATE: Duration = Duration::from_secs(2);

/// A call under way on the daemon; its end renews the lease.
#[derive(Debug)]
pub struct Held(Arc<Lease>);

impl Drop for Held {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.last = Instant::now();
        state.in_flight = state.in_flight.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn lapses_only_after_a_full_period_without_renewal() {
        let lease = Lease::new(Some(Duration::from_secs(10)));
        tokio::time::advance(Duration::from_secs(6)).await;
        lease.renew();
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(lease.remaining(), Some(Duration::from_secs(4)));
        // The paused clock moves on by the timeout's 1 ms while the lease is awaited.
        let early = tokio::time::timeout(Duration::from_millis(1), lease.lapsed()).await;
        assert!(early.is_err(), "lapsed although renewed 6 s ago");
        tokio::time::advance(Duration::from_secs(4)).await;
        let done = tokio::time::timeout(Duration::from_millis(1), lease.lapsed()).await;
        assert!(done.is_ok());
        assert_eq!(lease.remaining(), Some(Duration::ZERO));
    }

    /// Before, a command running longer than the lease was killed by its own daemon while the
    /// server waited for its answer.
    #[tokio::test(start_paused = true)]
    async fn a_call_under_way_holds_the_lease_until_it_ends() {
        let lease = Arc::new(Lease::new(Some(Duration::from_secs(10))));
        let call = lease.hold();
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(lease.remaining(), Some(Duration::from_secs(10)));
        let early = tokio::time::timeout(Duration::from_secs(30), lease.lapsed()).await;
        assert!(early.is_err(), "lapsed during a call");
        drop(call);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(lease.remaining(), Some(Duration::from_secs(1)));
        let done = tokio::time::timeout(Duration::from_secs(2), lease.lapsed()).await;
        assert!(done.is_ok(), "the lease runs again once the call ended");
    }

    /// Before, a paused sandbox's daemon woke from its freeze past its lease and ended the
    /// sandbox before the server's renewal after the resume could reach it.
    #[tokio::test(start_paused = true)]
    async fn time_spent_frozen_does_not_count_against_the_lease() {
        let lease = Lease::new(Some(Duration::from_secs(30)));
        let lapsed = lease.lapsed();
        tokio::pin!(lapsed);
        assert!(tokio::time::timeout(Duration::from_millis(1), &mut lapsed).await.is_err());
        // Frozen for 100 s: the watcher wakes once, far later than it asked.
        tokio::time::advance(Duration::from_secs(100)).await;
        assert!(tokio::time::timeout(Duration::from_millis(1), &mut lapsed).await.is_err(), "lapsed after a freeze");
        let left = lease.remaining().unwrap_or_default();
        assert!(left >= Duration::from_secs(15) && left <= Duration::from_secs(30), "{left:?}");
        // It still lapses once the remaining time passes with the daemon running.
        let done = tokio::time::timeout(Duration::from_secs(31), &mut lapsed).await;
        assert!(done.is_ok(), "the lease runs again after the freeze");
    }

    #[tokio::test(start_paused = true)]
    async fn no_lease_never_lapses() {
        let lease = Lease::new(None);
        tokio::time::advance(Duration::from_secs(86400)).await;
        assert!(tokio::time::timeout(Duration::from_secs(1), lease.lapsed()).await.is_err());
        assert_eq!(lease.remaining(), None);
    }
}

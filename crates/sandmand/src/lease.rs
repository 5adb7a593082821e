//! The daemon's dead-man switch: with no authenticated call for the lease period, it kills every
//! process it started and exits, so that a sandbox dies even when its server is gone for good.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
pub struct Lease {
    period: Option<Duration>,
    /// When the last authenticated call arrived. Written by every call, read by the watcher.
    last: Mutex<Instant>,
}

impl Lease {
    pub fn new(period: Option<Duration>) -> Self {
        Lease { period, last: Mutex::new(Instant::now()) }
    }

    pub fn period(&self) -> Option<Duration> {
        self.period
    }

    /// Renews the lease (any authenticated call does).
    pub fn renew(&self) {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    fn deadline(&self) -> Option<Instant> {
        let last = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        // A lease too long to add (no server asks for one) never lapses.
        self.period.and_then(|p| last.checked_add(p))
    }

    /// Time left before the lease lapses; `None` when no lease is kept.
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline().map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Resolves when the lease lapses; never when no lease is kept.
    pub async fn lapsed(&self) {
        loop {
            let Some(deadline) = self.deadline() else {
                return std::future::pending().await;
            };
            if deadline <= Instant::now() {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
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

    #[tokio::test(start_paused = true)]
    async fn no_lease_never_lapses() {
        let lease = Lease::new(None);
        tokio::time::advance(Duration::from_secs(86400)).await;
        assert!(tokio::time::timeout(Duration::from_secs(1), lease.lapsed()).await.is_err());
        assert_eq!(lease.remaining(), None);
    }
}

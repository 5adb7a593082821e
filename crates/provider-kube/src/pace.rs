//! Pacing of API writes: [`Pacer`] is a token bucket (an average rate and a burst) shared by every
//! write of the provider, which a `429 Too Many Requests` can also hold shut until its
//! `Retry-After`; [`backoff`] and [`retry_after`] say how long a refused write waits.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use http::HeaderMap;
use tokio::time::Instant;

/// Longest wait a `Retry-After` header is believed for.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// First and longest backoff between retries of one request.
const BACKOFF_BASE: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The slot the pacer granted a write, carried by its request as an extension. What sits below
/// the provider (a log of writes, a metrics layer) sees each write's slot there: the moment a
/// request passes a layer trails its slot by however long the client's queue held it, so writes
/// are seen bunched by scheduling delays the bucket cannot know of, while their slots keep to
/// the bucket exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSlot(pub Instant);

/// A token bucket: `burst` writes may go at once, then `qps` per second on average. Writes are
/// granted slots in the order they ask (a reservation each, so nothing polls), and no write
/// starts inside a hold.
#[derive(Debug)]
pub struct Pacer {
    qps: f64,
    burst: f64,
    /// The bucket; locked only to reserve a slot, never across an await.
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    /// Tokens at `at`; below zero once reservations run ahead of the rate.
    tokens: f64,
    at: Instant,
    /// No write starts before this (a 429's `Retry-After`).
    hold_until: Option<Instant>,
}

impl Pacer {
    pub fn new(qps: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Pacer {
            qps: qps.max(f64::MIN_POSITIVE),
            burst,
            bucket: Mutex::new(Bucket { tokens: burst, at: Instant::now(), hold_until: None }),
        }
    }

    /// Waits for the slot of one write; answers the slot (the bucket's time, which the wake-up
    /// may trail).
    pub async fn acquire(&self) -> Instant {
        loop {
            let slot = self.reserve();
            tokio::time::sleep_until(slot).await;
            // A slot that falls inside a hold set meanwhile is given up, and a later one taken:
            // the writes held back must not all go at once when the hold ends.
            match self.lock().hold_until {
                Some(until) if until > Instant::now() => continue,
                _ => return slot,
            }
        }
    }

    /// Reserves the next slot and says when it starts.
    fn reserve(&self) -> Instant {
        let mut b = self.lock();
        let now = Instant::now();
        let start = match b.hold_until {
            Some(until) if until > now => until.max(b.at),
            _ => now.max(b.at),
        };
        let elapsed = start.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.qps).min(self.burst) - 1.0;
        b.at = start;
        if b.tokens >= 0.0 { start } else { start + Duration::from_secs_f64(-b.tokens / self.qps) }
    }

    /// Holds every write until `until` (the API server said to wait), and lets them resume at
    /// the average rate, without a burst.
    pub fn hold(&self, until: Instant) {
        let mut b = self.lock();
        if b.hold_until.is_some_and(|h| h >= until) {
            return;
        }
        b.hold_until = Some(until);
        if until > b.at {
            b.tokens = b.tokens.min(0.0);
            b.at = until;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.bucket.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The wait a `Retry-After` header asks for, in seconds (the API server's form), capped.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    let secs: u64 = value.parse().ok()?;
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// Exponential backoff for the `attempt`-th retry (from 0), with up to half of it added at
/// random so that many writers refused together do not come back together.
pub fn backoff(attempt: u32) -> Duration {
    let base = BACKOFF_BASE.saturating_mul(1u32 << attempt.min(16)).min(BACKOFF_MAX);
    let jitter = base.mul_f64(random_fraction() / 2.0);
    base + jitter
}

/// A number in [0, 1) from the standard library's per-process random hash keys.
fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts, for every window of `window`, how many of `starts` fall in it, and returns the most.
    fn most_in_window(starts: &[Instant], window: Duration) -> usize {
        starts.iter().map(|s| starts.iter().filter(|t| **t >= *s && **t < *s + window).count()).max().unwrap_or(0)
    }

    #[tokio::test(start_paused = true)]
    async fn writes_keep_to_the_rate_after_the_burst() {
        let pacer = std::sync::Arc::new(Pacer::new(10.0, 5));
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..45 {
            let p = pacer.clone();
            tasks.push(tokio::spawn(async move {
                let slot = p.acquire().await;
                assert_eq!(slot, Instant::now(), "on a paused clock a write wakes at its slot");
                slot
            }));
        }
        let mut starts = Vec::new();
        for t in tasks {
            starts.push(t.await.unwrap_or_else(|e| panic!("{e}")));
        }
        starts.sort();
        assert_eq!(starts.iter().filter(|s| **s == t0).count(), 5, "the burst goes at once");
        // 40 more at 10 per second: the last one 4 s after the start.
        let last = starts.last().copied().unwrap_or(t0);
        assert_eq!(last - t0, Duration::from_secs(4));
        for w in [1, 2, 3] {
            let window = Duration::from_secs(w);
            assert!(most_in_window(&starts, window) <= 5 + 10 * w as usize, "too many writes in {window:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_stops_every_write_and_no_burst_follows_it() {
        let pacer = std::sync::Arc::new(Pacer::new(10.0, 5));
        let t0 = Instant::now();
        pacer.hold(t0 + Duration::from_secs(2));
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let p = pacer.clone();
            tasks.push(tokio::spawn(async move {
                let slot = p.acquire().await;
                assert_eq!(slot, Instant::now(), "on a paused clock a write wakes at its slot");
                slot
            }));
        }
        let mut starts = Vec::new();
        for t in tasks {
            starts.push(t.await.unwrap_or_else(|e| panic!("{e}")));
        }
        starts.sort();
        assert!(starts[0] >= t0 + Duration::from_secs(2), "a write started inside the hold");
        assert_eq!(starts[9] - starts[0], Duration::from_millis(900), "writes after a hold go at the rate");
    }

    #[test]
    fn retry_after_is_read_in_seconds_and_capped() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("1"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(1)));
        h.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("3600"));
        assert_eq!(retry_after(&h), Some(MAX_RETRY_AFTER));
        h.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        assert!(backoff(0) >= BACKOFF_BASE && backoff(0) < BACKOFF_BASE * 2);
        assert!(backoff(3) >= BACKOFF_BASE * 8);
        assert!(backoff(40) <= BACKOFF_MAX + BACKOFF_MAX / 2);
    }
}

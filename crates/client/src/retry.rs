//! [`RetryPolicy`]: which failed calls are sent again, how often, how far apart and for how long.
//! The client's one send loop (`Client::exchange`) asks [`RetryPolicy::wait`] after each failure.
//!
//! A failure is one of three kinds, and the kind decides:
//! - **not sent**: the connection could not be made (refused, reset during connect, timed out):
//!   the server never saw the request, so any call may be sent again;
//! - **shed**: the server answered 503 with `Retry-After` (its load shedding at the edge, before
//!   anything ran), so any call may be sent again, after the wait it asked for (at most 5 s);
//! - **maybe sent**: the connection broke after the request went out (reset, closed before the
//!   answer, or the answer cut short), or a server replica answered 503 with
//!   `X-Sandman-Unanswered` (it passed the call on to the leader, whose connection broke so): the
//!   server may have acted on it, so only an idempotent call is sent again.
//!
//! Every other answer (an error body, a 4xx) is the caller's at once. A streamed upload is never
//! sent twice: its bytes are gone once read.

use std::time::Duration;

use crate::error::ClientError;

/// How many times a call is sent again by default when that is safe.
pub const DEFAULT_RETRIES: u32 = 5;
/// How long, from the first failure, a call may keep being sent again by default.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// The wait before the first resend; it doubles with each one, up to [`BACKOFF_CAP`].
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// The longest `Retry-After` honoured: a longer one is the caller's to wait out.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(5);
/// The largest `SANDMAN_RETRIES`: more would only hide a server that is gone.
pub const MAX_RETRIES: u32 = 100;

/// When a call is sent again (see the module's documentation for which calls may be).
///
/// Resends wait 0.1 s, 0.2 s, 0.4 s ... (at most 2 s) times a random factor between 0.5 and
/// 1.5, so that many clients cut off at once by one server going away do not come back in step.
/// No resend starts once `deadline` has passed since the first failure, nor past `retries`
/// resends. [`RetryPolicy::none`] sends every call once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Resends at most, after the first attempt.
    pub retries: u32,
    /// How long after the first failure resends may still start.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { retries: DEFAULT_RETRIES, deadline: DEFAULT_DEADLINE }
    }
}

/// What kind of failure an attempt ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The request never reached the server.
    NotSent,
    /// The server refused it at the edge before running it, and asked to wait this long.
    Shed(Duration),
    /// The connection broke once the request was out: the server may have acted on it.
    MaybeSent,
    /// An answer: nothing to gain by sending it again.
    Final,
}

/// What an error answer's headers say about sending the call again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hint {
    None,
    /// `Retry-After`, in seconds.
    RetryAfter(Duration),
    /// `X-Sandman-Unanswered`: the call went out to the leader and no answer came back.
    Unanswered,
}

impl Failure {
    /// The kind of `err`, an attempt's failure; `hint` is what a 503's headers said.
    pub(crate) fn of(err: &ClientError, hint: Hint) -> Failure {
        match err {
            ClientError::Request { source, .. } if source.is_connect() => Failure::NotSent,
            ClientError::Request { .. } | ClientError::Body { .. } => Failure::MaybeSent,
            _ if err.status() == Some(503) => match hint {
                Hint::RetryAfter(wait) => Failure::Shed(wait),
                Hint::Unanswered => Failure::MaybeSent,
                Hint::None => Failure::Final,
            },
            _ => Failure::Final,
        }
    }

    /// Whether a call that is not idempotent may be sent again after it.
    fn safe_for_any_call(self) -> bool {
        matches!(self, Failure::NotSent | Failure::Shed(_))
    }
}

impl RetryPolicy {
    /// Every call is sent once.
    pub fn none() -> RetryPolicy {
        RetryPolicy { retries: 0, deadline: Duration::ZERO }
    }

    /// The default policy, changed by `SANDMAN_RETRIES` (resends at most, `0` for none) and
    /// `SANDMAN_RETRY_DEADLINE` (seconds after the first failure), where set.
    pub fn from_env() -> Result<RetryPolicy, ClientError> {
        let var = |name: &'static str| std::env::var(name).ok().filter(|v| !v.trim().is_empty()).map(|v| (name, v));
        RetryPolicy::default().with(var("SANDMAN_RETRIES"), var("SANDMAN_RETRY_DEADLINE"))
    }

    /// This policy with `retries` and `deadline` (as a variable's name and text) where given.
    fn with(
        mut self,
        retries: Option<(&'static str, String)>,
        deadline: Option<(&'static str, String)>,
    ) -> Result<RetryPolicy, ClientError> {
        if let Some((name, text)) = retries {
            self.retries = parse_retries(&text).ok_or(ClientError::InvalidSetting {
                name,
                value: text,
                expected: "a count from 0 to 100",
            })?;
        }
        if let Some((name, text)) = deadline {
            self.deadline = parse_seconds(&text).ok_or(ClientError::InvalidSetting {
                name,
                value: text,
                expected: "seconds from 0 to 3600",
            })?;
        }
        Ok(self)
    }

    /// How long to wait before sending the call again after attempt number `attempts` (from 1)
    /// failed as `failure`, `elapsed` after the first failure; `None` not to.
    pub(crate) fn wait(
        &self,
        failure: Failure,
        idempotent: bool,
        resendable: bool,
        attempts: u32,
        elapsed: Duration,
    ) -> Option<Duration> {
        if failure == Failure::Final || !resendable || attempts > self.retries {
            return None;
        }
        if !idempotent && !failure.safe_for_any_call() {
            return None;
        }
        let wait = match failure {
            Failure::Shed(asked) => asked.clamp(BACKOFF_BASE, MAX_RETRY_AFTER).mul_f64(jitter()),
            _ => backoff(attempts - 1),
        };
        (elapsed + wait <= self.deadline).then_some(wait)
    }
}

/// `retries`: a count from 0 to [`MAX_RETRIES`].
pub fn parse_retries(text: &str) -> Option<u32> {
    text.trim().parse().ok().filter(|n| *n <= MAX_RETRIES)
}

/// A deadline: seconds (fractions allowed) from 0 to an hour.
pub fn parse_seconds(text: &str) -> Option<Duration> {
    let s: f64 = text.trim().parse().ok()?;
    (s.is_finite() && (0.0..=3600.0).contains(&s)).then(|| Duration::from_secs_f64(s))
}

/// The wait before resend number `n` (from 0): 0.1 s doubled `n` times, at most 2 s, jittered.
fn backoff(n: u32) -> Duration {
    BACKOFF_BASE.saturating_mul(1u32 << n.min(16)).min(BACKOFF_CAP).mul_f64(jitter())
}

/// A factor from 0.5 to 1.5, different on every call and in every process: std's `RandomState`
/// is seeded randomly per process and per instance, which is all the randomness this needs.
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    0.5 + (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn what_is_sent_again_depends_on_whether_it_may_have_been_run() {
        let p = RetryPolicy::default();
        for idempotent in [false, true] {
            assert!(p.wait(Failure::NotSent, idempotent, true, 1, Duration::ZERO).is_some());
            assert!(p.wait(Failure::Shed(SECOND), idempotent, true, 1, Duration::ZERO).is_some());
            assert!(p.wait(Failure::Final, idempotent, true, 1, Duration::ZERO).is_none());
            // A streamed body cannot be read twice.
            assert!(p.wait(Failure::NotSent, idempotent, false, 1, Duration::ZERO).is_none());
        }
        assert!(p.wait(Failure::MaybeSent, true, true, 1, Duration::ZERO).is_some());
        assert!(p.wait(Failure::MaybeSent, false, true, 1, Duration::ZERO).is_none());
    }

    #[test]
    fn resends_stop_at_the_count_and_at_the_deadline() {
        let p = RetryPolicy { retries: 2, deadline: 10 * SECOND };
        assert!(p.wait(Failure::NotSent, true, true, 2, Duration::ZERO).is_some());
        assert!(p.wait(Failure::NotSent, true, true, 3, Duration::ZERO).is_none());
        assert!(p.wait(Failure::NotSent, true, true, 1, 10 * SECOND).is_none());
        assert!(RetryPolicy::none().wait(Failure::NotSent, true, true, 1, Duration::ZERO).is_none());
    }

    #[test]
    fn waits_grow_to_a_cap_with_jitter_and_shedding_waits_as_asked() {
        for n in 0..20 {
            let nominal = BACKOFF_BASE.saturating_mul(1 << n.min(16)).min(BACKOFF_CAP);
            let wait = backoff(n);
            assert!(wait >= nominal / 2 && wait <= nominal.mul_f64(1.5), "{n}: {wait:?}");
        }
        let p = RetryPolicy::default();
        let shed = p.wait(Failure::Shed(60 * SECOND), false, true, 1, Duration::ZERO).unwrap_or_default();
        assert!(shed <= MAX_RETRY_AFTER.mul_f64(1.5), "{shed:?}");
        let factors: std::collections::HashSet<u64> = (0..16).map(|_| jitter().to_bits()).collect();
        assert!(factors.len() > 1, "the jitter never varies");
    }

    #[test]
    fn settings_from_the_environment_are_checked() {
        let name = |v: &str| Some(("SANDMAN_RETRIES", v.to_string()));
        let d = |v: &str| Some(("SANDMAN_RETRY_DEADLINE", v.to_string()));
        let p = RetryPolicy::default().with(name("0"), d("2.5")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p, RetryPolicy { retries: 0, deadline: Duration::from_millis(2500) });
        for (r, dl) in [(name("-1"), None), (name("101"), None), (name("x"), None), (None, d("nan")), (None, d("4000"))]
        {
            let err = RetryPolicy::default().with(r, dl).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("SANDMAN_RETR"), "{err}");
        }
    }
}

//! `OutputBudget`: the daemon-wide bound on command output held in memory at once, shared by
//! the output `/v1/exec` collects, the output background processes retain and the output a
//! session run keeps until it ends (`--max-buffered-output`). Each holder takes bytes before it keeps them and gives them back
//! when it drops them (their capacity, not only their length: see [`OutputBudget::grow`]); what
//! the budget cannot grant is not kept (an exec's or a session run's output is cut and
//! marked truncated, a process's oldest output is dropped and counted).

use std::sync::atomic::{AtomicU64, Ordering};

/// `--max-buffered-output` by default.
pub const DEFAULT_MAX_BUFFERED_OUTPUT: u64 = 256 << 20;

#[derive(Debug)]
pub struct OutputBudget {
    limit: u64,
    /// Bytes granted and not given back.
    held: AtomicU64,
}

impl OutputBudget {
    pub fn new(limit: u64) -> Self {
        OutputBudget { limit, held: AtomicU64::new(0) }
    }

    /// Grants up to `want` bytes, as many as the budget has left.
    pub fn take(&self, want: u64) -> u64 {
        let mut granted = 0;
        let _ = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            granted = want.min(self.limit.saturating_sub(held));
            Some(held.saturating_add(granted))
        });
        granted
    }

    /// Gives back bytes taken earlier.
    pub fn give_back(&self, n: u64) {
        let _ = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| Some(held.saturating_sub(n)));
    }

    /// Room for `incoming` more bytes in a buffer of `len` bytes that may hold at most `cap`,
    /// and has `charged` bytes of capacity taken from the budget: takes more (doubling, as a
    /// growing `Vec` does) as far as the budget allows, and answers the length the buffer may
    /// reach now. Charging capacity rather than length keeps what the daemon actually holds,
    /// slack included, within the budget.
    pub fn grow(&self, charged: &mut u64, len: u64, incoming: u64, cap: u64) -> u64 {
        let need = len.saturating_add(incoming).min(cap);
        if need > *charged {
            let want = need.max(charged.saturating_mul(2)).min(cap);
            *charged = charged.saturating_add(self.take(want.saturating_sub(*charged)));
        }
        (*charged).min(cap)
    }

    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_what_is_left_and_takes_back_what_is_given() {
        let b = OutputBudget::new(10);
        assert_eq!(b.take(4), 4);
        assert_eq!(b.take(8), 6);
        assert_eq!(b.take(1), 0);
        b.give_back(5);
        assert_eq!((b.held(), b.take(100)), (5, 5));
    }
}

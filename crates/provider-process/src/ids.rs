//! Host id ranges for isolated sandboxes: each gets [`PER_SANDBOX`] uids and gids of its own,
//! from [`FIRST`] on, so that no two sandboxes (and no host user) share an id. A sandbox's range
//! is written in its directory (`ids`) before its daemon starts, and read back at start, so a
//! restarted server never hands one out twice.

use std::collections::BTreeSet;

use sandman_provider::ProviderError;

/// Ids per sandbox: its root is the first.
pub const PER_SANDBOX: u32 = 65536;

/// The first host id given to sandboxes (0x20000000): far above any user's or a distribution's
/// ids, below the ranges systemd reserves near 2^31.
pub const FIRST: u32 = 0x2000_0000;

/// How many ranges there are: sandboxes held at once by one server.
pub const SLOTS: u32 = 8192;

/// Slot 0 is kept for the isolation check the provider runs at start.
pub const CHECK_SLOT: u32 = 0;

/// The host id of a slot's root.
pub fn base_of(slot: u32) -> u32 {
    FIRST + slot * PER_SANDBOX
}

/// The slot whose root is host id `base`, if it is one.
pub fn slot_of(base: u32) -> Option<u32> {
    let off = base.checked_sub(FIRST)?;
    (off % PER_SANDBOX == 0 && off / PER_SANDBOX < SLOTS).then_some(off / PER_SANDBOX)
}

/// Which slots are taken. Locked briefly by its owner, never across an await.
#[derive(Debug, Default)]
pub struct Slots {
    taken: BTreeSet<u32>,
}

impl Slots {
    /// Marks `slot` taken (a sandbox found at start); false when it already was.
    pub fn mark(&mut self, slot: u32) -> bool {
        self.taken.insert(slot)
    }

    /// The lowest free slot, now taken.
    pub fn take(&mut self) -> Result<u32, ProviderError> {
        let free = (CHECK_SLOT + 1..SLOTS).find(|s| !self.taken.contains(s)).ok_or_else(|| {
            ProviderError::Backend(format!(
                "no free id range: this server holds {} isolated sandboxes, the most it can",
                SLOTS - 1
            ))
        })?;
        self.taken.insert(free);
        Ok(free)
    }

    pub fn free(&mut self, slot: u32) {
        self.taken.remove(&slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_lowest_first_and_never_twice() {
        let mut s = Slots::default();
        assert!(s.mark(2));
        assert!(!s.mark(2));
        assert_eq!(s.take().ok(), Some(1));
        assert_eq!(s.take().ok(), Some(3));
        s.free(1);
        assert_eq!(s.take().ok(), Some(1));
    }

    #[test]
    fn ranges_do_not_overlap_and_stay_below_2_pow_31() {
        assert_eq!(base_of(1) - base_of(0), PER_SANDBOX);
        assert!(u64::from(base_of(SLOTS - 1)) + u64::from(PER_SANDBOX) <= 1 << 31);
        assert_eq!(slot_of(base_of(7)), Some(7));
        assert_eq!(slot_of(base_of(7) + 1), None);
        assert_eq!(slot_of(5), None);
    }

    #[test]
    fn running_out_is_an_error_naming_the_limit() {
        let mut s = Slots::default();
        for slot in 1..SLOTS {
            s.mark(slot);
        }
        let e = s.take().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("8191"), "{e}");
    }
}

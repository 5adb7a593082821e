//! Host id ranges for isolated sandboxes: each gets [`PER_SANDBOX`] uids and gids of its own,
//! from [`FIRST`] on, so that no two sandboxes (and no host user) share an id. A sandbox's range
//! is written in its directory (`ids`) before its daemon starts, and read back at start, so a
//! restarted server never hands one out twice.
//!
//! Ranges start [`STRIDE`] ids apart, one more than a range holds: the kernel keeps a
//! `user_struct` per host uid in use in a hash of 128 buckets (`kernel/user.c`, `uidhash_table`,
//! bucket `((uid >> 7) + uid) & 127`), which every `setresuid` walks under a spin lock
//! (`alloc_uid`). Roots 65,536 apart all fell in one bucket, so each sandbox's start walked the
//! roots of all the others: a per-create cost that grew with the sandboxes held.

use std::collections::BTreeSet;

use sandman_provider::ProviderError;
use sandman_wire::server::Reason;

/// Ids per sandbox: its root is the first.
pub const PER_SANDBOX: u32 = 65536;

/// The first host id given to sandboxes (0x20000000): far above any user's or a distribution's
/// ids.
pub const FIRST: u32 = 0x2000_0000;

/// How far apart ranges start: one id more than a range holds, so that consecutive roots fall
/// in different buckets of the kernel's uid hash (the module's comment). The id between two
/// ranges is nobody's.
pub const STRIDE: u32 = PER_SANDBOX + 1;

/// How many ranges there are: sandboxes held at once by one server. The last ends below
/// 0x70000000, below the ranges systemd keeps for itself from there up to 2^31 (its container
/// and foreign ids, `nobody`'s 65534 aliases).
pub const SLOTS: u32 = 20479;

/// Slot 0 is kept for the isolation check the provider runs at start.
pub const CHECK_SLOT: u32 = 0;

/// The host id of a slot's root.
pub fn base_of(slot: u32) -> u32 {
    FIRST + slot * STRIDE
}

/// The slot whose root is host id `base`, if it is one.
pub fn slot_of(base: u32) -> Option<u32> {
    let off = base.checked_sub(FIRST)?;
    (off % STRIDE == 0 && off / STRIDE < SLOTS).then_some(off / STRIDE)
}

/// Every slot whose range shares an id with the range that starts at `base`: its own slot for a
/// root this module handed out, and the one or two slots it overlaps for a range on another
/// grid (a sandbox left by a server that spaced ranges differently), so that a restarted server
/// hands out none of those ids again.
pub fn slots_overlapping(base: u32) -> std::ops::Range<u32> {
    let Some(off) = base.checked_sub(FIRST) else { return 0..0 };
    let first = off / STRIDE;
    let last = (u64::from(off) + u64::from(PER_SANDBOX) - 1) / u64::from(STRIDE);
    first.min(SLOTS)..(last as u32 + 1).min(SLOTS)
}

/// Which slots are taken: every slot below `next` is taken unless it is in `free`. Taking and
/// giving back cost a logarithm of the slots free, not a scan of those taken. Locked briefly by
/// its owner, never across an await.
#[derive(Debug)]
pub struct Slots {
    /// Slots below `next` given back (or never taken, below one marked at start).
    free: BTreeSet<u32>,
    /// The lowest slot never handed out.
    next: u32,
}

impl Default for Slots {
    fn default() -> Self {
        Slots { free: BTreeSet::new(), next: CHECK_SLOT + 1 }
    }
}

impl Slots {
    /// Marks `slot` taken (a sandbox found at start); false when it already was.
    pub fn mark(&mut self, slot: u32) -> bool {
        if slot >= self.next {
            self.free.extend(self.next..slot);
            self.next = slot + 1;
            return true;
        }
        self.free.remove(&slot)
    }

    /// The lowest free slot, now taken.
    pub fn take(&mut self) -> Result<u32, ProviderError> {
        if let Some(slot) = self.free.pop_first() {
            return Ok(slot);
        }
        if self.next >= SLOTS {
            return Err(ProviderError::Failed {
                reason: Reason::ResourceExhausted,
                message: format!(
                    "no free id range: this server holds {} isolated sandboxes, the most the process provider can (one range of {PER_SANDBOX} host ids each)",
                    SLOTS - 1
                ),
            });
        }
        self.next += 1;
        Ok(self.next - 1)
    }

    pub fn free(&mut self, slot: u32) {
        if slot < self.next && slot != CHECK_SLOT {
            self.free.insert(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_lowest_first_and_never_twice() {
        let mut fresh = Slots::default();
        assert_eq!(fresh.take().ok(), Some(1));
        assert_eq!(fresh.take().ok(), Some(2));
        let mut s = Slots::default();
        assert!(s.mark(2));
        assert!(!s.mark(2));
        assert_eq!(s.take().ok(), Some(1));
        assert_eq!(s.take().ok(), Some(3));
        s.free(1);
        assert_eq!(s.take().ok(), Some(1));
    }

    #[test]
    fn ranges_do_not_overlap_and_stay_below_0x70000000() {
        assert!(base_of(1) - base_of(0) >= PER_SANDBOX);
        assert!(u64::from(base_of(SLOTS - 1)) + u64::from(PER_SANDBOX) <= 0x7000_0000);
        assert_eq!(slot_of(base_of(7)), Some(7));
        assert_eq!(slot_of(base_of(7) + 1), None);
        assert_eq!(slot_of(5), None);
        assert_eq!(slots_overlapping(base_of(7)), 7..8);
        assert_eq!(slots_overlapping(5), 0..0);
    }

    /// The kernel's bucket for a uid in its table of `user_struct`s (`__uidhashfn`,
    /// `kernel/user.c`, 128 buckets).
    fn kernel_uid_bucket(uid: u32) -> u32 {
        ((uid >> 7).wrapping_add(uid)) & 127
    }

    #[test]
    fn sandbox_roots_spread_over_the_kernels_uid_hash() {
        // Regression: roots 65,536 apart all hashed to one bucket, and every sandbox's start
        // walked the roots of all the sandboxes held (`alloc_uid` in `setresuid`).
        let mut per_bucket = [0u32; 128];
        for slot in 1..=12_800 {
            per_bucket[kernel_uid_bucket(base_of(slot)) as usize] += 1;
        }
        let fullest = per_bucket.iter().max().copied().unwrap_or(0);
        assert!(fullest <= 2 * 12_800 / 128, "roots of 12,800 sandboxes put {fullest} in one bucket: {per_bucket:?}");
    }

    #[test]
    fn a_range_on_the_old_grid_keeps_every_slot_it_overlaps() {
        // A sandbox left by a server that spaced ranges 65,536 apart.
        let old = FIRST + 300 * PER_SANDBOX;
        let slots = slots_overlapping(old);
        assert_eq!(slot_of(old), None);
        assert!(!slots.is_empty());
        for slot in 0..SLOTS {
            let (a, b) = (u64::from(base_of(slot)), u64::from(old));
            let overlaps = a < b + u64::from(PER_SANDBOX) && b < a + u64::from(PER_SANDBOX);
            assert_eq!(slots.contains(&slot), overlaps, "slot {slot}");
        }
    }

    #[test]
    fn running_out_is_an_error_naming_the_limit() {
        let mut s = Slots::default();
        for slot in 1..SLOTS {
            s.mark(slot);
        }
        let e = s.take().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("20478"), "{e}");
        s.free(5);
        assert_eq!(s.take().ok(), Some(5));
    }
}

//! Host id ranges for isolated sandboxes: each gets [`PER_SANDBOX`] uids and gids of its own,
//! from [`FIRST`] on, so that no two sandboxes (and no host user) share an id. A sandbox's range
//! is written in its directory (`ids`) before its daemon starts, and read back at start, so a
//! restarted server never hands one out twice.
//!
//! The ranges are the host's, not one server's: every server on the machine takes its slots from
//! one registry ([`Registry`], a file per slot taken under `/run/sandman/slots`, made with
//! `O_EXCL`), so that two servers never give their sandboxes the same host ids. [`IdRanges`]
//! is what the provider holds: its own slots, and the registry behind them.
//!
//! Ranges start [`STRIDE`] ids apart, one more than a range holds: the kernel keeps a
//! `user_struct` per host uid in use in a hash of 128 buckets (`kernel/user.c`, `uidhash_table`,
//! bucket `((uid >> 7) + uid) & 127`), which every `setresuid` walks under a spin lock
//! (`alloc_uid`). Roots 65,536 apart all fell in one bucket, so each sandbox's start walked the
//! roots of all the others: a per-create cost that grew with the sandboxes held.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use sandman_provider::ProviderError;
use sandman_wire::server::Reason;

/// Where the host's registry of taken slots lives: a tmpfs that a reboot empties, as it ends
/// every sandbox.
pub const REGISTRY_DIR: &str = "/run/sandman/slots";

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

/// Which slots this server has taken: every slot below `next` is taken unless it is in `free`.
/// Taking and giving back cost a logarithm of the slots free, not a scan of those taken.
#[derive(Debug)]
pub struct Slots {
    /// Slots below `next` given back (or never taken, below one marked at start).
    free: BTreeSet<u32>,
    /// The lowest slot never handed out.
    next: u32,
    /// Slots another server on the host held when this one tried them: tried again only when
    /// no other is free.
    foreign: BTreeSet<u32>,
}

impl Default for Slots {
    fn default() -> Self {
        Slots { free: BTreeSet::new(), next: CHECK_SLOT + 1, foreign: BTreeSet::new() }
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
            let others = self.foreign.len();
            return Err(ProviderError::Failed {
                reason: Reason::ResourceExhausted,
                message: format!(
                    "no free id range: this host's servers hold {} isolated sandboxes ({others} of them another server's), the most the process provider can (one range of {PER_SANDBOX} host ids each)",
                    SLOTS - 1
                ),
            });
        }
        self.next += 1;
        Ok(self.next - 1)
    }

    /// The lowest free slot that `claim` gets too (false: another server holds it, so it is set
    /// aside). Slots set aside are tried again once no other is free.
    pub fn take_claimed(&mut self, mut claim: impl FnMut(u32) -> io::Result<bool>) -> Result<u32, ProviderError> {
        let mut retried = false;
        loop {
            let slot = match self.take() {
                Ok(slot) => slot,
                Err(_) if !retried && !self.foreign.is_empty() => {
                    retried = true;
                    let foreign = std::mem::take(&mut self.foreign);
                    self.free.extend(foreign);
                    continue;
                }
                Err(e) => return Err(e),
            };
            match claim(slot) {
                Ok(true) => return Ok(slot),
                Ok(false) => {
                    self.foreign.insert(slot);
                }
                Err(e) => {
                    self.free(slot);
                    return Err(ProviderError::io(
                        format!("cannot take id range {slot} in the host's registry `{REGISTRY_DIR}`"),
                        e,
                    ));
                }
            }
        }
    }

    pub fn free(&mut self, slot: u32) {
        if slot < self.next && slot != CHECK_SLOT {
            self.free.insert(slot);
        }
    }
}

/// The host's registry of taken slots: `<dir>/<slot>` holds the state directory of the server
/// that took it and the sandbox's id. Made with `O_EXCL`, so two servers never take one slot.
#[derive(Debug)]
pub struct Registry {
    dir: PathBuf,
    /// This server's state directory, as written in its entries.
    owner: String,
}

impl Registry {
    /// Opens (makes, 0700) the registry at `dir` for the server whose state directory is `owner`.
    pub fn open(dir: &Path, owner: &Path) -> io::Result<Registry> {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        Ok(Registry { dir: dir.to_path_buf(), owner: owner.display().to_string() })
    }

    fn entry(&self, slot: u32) -> PathBuf {
        self.dir.join(slot.to_string())
    }

    /// Takes `slot` for `sandbox`: false when another server holds it. True too when this server
    /// holds it already (a restarted server finding its sandboxes).
    pub fn claim(&self, slot: u32, sandbox: &str) -> io::Result<bool> {
        let path = self.entry(slot);
        let made = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path);
        match made {
            Ok(mut f) => {
                io::Write::write_all(&mut f, format!("{}\n{sandbox}\n", self.owner).as_bytes())?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                Ok(self.holder(slot).is_some_and(|(owner, _)| owner == self.owner))
            }
            Err(e) => Err(e),
        }
    }

    /// Gives `slot` back, if this server holds it.
    pub fn release(&self, slot: u32) {
        if self.holder(slot).is_some_and(|(owner, _)| owner == self.owner) {
            let _ = std::fs::remove_file(self.entry(slot));
        }
    }

    /// Who holds `slot`: a state directory and a sandbox id.
    fn holder(&self, slot: u32) -> Option<(String, String)> {
        let text = std::fs::read_to_string(self.entry(slot)).ok()?;
        let mut lines = text.lines();
        Some((lines.next()?.to_string(), lines.next().unwrap_or_default().to_string()))
    }

    /// Removes what no live sandbox holds: this server's entries whose sandbox it no longer has
    /// (`ours`: slot to sandbox id), and entries of servers whose state directory is gone.
    /// Answers the slots other servers hold. Run at start, before any create.
    pub fn sweep(&self, ours: &HashMap<u32, String>) -> io::Result<Vec<u32>> {
        let mut others = Vec::new();
        for entry in std::fs::read_dir(&self.dir)?.flatten() {
            let Some(slot) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Some((owner, sandbox)) = self.holder(slot) else { continue };
            let stale = if owner == self.owner {
                ours.get(&slot) != Some(&sandbox)
            } else {
                !Path::new(&owner).join("sandboxes").join(&sandbox).exists()
            };
            if stale {
                let _ = std::fs::remove_file(entry.path());
            } else if owner != self.owner {
                others.push(slot);
            }
        }
        Ok(others)
    }
}

/// An isolated provider's id ranges: the slots this server holds, taken and given back through
/// the host's registry.
#[derive(Debug)]
pub struct IdRanges {
    /// Locked briefly (a file made or removed under it), never across an await.
    slots: Mutex<Slots>,
    registry: Registry,
}

impl IdRanges {
    /// This server's ranges, from the sandboxes it has (`found`: each one's slots and id), with
    /// the registry made to agree: their entries made again where a reboot or a crash lost them,
    /// stale entries removed, and every slot another server holds set aside.
    pub fn recover(registry: Registry, found: &[(u32, String)]) -> io::Result<IdRanges> {
        let mut slots = Slots::default();
        let mut ours = HashMap::new();
        for (slot, sandbox) in found {
            slots.mark(*slot);
            if !registry.claim(*slot, sandbox)? {
                tracing::error!(
                    slot,
                    sandbox,
                    "another server on this host holds the id range of this server's sandbox"
                );
            }
            ours.insert(*slot, sandbox.clone());
        }
        for slot in registry.sweep(&ours)? {
            slots.mark(slot);
            slots.foreign.insert(slot);
        }
        Ok(IdRanges { slots: Mutex::new(slots), registry })
    }

    /// A slot for `sandbox`, given back when the guard is dropped unless kept.
    pub fn take(&self, sandbox: &str) -> Result<SlotGuard<'_>, ProviderError> {
        let slot = self.lock().take_claimed(|slot| self.registry.claim(slot, sandbox))?;
        Ok(SlotGuard { ranges: self, slot, kept: false })
    }

    /// Gives a sandbox's slot back, to this server and to the host.
    pub fn free(&self, slot: u32) {
        let mut slots = self.lock();
        self.registry.release(slot);
        slots.free(slot);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An id range taken for a create: given back when the create fails (dropped), kept once it
/// succeeds.
#[derive(Debug)]
pub struct SlotGuard<'a> {
    ranges: &'a IdRanges,
    pub slot: u32,
    kept: bool,
}

impl SlotGuard<'_> {
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.ranges.free(self.slot);
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

    /// Regression (issue 29): every server numbered its sandboxes' ranges from the same first
    /// slot, so the first sandboxes of two servers on one host had the same host ids.
    #[test]
    fn two_servers_on_one_host_never_take_the_same_range() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (a_state, b_state) = (dir.path().join("a"), dir.path().join("b"));
        for s in [&a_state, &b_state] {
            std::fs::create_dir_all(s.join("sandboxes")).unwrap_or_else(|e| panic!("{e}"));
        }
        let registry = dir.path().join("slots");
        let open = |state: &Path| Registry::open(&registry, state).unwrap_or_else(|e| panic!("{e}"));
        let a = IdRanges::recover(open(&a_state), &[]).unwrap_or_else(|e| panic!("{e}"));
        let b = IdRanges::recover(open(&b_state), &[]).unwrap_or_else(|e| panic!("{e}"));
        let mut seen = BTreeSet::new();
        for i in 0..50 {
            let (x, y) = (a.take(&format!("a{i}")), b.take(&format!("b{i}")));
            let (x, y) = (x.unwrap_or_else(|e| panic!("{e}")), y.unwrap_or_else(|e| panic!("{e}")));
            assert!(seen.insert(x.slot) && seen.insert(y.slot), "slot {} or {} handed out twice", x.slot, y.slot);
            x.keep();
            y.keep();
        }
        // A slot given back leaves the registry, and is taken again first; a create that fails
        // gives its back.
        a.free(1);
        assert!(!registry.join("1").exists(), "a freed slot kept its registry entry");
        let again = a.take("a-again").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again.slot, 1);
        assert!(registry.join("1").exists());
        drop(again);
        assert!(!registry.join("1").exists(), "a failed create kept its registry entry");
        // Another server's slots are tried again once none other is free.
        let mut s = Slots::default();
        let held_elsewhere = |slot: u32| Ok(slot >= 3);
        assert_eq!(s.take_claimed(held_elsewhere).ok(), Some(3));
        s.next = SLOTS;
        assert_eq!(s.take_claimed(|_| Ok(true)).ok(), Some(1), "the set-aside slots were never tried again");
    }

    #[test]
    fn a_restart_keeps_its_entries_and_sweeps_what_no_sandbox_holds() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let state = dir.path().join("state");
        std::fs::create_dir_all(state.join("sandboxes/alive")).unwrap_or_else(|e| panic!("{e}"));
        let registry = dir.path().join("slots");
        let open = |state: &Path| Registry::open(&registry, state).unwrap_or_else(|e| panic!("{e}"));
        let first = IdRanges::recover(open(&state), &[]).unwrap_or_else(|e| panic!("{e}"));
        first.take("alive").unwrap_or_else(|e| panic!("{e}")).keep();
        first.take("crashed-before-its-record").unwrap_or_else(|e| panic!("{e}")).keep();
        // A server whose state directory is gone left an entry too.
        std::fs::write(registry.join("9"), "/nonexistent/state\nsb\n").unwrap_or_else(|e| panic!("{e}"));
        drop(first);
        let second = IdRanges::recover(open(&state), &[(1, "alive".to_string())]).unwrap_or_else(|e| panic!("{e}"));
        let left: BTreeSet<String> = std::fs::read_dir(&registry)
            .unwrap_or_else(|e| panic!("{e}"))
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, BTreeSet::from(["1".to_string()]));
        assert_eq!(second.take("next").map(|g| g.slot).ok(), Some(2));
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

//! Every sandbox the server knows, ended ones until they are forgotten, by id, by idempotency key
//! and by job.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sandman_wire::server::SandboxState;

use crate::sandbox::Sandbox;

/// The table, behind its lock. Take [`Table::lock`] only where several steps must see one
/// state (a create checks its key and its job's quota and inserts under one lock); the other
/// methods lock for a moment.
#[derive(Debug, Default)]
pub(super) struct Table {
    index: Mutex<Index>,
}

#[derive(Debug, Default)]
pub(super) struct Index {
    by_id: HashMap<String, Arc<Sandbox>>,
    /// idempotency key → sandbox id.
    by_key: HashMap<String, String>,
    /// job → its sandboxes (ended ones too, until forgotten).
    by_job: HashMap<String, HashSet<String>>,
}

impl Table {
    pub(super) fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.lock().get(id)
    }

    /// The job's sandboxes, ended ones included.
    pub(super) fn of_job(&self, job: &str) -> Vec<Arc<Sandbox>> {
        let index = self.lock();
        index.by_job.get(job).into_iter().flatten().filter_map(|id| index.by_id.get(id).cloned()).collect()
    }

    /// Every sandbox known, ended ones included.
    pub(super) fn snapshot(&self) -> Vec<Arc<Sandbox>> {
        self.lock().by_id.values().cloned().collect()
    }

    pub(super) fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Every job with a sandbox still known.
    pub(super) fn job_names(&self) -> BTreeSet<String> {
        self.lock().by_job.keys().cloned().collect()
    }

    /// Live claimed pool sandboxes, by pool, counted under the lock (no copy of the table).
    pub(super) fn claimed_per_pool(&self) -> HashMap<String, u64> {
        let mut claimed: HashMap<String, u64> = HashMap::new();
        for sb in self.lock().by_id.values() {
            if let (Some(p), Some(_)) = (sb.pool(), sb.claimed_ms)
                && !sb.state().is_terminal()
            {
                *claimed.entry(p.to_string()).or_default() += 1;
            }
        }
        claimed
    }

    /// Forgets an ended sandbox: it leaves every index that still names it.
    pub(super) fn forget(&self, sb: &Sandbox) {
        let mut index = self.lock();
        // A claimed pool sandbox replaced its pool's record of it under the same id.
        if index.by_id.get(sb.id()).is_some_and(|s| std::ptr::eq(s.as_ref(), sb)) {
            index.by_id.remove(sb.id());
        }
        if let Some(k) = &sb.spec.server.idempotency_key
            && index.by_key.get(k).map(String::as_str) == Some(sb.id())
        {
            index.by_key.remove(k);
        }
        if let Some(job) = &sb.spec.job
            && let Some(set) = index.by_job.get_mut(job)
        {
            set.remove(sb.id());
            if set.is_empty() {
                index.by_job.remove(job);
            }
        }
    }

    /// The ready journal's lines of the ready (or releasing) sandboxes, with their records:
    /// what it keeps when it compacts.
    pub(super) fn ready_lines(&self) -> Vec<String> {
        let index = self.lock();
        index
            .by_id
            .values()
            .filter_map(|sb| {
                let inner = sb.lock();
                matches!(inner.state, SandboxState::Ready | SandboxState::Releasing)
                    .then(|| crate::journal::ready_line(sb.id(), inner.conditions.taken()))
            })
            .collect()
    }
}

impl Index {
    pub(super) fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.by_id.get(id).cloned()
    }

    pub(super) fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// The sandbox created under idempotency key `key`, unless its create was given up by its
    /// caller while queued (it made nothing: a retry starts anew).
    pub(super) fn under_key(&self, key: &str) -> Option<Arc<Sandbox>> {
        self.by_key
            .get(key)
            .and_then(|id| self.by_id.get(id))
            .filter(|sb| !sb.abandoned.load(Ordering::Relaxed))
            .cloned()
    }

    pub(super) fn insert(&mut self, sb: &Arc<Sandbox>) {
        let id = sb.id().to_string();
        if let Some(k) = &sb.spec.server.idempotency_key {
            self.by_key.insert(k.clone(), id.clone());
        }
        if let Some(job) = &sb.spec.job {
            self.by_job.entry(job.clone()).or_default().insert(id.clone());
        }
        self.by_id.insert(id, sb.clone());
    }

    pub(super) fn live_of_job(&self, job: &str) -> u64 {
        self.by_job
            .get(job)
            .into_iter()
            .flatten()
            .filter(|id| self.by_id.get(*id).is_some_and(|s| !s.state().is_terminal()))
            .count() as u64
    }
}

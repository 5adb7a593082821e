//! Jobs: their quotas, weights and rates (kept across restarts in `jobs.json`), heartbeats that
//! renew a whole job, usage, and deleting a job with everything it has.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sandman_wire::server::{Job, JobAction, JobSpec, JobUsage, Reason};
use tokio::time::Instant;

use super::Service;
use super::request::bad_number;
use crate::admission::Tenant;
use crate::error::{ServerError, ServerResult};
use crate::sandbox::now_ms;
use crate::store::{self, Store};

/// Jobs by name, and the file that keeps them.
#[derive(Debug)]
pub(super) struct Jobs {
    store: Store,
    entries: Mutex<BTreeMap<String, JobEntry>>,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct JobEntry {
    spec: JobSpec,
    created: u64,
    last_heartbeat_ms: Option<u64>,
    /// The secret of the job's SandboxFusion capability URL, while it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fusion_key: Option<String>,
}

impl Jobs {
    pub(super) fn open(store: &Store) -> Jobs {
        Jobs { entries: Mutex::new(store.load(store::JOBS)), store: store.clone() }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, JobEntry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every job's admission tenant with its weight and create rate.
    pub(super) fn tenants(&self) -> Vec<(Tenant, Option<f64>, Option<f64>)> {
        self.lock().iter().map(|(name, e)| (Tenant::Job(name.clone()), e.spec.weight, e.spec.create_rate)).collect()
    }

    pub(super) fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }

    /// The job's own lease for its sandboxes, when it set one.
    pub(super) fn lease_s(&self, name: &str) -> Option<u64> {
        self.lock().get(name).and_then(|e| e.spec.lease_s)
    }

    /// The job's admission weight, when it set one.
    pub(super) fn weight(&self, name: &str) -> Option<f64> {
        self.lock().get(name).and_then(|e| e.spec.weight)
    }

    /// The job's create rate, when it set one.
    pub(super) fn create_rate(&self, name: &str) -> Option<f64> {
        self.lock().get(name).and_then(|e| e.spec.create_rate)
    }

    /// The job's `max_sandboxes` quota, when it set one.
    pub(super) fn max_sandboxes(&self, name: &str) -> Option<u64> {
        self.lock().get(name).and_then(|e| e.spec.max_sandboxes)
    }

    /// Counts a sandbox created for the job.
    pub(super) fn count_created(&self, name: &str) {
        if let Some(e) = self.lock().get_mut(name) {
            e.created += 1;
        }
    }

    fn put(&self, name: &str, spec: JobSpec) {
        let mut entries = self.lock();
        entries.entry(name.to_string()).or_default().spec = spec;
        self.save(&entries);
    }

    /// Forgets the job; false when it had no spec.
    fn remove(&self, name: &str) -> bool {
        let mut entries = self.lock();
        let known = entries.remove(name).is_some();
        if known {
            self.save(&entries);
        }
        known
    }

    /// The job's SandboxFusion key, made (with the job, when it has no spec) when it has none.
    fn fusion_key(&self, name: &str) -> std::io::Result<String> {
        let mut entries = self.lock();
        let entry = entries.entry(name.to_string()).or_default();
        if let Some(key) = &entry.fusion_key {
            return Ok(key.clone());
        }
        let key = crate::auth::random_token()?;
        entry.fusion_key = Some(key.clone());
        self.save(&entries);
        Ok(key)
    }

    /// Forgets the job's SandboxFusion key; false when it had none.
    fn revoke_fusion_key(&self, name: &str) -> bool {
        let mut entries = self.lock();
        let had = entries.get_mut(name).and_then(|e| e.fusion_key.take()).is_some();
        if had {
            self.save(&entries);
        }
        had
    }

    /// The job whose SandboxFusion key `key` is. Every key is compared in constant time, so
    /// the answer's timing says nothing of how close a guess came.
    fn job_of_fusion_key(&self, key: &str) -> Option<String> {
        let entries = self.lock();
        let mut found = None;
        for (name, e) in entries.iter() {
            if let Some(k) = &e.fusion_key
                && sandman_http::constant_time_eq(k.as_bytes(), key.as_bytes())
            {
                found = Some(name.clone());
            }
        }
        found
    }

    fn get(&self, name: &str) -> Option<JobEntry> {
        self.lock().get(name).cloned()
    }

    fn heard(&self, name: &str) {
        if let Some(e) = self.lock().get_mut(name) {
            e.last_heartbeat_ms = Some(now_ms());
        }
    }

    fn save(&self, entries: &BTreeMap<String, JobEntry>) {
        self.store.save(store::JOBS, entries);
    }
}

impl Service {
    pub fn put_job(&self, name: &str, spec: JobSpec) -> ServerResult<Job> {
        if name.is_empty() || name.contains('/') {
            return Err(ServerError::InvalidArgument(format!("invalid job name `{name}`")));
        }
        spec.check_bounds().map_err(bad_number)?;
        let (weight, rate) = (spec.weight, spec.create_rate);
        self.jobs.put(name, spec);
        self.queue.set_tenant(Tenant::Job(name.to_string()), weight, rate, Instant::now());
        self.job(name)
    }

    pub fn job(&self, name: &str) -> ServerResult<Job> {
        let live = self.table.of_job(name).iter().filter(|s| !s.state().is_terminal()).count() as u64;
        let entry = self.jobs.get(name);
        // A job exists while it has a spec (PUT) or live sandboxes; ended ones are history.
        if entry.is_none() && live == 0 {
            return Err(ServerError::NotFound(format!("no job `{name}`")));
        }
        let entry = entry.unwrap_or_default();
        Ok(Job {
            name: name.to_string(),
            spec: entry.spec,
            live,
            created: entry.created,
            last_heartbeat_ms: entry.last_heartbeat_ms,
        })
    }

    /// The job's SandboxFusion capability key, made when it has none (the job too, with no
    /// quota, when it has no spec).
    pub fn fusion_key(&self, name: &str) -> ServerResult<String> {
        if name.is_empty() || name.contains('/') {
            return Err(ServerError::InvalidArgument(format!("invalid job name `{name}`")));
        }
        let key = self.jobs.fusion_key(name).map_err(|e| ServerError::Internal(format!("cannot draw a key: {e}")))?;
        // A job made here is admitted like one made by PUT.
        let (weight, rate) = (self.jobs.weight(name), self.jobs.create_rate(name));
        self.queue.set_tenant(Tenant::Job(name.to_string()), weight, rate, Instant::now());
        Ok(key)
    }

    /// Revokes the job's SandboxFusion key: calls through its URL are refused from now on.
    pub fn revoke_fusion_key(&self, name: &str) -> ServerResult<()> {
        if self.jobs.revoke_fusion_key(name) {
            Ok(())
        } else {
            Err(ServerError::NotFound(format!("job `{name}` has no SandboxFusion key")))
        }
    }

    /// The job a SandboxFusion key belongs to, if it is one.
    pub fn job_of_fusion_key(&self, key: &str) -> Option<String> {
        self.jobs.job_of_fusion_key(key)
    }

    /// The sums of the job's accounting records, and its live sandboxes.
    pub fn job_usage(&self, name: &str) -> ServerResult<JobUsage> {
        let live = self.table.of_job(name).iter().filter(|s| !s.state().is_terminal()).count() as u64;
        let known = self.jobs.contains(name);
        match self.accounting.usage(name) {
            Some(u) => Ok(JobUsage { live, ..u }),
            None if known || live > 0 => Ok(JobUsage { job: name.to_string(), live, ..Default::default() }),
            None => Err(ServerError::NotFound(format!("no job `{name}`"))),
        }
    }

    /// One heartbeat renews the lease of every live sandbox of the job.
    pub fn heartbeat(self: &Arc<Self>, name: &str) -> ServerResult<JobAction> {
        self.metrics.heartbeats.inc();
        let members = self.table.of_job(name);
        let known = self.jobs.contains(name);
        if members.is_empty() && !known {
            return Err(ServerError::NotFound(format!("no job `{name}`")));
        }
        let mut n = 0;
        for sb in members.iter().filter(|s| !s.state().is_terminal()) {
            self.renew(sb);
            n += 1;
        }
        self.jobs.heard(name);
        Ok(JobAction { job: name.to_string(), sandboxes: n })
    }

    /// Releases every sandbox of the job (reason `job_deleted`), those it was still queueing
    /// included, and forgets its quota.
    pub async fn delete_job(self: &Arc<Self>, name: &str) -> ServerResult<JobAction> {
        // Off the queue first, all at once, so that nothing of the job is admitted meanwhile.
        let queued = self.queue.remove_tenant(&Tenant::Job(name.to_string()));
        let members = self.table.of_job(name);
        let known = self.jobs.remove(name);
        let has_snapshots = !self.snapshot_list(Some(name), None).is_empty();
        if members.is_empty() && !known && !has_snapshots {
            return Err(ServerError::NotFound(format!("no job `{name}`")));
        }
        tracing::info!(job = name, queued = queued.len(), "deleting a job");
        let live: Vec<_> = members.into_iter().filter(|s| !s.state().is_terminal()).collect();
        let releases = live.iter().map(|sb| self.release(sb.id(), Reason::JobDeleted));
        let results = futures_util::future::join_all(releases).await;
        let n = results.iter().filter(|r| r.is_ok()).count() as u64;
        // A job's snapshots end with it, after the sandboxes that may run from them.
        self.delete_job_snapshots(name).await;
        Ok(JobAction { job: name.to_string(), sandboxes: n })
    }
}

//! Accounting: one [`UsageRecord`] for every sandbox that ends, appended as a JSON line to
//! `<state-dir>/accounting.jsonl`, summed per job for `GET /v1/jobs/{job}/usage` (the sums are
//! rebuilt from the file at start), and counted in Prometheus families labelled by job.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use sandman_wire::server::{JobUsage, UsageRecord};

use crate::metrics::Metrics;
use crate::store::{self, Store};

/// The file records are appended to, in the state directory.
pub const FILE: &str = "accounting.jsonl";

#[derive(Debug)]
pub struct Accounting {
    path: PathBuf,
    /// The open file, appended to under this lock (one short write per ended sandbox, never
    /// across `.await`); `None` when it cannot be opened (logged once, sums still kept).
    file: Mutex<Option<File>>,
    /// Job (empty for none) → the sums of its records.
    sums: Mutex<HashMap<String, JobUsage>>,
    /// Where replicas share the sums (the file stays each leader's own): the store they are
    /// kept in after every record.
    shared: Option<Store>,
}

impl Accounting {
    /// Opens `<state_dir>/accounting.jsonl` for appending and sums what it already holds.
    pub fn open(state_dir: &Path) -> Self {
        Self::open_with(state_dir, &Store::Dir(state_dir.to_path_buf()))
    }

    /// As [`Accounting::open`]; where `store` is shared by replicas, the sums start from its
    /// document (a new leader's file is empty) and are kept there after every record.
    pub fn open_with(state_dir: &Path, store: &Store) -> Self {
        let path = state_dir.join(FILE);
        let shared = store.is_shared().then(|| store.clone());
        let mut sums = match &shared {
            Some(store) => store.load(store::ACCOUNTING),
            None => HashMap::new(),
        };
        if let (None, Ok(f)) = (&shared, File::open(&path)) {
            for line in BufReader::new(f).lines().map_while(Result::ok) {
                if let Ok(rec) = serde_json::from_str::<UsageRecord>(&line) {
                    add(&mut sums, &rec);
                }
            }
        }
        let file = match OpenOptions::new().create(true).append(true).open(&path) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot open the accounting file; records are kept in memory only");
                None
            }
        };
        Accounting { path, file: Mutex::new(file), sums: Mutex::new(sums), shared }
    }

    fn sums(&self) -> MutexGuard<'_, HashMap<String, JobUsage>> {
        self.sums.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records one ended sandbox: the file, the sums, the counters.
    pub fn record(&self, rec: &UsageRecord, metrics: &Metrics) {
        match serde_json::to_string(rec) {
            Ok(mut line) => {
                line.push('\n');
                let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(f) = file.as_mut()
                    && let Err(e) = f.write_all(line.as_bytes())
                {
                    tracing::error!(path = %self.path.display(), error = %e, "cannot append an accounting record");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode an accounting record"),
        }
        {
            let mut sums = self.sums();
            add(&mut sums, rec);
            if let Some(store) = &self.shared {
                store.save(store::ACCOUNTING, &*sums);
            }
        }
        metrics.accounted(rec);
    }

    /// The sums of `job`'s records; `None` when it has none.
    pub fn usage(&self, job: &str) -> Option<JobUsage> {
        self.sums().get(job).cloned()
    }
}

fn add(sums: &mut HashMap<String, JobUsage>, rec: &UsageRecord) {
    let key = rec.job.clone().unwrap_or_default();
    let u = sums.entry(key.clone()).or_insert_with(|| JobUsage { job: key, ..Default::default() });
    u.sandboxes += 1;
    *u.by_reason.entry(rec.reason.as_str().to_string()).or_default() += 1;
    u.sandbox_seconds += rec.wall_seconds;
    if let Some(cpu) = rec.cpu_seconds {
        u.cpu_seconds += cpu;
        u.with_usage += 1;
    }
    if let Some(peak) = rec.peak_memory_kib {
        u.peak_memory_kib = Some(u.peak_memory_kib.unwrap_or(0).max(peak));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_wire::server::{Reason, SandboxState};

    fn rec(id: &str, job: &str, reason: Reason, wall: f64, cpu: Option<f64>) -> UsageRecord {
        UsageRecord {
            sandbox: id.into(),
            job: Some(job.into()),
            image: "host".into(),
            provider: "fake".into(),
            pool: None,
            claimed_ms: None,
            created_ms: 1,
            ready_ms: Some(2),
            ended_ms: 3,
            state: SandboxState::Gone,
            reason,
            wall_seconds: wall,
            cpu_seconds: cpu,
            peak_memory_kib: cpu.map(|_| 1000),
            pool_idle_seconds: None,
            conditions: None,
        }
    }

    #[test]
    fn records_are_summed_appended_and_summed_again_after_a_restart() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let metrics = Metrics::default();
        let acc = Accounting::open(dir.path());
        acc.record(&rec("a", "j", Reason::Released, 2.0, Some(0.5)), &metrics);
        acc.record(&rec("b", "j", Reason::LeaseExpired, 3.0, None), &metrics);
        acc.record(&rec("c", "k", Reason::Released, 1.0, None), &metrics);
        let u = acc.usage("j").unwrap_or_default();
        assert_eq!((u.sandboxes, u.sandbox_seconds, u.cpu_seconds, u.with_usage), (2, 5.0, 0.5, 1));
        assert_eq!(u.by_reason.get("lease_expired"), Some(&1));
        assert_eq!(u.peak_memory_kib, Some(1000));
        let text = std::fs::read_to_string(dir.path().join(FILE)).unwrap_or_default();
        assert_eq!(text.lines().count(), 3);
        drop(acc);
        let again = Accounting::open(dir.path());
        assert_eq!(again.usage("j").map(|u| u.sandboxes), Some(2));
        assert!(again.usage("none").is_none());
        let m = metrics.encode();
        assert!(m.contains("sandman_job_sandbox_seconds_total{job=\"j\"} 5.0"), "{m}");
        assert!(m.contains("sandman_job_sandboxes_ended_total{job=\"j\",reason=\"lease_expired\"} 1"), "{m}");
    }
}

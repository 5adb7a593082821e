//! What the dashboard's own calls compute from the service's state, without I/O: the filtered,
//! paged sandbox table, the overview's counts, the jobs table, the prepare runs. Every function
//! here is one pass over what it is given (plus a partial selection for a page), so that a page
//! stays cheap at tens of thousands of sandboxes and never asks a daemon anything.

use std::collections::BTreeMap;
use std::sync::Arc;

use sandman_wire::server::{
    Event, EventKind, Job, JobUsage, PreparePhase, Reason, Sandbox as WireSandbox, SandboxState,
};
use serde::{Deserialize, Serialize};

use crate::sandbox::Sandbox;

/// Most rows one page of the table holds.
pub const MAX_PAGE: usize = 500;
/// Rows of a page when the call names no `limit`.
pub const DEFAULT_PAGE: usize = 50;
/// The longest search string.
pub const MAX_SEARCH: usize = 256;
/// The largest `offset` a page may start at.
pub const MAX_OFFSET: usize = 10_000_000;
/// The overview's failures chart: one bucket a minute over the last hour.
pub const FAILURE_BUCKET_MS: u64 = 60_000;
pub const FAILURE_BUCKETS: usize = 60;
/// Prepare runs listed, newest first.
pub const MAX_RUNS: usize = 100;

/// `GET /ui/api/sandboxes`: which sandboxes, and which page of them.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// Case-insensitive text found in the id, image, job, reason or a `key=value` label.
    #[serde(default)]
    pub q: Option<String>,
    #[serde(default)]
    pub job: Option<String>,
    /// A state, or `live` for every state that has not ended.
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub offset: Option<usize>,
    #[serde(default)]
    pub limit: Option<usize>,
}

/// Which states a page takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StateFilter {
    Any,
    Live,
    Is(SandboxState),
}

/// A [`PageQuery`] checked: every bound and name verified before the table is read.
#[derive(Debug, Clone)]
pub struct Page {
    search: Option<String>,
    job: Option<String>,
    state: StateFilter,
    reason: Option<String>,
    pub offset: usize,
    pub limit: usize,
}

impl PageQuery {
    pub fn check(self) -> Result<Page, String> {
        let limit = self.limit.unwrap_or(DEFAULT_PAGE);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(format!("`limit` is {limit}; it must be between 1 and {MAX_PAGE}"));
        }
        let offset = self.offset.unwrap_or(0);
        if offset > MAX_OFFSET {
            return Err(format!("`offset` is {offset}; it must be at most {MAX_OFFSET}"));
        }
        let search = self.q.map(|q| q.trim().to_ascii_lowercase()).filter(|q| !q.is_empty());
        if let Some(q) = &search
            && q.len() > MAX_SEARCH
        {
            return Err(format!("`q` is {} bytes long; it must be at most {MAX_SEARCH}", q.len()));
        }
        let state = match self.state.as_deref().filter(|s| !s.is_empty()) {
            None => StateFilter::Any,
            Some("live") => StateFilter::Live,
            Some(s) => StateFilter::Is(SandboxState::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| {
                let names: Vec<&str> = SandboxState::ALL.iter().map(|s| s.as_str()).collect();
                format!("unknown state `{s}`; it is `live` or one of {}", names.join(", "))
            })?),
        };
        let reason = self.reason.filter(|r| !r.is_empty());
        let job = self.job.filter(|j| !j.is_empty());
        Ok(Page { search, job, state, reason, offset, limit })
    }
}

/// One page of the table: how many rows match in all, and those of the page, newest first.
#[derive(Debug, Clone, Serialize)]
pub struct PageOf {
    pub total: usize,
    pub offset: usize,
    pub limit: usize,
    pub sandboxes: Vec<WireSandbox>,
}

/// Whether `needle` (lowercase ASCII) is in `hay`, ignoring ASCII case, without allocating.
fn contains_ci(hay: &str, needle: &str) -> bool {
    let (h, n) = (hay.as_bytes(), needle.as_bytes());
    n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
}

/// The row fields a filter reads, taken under the sandbox's lock once.
struct Row<'a> {
    sb: &'a Sandbox,
    state: SandboxState,
    reason: Option<Reason>,
}

impl Page {
    fn takes(&self, row: &Row<'_>) -> bool {
        let spec = &row.sb.spec;
        if self.job.as_ref().is_some_and(|j| spec.job.as_ref() != Some(j)) {
            return false;
        }
        let state_ok = match self.state {
            StateFilter::Any => true,
            StateFilter::Live => !row.state.is_terminal(),
            StateFilter::Is(s) => row.state == s,
        };
        if !state_ok || self.reason.as_ref().is_some_and(|r| row.reason.map(Reason::as_str) != Some(r.as_str())) {
            return false;
        }
        let Some(q) = &self.search else { return true };
        contains_ci(&spec.id, q)
            || contains_ci(&spec.image, q)
            || spec.job.as_deref().is_some_and(|j| contains_ci(j, q))
            || row.reason.is_some_and(|r| contains_ci(r.as_str(), q))
            || spec.labels.iter().any(|(k, v)| {
                // `key=value` as a whole, or either side.
                contains_ci(k, q)
                    || contains_ci(v, q)
                    || q.split_once('=').is_some_and(|(qk, qv)| k == qk && contains_ci(v, qv))
            })
    }

    /// The page of `all`: one pass to filter, linear selections of the page's rows, a sort of
    /// those alone, and `to_wire` for the page's rows only.
    pub fn apply(&self, all: &[Arc<Sandbox>]) -> PageOf {
        let mut rows: Vec<Row<'_>> = all
            .iter()
            .map(|sb| {
                let inner = sb.lock();
                Row { sb, state: inner.state, reason: inner.reason }
            })
            .filter(|r| self.takes(r))
            .collect();
        let total = rows.len();
        // Newest first; the id breaks ties so that pages never overlap or skip.
        let order = |a: &Row<'_>, b: &Row<'_>| {
            (b.sb.spec.created_at_ms, &a.sb.spec.id).cmp(&(a.sb.spec.created_at_ms, &b.sb.spec.id))
        };
        let end = self.offset.saturating_add(self.limit).min(total);
        let sandboxes = if self.offset >= end {
            Vec::new()
        } else {
            // Two linear selections put the page's rows, ranks `offset..end`, in place; only they
            // are sorted: O(n + limit log limit), whatever the page.
            if end < total {
                rows.select_nth_unstable_by(end - 1, order);
            }
            let head = &mut rows[..end];
            if self.offset > 0 {
                head.select_nth_unstable_by(self.offset, order);
            }
            let page = &mut head[self.offset..];
            page.sort_unstable_by(order);
            page.iter().map(|r| r.sb.to_wire()).collect()
        };
        PageOf { total, offset: self.offset, limit: self.limit, sandboxes }
    }
}

/// `GET /ui/api/summary`: the overview's counts, from one pass over the table.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub now_ms: u64,
    /// The latest event's number: where the dashboard's follower of `/v1/events` starts.
    pub last_seq: u64,
    pub provider: String,
    pub version: String,
    /// Sandboxes known (ended ones until their retention passes).
    pub total: usize,
    pub by_state: BTreeMap<&'static str, u64>,
    /// Each job's sandboxes by state (live states only), most live first.
    pub jobs: Vec<JobCounts>,
    /// When the oldest create still queued arrived.
    pub oldest_queued_ms: Option<u64>,
    pub failures: Failures,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct JobCounts {
    pub job: String,
    pub live: u64,
    pub by_state: BTreeMap<&'static str, u64>,
}

/// Ended sandboxes whose reason is not a release (`released`, `job_deleted`), by reason, in
/// buckets of a minute over the last hour ending at `end_ms`. Only what the server still
/// remembers: an ended sandbox is forgotten after `--gone-retention-s` (an hour by default).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Failures {
    pub end_ms: u64,
    pub bucket_ms: u64,
    pub by_reason: BTreeMap<&'static str, Vec<u64>>,
}

/// Counts sandboxes by state and job, finds the oldest queued create, and buckets the last
/// hour's failures.
pub fn summarize(all: &[Arc<Sandbox>], now_ms: u64) -> Summary {
    let mut by_state: BTreeMap<&'static str, u64> = SandboxState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
    let mut jobs: BTreeMap<&str, JobCounts> = BTreeMap::new();
    let mut oldest_queued_ms: Option<u64> = None;
    let window = FAILURE_BUCKET_MS * FAILURE_BUCKETS as u64;
    let start = now_ms.saturating_sub(window);
    let mut by_reason: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
    for sb in all {
        let (state, reason, ended) = {
            let inner = sb.lock();
            (inner.state, inner.reason, inner.ended_at_ms)
        };
        *by_state.entry(state.as_str()).or_default() += 1;
        if state == SandboxState::Queued {
            let at = sb.spec.created_at_ms;
            oldest_queued_ms = Some(oldest_queued_ms.map_or(at, |o| o.min(at)));
        }
        if !state.is_terminal()
            && let Some(job) = &sb.spec.job
        {
            let counts = jobs.entry(job).or_insert_with(|| JobCounts { job: job.clone(), ..Default::default() });
            counts.live += 1;
            *counts.by_state.entry(state.as_str()).or_default() += 1;
        }
        if let (Some(r), Some(at)) = (reason, ended)
            && state.is_terminal()
            && !matches!(r, Reason::Released | Reason::JobDeleted)
            && at >= start
        {
            let i = (((at - start) / FAILURE_BUCKET_MS) as usize).min(FAILURE_BUCKETS - 1);
            by_reason.entry(r.as_str()).or_insert_with(|| vec![0; FAILURE_BUCKETS])[i] += 1;
        }
    }
    let mut jobs: Vec<JobCounts> = jobs.into_values().collect();
    jobs.sort_by(|a, b| b.live.cmp(&a.live).then_with(|| a.job.cmp(&b.job)));
    Summary {
        now_ms,
        total: all.len(),
        by_state,
        jobs,
        oldest_queued_ms,
        failures: Failures { end_ms: start + window, bucket_ms: FAILURE_BUCKET_MS, by_reason },
        ..Default::default()
    }
}

/// One row of the jobs table: the job, its usage, and its live sandboxes by state.
#[derive(Debug, Clone, Serialize)]
pub struct JobRow {
    #[serde(flatten)]
    pub job: Job,
    pub usage: Option<JobUsage>,
    pub by_state: BTreeMap<&'static str, u64>,
}

/// The live states of each job's sandboxes, in one pass.
pub fn live_by_job(all: &[Arc<Sandbox>]) -> BTreeMap<String, BTreeMap<&'static str, u64>> {
    let mut out: BTreeMap<String, BTreeMap<&'static str, u64>> = BTreeMap::new();
    for sb in all {
        let state = sb.state();
        if let (Some(job), false) = (&sb.spec.job, state.is_terminal()) {
            *out.entry(job.clone()).or_default().entry(state.as_str()).or_default() += 1;
        }
    }
    out
}

/// One `POST /v1/prepare` of one image, as its events tell it.
#[derive(Debug, Clone, Serialize)]
pub struct PrepareRun {
    pub image: String,
    pub job: Option<String>,
    pub phase: PreparePhase,
    pub started_ms: u64,
    pub updated_ms: u64,
    pub message: Option<String>,
    pub nodes_ready: Option<u32>,
    pub nodes_total: Option<u32>,
    /// Each node's latest word, by node name.
    pub nodes: BTreeMap<String, NodeLine>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeLine {
    pub message: String,
    pub time_ms: u64,
}

/// Groups `prepare` events into runs: a `started` event opens a run of (job, image), later
/// events of the same pair add to it. Newest first, at most [`MAX_RUNS`].
pub fn prepare_runs(events: &[Event]) -> Vec<PrepareRun> {
    let mut runs: Vec<PrepareRun> = Vec::new();
    // (job, image) → index of its latest run.
    let mut open: BTreeMap<(Option<String>, String), usize> = BTreeMap::new();
    for e in events.iter().filter(|e| e.kind == EventKind::Prepare) {
        let (Some(image), Some(phase)) = (&e.image, e.phase) else { continue };
        let key = (e.job.clone(), image.clone());
        let idx = match open.get(&key) {
            Some(&i) if phase != PreparePhase::Started => i,
            _ => {
                runs.push(PrepareRun {
                    image: image.clone(),
                    job: e.job.clone(),
                    phase,
                    started_ms: e.time_ms,
                    updated_ms: e.time_ms,
                    message: None,
                    nodes_ready: None,
                    nodes_total: None,
                    nodes: BTreeMap::new(),
                });
                open.insert(key, runs.len() - 1);
                runs.len() - 1
            }
        };
        let run = &mut runs[idx];
        run.updated_ms = e.time_ms;
        // A node's progress leaves the run's phase as it was (`pulling`) until it ends.
        if phase != PreparePhase::Pulling || run.phase == PreparePhase::Started {
            run.phase = phase;
        }
        if let Some(node) = &e.node {
            run.nodes
                .insert(node.clone(), NodeLine { message: e.message.clone().unwrap_or_default(), time_ms: e.time_ms });
            run.nodes_ready = e.nodes_ready.or(run.nodes_ready);
            run.nodes_total = e.nodes_total.or(run.nodes_total);
        } else if e.message.is_some() {
            run.message = e.message.clone();
        }
    }
    runs.reverse();
    runs.truncate(MAX_RUNS);
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_ignores_case_without_allocating() {
        assert!(contains_ci("Python:3.12-Slim", "3.12-slim"));
        assert!(contains_ci("abc", ""));
        assert!(!contains_ci("ab", "abc"));
    }

    #[test]
    fn bad_pages_are_refused_naming_the_field() {
        let bad = |q: PageQuery| q.check().err().unwrap_or_default();
        assert!(bad(PageQuery { limit: Some(0), ..Default::default() }).contains("`limit`"));
        assert!(bad(PageQuery { limit: Some(MAX_PAGE + 1), ..Default::default() }).contains("`limit`"));
        assert!(bad(PageQuery { offset: Some(MAX_OFFSET + 1), ..Default::default() }).contains("`offset`"));
        assert!(bad(PageQuery { state: Some("sleepy".into()), ..Default::default() }).contains("`sleepy`"));
        assert!(bad(PageQuery { q: Some("x".repeat(MAX_SEARCH + 1)), ..Default::default() }).contains("`q`"));
        assert!(PageQuery { state: Some("live".into()), ..Default::default() }.check().is_ok());
    }

    fn prep(seq: u64, image: &str, phase: PreparePhase, node: Option<(&str, u32, u32)>) -> Event {
        Event {
            seq,
            time_ms: seq * 1000,
            kind: EventKind::Prepare,
            sandbox: String::new(),
            job: Some("j".into()),
            state: None,
            reason: None,
            message: Some(format!("m{seq}")),
            queue_position: None,
            estimated_wait_ms: None,
            image: Some(image.into()),
            phase: Some(phase),
            node: node.map(|n| n.0.to_string()),
            nodes_ready: node.map(|n| n.1),
            nodes_total: node.map(|n| n.2),
            idempotency_key: None,
        }
    }

    #[test]
    fn prepare_events_become_runs_with_each_nodes_progress() {
        use PreparePhase::*;
        let events = [
            prep(1, "a", Started, None),
            prep(2, "b", Started, None),
            prep(3, "a", Pulling, Some(("n1", 0, 2))),
            prep(4, "a", Pulling, Some(("n2", 1, 2))),
            prep(5, "a", Pulling, Some(("n1", 2, 2))),
            prep(6, "a", Ready, None),
            prep(7, "b", Failed, None),
            prep(8, "a", Started, None),
        ];
        let runs = prepare_runs(&events);
        assert_eq!(runs.len(), 3, "{runs:?}");
        // Newest first: the second run of `a`, then `b`, then the first of `a`.
        assert_eq!((runs[0].image.as_str(), runs[0].phase), ("a", Started));
        assert_eq!((runs[1].image.as_str(), runs[1].phase, runs[1].message.as_deref()), ("b", Failed, Some("m7")));
        let first = &runs[2];
        assert_eq!((first.phase, first.nodes_ready, first.nodes_total), (Ready, Some(2), Some(2)));
        assert_eq!(first.nodes.len(), 2);
        assert_eq!(first.nodes["n1"].message, "m5");
        assert_eq!((first.started_ms, first.updated_ms), (1000, 6000));
    }
}

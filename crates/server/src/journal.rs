//! Append-only files of lines in the state directory, read once at start and rewritten whole
//! when they have grown: [`Journal`] underlies the pool claims file and [`ReadyJournal`], the
//! record of sandboxes that became ready, which tells a restarted server a sandbox that was
//! ready from one whose create it was killed in the middle of, and keeps the conditions record
//! each was given before anything ran in it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use sandman_wire::server::SignedConditions;
use serde::{Deserialize, Serialize};

/// A file of lines: appended one at a time, rewritten whole by [`Journal::rewrite`].
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    /// The open file, appended to under this lock, never across `.await`.
    file: Mutex<Option<File>>,
    /// Lines in the file, to tell when it is worth rewriting.
    lines: AtomicUsize,
}

impl Journal {
    /// Opens `path` for appending, answering the lines it held (`None` when there was no file).
    pub fn open(path: PathBuf) -> (Self, Option<Vec<String>>) {
        let found = File::open(&path)
            .ok()
            .map(|f| BufReader::new(f).lines().map_while(Result::ok).filter(|l| !l.is_empty()).collect::<Vec<_>>());
        let file = OpenOptions::new().create(true).append(true).open(&path);
        if let Err(e) = &file {
            tracing::error!(path = %path.display(), error = %e, "cannot open a journal; what it records will not survive a restart");
        }
        let lines = AtomicUsize::new(found.as_ref().map_or(0, Vec::len));
        (Journal { path, file: Mutex::new(file.ok()), lines }, found)
    }

    /// Appends one line (it must hold no newline). A write that fails is logged: the journal is
    /// what a restart learns from, not what the call answers.
    pub fn append(&self, line: &str) {
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(f) = file.as_mut() else { return };
        // One write of the whole line, so that a crash leaves no half line before a whole one.
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        match f.write_all(&buf) {
            Ok(()) => {
                self.lines.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::error!(path = %self.path.display(), error = %e, "cannot append to a journal"),
        }
    }

    /// How many lines the file holds.
    pub fn len(&self) -> usize {
        self.lines.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replaces the file with `lines`, atomically (a temporary file renamed over it).
    pub fn rewrite<'a>(&self, lines: impl IntoIterator<Item = &'a str>) {
        let mut text = String::new();
        let mut n = 0;
        for line in lines {
            text.push_str(line);
            text.push('\n');
            n += 1;
        }
        let tmp = self.path.with_extension("tmp");
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        match std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &self.path)) {
            Ok(()) => {
                *file = OpenOptions::new().append(true).open(&self.path).ok();
                self.lines.store(n, Ordering::Relaxed);
            }
            Err(e) => tracing::error!(path = %self.path.display(), error = %e, "cannot rewrite a journal"),
        }
    }
}

/// The ready journal's file in the state directory.
pub const READY_FILE: &str = "ready.journal";

/// The sandboxes that became ready, each appended before its create answers, with the signed
/// conditions record taken before anything ran in it: a line of JSON (`{"id", "conditions"}`),
/// or its id alone when it has no record (as every line of a server from before records were
/// kept). At start a running sandbox not in it was still being created when the server
/// stopped: the server removes it, and a retry of its create (same idempotency key) makes a new
/// one. A state directory without the file (a first start, or one from before it existed) takes
/// every running sandbox for ready. A recovered sandbox is served the record kept here, never
/// one taken again from a daemon that has run the sandbox's commands.
#[derive(Debug)]
pub struct ReadyJournal {
    journal: Journal,
    /// What the file held at start, until recovery takes it.
    found: Mutex<Option<HashMap<String, Option<SignedConditions>>>>,
}

/// One line of the ready journal, when it carries a record.
#[derive(Debug, Serialize, Deserialize)]
struct ReadyLine {
    id: String,
    conditions: SignedConditions,
}

/// The line of sandbox `id` with its record, if it has one.
pub fn ready_line(id: &str, conditions: Option<&SignedConditions>) -> String {
    match conditions {
        Some(c) => serde_json::to_string(&ReadyLine { id: id.to_string(), conditions: c.clone() })
            .unwrap_or_else(|_| id.to_string()),
        None => id.to_string(),
    }
}

/// A line read back: the id and its record. A line of JSON that does not decode (the half line
/// a crash may leave at the end) is none.
pub(crate) fn parse_line(line: &str) -> Option<(String, Option<SignedConditions>)> {
    if !line.starts_with('{') {
        return Some((line.to_string(), None));
    }
    match serde_json::from_str::<ReadyLine>(line) {
        Ok(l) => Some((l.id, Some(l.conditions))),
        Err(e) => {
            tracing::warn!(error = %e, "an unreadable line in the ready journal; skipped");
            None
        }
    }
}

impl ReadyJournal {
    pub fn open(state_dir: &Path) -> Self {
        let (journal, found) = Journal::open(state_dir.join(READY_FILE));
        let found = found.map(|lines| lines.iter().filter_map(|l| parse_line(l)).collect());
        ReadyJournal { journal, found: Mutex::new(found) }
    }

    /// Records that sandbox `id` is ready, with its conditions record when it has one.
    pub fn ready(&self, id: &str, conditions: Option<&SignedConditions>) {
        self.journal.append(&ready_line(id, conditions));
    }

    /// The sandboxes found at start with their records (once); `None` when there was no journal.
    pub fn take_found(&self) -> Option<HashMap<String, Option<SignedConditions>>> {
        self.found.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Rewrites the file with only the `ready` lines ([`ready_line`]) when it holds many more
    /// lines than that (sandboxes long gone): at most a few times the live sandboxes, so that
    /// it stays small however many come and go.
    pub fn compact_if_grown(&self, ready: impl FnOnce() -> Vec<String>, live: usize) {
        if self.journal.len() > 2 * live + 4096 {
            self.journal.rewrite(ready().iter().map(String::as_str));
        }
    }

    /// Rewrites the file with only the `ready` lines ([`ready_line`]).
    pub fn compact<'a>(&self, ready: impl IntoIterator<Item = &'a str>) {
        self.journal.rewrite(ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_keeps_its_lines_across_opens_and_rewrites() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("j");
        let (j, found) = Journal::open(path.clone());
        assert_eq!(found, None, "no file yet");
        j.append("a");
        j.append("b");
        assert_eq!(j.len(), 2);
        drop(j);
        let (j, found) = Journal::open(path.clone());
        assert_eq!(found, Some(vec!["a".to_string(), "b".to_string()]));
        j.rewrite(["b"]);
        j.append("c");
        drop(j);
        let (j, found) = Journal::open(path);
        assert_eq!(found, Some(vec!["b".to_string(), "c".to_string()]));
        assert_eq!(j.len(), 2);
    }

    #[test]
    fn the_ready_journal_tells_a_first_start_from_one_with_nothing_ready() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let r = ReadyJournal::open(dir.path());
        assert_eq!(r.take_found(), None);
        r.ready("sb-1", None);
        drop(r);
        let r = ReadyJournal::open(dir.path());
        assert_eq!(r.take_found(), Some(HashMap::from([("sb-1".to_string(), None)])));
        assert_eq!(r.take_found(), None, "taken once");
        r.compact([]);
        drop(r);
        let r = ReadyJournal::open(dir.path());
        assert_eq!(r.take_found(), Some(HashMap::new()), "an empty journal is not a missing one");
    }

    fn signed(sandbox: &str) -> SignedConditions {
        let record: sandman_wire::server::ConditionsRecord = serde_json::from_value(serde_json::json!({
            "sandbox": sandbox, "provider": "docker", "server_version": "0.1.0", "recorded_ms": 7,
            "asked": {"image": "busybox", "resources": {}, "profile": "eval", "network": "none"},
            "applied": {"cpu": 0.12345, "memory": 999997440},
            "observed": {"daemon_version": "0.1.0", "kernel": "6.1", "cpu_model": "Xeon", "cpus_available": 2,
                         "cgroup_cpu_limit": 0.12345, "network_interfaces": ["lo"], "hostname": "h", "pid1": true},
            "mismatches": []
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        crate::conditions::Signer::new(&[3u8; 32]).sign(record)
    }

    /// A record kept in the journal comes back exactly as it was signed (and still verifies),
    /// whatever else the file holds: a line of an older server (an id alone), a half line a
    /// crash left, a rewrite.
    #[test]
    fn records_survive_the_journal_whole() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let r = ReadyJournal::open(dir.path());
        let (a, b) = (signed("sb-a"), signed("sb-b"));
        r.ready("sb-a", Some(&a));
        r.ready("sb-old", None);
        r.ready("sb-b", Some(&b));
        drop(r);
        let mut text = std::fs::read_to_string(dir.path().join(READY_FILE)).unwrap_or_default();
        text.push_str("{\"id\":\"sb-cut\",\"conditions\":{\"rec");
        std::fs::write(dir.path().join(READY_FILE), text).unwrap_or_else(|e| panic!("{e}"));
        let r = ReadyJournal::open(dir.path());
        let found = r.take_found().unwrap_or_default();
        assert_eq!(found.len(), 3, "{found:?}");
        assert_eq!(found.get("sb-a"), Some(&Some(a.clone())));
        assert_eq!(found.get("sb-old"), Some(&None));
        let signer = crate::conditions::Signer::new(&[3u8; 32]);
        let kept =
            serde_json::to_value(found["sb-b"].as_ref().unwrap_or_else(|| panic!("no record"))).unwrap_or_default();
        assert!(signer.verify(&kept).valid, "{kept}");
        r.compact([ready_line("sb-b", Some(&b)).as_str()]);
        drop(r);
        let found = ReadyJournal::open(dir.path()).take_found().unwrap_or_default();
        assert_eq!(found, HashMap::from([("sb-b".to_string(), Some(b))]));
    }
}

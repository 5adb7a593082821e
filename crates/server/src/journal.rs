//! Append-only files of lines in the state directory, read once at start and rewritten whole
//! when they have grown: [`Journal`] underlies the pool claims file and [`ReadyJournal`], the
//! record of sandboxes that became ready, which tells a restarted server a sandbox that was
//! ready from one whose create it was killed in the middle of.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

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

/// The ids of sandboxes that became ready, each appended before its create answers. At start a
/// running sandbox not in it was still being created when the server stopped: the server
/// removes it, and a retry of its create (same idempotency key) makes a new one. A state
/// directory without the file (a first start, or one from before it existed) takes every
/// running sandbox for ready.
#[derive(Debug)]
pub struct ReadyJournal {
    journal: Journal,
    /// What the file held at start, until recovery takes it.
    found: Mutex<Option<HashSet<String>>>,
}

impl ReadyJournal {
    pub fn open(state_dir: &Path) -> Self {
        let (journal, found) = Journal::open(state_dir.join(READY_FILE));
        ReadyJournal { journal, found: Mutex::new(found.map(|lines| lines.into_iter().collect())) }
    }

    pub fn ready(&self, id: &str) {
        self.journal.append(id);
    }

    /// The ids found at start (once); `None` when there was no journal.
    pub fn take_found(&self) -> Option<HashSet<String>> {
        self.found.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Rewrites the file with only `ready` when it holds many more lines than that (sandboxes
    /// long gone): at most a few times the live sandboxes, so that it stays small however many
    /// come and go.
    pub fn compact_if_grown(&self, ready: impl FnOnce() -> Vec<String>, live: usize) {
        if self.journal.len() > 2 * live + 4096 {
            self.journal.rewrite(ready().iter().map(String::as_str));
        }
    }

    /// Rewrites the file with only `ready`.
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
        r.ready("sb-1");
        drop(r);
        let r = ReadyJournal::open(dir.path());
        assert_eq!(r.take_found(), Some(HashSet::from(["sb-1".to_string()])));
        assert_eq!(r.take_found(), None, "taken once");
        r.compact([]);
        drop(r);
        let r = ReadyJournal::open(dir.path());
        assert_eq!(r.take_found(), Some(HashSet::new()), "an empty journal is not a missing one");
    }
}

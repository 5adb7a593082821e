//! A sandbox's records on the host, `<base>/<id>/` under the server's state directory: what every
//! provider that keeps files beside its sandboxes records the same way, so that a restarted or
//! second provider instance on the same directory agrees with the first. Start at [`RecordDir`]:
//! how the sandbox ended (`ended.json`, written by whoever saw it die, before the event), a
//! delete under way (the `deleting` marker, so that a death it causes is no news), atomic writes,
//! and a removal that copes with a sandbox's read-only files. [`check_id`] keeps an id one path
//! component. Everything here but [`remove_dir`] is blocking file I/O; callers run it off the
//! async threads.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Ended, ProviderError};

/// The directory of one sandbox's records, and the files in it every provider keeps alike.
/// Providers wrap it with the files of their own (a token, a socket, a log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordDir {
    pub root: PathBuf,
}

impl RecordDir {
    /// `base/id`; `id` is checked by [`check_id`] first.
    pub fn new(base: &Path, id: &str) -> Self {
        RecordDir { root: base.join(id) }
    }

    /// How the sandbox ended, written by the watcher that saw it die (before it reports the
    /// event), so that every later `list` agrees with the event, across restarts too.
    pub fn ended(&self) -> PathBuf {
        self.root.join("ended.json")
    }

    /// Present while a delete runs: a watcher (of this or another provider instance) that sees
    /// the sandbox die then knows the death was asked for.
    pub fn deleting(&self) -> PathBuf {
        self.root.join("deleting")
    }

    pub fn write_ended(&self, ended: &Ended) -> io::Result<()> {
        let bytes = serde_json::to_vec(ended).map_err(io::Error::other)?;
        write_atomic(&self.ended(), &bytes, 0o600)
    }

    /// `None` when nobody recorded an end (or the file cannot be read).
    pub fn read_ended(&self) -> Option<Ended> {
        serde_json::from_slice(&std::fs::read(self.ended()).ok()?).ok()
    }

    /// Leaves the `deleting` marker; never makes a directory that is gone already.
    pub fn mark_deleting(&self) {
        if self.root.is_dir() {
            let _ = std::fs::write(self.deleting(), b"");
        }
    }

    /// Whether a delete of this sandbox is under way or done (by this or another instance).
    pub fn being_deleted(&self) -> bool {
        self.deleting().exists() || !self.root.exists()
    }

    /// Removes the directory and everything in it; one already gone is fine, and a sandbox's
    /// files that lost their write bits are made removable.
    pub fn remove(&self) -> io::Result<()> {
        match std::fs::remove_dir_all(&self.root) {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                make_writable(&self.root);
                std::fs::remove_dir_all(&self.root)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }
}

/// Removes a sandbox's directory, retrying briefly: a killed sandbox's processes may still write
/// into it, or its mounts still be released, for a moment while it dies. Logs a failure; the
/// caller checks whether the directory is gone.
pub async fn remove_dir(dir: &RecordDir) {
    for attempt in 0..20 {
        let d = dir.clone();
        match tokio::task::spawn_blocking(move || d.remove()).await {
            Ok(Ok(())) => return,
            Ok(Err(err)) if attempt == 19 => {
                tracing::warn!(%err, path = %dir.root.display(), "cannot remove a sandbox directory")
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A sandbox id names a directory (and, with some providers, a container): letters, digits,
/// `-`, `_`, `.`, not starting with `.`, at most 128 bytes. The refusal says the id cannot name
/// `names` (`"a directory"`, `"a container"`).
pub fn check_id(id: &str, names: &str) -> Result<(), ProviderError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ProviderError::Unsupported(format!(
            "sandbox id `{id}` cannot name {names}: use letters, digits, `-`, `_` and `.`"
        )))
    }
}

/// A daemon's last words in its log: the last unindented line with the indented lines after it
/// (`error: …` then `  caused by: …`), on one line, at most 500 characters.
pub fn last_paragraph(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.iter().rposition(|l| !l.starts_with(char::is_whitespace)).unwrap_or(0);
    let joined = lines.get(start..)?.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
    if joined.is_empty() {
        return None;
    }
    // A runaway line must not make an event huge.
    Some(joined.chars().take(500).collect())
}

/// Writes `path` whole or not at all, with `mode`: a temporary file beside it, synced, then
/// renamed over it. Never creates the directory, so a write racing a delete cannot bring the
/// sandbox back.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_renamed(path, bytes, mode, true)
}

/// [`write_atomic`] without the sync: whole or not at all for every process, but not made
/// durable, for records that are worth nothing after the machine restarts (a process
/// provider's sandboxes die with it). A file whose blocks a crash lost reads empty or torn;
/// readers treat such a record as one never written. A sync costs a disk flush per file, and a
/// create writes several.
pub fn write_replacing(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_renamed(path, bytes, mode, false)
}

fn write_renamed(path: &Path, bytes: &[u8], mode: u32, sync: bool) -> io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
    // A temporary file left by a crash keeps its old mode; the mode matters (the token).
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    f.write_all(bytes)?;
    if sync {
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

fn make_writable(dir: &Path) {
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                make_writable(&entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_wire::server::Reason;

    #[test]
    fn the_end_and_the_delete_marker_round_trip_and_never_remake_the_directory() {
        let base = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let dir = RecordDir::new(base.path(), "sb-1");
        std::fs::create_dir(&dir.root).unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.read_ended().is_none());
        let ended = Ended { reason: Reason::OomKilled, message: "out of memory".into() };
        dir.write_ended(&ended).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dir.read_ended(), Some(ended.clone()));
        let mode = std::fs::metadata(dir.ended()).map(|m| m.permissions().mode() & 0o777).ok();
        assert_eq!(mode, Some(0o600));
        assert!(!dir.being_deleted());
        dir.mark_deleting();
        assert!(dir.being_deleted());
        dir.remove().unwrap_or_else(|e| panic!("{e}"));
        dir.remove().unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.being_deleted());
        dir.mark_deleting();
        assert!(dir.write_ended(&ended).is_err());
        assert!(!dir.root.exists(), "marking or ending a removed sandbox must not make its directory again");
    }

    #[test]
    fn a_sandbox_whose_files_lost_their_write_bits_is_removed() {
        let base = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let dir = RecordDir::new(base.path(), "sb-2");
        let locked = dir.root.join("work/locked");
        std::fs::create_dir_all(&locked).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(locked.join("f"), b"x").unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500)).unwrap_or_else(|e| panic!("{e}"));
        dir.remove().unwrap_or_else(|e| panic!("{e}"));
        assert!(!dir.root.exists());
        // As root (CI), the removal above goes through whatever the bits say: the bits are made
        // writable again, checked on their own.
        std::fs::create_dir_all(&locked).unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500)).unwrap_or_else(|e| panic!("{e}"));
        make_writable(&dir.root);
        let mode = std::fs::metadata(&locked).map(|m| m.permissions().mode() & 0o777).unwrap_or_default();
        assert_eq!(mode, 0o700, "{mode:o}");
    }

    #[test]
    fn last_words_join_an_error_with_its_causes() {
        let log = "2026 INFO serving\nerror: cannot listen on `x`\n  caused by: Address in use\n\n";
        assert_eq!(last_paragraph(log).as_deref(), Some("error: cannot listen on `x` caused by: Address in use"));
        assert_eq!(last_paragraph("one\ntwo\n").as_deref(), Some("two"));
        assert_eq!(last_paragraph("\n \n"), None);
        assert_eq!(last_paragraph(&"x".repeat(600)).map(|w| w.len()), Some(500));
    }

    #[test]
    fn atomic_writes_set_the_mode_and_never_make_the_directory() {
        for write in [write_atomic, write_replacing] {
            let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
            let path = dir.path().join("token");
            write(&path, b"secret", 0o600).unwrap_or_else(|e| panic!("{e}"));
            let meta = std::fs::metadata(&path).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(meta.permissions().mode() & 0o777, 0o600);
            assert_eq!(std::fs::read(&path).ok().as_deref(), Some(&b"secret"[..]));
            // Replaced by a new file: a reader holding the old one reads it whole.
            let held = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
            write(&path, b"other", 0o600).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(io::read_to_string(held).ok().as_deref(), Some("secret"));
            assert_eq!(std::fs::read(&path).ok().as_deref(), Some(&b"other"[..]));
            assert_eq!(std::fs::read_dir(dir.path()).map(|d| d.count()).ok(), Some(1), "a temporary file is left");
            assert!(write(&dir.path().join("gone/token"), b"x", 0o600).is_err());
            assert!(!dir.path().join("gone").exists());
        }
    }

    #[test]
    fn ids_are_single_path_components() {
        assert!(check_id("sb-42_x.1", "a directory").is_ok());
        for bad in ["", ".", "..", "../x", "a/b", ".hidden", "a b"] {
            assert!(check_id(bad, "a directory").is_err(), "{bad}");
        }
        let long = "a".repeat(129);
        assert!(check_id(&long, "a container").is_err());
        let msg = check_id("a/b", "a container").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("cannot name a container"), "{msg}");
    }
}

//! `HostDir`: a sandbox's directory on the host, `<state_dir>/docker/<id>/`: the daemon's token,
//! `run/` (bind-mounted into the container, where the daemon's socket appears), and the
//! provider's own notes, which the sandbox cannot reach: how it ended, and a delete under way.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sandman_provider::Ended;

#[derive(Debug, Clone)]
pub struct HostDir {
    pub root: PathBuf,
}

impl HostDir {
    pub fn new(base: &Path, id: &str) -> Self {
        HostDir { root: base.join(id) }
    }

    /// The daemon's bearer token (0600), bind-mounted read-only at [`crate::TOKEN_IN_CONTAINER`].
    pub fn token(&self) -> PathBuf {
        self.root.join("token")
    }

    /// Bind-mounted read-write at [`crate::RUN_IN_CONTAINER`]; holds only the daemon's socket.
    pub fn run(&self) -> PathBuf {
        self.root.join("run")
    }

    /// The daemon's socket as the host sees it: the endpoint.
    pub fn socket(&self) -> PathBuf {
        self.run().join("d.sock")
    }

    /// How the container ended, written by the watcher before it reports the death, so that
    /// `list` agrees with the event.
    pub fn ended(&self) -> PathBuf {
        self.root.join("ended.json")
    }

    /// Present while a delete runs: the container's death is no news.
    pub fn deleting(&self) -> PathBuf {
        self.root.join("deleting")
    }

    /// Makes the directory (which must not exist) and writes the token. Blocking.
    pub fn prepare(&self, token: &str) -> io::Result<()> {
        std::fs::DirBuilder::new().mode(0o700).create(&self.root)?;
        std::fs::DirBuilder::new().mode(0o700).create(self.run())?;
        write_atomic(&self.token(), token.as_bytes(), 0o600)
    }

    pub fn read_token(&self) -> io::Result<String> {
        let token = std::fs::read_to_string(self.token())?;
        if token.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "empty token file"));
        }
        Ok(token)
    }

    pub fn write_ended(&self, ended: &Ended) -> io::Result<()> {
        let bytes = serde_json::to_vec(ended).map_err(io::Error::other)?;
        write_atomic(&self.ended(), &bytes, 0o600)
    }

    pub fn read_ended(&self) -> Option<Ended> {
        serde_json::from_slice(&std::fs::read(self.ended()).ok()?).ok()
    }

    /// Whether a delete of this sandbox is under way or done (by this or another instance).
    pub fn being_deleted(&self) -> bool {
        self.deleting().exists() || !self.root.exists()
    }

    pub fn mark_deleting(&self) {
        if self.root.is_dir() {
            let _ = std::fs::write(self.deleting(), b"");
        }
    }

    /// Removes the directory and everything in it. Blocking.
    pub fn remove(&self) -> io::Result<()> {
        match std::fs::remove_dir_all(&self.root) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, with `mode`.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
    // A temporary file left by a crash keeps its old mode; the mode matters (the token).
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_wire::server::Reason;

    #[test]
    fn the_token_is_private_and_the_notes_round_trip() {
        let base = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let dir = HostDir::new(base.path(), "sb-1");
        dir.prepare("secret").unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.prepare("again").is_err(), "a second prepare must not reuse the directory");
        let mode = std::fs::metadata(dir.token()).map(|m| m.permissions().mode() & 0o777).ok();
        assert_eq!(mode, Some(0o600));
        assert_eq!(dir.read_token().ok().as_deref(), Some("secret"));
        assert!(dir.read_ended().is_none());
        let ended = Ended { reason: Reason::OomKilled, message: "out of memory".into() };
        dir.write_ended(&ended).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dir.read_ended(), Some(ended));
        assert!(!dir.being_deleted());
        dir.mark_deleting();
        assert!(dir.being_deleted());
        dir.remove().unwrap_or_else(|e| panic!("{e}"));
        dir.remove().unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.being_deleted());
        dir.mark_deleting();
        assert!(!dir.root.exists(), "marking a removed sandbox must not make its directory again");
    }
}

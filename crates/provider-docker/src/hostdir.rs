//! `HostDir`: a sandbox's directory on the host, `<state_dir>/docker/<id>/`: the daemon's token,
//! `run/` (bind-mounted into the container, where the daemon's socket appears and where the
//! token is handed to the daemon, which removes it once read), and the provider's own records,
//! which the sandbox cannot reach (the token, how it ended, a delete under way: [`RecordDir`],
//! shared with the other providers).

use std::io;
use std::ops::Deref;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use sandman_provider::records::{RecordDir, write_atomic};

#[derive(Debug, Clone)]
pub struct HostDir(RecordDir);

impl Deref for HostDir {
    type Target = RecordDir;

    fn deref(&self) -> &RecordDir {
        &self.0
    }
}

impl HostDir {
    pub fn new(base: &Path, id: &str) -> Self {
        HostDir(RecordDir::new(base, id))
    }

    /// The daemon's bearer token (0600), for a restarted server; out of the container's reach.
    pub fn token(&self) -> PathBuf {
        self.root.join("token")
    }

    /// Bind-mounted read-write at [`crate::RUN_IN_CONTAINER`]; holds the daemon's socket, and
    /// the token handed over until the daemon has read (and removed) it.
    pub fn run(&self) -> PathBuf {
        self.root.join("run")
    }

    /// The token as handed to the daemon ([`crate::TOKEN_IN_CONTAINER`] in the container),
    /// which removes it as it starts, before anything else runs in the sandbox.
    pub fn handoff(&self) -> PathBuf {
        self.run().join("token")
    }

    /// The daemon's socket as the host sees it: the endpoint.
    pub fn socket(&self) -> PathBuf {
        self.run().join("d.sock")
    }

    /// Makes the directory (which must not exist) and writes the token, kept and handed over.
    /// Blocking.
    pub fn prepare(&self, token: &str) -> io::Result<()> {
        std::fs::DirBuilder::new().mode(0o700).create(&self.root)?;
        std::fs::DirBuilder::new().mode(0o700).create(self.run())?;
        write_atomic(&self.token(), token.as_bytes(), 0o600)?;
        write_atomic(&self.handoff(), token.as_bytes(), 0o600)
    }

    pub fn read_token(&self) -> io::Result<String> {
        let token = std::fs::read_to_string(self.token())?;
        if token.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "empty token file"));
        }
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use sandman_provider::Ended;
    use sandman_wire::server::Reason;

    #[test]
    fn the_token_is_private_and_the_records_live_beside_it() {
        let base = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let dir = HostDir::new(base.path(), "sb-1");
        dir.prepare("secret").unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.prepare("again").is_err(), "a second prepare must not reuse the directory");
        let mode = std::fs::metadata(dir.token()).map(|m| m.permissions().mode() & 0o777).ok();
        assert_eq!(mode, Some(0o600));
        assert_eq!(dir.read_token().ok().as_deref(), Some("secret"));
        // The copy handed to the daemon is in `run/`; the one kept is not.
        assert!(dir.handoff().starts_with(dir.run()) && !dir.token().starts_with(dir.run()));
        assert_eq!(std::fs::read_to_string(dir.handoff()).ok().as_deref(), Some("secret"));
        // How it ended and a delete under way are the shared records (tested there), in this
        // directory, out of the container's reach (only `run/` is mounted).
        let ended = Ended { reason: Reason::OomKilled, message: "out of memory".into() };
        dir.write_ended(&ended).unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.ended().starts_with(&dir.root) && !dir.ended().starts_with(dir.run()));
        assert_eq!(dir.read_ended(), Some(ended));
        dir.remove().unwrap_or_else(|e| panic!("{e}"));
        assert!(dir.being_deleted());
    }
}

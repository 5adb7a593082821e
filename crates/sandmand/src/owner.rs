//! Who owns what a file call creates: a call's `user` (the sandbox's default user, added by the
//! server) resolved into the uid and gid that user's own command would create files with, and
//! the directories and files the call makes given to them. Start at [`Owner::of`].
//!
//! The daemon creates as itself (root), so a call may write where that user could not (an
//! upload into `/`, say), and then gives each thing it created to the user: files by their open
//! descriptor, directories and archive entries by path, without following a symlink at the
//! end. What existed before the call keeps its owner.

use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{DaemonError, DaemonResult};
use crate::spawn::lookup_user;
use crate::state::Daemon;

/// The uid and gid a call's creations belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// The owner a call's `user` names (`name`, `uid`, `uid:gid`, `name:group`); `None` when it
    /// names none, or the daemon's own ids (what it creates is theirs already).
    pub fn of(daemon: &Daemon, user: Option<&str>) -> DaemonResult<Option<Owner>> {
        let Some(spec) = user.filter(|u| !u.is_empty()) else { return Ok(None) };
        let ids = lookup_user(&daemon.defaults.passwd, spec)?;
        let euid = daemon.defaults.euid;
        if ids.uid != euid && euid != 0 {
            return Err(DaemonError::InvalidArgument(format!(
                "cannot give files to uid {}: the daemon runs as uid {euid} and is not root",
                ids.uid
            )));
        }
        if (ids.uid, ids.gid) == (euid, crate::sys::egid()) {
            return Ok(None);
        }
        Ok(Some(Owner { uid: ids.uid, gid: ids.gid }))
    }

    /// Gives an open file to the owner.
    pub fn give_file(&self, file: impl AsFd, path: &Path) -> DaemonResult<()> {
        std::os::unix::fs::fchown(file, Some(self.uid), Some(self.gid))
            .map_err(|e| DaemonError::io(GIVE, crate::files::shown(path), e))
    }

    /// Gives `path` itself (a symlink, not what it points to) to the owner.
    pub fn give(&self, path: &Path) -> io::Result<()> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid))
    }
}

/// What a failed change of owner did, for its error.
const GIVE: &str = "give the call's user ownership of";

/// `mkdir -p dir` (each created 0755, less the umask), every directory created given to
/// `owner`; the ones that existed are left as they are.
pub fn create_dirs(dir: &Path, owner: Option<Owner>) -> DaemonResult<()> {
    let Some(owner) = owner else {
        return fs::DirBuilder::new()
            .recursive(true)
            .mode(crate::files::DEFAULT_DIR_MODE)
            .create(dir)
            .map_err(|e| DaemonError::io("create directory", crate::files::shown(dir), e));
    };
    for missing in missing_ancestors(dir, Path::new("/")).into_iter().rev() {
        match fs::DirBuilder::new().mode(crate::files::DEFAULT_DIR_MODE).create(&missing) {
            Ok(()) => owner.give(&missing).map_err(|e| DaemonError::io(GIVE, crate::files::shown(&missing), e))?,
            // Made meanwhile by someone else: theirs.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(DaemonError::io("create directory", crate::files::shown(&missing), e)),
        }
    }
    Ok(())
}

/// `path` and its ancestors that do not exist, nearest first, stopping at `root` (which is not
/// included) or at the first that exists.
pub fn missing_ancestors(path: &Path, root: &Path) -> Vec<PathBuf> {
    let mut missing = Vec::new();
    let mut cur = Some(path);
    while let Some(p) = cur {
        if p == root || p.as_os_str().is_empty() {
            break;
        }
        match fs::symlink_metadata(p) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(p.to_path_buf()),
            _ => break,
        }
        cur = p.parent();
    }
    missing
}

/// Gives `path` to `owner`, then sets `mode` again when it has the setuid or setgid bit, which
/// a change of owner clears.
pub fn give_keeping_mode(owner: Owner, path: &Path, mode: Option<u32>) -> io::Result<()> {
    owner.give(path)?;
    if let Some(mode) = mode.filter(|m| m & 0o6000 != 0) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode & 0o7777))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ancestors_stop_at_the_first_that_exists() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let deep = dir.path().join("a/b/c");
        assert_eq!(
            missing_ancestors(&deep, Path::new("/")),
            [deep.clone(), dir.path().join("a/b"), dir.path().join("a")]
        );
        assert_eq!(missing_ancestors(&deep, &dir.path().join("a/b")), [deep]);
        assert!(missing_ancestors(dir.path(), Path::new("/")).is_empty());
        Ok(())
    }
}

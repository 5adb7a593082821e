//! Where the server keeps its state when told nowhere, which is also where a client on the same
//! machine finds the server's token: one rule for both sides, [`default_state_dir`]. It reads
//! environment variables and nothing else.

use std::ffi::OsString;
use std::path::PathBuf;

/// The server's state directory when none is given: `$SANDMAN_STATE_DIR`, else
/// `$XDG_STATE_HOME/sandman`, else `~/.local/state/sandman` (`/var/lib/sandman` without a home).
pub fn default_state_dir() -> PathBuf {
    state_dir_from(std::env::var_os("SANDMAN_STATE_DIR"), std::env::var_os("XDG_STATE_HOME"), std::env::home_dir())
}

/// [`default_state_dir`] from the values of its variables; empty values count as unset, and so
/// does a relative `XDG_STATE_HOME` (the XDG spec says to ignore it).
fn state_dir_from(sandman: Option<OsString>, xdg: Option<OsString>, home: Option<PathBuf>) -> PathBuf {
    if let Some(dir) = sandman.filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(xdg) = xdg.map(PathBuf::from).filter(|d| d.is_absolute()) {
        return xdg.join("sandman");
    }
    match home.filter(|h| !h.as_os_str().is_empty()) {
        Some(home) => home.join(".local/state/sandman"),
        None => PathBuf::from("/var/lib/sandman"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dir_prefers_sandman_then_xdg_then_home() {
        let home = Some(PathBuf::from("/home/u"));
        assert_eq!(state_dir_from(Some("/srv/s".into()), Some("/x".into()), home.clone()), PathBuf::from("/srv/s"));
        assert_eq!(state_dir_from(Some("".into()), Some("/x".into()), home.clone()), PathBuf::from("/x/sandman"));
        assert_eq!(
            state_dir_from(None, Some("rel".into()), home.clone()),
            PathBuf::from("/home/u/.local/state/sandman")
        );
        assert_eq!(state_dir_from(None, Some("".into()), home.clone()), PathBuf::from("/home/u/.local/state/sandman"));
        assert_eq!(state_dir_from(None, None, home), PathBuf::from("/home/u/.local/state/sandman"));
        assert_eq!(state_dir_from(None, None, Some(PathBuf::new())), PathBuf::from("/var/lib/sandman"));
        assert_eq!(state_dir_from(None, None, None), PathBuf::from("/var/lib/sandman"));
    }
}

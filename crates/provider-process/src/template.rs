//! The mount namespace every isolated sandbox's is a copy of: made once per provider by
//! `sandmand isolation-template` (one `pivot_root` into an empty read-only tmpfs, the host's
//! tree under `/host`), and held by that process, which the provider keeps as an unreaped child
//! for its whole life, so that its `/proc/<pid>/ns/mnt`, handed to each daemon as
//! `--isolate-template`, names no other process's namespace. Why: `pivot_root` walks every
//! thread on the machine (the kernel's `chroot_fs_refs`), so one per sandbox made each create
//! cost in proportion to the sandboxes held; a copy of the template switches to the sandbox's
//! root with a move and a `chroot`, at a cost that does not grow. Start at [`Template::start`].
//! Should that process die (killed by hand, or by the OOM killer), the next create makes a new
//! one ([`Template::current`]): sandboxes already made keep their copies.

use std::ffi::OsString;
use std::io::{self, BufRead, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The process holding the template, killed and reaped when dropped.
#[derive(Debug)]
pub struct Template {
    child: Child,
    ns: PathBuf,
    /// How it was started, to start it again.
    daemon_bin: PathBuf,
    daemon_args: Vec<OsString>,
    dir: PathBuf,
}

impl Template {
    /// Runs `daemon_bin daemon_args… isolation-template dir` (an empty directory, made if
    /// missing) and waits until it says the namespace is made. An error carries what the daemon
    /// said.
    pub fn start(daemon_bin: &Path, daemon_args: &[OsString], dir: &Path) -> io::Result<Template> {
        let child = Self::spawn(daemon_bin, daemon_args, dir)?;
        let ns = PathBuf::from(format!("/proc/{}/ns/mnt", child.id()));
        Ok(Template { child, ns, daemon_bin: daemon_bin.into(), daemon_args: daemon_args.into(), dir: dir.into() })
    }

    fn spawn(daemon_bin: &Path, daemon_args: &[OsString], dir: &Path) -> io::Result<Child> {
        std::fs::create_dir_all(dir)?;
        let mut child = Command::new(daemon_bin)
            .args(daemon_args)
            .arg("isolation-template")
            .arg(dir)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            io::BufReader::new(out).read_line(&mut line)?;
        }
        if line.trim() != "ready" {
            let mut said = String::new();
            if let Some(mut err) = child.stderr.take() {
                let _ = err.read_to_string(&mut said);
            }
            let _ = child.kill();
            let _ = child.wait();
            let said = said.lines().map(str::trim).collect::<Vec<_>>().join(" ");
            return Err(io::Error::other(format!("`{} isolation-template` failed: {said}", daemon_bin.display())));
        }
        // It writes nothing more; its stdin stays open (held in `child`) for as long as it must live.
        drop(child.stderr.take());
        Ok(child)
    }

    /// The namespace's file, for `--isolate-template`.
    pub fn ns(&self) -> &Path {
        &self.ns
    }

    /// The namespace's file, after making the template again if its process has died or is
    /// dying (reaping it: a zombie's namespace cannot be opened). A process gives up its
    /// namespaces early in its exit, before it can be reaped: one whose namespace no longer
    /// opens is dying, and is waited for. One `waitpid(WNOHANG)` and one `stat` while it lives.
    pub fn current(&mut self) -> io::Result<&Path> {
        let ended = match self.child.try_wait()? {
            None if std::fs::metadata(&self.ns).is_err() => {
                let _ = self.child.kill();
                Some(self.child.wait()?)
            }
            status => status,
        };
        if let Some(status) = ended {
            tracing::warn!(%status, ns = %self.ns.display(), "the isolation template's process died: making it again");
            self.child = Self::spawn(&self.daemon_bin, &self.daemon_args, &self.dir)?;
            self.ns = PathBuf::from(format!("/proc/{}/ns/mnt", self.child.id()));
        }
        Ok(&self.ns)
    }
}

impl Drop for Template {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for `sandmand isolation-template`: says ready, then lives while its stdin is open.
    fn stand_in(dir: &Path) -> Template {
        let args: Vec<OsString> = ["-c", "echo ready; exec /bin/cat", "sh"].iter().map(Into::into).collect();
        Template::start(Path::new("/bin/sh"), &args, dir).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Regression: a template process killed while a create asked for it had given up its
    /// namespace but could not be reaped yet, so `waitpid` said it lived and the create was handed
    /// a namespace that no longer opened (its daemon never became healthy). A namespace that
    /// does not open is now a dying template, waited for and made again.
    #[test]
    fn a_template_whose_namespace_no_longer_opens_is_made_again() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut t = stand_in(dir.path());
        let old_pid = t.child.id();
        assert_eq!(t.current().unwrap_or_else(|e| panic!("{e}")), Path::new(&format!("/proc/{old_pid}/ns/mnt")));
        // As a dying process's does: the process is there, its namespace is not.
        t.ns = dir.path().join("gone");
        let ns = t.current().unwrap_or_else(|e| panic!("{e}")).to_path_buf();
        let new_pid = t.child.id();
        assert_ne!(new_pid, old_pid);
        assert_eq!(ns, PathBuf::from(format!("/proc/{new_pid}/ns/mnt")));
        assert!(std::fs::metadata(&ns).is_ok(), "{} does not open", ns.display());
        assert!(!Path::new(&format!("/proc/{old_pid}")).exists(), "the old process was not reaped");
    }
}

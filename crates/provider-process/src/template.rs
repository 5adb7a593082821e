//! The mount namespace every isolated sandbox's is a copy of: made once per provider by
//! `sandmand isolation-template` (one `pivot_root` into an empty read-only tmpfs, the host's
//! tree under `/host`), and held by that process, which the provider keeps as an unreaped child
//! for its whole life, so that its `/proc/<pid>/ns/mnt`, handed to each daemon as
//! `--isolate-template`, names no other process's namespace. Why: `pivot_root` walks every
//! thread on the machine (the kernel's `chroot_fs_refs`), so one per sandbox made each create
//! cost in proportion to the sandboxes held; a copy of the template switches to the sandbox's
//! root with a move and a `chroot`, at a cost that does not grow. Start at [`Template::start`].

use std::ffi::OsString;
use std::io::{self, BufRead, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The process holding the template, killed and reaped when dropped.
#[derive(Debug)]
pub struct Template {
    child: Child,
    ns: PathBuf,
}

impl Template {
    /// Runs `daemon_bin daemon_args… isolation-template dir` (an empty directory, made if
    /// missing) and waits until it says the namespace is made. An error carries what the daemon
    /// said.
    pub fn start(daemon_bin: &Path, daemon_args: &[OsString], dir: &Path) -> io::Result<Template> {
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
        let ns = PathBuf::from(format!("/proc/{}/ns/mnt", child.id()));
        Ok(Template { child, ns })
    }

    /// The namespace's file, for `--isolate-template`.
    pub fn ns(&self) -> &Path {
        &self.ns
    }
}

impl Drop for Template {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! A sandbox's directory under `<state_dir>/sandboxes/<id>/`: the state of record (`record.json`,
//! `ids`, `cgroups.json`, `daemon.pid`, `ended.json`), the daemon's token, socket, log and the
//! commands' environment, `root/` (where an isolated sandbox's root is assembled), and, without
//! isolation only, the sandbox's `work/` and `tmp/`. The records every provider keeps alike (`ended.json`, the `deleting` marker) are
//! [`RecordDir`]'s. The files are written whole or not at all but not synced
//! ([`write_replacing`]): the sandboxes die with the machine, and after a crash a record the
//! disk lost is a sandbox never made. Everything here is blocking file I/O; callers run it off
//! the async threads.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::ops::Deref;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sandman_provider::SandboxSpec;
use sandman_provider::records::{RecordDir, last_paragraph, write_replacing};

use crate::cgroup::Dirs;
use crate::procs::ProcId;

/// The paths of one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxDir(RecordDir);

impl Deref for SandboxDir {
    type Target = RecordDir;

    fn deref(&self) -> &RecordDir {
        &self.0
    }
}

impl SandboxDir {
    pub fn new(sandboxes: &Path, id: &str) -> Self {
        SandboxDir(RecordDir::new(sandboxes, id))
    }

    /// The whole `SandboxSpec`, token included (0600).
    pub fn record(&self) -> PathBuf {
        self.root.join("record.json")
    }
    pub fn token(&self) -> PathBuf {
        self.root.join("token")
    }
    pub fn socket(&self) -> PathBuf {
        self.root.join("d.sock")
    }
    /// The working directory and `HOME` of a sandbox without isolation (an isolated one has its
    /// own inside, in its layer).
    pub fn work(&self) -> PathBuf {
        self.root.join("work")
    }
    /// The `TMPDIR` of a sandbox without isolation.
    pub fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }
    /// The empty directory where an isolated sandbox's root is assembled (the mounts on it exist
    /// only in the sandbox's mount namespace).
    pub fn rootfs(&self) -> PathBuf {
        self.root.join("root")
    }
    /// The commands' environment, a JSON object (0600), which the daemon reads at start.
    pub fn env_file(&self) -> PathBuf {
        self.root.join("env.json")
    }
    /// The first host id of an isolated sandbox's range (its root), in decimal.
    pub fn ids(&self) -> PathBuf {
        self.root.join("ids")
    }
    pub fn read_ids(&self) -> Option<u32> {
        std::fs::read_to_string(self.ids()).ok()?.trim().parse().ok()
    }
    /// `pid start_time` of the process the provider started (the daemon, or its waiter when
    /// isolated).
    pub fn pid_file(&self) -> PathBuf {
        self.root.join("daemon.pid")
    }
    /// The daemon's stderr.
    pub fn log(&self) -> PathBuf {
        self.root.join("daemon.log")
    }
    /// The exit code the daemon writes when it exits by itself (`--exit-file`): what a
    /// restarted server, which cannot wait for a daemon it did not start, learns its end from.
    pub fn exit_file(&self) -> PathBuf {
        self.root.join("daemon.exit")
    }
    /// The code in [`SandboxDir::exit_file`], when the daemon wrote one.
    pub fn exit_code(&self) -> Option<i32> {
        std::fs::read_to_string(self.exit_file()).ok()?.trim().parse().ok()
    }

    /// Makes the directory (which must not exist) with `root/` (and `work/` and `tmp/` without
    /// isolation), writes the
    /// token, the commands' environment, the id range and the cgroups' names, and last the
    /// record (the daemon's log is opened as it starts). A directory without a record is one
    /// whose create never got this far, which a restarted provider removes.
    pub fn prepare(&self, spec: &SandboxSpec, extra: &Extra) -> io::Result<()> {
        if extra.ids.is_some() {
            // Isolated: nothing of the sandbox enters it (its files are in its own layer), so no
            // one but the server's user does.
            std::fs::DirBuilder::new().mode(0o700).create(&self.root)?;
        } else {
            // Plain processes of the server's user, whose commands may run as another uid with
            // `work/` as their cwd: traversable, not listable.
            std::fs::DirBuilder::new().mode(0o711).create(&self.root)?;
            std::fs::DirBuilder::new().mode(0o755).create(self.work())?;
            std::fs::DirBuilder::new().mode(0o777).create(self.tmp())?;
            // Sticky and world-writable, like any /tmp (set apart from the umask).
            std::fs::set_permissions(self.tmp(), std::fs::Permissions::from_mode(0o1777))?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(self.rootfs())?;
        write_replacing(&self.token(), spec.token.as_bytes(), 0o600)?;
        let env = serde_json::to_vec(&extra.commands_env).map_err(io::Error::other)?;
        write_replacing(&self.env_file(), &env, 0o600)?;
        if let Some(ids) = extra.ids {
            write_replacing(&self.ids(), format!("{ids}\n").as_bytes(), 0o600)?;
        }
        if let Some(dirs) = &extra.cgroups {
            self.write_cgroups(dirs)?;
        }
        if let Some(image) = &extra.image {
            let bytes = serde_json::to_vec_pretty(image).map_err(io::Error::other)?;
            write_replacing(&self.image(), &bytes, 0o600)?;
        }
        let record = serde_json::to_vec_pretty(spec).map_err(io::Error::other)?;
        write_replacing(&self.record(), &record, 0o600)
    }

    /// The image the sandbox runs (`crate::image::SandboxImage` as JSON); absent for `host`.
    pub fn image(&self) -> PathBuf {
        self.root.join("image.json")
    }

    pub fn read_image(&self) -> Option<crate::image::SandboxImage> {
        serde_json::from_slice(&std::fs::read(self.image()).ok()?).ok()
    }

    /// The sandbox's cgroup directories (`cgroup::Dirs` as JSON); absent without cgroups.
    pub fn cgroups(&self) -> PathBuf {
        self.root.join("cgroups.json")
    }

    pub fn write_cgroups(&self, dirs: &Dirs) -> io::Result<()> {
        let bytes = serde_json::to_vec_pretty(dirs).map_err(io::Error::other)?;
        write_replacing(&self.cgroups(), &bytes, 0o600)
    }

    /// `None` when the sandbox has no cgroups (or the file was torn, which an atomic write rules
    /// out).
    pub fn read_cgroups(&self) -> Option<Dirs> {
        serde_json::from_slice(&std::fs::read(self.cgroups()).ok()?).ok()
    }

    pub fn read_spec(&self) -> io::Result<SandboxSpec> {
        let bytes = std::fs::read(self.record())?;
        serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    pub fn write_pid(&self, daemon: ProcId) -> io::Result<()> {
        write_replacing(&self.pid_file(), daemon.to_line().as_bytes(), 0o600)
    }

    pub fn read_pid(&self) -> Option<ProcId> {
        ProcId::parse(&std::fs::read_to_string(self.pid_file()).ok()?)
    }

    /// The daemon's last words: the last unindented line of its log with the indented lines
    /// after it (`error: …` then `  caused by: …`), on one line.
    pub fn last_words(&self) -> Option<String> {
        const TAIL: u64 = 4096;
        let mut f = File::open(self.log()).ok()?;
        let len = f.metadata().ok()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(TAIL))).ok()?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).ok()?;
        last_paragraph(&String::from_utf8_lossy(&buf))
    }
}

/// What a sandbox's directory holds beyond its spec.
#[derive(Debug, Clone, Default)]
pub struct Extra {
    pub commands_env: std::collections::BTreeMap<String, String>,
    /// The first host id of its range, when isolated (and only then).
    pub ids: Option<u32>,
    pub cgroups: Option<Dirs>,
    /// The image it runs, but for `host`.
    pub image: Option<crate::image::SandboxImage>,
}

/// The mount source the records' tmpfs shows in `/proc/mounts`.
pub const RECORDS_TMPFS: &str = "sandman-records";

/// Where an isolated provider keeps its sandboxes' directories (`state_dir/sandboxes/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Records {
    /// On a tmpfs mounted on `sandboxes/` (by this provider or a previous one on this state
    /// directory), which [`release_records`] unmounts once no sandbox is left.
    Tmpfs,
    /// On a tmpfs the state directory is on.
    Memory,
    /// On the state directory's own file system: `sandboxes/` held the directories of a server
    /// that kept them there, or the mount was refused.
    Disk,
}

/// Keeps the directories of isolated sandboxes in memory: a tmpfs is mounted on `sandboxes`
/// unless it is on one already or holds directories on disk (a previous server's; the next
/// start with none left mounts it). Each create writes a handful of small files there and each
/// delete removes them; they are worth nothing once the machine restarts (the sandboxes die
/// with it), and on a disk file system every one is an inode allocated and freed, which on
/// ext4 without a journal (inode allocation skips recently freed inodes) was about 4 ms of CPU
/// a sandbox at 45 creates a second. The tmpfs takes memory only for what is written (a few
/// pages a sandbox, charged to the writer's memory cgroup), bounded at a tenth of the machine's.
/// It is mounted before the template mount namespace is made, which sandboxes' namespaces
/// copy, so that a daemon's socket is where the server looks. Blocking.
pub fn keep_in_memory(sandboxes: &Path) -> Records {
    collect_abandoned(sandboxes);
    if crate::sys::on_tmpfs(sandboxes).unwrap_or(false) {
        return if is_mount_point(sandboxes) { Records::Tmpfs } else { Records::Memory };
    }
    if is_empty(sandboxes) != Some(true) {
        tracing::info!(dir = %sandboxes.display(), "sandbox directories stay on disk: sandboxes of an earlier server are there");
        return Records::Disk;
    }
    match crate::sys::mount_tmpfs(RECORDS_TMPFS, sandboxes, "mode=0700,size=10%") {
        Ok(()) => Records::Tmpfs,
        Err(e) => {
            tracing::info!(dir = %sandboxes.display(), error = %e, "sandbox directories stay on disk: cannot mount a tmpfs there");
            Records::Disk
        }
    }
}

/// Unmounts the records' tmpfs on `sandboxes` when no sandbox directory is left in it (a
/// provider that stops with sandboxes running keeps them for the next server). Blocking.
pub fn release_records(sandboxes: &Path) {
    if !is_mount_point(sandboxes) || !crate::sys::on_tmpfs(sandboxes).unwrap_or(false) {
        return;
    }
    if is_empty(sandboxes) == Some(true)
        && let Err(e) = crate::sys::umount_detach(sandboxes)
    {
        tracing::warn!(dir = %sandboxes.display(), error = %e, "cannot unmount the sandboxes' tmpfs");
    }
}

/// How long a state directory left with nothing but an empty `sandboxes/` must have been so
/// before its tmpfs is taken for abandoned: a server starting on a new one mounts the tmpfs a
/// moment before it writes anything else there.
const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Unmounts the records' tmpfs of state directories no server uses any more (other than
/// `own`): the tmpfs empty, and its state directory holding nothing else for a minute. A
/// server killed with no sandbox left, whose state directory was then removed (all but the
/// mount point, which cannot be), leaves such a mount; every mount namespace made on the
/// machine copies it until it goes. Blocking.
fn collect_abandoned(own: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    for point in records_mounts(&info) {
        if point != own && abandoned(&point) {
            match crate::sys::umount_detach(&point) {
                Ok(()) => {
                    tracing::info!(dir = %point.display(), "unmounted the sandboxes' tmpfs of an abandoned state directory")
                }
                Err(e) => {
                    tracing::debug!(dir = %point.display(), error = %e, "cannot unmount an abandoned sandboxes' tmpfs")
                }
            }
        }
    }
}

/// The mount points of the records' tmpfs mounts in `mountinfo` (`/proc/self/mountinfo`).
fn records_mounts(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut fs = right.split(' ');
            if (fs.next(), fs.next()) != (Some("tmpfs"), Some(RECORDS_TMPFS)) {
                return None;
            }
            left.split(' ').nth(4).map(|p| PathBuf::from(unescape_mountinfo(p)))
        })
        .collect()
}

/// A path as `mountinfo` writes it, with space, tab, newline and backslash as octal escapes.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let code = bytes
            .get(i + 1..i + 4)
            .and_then(|o| std::str::from_utf8(o).ok())
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match (bytes[i], code) {
            (b'\\', Some(c)) => {
                out.push(c);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn abandoned(sandboxes: &Path) -> bool {
    let Some(state) = sandboxes.parent() else { return false };
    let empty = is_empty(sandboxes) == Some(true);
    let alone = std::fs::read_dir(state)
        .map(|d| d.flatten().all(|e| e.file_name() == std::ffi::OsStr::new("sandboxes")))
        .unwrap_or(false);
    let old = std::fs::metadata(state)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age >= ABANDONED_AFTER);
    empty && alone && old
}

/// Whether the directory `dir` holds nothing; `None` when it cannot be read.
fn is_empty(dir: &Path) -> Option<bool> {
    std::fs::read_dir(dir).ok().map(|mut d| d.next().is_none())
}

/// Whether `path` is the root of a mount: on another device than its parent.
fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), std::fs::metadata(path.join(".."))) {
        (Ok(a), Ok(b)) => a.dev() != b.dev(),
        _ => false,
    }
}

/// The id slots the sandboxes under `sandboxes` hold (their `ids` files), each with the sandbox's
/// id, for a provider that starts on a state directory with sandboxes in it: each slot a
/// sandbox's range overlaps, also for a range another server's spacing made.
pub fn taken_slots(sandboxes: &Path) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir(sandboxes) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let id = e.file_name().to_str()?.to_string();
            let base = SandboxDir(RecordDir { root: e.path() }).read_ids()?;
            Some(crate::ids::slots_overlapping(base).map(move |slot| (slot, id.clone())))
        })
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_records_mounts_are_read_from_mountinfo_with_their_escapes() {
        let info = "\
36 25 0:31 / /var/lib/sandman/sandboxes rw,nosuid,nodev,noexec,relatime - tmpfs sandman-records rw,size=2400k,mode=700
37 25 0:32 / /var/tmp/a\\040b/sandboxes rw,relatime - tmpfs sandman-records rw,mode=700
38 25 0:33 / /run/other rw,relatime - tmpfs tmpfs rw
39 25 0:34 / /srv/sandboxes rw,relatime - ext4 sandman-records rw
";
        assert_eq!(
            records_mounts(info),
            vec![PathBuf::from("/var/lib/sandman/sandboxes"), PathBuf::from("/var/tmp/a b/sandboxes")]
        );
        assert_eq!(unescape_mountinfo("a\\011b\\134c\\012"), "a\tb\\c\n");
        assert_eq!(unescape_mountinfo("plain\\"), "plain\\");
    }
}

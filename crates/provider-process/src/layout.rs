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

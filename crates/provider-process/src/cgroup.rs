//! The cgroups of isolated sandboxes: `<the server's own cgroup>/sandman-<id>` in one v2 directory
//! or in each of the v1 cpu, memory and pids controllers, with limits written at create
//! ([`create`]: pids always, cpu and memory when asked, and for eval no swap beyond memory),
//! read back for `applied` ([`Dirs::read_back`]) and removed at delete. Start at
//! [`Dirs::own`]. Pause and resume freeze a sandbox through cgroup v2's `cgroup.freeze`
//! ([`Dirs::freeze`]): in its v2 directory, or on a hybrid host (v1 controllers, the unified
//! hierarchy at `/sys/fs/cgroup/unified`) in a v2 cgroup of its own there that holds no
//! controller. Blocking file I/O throughout; callers run it off the async threads.

use std::io;
use std::path::{Path, PathBuf};

use sandman_provider::ProviderError;
use sandman_wire::cgroup::{parse_cpu_max, parse_max, swap_total};
use serde::{Deserialize, Serialize};

use crate::sys;

/// Where cgroup hierarchies are mounted (the daemon's observer reads them there too).
pub const MOUNT: &str = "/sys/fs/cgroup";

/// The CFS period the cpu quota is a share of, in microseconds (the kernel's default).
pub const PERIOD_US: u64 = 100_000;

/// The longest a freeze or thaw waits for `cgroup.events` to change before reading it again
/// (see [`Dirs::freeze`]): a few reads of a small file per pause at most.
const NOTIFY_CAP: std::time::Duration = std::time::Duration::from_micros(200);

/// The smallest CFS quota the kernel takes, in microseconds.
pub const MIN_QUOTA_US: u64 = 1_000;

/// v1 reports "no limit" as a huge page-rounded number.
const V1_UNLIMITED: u64 = 1 << 60;

/// The controllers eval needs, in the order they are named.
const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    /// One controller per hierarchy (`/sys/fs/cgroup/<controller>/…`), as on hybrid hosts.
    V1,
    /// The unified hierarchy mounted at `/sys/fs/cgroup` itself.
    V2,
}

/// One cgroup directory per controller eval needs; under v2 all three are the same directory.
/// Serialized as the sandbox's `cgroups.json`, so that a delete or `applied` after a server
/// restart (which may run in another cgroup) finds the sandbox's own.
///
/// A sandbox's v1 cpu and memory cgroups exist only when it is limited there (`None` else): a
/// memory cgroup costs the kernel about 1.4 MiB that it keeps until the cgroup is removed, more
/// than the sandbox's daemon itself, and an unlimited one holds the sandbox to nothing. Its pids
/// cgroup always exists: it limits, and it lists the sandbox's processes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dirs {
    pub version: Version,
    #[serde(default)]
    pub cpu: Option<PathBuf>,
    #[serde(default)]
    pub memory: Option<PathBuf>,
    pub pids: PathBuf,
    /// The v2 cgroup whose `cgroup.freeze` pauses the sandbox: the v2 directory itself, or on a
    /// hybrid host one in the unified hierarchy; `None` where the host has no cgroup v2 (or for
    /// a sandbox made before pausing existed), and pausing is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freezer: Option<PathBuf>,
}

/// What a sandbox's cgroups hold it to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Cores; no limit when `None`.
    pub cpu: Option<f64>,
    /// Bytes; no limit when `None`.
    pub memory: Option<u64>,
    /// No swap beyond `memory` (eval), refused where it cannot be held.
    pub no_swap: bool,
    pub pids: u64,
}

impl Limits {
    /// The CFS quota, in microseconds per [`PERIOD_US`].
    pub fn quota_us(&self) -> Option<u64> {
        self.cpu.map(|cpu| (cpu * PERIOD_US as f64).round() as u64)
    }
}

/// The limits as the cgroup files say, in the units `Applied` reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReadBack {
    pub cpu: Option<f64>,
    pub memory: Option<u64>,
    /// Bytes of swap allowed beyond memory.
    pub swap: Option<u64>,
    pub pids: Option<u64>,
}

impl Dirs {
    /// The server's own cgroups, from `/proc/self/cgroup` (`id:controllers:path` lines) and the
    /// hierarchies under `mount`: v2 when `mount` is the unified hierarchy (it has
    /// `cgroup.controllers`), else v1. An error says what is missing, for a refusal.
    pub fn own(self_cgroup: &str, mount: &Path) -> Result<Dirs, String> {
        let lines: Vec<(&str, &str)> = self_cgroup
            .lines()
            .filter_map(|l| {
                let mut parts = l.splitn(3, ':');
                parts.next()?;
                Some((parts.next()?, parts.next()?))
            })
            .collect();
        let under = |hierarchy: PathBuf, path: &str| hierarchy.join(path.trim_start_matches('/'));
        if mount.join("cgroup.controllers").is_file() {
            let path = lines
                .iter()
                .find(|(controllers, _)| controllers.is_empty())
                .map(|(_, p)| *p)
                .ok_or("/proc/self/cgroup has no cgroup v2 line")?;
            let own = under(mount.to_path_buf(), path);
            let enabled = std::fs::read_to_string(own.join("cgroup.subtree_control")).unwrap_or_default();
            let missing: Vec<&str> =
                CONTROLLERS.into_iter().filter(|c| !enabled.split_whitespace().any(|e| e == *c)).collect();
            if !missing.is_empty() {
                return Err(format!(
                    "cgroup v2: the server's cgroup `{}` does not enable {} for its children (its cgroup.subtree_control)",
                    own.display(),
                    quoted(&missing)
                ));
            }
            if !sys::writable(&own) {
                return Err(format!("cgroup v2: the server's cgroup `{}` is not writable", own.display()));
            }
            return Ok(Dirs {
                version: Version::V2,
                cpu: Some(own.clone()),
                memory: Some(own.clone()),
                freezer: Some(own.clone()),
                pids: own,
            });
        }
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for controller in CONTROLLERS {
            let path = lines.iter().find(|(cs, _)| cs.split(',').any(|c| c == controller)).map(|(_, p)| *p);
            match path.map(|p| under(mount.join(controller), p)) {
                Some(dir) if dir.is_dir() && sys::writable(&dir) => found.push(dir),
                Some(dir) => missing.push(format!("`{controller}` (`{}` is not a writable directory)", dir.display())),
                None => missing.push(format!("`{controller}` (not in /proc/self/cgroup)")),
            }
        }
        // A hybrid host's unified hierarchy, for the freezer alone: a cgroup there needs no
        // controller, so it costs the kernel little.
        let unified = mount.join("unified");
        let freezer = lines
            .iter()
            .find(|(controllers, _)| controllers.is_empty())
            .filter(|_| unified.join("cgroup.controllers").is_file())
            .map(|(_, p)| under(unified.clone(), p))
            .filter(|dir| dir.is_dir() && sys::writable(dir));
        match <[PathBuf; 3]>::try_from(found) {
            Ok([cpu, memory, pids]) if missing.is_empty() => {
                Ok(Dirs { version: Version::V1, cpu: Some(cpu), memory: Some(memory), pids, freezer })
            }
            _ => Err(format!("no writable cgroup v1 controller {}", missing.join(", "))),
        }
    }

    /// The cgroups of sandbox `id` held to `limits`: `sandman-<id>` under each of these (the
    /// server's own), in v1 only for the controllers that limit it (and pids).
    pub fn child(&self, id: &str, limits: &Limits) -> Dirs {
        let name = format!("sandman-{id}");
        let v2 = self.version == Version::V2;
        let limited =
            |own: &Option<PathBuf>, limits: bool| own.as_ref().filter(|_| v2 || limits).map(|d| d.join(&name));
        Dirs {
            version: self.version,
            cpu: limited(&self.cpu, limits.cpu.is_some()),
            memory: limited(&self.memory, limits.memory.is_some()),
            pids: self.pids.join(&name),
            freezer: self.freezer.as_ref().map(|d| d.join(&name)),
        }
    }

    /// Each directory once (v2 has one).
    pub fn unique(&self) -> Vec<&Path> {
        let mut dirs: Vec<&Path> = Vec::new();
        let all = [self.cpu.as_deref(), self.memory.as_deref(), Some(self.pids.as_path()), self.freezer.as_deref()];
        for d in all.into_iter().flatten() {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
        dirs
    }

    /// Whether the memory cgroup accounts swap, so that a swap limit can be written: v1
    /// `memory.memsw.limit_in_bytes`, v2 `memory.swap.max` (absent in a v2 root cgroup, where it
    /// is checked again once the sandbox's cgroup exists).
    pub fn accounts_swap(&self) -> bool {
        let Some(memory) = &self.memory else { return false };
        match self.version {
            Version::V1 => memory.join("memory.memsw.limit_in_bytes").exists(),
            Version::V2 => memory.join("memory.swap.max").exists() || memory == Path::new(MOUNT),
        }
    }

    /// Writes the limits into these (existing) directories. `host_swap` is `SwapTotal`: with no
    /// way to limit swap, a host without swap is the only one where none is guaranteed.
    fn write_limits(&self, limits: Limits, host_swap: u64) -> Result<(), ProviderError> {
        let v1 = self.version == Version::V1;
        if let Some(quota) = limits.quota_us() {
            let cpu = made_for(&self.cpu, "cpu")?;
            if v1 {
                write(cpu, "cpu.cfs_period_us", &PERIOD_US.to_string())?;
                write(cpu, "cpu.cfs_quota_us", &quota.to_string())?;
            } else {
                write(cpu, "cpu.max", &format!("{quota} {PERIOD_US}"))?;
            }
        }
        if let Some(bytes) = limits.memory.map(|m| m.to_string()) {
            let memory = made_for(&self.memory, "memory")?;
            let (limit, no_swap, no_swap_value) = if v1 {
                // memsw is memory and swap together, never below memory: memory goes first.
                ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", bytes.as_str())
            } else {
                ("memory.max", "memory.swap.max", "0")
            };
            write(memory, limit, &bytes)?;
            if limits.no_swap {
                if memory.join(no_swap).exists() {
                    write(memory, no_swap, no_swap_value)?;
                } else if host_swap > 0 {
                    return Err(no_swap_control(memory));
                }
            }
        }
        write(&self.pids, "pids.max", &limits.pids.to_string())
    }

    /// The limits the files hold now. Swap is what is allowed beyond memory; with no swap limit
    /// readable, none when the host has no swap (`host_swap` is `SwapTotal`).
    pub fn read_back(&self, host_swap: Option<u64>) -> ReadBack {
        let (memory, cpu) = (self.memory.as_deref(), self.cpu.as_deref());
        let in_memory = |file: &str| memory.and_then(|m| read(m, file));
        let in_cpu = |file: &str| cpu.and_then(|c| read(c, file));
        let v1_bytes = |file: &str| in_memory(file).and_then(|v| v.parse::<u64>().ok()).filter(|v| *v < V1_UNLIMITED);
        let swap = match self.version {
            Version::V1 => {
                let (memory, memsw) = (v1_bytes("memory.limit_in_bytes"), v1_bytes("memory.memsw.limit_in_bytes"));
                memsw.zip(memory).map(|(memsw, memory)| memsw.saturating_sub(memory))
            }
            Version::V2 => in_memory("memory.swap.max").and_then(|v| parse_max(&v)),
        };
        let swap = swap.or_else(|| (host_swap == Some(0)).then_some(0));
        let pids = read(&self.pids, "pids.max").and_then(|v| parse_max(&v));
        match self.version {
            Version::V1 => {
                let quota: Option<i64> = in_cpu("cpu.cfs_quota_us").and_then(|v| v.parse().ok());
                let period: Option<i64> = in_cpu("cpu.cfs_period_us").and_then(|v| v.parse().ok());
                ReadBack {
                    cpu: quota.zip(period).filter(|(q, p)| *q > 0 && *p > 0).map(|(q, p)| q as f64 / p as f64),
                    memory: v1_bytes("memory.limit_in_bytes"),
                    swap,
                    pids,
                }
            }
            Version::V2 => ReadBack {
                cpu: in_cpu("cpu.max").and_then(|v| parse_cpu_max(&v)),
                memory: in_memory("memory.max").and_then(|v| parse_max(&v)),
                swap,
                pids,
            },
        }
    }

    /// The processes in the sandbox's pids cgroup (every process of it: the daemon joins its
    /// cgroups before anything else).
    pub fn members(&self) -> Vec<i32> {
        std::fs::read_to_string(self.pids.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// SIGKILLs every process still in these cgroups: what a delete does when they do not empty
    /// by themselves (an isolated sandbox's do, as its pid namespace dies).
    pub fn kill_members(&self) {
        for dir in self.unique() {
            let procs = dir.join("cgroup.procs");
            let listed = |pid: i32| {
                std::fs::read_to_string(&procs).is_ok_and(|t| t.split_whitespace().any(|p| p == pid.to_string()))
            };
            let pids: Vec<i32> = std::fs::read_to_string(&procs)
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect();
            for pid in pids {
                if let Err(err) = sys::kill_pinned(pid, || listed(pid)) {
                    tracing::warn!(pid, %err, cgroup = %dir.display(), "cannot kill a process left in a sandbox's cgroup");
                }
            }
        }
    }

    /// Freezes (`frozen`) or thaws every process of the sandbox through its v2 cgroup's
    /// `cgroup.freeze`, then waits until the kernel says they all are (`frozen 1` or `frozen 0`
    /// in `cgroup.events`), at most `timeout`. The wait is on the file's change notification
    /// (`POLLPRI`), never a sleep: it ends the moment the last process stops.
    pub fn freeze(&self, frozen: bool, timeout: std::time::Duration) -> Result<(), ProviderError> {
        use std::io::{Read, Seek};
        let dir = self.freezer.as_deref().ok_or_else(|| {
            ProviderError::Unsupported(
                "the process provider cannot pause this sandbox: it has no cgroup v2 to freeze it with (the host mounts no \
                 unified hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified, or the sandbox was made before pausing existed)"
                    .into(),
            )
        })?;
        let path = dir.join("cgroup.events");
        let fail = |e| ProviderError::io(format!("cannot read `{}`", path.display()), e);
        let mut events = std::fs::File::open(&path).map_err(fail)?;
        write(dir, "cgroup.freeze", if frozen { "1" } else { "0" })?;
        let want = if frozen { "frozen 1" } else { "frozen 0" };
        let deadline = std::time::Instant::now().checked_add(timeout);
        let mut text = String::with_capacity(64);
        loop {
            text.clear();
            events.seek(io::SeekFrom::Start(0)).and_then(|_| events.read_to_string(&mut text)).map_err(fail)?;
            if text.lines().any(|l| l.trim() == want) {
                return Ok(());
            }
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(std::time::Instant::now()));
            if left.is_zero() {
                return Err(ProviderError::Backend(format!(
                    "the processes of cgroup `{}` are still not {} after {} ms",
                    dir.display(),
                    if frozen { "frozen" } else { "thawed" },
                    timeout.as_millis()
                )));
            }
            // The kernel sends a cgroup file's change notifications at most once per 10 ms
            // (`CGROUP_FILE_NOTIFY_MIN_INTV`), delaying one that comes sooner after the last (a
            // pause right after a resume), while the file itself is current at once: so the
            // wait is cut short and the file read again.
            sys::wait_changed(&events, left.min(NOTIFY_CAP)).map_err(fail)?;
        }
    }

    /// Whether the sandbox's processes are frozen now (`cgroup.freeze` holds 1).
    pub fn is_frozen(&self) -> bool {
        self.freezer.as_deref().and_then(|d| read(d, "cgroup.freeze")).is_some_and(|v| v == "1")
    }

    /// Asks the kernel to thaw the sandbox without waiting: what a delete does first, so that
    /// its processes can take their signals.
    pub fn thaw_now(&self) {
        if self.is_frozen()
            && let Some(dir) = self.freezer.as_deref()
            && let Err(err) = write(dir, "cgroup.freeze", "0")
        {
            tracing::warn!(%err, "cannot thaw a paused sandbox's cgroup");
        }
    }

    /// Microseconds of CPU the sandbox's processes have used, from its v2 cgroup's `cpu.stat`
    /// (`usage_usec`, kept by every v2 cgroup whatever its controllers).
    pub fn cpu_usage_usec(&self) -> Option<u64> {
        let stat = read(self.freezer.as_deref()?, "cpu.stat")?;
        stat.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|v| v.trim().parse().ok())
    }

    /// Removes the directories once: fails while processes are still in one (`EBUSY`); one that
    /// is gone already is fine.
    pub fn remove(&self) -> io::Result<()> {
        for dir in self.unique() {
            match std::fs::remove_dir(dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}

/// Makes the cgroups of `dirs` and writes `limits`; on failure removes what it made.
pub fn create(dirs: &Dirs, limits: Limits, host_swap: u64) -> Result<(), ProviderError> {
    let mut made: Vec<&Path> = Vec::new();
    let mut result = Ok(());
    for dir in dirs.unique() {
        result = make(dir);
        if result.is_err() {
            break;
        }
        made.push(dir);
    }
    if result.is_ok() {
        result = dirs.write_limits(limits, host_swap);
    }
    if result.is_err() {
        for dir in made.into_iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
    result
}

/// Makes one cgroup. One left by a sandbox no longer in the records (a crash between its
/// directory's removal and its cgroup's) is removed and made anew when empty.
fn make(dir: &Path) -> Result<(), ProviderError> {
    let made = match std::fs::create_dir(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            tracing::info!(cgroup = %dir.display(), "replacing a cgroup left by an earlier sandbox");
            std::fs::remove_dir(dir).map_err(|e| {
                ProviderError::io(
                    format!(
                        "the cgroup `{}` exists already and cannot be removed (processes still in it?)",
                        dir.display()
                    ),
                    e,
                )
            })?;
            std::fs::create_dir(dir)
        }
        other => other,
    };
    made.map_err(|e| ProviderError::io(format!("cannot make the cgroup `{}`", dir.display()), e))
}

/// The directory `child` made for a limited controller.
fn made_for<'a>(dir: &'a Option<PathBuf>, controller: &str) -> Result<&'a Path, ProviderError> {
    dir.as_deref().ok_or_else(|| {
        ProviderError::Unsupported(format!(
            "the sandbox's {controller} cgroup was not made, yet a limit is asked there"
        ))
    })
}

fn no_swap_control(memory: &Path) -> ProviderError {
    ProviderError::Unsupported(format!(
        "eval needs swap limited to nothing beyond memory, and the host has swap but the memory cgroup `{}` cannot limit it (swap accounting is off: boot with swapaccount=1)",
        memory.display()
    ))
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), ProviderError> {
    let path = dir.join(file);
    // Not `fs::write`: a cgroup file is never created, and a missing one is an error. (Truncating
    // is what a shell's `>` does; cgroup files allow it.)
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .and_then(|mut f| io::Write::write_all(&mut f, value.as_bytes()))
        .map_err(|e| ProviderError::io(format!("cannot write `{value}` to `{}`", path.display()), e))
}

fn read(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_string())
}

/// The host's `SwapTotal`, read now (swap can be turned on at any time).
pub fn host_swap() -> Option<u64> {
    swap_total(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn quoted(names: &[&str]) -> String {
    names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(cpu: f64, memory: u64, pids: u64) -> Limits {
        Limits { cpu: Some(cpu), memory: Some(memory), no_swap: true, pids }
    }

    #[test]
    fn only_pids_are_written_when_nothing_else_is_asked() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let d = root.path().to_path_buf();
        for (f, v) in [("cpu.max", "max 100000"), ("memory.max", "max"), ("pids.max", "max")] {
            put(&d, f, v);
        }
        let dirs = Dirs {
            version: Version::V2,
            cpu: Some(d.clone()),
            memory: Some(d.clone()),
            pids: d.clone(),
            freezer: None,
        };
        let limits = Limits { cpu: None, memory: None, no_swap: false, pids: 4096 };
        dirs.write_limits(limits, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
        let back = dirs.read_back(Some(1 << 30));
        assert_eq!(back, ReadBack { cpu: None, memory: None, swap: None, pids: Some(4096) });
    }

    fn put(root: &Path, file: &str, text: &str) {
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().unwrap_or(root)).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(path, text).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn v1_cgroups_are_found_per_controller_under_the_servers_own() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let r = root.path();
        for d in ["cpu", "memory/process_api/x", "pids"] {
            std::fs::create_dir_all(r.join(d)).unwrap_or_else(|e| panic!("{e}"));
        }
        let lines = "8:pids:/\n4:memory:/process_api/x\n1:cpu,cpuacct:/\n0::/\n";
        let own = Dirs::own(lines, r).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(own.version, Version::V1);
        assert_eq!(own.memory, Some(r.join("memory/process_api/x")));
        let limited = Limits { cpu: Some(0.5), memory: Some(1 << 20), no_swap: false, pids: 10 };
        let sb = own.child("sb-1", &limited);
        assert_eq!(sb.memory, Some(r.join("memory/process_api/x/sandman-sb-1")));
        assert_eq!(sb.cpu, Some(r.join("cpu/sandman-sb-1")));
        assert_eq!(sb.unique().len(), 3);
        // Unlimited cpu and memory: no cgroup there, only pids.
        let plain = own.child("sb-2", &Limits { cpu: None, memory: None, ..limited });
        assert_eq!((&plain.cpu, &plain.memory), (&None, &None));
        let pids = r.join("pids/sandman-sb-2");
        assert_eq!(plain.unique(), vec![pids.as_path()]);
        let err = Dirs::own("4:memory:/process_api/x\n1:cpu:/\n", r).err().unwrap_or_default();
        assert!(err.contains("`pids`") && !err.contains("`cpu`"), "{err}");
    }

    #[test]
    fn v2_needs_the_controllers_enabled_for_children() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let r = root.path();
        put(r, "cgroup.controllers", "cpu memory pids io\n");
        put(r, "srv/cgroup.subtree_control", "memory io\n");
        let err = Dirs::own("0::/srv\n", r).err().unwrap_or_default();
        assert!(err.contains("`cpu`, `pids`") && err.contains("subtree_control"), "{err}");
        put(r, "srv/cgroup.subtree_control", "cpu memory pids\n");
        let own = Dirs::own("0::/srv\n", r).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((own.version, own.unique()), (Version::V2, vec![r.join("srv").as_path()]));
    }

    #[test]
    fn v1_limits_are_written_and_read_back() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let r = root.path();
        let dirs = Dirs {
            version: Version::V1,
            cpu: Some(r.join("cpu")),
            memory: Some(r.join("memory")),
            pids: r.join("pids"),
            freezer: None,
        };
        // What the kernel puts in a new cgroup.
        for (f, v) in [
            ("cpu/cpu.cfs_period_us", "100000"),
            ("cpu/cpu.cfs_quota_us", "-1"),
            ("memory/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/memory.memsw.limit_in_bytes", "9223372036854771712"),
            ("pids/pids.max", "max"),
        ] {
            put(r, f, v);
        }
        assert_eq!(dirs.read_back(Some(1 << 30)), ReadBack::default());
        dirs.write_limits(eval(1.5, 64 << 20, 50), 1 << 30).unwrap_or_else(|e| panic!("{e}"));
        let back = dirs.read_back(Some(1 << 30));
        assert_eq!(back, ReadBack { cpu: Some(1.5), memory: Some(64 << 20), swap: Some(0), pids: Some(50) });
        // Without swap accounting, only a host without swap can be held to none.
        std::fs::remove_file(r.join("memory/memory.memsw.limit_in_bytes")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dirs.read_back(Some(1 << 30)).swap, None);
        assert_eq!(dirs.read_back(Some(0)).swap, Some(0));
        let refused = dirs.write_limits(eval(1.0, 1 << 20, 1), 1 << 30);
        assert!(matches!(&refused, Err(ProviderError::Unsupported(m)) if m.contains("swap")), "{refused:?}");
        assert!(dirs.write_limits(eval(1.0, 1 << 20, 1), 0).is_ok());
        // Outside eval, swap is not held, so its control is not needed.
        assert!(dirs.write_limits(Limits { no_swap: false, ..eval(1.0, 1 << 20, 1) }, 1 << 30).is_ok());
    }

    #[test]
    fn v2_limits_are_written_and_read_back() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let d = root.path().to_path_buf();
        for (f, v) in
            [("cpu.max", "max 100000"), ("memory.max", "max"), ("memory.swap.max", "max"), ("pids.max", "max")]
        {
            put(&d, f, v);
        }
        let dirs = Dirs {
            version: Version::V2,
            cpu: Some(d.clone()),
            memory: Some(d.clone()),
            pids: d.clone(),
            freezer: None,
        };
        dirs.write_limits(eval(0.25, 1 << 30, 1024), 1 << 30).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read_to_string(d.join("cpu.max")).ok().as_deref(), Some("25000 100000"));
        let back = dirs.read_back(Some(1 << 30));
        assert_eq!(back, ReadBack { cpu: Some(0.25), memory: Some(1 << 30), swap: Some(0), pids: Some(1024) });
    }

    #[test]
    fn a_missing_cgroup_file_is_an_error_never_created() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        assert!(write(root.path(), "pids.max", "5").is_err());
        assert!(!root.path().join("pids.max").exists());
    }
}

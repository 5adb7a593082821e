//! `GET /v1/conditions`: what the sandbox looks like from inside — cgroup limits, the daemon's
//! rlimits, network interfaces, timezone, locale, kernel, cpu — read fresh on every call, so that
//! a record of the conditions a result ran under can be checked against what was asked.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use sandman_wire::cgroup::{parse_cpu_max, parse_max, swap_total};
use sandman_wire::daemon::Observed;

use crate::state::Daemon;

pub async fn conditions(State(daemon): State<Arc<Daemon>>) -> Json<Observed> {
    let env = daemon.defaults.env.clone();
    let rlimits = daemon.defaults.rlimits;
    let pid1 = daemon.pid1;
    let observed = tokio::task::spawn_blocking(move || {
        let cgroup = Cgroup::of_self();
        Observed {
            daemon_version: crate::api::VERSION.to_string(),
            kernel: read_trim("/proc/sys/kernel/osrelease"),
            cpu_model: cpu_model(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()),
            cpus_available: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cgroup_cpu_limit: cgroup.cpu_limit(),
            cgroup_memory_limit: cgroup.memory_limit(),
            cgroup_swap_limit: cgroup
                .swap_limit(swap_total(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default())),
            cgroup_pids_limit: cgroup.pids_limit(),
            rlimit_as: rlimits.address_space,
            rlimit_fsize: rlimits.file_size,
            rlimit_nofile: rlimits.open_files,
            network_interfaces: interfaces(&std::fs::read_to_string("/proc/net/dev").unwrap_or_default()),
            timezone: env.get("TZ").cloned().or_else(|| {
                std::fs::read_link("/etc/localtime").ok().map(|p| {
                    let s = p.display().to_string();
                    s.split_once("zoneinfo/").map(|(_, z)| z.to_string()).unwrap_or(s)
                })
            }),
            locale: env.get("LC_ALL").or_else(|| env.get("LANG")).cloned(),
            hostname: read_trim("/proc/sys/kernel/hostname"),
            pid1,
        }
    })
    .await
    .unwrap_or_default();
    Json(observed)
}

fn read_trim(path: impl AsRef<Path>) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}

fn cpu_model(cpuinfo: &str) -> String {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default()
}

fn interfaces(net_dev: &str) -> Vec<String> {
    let mut names: Vec<String> =
        net_dev.lines().skip(2).filter_map(|l| l.split_once(':')).map(|(n, _)| n.trim().to_string()).collect();
    names.sort();
    names
}

/// The memory limit of the cgroup this process is in, if it has one: the daemon holds its
/// buffered output to a share of it (see `crate::run`).
pub fn own_memory_limit() -> Option<u64> {
    Cgroup::of_self().memory_limit()
}

/// Where this process's cgroup files are: the unified (v2) directory, and the v1 controller
/// directories of a hybrid or legacy hierarchy.
#[derive(Debug, Default)]
struct Cgroup {
    unified: Option<PathBuf>,
    cpu_v1: Option<PathBuf>,
    memory_v1: Option<PathBuf>,
    pids_v1: Option<PathBuf>,
}

impl Cgroup {
    fn of_self() -> Cgroup {
        Cgroup::from_lines(
            &std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
            Path::new("/sys/fs/cgroup"),
        )
    }

    /// From `/proc/self/cgroup` lines (`id:controllers:path`). A path that is not mounted at the
    /// same place inside (a cgroup namespace shows `/`) falls back to the mount's root.
    fn from_lines(text: &str, root: &Path) -> Cgroup {
        let mut cg = Cgroup::default();
        let at = |mount: PathBuf, path: &str| {
            let inner = mount.join(path.trim_start_matches('/'));
            if inner.is_dir() { inner } else { mount }
        };
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
            if controllers.is_empty() {
                let unified =
                    if root.join("cgroup.controllers").exists() { root.to_path_buf() } else { root.join("unified") };
                cg.unified = Some(at(unified, path));
            }
            for c in controllers.split(',') {
                match c {
                    "cpu" => cg.cpu_v1 = Some(at(root.join("cpu"), path)),
                    "memory" => cg.memory_v1 = Some(at(root.join("memory"), path)),
                    "pids" => cg.pids_v1 = Some(at(root.join("pids"), path)),
                    _ => {}
                }
            }
        }
        cg
    }

    fn v2(&self, file: &str) -> Option<String> {
        self.unified.as_ref().and_then(|d| std::fs::read_to_string(d.join(file)).ok()).map(|s| s.trim().to_string())
    }

    fn v1(dir: &Option<PathBuf>, file: &str) -> Option<String> {
        dir.as_ref().and_then(|d| std::fs::read_to_string(d.join(file)).ok()).map(|s| s.trim().to_string())
    }

    fn cpu_limit(&self) -> Option<f64> {
        if let Some(max) = self.v2("cpu.max") {
            return parse_cpu_max(&max);
        }
        let quota: i64 = Self::v1(&self.cpu_v1, "cpu.cfs_quota_us")?.parse().ok()?;
        let period: i64 = Self::v1(&self.cpu_v1, "cpu.cfs_period_us")?.parse().ok()?;
        (quota > 0 && period > 0).then(|| quota as f64 / period as f64)
    }

    /// A v1 memory byte count; v1 reports "no limit" as a huge page-rounded number.
    fn v1_bytes(&self, file: &str) -> Option<u64> {
        Self::v1(&self.memory_v1, file)?.parse().ok().filter(|v: &u64| *v < (1 << 60))
    }

    fn memory_limit(&self) -> Option<u64> {
        match self.v2("memory.max") {
            Some(v) => parse_max(&v),
            None => self.v1_bytes("memory.limit_in_bytes"),
        }
    }

    /// Swap allowed beyond memory: v2 `memory.swap.max`; v1 `memory.memsw.limit_in_bytes` (memory
    /// and swap together) less `memory.limit_in_bytes`. With no such limit readable, a host with
    /// no swap at all (`host_swap` is `SwapTotal`) allows none.
    fn swap_limit(&self, host_swap: Option<u64>) -> Option<u64> {
        let limit = match self.v2("memory.swap.max") {
            Some(v) => parse_max(&v),
            None => self
                .v1_bytes("memory.memsw.limit_in_bytes")
                .zip(self.v1_bytes("memory.limit_in_bytes"))
                .map(|(memsw, memory)| memsw.saturating_sub(memory)),
        };
        limit.or_else(|| (host_swap == Some(0)).then_some(0))
    }

    fn pids_limit(&self) -> Option<u64> {
        self.v2("pids.max").or_else(|| Self::v1(&self.pids_v1, "pids.max")).and_then(|v| parse_max(&v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_files() {
        let dev = "Inter-|   Receive\n face |bytes\n    lo: 1 2 3\n  eth0: 4 5 6\n";
        assert_eq!(interfaces(dev), ["eth0", "lo"]);
        assert_eq!(cpu_model("processor : 0\nmodel name\t: Some CPU @ 2GHz\n"), "Some CPU @ 2GHz");
    }

    #[test]
    fn finds_v1_and_v2_cgroup_directories() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(root.path().join("memory/sb")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(root.path().join("memory/sb/memory.limit_in_bytes"), "33554432\n")
            .unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(root.path().join("unified")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(root.path().join("unified/pids.max"), "64\n").unwrap_or_else(|e| panic!("{e}"));
        let cg = Cgroup::from_lines("4:memory:/sb\n0::/\n", root.path());
        assert_eq!(cg.memory_limit(), Some(32 << 20));
        assert_eq!(cg.pids_limit(), Some(64));
        assert_eq!(cg.cpu_limit(), None);
    }

    fn write(root: &Path, file: &str, text: &str) {
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().unwrap_or(root)).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(path, text).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn v1_swap_is_memsw_less_memory_in_a_nested_sandbox_cgroup() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let r = root.path();
        // The process provider's layout: the daemon in `<server's own>/sandman-<id>` of each
        // controller; the v2 hierarchy (hybrid) holds no controllers.
        let sb = "process_api/abc/sandman-sb1";
        write(r, &format!("memory/{sb}/memory.limit_in_bytes"), "268435456\n");
        write(r, &format!("memory/{sb}/memory.memsw.limit_in_bytes"), "268435456\n");
        write(r, "memory/process_api/abc/memory.limit_in_bytes", "9223372036854771712\n");
        write(r, "cpu/sandman-sb1/cpu.cfs_quota_us", "50000\n");
        write(r, "cpu/sandman-sb1/cpu.cfs_period_us", "100000\n");
        write(r, "pids/sandman-sb1/pids.max", "100\n");
        write(r, "unified/cgroup.procs", "");
        let lines = format!("8:pids:/sandman-sb1\n4:memory:/{sb}\n1:cpu,cpuacct:/sandman-sb1\n0::/\n");
        let cg = Cgroup::from_lines(&lines, r);
        assert_eq!(cg.cpu_limit(), Some(0.5));
        assert_eq!(cg.memory_limit(), Some(256 << 20));
        assert_eq!(cg.pids_limit(), Some(100));
        // memsw equal to memory: no swap, whether or not the host has any.
        assert_eq!(cg.swap_limit(Some(1 << 30)), Some(0));
        write(r, &format!("memory/{sb}/memory.memsw.limit_in_bytes"), "301989888\n");
        assert_eq!(cg.swap_limit(Some(1 << 30)), Some(32 << 20));
        // memsw unlimited: swap unlimited, unless the host has none.
        write(r, &format!("memory/{sb}/memory.memsw.limit_in_bytes"), "9223372036854771712\n");
        assert_eq!(cg.swap_limit(Some(1 << 30)), None);
        assert_eq!(cg.swap_limit(Some(0)), Some(0));
    }

    #[test]
    fn no_swap_anywhere_means_none_allowed() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        // v1 without swap accounting: no memsw file.
        write(root.path(), "memory/sb/memory.limit_in_bytes", "33554432\n");
        let cg = Cgroup::from_lines("4:memory:/sb\n", root.path());
        assert_eq!(cg.swap_limit(Some(0)), Some(0));
        assert_eq!(cg.swap_limit(Some(4 << 30)), None);
        assert_eq!(cg.swap_limit(None), None);
    }

    #[test]
    fn v2_swap_max_wins() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        write(root.path(), "cgroup.controllers", "cpu memory pids\n");
        write(root.path(), "srv/sandman-sb/memory.max", "67108864\n");
        write(root.path(), "srv/sandman-sb/memory.swap.max", "0\n");
        write(root.path(), "srv/sandman-sb/cpu.max", "200000 100000\n");
        let cg = Cgroup::from_lines("0::/srv/sandman-sb\n", root.path());
        assert_eq!(cg.memory_limit(), Some(64 << 20));
        assert_eq!(cg.swap_limit(Some(1 << 30)), Some(0));
        assert_eq!(cg.cpu_limit(), Some(2.0));
        write(root.path(), "srv/sandman-sb/memory.swap.max", "max\n");
        assert_eq!(cg.swap_limit(Some(1 << 30)), None);
        assert_eq!(cg.swap_limit(Some(0)), Some(0));
    }
}

//! `--isolate` (namespaces, a private /tmp, loopback-only network) and `--rlimit-*` (limits on
//! every child), against the real daemon binary. The isolation tests need root, as CI has.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Daemon, alive, eventually};
use serde_json::json;

/// A directory outside /tmp, which `--isolate-tmp` replaces.
fn base() -> PathBuf {
    let dir = common::scratch().join("isolation");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn require_root() {
    assert_eq!(sandmand::sys::euid(), 0, "this test needs root for namespaces (CI and scripts/test run as root)");
}

/// A fresh directory for the sandbox's /tmp, and the daemon started with it.
async fn isolated(extra: &[&str]) -> (Daemon, tempfile::TempDir) {
    require_root();
    let tmp = tempfile::tempdir_in(base()).unwrap();
    let tmp_arg = tmp.path().display().to_string();
    let mut args = vec!["--isolate", "--isolate-tmp", &tmp_arg];
    args.extend_from_slice(extra);
    (Daemon::start_in(&base(), &args).await, tmp)
}

async fn sh(d: &Daemon, script: &str) -> serde_json::Value {
    d.exec(json!({"argv": ["/bin/sh", "-c", script]})).await
}

fn stdout(v: &serde_json::Value) -> String {
    v["stdout"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn isolated_daemon_is_pid_1_and_sees_only_its_own_processes() {
    let (d, _tmp) = isolated(&[]).await;
    let info = d.get("/v1/info").await.json();
    assert_eq!(info["pid"], 1, "{info}");
    // The host runs dozens of processes; the sandbox's /proc shows the daemon, the shell and ls.
    let out = sh(&d, "ls /proc | grep -c '^[0-9]'").await;
    let count: u32 = stdout(&out).trim().parse().unwrap();
    assert!(count <= 4, "the sandbox sees {count} processes: {out}");
    let me = sh(&d, "tr '\\0' ' ' < /proc/1/cmdline").await;
    assert!(stdout(&me).contains("sandmand"), "{me}");
}

#[tokio::test]
async fn isolated_tmp_is_the_given_directory() {
    let (d, tmp) = isolated(&[]).await;
    let name = format!("isolation-marker-{}", std::process::id());
    let out = sh(&d, &format!("echo inside > /tmp/{name}")).await;
    assert_eq!(out["exit_code"], 0, "{out}");
    assert_eq!(std::fs::read_to_string(tmp.path().join(&name)).unwrap(), "inside\n");
    assert!(!Path::new("/tmp").join(&name).exists(), "the file reached the host's /tmp");
}

#[tokio::test]
async fn isolated_hostname_is_its_own() {
    let (d, _tmp) = isolated(&[]).await;
    let host_before = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let out = sh(&d, "hostname sandbox-uts-test && cat /proc/sys/kernel/hostname").await;
    assert_eq!(stdout(&out).trim(), "sandbox-uts-test", "{out}");
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(), host_before);
}

#[tokio::test]
async fn isolate_net_leaves_only_loopback_and_brings_it_up() {
    let (d, _tmp) = isolated(&["--isolate-net"]).await;
    let dev = stdout(&d.exec(json!({"argv": ["cat", "/proc/net/dev"]})).await);
    // Two header lines, then one line per interface.
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, ["lo"], "{dev}");
    // A connection to a closed port on a loopback that is up is refused; were it down, the
    // network would be unreachable.
    let out = d.exec(json!({"argv": ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9"]})).await;
    let err = out["stderr"].as_str().unwrap();
    assert!(err.contains("Connection refused"), "{out}");
}

#[tokio::test]
async fn sigterm_to_the_waiter_stops_the_isolated_daemon_cleanly() {
    let (mut d, _tmp) = isolated(&[]).await;
    let r = d.json("POST", "/v1/processes", json!({"argv": ["sleep", "1000"], "tag": "sleeper"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let _ = Command::new("kill").args(["-TERM", &d.pid().to_string()]).status().unwrap();
    let status = d.wait_exit(Duration::from_secs(10)).expect("the waiter did not exit after SIGTERM");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[tokio::test]
async fn killing_the_waiter_kills_the_sandbox() {
    let (mut d, _tmp) = isolated(&[]).await;
    let waiter = d.pid();
    let children = std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children")).unwrap();
    let init: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    assert!(alive(init));
    let _ = Command::new("kill").args(["-KILL", &waiter.to_string()]).status().unwrap();
    d.wait_exit(Duration::from_secs(5)).expect("the waiter survived SIGKILL");
    assert!(
        eventually(Duration::from_secs(5), || !alive(init)).await,
        "the sandbox's init (host pid {init}) outlived its waiter"
    );
}

#[tokio::test]
async fn isolate_without_privileges_fails_clearly() {
    require_root();
    let dir = tempfile::tempdir_in(base()).unwrap();
    // Opened to everyone so that the unprivileged daemon gets as far as unshare.
    let mut perms = std::fs::metadata(dir.path()).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o777);
    std::fs::set_permissions(dir.path(), perms).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
        .arg(common::daemon_bin())
        .arg("--listen")
        .arg(format!("unix:{}/d.sock", dir.path().display()))
        .arg("--isolate")
        .env("SANDMAN_TOKEN", "t")
        .stdin(Stdio::null())
        .output()
        .expect("setpriv (util-linux) is needed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unshare needs root"), "{err}");
}

#[tokio::test]
async fn rlimit_as_limits_every_child_but_not_the_daemon() {
    let d = Daemon::start_in(&base(), &["--rlimit-as", "268435456"]).await;
    assert_eq!(stdout(&sh(&d, "ulimit -v").await).trim(), "262144");
    // GNU tail keeps a whole line in memory: 300 MiB without a newline cannot fit in 256 MiB.
    let out = sh(&d, "head -c 300M /dev/zero | tail").await;
    assert_ne!(out["exit_code"], 0, "{out}");
    assert!(out["stderr"].as_str().unwrap().contains("memory exhausted"), "{out}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.pid())).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max address space")).unwrap();
    assert!(line.contains("unlimited"), "the daemon itself is limited: {line}");
    // It still serves.
    assert_eq!(d.get("/v1/info").await.status, 200);
}

#[tokio::test]
async fn rlimit_fsize_stops_a_larger_write() {
    let d = Daemon::start_in(&base(), &["--rlimit-fsize", "1048576"]).await;
    let file = d.dir().join("big");
    let out = sh(&d, &format!("head -c 2M /dev/zero > {}", file.display())).await;
    // SIGXFSZ kills the writer, or the write fails with EFBIG where the signal is ignored.
    assert!(out["exit_code"] != 0 || out["signal"] == 25, "{out}");
    let size = std::fs::metadata(&file).unwrap().len();
    assert!(size <= 1 << 20, "wrote {size} bytes past a 1 MiB limit");
    let small = sh(&d, &format!("head -c 1000 /dev/zero > {}.small", file.display())).await;
    assert_eq!(small["exit_code"], 0, "{small}");
}

#[tokio::test]
async fn rlimit_nofile_is_set_on_children() {
    let d = Daemon::start_in(&base(), &["--rlimit-nofile", "64"]).await;
    assert_eq!(stdout(&sh(&d, "ulimit -n").await).trim(), "64");
}

#[tokio::test]
async fn conditions_report_what_the_sandbox_sees() {
    let (d, _tmp) = isolated(&["--isolate-net", "--rlimit-as", "268435456", "--rlimit-nofile", "64"]).await;
    let c = d.get("/v1/conditions").await.json();
    assert_eq!(c["network_interfaces"], json!(["lo"]), "{c}");
    assert_eq!(c["pid1"], true);
    assert_eq!(c["rlimit_as"], 268435456);
    assert_eq!(c["rlimit_nofile"], 64);
    assert_eq!(c["kernel"], std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap().trim());
    assert_eq!(c["daemon_version"], env!("CARGO_PKG_VERSION"));
    assert!(c["cpus_available"].as_u64().unwrap() >= 1);
}

#[tokio::test]
async fn a_cgroup_that_cannot_be_joined_stops_the_start() {
    let dir = tempfile::tempdir_in(base()).unwrap();
    let missing = dir.path().join("no-such-cgroup");
    let out = Command::new(common::daemon_bin())
        .arg("--listen")
        .arg(format!("unix:{}/d.sock", dir.path().display()))
        .arg("--cgroup")
        .arg(&missing)
        .env("SANDMAN_TOKEN", "t")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("cannot join the cgroup `{}`", missing.display())), "{err}");
    assert!(!dir.path().join("d.sock").exists(), "it listened before joining");
}

/// A fresh cgroup under this test's own in the hierarchy that has `controller` (v1), or in the
/// unified one when `/sys/fs/cgroup` is v2; removed (once empty) on drop.
struct TestCgroup(PathBuf);

impl TestCgroup {
    fn new(controller: &str, name: &str) -> TestCgroup {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let mount = Path::new("/sys/fs/cgroup");
        let (hierarchy, wanted) = if mount.join("cgroup.controllers").exists() {
            (mount.to_path_buf(), "")
        } else {
            (mount.join(controller), controller)
        };
        let path = own
            .lines()
            .filter_map(|l| l.split_once(':').and_then(|(_, rest)| rest.split_once(':')))
            .find(|(cs, _)| if wanted.is_empty() { cs.is_empty() } else { cs.split(',').any(|c| c == wanted) })
            .map(|(_, p)| p.trim_start_matches('/').to_string())
            .unwrap();
        let dir = hierarchy.join(path).join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot make the cgroup {}: {e}", dir.display()));
        TestCgroup(dir)
    }

    fn write(&self, file: &str, value: &str) {
        std::fs::write(self.0.join(file), value).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for _ in 0..250 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[tokio::test]
async fn the_daemon_joins_its_cgroups_first_and_observes_their_limits() {
    require_root();
    let memory = TestCgroup::new("memory", "sandmand-memory");
    let pids = TestCgroup::new("pids", "sandmand-pids");
    memory.write("memory.limit_in_bytes", "134217728");
    if memory.0.join("memory.memsw.limit_in_bytes").exists() {
        memory.write("memory.memsw.limit_in_bytes", "134217728");
    }
    pids.write("pids.max", "77");
    let (memory_arg, pids_arg) = (memory.0.display().to_string(), pids.0.display().to_string());
    {
        let (d, _tmp) = isolated(&["--isolate-net", "--cgroup", &memory_arg, "--cgroup", &pids_arg]).await;
        // The waiter outside and every command inside are in both.
        let outside = std::fs::read_to_string(format!("/proc/{}/cgroup", d.pid())).unwrap();
        let inside = stdout(&sh(&d, "cat /proc/self/cgroup").await);
        for cg in [&memory.0, &pids.0] {
            let name = cg.file_name().unwrap().to_str().unwrap();
            assert!(outside.contains(name) && inside.contains(name), "not in {name}: {outside} / {inside}");
        }
        let c = d.get("/v1/conditions").await.json();
        assert_eq!(c["cgroup_memory_limit"], 134217728, "{c}");
        assert_eq!(c["cgroup_pids_limit"], 77, "{c}");
        // memsw equal to memory, or a host without swap: no swap either way.
        assert_eq!(c["cgroup_swap_limit"], 0, "{c}");
    }
}

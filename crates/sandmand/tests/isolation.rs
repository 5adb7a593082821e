//! `--isolate` (a user namespace, a private root, namespaces, a private /tmp, loopback-only
//! network, confinement) and `--rlimit-*` (limits on every child), against the real daemon
//! binary. The isolation tests need root, as CI has.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Daemon, alive, eventually};
use sandman_testkit::http::Body;
use serde_json::json;

/// The host id the tests' sandboxes' root is: apart from the process provider's ranges.
const IDS: u32 = 0x1f00_0000;

/// A directory outside /tmp, which every sandbox has its own of.
fn base() -> PathBuf {
    let dir = common::scratch().join("isolation");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn require_root() {
    assert_eq!(sandmand::sys::euid(), 0, "this test needs root for namespaces (CI and scripts/test run as root)");
}

/// The working directory the tests' sandboxes get, inside.
const HOME: &str = "/home/user";

/// Where a sandbox's root is assembled (empty on the host: the mounts are in its namespace).
struct Dirs {
    root: tempfile::TempDir,
}

/// The daemon started isolated, with fresh directories.
async fn isolated(extra: &[&str]) -> (Daemon, Dirs) {
    require_root();
    let root = tempfile::tempdir_in(base()).unwrap();
    let (root_arg, ids) = (path(&root), IDS.to_string());
    let mut args = vec!["--isolate", "--isolate-ids", &ids, "--isolate-root", &root_arg, "--workdir", HOME];
    let dirs = Dirs { root };
    args.extend_from_slice(extra);
    (Daemon::start_in(&base(), &args).await, dirs)
}

fn path(d: &tempfile::TempDir) -> String {
    d.path().display().to_string()
}

/// The sandbox's init: the waiter's one child.
fn init_of(d: &Daemon) -> i32 {
    let waiter = d.pid();
    let children = std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children")).unwrap();
    children.split_whitespace().next().unwrap().parse().unwrap()
}

async fn sh(d: &Daemon, script: &str) -> serde_json::Value {
    d.exec(json!({"argv": ["/bin/sh", "-c", script]})).await
}

fn stdout(v: &serde_json::Value) -> String {
    v["stdout"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn isolated_daemon_is_pid_1_and_sees_only_its_own_processes() {
    let (d, _dirs) = isolated(&[]).await;
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
async fn isolated_tmp_is_its_own_both_ways() {
    let (d, _dirs) = isolated(&[]).await;
    let name = format!("isolation-marker-{}", std::process::id());
    let host_file = tempfile::NamedTempFile::new().unwrap();
    let host_name = host_file.path().file_name().unwrap().to_str().unwrap().to_string();
    let out = sh(&d, &format!("echo inside > /tmp/{name} && cat /tmp/{name}; ls -A /tmp")).await;
    assert_eq!(out["exit_code"], 0, "{out}");
    assert!(stdout(&out).starts_with("inside\n"), "{out}");
    assert!(!stdout(&out).contains(&host_name), "the host's /tmp shows in the sandbox: {out}");
    assert!(!Path::new("/tmp").join(&name).exists(), "the file reached the host's /tmp");
    // It is in the sandbox's own layer, seen from the host only through the sandbox's root.
    let inside = format!("/proc/{}/root/tmp/{name}", init_of(&d));
    assert_eq!(std::fs::read_to_string(inside).unwrap(), "inside\n");
}

#[tokio::test]
async fn isolated_daemon_has_namespaces_of_its_own() {
    let (d, _dirs) = isolated(&[]).await;
    let init = init_of(&d);
    for ns in ["user", "mnt", "pid", "cgroup", "ipc", "uts"] {
        let theirs = std::fs::read_link(format!("/proc/{init}/ns/{ns}")).unwrap();
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        assert_ne!(theirs, ours, "the sandbox shares the host's {ns} namespace");
    }
    // Without --isolate-net the network is the host's.
    assert_eq!(
        std::fs::read_link(format!("/proc/{init}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap()
    );
}

#[tokio::test]
async fn the_sandboxs_root_is_an_unprivileged_host_id() {
    let (d, dirs) = isolated(&[]).await;
    let me = sh(&d, "id -u; id -g; cat /proc/self/uid_map").await;
    let text = stdout(&me);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(&lines[..2], ["0", "0"], "{me}");
    assert_eq!(lines[2].split_whitespace().collect::<Vec<_>>(), ["0", &IDS.to_string(), "65536"], "{me}");
    // Seen from the host, the sandbox's init and what it writes belong to that id.
    let status = std::fs::read_to_string(format!("/proc/{}/status", init_of(&d))).unwrap();
    let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(uid.split_whitespace().skip(1).all(|u| u == IDS.to_string()), "{uid}");
    let wrote = sh(&d, "echo mine > owned").await;
    assert_eq!(wrote["exit_code"], 0, "{wrote}");
    let written = format!("/proc/{}/root{HOME}/owned", init_of(&d));
    let meta = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(written).unwrap());
    assert_eq!(meta, IDS);
    drop(dirs);
}

#[tokio::test]
async fn the_hosts_root_is_read_only_below_and_writes_stay_in_the_sandbox() {
    let (d, _dirs) = isolated(&[]).await;
    let name = format!("/isolation-layer-{}", std::process::id());
    let out = sh(
        &d,
        &format!("mkdir {name} && echo x > {name}/f && cat {name}/f; touch /usr/bin/planted; echo usr=$?; rm -f /etc/hostname; echo etc=$?"),
    )
    .await;
    let text = stdout(&out);
    assert!(text.starts_with("x\n"), "{out}");
    assert!(text.contains("usr=1") && text.contains("etc=1"), "the host's files are writable: {out}");
    assert!(!Path::new(&name).exists(), "a write reached the host's root");
    assert!(!Path::new("/usr/bin/planted").exists());
    assert!(Path::new("/etc/hostname").exists() || !Path::new("/etc").join("hostname").exists());
}

/// Regression (issue 28): a sandbox's working directory was its directory in the server's state
/// directory, at the same path inside, so every command saw the host's layout, and under a 0700
/// home (root's default state directory) the sandbox's root could not enter it at all.
#[tokio::test]
async fn hidden_paths_are_not_there_and_no_host_path_shows() {
    require_root();
    let secret_dir = tempfile::tempdir_in(base()).unwrap();
    std::fs::write(secret_dir.path().join("key"), "secret").unwrap();
    let secret_file = secret_dir.path().with_extension("file");
    std::fs::write(&secret_file, "secret").unwrap();
    let (hide_dir, hide_file) = (path(&secret_dir), secret_file.display().to_string());
    let (d, dirs) = isolated(&["--isolate-hide", &hide_dir, "--isolate-hide", &hide_file]).await;
    let parent = secret_dir.path().parent().unwrap().display().to_string();
    let out = sh(
        &d,
        &format!("ls -A {parent}; test -e {hide_dir}; echo dir=$?; test -e {hide_file}; echo file=$?; mkdir {hide_dir}/x; echo w=$?"),
    )
    .await;
    let text = stdout(&out);
    let (dir_name, file_name) = (secret_dir.path().file_name().unwrap(), secret_file.file_name().unwrap());
    assert!(!text.contains(dir_name.to_str().unwrap()) && !text.contains(file_name.to_str().unwrap()), "{out}");
    assert!(text.contains("dir=1\n") && text.contains("file=1\n") && text.contains("w=1\n"), "{out}");
    // The working directory is the sandbox's own, empty and writable, and nothing it can read
    // names a host path: not its working directory, HOME, mounts or PID 1's command line.
    let root = path(&dirs.root);
    let out = sh(
        &d,
        "ls -A; echo s > from-sandbox && cat from-sandbox; pwd; readlink /proc/self/cwd; stat -c '%u %a' .; \
         cat /proc/self/mountinfo /proc/1/mountinfo; tr '\\0' ' ' < /proc/1/cmdline; echo",
    )
    .await;
    let text = stdout(&out);
    assert!(text.starts_with(&format!("s\n{HOME}\n{HOME}\n0 755\n")), "{out}");
    for host in [&root, &hide_dir, &hide_file, &base().display().to_string()] {
        assert!(!text.contains(host.as_str()), "`{host}` shows inside the sandbox: {out}");
    }
    assert!(text.trim_end().ends_with("sandmand"), "PID 1's command line: {out}");
    // The host's file is untouched, and the sandbox's write is not on the host.
    assert_eq!(std::fs::read_to_string(secret_dir.path().join("key")).unwrap(), "secret");
}

#[tokio::test]
async fn the_sandbox_has_one_tmpfs_and_its_own_directories_share_it() {
    // 1 MiB of layer for everything the sandbox writes.
    let (d, _dirs) = isolated(&["--isolate-layer-bytes", "1048576"]).await;
    // The kernel's reclaim visits every superblock: a sandbox makes one tmpfs, and its other
    // directories are bind mounts of it (one device number in mountinfo's third field).
    let mountinfo = stdout(&sh(&d, "cat /proc/self/mountinfo").await);
    let tmpfs: std::collections::BTreeSet<&str> = mountinfo
        .lines()
        .filter(|l| l.split_once(" - ").is_some_and(|(_, r)| r.starts_with("tmpfs ")))
        .filter_map(|l| l.split(' ').nth(2))
        .collect();
    assert_eq!(tmpfs.len(), 1, "tmpfs superblocks {tmpfs:?} in {mountinfo}");
    let out = sh(
        &d,
        "echo a > /run/a && echo b > /var/tmp/b && echo c > /dev/shm/c && cat /run/a /var/tmp/b /dev/shm/c;          touch /dev/made 2>/dev/null; echo dev=$?; stat -c '%n %a %u' /run /var/tmp /dev/shm /tmp;          head -c 2000000 /dev/zero > /dev/shm/big 2>/dev/null; echo big=$?; rm -f /dev/shm/big;          head -c 2000000 /dev/zero > /tmp/big 2>/dev/null; echo tmp=$?; rm -f /tmp/big;          head -c 2000000 /dev/zero > big 2>/dev/null; echo home=$?; rm -f big;          echo x > /dev/null && head -c 4 /dev/zero | wc -c",
    )
    .await;
    let text = stdout(&out);
    assert!(text.starts_with("a\nb\nc\n"), "{out}");
    assert!(text.contains("dev=1\n"), "/dev is writable: {out}");
    for line in ["/run 755 0", "/var/tmp 1777 0", "/dev/shm 1777 0", "/tmp 1777 0"] {
        assert!(text.contains(line), "{line} missing: {out}");
    }
    assert!(text.contains("big=1\n"), "/dev/shm is not held to the layer's size: {out}");
    assert!(text.contains("tmp=1\n") && text.contains("home=1\n"), "/tmp or the home is not held to it: {out}");
    assert!(text.trim_end().ends_with('4'), "devices do not work: {out}");
}

#[tokio::test]
async fn commands_are_confined_no_new_privileges_and_no_admin_capabilities() {
    let (d, _dirs) = isolated(&[]).await;
    let out = sh(&d, "grep -E '^(NoNewPrivs|CapBnd|CapEff)' /proc/self/status").await;
    let text = stdout(&out);
    assert!(text.contains("NoNewPrivs:\t1"), "{out}");
    let bnd = text.lines().find(|l| l.starts_with("CapBnd")).unwrap().split_whitespace().nth(1).unwrap();
    let caps = u64::from_str_radix(bnd, 16).unwrap();
    // CAP_SYS_ADMIN (21), CAP_SYS_PTRACE (19), CAP_SYS_MODULE (16), CAP_NET_ADMIN (12) are gone.
    for cap in [21, 19, 16, 12] {
        assert_eq!(caps & (1 << cap), 0, "capability {cap} is in the bounding set: {bnd}");
    }
    let out = sh(
        &d,
        "mount -t tmpfs x /mnt; echo mount=$?; unshare -U true; echo userns=$?; \
         cat /proc/1/environ > /dev/null; echo environ=$?; echo $$ > /sys/fs/cgroup/pids/cgroup.procs; echo cg=$?",
    )
    .await;
    let text = stdout(&out);
    for refused in ["mount=", "userns=", "environ=", "cg="] {
        let code = text.split(refused).nth(1).and_then(|r| r.lines().next()).unwrap();
        assert_ne!(code, "0", "{refused} was allowed: {out}");
    }
}

#[tokio::test]
async fn isolate_net_leaves_only_loopback_and_brings_it_up() {
    let (d, _dirs) = isolated(&["--isolate-net"]).await;
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
    let (mut d, _dirs) = isolated(&[]).await;
    let r = d.json("POST", "/v1/processes", json!({"argv": ["sleep", "1000"], "tag": "sleeper"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let _ = Command::new("kill").args(["-TERM", &d.pid().to_string()]).status().unwrap();
    let status = d.wait_exit(Duration::from_secs(10)).expect("the waiter did not exit after SIGTERM");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[tokio::test]
async fn killing_the_waiter_kills_the_sandbox() {
    let (mut d, _dirs) = isolated(&[]).await;
    let waiter = d.pid();
    let init = init_of(&d);
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
    // Opened to everyone so that the unprivileged daemon gets as far as isolating.
    let mut perms = std::fs::metadata(dir.path()).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o777);
    std::fs::set_permissions(dir.path(), perms).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
        .arg(common::daemon_bin())
        .arg("--listen")
        .arg(format!("unix:{}/d.sock", dir.path().display()))
        .args(["--isolate", "--isolate-ids", &IDS.to_string(), "--isolate-root"])
        .arg(dir.path())
        .env("SANDMAN_TOKEN", "t")
        .stdin(Stdio::null())
        .output()
        .expect("setpriv (util-linux) is needed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("isolation needs root"), "{err}");
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

/// Regression (issue 34): the process provider gives every sandbox a file size limit, and every
/// exec forked the daemon to set it. The daemon holds the limit itself now, so that commands start
/// with posix_spawn: they still have the limit as their own, with SIGXFSZ at its default (the
/// daemon ignores it), and the daemon's own write past the limit is refused rather than its death.
#[tokio::test]
async fn a_file_size_limit_the_daemon_holds_is_the_commands_own() {
    let d = Daemon::start_in(&base(), &["--rlimit-fsize", "1048576"]).await;
    let file = d.dir().join("big");
    let dd =
        d.exec(json!({"argv": ["dd", "if=/dev/zero", format!("of={}", file.display()), "bs=1M", "count=2"]})).await;
    assert_eq!(dd["signal"], 25, "dd past the limit is killed by SIGXFSZ: {dd}");
    let limits = d.exec(json!({"argv": ["grep", "Max file size", "/proc/self/limits"]})).await;
    assert!(stdout(&limits).contains("1048576"), "{limits}");
    let session = d.json("POST", "/v1/sessions", json!({})).await.json();
    let run = d
        .json(
            "POST",
            &format!("/v1/sessions/{}/run", session["id"].as_str().unwrap()),
            json!({"command": format!("dd if=/dev/zero of={}.s bs=1M count=2 2>/dev/null; echo $?", file.display())}),
        )
        .await
        .json();
    assert_eq!(run["stdout"].as_str().unwrap().trim(), "153", "a session's command too (128 + SIGXFSZ): {run}");
    let path = format!("/v1/files?path={}", d.dir().join("upload").display());
    let upload = d.call("PUT", &path, Some(common::TOKEN), Body::Octets(vec![0; 2 << 20])).await.unwrap();
    assert_ne!(upload.status, 200, "the daemon wrote 2 MiB past a 1 MiB limit");
    assert_eq!(d.get("/v1/info").await.status, 200, "the daemon still serves");
}

#[tokio::test]
async fn rlimit_nofile_is_set_on_children() {
    let d = Daemon::start_in(&base(), &["--rlimit-nofile", "64"]).await;
    assert_eq!(stdout(&sh(&d, "ulimit -n").await).trim(), "64");
}

#[tokio::test]
async fn conditions_report_what_the_sandbox_sees() {
    let (d, _dirs) = isolated(&["--isolate-net", "--rlimit-as", "268435456", "--rlimit-nofile", "64"]).await;
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
        let (d, _dirs) = isolated(&["--isolate-net", "--cgroup", &memory_arg, "--cgroup", &pids_arg]).await;
        // The waiter outside and every command inside are in both.
        let outside = std::fs::read_to_string(format!("/proc/{}/cgroup", d.pid())).unwrap();
        let init = std::fs::read_to_string(format!("/proc/{}/cgroup", init_of(&d))).unwrap();
        for cg in [&memory.0, &pids.0] {
            let name = cg.file_name().unwrap().to_str().unwrap();
            assert!(outside.contains(name) && init.contains(name), "not in {name}: {outside} / {init}");
        }
        // Inside, a cgroup namespace of its own: its cgroup is the root.
        let inside = stdout(&sh(&d, "cat /proc/self/cgroup").await);
        assert!(inside.lines().all(|l| l.ends_with(":/")), "{inside}");
        let c = d.get("/v1/conditions").await.json();
        assert_eq!(c["cgroup_memory_limit"], 134217728, "{c}");
        assert_eq!(c["cgroup_pids_limit"], 77, "{c}");
        // memsw equal to memory, or a host without swap: no swap either way.
        assert_eq!(c["cgroup_swap_limit"], 0, "{c}");
    }
}

//! The process provider beyond the conformance suite: refusals, resources (cgroups isolated,
//! rlimits not), the daemon's environment, isolation (root), deletes that leave nothing, and
//! deaths seen after a restart.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{
    call, dir_of, eventually, exec, out, processes_mentioning, provider, ready, require_root, sh, socket_of, state_dir,
    unsupported,
};
use sandman_provider::conformance::{next_event, spec};
use sandman_provider::{Provider, SandboxSpec};
use sandman_provider_process::{HOST_IMAGE, Isolation, ProcessConfig, ProcessProvider, SANDBOX_HOME};
use sandman_wire::server::{Network, Profile, Quantity, Reason};
use serde_json::json;

#[tokio::test]
async fn refusals_name_the_way_out_and_leave_nothing() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    // A task image's layers are a sandbox's root in a user namespace of its own: not without isolation.
    let msg = unsupported(p.create(&spec("img", "python:3.12")).await);
    assert!(msg.contains("`python:3.12`") && msg.contains("--isolation none") && msg.contains("`host`"), "{msg}");
    // Eval needs fixed resources first of all, and then namespaces, which are off here.
    let mut eval = SandboxSpec { profile: Profile::Eval, ..spec("eval", HOST_IMAGE) };
    assert!(unsupported(p.create(&eval).await).contains("resources.cpu"));
    eval.resources.cpu = Some(Quantity::Number(1.0));
    eval.resources.memory = Some(Quantity::Text("64Mi".into()));
    let msg = unsupported(p.create(&eval).await);
    assert!(msg.contains("eval") && msg.contains("isolation is off"), "{msg}");
    let offline = SandboxSpec { network: Network::None, ..spec("net", HOST_IMAGE) };
    assert!(unsupported(p.create(&offline).await).contains("network namespace"));
    assert!(unsupported(p.create(&spec("../escape", HOST_IMAGE)).await).contains("cannot name a directory"));
    assert!(p.list().await.unwrap().is_empty());
    assert_eq!(std::fs::read_dir(state.path().join("sandboxes")).unwrap().count(), 0);
    // Deleting what never existed is fine, and touches nothing outside.
    p.delete("never-was").await.unwrap();
    p.delete("../..").await.unwrap();
    assert!(state.path().exists());
}

#[tokio::test]
async fn the_daemon_gets_a_clean_environment_and_its_own_work_dir() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let mut s = spec("env1", HOST_IMAGE);
    s.env = BTreeMap::from([("FROM_SPEC".into(), "1".into()), ("SANDMAN_TOKEN".into(), "hijack".into())]);
    let ep = ready(&p, &s).await;
    let dir = dir_of(&ep);
    let env = out(&sh(&ep, &s.token, "env; echo cwd=$(pwd); ls -A").await);
    assert!(env.contains("FROM_SPEC=1"), "{env}");
    assert!(env.contains(&format!("HOME={SANDBOX_HOME}\n")), "{env}");
    assert!(env.trim_end().ends_with(&format!("cwd={SANDBOX_HOME}")), "the work directory is not fresh: {env}");
    assert!(env.contains("LANG=C.UTF-8"), "{env}");
    assert!(!env.contains("CARGO"), "the server's environment leaked into the sandbox: {env}");
    assert!(!env.contains("SANDMAN_"), "{env}");
    assert!(!env.contains(&state.path().display().to_string()), "the state directory shows: {env}");
    for secret in ["token", "record.json"] {
        let mode = std::fs::metadata(dir.join(secret)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{secret} is {mode:o}");
    }
    // Nothing of the sandbox needs to enter its directory on the host: only its owner may.
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert!(!dir.join("work").exists() && !dir.join("tmp").exists(), "files of the sandbox on the host's disk");
    p.delete(&s.id).await.unwrap();
}

/// Regression (issue 28): as root with the default state directory (under `/root`, 0700), every
/// command failed `Permission denied`: the sandbox's working directory was in the state
/// directory, which the sandbox's root (an unmapped id on the host) could not enter.
#[tokio::test]
async fn a_state_directory_under_a_0700_home_works() {
    require_root();
    let home = tempfile::tempdir_in(common::scratch()).unwrap();
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let state = home.path().join(".local/state/sandman");
    let p = provider(&state, Isolation::Full);
    let s = spec("home0700", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    let uname = exec(&socket_of(&ep), &s.token, &["uname", "-a"]).await.unwrap();
    assert_eq!(uname["exit_code"], 0, "{uname}");
    assert!(out(&uname).starts_with("Linux "), "{uname}");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn without_isolation_memory_and_disk_become_rlimits_of_every_command() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    let mut s = spec("limits", HOST_IMAGE);
    s.resources.memory = Some(Quantity::Text("256Mi".into()));
    s.resources.disk = Some(Quantity::Text("1Mi".into()));
    s.resources.cpu = Some(Quantity::Number(0.5));
    let ep = ready(&p, &s).await;
    let limits = out(&sh(&ep, &s.token, "ulimit -v; ulimit -f").await);
    let lines: Vec<&str> = limits.lines().collect();
    assert_eq!(lines.first().copied(), Some("262144"), "{limits}");
    // 1 MiB in the shell's blocks: 512 bytes (dash) or 1024 (bash).
    assert!(matches!(lines.get(1).copied(), Some("2048" | "1024")), "{limits}");
    let big = sh(&ep, &s.token, "head -c 2M /dev/zero > big").await;
    assert!(big["exit_code"] != 0 || big["signal"] == 25, "{big}");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn isolated_memory_cpu_and_pids_are_the_sandboxs_cgroup_limits() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let mut s = spec("cg-limits", HOST_IMAGE);
    s.resources.memory = Some(Quantity::Text("256Mi".into()));
    s.resources.cpu = Some(Quantity::Number(0.5));
    s.resources.disk = Some(Quantity::Text("1Mi".into()));
    let ep = ready(&p, &s).await;
    // Seen from inside, through the sandbox's own cgroup namespace (v1 or v2).
    let script = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null; \
                  cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null; ulimit -v; ulimit -f";
    let seen = out(&sh(&ep, &s.token, script).await);
    let lines: Vec<&str> = seen.lines().collect();
    assert_eq!(lines.first().copied(), Some("268435456"), "{seen}");
    assert_eq!(lines.get(1).copied(), Some("4096"), "the default pids limit: {seen}");
    // No address-space limit: the memory is the cgroup's.
    assert_eq!(lines.get(2).copied(), Some("unlimited"), "{seen}");
    assert!(matches!(lines.get(3).copied(), Some("2048" | "1024")), "{seen}");
    let applied = p.applied(&s.id).await.unwrap();
    assert_eq!((applied.memory, applied.cpu, applied.pids), (Some(256 << 20), Some(0.5), Some(4096)));
    // A fork bomb stops at the limit; the sandbox stays usable.
    let mut small = spec("cg-pids", HOST_IMAGE);
    small.resources.pids = Some(20);
    let ep2 = ready(&p, &small).await;
    let bomb = sh(&ep2, &small.token, "for i in $(seq 40); do sleep 30 & done 2>&1; wait").await;
    assert!(out(&bomb).contains("fork") || bomb["stderr"].as_str().unwrap_or("").contains("fork"), "{bomb}");
    // Under v1, cpu and memory cgroups are made only for a sandbox limited there: each memory
    // cgroup costs the kernel more than the sandbox's daemon.
    let cgroups = |ep: &sandman_provider::Endpoint| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir_of(ep).join("cgroups.json")).unwrap()).unwrap()
    };
    let (limited, plain) = (cgroups(&ep), cgroups(&ep2));
    for dir in [&limited["cpu"], &limited["memory"], &limited["pids"], &plain["pids"]] {
        assert!(Path::new(dir.as_str().unwrap()).is_dir(), "{dir}");
    }
    if plain["version"] == "v1" {
        assert_eq!((&plain["cpu"], &plain["memory"]), (&json!(null), &json!(null)), "{plain}");
    }
    p.delete(&small.id).await.unwrap();
    p.delete(&s.id).await.unwrap();
}

/// Creates a sandbox with a background process and a detached grandchild, deletes it, and checks
/// that no process and no file of it is left.
async fn nothing_left_after_delete(isolate: Isolation, id: &str, secs: &str) {
    let state = state_dir();
    let p = provider(state.path(), isolate);
    let s = spec(id, HOST_IMAGE);
    let ep = ready(&p, &s).await;
    let dir = dir_of(&ep);
    let socket = socket_of(&ep);
    let started =
        call(&socket, "POST", "/v1/processes", Some(&s.token), Some(json!({"argv": ["sleep", secs]}))).await.unwrap();
    assert_eq!(started.status, 201);
    // A grandchild in a session of its own, orphaned to the daemon: not in any group it knows.
    let detached = sh(&ep, &s.token, &format!("setsid sleep {secs}1 >/dev/null 2>&1 < /dev/null &")).await;
    assert_eq!(detached["exit_code"], 0, "{detached}");
    assert!(eventually(Duration::from_secs(5), || processes_mentioning(&format!("sleep {secs}")).len() == 2).await);
    assert!(!processes_mentioning(&dir.display().to_string()).is_empty());
    p.delete(&s.id).await.unwrap();
    assert!(!dir.exists(), "{} left behind", dir.display());
    let gone = eventually(Duration::from_secs(5), || {
        processes_mentioning(&dir.display().to_string()).is_empty()
            && processes_mentioning(&format!("sleep {secs}")).is_empty()
    })
    .await;
    assert!(
        gone,
        "left running: {:?} {:?}",
        processes_mentioning(&dir.display().to_string()),
        processes_mentioning(&format!("sleep {secs}"))
    );
}

#[tokio::test]
async fn nothing_is_left_after_delete_without_isolation() {
    nothing_left_after_delete(Isolation::None, "left-plain", "4242.25").await;
}

#[tokio::test]
async fn nothing_is_left_after_delete_isolated() {
    require_root();
    nothing_left_after_delete(Isolation::Full, "left-ns", "4343.25").await;
}

#[tokio::test]
async fn isolated_sandbox_has_its_own_tmp_pid_1_and_namespaces() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = spec("iso1", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    let dir = dir_of(&ep);
    let info = call(&socket_of(&ep), "GET", "/v1/info", Some(&s.token), None).await.unwrap().json();
    assert_eq!(info["pid"], 1, "{info}");
    let name = format!("pp-marker-{}", std::process::id());
    let wrote = sh(&ep, &s.token, &format!("echo mine > /tmp/{name}")).await;
    assert_eq!(wrote["exit_code"], 0, "{wrote}");
    assert!(!Path::new("/tmp").join(&name).exists(), "reached the host's /tmp");
    assert!(!dir.join("tmp").exists(), "the sandbox's /tmp is on the host's disk");
    let applied = p.applied(&s.id).await.unwrap();
    let apart = applied.details["namespaces"].as_array().cloned().unwrap_or_default();
    for ns in ["mount", "pid", "ipc", "uts"] {
        assert!(apart.contains(&json!(ns)), "{ns} is shared with the host: {apart:?}");
    }
    assert_eq!(applied.details["isolation"]["mode"], "full", "{:?}", applied.details);
    p.delete(&s.id).await.unwrap();
}

/// The pid of sandbox `s`'s daemon, from its `daemon.pid` under the provider's state directory.
fn daemon_pid(state: &Path, s: &SandboxSpec) -> String {
    let pids = std::fs::read_to_string(state.join(format!("sandboxes/{}/daemon.pid", s.id))).unwrap();
    pids.split_whitespace().next().unwrap().to_string()
}

/// The `--isolate-template` an isolated daemon was started with, from its command line.
fn template_of(daemon_pid: &str) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{daemon_pid}/cmdline")).unwrap_or_default();
    let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    args.iter().position(|a| a == "--isolate-template").and_then(|i| args.get(i + 1).cloned())
}

#[tokio::test]
async fn isolated_sandboxes_copy_one_template_and_never_pivot_root() {
    // Regression: each daemon copied the host's mount namespace and switched with `pivot_root`,
    // which walks every thread on the machine (`chroot_fs_refs`): a create cost grew with the
    // sandboxes held. Each copies the provider's one template instead.
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let (a, b) = (spec("tmpl-a", HOST_IMAGE), spec("tmpl-b", HOST_IMAGE));
    let (ea, _eb) = (ready(&p, &a).await, ready(&p, &b).await);
    let (ta, tb) = (template_of(&daemon_pid(state.path(), &a)), template_of(&daemon_pid(state.path(), &b)));
    let template = ta.clone().unwrap_or_else(|| panic!("sandbox `{}` was started without --isolate-template", a.id));
    assert_eq!(ta, tb, "two sandboxes, two templates");
    let host_ns = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    assert_ne!(std::fs::read_link(&template).unwrap(), host_ns, "the template is the host's namespace");
    // The classic chroot escape (chroot below the cwd, then `..`) finds only the sandbox's root:
    // every mount under it sits on the root of the one below, and the host's tree is detached.
    let escape = "import os; open('/esc-marker', 'w').close(); os.mkdir('/esc'); os.chroot('/esc'); \
                  [os.chdir('..') for _ in range(40)]; os.chroot('.'); \
                  print(os.path.exists('/esc-marker'), os.path.exists('/host'))";
    let ran = sh(&ea, &a.token, &format!("python3 -c \"{escape}\"")).await;
    assert_eq!(ran["exit_code"], 0, "{ran}");
    assert_eq!(out(&ran).trim(), "True False", "{ran}");
    p.delete(&a.id).await.unwrap();
    p.delete(&b.id).await.unwrap();
}

#[tokio::test]
async fn a_template_whose_process_died_is_made_again_at_the_next_create() {
    // Regression: the template's process dying (killed, or by the OOM killer) left its namespace
    // unopenable, and every create failed until the server restarted.
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let (a, b) = (spec("tmpl-dead-a", HOST_IMAGE), spec("tmpl-dead-b", HOST_IMAGE));
    let ea = ready(&p, &a).await;
    let old = template_of(&daemon_pid(state.path(), &a)).unwrap();
    let holder: i32 = old.trim_start_matches("/proc/").split('/').next().unwrap().parse().unwrap();
    Command::new("kill").args(["-KILL", &holder.to_string()]).status().unwrap();
    // Gone, but not reaped: its namespace cannot be opened any more.
    let died = eventually(Duration::from_secs(10), || std::fs::metadata(&old).is_err()).await;
    assert!(died, "{old} still opens after its process was killed");
    let eb = ready(&p, &b).await;
    let new = template_of(&daemon_pid(state.path(), &b)).unwrap();
    assert_ne!(new, old, "the second sandbox was handed the dead template");
    assert!(std::fs::metadata(&new).is_ok(), "{new} cannot be opened");
    for (e, s) in [(&ea, &a), (&eb, &b)] {
        let ran = sh(e, &s.token, "echo alive").await;
        assert_eq!(out(&ran).trim(), "alive", "{ran}");
    }
    p.delete(&a.id).await.unwrap();
    p.delete(&b.id).await.unwrap();
}

#[tokio::test]
async fn network_none_leaves_only_loopback() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = SandboxSpec { network: Network::None, ..spec("offline", HOST_IMAGE) };
    let ep = ready(&p, &s).await;
    let dev = out(&exec(&socket_of(&ep), &s.token, &["cat", "/proc/net/dev"]).await.unwrap());
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, ["lo"], "{dev}");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn a_lapsed_daemon_lease_is_reported_as_lease_expired() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let mut events = p.events().unwrap();
    assert!(p.events().is_none(), "events are handed out once");
    let s = SandboxSpec { daemon_lease_s: 1, ..spec("lease", HOST_IMAGE) };
    p.create(&s).await.unwrap();
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::LeaseExpired, "{event:?}");
    let listed = p.list().await.unwrap().into_iter().find(|r| r.spec.id == s.id).unwrap();
    assert_eq!(listed.ended, Some(event.ended));
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn a_daemon_that_cannot_start_is_reported_with_its_last_words() {
    let state = state_dir();
    // A "daemon" that fails the way sandmand does when it cannot start.
    let fake = state.path().join("failing-daemon");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'error: cannot listen on `nowhere`' >&2\necho '  caused by: no such place' >&2\nexit 2\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let p = ProcessProvider::new(ProcessConfig {
        state_dir: state.path().to_path_buf(),
        daemon_bin: fake,
        daemon_args: Vec::new(),
        isolation: Isolation::None,
        hide: Vec::new(),
        network: Default::default(),
        defaults: Default::default(),
        capacity: None,
        images: Some(sandman_image::StoreConfig::new(state.path().join("images"))),
    })
    .unwrap();
    let mut events = p.events().unwrap();
    let s = spec("nostart", HOST_IMAGE);
    p.create(&s).await.unwrap();
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::ProviderError);
    assert_eq!(
        event.ended.message,
        "daemon exited with status 2: error: cannot listen on `nowhere` caused by: no such place"
    );
    p.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn a_restarted_server_learns_of_deaths_through_pidfds() {
    let state = state_dir();
    let first = provider(state.path(), Isolation::Full);
    let s = spec("adopted", HOST_IMAGE);
    let ep = ready(&first, &s).await;
    // The first server goes away; its daemon runs on.
    drop(first);
    let second = provider(state.path(), Isolation::Full);
    let mut events = second.events().unwrap();
    let listed = second.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].ended, None);
    let pid_line = std::fs::read_to_string(dir_of(&ep).join("daemon.pid")).unwrap();
    let pid = pid_line.split_whitespace().next().unwrap();
    assert!(Command::new("kill").args(["-KILL", pid]).status().unwrap().success());
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::ProviderError);
    assert!(event.ended.message.starts_with("daemon exited"), "{event:?}");
    let again = second.list().await.unwrap();
    assert_eq!(again[0].ended, Some(event.ended));
    second.delete(&s.id).await.unwrap();
    assert!(second.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_restarted_server_learns_a_lapsed_lease_from_the_exit_file() {
    let state = state_dir();
    let first = provider(state.path(), Isolation::Full);
    let s = SandboxSpec { daemon_lease_s: 2, ..spec("adopted-lease", HOST_IMAGE) };
    let ep = ready(&first, &s).await;
    drop(first);
    // The daemon is not the second provider's child: its status comes from the file it leaves.
    let second = provider(state.path(), Isolation::Full);
    let mut events = second.events().unwrap();
    assert_eq!(second.list().await.unwrap()[0].ended, None);
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::LeaseExpired, "{event:?}");
    assert_eq!(std::fs::read_to_string(dir_of(&ep).join("daemon.exit")).unwrap(), "3\n");
    second.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn an_unreadable_record_is_removed_unless_its_daemon_runs() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    let sandboxes = state.path().join("sandboxes");
    // What a machine crash leaves of an unsynced record: its sandbox died with the machine.
    let torn = sandboxes.join("torn");
    std::fs::create_dir_all(torn.join("work")).unwrap();
    std::fs::write(torn.join("record.json"), "").unwrap();
    // Unreadable while a process it names runs (a record from elsewhere): kept, not listed.
    let mut running = Command::new("sleep").arg("3004").spawn().unwrap();
    let broken = sandboxes.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("record.json"), "{not json").unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", running.id())).unwrap();
    let start_time = stat.rsplit_once(')').unwrap().1.split_whitespace().nth(19).unwrap().to_string();
    std::fs::write(broken.join("daemon.pid"), format!("{} {start_time}\n", running.id())).unwrap();
    assert!(p.list().await.unwrap().is_empty());
    assert!(!torn.exists(), "a torn record of a dead sandbox is left behind");
    assert!(broken.exists(), "an unreadable record whose daemon runs was removed");
    p.delete("broken").await.unwrap();
    assert!(!broken.exists());
    // The delete killed what the record named.
    assert!(running.wait().unwrap().code().is_none());
}

/// A state directory on a tmpfs of its own (`/dev/shm`, say) is the fastest place for it, and
/// fine for sandboxes: none of them enters it, although each gets a `/dev` of its own.
#[tokio::test]
async fn isolation_works_with_a_state_directory_under_dev_shm() {
    require_root();
    let state = Path::new("/dev/shm").join(format!("sandman-pp-{}", std::process::id()));
    let p = provider(&state, Isolation::Full);
    let s = spec("devshm", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    let r = sh(&ep, &s.token, "echo hi > f && cat f").await;
    assert_eq!((r["exit_code"].as_i64(), out(&r).as_str()), (Some(0), "hi\n"), "{r}");
    p.delete(&s.id).await.unwrap();
    drop(p);
    let _ = std::fs::remove_dir_all(&state);
}

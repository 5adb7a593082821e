//! The `eval` profile on the process provider: cgroups with fixed cpu, memory, swap and pids
//! limits that the daemon observes from inside and that bite, a loopback-only network, a fixed
//! environment with nothing from the host, refusals that name what is missing, and cgroups that
//! go with the sandbox. Sandboxes need root (namespaces, cgroups), as CI has.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{
    call, eventually, out, processes_mentioning, provider, ready, require_root, sh, socket_of, state_dir, unsupported,
};
use sandman_provider::conformance::spec;
use sandman_provider::{Provider, ProviderError, SandboxSpec};
use sandman_provider_process::{HOST_IMAGE, Isolation};
use sandman_wire::daemon::Observed;
use sandman_wire::server::{Applied, Profile, Quantity};
use serde_json::Value;

/// An eval spec with a per-run id: cgroups live in hierarchies the whole machine shares.
fn eval_spec(name: &str, cpu: f64, memory: &str, pids: Option<u64>) -> SandboxSpec {
    let mut s = spec(&format!("{name}-{}", std::process::id()), HOST_IMAGE);
    s.profile = Profile::Eval;
    s.resources.cpu = Some(Quantity::Number(cpu));
    s.resources.memory = Some(Quantity::Text(memory.into()));
    s.resources.pids = pids;
    s
}

/// The sandbox's cgroup directories, as `applied` reports them.
fn cgroup_dirs(applied: &Applied) -> Vec<PathBuf> {
    let cgroups = &applied.details["cgroups"];
    let mut dirs: Vec<PathBuf> =
        ["cpu", "memory", "pids"].iter().map(|c| PathBuf::from(cgroups[c].as_str().unwrap())).collect();
    dirs.dedup();
    dirs
}

fn dir_of(applied: &Applied, controller: &str) -> PathBuf {
    PathBuf::from(applied.details["cgroups"][controller].as_str().unwrap())
}

/// A counter of a flat-keyed cgroup file (`oom_kill 1`, `max 3`), 0 when absent.
fn counter(dir: &Path, files: &[&str], key: &str) -> u64 {
    files
        .iter()
        .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .flat_map(|text| text.lines().map(str::to_string).collect::<Vec<_>>())
        .find_map(|l| l.strip_prefix(&format!("{key} ")).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

#[tokio::test]
async fn an_eval_sandbox_gets_what_it_asked_for_and_its_daemon_observes_the_same() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = eval_spec("eval-limits", 0.5, "256Mi", Some(100));
    let ep = ready(&p, &s).await;
    let socket = socket_of(&ep);

    // The first command: the working directory is fresh and empty; the environment is fixed and
    // takes nothing from the host (cargo sets CARGO_MANIFEST_DIR in this test process).
    let host_var = std::env::var("CARGO_MANIFEST_DIR").unwrap();
    let first = sh(&ep, &s.token, "ls -A; echo ---; env; echo ---; cat /proc/self/cgroup").await;
    assert_eq!(first["exit_code"], 0, "{first}");
    let text = out(&first);
    let mut parts = text.split("---\n");
    let (listing, env, cgroups) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
    assert_eq!(listing, "", "the working directory is not empty: {listing}");
    let env: BTreeMap<&str, &str> = env.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(env.get("TZ"), Some(&"UTC"), "{env:?}");
    assert_eq!(env.get("LC_ALL"), Some(&"C.UTF-8"), "{env:?}");
    assert_eq!(env.get("LANG"), Some(&"C.UTF-8"), "{env:?}");
    assert_eq!(env.get("PATH"), Some(&"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), "{env:?}");
    assert!(!text.contains(&host_var) && !env.contains_key("CARGO_MANIFEST_DIR"), "the host leaked in: {env:?}");
    // In a cgroup namespace of its own: the sandbox's cgroup is its root.
    assert!(cgroups.lines().all(|l| l.ends_with(":/")), "commands see the host's cgroups: {cgroups}");

    let applied = p.applied(&s.id).await.unwrap();
    assert_eq!(applied.image.as_deref(), Some(HOST_IMAGE));
    assert_eq!(applied.cpu, Some(0.5), "{applied:?}");
    assert_eq!(applied.memory, Some(256 << 20), "{applied:?}");
    assert_eq!(applied.swap, Some(0), "{applied:?}");
    assert_eq!(applied.pids, Some(100), "{applied:?}");
    assert_eq!(applied.network.as_deref(), Some("none"));
    assert_eq!(applied.timezone.as_deref(), Some("UTC"));
    assert_eq!(applied.locale.as_deref(), Some("C.UTF-8"));
    let namespaces = applied.details["namespaces"].as_array().unwrap();
    for ns in ["mount", "pid", "net"] {
        assert!(namespaces.contains(&Value::from(ns)), "{ns} missing: {namespaces:?}");
    }
    assert_eq!(applied.details["rlimits"]["as"], Value::Null, "eval's memory is the cgroup's, not RLIMIT_AS");
    let dirs = cgroup_dirs(&applied);
    assert!(dirs.iter().all(|d| d.is_dir() && d.ends_with(format!("sandman-{}", s.id))), "{dirs:?}");
    // Seen from the host, the daemon and what it runs are in them.
    for d in &dirs {
        let members = std::fs::read_to_string(d.join("cgroup.procs")).unwrap();
        assert!(members.split_whitespace().count() >= 2, "{}: {members}", d.display());
    }

    let observed: Observed =
        serde_json::from_value(call(&socket, "GET", "/v1/conditions", Some(&s.token), None).await.unwrap().json())
            .unwrap();
    assert_eq!(observed.cgroup_cpu_limit, applied.cpu, "{observed:?}");
    assert_eq!(observed.cgroup_memory_limit, applied.memory, "{observed:?}");
    assert_eq!(observed.cgroup_swap_limit, applied.swap, "{observed:?}");
    assert_eq!(observed.cgroup_pids_limit, applied.pids, "{observed:?}");
    assert_eq!(observed.network_interfaces, ["lo"], "{observed:?}");
    assert_eq!(observed.timezone, applied.timezone);
    assert_eq!(observed.locale, applied.locale);
    assert_eq!(observed.rlimit_as, None);

    // The memory limit bites: well within it works, well over it is killed by the cgroup's OOM
    // killer, and the daemon serves on.
    let fill = |bytes: u64| format!("x=$(head -c {bytes} /dev/zero | tr '\\0' a); echo kept ${{#x}}");
    let small = sh(&ep, &s.token, &fill(16 << 20)).await;
    assert_eq!(out(&small).trim(), format!("kept {}", 16 << 20), "{small}");
    let memory_dir = dir_of(&applied, "memory");
    let ooms = |d: &Path| counter(d, &["memory.oom_control", "memory.events"], "oom_kill");
    let before = ooms(&memory_dir);
    let big = sh(&ep, &s.token, &fill(600 << 20)).await;
    assert!(!out(&big).contains("kept"), "600 MiB fitted into a 256 MiB sandbox: {big}");
    assert_eq!(big["signal"], 9, "not killed: {big}");
    assert!(ooms(&memory_dir) > before, "no OOM kill counted in {}", memory_dir.display());
    let after = sh(&ep, &s.token, "echo still here").await;
    assert_eq!(out(&after).trim(), "still here");

    // A restarted server finds the sandbox, reads back the same, and its delete removes the
    // cgroups with the directory.
    drop(p);
    let second = provider(state.path(), Isolation::Full);
    let listed = second.list().await.unwrap();
    assert_eq!(listed.iter().filter(|r| r.spec.id == s.id && r.ended.is_none()).count(), 1, "{listed:?}");
    assert_eq!(second.applied(&s.id).await.unwrap(), applied);
    second.delete(&s.id).await.unwrap();
    assert!(dirs.iter().all(|d| !d.exists()), "cgroups left after delete: {dirs:?}");
    assert!(!socket.parent().unwrap().exists());
    assert!(matches!(second.applied(&s.id).await, Err(ProviderError::NotFound(_))));
}

#[tokio::test]
async fn the_pids_limit_bounds_a_fork_bomb() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = eval_spec("eval-pids", 1.0, "256Mi", Some(40));
    let ep = ready(&p, &s).await;
    let applied = p.applied(&s.id).await.unwrap();
    assert_eq!(applied.pids, Some(40));
    let pids_dir = dir_of(&applied, "pids");
    let marker = "4646.5";
    let bomb = sh(
        &ep,
        &s.token,
        &format!("i=0; while [ $i -lt 80 ]; do sleep {marker} >/dev/null 2>&1 & i=$((i+1)); done; echo spawned $i"),
    )
    .await;
    assert!(!out(&bomb).contains("spawned 80"), "80 processes under a limit of 40: {bomb}");
    assert_ne!(bomb["exit_code"], 0, "{bomb}");
    assert!(counter(&pids_dir, &["pids.events"], "max") > 0, "no fork refused in {}", pids_dir.display());
    let current: u64 = std::fs::read_to_string(pids_dir.join("pids.current")).unwrap().trim().parse().unwrap();
    assert!(current <= 40, "{current} tasks under a limit of 40");
    let sleeping = processes_mentioning(&format!("sleep {marker}")).len();
    assert!(sleeping > 0 && sleeping < 40, "{sleeping} sleeps");
    p.delete(&s.id).await.unwrap();
    assert!(cgroup_dirs(&applied).iter().all(|d| !d.exists()), "cgroups left after delete");
    assert!(eventually(Duration::from_secs(5), || processes_mentioning(&format!("sleep {marker}")).is_empty()).await);
}

#[tokio::test]
async fn eval_without_cpu_or_memory_or_with_another_locale_is_refused_by_name() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let mut s = eval_spec("eval-refused", 1.0, "256Mi", None);
    s.resources.memory = None;
    let msg = unsupported(p.create(&s).await);
    assert!(msg.contains("resources.memory"), "{msg}");
    s.resources.memory = Some(Quantity::Text("256Mi".into()));
    s.resources.cpu = None;
    assert!(unsupported(p.create(&s).await).contains("resources.cpu"));
    s.resources.cpu = Some(Quantity::Number(1.0));
    s.env.insert("LC_ALL".into(), "de_DE.UTF-8".into());
    s.env.insert("TZ".into(), "UTC".into());
    let msg = unsupported(p.create(&s).await);
    assert!(msg.contains("LC_ALL") && !msg.contains("TZ"), "{msg}");
    assert!(matches!(p.check(&s), Err(ProviderError::Unsupported(_))));
    assert_eq!(std::fs::read_dir(state.path().join("sandboxes")).unwrap().count(), 0);
}

#[tokio::test]
async fn eval_without_namespaces_is_refused_naming_why() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    let s = eval_spec("eval-no-ns", 1.0, "256Mi", None);
    let msg = unsupported(p.create(&s).await);
    // Root or not, the reason is named: isolation off (root), or no root.
    assert!(msg.contains("isolation is off") || msg.contains("not root"), "{msg}");
    assert!(msg.contains("eval"), "{msg}");
    assert_eq!(std::fs::read_dir(state.path().join("sandboxes")).unwrap().count(), 0);
}

#[tokio::test]
async fn a_leftover_cgroup_of_a_forgotten_sandbox_breaks_nothing() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let s = eval_spec("eval-leftover", 1.0, "128Mi", None);
    ready(&p, &s).await;
    let applied = p.applied(&s.id).await.unwrap();
    assert_eq!(applied.pids, Some(1024), "eval's default pids limit");
    let dirs = cgroup_dirs(&applied);
    p.delete(&s.id).await.unwrap();
    // As if a server died between removing the sandbox's directory and its cgroups.
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
    }
    assert!(p.list().await.unwrap().iter().all(|r| r.spec.id != s.id));
    p.delete(&s.id).await.unwrap();
    let ep = ready(&p, &s).await;
    assert_eq!(p.applied(&s.id).await.unwrap().memory, Some(128 << 20));
    assert_eq!(out(&sh(&ep, &s.token, "echo ok").await).trim(), "ok");
    p.delete(&s.id).await.unwrap();
    assert!(dirs.iter().all(|d| !d.exists()), "cgroups left after delete: {dirs:?}");
}

#[tokio::test]
async fn a_default_sandbox_reports_its_cgroup_limits_and_no_address_space_rlimit() {
    require_root();
    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    let mut s = spec(&format!("plain-applied-{}", std::process::id()), HOST_IMAGE);
    s.resources.memory = Some(Quantity::Text("256Mi".into()));
    ready(&p, &s).await;
    let applied = p.applied(&s.id).await.unwrap();
    assert_eq!((applied.cpu, applied.memory, applied.pids), (None, Some(256 << 20), Some(4096)), "{applied:?}");
    assert_eq!(applied.network.as_deref(), Some("egress"));
    assert_eq!(applied.locale.as_deref(), Some("C.UTF-8"));
    assert_eq!(applied.timezone, None);
    assert_eq!(applied.details["rlimits"]["as"], Value::Null);
    assert!(applied.details["cgroups"].is_object(), "{applied:?}");
    p.delete(&s.id).await.unwrap();
    assert!(matches!(p.applied(&s.id).await, Err(ProviderError::NotFound(_))));
    assert!(matches!(p.applied("../etc").await, Err(ProviderError::NotFound(_))));
}

#[tokio::test]
async fn without_isolation_a_sandbox_reports_rlimits_and_no_cgroup_limits() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    let mut s = spec(&format!("none-applied-{}", std::process::id()), HOST_IMAGE);
    s.resources.memory = Some(Quantity::Text("256Mi".into()));
    ready(&p, &s).await;
    let applied = p.applied(&s.id).await.unwrap();
    assert_eq!((applied.cpu, applied.memory, applied.swap, applied.pids), (None, None, None, None), "{applied:?}");
    assert_eq!(applied.details["rlimits"]["as"], 256 << 20);
    assert_eq!(applied.details["cgroups"], Value::Null);
    assert_eq!(applied.details["isolation"]["mode"], "none");
    p.delete(&s.id).await.unwrap();
}

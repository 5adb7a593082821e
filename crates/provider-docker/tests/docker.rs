//! The Docker provider beyond the conformance suite: an image with no shell, the image's env and
//! workdir, limits and network in the engine, OOM, failed pulls, restarts, deletes that leave
//! nothing, the daemon's lease, and refusals.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    BUSYBOX, MISSING, NOSHELL, State, call, call_raw, containers_with_label, docker, exec, id, inspect, next_event,
    socket_of, static_daemon, wait_healthy,
};
use sandman_provider::conformance::spec;
use sandman_provider::{Endpoint, Provider, ProviderError, SandboxSpec};
use sandman_provider_docker::{DockerConfig, DockerProvider, SANDBOX_LABEL, container_name};
use sandman_wire::server::{Network, Profile, Quantity, Reason};
use serde_json::{Value, json};

async fn ready(p: &DockerProvider, s: &SandboxSpec) -> Endpoint {
    let endpoint = p.create(s).await.unwrap_or_else(|e| panic!("create of {} failed: {e}", s.id));
    wait_healthy(&socket_of(&endpoint)).await.unwrap();
    endpoint
}

async fn sh(endpoint: &Endpoint, token: &str, script: &str) -> Value {
    exec(&socket_of(endpoint), token, &["/bin/sh", "-c", script]).await.unwrap()
}

fn out(v: &Value) -> String {
    v["stdout"].as_str().unwrap().to_string()
}

fn unsupported(res: Result<Endpoint, ProviderError>) -> String {
    match res {
        Err(ProviderError::Unsupported(msg)) => msg,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_without_a_shell_gets_exec_files_and_tar() {
    let state = State::new();
    let p = state.provider().await;
    let s = spec(&id("noshell"), NOSHELL);
    let ep = ready(&p, &s).await;
    let socket = socket_of(&ep);
    let tok = Some(s.token.as_str());

    // The image's entry point (`/hello`) was not run: the daemon is PID 1 and serves.
    let info = call(&socket, "GET", "/v1/info", tok, None).await.unwrap().ok().json();
    assert_eq!(info["pid"], 1, "{info}");
    let hello = exec(&socket, &s.token, &["/hello"]).await.unwrap();
    assert_eq!((hello["exit_code"].clone(), out(&hello)), (json!(0), "hello from noshell\n".to_string()), "{hello}");
    // There is no shell to fall back on.
    let no_sh = call(&socket, "POST", "/v1/exec", tok, Some(json!({"argv": ["/bin/sh", "-c", "true"]}))).await.unwrap();
    assert!(no_sh.status != 200 || no_sh.json()["exit_code"] != 0, "the no-shell image has a shell");

    // Files: write (creating parents), read back, stat.
    let put = call_raw(&socket, "PUT", "/v1/files?path=/data/in/note.txt", tok, None, Bytes::from_static(b"a note\n"));
    put.await.unwrap().ok();
    let got = call(&socket, "GET", "/v1/files?path=/data/in/note.txt", tok, None).await.unwrap().ok();
    assert_eq!(&got.body[..], b"a note\n");

    // Archives: upload a tar, find its files, download the directory as a tar.
    let mut builder = tar::Builder::new(Vec::new());
    for (path, body) in [("src/main.py", &b"print('hi')\n"[..]), ("README", &b"readme\n"[..])] {
        let mut header = tar::Header::new_gnu();
        header.set_size(body.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, path, body).unwrap();
    }
    let archive = builder.into_inner().unwrap();
    call_raw(&socket, "PUT", "/v1/archive?path=/data/repo", tok, Some("application/x-tar"), Bytes::from(archive))
        .await
        .unwrap()
        .ok();
    let main = call(&socket, "GET", "/v1/files?path=/data/repo/src/main.py", tok, None).await.unwrap().ok();
    assert_eq!(&main.body[..], b"print('hi')\n");
    let tarball = call(&socket, "GET", "/v1/archive?path=/data", tok, None).await.unwrap().ok();
    let mut names = Vec::new();
    let mut readme = String::new();
    for entry in tar::Archive::new(&tarball.body[..]).entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().display().to_string();
        if name.ends_with("README") {
            entry.read_to_string(&mut readme).unwrap();
        }
        names.push(name);
    }
    assert!(names.iter().any(|n| n.ends_with("repo/src/main.py")), "{names:?}");
    assert!(names.iter().any(|n| n.ends_with("in/note.txt")), "{names:?}");
    assert_eq!(readme, "readme\n");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_env_and_workdir_are_the_defaults_and_the_token_stays_out_of_inspect() {
    let state = State::new();
    let p = state.provider().await;
    let mut s = spec(&id("env"), BUSYBOX);
    s.env = BTreeMap::from([("FROM_SPEC".into(), "1".into()), ("SANDMAN_TOKEN".into(), "hijack".into())]);
    s.resources.cpu = Some(Quantity::Text("500m".into()));
    s.resources.memory = Some(Quantity::Text("64Mi".into()));
    s.resources.pids = Some(50);
    let ep = ready(&p, &s).await;
    let env = out(&sh(&ep, &s.token, "env; echo cwd=$(pwd)").await);
    assert!(env.contains("FROM_IMAGE=busybox"), "the image's Env is not the default: {env}");
    assert!(env.contains("FROM_SPEC=1"), "{env}");
    assert!(env.contains("cwd=/work"), "the image's WorkingDir is not the default: {env}");
    assert!(!env.contains("SANDMAN_") && !env.contains("hijack"), "{env}");
    let info = call(&socket_of(&ep), "GET", "/v1/info", Some(&s.token), None).await.unwrap().ok().json();
    assert_eq!(info["pid"], 1, "the daemon is not the container's PID 1: {info}");

    let c = inspect(&s.id);
    let text = c.to_string();
    assert!(!text.contains(&s.token), "docker inspect shows the daemon's token");
    let labels = &c["Config"]["Labels"];
    assert_eq!(labels["app.kubernetes.io/managed-by"], "sandman");
    assert_eq!(labels[SANDBOX_LABEL], s.id.as_str());
    assert_eq!(labels["sandman.dev/job"], "conformance-job");
    assert!(labels["sandman.dev/spec"].as_str().unwrap().contains("\"suite\":\"conformance\""), "{labels}");
    let hc = &c["HostConfig"];
    assert_eq!(hc["NanoCpus"], 500_000_000, "{hc}");
    assert_eq!(hc["Memory"], 64 << 20);
    assert_eq!(hc["MemorySwap"], 64 << 20);
    assert_eq!(hc["PidsLimit"], 50);
    assert_eq!(c["Path"], "/.sandman/sandmand");
    let token_file = p.sandbox_dir(&s.id).join("token");
    assert_eq!(std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777, 0o600);
    // The limits hold inside: the container's cgroups (v1 or v2) carry them.
    let cgroup = "cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max \
                  /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null";
    let limits = out(&sh(&ep, &s.token, cgroup).await);
    assert_eq!(limits.split_whitespace().collect::<Vec<_>>(), ["50", &(64u64 << 20).to_string()], "{limits}");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_none_leaves_only_loopback() {
    let state = State::new();
    let p = state.provider().await;
    let interfaces = async |s: &SandboxSpec| {
        let ep = ready(&p, s).await;
        let dev = out(&exec(&socket_of(&ep), &s.token, &["cat", "/proc/net/dev"]).await.unwrap());
        dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(|i| i.trim().to_string()).collect::<Vec<_>>()
    };
    let offline = SandboxSpec { network: Network::None, ..spec(&id("offline"), BUSYBOX) };
    assert_eq!(interfaces(&offline).await, ["lo"]);
    assert_eq!(inspect(&offline.id)["HostConfig"]["NetworkMode"], "none");
    // The default network has more than loopback, so the check above can tell them apart.
    let online = spec(&id("online"), BUSYBOX);
    assert!(interfaces(&online).await.len() > 1);
    p.delete(&offline.id).await.unwrap();
    p.delete(&online.id).await.unwrap();
}

/// What this proves: a command that goes over the sandbox's memory limit ends the sandbox, which
/// is reported `oom_killed` as an event and in the records. The kernel's OOM killer picks the
/// command (the largest process), not the daemon; the provider then kills the container, as
/// Kubernetes does with `memory.oom.group`, so the limit is the sandbox's, not one process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn going_over_the_memory_limit_is_reported_oom_killed() {
    let state = State::new();
    let p = state.provider().await;
    let mut events = p.events().unwrap();
    let mut s = spec(&id("oom"), BUSYBOX);
    s.resources.memory = Some(Quantity::Text("32Mi".into()));
    let ep = ready(&p, &s).await;
    // tail holds all of a newline-free input in memory: 100 MiB against a 32 MiB limit.
    let body = json!({"argv": ["/bin/sh", "-c", "head -c 104857600 /dev/zero | tail"]});
    let answer = call(&socket_of(&ep), "POST", "/v1/exec", Some(&s.token), Some(body)).await;
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::OomKilled, "{event:?} (the exec answered {:?})", answer.map(|r| r.status));
    assert!(event.ended.message.contains("32Mi"), "{event:?}");
    let listed = p.list().await.unwrap().into_iter().find(|r| r.spec.id == s.id).unwrap();
    assert_eq!(listed.ended, Some(event.ended));
    assert_eq!(inspect(&s.id)["State"]["OOMKilled"], true);
    p.delete(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_is_image_pull_failed_within_seconds_and_leaves_nothing() {
    let state = State::new();
    let p = state.provider().await;
    let s = spec(&id("missing"), MISSING);
    let started = Instant::now();
    let res = p.create(&s).await;
    let took = started.elapsed();
    match res {
        Err(ProviderError::Failed { reason: Reason::ImagePullFailed, message }) => {
            assert!(message.contains(MISSING), "{message}");
        }
        other => panic!("expected image_pull_failed, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "the failed pull took {took:?}");
    assert!(p.list().await.unwrap().is_empty());
    assert!(state.containers().is_empty());
    assert!(state.sandbox_dirs().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_provider_finds_its_containers_and_their_deaths() {
    let state = State::new();
    let first = state.provider().await;
    let s = spec(&id("restart"), BUSYBOX);
    let gone = spec(&id("restart-gone"), BUSYBOX);
    let ep = ready(&first, &s).await;
    ready(&first, &gone).await;
    let wrote = sh(&ep, &s.token, "echo kept > /tmp/state").await;
    assert_eq!(wrote["exit_code"], 0);
    // The first server goes away; its containers run on.
    first.shutdown().await;
    drop(first);
    let second = state.provider().await;
    let mut events = second.events().unwrap();
    let mut listed = second.list().await.unwrap();
    listed.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
    assert_eq!(listed.iter().map(|r| r.spec.id.clone()).collect::<Vec<_>>(), [s.id.clone(), gone.id.clone()]);
    assert_eq!(listed[0].spec, s, "the spec (token included) did not survive the restart");
    assert_eq!(listed[0].endpoint, ep);
    assert!(listed.iter().all(|r| r.ended.is_none()));
    let kept = sh(&ep, &s.token, "cat /tmp/state").await;
    assert_eq!(out(&kept), "kept\n");
    // Its one events stream covers the containers it did not create.
    docker(&["kill", &container_name(&s.id)]);
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::ProviderError);
    assert!(event.ended.message.contains("signal 9"), "{event:?}");
    // A container removed behind sandman's back is reported too.
    docker(&["rm", "-f", &container_name(&gone.id)]);
    let event = next_event(&mut events, &gone.id).await;
    assert!(event.ended.message.contains("removed outside sandman"), "{event:?}");
    second.delete(&s.id).await.unwrap();
    second.delete(&gone.id).await.unwrap();
    assert!(second.list().await.unwrap().is_empty());
    assert!(state.sandbox_dirs().is_empty(), "{:?}", state.sandbox_dirs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_left_after_release() {
    let state = State::new();
    let p = state.provider().await;
    let mut events = p.events().unwrap();
    let s = spec(&id("release"), BUSYBOX);
    let ep = ready(&p, &s).await;
    let bg = json!({"argv": ["sleep", "1000"]});
    call(&socket_of(&ep), "POST", "/v1/processes", Some(&s.token), Some(bg)).await.unwrap().ok();
    assert_eq!(containers_with_label(&format!("{SANDBOX_LABEL}={}", s.id)).len(), 1);
    p.delete(&s.id).await.unwrap();
    assert!(containers_with_label(&format!("{SANDBOX_LABEL}={}", s.id)).is_empty(), "the container is left");
    assert!(!p.sandbox_dir(&s.id).exists(), "the host directory is left");
    // A delete is no death: nothing is reported.
    let quiet = tokio::time::timeout(Duration::from_secs(2), events.recv()).await;
    assert!(quiet.is_err(), "a delete was reported as a death: {quiet:?}");
    p.delete(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_daemon_lease_is_reported_as_lease_expired() {
    let state = State::new();
    let p = state.provider().await;
    let mut events = p.events().unwrap();
    let s = SandboxSpec { daemon_lease_s: 1, ..spec(&id("lease"), BUSYBOX) };
    p.create(&s).await.unwrap();
    let event = next_event(&mut events, &s.id).await;
    assert_eq!(event.ended.reason, Reason::LeaseExpired, "{event:?}");
    let listed = p.list().await.unwrap().into_iter().find(|r| r.spec.id == s.id).unwrap();
    assert_eq!(listed.ended, Some(event.ended));
    p.delete(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_clear_and_leave_nothing() {
    let state = State::new();
    let p = state.provider().await;
    let eval = SandboxSpec { profile: Profile::Eval, ..spec(&id("eval"), BUSYBOX) };
    assert!(unsupported(p.create(&eval).await).contains("eval"));
    let mut disk = spec(&id("disk"), BUSYBOX);
    disk.resources.disk = Some(Quantity::Text("1Gi".into()));
    assert!(unsupported(p.create(&disk).await).contains("resources.disk"));
    let mut cpu = spec(&id("cpu"), BUSYBOX);
    cpu.resources.cpu = Some(Quantity::Number(4096.0));
    assert!(unsupported(p.create(&cpu).await).contains("cpus"));
    assert!(unsupported(p.create(&spec("../escape", BUSYBOX)).await).contains("cannot name a container"));
    assert!(p.list().await.unwrap().is_empty());
    assert!(state.sandbox_dirs().is_empty());
    p.delete("never-was").await.unwrap();
    p.delete("../..").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_state_directories_are_left_alone() {
    let (a, b) = (State::new(), State::new());
    let (pa, pb) = (a.provider().await, b.provider().await);
    let s = spec(&id("mine"), BUSYBOX);
    pa.create(&s).await.unwrap();
    assert!(pb.list().await.unwrap().is_empty(), "a provider lists another state directory's containers");
    assert_eq!(pa.list().await.unwrap().len(), 1);
    pa.delete(&s.id).await.unwrap();
}

#[tokio::test]
async fn a_dynamic_daemon_or_no_engine_is_refused_at_start_with_the_way_out() {
    let state = State::new();
    // This test binary is dynamically linked, as a debug `sandmand` is.
    let dynamic = DockerConfig { daemon_bin: std::env::current_exe().unwrap(), ..state.config() };
    let err = DockerProvider::connect(dynamic).await.err().unwrap().to_string();
    assert!(err.contains("dynamically linked") && err.contains("./scripts/build-daemon"), "{err}");
    let nowhere = DockerConfig { docker_host: "unix:///nonexistent/docker.sock".into(), ..state.config() };
    let err = DockerProvider::connect(nowhere).await.err().unwrap().to_string();
    assert!(err.contains("/nonexistent/docker.sock") && err.contains("dockerd"), "{err}");
    assert!(static_daemon().is_file());
}

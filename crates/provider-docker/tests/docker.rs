//! The Docker provider beyond the conformance suite: an image with no shell, the image's env and
//! workdir, limits and network in the engine, the `eval` profile (what is applied, what its daemon
//! observes, loopback only, fixed TZ and locale, the image pinned at create), OOM, failed pulls,
//! restarts, deletes that leave nothing, the daemon's lease, and refusals.
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
use sandman_provider_docker::{DockerConfig, DockerProvider, IMAGE_LABEL, SANDBOX_LABEL, container_name};
use sandman_wire::daemon::Observed;
use sandman_wire::server::{Applied, Network, Profile, Quantity, Reason};
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
    // The token is mounted nowhere, and the copy handed to the daemon is gone once it runs.
    let mounts: Vec<&str> = c["Mounts"].as_array().unwrap().iter().filter_map(|m| m["Destination"].as_str()).collect();
    assert_eq!(mounts.len(), 2, "{mounts:?}");
    assert!(mounts.contains(&"/.sandman/sandmand") && mounts.contains(&"/.sandman/run"), "{mounts:?}");
    assert!(!p.sandbox_dir(&s.id).join("run/token").exists(), "the daemon left the token it was handed");
    assert_eq!(out(&sh(&ep, &s.token, "ls -A /.sandman/run").await), "d.sock\n");
    // An egress sandbox sits on sandman's network, never the engine's default bridge.
    let egress = state.config().egress;
    assert_eq!(hc["NetworkMode"], egress.network.as_str(), "{hc}");
    let net: Value = serde_json::from_str(&docker(&["network", "inspect", &egress.network])).unwrap();
    let options = &net[0]["Options"];
    assert_eq!(options["com.docker.network.bridge.name"], egress.bridge.as_str(), "{net}");
    assert_eq!(options["com.docker.network.bridge.enable_icc"], "false", "{net}");
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
    // Eval without cpu or memory, or with another TZ or locale, is refused by `check`, naming it.
    let mut no_cpu = eval_spec("eval-cpu", BUSYBOX);
    no_cpu.resources.cpu = None;
    let msg = p.check(&no_cpu).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("eval") && msg.contains("resources.cpu"), "{msg}");
    assert!(unsupported(p.create(&no_cpu).await).contains("resources.cpu"));
    let mut no_memory = eval_spec("eval-memory", BUSYBOX);
    no_memory.resources.memory = None;
    let msg = unsupported(p.create(&no_memory).await);
    assert!(msg.contains("resources.memory") && !msg.contains("resources.cpu"), "{msg}");
    let mut tz = eval_spec("eval-tz", BUSYBOX);
    tz.env.insert("TZ".into(), "Asia/Tokyo".into());
    assert!(unsupported(p.create(&tz).await).contains("TZ=Asia/Tokyo"));
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

/// An eval spec with the resources eval requires: half a core and 64 MiB.
fn eval_spec(name: &str, image: &str) -> SandboxSpec {
    let mut s = SandboxSpec { profile: Profile::Eval, ..spec(&id(name), image) };
    s.resources.cpu = Some(Quantity::Text("500m".into()));
    s.resources.memory = Some(Quantity::Text("64Mi".into()));
    s
}

async fn applied(p: &DockerProvider, id: &str) -> Applied {
    p.applied(id).await.unwrap_or_else(|e| panic!("applied of {id}: {e}"))
}

/// What the sandbox's daemon observes from inside (`GET /v1/conditions`).
async fn observed(endpoint: &Endpoint, token: &str) -> Observed {
    let r = call(&socket_of(endpoint), "GET", "/v1/conditions", Some(token), None).await.unwrap().ok();
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("conditions: {e}: {}", String::from_utf8_lossy(&r.body)))
}

/// `docker image inspect`'s ID of `image`: `sha256:…`.
fn image_id(image: &str) -> String {
    docker(&["image", "inspect", "--format", "{{.Id}}", image]).trim().to_string()
}

/// What this proves: an eval sandbox gets the limits asked for (rounded down as the kernel holds
/// them: whole pages of memory, whole microseconds of cpu quota; pids defaulting to 1024; no
/// swap), loopback only although the spec left the network at its default, and TZ=UTC,
/// LANG=LC_ALL=C.UTF-8; the engine reports them through `applied`, and the daemon inside observes
/// exactly the same values from its cgroup, `/proc/net/dev` and environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_sandbox_applies_what_was_asked_and_its_daemon_observes_the_same() {
    let state = State::new();
    let p = state.provider().await;
    let mut s = eval_spec("eval", BUSYBOX);
    // Neither is whole: 100M is 24414.0625 pages, and the quota would be 12345.6789 µs.
    s.resources.memory = Some(Quantity::Text("100M".into()));
    s.resources.cpu = Some(Quantity::Number(0.123456789));
    assert_eq!(s.network, Network::Egress, "the spec should leave the network at its default");
    let ep = ready(&p, &s).await;

    let a = applied(&p, &s.id).await;
    assert_eq!(a.image.as_deref(), Some(image_id(BUSYBOX).as_str()), "{a:?}");
    assert_eq!((a.cpu, a.memory, a.swap, a.pids), (Some(0.12345), Some(99_999_744), Some(0), Some(1024)), "{a:?}");
    assert_eq!(a.network.as_deref(), Some("none"));
    assert_eq!((a.timezone.as_deref(), a.locale.as_deref()), (Some("UTC"), Some("C.UTF-8")));
    let hc = &a.details["HostConfig"];
    assert_eq!((hc["NanoCpus"].clone(), hc["Memory"].clone()), (json!(123_450_000), json!(99_999_744)), "{hc}");
    assert_eq!((hc["MemorySwap"].clone(), hc["PidsLimit"].clone()), (json!(99_999_744), json!(1024)), "{hc}");
    assert_eq!(hc["NetworkMode"], "none");
    assert_eq!(a.details["Config"]["Image"], json!(a.image), "the container is not made from the image ID");
    assert_eq!(a.details["ImageReference"], BUSYBOX);

    let o = observed(&ep, &s.token).await;
    assert_eq!(o.cgroup_cpu_limit, a.cpu, "{o:?}");
    assert_eq!(o.cgroup_memory_limit, a.memory, "{o:?}");
    assert_eq!(o.cgroup_pids_limit, a.pids, "{o:?}");
    assert_eq!(o.network_interfaces, ["lo"], "{o:?}");
    assert_eq!((o.timezone.as_deref(), o.locale.as_deref()), (a.timezone.as_deref(), a.locale.as_deref()));
    // Swap beyond memory: none, as the daemon reads it (v1 `memory.memsw.limit_in_bytes` less
    // `memory.limit_in_bytes`, or v2 `memory.swap.max`) and as the cgroup files say themselves.
    assert_eq!(o.cgroup_swap_limit, a.swap, "{o:?}");
    let cgroup = "if [ -e /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes ]; then \
                  echo $(( $(cat /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes) \
                  - $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes) )); \
                  else cat /sys/fs/cgroup/memory.swap.max; fi";
    assert_eq!(out(&sh(&ep, &s.token, cgroup).await).trim(), "0", "the sandbox may swap");

    // Every command's environment: the fixed TZ and locale, the image's own, nothing of the host's
    // (the test runs under cargo, whose CARGO_* it would show); its working directory is fresh.
    let env = out(&sh(&ep, &s.token, "env; echo cwd=$(pwd) files=$(ls -A | wc -l); date +%Z").await);
    for fixed in ["TZ=UTC", "LANG=C.UTF-8", "LC_ALL=C.UTF-8", "FROM_IMAGE=busybox", "CONFORMANCE=yes"] {
        assert!(env.lines().any(|l| l == fixed), "no {fixed} in {env}");
    }
    assert!(!env.contains("CARGO_") && !env.contains("SANDMAN_"), "{env}");
    assert!(env.contains("cwd=/work files=0\nUTC\n"), "{env}");
    p.delete(&s.id).await.unwrap();
    assert!(matches!(p.applied(&s.id).await, Err(ProviderError::NotFound(_))), "applied of a deleted sandbox");
}

/// What this proves: an eval sandbox has loopback only: `lo` is its one interface and has no
/// route out, so a connect to another address fails at once (no packet is sent: there is no
/// route), while a server on 127.0.0.1 answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_sandbox_has_loopback_and_nothing_else() {
    let state = State::new();
    let p = state.provider().await;
    let s = eval_spec("eval-net", BUSYBOX);
    let ep = ready(&p, &s).await;
    let dev = out(&exec(&socket_of(&ep), &s.token, &["cat", "/proc/net/dev"]).await.unwrap());
    let interfaces: Vec<_> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(interfaces, ["lo"], "{dev}");
    assert_eq!(out(&sh(&ep, &s.token, "ip route; ip -6 route").await), "", "a route beyond loopback");
    // 192.0.2.1 is TEST-NET-1 (documentation only); with no route the kernel refuses the connect.
    let away = sh(&ep, &s.token, "nc -w 2 192.0.2.1 80 </dev/null").await;
    assert_ne!(away["exit_code"], 0, "{away}");
    assert!(away["stderr"].as_str().unwrap().contains("unreachable"), "{away}");
    let local = "mkdir -p /tmp/www && echo here > /tmp/www/x && httpd -p 127.0.0.1:8080 -h /tmp/www && \
                 for i in $(seq 100); do wget -q -O- http://127.0.0.1:8080/x && exit 0; sleep 0.05; done; exit 1";
    let served = sh(&ep, &s.token, local).await;
    assert_eq!((served["exit_code"].clone(), out(&served)), (json!(0), "here\n".to_string()), "{served}");
    p.delete(&s.id).await.unwrap();
}

/// Removes a test tag however the test ends.
struct Tag(String);

impl Drop for Tag {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker").args(["rmi", &self.0]).output();
    }
}

/// What this proves: a sandbox runs the image its reference named at create, and says so: after
/// the tag is moved to another image, the running sandbox still has the first image's files and
/// `applied` still names the first image's ID, while a sandbox created from the tag now gets the
/// second (so the tag did move). The container is made from the ID, with the reference in a label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_moved_after_create_changes_nothing_for_a_running_sandbox() {
    let state = State::new();
    let p = state.provider().await;
    let tag = Tag(format!("sandman-test/repoint-{}:latest", std::process::id()));
    docker(&["tag", BUSYBOX, &tag.0]);
    let (first, second) = (image_id(BUSYBOX), image_id(NOSHELL));
    assert_ne!(first, second);

    let s = eval_spec("pinned", &tag.0);
    let ep = ready(&p, &s).await;
    let c = inspect(&s.id);
    assert_eq!((c["Image"].clone(), c["Config"]["Image"].clone()), (json!(first), json!(first)), "{c}");
    assert_eq!(c["Config"]["Labels"][IMAGE_LABEL], tag.0.as_str());
    assert_eq!(applied(&p, &s.id).await.image, Some(first.clone()));

    docker(&["tag", NOSHELL, &tag.0]);
    assert_eq!(image_id(&tag.0), second);
    let still = exec(&socket_of(&ep), &s.token, &["/bin/busybox", "echo", "still busybox"]).await.unwrap();
    assert_eq!(out(&still), "still busybox\n", "{still}");
    assert_eq!(applied(&p, &s.id).await.image, Some(first), "the record follows the moved tag");

    // A sandbox created now (default profile) gets what the tag names now, pinned the same way.
    let later = spec(&id("pinned-later"), &tag.0);
    let later_ep = ready(&p, &later).await;
    let hello = exec(&socket_of(&later_ep), &later.token, &["/hello"]).await.unwrap();
    assert_eq!(out(&hello), "hello from noshell\n", "{hello}");
    assert_eq!(applied(&p, &later.id).await.image, Some(second.clone()));
    assert_eq!(inspect(&later.id)["Config"]["Image"], second.as_str());
    p.delete(&s.id).await.unwrap();
    p.delete(&later.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_reports_what_a_default_sandbox_got_and_not_found_for_others() {
    let (state, other) = (State::new(), State::new());
    let p = state.provider().await;
    let mut s = spec(&id("applied-default"), BUSYBOX);
    s.resources.memory = Some(Quantity::Text("64Mi".into()));
    p.create(&s).await.unwrap();
    let a = applied(&p, &s.id).await;
    assert_eq!(a.image, Some(image_id(BUSYBOX)));
    assert_eq!((a.cpu, a.memory, a.swap, a.pids), (None, Some(64 << 20), Some(0), None), "{a:?}");
    assert_eq!((a.network.as_deref(), a.timezone.as_deref(), a.locale.as_deref()), (Some("egress"), None, None));
    assert!(matches!(p.applied("never-was").await, Err(ProviderError::NotFound(_))));
    // Another state directory's provider does not own the container.
    let q = other.provider().await;
    assert!(matches!(q.applied(&s.id).await, Err(ProviderError::NotFound(_))));
    p.delete(&s.id).await.unwrap();
}

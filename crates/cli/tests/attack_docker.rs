//! The attack suite of the docker provider: from inside real containers of `sandman serve
//! --provider docker` (as root, beside the engine, as CI runs), each test does what a hostile
//! tenant did and checks that it now reaches nothing. Named after what broke. They need a running
//! engine and the static daemon, as `docker_e2e.rs` does, and a C compiler with a static libc
//! (`scripts/test-images` needs the same) for the tenant's relay.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use e2e::docker::{Cleanup, require_docker, static_daemon};
use e2e::tenant::{all_refused, codes, sandbox, sh, stdout};
use e2e::{Body, Http, Server, eventually};
use sandman_testkit::{Spawned, require_root};
use serde_json::{Value, json};

const BUSYBOX: &str = "sandman-test/busybox:latest";

fn start(state: &Path, extra: &[&str]) -> Server {
    let daemon = static_daemon().display().to_string();
    let mut args = vec!["--provider", "docker", "--daemon", &daemon];
    args.extend(extra);
    Server::start_in(state, &args)
}

/// The tenant's relay (`fixtures/relay.c`), built static in `dir`.
fn relay(dir: &Path) -> Vec<u8> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/relay.c");
    let bin = dir.join("relay");
    let out = Command::new("gcc").args(["-static", "-O2", "-o"]).arg(&bin).arg(&source).output();
    let out = out.unwrap_or_else(|e| panic!("gcc (apt-get install gcc libc6-dev): {e}"));
    assert!(out.status.success(), "gcc: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::read(&bin).unwrap()
}

/// Has the sandbox's own root move its daemon's socket aside and serve `argv` on its path.
async fn take_the_socket(http: &Http, id: &str, argv: &[&str]) {
    let moved = sh(http, id, None, "mv /.sandman/run/d.sock /.sandman/run/real.sock && echo moved").await;
    assert_eq!(stdout(&moved), "moved\n", "{moved}");
    let started = http.post(&format!("/v1/sandboxes/{id}/processes"), json!({"argv": argv, "tag": "impostor"})).await;
    assert_eq!(started.status, 201, "{}", String::from_utf8_lossy(&started.body));
    // It listens once the socket is back at its path.
    let listening =
        sh(http, id, None, "for i in $(seq 100); do test -S /.sandman/run/d.sock && exit 0; sleep 0.05; done; exit 1");
    assert_eq!(listening.await["exit_code"], 0, "the impostor never listened");
}

/// Waits until sandbox `id` has ended, and answers it.
async fn ended(http: &Http, id: &str) -> Value {
    let path = format!("/v1/sandboxes/{id}");
    let done = eventually(Duration::from_secs(30), async || {
        let v: Value = http.get(&path).await.json();
        v["state"] == "failed" || v["state"] == "gone"
    })
    .await;
    let v: Value = http.get(&path).await.json();
    assert!(done, "the sandbox whose daemon was replaced is still {}: {v}", v["state"]);
    v
}

/// Before, an eval sandbox's record was taken at readiness and kept in memory only: after a
/// server restart it was taken again from whatever answered at the daemon's address. A tenant
/// that moved the daemon's socket aside and served its own (here a relay to the real one, which
/// reads everything the server sends) got a record of its making signed, `sandman verify` said
/// `valid`, and every later call, token included, went through it. Now the record taken before
/// anything ran is kept in the state directory and served unchanged after a restart; the restarted
/// server's first new connection meets the relay, whose daemon gives no proof to a process of its
/// own sandbox, and the sandbox ends `daemon_untrusted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_never_takes_a_record_again_from_a_daemon_that_ran_tenant_code() {
    require_root();
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let mut server = start(&state, &[]);
    let http = server.client();
    let resources = json!({"cpu": "500m", "memory": "64Mi"});
    let id = sandbox(&http, json!({"image": BUSYBOX, "profile": "eval", "resources": resources})).await;
    let record = http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok();
    assert_eq!(record["record"]["observed"]["pid1"], true, "{record}");

    let relay = relay(dir.path());
    let path = format!("/v1/sandboxes/{id}/files?path=%2Ftmp%2Frelay&mode=755");
    assert_eq!(http.call("PUT", &path, Body::Octets(relay)).await.status, 200);
    take_the_socket(&http, &id, &["/tmp/relay", "/.sandman/run/d.sock", "/.sandman/run/real.sock", "/tmp/seen"]).await;

    server.kill9();
    let server = start(&state, &[]);
    let http = server.client();
    let after = http.get(&format!("/v1/sandboxes/{id}/conditions")).await;
    let kept = after.json();
    assert_eq!(kept, record, "the record served after the restart is not the one taken at readiness");
    let file = dir.path().join("record.json");
    std::fs::write(&file, serde_json::to_vec(&kept).unwrap()).unwrap();
    let (code, out, err) = e2e::cli(&server, &["verify", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("valid"), "{out}");
    let v = ended(&http, &id).await;
    assert_eq!((v["state"].as_str(), v["reason"].as_str()), (Some("failed"), Some("daemon_untrusted")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("outside the sandbox"), "{v}");
    // Still the same record once it has ended, and an event says why it did.
    assert_eq!(http.get(&format!("/v1/sandboxes/{id}/conditions")).await.json(), record);
    let events = http.get("/v1/events?after=0").await.ok();
    let untrusted = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["sandbox"] == id.as_str() && e["reason"] == "daemon_untrusted");
    assert!(untrusted, "no event says why: {events}");
}

/// Before, the daemon's token was bind-mounted at `/.sandman/token`, readable by the
/// container's root, and the server sent it on every call to whatever answered at the daemon's
/// socket. Now the daemon takes its token from a file it removes as it starts, is undumpable as
/// the container's init (its environment, memory and descriptors in /proc are closed to the
/// container's root, who has no CAP_SYS_PTRACE), and every new connection of the server's must
/// prove the token before anything is sent: a daemon of the tenant's own on the socket's path
/// (the static `sandmand` every container has, with the best token the tenant could find) fails
/// the proof, the call answers `gone (daemon_untrusted)`, and the sandbox ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_put_in_the_real_ones_place_gets_no_token_and_ends_the_sandbox() {
    require_root();
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let server = start(&state, &[]);
    let http = server.client();
    let id = sandbox(&http, json!({"image": BUSYBOX})).await;
    let token = std::fs::read_to_string(state.join("docker").join(&id).join("token")).unwrap();
    assert!(token.len() >= 32, "{token}");

    // Nowhere the tenant looks, as the container's root or as nobody.
    for user in [None, Some("65534")] {
        let found = codes(
            &http,
            &id,
            user,
            &format!(
                "cat /.sandman/token >/dev/null; echo token=$?; cat /.sandman/run/token >/dev/null; echo handed-over=$?; \
                 cat /proc/1/environ >/dev/null; echo environ=$?; head -c 1 /proc/1/mem >/dev/null; echo mem=$?; \
                 readlink /proc/1/fd/0; echo fds=$?; cat /proc/1/maps >/dev/null; echo maps=$?; \
                 ls /proc/1/root/ >/dev/null; echo root=$?; \
                 grep -qF {token} /proc/1/cmdline; echo cmdline=$?; \
                 cd / && test -n \"$(grep -rlF {token} $(ls -A / | grep -v -x -e proc -e sys -e dev) 2>/dev/null)\"; echo files=$?; \
                 test -n \"$(grep -lF {token} /proc/[0-9]*/environ 2>/dev/null)\"; echo environs=$?"
            ),
        )
        .await;
        all_refused(&format!("the token, as {user:?}"), &found);
    }
    // The static daemon every container has, on the socket's path, with what the tenant found.
    take_the_socket(
        &http,
        &id,
        &[
            "/bin/sh",
            "-c",
            "T=$(cat /.sandman/token /.sandman/run/token 2>/dev/null || echo a-guess); echo \"$T\" > /tmp/t; \
         exec /.sandman/sandmand --listen unix:/.sandman/run/d.sock --token-file /tmp/t --workdir /",
        ],
    )
    .await;

    // Calls at once: those past the connection the server keeps open need new ones, which meet
    // the impostor.
    let calls = (0..4).map(|_| {
        let http = http.clone();
        let id = id.clone();
        async move { http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["sleep", "1"]})).await }
    });
    let answers = futures_util::future::join_all(calls).await;
    let untrusted: Vec<&e2e::Resp> = answers.iter().filter(|r| r.status == 410).collect();
    assert!(
        !untrusted.is_empty(),
        "every call went through: {:?}",
        answers.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert_eq!(untrusted[0].json()["error"]["reason"], "daemon_untrusted", "{}", untrusted[0].json());
    let v = ended(&http, &id).await;
    assert_eq!((v["state"].as_str(), v["reason"].as_str()), (Some("failed"), Some("daemon_untrusted")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("does not hold the sandbox's token"), "{v}");
    // Every later call answers the same, and nothing is left of it.
    let later = http.post(&format!("/v1/sandboxes/{id}/exec"), json!({"argv": ["true"]})).await;
    assert_eq!(later.error(410, "gone")["reason"], "daemon_untrusted");
    assert!(e2e::docker::containers_of(&id).is_empty(), "the untrusted sandbox's container is left");
}

/// A network namespace standing in for the internet, with a veth to the host: an address of
/// TEST-NET-2 (198.51.100.0/24, a /30 of this test's own), and a private and a link-local one
/// routed to it from the host, each serving HTTP on `port`. Removed (namespace, veth, routes,
/// server) however the test ends.
struct Internet {
    ns: String,
    veth: String,
    routes: Vec<String>,
    public: String,
    private: String,
    link_local: String,
    port: u16,
    _server: Option<Spawned>,
}

impl Internet {
    fn new(files: &Path) -> Internet {
        let pid = std::process::id();
        let slot = pid % 64;
        let base = slot * 4;
        let (host, ns) = (format!("198.51.100.{}", base + 1), format!("198.51.100.{}", base + 2));
        let mut net = Internet {
            ns: format!("sandman-inet-{pid}"),
            veth: format!("smi{pid}h"),
            routes: Vec::new(),
            public: ns.clone(),
            private: format!("10.213.{slot}.2"),
            link_local: format!("169.254.213.{}", slot + 1),
            port: 18080,
            _server: None,
        };
        let peer = format!("smi{pid}n");
        let ip = |args: &[&str]| {
            let out = Command::new("ip").args(args).output().unwrap();
            assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        ip(&["netns", "add", &net.ns]);
        ip(&["link", "add", &net.veth, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &net.ns]);
        ip(&["addr", "add", &format!("{host}/30"), "dev", &net.veth]);
        ip(&["link", "set", &net.veth, "up"]);
        let inside = |args: &[&str]| ip(&[&["netns", "exec", &net.ns, "ip"], args].concat());
        inside(&["link", "set", "lo", "up"]);
        inside(&["addr", "add", &format!("{ns}/30"), "dev", &peer]);
        inside(&["addr", "add", &format!("{}/32", net.private), "dev", &peer]);
        inside(&["addr", "add", &format!("{}/32", net.link_local), "dev", &peer]);
        inside(&["link", "set", &peer, "up"]);
        for addr in [net.private.clone(), net.link_local.clone()] {
            ip(&["route", "add", &format!("{addr}/32"), "dev", &net.veth]);
            net.routes.push(addr);
        }
        std::fs::write(files.join("hello"), "hello from the stand-in internet\n").unwrap();
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &net.ns,
            "python3",
            "-m",
            "http.server",
            &net.port.to_string(),
            "--bind",
            "0.0.0.0",
        ])
        .current_dir(files);
        net._server = Some(Spawned::spawn("stand-in-internet", &mut cmd, &e2e::scratch()));
        net
    }

    fn url(&self, addr: &str) -> String {
        format!("http://{addr}:{}/hello", self.port)
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        self._server = None;
        for addr in &self.routes {
            let _ = Command::new("ip").args(["route", "del", &format!("{addr}/32")]).output();
        }
        let _ = Command::new("ip").args(["link", "del", &self.veth]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// The host's address on its default route (not loopback).
fn host_address() -> String {
    let out = Command::new("ip").args(["-4", "route", "get", "1.1.1.1"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "src" {
            return words.next().unwrap().to_string();
        }
    }
    panic!("no source address in `ip route get`: {text}")
}

/// Before, docker sandboxes with `network: egress` sat on the engine's default bridge: they
/// reached the host's services (the server's own port among them), the private ranges and the
/// cloud's metadata address. Now they sit on sandman's own bridge, and the host firewall refuses
/// all of that at once (admin-prohibited), while the internet (a stand-in here) answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_egress_reaches_the_internet_and_not_the_host_or_private_ranges() {
    require_root();
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let files = dir.path().join("www");
    std::fs::create_dir(&files).unwrap();
    let net = Internet::new(&files);
    // A service of the host's own, on its address, and the server on every address.
    let host = host_address();
    let service = std::net::TcpListener::bind((host.as_str(), 0)).unwrap();
    let service_port = service.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in service.incoming().flatten() {
            let mut conn = conn;
            let _ = std::io::Write::write_all(&mut conn, b"HTTP/1.0 200 OK\r\n\r\nthe host's service\n");
        }
    });
    let server = start(&state, &["--listen", "0.0.0.0:0"]);
    let server_port = server.addr.rsplit(':').next().unwrap().to_string();
    let http = server.client();
    let id = sandbox(&http, json!({"image": BUSYBOX})).await;
    let info = http.get(&format!("/v1/sandboxes/{id}")).await.ok();
    assert_eq!(info["network"], "egress", "{info}");

    // busybox's own `-T` crashes it (1.35, static): the shell's timeout instead.
    let fetch = |url: String| format!("timeout 5 wget -q -O - {url}");
    let out = sh(&http, &id, None, &fetch(net.url(&net.public))).await;
    assert_eq!(stdout(&out), "hello from the stand-in internet\n", "the internet does not answer: {out}");
    let gateway = "$(ip route | awk '/^default/ {print $3}')";
    for user in [None, Some("65534")] {
        let c = codes(
            &http,
            &id,
            user,
            &[
                format!("{} >/dev/null; echo host-service=$?", fetch(format!("http://{host}:{service_port}/"))),
                format!("{} >/dev/null; echo server-port=$?", fetch(format!("http://{host}:{server_port}/healthz"))),
                format!("{} >/dev/null; echo gateway=$?", fetch(format!("http://{gateway}:{server_port}/healthz"))),
                format!("{} >/dev/null; echo private=$?", fetch(net.url(&net.private))),
                format!("{} >/dev/null; echo link-local=$?", fetch(net.url(&net.link_local))),
            ]
            .join("; "),
        )
        .await;
        all_refused(&format!("egress as {user:?}"), &c);
    }
    // Refused, not left to time out: each fails at once.
    let started = std::time::Instant::now();
    let out = sh(&http, &id, None, &format!("{} 2>&1; true", fetch(net.url(&net.private)))).await;
    assert!(started.elapsed() < Duration::from_secs(4), "the refusal took {:?}: {out}", started.elapsed());
    http.release(&id).await.ok();
}

/// The firewall is installed on the engine's host by a root server; where it cannot be, the
/// server refuses to start, naming the way out, and runs unfiltered only when told.
#[test]
fn a_server_that_cannot_filter_egress_refuses_to_start_unless_told_unfiltered() {
    require_docker();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let serve = |extra: &[&str]| {
        let out = Command::new(e2e::sandman_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--provider", "docker", "--state-dir"])
            .arg(dir.path())
            .arg("--daemon")
            .arg(static_daemon())
            .args(extra)
            .env("SANDMAN_TOKEN", e2e::TOKEN)
            // An engine elsewhere: no firewall of this host's holds its containers.
            .env("DOCKER_HOST", "tcp://192.0.2.99:2375")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let refused = serve(&[]);
    assert!(refused.contains("not on this host") && refused.contains("--docker-egress unfiltered"), "{refused}");
    // Told, it goes on (to find no engine there).
    let told = serve(&["--docker-egress", "unfiltered"]);
    assert!(told.contains("cannot reach the docker engine") && !told.contains("--docker-egress"), "{told}");
}

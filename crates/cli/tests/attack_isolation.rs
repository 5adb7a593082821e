//! The attack suite of the embedded default: from inside real sandboxes of `sandman serve` on the
//! process provider (as root, as CI runs), as the sandbox's root and as an unprivileged user,
//! each test tries what a hostile tenant tried and was able to do, and checks that it does no
//! harm. Named after what broke.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e::tenant::{all_refused, codes, sandbox, sh, stdout};
use e2e::{Server, eventually, scratch};
use sandman_testkit::require_root;
use serde_json::json;

/// The users every attack runs as: the sandbox's root, and an unprivileged one.
const USERS: [Option<&str>; 2] = [None, Some("nobody")];

fn sandbox_dir(server: &Server, id: &str) -> PathBuf {
    server.state.join("sandboxes").join(id)
}

/// The host pid of a sandbox's init: the one child of the waiter its `daemon.pid` names.
fn init_of(server: &Server, id: &str) -> i32 {
    let waiter = std::fs::read_to_string(sandbox_dir(server, id).join("daemon.pid")).unwrap();
    let waiter = waiter.split_whitespace().next().unwrap();
    let children = std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children")).unwrap();
    children.split_whitespace().next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_is_no_longer_root_on_the_host() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host"})).await;
    // Root inside, with the capabilities a container runtime gives and no more.
    let out = sh(&http, &id, None, "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; echo x > mine").await;
    let text = stdout(&out);
    assert!(text.starts_with("0\n"), "{out}");
    let eff = text.lines().find(|l| l.starts_with("CapEff")).unwrap().split_whitespace().nth(1).unwrap();
    let caps = u64::from_str_radix(eff, 16).unwrap();
    for (cap, name) in [(21, "SYS_ADMIN"), (19, "SYS_PTRACE"), (16, "SYS_MODULE"), (12, "NET_ADMIN"), (17, "SYS_RAWIO")]
    {
        assert_eq!(caps & (1 << cap), 0, "CAP_{name} is effective inside: {text}");
    }
    assert!(text.contains("NoNewPrivs:\t1"), "{text}");
    // Seen from the host, that root is an unprivileged id of its own.
    let file = PathBuf::from(format!("/proc/{}/root/home/user/mine", init_of(&server, &id)));
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&file).unwrap());
    assert!(owner >= 0x2000_0000, "a file the sandbox's root wrote belongs to host uid {owner}");
    let health = http.get("/healthz").await.ok();
    assert_eq!(health["isolation"], "user_namespace", "{health}");
    assert_eq!(http.get(&format!("/v1/sandboxes/{id}")).await.ok()["isolation"], "user_namespace");
    http.release(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hosts_file_system_is_neither_writable_nor_its_secrets_readable() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host"})).await;
    let marker = format!("sandman-attack-{}", std::process::id());
    for user in USERS {
        let c = codes(
            &http,
            &id,
            user,
            &format!(
                "echo x > /etc/{marker}; echo etc=$?; echo x > /usr/bin/{marker}; echo usr=$?; \
                 cat /etc/shadow > /dev/null; echo shadow=$?; ls /root > /dev/null; echo root=$?; \
                 chmod 777 /etc/passwd; echo chmod=$?; mount -t tmpfs t /mnt; echo mount=$?; \
                 unshare -U true; echo userns=$?; dmesg > /dev/null; echo dmesg=$?"
            ),
        )
        .await;
        all_refused(&format!("as {user:?}"), &c);
    }
    assert!(!Path::new("/etc").join(&marker).exists() && !Path::new("/usr/bin").join(&marker).exists());
    // Writes outside the host's view stay in the sandbox's own layer.
    let out =
        sh(&http, &id, None, &format!("mkdir -p /{marker}/d && echo mine > /{marker}/d/f && cat /{marker}/d/f")).await;
    assert_eq!(stdout(&out), "mine\n", "{out}");
    assert!(!Path::new("/").join(&marker).exists(), "a write reached the host's root");
    http.release(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rm_rf_root_in_a_sandbox_harms_only_that_sandbox() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let victim = sandbox(&http, json!({"image": "host"})).await;
    let other = sandbox(&http, json!({"image": "host"})).await;
    assert_eq!(stdout(&sh(&http, &other, None, "echo keep > kept").await), "");
    let sentinel = scratch().join(format!("attack-sentinel-{}", std::process::id()));
    std::fs::write(&sentinel, "still here").unwrap();
    let token_file = server.state.join("sandboxes").join(&other).join("token");
    let before = std::fs::read(&token_file).unwrap();
    // Bounded: the walk of the whole host tree (where nearly every unlink fails) is what takes time.
    let _ = sh(&http, &victim, None, "timeout 60 rm -rf --no-preserve-root / 2>/dev/null; echo done").await;
    assert_eq!(std::fs::read_to_string(&sentinel).unwrap(), "still here");
    assert_eq!(std::fs::read(&token_file).unwrap(), before);
    for path in ["/etc/passwd", "/usr/bin/env", "/bin/sh"] {
        assert!(Path::new(path).exists(), "{path} is gone from the host");
    }
    assert_eq!(stdout(&sh(&http, &other, None, "cat kept").await), "keep\n", "the other sandbox was harmed");
    assert_eq!(http.get("/healthz").await.status, 200);
    std::fs::remove_file(&sentinel).unwrap();
    http.release(&victim).await;
    http.release(&other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_sandboxs_token_record_files_and_socket_are_out_of_reach() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let target = sandbox(&http, json!({"image": "host"})).await;
    sh(&http, &target, None, "echo secret-work > work-file").await;
    let dir = sandbox_dir(&server, &target);
    for network in ["egress", "none"] {
        let attacker = sandbox(&http, json!({"image": "host", "network": network})).await;
        for user in USERS {
            let c = codes(
                &http,
                &attacker,
                user,
                &format!(
                    "cat {d}/token; echo token=$?; cat {d}/record.json; echo record=$?; cat {d}/work/work-file; echo work=$?; \
                     ls {d}/; test -n \"$(ls -A {d} 2>/dev/null)\"; echo listed=$?; \
                     python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])' {d}/d.sock 2>/dev/null; echo socket=$?",
                    d = dir.display()
                ),
            )
            .await;
            all_refused(&format!("{network} as {user:?}"), &c);
        }
        http.release(&attacker).await;
    }
    http.release(&target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_token_key_and_process_are_out_of_reach() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host"})).await;
    // The server wrote its key and files into its state directory; a token file too, when it
    // makes one (here it is given in its environment).
    std::fs::write(server.state.join("token"), "a-token-file").unwrap();
    let key = server.state.join("conditions.key");
    assert!(key.exists() || http.get(&format!("/v1/sandboxes/{id}/conditions")).await.status == 200);
    let server_pid = server.pid();
    for user in USERS {
        let c = codes(
            &http,
            &id,
            user,
            &format!(
                "cat {s}/token; echo token=$?; cat {s}/conditions.key; echo key=$?; \
                 ls -A {s}/sandboxes/{id}; echo own-dir=$?; ls -A {s}; echo state-dir=$?; \
                 cat /proc/{pid}/environ; echo environ=$?; ls /proc/{pid}; echo proc=$?; \
                 test $(ls /proc | grep -c '^[0-9]') -lt 10; echo few=$((1 - $?))",
                s = server.state.display(),
                pid = server_pid,
            ),
        )
        .await;
        all_refused(&format!("as {user:?}"), &c);
    }
    // A record signed by someone who could not read the key does not verify.
    let signed = http.get(&format!("/v1/sandboxes/{id}/conditions")).await.ok();
    let mut forged = signed.clone();
    forged["record"]["applied"]["memory"] = json!(1);
    forged["signature"] = json!(format!("hmac-sha256:{}", "00".repeat(32)));
    assert_eq!(http.post("/v1/verify", forged).await.ok()["valid"], false);
    assert_eq!(http.post("/v1/verify", signed).await.ok()["valid"], true);
    http.release(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_and_server_binaries_cannot_be_replaced_or_read() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host"})).await;
    let daemon = e2e::sandman_bin().parent().unwrap().join("sandmand");
    let server_bin = e2e::sandman_bin();
    let hash = |p: &Path| std::fs::read(p).map(|b| b.len()).unwrap_or(0);
    let (daemon_len, server_len) = (hash(&daemon), hash(&server_bin));
    assert!(daemon_len > 0 && server_len > 0);
    for user in USERS {
        let c = codes(
            &http,
            &id,
            user,
            &format!(
                "cp /bin/sh {d} 2>/dev/null; echo cp=$?; echo x 2>/dev/null >> {d}; echo append=$?; \
                 test -s {d}; echo daemon-readable=$?; test -s {s}; echo server-readable=$?",
                d = daemon.display(),
                s = server_bin.display()
            ),
        )
        .await;
        // `test -s` succeeds (0) only when the file has content: hidden, it is empty.
        all_refused(&format!("as {user:?}"), &c);
    }
    assert_eq!((hash(&daemon), hash(&server_bin)), (daemon_len, server_len), "a binary changed");
    // The next create still runs the real daemon.
    let next = sandbox(&http, json!({"image": "host"})).await;
    assert_eq!(stdout(&sh(&http, &next, None, "echo fine").await), "fine\n");
    http.release(&id).await;
    http.release(&next).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_sandbox_cannot_leave_its_pids_cgroup() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(
        &http,
        json!({"image": "host", "profile": "eval", "resources": {"cpu": 1, "memory": "256Mi", "pids": 30}}),
    )
    .await;
    for user in USERS {
        let c = codes(
            &http,
            &id,
            user,
            "for f in /sys/fs/cgroup/pids/cgroup.procs /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/pids/../cgroup.procs; do \
               echo $$ > $f 2>/dev/null; echo $f=$?; done; \
             mkdir /sys/fs/cgroup/pids/escape; echo mkdir=$?",
        )
        .await;
        all_refused(&format!("as {user:?}"), &c);
    }
    // Still held: the 31st process cannot start.
    let bomb = sh(&http, &id, None, "for i in $(seq 40); do sleep 20 & done; wait").await;
    let said = format!("{}{}", stdout(&bomb), bomb["stderr"].as_str().unwrap_or_default());
    assert!(said.contains("fork") || said.contains("Resource temporarily unavailable"), "{bomb}");
    http.release(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ld_preload_in_a_create_never_reaches_the_daemon() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host", "env": {"LD_PRELOAD": "/nonexistent/evil.so", "MARK": "1"}})).await;
    // The commands get it (it is their environment)...
    let out = sh(&http, &id, None, "echo $LD_PRELOAD $MARK").await;
    assert!(stdout(&out).starts_with("/nonexistent/evil.so 1"), "{out}");
    // ...the daemon and its waiter, outside the sandbox, never do.
    let dir = sandbox_dir(&server, &id);
    let pid: i32 =
        std::fs::read_to_string(dir.join("daemon.pid")).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    for p in std::iter::once(pid).chain(children.split_whitespace().map(|c| c.parse().unwrap())) {
        let environ = std::fs::read(format!("/proc/{p}/environ")).unwrap();
        let text = String::from_utf8_lossy(&environ);
        assert!(
            !text.contains("LD_PRELOAD") && !text.contains("MARK="),
            "pid {p} has the request's environment: {text}"
        );
    }
    http.release(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_directory_under_tmp_still_isolates() {
    require_root();
    let dir = tempfile::Builder::new().prefix("sandman-attack").tempdir_in("/tmp").unwrap();
    let state = dir.path().join("state");
    let server = Server::start_in(&state, &[]);
    let http = server.client();
    assert_eq!(http.get("/healthz").await.ok()["isolation"], "user_namespace");
    let a = sandbox(&http, json!({"image": "host"})).await;
    let b = sandbox(&http, json!({"image": "host"})).await;
    // Parallel episodes writing the same /tmp path do not see each other.
    sh(&http, &a, None, "echo a > /tmp/episode").await;
    sh(&http, &b, None, "echo b > /tmp/episode").await;
    assert_eq!(stdout(&sh(&http, &a, None, "cat /tmp/episode").await), "a\n");
    let c = codes(&http, &a, None, &format!("cat {}/sandboxes/{b}/token; echo token=$?", state.display())).await;
    all_refused("state under /tmp", &c);
    http.release(&a).await;
    http.release(&b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_cannot_isolate_refuses_to_start_unless_told_none() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    // Open to the unprivileged user the server runs as here.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let state = dir.path().join("state");
    let run = |extra: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
            .arg(e2e::sandman_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(&state)
            .args(extra)
            .env("SANDMAN_TOKEN", "t")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("setpriv (util-linux) is needed")
    };
    let out = run(&[]).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot isolate") && err.contains("--isolation none"), "{err}");
    // Told so by name, it starts, and says what it is.
    let mut child = run(&["--isolation", "none"]);
    let stderr = child.stderr.take().unwrap();
    let line = std::io::BufRead::lines(std::io::BufReader::new(stderr))
        .map_while(Result::ok)
        .find(|l| l.contains("serving on"))
        .unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.contains("serving on"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_a_released_sandbox_is_left() {
    require_root();
    let server = Server::start();
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host", "resources": {"memory": "128Mi"}})).await;
    sh(&http, &id, None, "setsid sleep 600 > /dev/null 2>&1 < /dev/null &").await;
    let dir = sandbox_dir(&server, &id);
    let cgroup = format!("sandman-{id}");
    let cgroups = || {
        let mut found = Vec::new();
        for c in ["pids", "memory", "cpu", "unified", ""] {
            let root = Path::new("/sys/fs/cgroup").join(c);
            let out = Command::new("find").arg(&root).args(["-maxdepth", "4", "-name", &cgroup]).output().unwrap();
            found.extend(String::from_utf8_lossy(&out.stdout).lines().map(str::to_string));
        }
        found
    };
    assert!(!cgroups().is_empty(), "no cgroup made for the sandbox");
    http.release(&id).await;
    assert!(
        eventually(Duration::from_secs(10), async || e2e::processes_mentioning(&dir.display().to_string()).is_empty())
            .await
    );
    assert!(!dir.exists(), "{} left", dir.display());
    assert!(cgroups().is_empty(), "cgroups left: {:?}", cgroups());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&id), "mounts left on the host: {mounts}");
}

/// The same findings on the docker provider, where they apply: nothing in a container reaches
/// the server's token or conditions key, or another sandbox's token or socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_docker_the_servers_token_key_and_other_sandboxes_are_out_of_reach() {
    use e2e::docker::{Cleanup, require_docker, static_daemon};
    require_docker();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let state = dir.path().join("state");
    let _cleanup = Cleanup(state.clone());
    let daemon = static_daemon().display().to_string();
    let server = Server::start_in(&state, &["--provider", "docker", "--daemon", &daemon]);
    let http = server.client();
    let busybox = "sandman-test/busybox:latest";
    let target = sandbox(&http, json!({"image": busybox})).await;
    let attacker = sandbox(&http, json!({"image": busybox})).await;
    assert_eq!(http.get(&format!("/v1/sandboxes/{attacker}")).await.ok()["isolation"], "container");
    std::fs::write(state.join("token"), "a-token-file").unwrap();
    // What the attacker must not find anywhere it can look: the target's token, the server's.
    let token_of = |id: &str| {
        let file = walk(&state).into_iter().find(|p| p.ends_with("token") && p.to_string_lossy().contains(id));
        std::fs::read_to_string(file.unwrap()).unwrap().trim().to_string()
    };
    let (target_token, own_token) = (token_of(&target), token_of(&attacker));
    // The search works: it finds what is there (a planted copy). Its own daemon's token is not:
    // the daemon removed the file it was handed as it started.
    let own = sh(
        &http,
        &attacker,
        None,
        &format!("echo {own_token} > /tmp/planted; cd / && grep -rlF {own_token} tmp .sandman"),
    )
    .await;
    assert_eq!(stdout(&own), "tmp/planted\n", "{own}");
    assert_eq!(sh(&http, &attacker, None, "rm /tmp/planted; ls -A /.sandman/run").await["stdout"], "d.sock\n");
    for user in [None, Some("65534")] {
        let c = codes(
            &http,
            &attacker,
            user,
            &format!(
                "cat {s}/token; echo token=$?; cat {s}/conditions.key; echo key=$?; ls {s}; echo state=$?; \
                 test -z \"$(ls -A /.sandman/run 2>/dev/null | grep -vx d.sock)\"; echo other-sockets=$((1 - $?)); \
                 cd / && test -z \"$(grep -rlF -e {t} -e {server} $(ls / | grep -v -x -e proc -e sys -e dev))\"; \
                 echo found-a-token=$((1 - $?)); \
                 test -z \"$(grep -lF -e {t} -e {server} /proc/1/environ 2>/dev/null)\"; echo in-environ=$((1 - $?))",
                s = state.display(),
                t = target_token,
                server = e2e::TOKEN,
            ),
        )
        .await;
        all_refused(&format!("docker as {user:?}"), &c);
    }
    http.release(&target).await;
    http.release(&attacker).await;
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

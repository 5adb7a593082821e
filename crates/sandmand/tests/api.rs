//! The daemon's surface as a whole: auth, the error body for bad input, info and keepalive, the
//! lease, signals, zombie reaping as PID 1, and the OpenAPI description.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Body, Daemon, TOKEN, alive, eventually};
use serde_json::json;

#[tokio::test]
async fn every_call_but_health_needs_the_token() {
    let d = Daemon::start().await;
    let health = d.call("GET", "/v1/health", None, Body::Empty).await.unwrap();
    assert_eq!(health.status, 200);
    for (method, path) in
        [("GET", "/v1/info"), ("POST", "/v1/exec"), ("GET", "/v1/files?path=/etc/hostname"), ("GET", "/v1/processes")]
    {
        let none = d.call(method, path, None, Body::Empty).await.unwrap();
        none.error(401, "unauthorized");
        let wrong = d.call(method, path, Some("test-token-0123456788"), Body::Empty).await.unwrap();
        wrong.error(401, "unauthorized");
    }
    // Nothing ran for the refused exec.
    let ok = d.call("GET", "/v1/info", Some(TOKEN), Body::Empty).await.unwrap();
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn bad_input_gets_the_error_body() {
    let d = Daemon::start().await;
    let unknown = d.json("POST", "/v1/exec", json!({"argv": ["true"], "timeout": 5})).await;
    assert!(unknown.error(400, "invalid_argument").contains("unknown field `timeout`"));
    let malformed = d.call("POST", "/v1/exec", Some(TOKEN), Body::Bytes(b"{not json".to_vec())).await.unwrap();
    malformed.error(400, "invalid_argument");
    let empty = d.call("POST", "/v1/exec", Some(TOKEN), Body::Empty).await.unwrap();
    empty.error(400, "invalid_argument");
    let huge = vec![b' '; 17 << 20];
    let too_large = d.call("POST", "/v1/exec", Some(TOKEN), Body::Bytes(huge)).await.unwrap();
    too_large.error(413, "too_large");
    let no_route = d.get("/v1/nothing").await;
    no_route.error(404, "not_found");
    let bad_query = d.get("/v1/stat?path=/&extra=1").await;
    assert!(bad_query.error(400, "invalid_argument").contains("extra"));
    let relative = d.get("/v1/stat?path=etc/passwd").await;
    assert!(relative.error(400, "invalid_argument").contains("absolute"));
    let missing = d.get("/v1/processes/p-999").await;
    missing.error(404, "not_found");
}

#[tokio::test]
async fn info_and_keepalive() {
    let d = Daemon::start_with(&["--lease", "60s"], None).await;
    let info = d.get("/v1/info").await.json();
    assert_eq!(info["pid"], d.pid());
    assert_eq!(info["lease_ms"], 60000);
    assert!(info["lease_remaining_ms"].as_u64().unwrap() > 50000);
    assert_eq!(info["version"], env!("CARGO_PKG_VERSION"));
    let k = d.json("POST", "/v1/keepalive", json!({})).await.json();
    assert!(k["lease_remaining_ms"].as_u64().unwrap() > 59000);
}

#[tokio::test]
async fn the_lease_kills_everything_and_exits_when_it_lapses() {
    let exit_dir = tempfile::tempdir().unwrap();
    let exit_file = exit_dir.path().join("daemon.exit");
    let mut d = Daemon::start_with(&["--lease", "1500ms", "--exit-file", exit_file.to_str().unwrap()], None).await;
    let r = d.json("POST", "/v1/processes", json!({"command": "sleep 100 & sleep 100"})).await.json();
    let leader = r["pid"].as_i64().unwrap() as i32;
    let pidfile = d.dir().join("orphan.pid");
    // An orphaned grandchild in a session of its own, re-parented to the daemon.
    d.exec(json!({"command": format!("setsid sleep 100 > /dev/null 2>&1 & echo $! > {}", pidfile.display())})).await;
    let orphan: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    // Calls within the lease keep it alive.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(d.get("/v1/info").await.status, 200);
    }
    assert!(alive(leader) && alive(orphan));
    let status = d.wait_exit(Duration::from_secs(10)).expect("daemon did not exit after its lease lapsed");
    assert_eq!(status.code(), Some(3));
    // For a supervisor that is not its parent, the same code in the exit file.
    assert_eq!(std::fs::read_to_string(&exit_file).unwrap(), "3\n");
    assert!(
        eventually(Duration::from_secs(5), || !alive(leader) && !alive(orphan)).await,
        "processes outlived the lease"
    );
    let log = d.stderr_text();
    assert!(log.contains("lease lapsed"), "{log}");
}

/// Before, a command longer than the daemon's lease was killed, with the daemon, while its
/// caller waited for the answer.
#[tokio::test]
async fn an_exec_longer_than_the_lease_holds_it_to_its_end() {
    let mut d = Daemon::start_with(&["--lease", "1s"], None).await;
    let r = d.exec(json!({"command": "sleep 2.5; echo done"})).await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"], "done\n");
    // The lease runs again from the call's end: the daemon still answers, then lapses.
    assert_eq!(d.get("/v1/info").await.status, 200);
    let status = d.wait_exit(Duration::from_secs(10)).expect("daemon did not exit after its lease lapsed");
    assert_eq!(status.code(), Some(3));
}

#[tokio::test]
async fn sigterm_is_forwarded_and_the_daemon_exits() {
    let mut d = Daemon::start().await;
    let pidfile = d.dir().join("term.pid");
    let r = d
        .json(
            "POST",
            "/v1/processes",
            json!({"command": format!("trap 'echo got-term > {}; exit 0' TERM; sleep 100 & wait", pidfile.display())}),
        )
        .await
        .json();
    let leader = r["pid"].as_i64().unwrap() as i32;
    tokio::time::sleep(Duration::from_millis(200)).await;
    std::process::Command::new("kill").args(["-TERM", &d.pid().to_string()]).status().unwrap();
    let status = d.wait_exit(Duration::from_secs(10)).expect("daemon did not exit on SIGTERM");
    assert_eq!(status.code(), Some(0));
    assert_eq!(std::fs::read_to_string(&pidfile).unwrap_or_default().trim(), "got-term");
    assert!(!alive(leader));
}

#[tokio::test]
async fn refuses_to_start_without_a_token() {
    let out = std::process::Command::new(common::daemon_bin())
        .args(["--listen", "unix:/tmp/sandmand-no-token.sock"])
        .env_remove("SANDMAN_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("SANDMAN_TOKEN"));
}

/// As its sandbox's init (here PID 1 of a pid namespace of its own, as in a container), the
/// daemon proves its token to callers outside, and refuses the proof to its sandbox's own
/// processes: one that put a socket of its own in the daemon's place cannot relay the server's
/// challenge to the daemon.
#[tokio::test]
async fn as_init_it_gives_its_health_proof_only_to_callers_outside_its_sandbox() {
    let d = Daemon::start_with(&[], Some(&["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"])).await;
    assert_eq!(d.get("/v1/info").await.json()["pid"], 1);
    let outside = d.get("/v1/health?challenge=c1").await;
    assert_eq!(outside.status.as_u16(), 200);
    assert_eq!(outside.json()["proof"].as_str().map(str::len), Some(64));
    let relay = "import socket,sys\n\
                 s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n\
                 s.sendall(b'GET /v1/health?challenge=c1 HTTP/1.1\\r\\nhost: x\\r\\nconnection: close\\r\\n\\r\\n')\n\
                 print(s.makefile('rb').read().decode())";
    let socket = d.socket.display().to_string();
    let inside = d.exec(json!({"argv": ["python3", "-c", relay, socket]})).await;
    let answer = inside["stdout"].as_str().unwrap();
    assert!(answer.starts_with("HTTP/1.1 403"), "{inside}");
    assert!(answer.contains("outside the sandbox") && !answer.contains("\"proof\""), "{answer}");
    // Without a challenge, its health is still answered inside.
    let plain = relay.replace("?challenge=c1", "");
    let inside = d.exec(json!({"argv": ["python3", "-c", plain, socket]})).await;
    assert!(inside["stdout"].as_str().unwrap().starts_with("HTTP/1.1 200"), "{inside}");
}

/// `--consume-token-file`: the token file is gone once the daemon has read it, before anything
/// it starts could look for it; the token still opens the daemon.
#[tokio::test]
async fn a_consumed_token_file_is_gone_once_read() {
    let dir = tempfile::tempdir().unwrap();
    let (file, socket) = (dir.path().join("token"), dir.path().join("d.sock"));
    std::fs::write(&file, "from-the-file\n").unwrap();
    let mut child = std::process::Command::new(common::daemon_bin())
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .arg("--token-file")
        .arg(&file)
        .arg("--consume-token-file")
        .env_remove("SANDMAN_TOKEN")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let served = eventually(Duration::from_secs(20), || socket.exists()).await;
    let gone = !file.exists();
    let status = match served {
        true => {
            common::Conn::open(&socket).await.call("GET", "/v1/info", Some("from-the-file"), Body::Empty).await.ok()
        }
        false => None,
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(served && gone, "served {served}, the file gone {gone}");
    assert_eq!(status.map(|r| r.status.as_u16()), Some(200));
}

#[tokio::test]
async fn serves_tcp_too() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new(common::daemon_bin())
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("SANDMAN_TOKEN", TOKEN)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut ok = false;
    for _ in 0..200 {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
            let mut buf = String::new();
            s.read_to_string(&mut buf).unwrap();
            ok = buf.starts_with("HTTP/1.1 200") && buf.contains("\"status\":\"ok\"");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(ok, "no health answer over TCP");
}

#[tokio::test]
async fn reaps_zombies_as_pid_1() {
    // `--kill-child`: the daemon (PID 1 of the namespace) dies with `unshare` when the test kills it.
    let d = Daemon::start_with(&[], Some(&["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"])).await;
    let info = d.get("/v1/info").await.json();
    assert_eq!(info["pid"], 1, "not PID 1 in its namespace: {info}");
    // Orphans: the subshell exits at once, its sleeps are re-parented to PID 1 and exit later.
    d.exec(json!({"command": "(sleep 0.2 & sleep 0.2 & sleep 0.2 &) ; exit 0"})).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let ps = d.exec(json!({"command": "cat /proc/[0-9]*/stat"})).await;
    let stats = ps["stdout"].as_str().unwrap();
    let zombies: Vec<&str> =
        stats.lines().filter(|l| l.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z')).collect();
    assert!(zombies.is_empty(), "zombies left: {zombies:?}");
    let sleeps = stats.lines().filter(|l| l.contains("(sleep)")).count();
    assert_eq!(sleeps, 0, "{stats}");
}

#[tokio::test]
async fn reaps_orphans_as_an_ordinary_process_too() {
    let d = Daemon::start().await;
    let pidfile = d.dir().join("o.pid");
    d.exec(json!({"command": format!("(sleep 0.2 & echo $! > {}) ; exit 0", pidfile.display())})).await;
    let orphan: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{orphan}/stat")).unwrap_or_default();
    let ppid: u32 = stat.rsplit(')').next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(ppid, d.pid(), "orphan was not re-parented to the daemon");
    assert!(
        eventually(Duration::from_secs(5), || !std::path::Path::new(&format!("/proc/{orphan}")).exists()).await,
        "orphan {orphan} left as a zombie"
    );
}

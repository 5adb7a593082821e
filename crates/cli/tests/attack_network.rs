//! The network rows of the attack suite of the embedded default: from inside real sandboxes of
//! `sandman serve` on the process provider (isolated, as root, as CI runs), what a hostile tenant
//! tried through the network, each test named after what it could do before every sandbox had a
//! network of its own. Egress is tested against a stand-in internet (a network namespace the test
//! makes at a documentation address, serving HTTP and DNS), while the host's services stay out
//! of reach.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use e2e::tenant::sandbox;
use e2e::{Http, Server, TOKEN, scratch};
use sandman_testkit::internet::StandIn;
use sandman_testkit::require_root;
use serde_json::{Value, json};

/// Runs a Python program in `id`; its stdout.
async fn python(http: &Http, id: &str, program: &str) -> String {
    let out = http.exec(id, json!({"argv": ["python3", "-c", program], "timeout_ms": 120_000})).await;
    assert_eq!(out["exit_code"], 0, "{out}");
    out["stdout"].as_str().unwrap().to_string()
}

/// A Python function `reach(host, port)` printing `ok` or the error's name, at once.
const REACH: &str = r#"
import socket, errno
def reach(host, port):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e)) if e.errno else type(e).__name__
    finally:
        s.close()
"#;

/// The host's global IPv4 addresses, as the kernel lists them.
fn host_addrs() -> Vec<Ipv4Addr> {
    let out = Command::new("ip").args(["-4", "-o", "addr", "show", "scope", "global"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next()?.parse().ok())
        .collect()
}

/// A listener on every host address, answering nothing: a host service a sandbox must not reach.
fn host_service() -> TcpListener {
    TcpListener::bind("0.0.0.0:0").unwrap()
}

/// Regression (issue 29): a default (`egress`) sandbox shared the host's network, so it reached
/// every service on the host's loopback and addresses, cloud metadata and private networks.
/// Now it reaches the internet (by name, through its resolvers) and none of those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_reaches_the_internet_by_name_and_nothing_of_the_host() {
    require_root();
    let internet = StandIn::start(10);
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let dns = internet.addr.to_string();
    let server = Server::start_in(&dir.path().join("state"), &["--dns", &dns]);
    let http = server.client();
    let service = host_service();
    let port = service.local_addr().unwrap().port();
    let server_port: u16 = server.addr.rsplit(':').next().unwrap().parse().unwrap();
    let id = sandbox(&http, json!({"image": "host"})).await;
    let other = sandbox(&http, json!({"image": "host"})).await;
    let other_addr = http.exec(&other, json!({"argv": ["sh", "-c", "ip -4 -o addr show dev eth0"]})).await;
    let other_addr = other_addr["stdout"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .nth(3)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let mut targets = vec![
        ("host-loopback-service".to_string(), "127.0.0.1".to_string(), port),
        ("server-port".to_string(), "127.0.0.1".to_string(), server_port),
        ("metadata".to_string(), "169.254.169.254".to_string(), 80),
        ("private-10".to_string(), "10.255.255.1".to_string(), 80),
        ("private-192".to_string(), "192.168.1.1".to_string(), 80),
        ("another-sandbox".to_string(), other_addr, 80),
    ];
    for (i, addr) in host_addrs().iter().enumerate() {
        targets.push((format!("host-address-{i}"), addr.to_string(), port));
        targets.push((format!("host-address-{i}-server"), addr.to_string(), server_port));
    }
    let checks: String =
        targets.iter().map(|(name, host, port)| format!("print('{name}=' + reach('{host}', {port}))\n")).collect();
    let program = format!(
        "{REACH}\nimport urllib.request\nprint('web=' + urllib.request.urlopen('http://{}/', timeout=10).read().decode().strip())\n{checks}",
        StandIn::NAME
    );
    let out = python(&http, &id, &program).await;
    assert!(
        out.contains(&format!("web={}", StandIn::PAGE.trim())),
        "the stand-in internet is not reached by name: {out}"
    );
    for (name, host, port) in &targets {
        let line = out.lines().find(|l| l.starts_with(&format!("{name}="))).unwrap_or_default();
        assert!(
            line.ends_with("=ECONNREFUSED") || line.ends_with("=EHOSTUNREACH"),
            "{name} ({host}:{port}) is not refused at once: {line}\n{out}"
        );
    }
    drop(service);
}

/// Regression (issue 29): a background process of a default sandbox bound the server's address
/// while the server restarted (sandboxes outlive it), so the restarted server failed "Address
/// already in use" and the CLI then sent its token to the sandbox. A sandbox's binds are in its
/// own network namespace now: the host never sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_cannot_squat_the_servers_address_or_bind_a_host_port() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let state = dir.path().join("state");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let mut server = Server::start_in(&state, &["--listen", &listen]);
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host", "lease_s": 600})).await;
    let squat = format!(
        "import socket, time\nfor p in ({port}, 17999):\n    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n    s.bind(('127.0.0.1', p)); s.listen(); globals()[f's{{p}}'] = s\nprint('bound', flush=True)\ntime.sleep(600)"
    );
    http.post(
        &format!("/v1/sandboxes/{id}/processes"),
        json!({"argv": ["python3", "-u", "-c", squat], "tag": "squat"}),
    )
    .await
    .ok();
    let bound = e2e::eventually(Duration::from_secs(20), async || {
        let out = http.get(&format!("/v1/sandboxes/{id}/processes/squat/output")).await.json();
        out["data"].as_str().unwrap_or_default().contains("bound")
    })
    .await;
    assert!(bound, "the squatter did not bind inside its sandbox");
    // The host sees neither listener.
    assert!(std::net::TcpStream::connect(("127.0.0.1", 17999)).is_err(), "a sandbox's bind is the host's");
    // The server restarts on its own address while the squatter runs (killed, not dropped: the
    // harness's drop ends the sandboxes and their records too; the first one's goes at the end).
    server.kill9();
    let server = Server::start_in(&state, &["--listen", &listen]);
    let http = server.client();
    let health = http.get("/healthz").await.ok();
    assert_eq!(health["status"], "ok", "{health}");
    let (code, stdout, stderr) = e2e::cli(&server, &["ls", "-q"]);
    assert_eq!((code, stdout.trim()), (0, id.as_str()), "{stderr}");
    http.release(&id).await;
    let _ = TOKEN;
}

/// Regression (issue 29): 9,000 connections from inside a sandbox to the server's port made
/// `/healthz` take 40 s. From inside, the server's port is out of reach now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_from_inside_leaves_healthz_answering() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    // Listening on every address, so that the host's addresses lead to it.
    let port = TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port();
    let server = Server::start_in(&dir.path().join("state"), &["--listen", &format!("0.0.0.0:{port}")]);
    let http = Http { addr: format!("127.0.0.1:{port}"), token: Some(TOKEN.to_string()) };
    let id = sandbox(&http, json!({"image": "host"})).await;
    let targets: Vec<String> =
        host_addrs().iter().map(|a| format!("'{a}'")).chain(["'127.0.0.1'".to_string()]).collect();
    let flood = format!(
        "{REACH}\nok = 0\nfor i in range(9000):\n    host = [{}][i % {}]\n    ok += reach(host, {port}) == 'ok'\nprint('connected', ok)",
        targets.join(", "),
        targets.len()
    );
    let (flooded, health) = tokio::join!(python(&http, &id, &flood), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        http.get("/healthz").await
    });
    assert_eq!(flooded.trim(), "connected 0", "a sandbox reached the server's port");
    assert_eq!(health.status, 200);
    http.release(&id).await;
    drop(server);
}

/// Regression (issue 29): the state directory was open to every host user: as `nobody`, one
/// listed the sandboxes' ids, read a sandbox's files and wrote into its `/tmp`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_user_cannot_list_or_reach_into_the_state_directory() {
    require_root();
    // Under a directory every host user may enter, as /var/lib is.
    let parent = tempfile::tempdir_in(scratch()).unwrap();
    std::fs::set_permissions(parent.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = Server::start_in(&parent.path().join("state"), &[]);
    let http = server.client();
    let id = sandbox(&http, json!({"image": "host"})).await;
    let dir = server.state.join("sandboxes").join(&id);
    for target in [server.state.clone(), server.state.join("sandboxes"), dir.clone(), dir.join("record.json")] {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--", "ls", "-A"])
            .arg(&target)
            .output()
            .unwrap();
        assert!(!out.status.success(), "nobody listed {}: {}", target.display(), String::from_utf8_lossy(&out.stdout));
    }
    http.release(&id).await;
}

/// Regression (issue 29): two servers on one host gave their first sandboxes the same host ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_give_their_sandboxes_disjoint_host_ids() {
    require_root();
    let (a, b) = (Server::start(), Server::start());
    let (ha, hb) = (a.client(), b.client());
    let (x, y) = (sandbox(&ha, json!({"image": "host"})).await, sandbox(&hb, json!({"image": "host"})).await);
    let ids = |server: &Server, id: &str| -> u32 {
        std::fs::read_to_string(server.state.join("sandboxes").join(id).join("ids")).unwrap().trim().parse().unwrap()
    };
    let (ia, ib) = (ids(&a, &x), ids(&b, &y));
    assert!(ia.abs_diff(ib) >= 65536, "two servers' sandboxes share host ids: {ia} and {ib}");
    // And inside, each one's root maps to its own.
    let map = |out: Value| out["stdout"].as_str().unwrap().split_whitespace().nth(1).unwrap().parse::<u32>().unwrap();
    let argv = json!({"argv": ["cat", "/proc/self/uid_map"]});
    assert_eq!(map(ha.exec(&x, argv.clone()).await), ia);
    assert_eq!(map(hb.exec(&y, argv).await), ib);
    ha.release(&x).await;
    hb.release(&y).await;
}

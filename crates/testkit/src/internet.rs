//! A stand-in for the internet, for tests of sandboxes' egress: a network namespace of the test's
//! own, joined to the host by a veth, at an address of the documentation range 198.51.100.0/24
//! (TEST-NET-2; never 203.0.113.0/24, where this machine's package registries answer), serving
//! HTTP on port 80 (a file saying who it is) and DNS on port 53 (`dnsmasq`, answering
//! [`StandIn::NAME`] with its own address). The host routes that one address to the veth; the
//! namespace's default route leads back to the host. Everything goes when the value is dropped,
//! however the test ends. Needs root, `ip`, `python3` and `dnsmasq`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One stand-in internet host.
#[derive(Debug)]
pub struct StandIn {
    /// Its address: 198.51.100.`n`.
    pub addr: std::net::Ipv4Addr,
    netns: String,
    veth: String,
    servers: Vec<Child>,
    dir: tempfile::TempDir,
}

impl StandIn {
    /// The name its DNS server answers with its address.
    pub const NAME: &'static str = "internet.test";
    /// What its web server answers at `/`.
    pub const PAGE: &'static str = "hello from the stand-in internet\n";

    /// Starts one at 198.51.100.`n` (`n` in 2..=254, one per test that runs at the same time as
    /// others: the host routes the address to this namespace alone).
    pub fn start(n: u8) -> StandIn {
        assert!((2..=254).contains(&n), "198.51.100.{n}: the host end is .1");
        let tag = format!("{n}-{}", std::process::id());
        let addr = std::net::Ipv4Addr::new(198, 51, 100, n);
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut me = StandIn {
            addr,
            netns: format!("sandman-inet-{tag}"),
            veth: format!("sminet{n}"),
            servers: Vec::new(),
            dir,
        };
        // A namespace or veth of this name left by a run that was killed goes first.
        me.cleanup();
        let (ns, veth, a) = (me.netns.clone(), me.veth.clone(), addr.to_string());
        ip(&["netns", "add", &ns]);
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
        ip(&["addr", "add", "198.51.100.1/32", "dev", &veth]);
        ip(&["link", "set", &veth, "up"]);
        ip(&["route", "add", &format!("{a}/32"), "dev", &veth]);
        ip(&["-n", &ns, "addr", "add", &format!("{a}/32"), "dev", "eth0"]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&["-n", &ns, "route", "add", "198.51.100.1/32", "dev", "eth0"]);
        ip(&["-n", &ns, "route", "add", "default", "via", "198.51.100.1"]);
        let site = me.dir.path().join("site");
        std::fs::create_dir_all(&site).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(site.join("index.html"), Self::PAGE).unwrap_or_else(|e| panic!("{e}"));
        let web = me.inside(&["python3", "-m", "http.server", "80", "--bind", &a, "--directory"], Some(site));
        me.servers.push(web);
        let dns = me.inside(
            &[
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                &format!("--listen-address={a}"),
                &format!("--address=/{}/{a}", Self::NAME),
                "--pid-file=",
                "--user=root",
            ],
            None,
        );
        me.servers.push(dns);
        me.wait_serving();
        me
    }

    /// Its web server's URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Runs `argv` (and then `extra`) in the namespace, its output to the scratch directory.
    fn inside(&self, argv: &[&str], extra: Option<PathBuf>) -> Child {
        let log =
            std::fs::File::create(self.dir.path().join(format!("{}.log", argv[0]))).unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.netns]).args(argv);
        if let Some(p) = extra {
            cmd.arg(p);
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} in the stand-in: {e}", argv[0]))
    }

    /// Waits until both servers answer from the host.
    fn wait_serving(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let web = std::net::SocketAddr::from((self.addr, 80));
        while std::net::TcpStream::connect_timeout(&web, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "the stand-in's web server did not start: {}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
        let dns = std::net::SocketAddr::from((self.addr, 53));
        while std::net::TcpStream::connect_timeout(&dns, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "the stand-in's DNS server did not start: {}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn logs(&self) -> String {
        ["python3.log", "dnsmasq.log"]
            .iter()
            .map(|f| format!("{f}: {}", std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn cleanup(&mut self) {
        for mut s in self.servers.drain(..) {
            let _ = s.kill();
            let _ = s.wait();
        }
        // The namespace's end of the veth goes with it, and the host's route with the host's end.
        let _ = Command::new("ip").args(["netns", "del", &self.netns]).stderr(Stdio::null()).status();
        let _ = Command::new("ip").args(["link", "del", &self.veth]).stderr(Stdio::null()).status();
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.cleanup();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| panic!("cannot run ip: {e}"));
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

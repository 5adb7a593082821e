//! The host's side of isolated sandboxes' networks. Every isolated sandbox has a network
//! namespace of its own; one with `network: egress` also has a veth to the host, whose host end
//! (`smv<slot>`, in this server's interface group) the daemon makes as it starts
//! (`sandmand --isolate-veth`), with an address of [`NetConfig::subnet`] (`10.201.0.0/16`
//! unless told) and a default route through it. What it may reach through it is this module's:
//! at start the provider turns on IPv4 forwarding and installs one nftables table of its own
//! ([`HostNetwork::setup`], with [`firewall`]) that
//!
//! - masquerades the sandboxes' traffic out of the host;
//! - refuses (ICMP admin-prohibited, so a connect fails at once) whatever they send to the host
//!   itself, on any of its addresses, and to the private, shared, loopback, link-local and
//!   multicast ranges ([`firewall::DENIED`]), other sandboxes included, unless an address is in
//!   [`NetConfig::allow`] (`--egress-allow`), or is one of their resolvers on port 53;
//! - drops their IPv6, and anything that starts a connection towards them.
//!
//! On a host whose iptables `FORWARD` chain drops by default (Docker's does), an nftables accept
//! does not outweigh that drop, so the provider also puts two accept rules for its veths there
//! (in `DOCKER-USER` when it exists), with the `iptables` that such a host has.
//!
//! The table is named for this server's group (`sandman-<group>`), made whole in one
//! transaction each start, and left in place at exit: the sandboxes outlive their server. A
//! server's start removes the tables of servers whose state directory is gone
//! ([`firewall::TABLES_DIR`]).

use std::net::Ipv4Addr;
use std::path::Path;

pub use sandman_provider::firewall::Cidr;
use sandman_provider::firewall::{self, Policy, Sandboxes};

/// The sandboxes' addresses when not told (`--sandbox-subnet`).
pub const DEFAULT_SUBNET: &str = "10.201.0.0/16";

/// The prefix of every sandbox veth's host end, of every server: what the iptables accept rules
/// match (`smv+`).
pub const VETH_PREFIX: &str = "smv";

/// What the server is told of its sandboxes' networks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Where sandboxes' addresses come from (`--sandbox-subnet`): one per id slot, so it holds
    /// at least as many addresses as there are slots.
    pub subnet: Cidr,
    /// Networks sandboxes may reach although [`DENIED`] holds them (`--egress-allow`).
    pub allow: Vec<Cidr>,
    /// The sandboxes' resolvers (`--dns`); `None`: the host's own, from its resolv.conf.
    pub dns: Option<Vec<Ipv4Addr>>,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            subnet: DEFAULT_SUBNET.parse().unwrap_or(Cidr { addr: Ipv4Addr::new(10, 201, 0, 0), prefix: 16 }),
            allow: Vec::new(),
            dns: None,
        }
    }
}

/// The host network as set up for this server's sandboxes.
#[derive(Debug, Clone)]
pub struct HostNetwork {
    /// The interface group of this server's veths, which its rules name.
    pub group: u32,
    subnet: Cidr,
    dns: Vec<Ipv4Addr>,
}

impl HostNetwork {
    /// Turns on IPv4 forwarding, installs this server's table (replacing the one an earlier
    /// start installed), and opens iptables' `FORWARD` drop where there is one. `owner` (the
    /// state directory) names the server. Blocking; at start.
    pub fn setup(config: &NetConfig, owner: &Path, slots: u32) -> Result<HostNetwork, String> {
        if config.subnet.size() < u64::from(slots) + 1 {
            return Err(format!(
                "--sandbox-subnet {} holds {} addresses, fewer than the {slots} sandboxes a host may hold: give a /16 or larger",
                config.subnet,
                config.subnet.size()
            ));
        }
        let dns = match &config.dns {
            Some(dns) => dns.clone(),
            None => firewall::host_resolvers(),
        };
        if dns.is_empty() {
            tracing::warn!(
                "sandboxes get no resolver: the host's resolv.conf names none they can reach (loopback ones are the host's own); pass --dns"
            );
        }
        let group = group_of(owner);
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| format!("cannot turn on IPv4 forwarding (/proc/sys/net/ipv4/ip_forward): {e}"))?;
        let policy = Policy {
            table: format!("sandman-{group:08x}"),
            sandboxes: Sandboxes::Group(group),
            masquerade: Some(config.subnet),
            allow: config.allow.clone(),
            dns: dns.clone(),
        };
        let tables = Path::new(firewall::TABLES_DIR);
        firewall::sweep(tables, owner);
        firewall::apply(&policy).map_err(|e| format!("cannot install the nftables table `{}`: {e}", policy.table))?;
        firewall::record(tables, &policy.table, owner)
            .map_err(|e| format!("cannot record the table `{}` in `{}`: {e}", policy.table, firewall::TABLES_DIR))?;
        open_iptables_forward()?;
        tracing::info!(table = %policy.table, subnet = %config.subnet, resolvers = ?dns, "sandboxes' networks: egress through NAT, host and private ranges refused");
        Ok(HostNetwork { group, subnet: config.subnet, dns })
    }

    /// The host end of slot `slot`'s veth.
    pub fn veth(slot: u32) -> String {
        format!("{VETH_PREFIX}{slot}")
    }

    /// The address of slot `slot`'s sandbox.
    pub fn addr(&self, slot: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet.network()) + slot)
    }

    pub fn dns(&self) -> &[Ipv4Addr] {
        &self.dns
    }
}

/// This server's interface group: `0x53` and 24 bits of a hash of its state directory.
fn group_of(owner: &Path) -> u32 {
    // FNV-1a: stable across builds and runs, unlike std's hasher.
    let hash = owner
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
    0x5300_0000 | (hash & 0x00ff_ffff)
}

/// Where iptables' `FORWARD` chain drops by default (Docker sets it so), an accept of ours in
/// nftables does not keep a sandbox's packets from that drop: two accept rules for every
/// sandbox veth go there too (into `DOCKER-USER`, Docker's place for them, when it exists),
/// once. A host without iptables has no such chain.
fn open_iptables_forward() -> Result<(), String> {
    let run = |args: &[&str]| std::process::Command::new("iptables").args(args).output();
    let listed = match run(&["-w", "-S", "FORWARD"]) {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        // No iptables, or no filter table: nothing drops there.
        _ => return Ok(()),
    };
    let has_user_chain = run(&["-w", "-S", "DOCKER-USER"]).is_ok_and(|o| o.status.success());
    if !listed.lines().any(|l| l.trim() == "-P FORWARD DROP") && !has_user_chain {
        return Ok(());
    }
    let chain = if has_user_chain { "DOCKER-USER" } else { "FORWARD" };
    let any = format!("{VETH_PREFIX}+");
    let rules: [&[&str]; 2] = [
        &["-i", &any, "-j", "ACCEPT"],
        &["-o", &any, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"],
    ];
    for rule in rules {
        let present = run(&[&["-w", "-C", chain], rule].concat()).is_ok_and(|o| o.status.success());
        if present {
            continue;
        }
        let out = run(&[&["-w", "-I", chain, "1"], rule].concat())
            .map_err(|e| format!("cannot run iptables to open its FORWARD drop to the sandboxes: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "iptables' FORWARD chain drops by default, and adding the sandboxes' accept rule to `{chain}` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_server_has_a_group_of_its_own_and_each_slot_an_address() {
        let (a, b) = (group_of(Path::new("/var/lib/sandman")), group_of(Path::new("/root/.local/state/sandman")));
        assert_ne!(a, b);
        assert_eq!(a >> 24, 0x53);
        let net =
            HostNetwork { group: a, subnet: DEFAULT_SUBNET.parse().unwrap_or_else(|e| panic!("{e}")), dns: vec![] };
        assert_eq!(net.addr(1), Ipv4Addr::new(10, 201, 0, 1));
        assert_eq!(net.addr(20478), Ipv4Addr::new(10, 201, 79, 254));
        assert_eq!(HostNetwork::veth(20478), "smv20478");
        assert!(HostNetwork::veth(20478).len() < 16, "longer than a Linux interface name may be");
    }
}

/// The table as the kernel takes it, in a network namespace of the test's own (root, `ip` and
/// `nft`, which CI has).
#[cfg(test)]
mod kernel_tests {
    use super::*;

    /// A named network namespace (`ip netns`), removed with the value.
    struct Netns(String);

    impl Netns {
        fn new(tag: &str) -> Netns {
            let name = format!("sandman-test-{tag}-{}", std::process::id());
            let ok = std::process::Command::new("ip").args(["netns", "add", &name]).status();
            assert!(ok.is_ok_and(|s| s.success()), "ip netns add {name}");
            Netns(name)
        }

        /// Runs `f` on a thread that has joined the namespace.
        fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
            std::thread::scope(|s| {
                s.spawn(|| {
                    let fd = std::fs::File::open(format!("/run/netns/{}", self.0)).unwrap_or_else(|e| panic!("{e}"));
                    crate::sys::setns_net(&fd).unwrap_or_else(|e| panic!("setns: {e}"));
                    f()
                })
                .join()
                .unwrap_or_else(|_| panic!("the thread in the namespace panicked"))
            })
        }

        fn nft_list(&self) -> String {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", &self.0, "nft", "list", "ruleset"])
                .output()
                .unwrap_or_else(|e| panic!("nft: {e}"));
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    }

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    #[test]
    fn the_table_is_installed_whole_and_replaced_whole() {
        assert_eq!(crate::sys::euid(), 0, "this test needs root (CI and scripts/test run as root)");
        let ns = Netns::new("nft");
        let allow = ["10.9.0.0/16".parse().unwrap_or_else(|e: String| panic!("{e}"))];
        let dns = [Ipv4Addr::new(10, 255, 255, 53)];
        let rules = Policy {
            table: "sandman-53123456".into(),
            sandboxes: Sandboxes::Group(0x5312_3456),
            masquerade: Some(DEFAULT_SUBNET.parse().unwrap_or_else(|e: String| panic!("{e}"))),
            allow: allow.to_vec(),
            dns: dns.to_vec(),
        };
        ns.run(|| firewall::apply(&rules)).unwrap_or_else(|e| panic!("{e}"));
        let listed = ns.nft_list();
        // nft prints the group in decimal (0x53123456) and leaves out the family checks it can
        // tell from the addresses.
        for want in [
            "table inet sandman-53123456",
            "type filter hook forward priority filter - 1; policy accept;",
            "iifgroup 1393701974 meta nfproto ipv6 drop",
            "iifgroup 1393701974 ip daddr 10.9.0.0/16 accept",
            "iifgroup 1393701974 ip daddr 10.255.255.53 udp dport 53 accept",
            "iifgroup 1393701974 ip daddr 10.255.255.53 tcp dport 53 accept",
            "iifgroup 1393701974 ip daddr 169.254.0.0/16 jump refuse",
            "iifgroup 1393701974 ip daddr 10.0.0.0/8 jump refuse",
            "oifgroup 1393701974 ct state established,related accept",
            "oifgroup 1393701974 drop",
            "type filter hook input priority filter - 1; policy accept;",
            "iifgroup 1393701974 jump refuse",
            "meta l4proto tcp reject with tcp reset",
            "reject with icmpx admin-prohibited",
            "type nat hook postrouting priority srcnat; policy accept;",
            "ip saddr 10.201.0.0/16 oifgroup != 1393701974 masquerade",
        ] {
            assert!(listed.contains(want), "`{want}` is not in:\n{listed}");
        }
        // The allow rule and the resolvers' come before the refusals.
        let at = |s: &str| listed.find(s).unwrap_or(usize::MAX);
        assert!(at("10.9.0.0/16 accept") < at("10.0.0.0/8 jump"), "{listed}");
        assert!(at("udp dport 53 accept") < at("10.0.0.0/8 jump"), "{listed}");
        // A second start replaces it whole: no rule twice, none of the first's left.
        let rules = Policy { allow: vec![], ..rules };
        ns.run(|| firewall::apply(&rules)).unwrap_or_else(|e| panic!("{e}"));
        let listed = ns.nft_list();
        assert_eq!(listed.matches("table inet sandman-53123456").count(), 1);
        assert!(!listed.contains("10.9.0.0/16"), "{listed}");
        assert_eq!(listed.matches("masquerade").count(), 1, "{listed}");
    }
}

//! The host's side of isolated sandboxes' networks. Every isolated sandbox has a network
//! namespace of its own; one with `network: egress` also has a veth to the host, whose host end
//! (`smv<slot>`, in this server's interface group) the daemon makes as it starts
//! (`sandmand --isolate-veth`), with an address of [`NetConfig::subnet`] (`10.201.0.0/16`
//! unless told) and a default route through it. What it may reach through it is this module's:
//! at start the provider turns on IPv4 forwarding and installs one nftables table of its own
//! ([`HostNetwork::setup`]) that
//!
//! - masquerades the sandboxes' traffic out of the host;
//! - refuses (ICMP admin-prohibited, so a connect fails at once) whatever they send to the host
//!   itself, on any of its addresses, and to the private, shared, loopback, link-local and
//!   multicast ranges ([`DENIED`]), other sandboxes included, unless an address is in
//!   [`NetConfig::allow`] (`--egress-allow`), or is one of their resolvers on port 53;
//! - drops their IPv6, and anything that starts a connection towards them.
//!
//! On a host whose iptables `FORWARD` chain drops by default (Docker's does), an nftables accept
//! does not outweigh that drop, so the provider also puts two accept rules for its veths there
//! (in `DOCKER-USER` when it exists), with the `iptables` that such a host has.
//!
//! The table is named for this server's group (`sandman-<group>`), made whole in one
//! transaction each start, and left in place at exit: the sandboxes outlive their server. A
//! server's start removes the tables of servers whose state directory is gone ([`TABLES_DIR`]).

use std::fmt;
use std::net::Ipv4Addr;
use std::path::Path;
use std::str::FromStr;

use netlink_packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, Cmp, DataAttribute, ExpressionAttribute, Expressions, Hook, Immediate, InetHookNumber,
    ListAttribute, Meta, MetaKey, NfTablesMessage, Operator, Payload, Register, RuleAttribute, RuleMessage,
    TableAttribute, TableMessage, VerdictAttribute,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

/// The ranges no sandbox reaches unless allowed: this network, private (RFC 1918), shared
/// (carrier-grade NAT, RFC 6598), loopback, link-local (cloud metadata services answer at
/// 169.254.169.254), the IETF's protocol assignments, benchmarking, multicast and reserved.
pub const DENIED: [&str; 11] = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// The sandboxes' addresses when not told (`--sandbox-subnet`).
pub const DEFAULT_SUBNET: &str = "10.201.0.0/16";

/// The prefix of every sandbox veth's host end, of every server: what the iptables accept rules
/// match (`smv+`).
pub const VETH_PREFIX: &str = "smv";

/// An IPv4 network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    pub fn mask(self) -> u32 {
        if self.prefix == 0 { 0 } else { u32::MAX << (32 - u32::from(self.prefix)) }
    }

    /// The network's own address (host bits cleared).
    pub fn network(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & self.mask())
    }

    pub fn contains(self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & self.mask() == u32::from(self.network())
    }

    /// How many addresses it holds.
    pub fn size(self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Cidr, String> {
        let (addr, prefix) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = addr.parse().map_err(|_| format!("`{s}` is not an IPv4 network (a.b.c.d/n)"))?;
        let prefix: u8 =
            prefix.parse().ok().filter(|p| *p <= 32).ok_or_else(|| format!("`{s}`: the prefix is 0 to 32"))?;
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix)
    }
}

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
            None => host_resolvers(),
        };
        if dns.is_empty() {
            tracing::warn!(
                "sandboxes get no resolver: the host's resolv.conf names none they can reach (loopback ones are the host's own); pass --dns"
            );
        }
        let group = group_of(owner);
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| format!("cannot turn on IPv4 forwarding (/proc/sys/net/ipv4/ip_forward): {e}"))?;
        let rules = Ruleset { group, subnet: config.subnet, allow: &config.allow, dns: &dns };
        sweep_tables(Path::new(TABLES_DIR), owner);
        nft::apply(&rules.messages())
            .map_err(|e| format!("cannot install the nftables table `{}`: {e}", rules.table()))?;
        record_table(Path::new(TABLES_DIR), &rules.table(), owner)
            .map_err(|e| format!("cannot record the table `{}` in `{TABLES_DIR}`: {e}", rules.table()))?;
        open_iptables_forward()?;
        tracing::info!(table = %rules.table(), subnet = %config.subnet, resolvers = ?dns, "sandboxes' networks: egress through NAT, host and private ranges refused");
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

/// Where the host's servers record their tables (a file per table naming its server's state
/// directory), so that a server finds those whose server is gone for good, and removes them: each
/// one's rules are walked by every packet the host forwards.
pub const TABLES_DIR: &str = "/run/sandman/tables";

fn record_table(dir: &Path, table: &str, owner: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::write(dir.join(table), owner.as_os_str().as_encoded_bytes())
}

/// Removes the tables of servers whose state directory no longer holds a `sandboxes` directory
/// (removed, as a test's is), with their records.
fn sweep_tables(dir: &Path, owner: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let Ok(theirs) = std::fs::read_to_string(entry.path()) else { continue };
        let table = entry.file_name().to_string_lossy().into_owned();
        if Path::new(&theirs) == owner
            || Path::new(&theirs).join("sandboxes").is_dir()
            || !table.starts_with("sandman-")
        {
            continue;
        }
        let delete = msg(
            NfTablesMessage::DeleteTable(TableMessage { attributes: vec![TableAttribute::Name(table.clone())] }),
            0,
        );
        match nft::apply(&[delete]) {
            Ok(()) => tracing::info!(%table, server = %theirs, "removed the nftables table of a server that is gone"),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => {
                tracing::warn!(%table, err = %e, "cannot remove the nftables table of a server that is gone");
                continue;
            }
        }
        let _ = std::fs::remove_file(entry.path());
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

/// The host's resolvers as its sandboxes can use them: the IPv4 nameservers of /etc/resolv.conf
/// that are not loopback (those are the host's own, out of every sandbox's reach); where it names
/// only loopback ones (systemd-resolved's stub), those systemd-resolved itself uses.
fn host_resolvers() -> Vec<Ipv4Addr> {
    let read = |path: &str| -> Vec<Ipv4Addr> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("nameserver"))
            .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
            .filter(|a| !a.is_loopback())
            .collect()
    };
    let mine = read("/etc/resolv.conf");
    if mine.is_empty() { read("/run/systemd/resolve/resolv.conf") } else { mine }
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

/// This server's nftables table, as netlink messages.
struct Ruleset<'a> {
    group: u32,
    subnet: Cidr,
    allow: &'a [Cidr],
    dns: &'a [Ipv4Addr],
}

/// nftables' verdicts, as the kernel numbers them (`NF_DROP`, `NF_ACCEPT`).
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
/// `nft_reject` with an ICMP(v6) code whatever the family: admin-prohibited.
const NFT_REJECT_ICMPX_UNREACH: u32 = 2;
const NFT_REJECT_ICMPX_ADMIN_PROHIBITED: u8 = 3;
const NFTA_REJECT_TYPE: u16 = 1;
const NFTA_REJECT_ICMP_CODE: u16 = 2;
/// `nft_ct`: the connection's state bits (`NFT_CT_STATE`), into a register.
const NFTA_CT_KEY: u16 = 2;
const NFTA_CT_DREG: u16 = 1;
const NFT_CT_STATE: u32 = 0;
const CT_ESTABLISHED_OR_RELATED: u32 = 0x2 | 0x4;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
/// Payload bases: the network and the transport header.
const NETWORK: u32 = 1;
const TRANSPORT: u32 = 2;

impl Ruleset<'_> {
    fn table(&self) -> String {
        format!("sandman-{:08x}", self.group)
    }

    /// One transaction: the table made (so that it exists), deleted with whatever an earlier
    /// start put in it, then made again whole.
    fn messages(&self) -> Vec<NetlinkMessage<NetfilterMessage>> {
        let table = self.table();
        let mut out = vec![
            msg(
                NfTablesMessage::NewTable(TableMessage { attributes: vec![TableAttribute::Name(table.clone())] }),
                NLM_F_CREATE,
            ),
            msg(
                NfTablesMessage::DeleteTable(TableMessage { attributes: vec![TableAttribute::Name(table.clone())] }),
                0,
            ),
            msg(
                NfTablesMessage::NewTable(TableMessage { attributes: vec![TableAttribute::Name(table.clone())] }),
                NLM_F_CREATE,
            ),
        ];
        let priority_filter_first = (-1i32) as u32;
        let srcnat = 100u32;
        for (name, kind, hook, priority) in [
            ("forward", "filter", InetHookNumber::Forward, priority_filter_first),
            ("input", "filter", InetHookNumber::LocalIn, priority_filter_first),
            ("postrouting", "nat", InetHookNumber::PostRouting, srcnat),
        ] {
            out.push(msg(
                NfTablesMessage::NewChain(netlink_packet_netfilter::nftables::ChainMessage {
                    attributes: vec![
                        ChainAttribute::Table(table.clone()),
                        ChainAttribute::Name(name.to_string()),
                        ChainAttribute::Hook(vec![Hook::Number(hook.into()), Hook::Priority(priority)]),
                        ChainAttribute::Policy(NF_ACCEPT),
                        ChainAttribute::Type(kind.to_string()),
                    ],
                }),
                NLM_F_CREATE,
            ));
        }
        let rule = |chain: &str, exprs: Vec<ListAttribute<ExpressionAttribute>>| {
            msg(
                NfTablesMessage::NewRule(RuleMessage {
                    attributes: vec![
                        RuleAttribute::Table(table.clone()),
                        RuleAttribute::Chain(chain.to_string()),
                        RuleAttribute::Expressions(exprs),
                    ],
                }),
                NLM_F_CREATE | NLM_F_APPEND,
            )
        };
        let from_ours = || meta_eq(MetaKey::Iifgroup, &self.group.to_ne_bytes());
        let to_ours = || meta_eq(MetaKey::Oifgroup, &self.group.to_ne_bytes());
        // forward: what a sandbox sends on.
        out.push(rule(
            "forward",
            [from_ours(), meta_eq(MetaKey::Nfproto, &[NFPROTO_IPV6]), vec![verdict(NF_DROP)]].concat(),
        ));
        for net in self.allow {
            out.push(rule("forward", [from_ours(), ipv4(), daddr_in(*net), vec![verdict(NF_ACCEPT)]].concat()));
        }
        for server in self.dns {
            let host = Cidr { addr: *server, prefix: 32 };
            for proto in [libc::IPPROTO_UDP as u8, libc::IPPROTO_TCP as u8] {
                out.push(rule(
                    "forward",
                    [
                        from_ours(),
                        ipv4(),
                        daddr_in(host),
                        meta_eq(MetaKey::L4Proto, &[proto]),
                        dport(53),
                        vec![verdict(NF_ACCEPT)],
                    ]
                    .concat(),
                ));
            }
        }
        for denied in DENIED {
            let net: Cidr = denied.parse().unwrap_or(Cidr { addr: Ipv4Addr::UNSPECIFIED, prefix: 0 });
            out.push(rule("forward", [from_ours(), ipv4(), daddr_in(net), vec![reject()]].concat()));
        }
        // forward: what comes back to a sandbox, and nothing that starts a connection to it.
        out.push(rule("forward", [to_ours(), ct_established(), vec![verdict(NF_ACCEPT)]].concat()));
        out.push(rule("forward", [to_ours(), vec![verdict(NF_DROP)]].concat()));
        // input: nothing a sandbox sends reaches the host itself, on any address.
        out.push(rule("input", [from_ours(), vec![reject()]].concat()));
        // postrouting: out of the host under the host's address.
        out.push(rule(
            "postrouting",
            [
                ipv4(),
                saddr_in(self.subnet),
                meta_cmp(MetaKey::Oifgroup, Operator::NotEqual, &self.group.to_ne_bytes()),
                vec![masquerade()],
            ]
            .concat(),
        ));
        out
    }
}

fn msg(m: NfTablesMessage, flags: u16) -> NetlinkMessage<NetfilterMessage> {
    let mut out =
        NetlinkMessage::from(NetfilterMessage::new(NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0), m));
    out.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    out
}

fn meta_eq(key: MetaKey, value: &[u8]) -> Vec<ListAttribute<ExpressionAttribute>> {
    meta_cmp(key, Operator::Equal, value)
}

fn meta_cmp(key: MetaKey, op: Operator, value: &[u8]) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        Expressions::Meta(vec![Meta::Key(key), Meta::DestinationRegister(Register::Reg1)]).into(),
        Expressions::Cmp(vec![
            Cmp::SourceRegister(Register::Reg1),
            Cmp::Op(op),
            Cmp::Data(DataAttribute::Value(value.to_vec())),
        ])
        .into(),
    ]
}

fn ipv4() -> Vec<ListAttribute<ExpressionAttribute>> {
    meta_eq(MetaKey::Nfproto, &[NFPROTO_IPV4])
}

/// The IPv4 header's address at `offset` (12: source, 16: destination) within `net`.
fn addr_in(offset: u32, net: Cidr) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        Expressions::Payload(vec![
            Payload::DestinationRegister(Register::Reg1),
            Payload::Base(NETWORK),
            Payload::Offset(offset),
            Payload::Len(4),
        ])
        .into(),
        Expressions::Bitwise(vec![
            Bitwise::SourceRegister(Register::Reg1),
            Bitwise::DestinationRegister(Register::Reg1),
            Bitwise::Length(4),
            Bitwise::Mask(DataAttribute::Value(net.mask().to_be_bytes().to_vec())),
            Bitwise::Xor(DataAttribute::Value(vec![0; 4])),
        ])
        .into(),
        Expressions::Cmp(vec![
            Cmp::SourceRegister(Register::Reg1),
            Cmp::Op(Operator::Equal),
            Cmp::Data(DataAttribute::Value(net.network().octets().to_vec())),
        ])
        .into(),
    ]
}

fn daddr_in(net: Cidr) -> Vec<ListAttribute<ExpressionAttribute>> {
    addr_in(16, net)
}

fn saddr_in(net: Cidr) -> Vec<ListAttribute<ExpressionAttribute>> {
    addr_in(12, net)
}

/// The transport header's destination port (UDP's and TCP's both at offset 2).
fn dport(port: u16) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        Expressions::Payload(vec![
            Payload::DestinationRegister(Register::Reg1),
            Payload::Base(TRANSPORT),
            Payload::Offset(2),
            Payload::Len(2),
        ])
        .into(),
        Expressions::Cmp(vec![
            Cmp::SourceRegister(Register::Reg1),
            Cmp::Op(Operator::Equal),
            Cmp::Data(DataAttribute::Value(port.to_be_bytes().to_vec())),
        ])
        .into(),
    ]
}

/// The connection is established or related: `ct state & (established|related) != 0`.
fn ct_established() -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        Expressions::Other {
            expression_type: "ct".to_string(),
            attributes: vec![
                DefaultNla::new(NFTA_CT_KEY, NFT_CT_STATE.to_be_bytes().to_vec()),
                DefaultNla::new(NFTA_CT_DREG, 1u32.to_be_bytes().to_vec()),
            ],
        }
        .into(),
        Expressions::Bitwise(vec![
            Bitwise::SourceRegister(Register::Reg1),
            Bitwise::DestinationRegister(Register::Reg1),
            Bitwise::Length(4),
            Bitwise::Mask(DataAttribute::Value(CT_ESTABLISHED_OR_RELATED.to_ne_bytes().to_vec())),
            Bitwise::Xor(DataAttribute::Value(vec![0; 4])),
        ])
        .into(),
        Expressions::Cmp(vec![
            Cmp::SourceRegister(Register::Reg1),
            Cmp::Op(Operator::NotEqual),
            Cmp::Data(DataAttribute::Value(vec![0; 4])),
        ])
        .into(),
    ]
}

fn verdict(code: u32) -> ListAttribute<ExpressionAttribute> {
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(Register::Verdict),
        Immediate::Data(DataAttribute::Verdict(vec![VerdictAttribute::Code(
            netlink_packet_netfilter::nftables::Verdict::Other(code),
        )])),
    ])
    .into()
}

fn reject() -> ListAttribute<ExpressionAttribute> {
    Expressions::Other {
        expression_type: "reject".to_string(),
        attributes: vec![
            DefaultNla::new(NFTA_REJECT_TYPE, NFT_REJECT_ICMPX_UNREACH.to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_REJECT_ICMP_CODE, vec![NFT_REJECT_ICMPX_ADMIN_PROHIBITED]),
        ],
    }
    .into()
}

fn masquerade() -> ListAttribute<ExpressionAttribute> {
    ListAttribute::Element(vec![ExpressionAttribute::Name("masq".to_string())])
}

/// Sending a transaction to the kernel's nftables.
mod nft {
    use super::*;
    use netlink_packet_netfilter::none::ControlMessage;
    use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

    /// The subsystem a batch is for (`NFNL_SUBSYS_NFTABLES`).
    const NFTABLES: u16 = 10;

    /// Sends `messages` as one batch (all or nothing) and waits for the kernel to acknowledge
    /// each; the first error is the batch's.
    pub fn apply(messages: &[NetlinkMessage<NetfilterMessage>]) -> std::io::Result<()> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        let control = |m: ControlMessage| {
            let mut out = NetlinkMessage::from(NetfilterMessage::new(
                NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFTABLES),
                m,
            ));
            out.header.flags = NLM_F_REQUEST;
            out
        };
        let mut batch = vec![control(ControlMessage::BatchBegin)];
        batch.extend(messages.iter().cloned());
        batch.push(control(ControlMessage::BatchEnd));
        let mut bytes = Vec::new();
        for (seq, m) in batch.iter_mut().enumerate() {
            m.header.sequence_number = seq as u32;
            m.finalize();
            let at = bytes.len();
            bytes.resize(at + m.buffer_len(), 0);
            m.serialize(&mut bytes[at..]);
        }
        socket.send(&bytes, 0)?;
        // Every message but the batch's two markers asks for an acknowledgement.
        let mut waiting = messages.len();
        let mut buf = Vec::with_capacity(64 * 1024);
        while waiting > 0 {
            buf.clear();
            socket.recv(&mut buf, 0)?;
            let mut at = 0;
            while at < buf.len() {
                let m = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[at..])
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
                let len = m.header.length as usize;
                if let NetlinkPayload::Error(e) = &m.payload {
                    if let Some(code) = e.code {
                        return Err(std::io::Error::from_raw_os_error(-code.get()));
                    }
                    waiting -= 1;
                }
                if len == 0 {
                    break;
                }
                at += len.next_multiple_of(4);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_parse_and_hold_their_addresses() {
        let net: Cidr = "10.201.7.9/16".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(net.to_string(), "10.201.0.0/16");
        assert!(net.contains(Ipv4Addr::new(10, 201, 255, 1)) && !net.contains(Ipv4Addr::new(10, 202, 0, 1)));
        assert_eq!(net.size(), 65536);
        let host: Cidr = "198.51.100.10".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(host.prefix, 32);
        for bad in ["10.0.0.0/33", "300.1.1.1/8", "x"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        for denied in DENIED {
            assert!(denied.parse::<Cidr>().is_ok(), "{denied}");
        }
    }

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
        let rules = Ruleset {
            group: 0x5312_3456,
            subnet: DEFAULT_SUBNET.parse().unwrap_or_else(|e: String| panic!("{e}")),
            allow: &allow,
            dns: &dns,
        };
        ns.run(|| nft::apply(&rules.messages())).unwrap_or_else(|e| panic!("{e}"));
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
            "iifgroup 1393701974 ip daddr 169.254.0.0/16 reject with icmpx admin-prohibited",
            "iifgroup 1393701974 ip daddr 10.0.0.0/8 reject with icmpx admin-prohibited",
            "oifgroup 1393701974 ct state established,related accept",
            "oifgroup 1393701974 drop",
            "type filter hook input priority filter - 1; policy accept;",
            "iifgroup 1393701974 reject with icmpx admin-prohibited",
            "type nat hook postrouting priority srcnat; policy accept;",
            "ip saddr 10.201.0.0/16 oifgroup != 1393701974 masquerade",
        ] {
            assert!(listed.contains(want), "`{want}` is not in:\n{listed}");
        }
        // The allow rule and the resolvers' come before the refusals.
        let at = |s: &str| listed.find(s).unwrap_or(usize::MAX);
        assert!(at("10.9.0.0/16 accept") < at("10.0.0.0/8 reject"), "{listed}");
        assert!(at("udp dport 53 accept") < at("10.0.0.0/8 reject"), "{listed}");
        // A second start replaces it whole: no rule twice, none of the first's left.
        let rules = Ruleset { allow: &[], ..rules };
        ns.run(|| nft::apply(&rules.messages())).unwrap_or_else(|e| panic!("{e}"));
        let listed = ns.nft_list();
        assert_eq!(listed.matches("table inet sandman-53123456").count(), 1);
        assert!(!listed.contains("10.9.0.0/16"), "{listed}");
        assert_eq!(listed.matches("masquerade").count(), 1, "{listed}");
    }
}

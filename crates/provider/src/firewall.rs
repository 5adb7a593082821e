//! The host firewall of providers whose sandboxes' traffic goes through this host (the process
//! provider's veths, the docker provider's bridge): one nftables table per server, installed over
//! netlink (no `nft` binary needed), that refuses what a sandbox sends to the host itself and to
//! the private, loopback, link-local, shared and multicast ranges ([`DENIED`]) unless allowed,
//! lets its resolvers answer on port 53, drops its IPv6 and anything that starts a connection
//! towards it, and (for the process provider) masquerades the rest out of the host. Start at
//! [`Policy`] and [`apply`]; [`record`] and [`sweep`] keep the host from collecting the tables
//! of servers that are gone.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::Path;
use std::str::FromStr;

use netlink_packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, ChainMessage, Cmp, DataAttribute, ExpressionAttribute, Expressions, Hook, Immediate,
    InetHookNumber, ListAttribute, Meta, MetaKey, NfTablesMessage, Operator, Payload, Register, RuleAttribute,
    RuleMessage, TableAttribute, TableMessage, Verdict, VerdictAttribute,
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

/// Which interfaces a table's rules are about: the sandboxes' ends on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sandboxes {
    /// Every interface in this interface group (the process provider's veths).
    Group(u32),
    /// The interface of this name (the docker provider's bridge).
    Interface(String),
}

/// One server's table: what its sandboxes may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The table's name (`sandman-…`), the server's own.
    pub table: String,
    pub sandboxes: Sandboxes,
    /// Masquerade traffic from this network out of the host (the process provider's; Docker
    /// masquerades its bridge's itself).
    pub masquerade: Option<Cidr>,
    /// Networks the sandboxes may reach although [`DENIED`] holds them (`--egress-allow`).
    pub allow: Vec<Cidr>,
    /// Their resolvers, reachable on port 53 wherever they are.
    pub dns: Vec<Ipv4Addr>,
}

/// Where the host's servers record their tables (a file per table naming a directory of its
/// server's that exists while the server's sandboxes may), so that a server finds those whose
/// server is gone for good, and removes them: each one's rules are walked by every packet the
/// host forwards.
pub const TABLES_DIR: &str = "/run/sandman/tables";

/// Records `table` as the table of the server whose `marker` directory (the process provider's
/// state directory, the docker provider's `<state>/docker`) exists while it may have sandboxes.
pub fn record(dir: &Path, table: &str, marker: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::write(dir.join(table), marker.as_os_str().as_encoded_bytes())
}

/// Removes the tables whose server's marker directory no longer exists (removed, as a test's
/// state directory is), with their records; `own` is this server's marker. Every server's table
/// is named `sandman…` (the process provider's `sandman-<group>`, the docker provider's
/// `sandman_docker_<hash>`: a name that servers from before it, which took the marker of every
/// `sandman-` table for a process provider's state directory, leave alone).
pub fn sweep(dir: &Path, own: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let Ok(theirs) = std::fs::read_to_string(entry.path()) else { continue };
        let table = entry.file_name().to_string_lossy().into_owned();
        if Path::new(&theirs) == own || Path::new(&theirs).is_dir() || !table.starts_with("sandman") {
            continue;
        }
        if let Err(e) = remove(&table) {
            tracing::warn!(%table, err = %e, "cannot remove the nftables table of a server that is gone");
            continue;
        }
        tracing::info!(%table, server = %theirs, "removed the nftables table of a server that is gone");
        let _ = std::fs::remove_file(entry.path());
    }
}

/// Removes `table`; one that is not there is fine.
pub fn remove(table: &str) -> std::io::Result<()> {
    let delete = msg(
        NfTablesMessage::DeleteTable(TableMessage { attributes: vec![TableAttribute::Name(table.to_string())] }),
        0,
    );
    match apply_messages(&[delete]) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// The host's resolvers as its sandboxes can use them: the IPv4 nameservers of /etc/resolv.conf
/// that are not loopback (those are the host's own, out of every sandbox's reach); where it names
/// only loopback ones (systemd-resolved's stub), those systemd-resolved itself uses.
pub fn host_resolvers() -> Vec<Ipv4Addr> {
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

/// nftables' verdicts, as the kernel numbers them (`NF_DROP`, `NF_ACCEPT`).
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
/// `nft_reject`: a TCP reset, or an ICMP(v6) code whatever the family (admin-prohibited).
const NFT_REJECT_TCP_RST: u32 = 1;
const NFT_REJECT_ICMPX_UNREACH: u32 = 2;
/// The chain every refusal jumps to.
const REFUSE: &str = "refuse";
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

impl Policy {
    /// One transaction: the table made (so that it exists), deleted with whatever an earlier
    /// start put in it, then made again whole.
    pub fn messages(&self) -> Vec<NetlinkMessage<NetfilterMessage>> {
        let table = &self.table;
        let named = || TableMessage { attributes: vec![TableAttribute::Name(table.clone())] };
        let mut out = vec![
            msg(NfTablesMessage::NewTable(named()), NLM_F_CREATE),
            msg(NfTablesMessage::DeleteTable(named()), 0),
            msg(NfTablesMessage::NewTable(named()), NLM_F_CREATE),
        ];
        // Before the filter chains of others (Docker's, at 0), so that a refusal here is seen
        // first; an accept here does not outweigh their drop.
        let before_filter = (-1i32) as u32;
        let srcnat = 100u32;
        let mut chains = vec![
            ("forward", "filter", InetHookNumber::Forward, before_filter),
            ("input", "filter", InetHookNumber::LocalIn, before_filter),
        ];
        if self.masquerade.is_some() {
            chains.push(("postrouting", "nat", InetHookNumber::PostRouting, srcnat));
        }
        // A regular chain every refusal jumps to.
        out.push(msg(
            NfTablesMessage::NewChain(ChainMessage {
                attributes: vec![ChainAttribute::Table(table.clone()), ChainAttribute::Name(REFUSE.to_string())],
            }),
            NLM_F_CREATE,
        ));
        for (name, kind, hook, priority) in chains {
            out.push(msg(
                NfTablesMessage::NewChain(ChainMessage {
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
        let (from_ours, to_ours) = (|| self.sandboxes.matches(true), || self.sandboxes.matches(false));
        // refuse: a TCP connect is reset (its connect fails at once, whatever the rate); anything
        // else gets admin-prohibited, which the kernel sends at a limited rate.
        out.push(rule(
            REFUSE,
            [meta_eq(MetaKey::L4Proto, &[libc::IPPROTO_TCP as u8]), vec![reject(NFT_REJECT_TCP_RST, 0)]].concat(),
        ));
        out.push(rule(REFUSE, vec![reject(NFT_REJECT_ICMPX_UNREACH, NFT_REJECT_ICMPX_ADMIN_PROHIBITED)]));
        // forward: what a sandbox sends on.
        out.push(rule(
            "forward",
            [from_ours(), meta_eq(MetaKey::Nfproto, &[NFPROTO_IPV6]), vec![verdict(NF_DROP)]].concat(),
        ));
        for net in &self.allow {
            out.push(rule("forward", [from_ours(), ipv4(), daddr_in(*net), vec![verdict(NF_ACCEPT)]].concat()));
        }
        for server in &self.dns {
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
            out.push(rule("forward", [from_ours(), ipv4(), daddr_in(net), vec![jump(REFUSE)]].concat()));
        }
        // forward: what comes back to a sandbox, and nothing that starts a connection to it.
        out.push(rule("forward", [to_ours(), ct_established(), vec![verdict(NF_ACCEPT)]].concat()));
        out.push(rule("forward", [to_ours(), vec![verdict(NF_DROP)]].concat()));
        // input: nothing a sandbox sends reaches the host itself, on any address.
        out.push(rule("input", [from_ours(), vec![jump(REFUSE)]].concat()));
        // postrouting: out of the host under the host's address.
        if let Some(subnet) = self.masquerade {
            out.push(rule(
                "postrouting",
                [ipv4(), saddr_in(subnet), self.sandboxes.not_out(), vec![masquerade()]].concat(),
            ));
        }
        out
    }
}

impl Sandboxes {
    /// The packet came in from (`from`), or goes out to, a sandbox's interface.
    fn matches(&self, from: bool) -> Vec<ListAttribute<ExpressionAttribute>> {
        match (self, from) {
            (Sandboxes::Group(g), true) => meta_eq(MetaKey::Iifgroup, &g.to_ne_bytes()),
            (Sandboxes::Group(g), false) => meta_eq(MetaKey::Oifgroup, &g.to_ne_bytes()),
            (Sandboxes::Interface(name), true) => meta_eq(MetaKey::Iifname, &ifname(name)),
            (Sandboxes::Interface(name), false) => meta_eq(MetaKey::Oifname, &ifname(name)),
        }
    }

    /// The packet does not go out to a sandbox's interface.
    fn not_out(&self) -> Vec<ListAttribute<ExpressionAttribute>> {
        match self {
            Sandboxes::Group(g) => meta_cmp(MetaKey::Oifgroup, Operator::NotEqual, &g.to_ne_bytes()),
            Sandboxes::Interface(name) => meta_cmp(MetaKey::Oifname, Operator::NotEqual, &ifname(name)),
        }
    }
}

/// An interface name as the kernel holds it in a register: NUL-terminated, so that the compare
/// is of the whole name.
fn ifname(name: &str) -> Vec<u8> {
    let mut v = name.as_bytes().to_vec();
    v.push(0);
    v
}

/// Installs `policy`'s table (see [`Policy::messages`]) in this thread's network namespace.
pub fn apply(policy: &Policy) -> std::io::Result<()> {
    apply_messages(&policy.messages())
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
        Immediate::Data(DataAttribute::Verdict(vec![VerdictAttribute::Code(Verdict::Other(code))])),
    ])
    .into()
}

fn reject(kind: u32, code: u8) -> ListAttribute<ExpressionAttribute> {
    Expressions::Other {
        expression_type: "reject".to_string(),
        attributes: vec![
            DefaultNla::new(NFTA_REJECT_TYPE, kind.to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_REJECT_ICMP_CODE, vec![code]),
        ],
    }
    .into()
}

fn jump(chain: &str) -> ListAttribute<ExpressionAttribute> {
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(Register::Verdict),
        Immediate::Data(DataAttribute::Verdict(vec![
            VerdictAttribute::Code(Verdict::Jump),
            VerdictAttribute::Chain(chain.to_string()),
        ])),
    ])
    .into()
}

fn masquerade() -> ListAttribute<ExpressionAttribute> {
    ListAttribute::Element(vec![ExpressionAttribute::Name("masq".to_string())])
}

/// The subsystem a batch is for (`NFNL_SUBSYS_NFTABLES`).
const NFTABLES: u16 = 10;

/// Sends `messages` as one batch (all or nothing) and waits for the kernel to acknowledge each;
/// the first error is the batch's.
pub fn apply_messages(messages: &[NetlinkMessage<NetfilterMessage>]) -> std::io::Result<()> {
    use netlink_packet_netfilter::none::ControlMessage;
    use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
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
    fn a_policy_without_masquerade_has_no_nat_chain() {
        let policy = |masquerade| Policy {
            table: "sandman-t".into(),
            sandboxes: Sandboxes::Interface("smd0".into()),
            masquerade,
            allow: vec![],
            dns: vec![],
        };
        let chains =
            |p: &Policy| p.messages().iter().filter(|m| format!("{:?}", m.payload).contains("NewChain")).count();
        assert_eq!(chains(&policy(None)), 3);
        assert_eq!(chains(&policy(Some("10.201.0.0/16".parse().unwrap_or_else(|e: String| panic!("{e}"))))), 4);
    }
}

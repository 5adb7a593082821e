//! A minimal rtnetlink client for `--isolate-veth`: the few requests that give a sandbox a veth
//! of its own to the host (the pair, the host's route to it, its address, its gateway's
//! neighbour entry and its default route), each sent and acknowledged on a `NETLINK_ROUTE`
//! socket. A socket stays bound to the network namespace it was opened in, so one opened before
//! the sandbox's namespace exists configures the host's from inside it.
//!
//! Written out rather than taken from a netlink crate: the daemon is a small static binary, and
//! these few fixed messages are a page of code where a general library is most of a megabyte.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

// From the kernel's uapi headers (linux/netlink.h, linux/rtnetlink.h, linux/if_link.h,
// linux/veth.h, linux/neighbour.h).
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const RTM_NEWNEIGH: u16 = 28;
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_GROUP: u16 = 27;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_F_PERMANENT: u8 = 0x80;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_STATIC: u8 = 4;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_LINK: u8 = 253;
const RTN_UNICAST: u8 = 1;
const RTNH_F_ONLINK: u32 = 4;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;
const NUD_PERMANENT: u16 = 0x80;
const IFF_UP: u32 = 1;
const AF_UNSPEC: u8 = 0;
const AF_INET: u8 = 2;

/// One request being built: the netlink header, the family's fixed header, then attributes.
#[derive(Debug)]
struct Message {
    buf: Vec<u8>,
    /// Where each nested attribute still open begins.
    open: Vec<usize>,
}

impl Message {
    fn new(kind: u16, flags: u16, fixed: &[u8]) -> Message {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set by `bytes`
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // sequence, set by `bytes`
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel's
        let mut m = Message { buf, open: Vec::new() };
        m.raw(fixed);
        m
    }

    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self.buf.resize(self.buf.len().next_multiple_of(4), 0);
        self
    }

    fn attr(&mut self, kind: u16, data: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.raw(data)
    }

    fn begin(&mut self, kind: u16) -> &mut Self {
        self.open.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    fn end(&mut self) -> &mut Self {
        if let Some(at) = self.open.pop() {
            let len = (self.buf.len() - at) as u16;
            self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    fn bytes(&mut self, seq: u32) -> &[u8] {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

/// `struct ifinfomsg`: family, type, index, flags and the flags to change.
fn ifinfomsg(index: i32, flags: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0] = AF_UNSPEC;
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b[8..12].copy_from_slice(&flags.to_ne_bytes());
    b[12..16].copy_from_slice(&flags.to_ne_bytes());
    b
}

/// `struct rtmsg` of an IPv4 route in the main table.
fn rtmsg(dst_len: u8, scope: u8, flags: u32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0] = AF_INET;
    b[1] = dst_len;
    b[4] = RT_TABLE_MAIN;
    b[5] = RTPROT_STATIC;
    b[6] = scope;
    b[7] = RTN_UNICAST;
    b[8..12].copy_from_slice(&flags.to_ne_bytes());
    b
}

/// A `NETLINK_ROUTE` socket of the network namespace it was opened in.
#[derive(Debug)]
pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

impl Netlink {
    pub fn open() -> io::Result<Netlink> {
        // SAFETY: `socket` takes no pointers.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero `sockaddr_nl` (the kernel picks the port) is valid once its family
        // is set.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        let len = size_of::<libc::sockaddr_nl>() as libc::socklen_t;
        // SAFETY: the pointer and length describe a live `sockaddr_nl`.
        if unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Netlink { fd, seq: 0 })
    }

    /// Sends `m` and waits for the kernel's acknowledgement; answers the payload of the reply
    /// that came before it, if any (a `GET`'s).
    fn request(&mut self, m: &mut Message) -> io::Result<Vec<u8>> {
        self.seq += 1;
        let seq = self.seq;
        let bytes = m.bytes(seq);
        // SAFETY: the pointer and length describe a live buffer.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut reply = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            // SAFETY: the pointer and length describe a live, writable buffer.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            let mut at = 0;
            let got = &buf[..n as usize];
            while at + 16 <= got.len() {
                let len = u32::from_ne_bytes(got[at..at + 4].try_into().unwrap_or_default()) as usize;
                let kind = u16::from_ne_bytes(got[at + 4..at + 6].try_into().unwrap_or_default());
                let of = u32::from_ne_bytes(got[at + 8..at + 12].try_into().unwrap_or_default());
                if len < 16 || at + len > got.len() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "a truncated netlink message"));
                }
                if of == seq {
                    if kind == NLMSG_ERROR {
                        let code = i32::from_ne_bytes(got[at + 16..at + 20].try_into().unwrap_or_default());
                        return if code == 0 { Ok(reply) } else { Err(io::Error::from_raw_os_error(-code)) };
                    }
                    reply = got[at + 16..at + len].to_vec();
                }
                at += len.next_multiple_of(4);
            }
        }
    }

    /// The index of the link named `name` in this socket's namespace.
    pub fn index_of(&mut self, name: &str) -> io::Result<i32> {
        let mut m = Message::new(RTM_GETLINK, 0, &ifinfomsg(0, 0));
        m.attr(IFLA_IFNAME, &nul_terminated(name));
        let reply = self.request(&mut m)?;
        reply
            .get(4..8)
            .and_then(|b| b.try_into().ok())
            .map(i32::from_ne_bytes)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no index for link `{name}`")))
    }

    /// Makes a veth pair, both ends down (an end comes up only once the pair is whole, see
    /// [`Netlink::set_up`]): `host` (with `host_mac`, in interface group `group`) in this
    /// socket's namespace, its peer `peer` (with `peer_mac`) in the namespace `netns` names.
    pub fn add_veth(
        &mut self,
        host: &str,
        host_mac: [u8; 6],
        group: u32,
        peer: &str,
        peer_mac: [u8; 6],
        netns: &OwnedFd,
    ) -> io::Result<()> {
        let mut m = Message::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, &ifinfomsg(0, 0));
        m.attr(IFLA_IFNAME, &nul_terminated(host)).attr(IFLA_ADDRESS, &host_mac).attr(IFLA_GROUP, &group.to_ne_bytes());
        m.begin(IFLA_LINKINFO).attr(IFLA_INFO_KIND, b"veth").begin(IFLA_INFO_DATA).begin(VETH_INFO_PEER);
        m.raw(&ifinfomsg(0, 0))
            .attr(IFLA_IFNAME, &nul_terminated(peer))
            .attr(IFLA_ADDRESS, &peer_mac)
            .attr(IFLA_NET_NS_FD, &(netns.as_raw_fd() as u32).to_ne_bytes());
        m.end().end().end();
        self.request(&mut m).map(drop)
    }

    /// Brings link `index` up.
    pub fn set_up(&mut self, index: i32) -> io::Result<()> {
        let mut m = Message::new(RTM_NEWLINK, 0, &ifinfomsg(index, IFF_UP));
        self.request(&mut m).map(drop)
    }

    /// Removes the link named `name` (and with a veth, its peer, and the routes through them).
    pub fn del_link(&mut self, name: &str) -> io::Result<()> {
        let mut m = Message::new(RTM_DELLINK, 0, &ifinfomsg(0, 0));
        m.attr(IFLA_IFNAME, &nul_terminated(name));
        self.request(&mut m).map(drop)
    }

    /// A route to `dst`/32 out of link `index` (no gateway: the address is on that link).
    pub fn add_host_route(&mut self, dst: Ipv4Addr, index: i32) -> io::Result<()> {
        let mut m = Message::new(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, &rtmsg(32, RT_SCOPE_LINK, 0));
        m.attr(RTA_DST, &dst.octets()).attr(RTA_OIF, &(index as u32).to_ne_bytes());
        self.request(&mut m).map(drop)
    }

    /// `addr`/32 on link `index`.
    pub fn add_address(&mut self, addr: Ipv4Addr, index: i32) -> io::Result<()> {
        let mut fixed = [0u8; 8];
        fixed[0] = AF_INET;
        fixed[1] = 32;
        fixed[2] = IFA_F_PERMANENT;
        fixed[3] = RT_SCOPE_UNIVERSE;
        fixed[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
        let mut m = Message::new(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &fixed);
        m.attr(IFA_LOCAL, &addr.octets()).attr(IFA_ADDRESS, &addr.octets());
        self.request(&mut m).map(drop)
    }

    /// A permanent neighbour entry: `addr` is `mac` on link `index`, so that nothing is asked
    /// for it (ARP) and nothing can change it.
    pub fn add_neighbour(&mut self, addr: Ipv4Addr, mac: [u8; 6], index: i32) -> io::Result<()> {
        let mut fixed = [0u8; 12];
        fixed[0] = AF_INET;
        fixed[4..8].copy_from_slice(&index.to_ne_bytes());
        fixed[8..10].copy_from_slice(&NUD_PERMANENT.to_ne_bytes());
        let mut m = Message::new(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_EXCL, &fixed);
        m.attr(NDA_DST, &addr.octets()).attr(NDA_LLADDR, &mac);
        self.request(&mut m).map(drop)
    }

    /// The default route, through `gateway` on link `index` whatever its address (`onlink`).
    pub fn add_default_route(&mut self, gateway: Ipv4Addr, index: i32) -> io::Result<()> {
        let mut m = Message::new(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, &rtmsg(0, RT_SCOPE_UNIVERSE, RTNH_F_ONLINK));
        m.attr(RTA_GATEWAY, &gateway.octets()).attr(RTA_OIF, &(index as u32).to_ne_bytes());
        self.request(&mut m).map(drop)
    }
}

fn nul_terminated(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_are_measured_and_padded() {
        let mut m = Message::new(RTM_NEWLINK, NLM_F_CREATE, &ifinfomsg(0, IFF_UP));
        m.attr(IFLA_IFNAME, b"ab\0").begin(IFLA_LINKINFO).attr(IFLA_INFO_KIND, b"veth").end();
        let bytes = m.bytes(7).to_vec();
        assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap_or_default()) as usize, bytes.len());
        assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into().unwrap_or_default()), 7);
        // The name: 4 + 3 bytes, padded to 8.
        assert_eq!(&bytes[32..40], &[7, 0, 3, 0, b'a', b'b', 0, 0]);
        // The nest: its own 4 bytes and the kind's 8.
        assert_eq!(u16::from_ne_bytes([bytes[40], bytes[41]]), 12);
        assert_eq!(u16::from_ne_bytes([bytes[42], bytes[43]]), IFLA_LINKINFO | NLA_F_NESTED);
        assert_eq!(bytes.len(), 52);
    }
}

#[cfg(test)]
mod kernel_tests {
    use super::*;

    #[test]
    fn the_kernel_answers_a_request_for_a_links_index() {
        let mut n = Netlink::open().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(n.index_of("lo").ok(), Some(1));
        let err = n.index_of("no-such-link").err().map(|e| e.raw_os_error());
        assert_eq!(err, Some(Some(libc::ENODEV)));
    }
}

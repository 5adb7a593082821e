//! `--isolate`: makes the sandbox before the daemon's runtime starts. The daemon forks into new
//! mount, pid, cgroup (and, with `--isolate-net`, network) namespaces, so that it is PID 1 of its
//! own pid namespace, while a tiny single-threaded waiter stays outside to forward signals and
//! report its exit code. The child, still the host's root, assembles the sandbox's root (an
//! overlay over the host's root with a writable layer of its own, fresh `/proc`, `/sys`, `/dev`,
//! the sandbox's `/tmp` and work directory, and empty mounts over what must stay hidden),
//! switches to it, then joins a user namespace where it is root but the host sees an
//! unprivileged id, and confines itself (capabilities, `no_new_privs`, Landlock scopes) before it
//! serves. Start at [`enter`]; `docs/sandmand.md#isolation` has the picture.
//!
//! With a template ([`Isolation::template`], made once per server by [`make_template`]) the
//! daemon's mount namespace is a copy of one whose root is an empty read-only tmpfs with the
//! host's tree at [`TEMPLATE_HOST`], and it switches to the sandbox's root by moving it onto `/`
//! and `chroot`, after detaching the host's tree: `pivot_root` walks every thread on the machine
//! (`chroot_fs_refs`), so one per sandbox made each create cost in proportion to the sandboxes
//! held. Without a template it makes its namespace from the host's and uses `pivot_root`.

use std::io::{PipeReader, PipeWriter, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::sys::{self, netlink, ns};

/// How many ids (uids and gids alike) a sandbox has: its root is the first, mapped to
/// [`Isolation::ids`] on the host.
pub const IDS_PER_SANDBOX: u32 = 65536;

/// The capabilities a sandbox's root keeps (inside its own user namespace, over its own files):
/// the set container runtimes give by default. Every other one leaves the bounding set.
const KEPT_CAPS: [u32; 14] = [
    ns::cap::CHOWN,
    ns::cap::DAC_OVERRIDE,
    ns::cap::FOWNER,
    ns::cap::FSETID,
    ns::cap::KILL,
    ns::cap::SETGID,
    ns::cap::SETUID,
    ns::cap::SETPCAP,
    ns::cap::NET_BIND_SERVICE,
    ns::cap::NET_RAW,
    ns::cap::SYS_CHROOT,
    ns::cap::MKNOD,
    ns::cap::AUDIT_WRITE,
    ns::cap::SETFCAP,
];

/// Where a template's mount namespace holds the host's tree.
pub const TEMPLATE_HOST: &str = "/host";

/// The empty directory of a template's root where a sandbox's root is moved before it becomes `/`.
const TEMPLATE_NEW: &str = "/new";

/// The device nodes a sandbox's `/dev` gets from the host (all harmless, world-usable).
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// What `--isolate` asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Isolation {
    /// The host uid and gid the sandbox's root is (`--isolate-ids`); the sandbox has
    /// [`IDS_PER_SANDBOX`] ids from there. Never 0.
    pub ids: u32,
    /// An empty directory where the sandbox's root is assembled (`--isolate-root`); the mounts
    /// on it exist only in the sandbox's mount namespace.
    pub root: PathBuf,
    /// A network namespace too (`--isolate-net`), with only `lo`, brought up...
    pub net: bool,
    /// ...and, with `egress` (`--isolate-veth`), a veth to the host as its way out.
    pub egress: Option<Egress>,
    /// The most the sandbox may write (its writable layer, in memory, which holds every file it
    /// writes: its changes to the root, its `/tmp`, `/run`, `/var/tmp`, `/dev/shm` and working
    /// directory), in bytes; the kernel's default (half the memory) when `None`.
    pub layer_bytes: Option<u64>,
    /// Host paths the sandbox must not see (`--isolate-hide`): whited out in its writable layer,
    /// so they are simply not there (no mount shows where they were). The state directory, the
    /// daemon's and the server's binaries.
    pub hide: Vec<PathBuf>,
    /// The sandbox's working directory, a path inside it (the daemon's `--workdir`). Over the
    /// host's root: made fresh and empty in its writable layer, owned by its root, whatever the
    /// host has there. Over an image: the image's, made (root's) when the image has none.
    pub workdir: Option<PathBuf>,
    /// An image's layers (`--isolate-lower`, top first), each a directory unpacked once on the
    /// host and mounted idmapped: their files' owners are the sandbox's ids, whatever its range.
    /// Empty: the host's root file system is the lower layer (the `host` image).
    pub lower: Vec<PathBuf>,
    /// The sandbox's hostname (`--isolate-hostname`), its UTS namespace's; `None` leaves the
    /// host's showing. Over an image it is also the image's `/etc/hostname`, and with egress
    /// `/etc/hosts` names the sandbox's address by it, as a container's files do.
    pub hostname: Option<String>,
    /// A mount namespace made by [`make_template`] (`--isolate-template`, its `/proc/<pid>/ns/mnt`):
    /// the sandbox's namespace is a copy of it, and the switch to its root costs the same however
    /// many processes the machine runs. `None`: a copy of the host's, and `pivot_root`.
    pub template: Option<PathBuf>,
}

/// A sandbox's way out (`--isolate-veth` and its flags): a veth whose host end is `veth` (in
/// interface group `group`, which the host's firewall rules name) and whose sandbox end is
/// `eth0` with `addr`/32, a default route through [`GATEWAY`] (the host end, by a permanent
/// neighbour entry: nothing is asked for it), and `dns` as its resolvers. The host routes
/// `addr` to the veth; what the sandbox may reach through it is the host's firewall's to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Egress {
    pub veth: String,
    pub addr: Ipv4Addr,
    pub group: u32,
    pub dns: Vec<Ipv4Addr>,
}

/// The next hop of every sandbox's default route: a link-local address no host has, answered
/// for by the host end of its veth (Calico's choice), so that the host needs no address per
/// sandbox.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

impl Egress {
    /// The host end's MAC and the sandbox end's, locally administered, from the sandbox's
    /// address: unique on the host as the addresses are.
    fn macs(&self) -> ([u8; 6], [u8; 6]) {
        let [_, a, b, c] = self.addr.octets();
        ([0x02, 0x53, 0x4d, a, b, c], [0x02, 0x53, 0x4e, a, b, c])
    }
}

/// Why isolation could not be set up. The daemon does not start without it.
#[derive(Debug, thiserror::Error)]
pub enum IsolateError {
    #[error("--isolate-ids must be a host id above 0 with {IDS_PER_SANDBOX} ids free after it, not {0}")]
    Ids(u32),
    #[error("isolation needs root: the daemon runs as uid {0}")]
    NotRoot(u32),
    #[error("cannot create the sandbox's user namespace (needs root and user namespaces enabled)")]
    UserNamespace(#[source] std::io::Error),
    #[error("cannot map the sandbox's ids onto host ids {first}..{last}")]
    IdMap {
        first: u32,
        last: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the sandbox's namespaces (needs root)")]
    Namespaces(#[source] std::io::Error),
    #[error("cannot block signals for the waiter")]
    Signals(#[source] std::io::Error),
    #[error("cannot set the parent-death signal")]
    DeathSignal(#[source] std::io::Error),
    #[error("the waiting parent exited before the daemon started")]
    ParentGone,
    #[error("cannot {what} at `{}`", path.display())]
    Mount {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot switch to the sandbox's root")]
    PivotRoot(#[source] std::io::Error),
    #[error("cannot enter the isolation template `{}`", path.display())]
    Template {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot join the sandbox's user namespace")]
    JoinUser(#[source] std::io::Error),
    #[error("cannot become root of the sandbox's user namespace")]
    BecomeRoot(#[source] std::io::Error),
    #[error("cannot confine the daemon: {what}")]
    Confine {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bring the loopback interface up")]
    Loopback(#[source] std::io::Error),
    #[error("cannot set the sandbox's hostname to `{name}`")]
    Hostname {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot give the sandbox its veth `{veth}`: {what}")]
    Veth {
        veth: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Which side of the fork this process is on.
#[derive(Debug)]
pub enum Role {
    /// PID 1 of the new pid namespace, inside the sandbox's root, confined: go on and serve.
    Daemon,
    /// Outside: wait for the daemon with [`Waiter::wait`] and exit with its code.
    Waiter(Waiter),
}

/// The parent left outside the pid namespace.
#[derive(Debug)]
pub struct Waiter {
    child: i32,
    /// Held open for the waiter's whole life: the child learns the waiter is gone when this end
    /// closes (the parent-death signal covers the time after the child set it, this the time
    /// before).
    _lifeline: PipeWriter,
}

/// Signals the waiter handles: the two it forwards, and SIGCHLD for the daemon's exit.
const WAITED: [i32; 3] = [sys::SIGTERM, sys::SIGINT, sys::SIGCHLD];

/// Makes the sandbox and forks into it. Must be called while the process is single-threaded
/// (before the async runtime starts), after everything the daemon needs from the host's view
/// (its token, its listening socket, its environment file) has been read or opened.
pub fn enter(iso: &Isolation) -> Result<Role, IsolateError> {
    if iso.ids == 0 || iso.ids.checked_add(IDS_PER_SANDBOX - 1).is_none() {
        return Err(IsolateError::Ids(iso.ids));
    }
    let userns = user_namespace(iso.ids)?;
    // Opened here, where the host's paths are, and joined by the child only: the waiter stays in
    // the host's mount namespace (it writes the exit file there).
    let template = match &iso.template {
        Some(path) => Some(
            std::fs::File::open(path)
                .map(OwnedFd::from)
                .map_err(|source| IsolateError::Template { path: path.clone(), source })?,
        ),
        None => None,
    };
    // Opened in the host's network namespace, so that the child, in its own, can still make the
    // host's end of its veth and the host's route to it.
    let host_net = match &iso.egress {
        Some(e) if iso.net => Some(netlink::Netlink::open().map_err(veth_error(e, "open the host's netlink"))?),
        _ => None,
    };
    let mut flags = sys::NS_PID | ns::NS_CGROUP;
    if template.is_none() {
        flags |= sys::NS_MOUNT;
    }
    if iso.net {
        flags |= sys::NS_NET;
    }
    // Blocked before the fork so that a signal arriving before the waiter waits is kept pending,
    // not lost; the child unblocks them at once.
    sys::mask_signals(&WAITED, true).map_err(IsolateError::Signals)?;
    let (reader, writer) = std::io::pipe().map_err(IsolateError::Namespaces)?;
    match ns::clone_into(flags).map_err(IsolateError::Namespaces)? {
        Some(child) => {
            drop((reader, template, host_net));
            Ok(Role::Waiter(Waiter { child, _lifeline: writer }))
        }
        None => {
            drop(writer);
            become_init(iso, reader, userns, template, host_net)?;
            Ok(Role::Daemon)
        }
    }
}

/// A user namespace whose ids `0..IDS_PER_SANDBOX` are the host's `ids..`: made by a child that
/// unshares it and waits while this process (the host's root) writes its maps, then exits; the
/// namespace lives on in the descriptor.
fn user_namespace(ids: u32) -> Result<OwnedFd, IsolateError> {
    let (mut ready_r, mut ready_w) = std::io::pipe().map_err(IsolateError::UserNamespace)?;
    let (mut go_r, go_w) = std::io::pipe().map_err(IsolateError::UserNamespace)?;
    let Some(pid) = sys::fork().map_err(IsolateError::UserNamespace)? else {
        drop((ready_r, go_w));
        let ok = sys::unshare(ns::NS_USER).is_ok();
        let _ = ready_w.write_all(&[u8::from(ok)]);
        drop(ready_w);
        // Until the parent has the namespace and closes its end.
        let _ = go_r.read(&mut [0u8]);
        ns::exit_now(0)
    };
    drop((ready_w, go_r));
    let made = (|| {
        let mut ok = [0u8];
        ready_r.read_exact(&mut ok).map_err(IsolateError::UserNamespace)?;
        if ok[0] != 1 {
            // The child's own unshare failed; ask the kernel why, here.
            return Err(IsolateError::UserNamespace(
                std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
                    .ok()
                    .filter(|n| n.trim() == "0")
                    .map(|_| std::io::Error::other("user.max_user_namespaces is 0"))
                    .unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
            ));
        }
        let map = format!("0 {ids} {IDS_PER_SANDBOX}\n");
        let id_map = |source| IsolateError::IdMap { first: ids, last: ids + (IDS_PER_SANDBOX - 1), source };
        std::fs::write(format!("/proc/{pid}/uid_map"), &map).map_err(id_map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map).map_err(id_map)?;
        std::fs::File::open(format!("/proc/{pid}/ns/user")).map(OwnedFd::from).map_err(IsolateError::UserNamespace)
    })();
    drop(go_w);
    let _ = ns::wait_pid(pid);
    made
}

/// The child's half: die with the waiter, assemble the root, switch to it, become the
/// sandbox's root and confine itself.
fn become_init(
    iso: &Isolation,
    lifeline: PipeReader,
    userns: OwnedFd,
    template: Option<OwnedFd>,
    host_net: Option<netlink::Netlink>,
) -> Result<(), IsolateError> {
    sys::mask_signals(&WAITED, false).map_err(IsolateError::Signals)?;
    sys::set_parent_death_signal(sys::SIGKILL).map_err(IsolateError::DeathSignal)?;
    // The waiter may have died between the fork and the line above, when no signal was set.
    if sys::is_hung_up(lifeline.as_fd()).map_err(IsolateError::DeathSignal)? {
        return Err(IsolateError::ParentGone);
    }
    if let (Some(egress), Some(host_net)) = (&iso.egress, host_net) {
        // First, while `/proc` is still the host's: it names this namespace.
        give_veth(egress, host_net)?;
    }
    let host = match (template, &iso.template) {
        (Some(fd), Some(path)) => {
            let fail = |source| IsolateError::Template { path: path.clone(), source };
            // Joining leaves this process at the template's root; the copy is the sandbox's own.
            ns::setns(fd.as_fd(), sys::NS_MOUNT).map_err(fail)?;
            drop(fd);
            sys::unshare(sys::NS_MOUNT).map_err(fail)?;
            Path::new(TEMPLATE_HOST)
        }
        _ => Path::new("/"),
    };
    let merged = assemble(iso, host, userns.as_fd())?;
    if iso.net {
        sys::loopback_up().map_err(IsolateError::Loopback)?;
    }
    if iso.template.is_some() {
        move_root(&merged)?;
    } else {
        switch_root(&merged)?;
    }
    // Its arguments name host paths (the state directory, the sandbox's own directory); every
    // process of the sandbox may read PID 1's command line.
    ns::overwrite_cmdline("sandmand")
        .map_err(|source| IsolateError::Confine { what: "hide its command line", source })?;
    ns::setns(userns.as_fd(), ns::NS_USER).map_err(IsolateError::JoinUser)?;
    drop(userns);
    // Owned by the sandbox's user namespace, so that its root may name its host and use its IPC.
    sys::unshare(sys::NS_UTS | sys::NS_IPC).map_err(IsolateError::Namespaces)?;
    if let Some(name) = &iso.hostname {
        ns::set_hostname(name).map_err(|source| IsolateError::Hostname { name: name.clone(), source })?;
    }
    ns::become_root().map_err(IsolateError::BecomeRoot)?;
    // A change of credentials clears the parent-death signal: set it again, and look once more.
    sys::set_parent_death_signal(sys::SIGKILL).map_err(IsolateError::DeathSignal)?;
    if sys::is_hung_up(lifeline.as_fd()).map_err(IsolateError::DeathSignal)? {
        return Err(IsolateError::ParentGone);
    }
    drop(lifeline);
    confine()
}

fn veth_error(e: &Egress, what: &'static str) -> impl FnOnce(std::io::Error) -> IsolateError {
    let veth = e.veth.clone();
    move |source| IsolateError::Veth { veth, what, source }
}

/// Gives this process's (new) network namespace its way out: the veth pair, made from the host's
/// side (`host_net`, a socket of the host's namespace) with its peer moved in here as `eth0`; the
/// host's route to the sandbox's address; and in here, that address, the gateway's neighbour
/// entry and the default route. A veth of the same name left by a sandbox of the same slot whose
/// namespace the kernel has not finished tearing down is removed first (or found gone by then).
fn give_veth(e: &Egress, mut host_net: netlink::Netlink) -> Result<(), IsolateError> {
    let ours = std::fs::File::open("/proc/thread-self/ns/net")
        .map(OwnedFd::from)
        .map_err(veth_error(e, "open the sandbox's network namespace"))?;
    let (host_mac, sandbox_mac) = e.macs();
    let add = |n: &mut netlink::Netlink| n.add_veth(&e.veth, host_mac, e.group, "eth0", sandbox_mac, &ours);
    match add(&mut host_net) {
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            stale_removed(host_net.del_link(&e.veth)).map_err(veth_error(e, "remove a stale veth of the same name"))?;
            add(&mut host_net).map_err(veth_error(e, "make the veth pair"))?;
        }
        other => other.map_err(veth_error(e, "make the veth pair"))?,
    }
    let host_end = host_net.index_of(&e.veth).map_err(veth_error(e, "find the host's end"))?;
    host_net.set_up(host_end).map_err(veth_error(e, "bring the host's end up"))?;
    host_net.add_host_route(e.addr, host_end).map_err(veth_error(e, "route the sandbox's address to it"))?;
    drop(host_net);
    let mut inside = netlink::Netlink::open().map_err(veth_error(e, "open the sandbox's netlink"))?;
    let eth0 = inside.index_of("eth0").map_err(veth_error(e, "find eth0"))?;
    inside.set_up(eth0).map_err(veth_error(e, "bring eth0 up"))?;
    inside.add_address(e.addr, eth0).map_err(veth_error(e, "give eth0 its address"))?;
    inside.add_neighbour(GATEWAY, host_mac, eth0).map_err(veth_error(e, "pin the gateway's address"))?;
    inside.add_default_route(GATEWAY, eth0).map_err(veth_error(e, "route through the gateway"))
}

/// The removal of a stale veth: done when it went, or when it was gone by itself already (the
/// kernel finished tearing its namespace down between the make that found it and the delete).
fn stale_removed(deleted: std::io::Result<()>) -> std::io::Result<()> {
    match deleted {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        other => other,
    }
}

/// Builds the sandbox's root under `iso.root` and answers where it is: a tmpfs holding the
/// writable layer, an overlay of it over the host's root or the image's layers (mounted
/// idmapped through `userns`, the sandbox's user namespace), and the sandbox's own mounts in it.
/// `host` is where this mount namespace shows the host's tree (`/`, or [`TEMPLATE_HOST`]).
fn assemble(iso: &Isolation, host: &Path, userns: BorrowedFd<'_>) -> Result<PathBuf, IsolateError> {
    let on_host = |p: &Path| host.join(p.strip_prefix("/").unwrap_or(p));
    let mount = |what, source: Option<&Path>, target: &Path, fstype: Option<&str>, flags, data: Option<&str>| {
        ns::mount(source, target, fstype, flags, data).map_err(|source| IsolateError::Mount {
            what,
            path: target.to_path_buf(),
            source,
        })
    };
    let prep = |what, path: &Path, r: std::io::Result<()>| {
        r.map_err(|source| IsolateError::Mount { what, path: path.to_path_buf(), source })
    };
    let no_dev = ns::MS_NOSUID | ns::MS_NODEV;
    let no_exec = no_dev | ns::MS_NOEXEC;
    mount("make the mounts private", None, Path::new("/"), None, ns::MS_REC | ns::MS_PRIVATE, None)?;

    let root = &on_host(&iso.root);
    let size = iso.layer_bytes.map(|b| format!(",size={b}")).unwrap_or_default();
    mount(
        "mount the writable layer",
        Some(Path::new("tmpfs")),
        root,
        Some("tmpfs"),
        no_dev,
        Some(&format!("mode=0755{size}")),
    )?;
    let (upper, work, merged) = (root.join("upper"), root.join("work"), root.join("merged"));
    for dir in [&upper, &work, &merged] {
        prep("make the layer's directories", dir, std::fs::create_dir(dir))?;
    }
    prep("own the writable layer", &upper, ns::lchown(&upper, iso.ids, iso.ids))?;
    // Kept open for the daemon's life: a snapshot reads the layer through it (the tmpfs is in
    // no mount the host sees, and in none of the sandbox's once its root is switched).
    prep("keep the writable layer open", &upper, ns::keep_dir_at(&upper, sandman_wire::snapshots::LAYER_FD))?;
    let image = !iso.lower.is_empty();
    if !image {
        // An image has nothing of the host's to hide.
        for path in &iso.hide {
            white_out(&upper, host, path)?;
        }
    }
    // Relative to `root`, so that no path needs escaping in the options, and none of the host's
    // shows in the sandbox's mountinfo.
    prep("enter the layer", root, std::env::set_current_dir(root))?;
    let lowerdir = if image {
        let layers = root.join("l");
        prep("make the layers' mount points", &layers, std::fs::create_dir(&layers))?;
        for (i, layer) in iso.lower.iter().enumerate() {
            let point = layers.join(i.to_string());
            prep("make a layer's mount point", &point, std::fs::create_dir(&point))?;
            ns::mount_idmapped(&on_host(layer), &point, userns).map_err(|source| IsolateError::Mount {
                what: "mount an image's layer idmapped",
                path: layer.clone(),
                source,
            })?;
        }
        (0..iso.lower.len()).map(|i| format!("l/{i}")).collect::<Vec<_>>().join(":")
    } else {
        host.display().to_string()
    };
    mount(
        if image { "overlay the image's layers" } else { "overlay the host's root" },
        Some(Path::new("overlay")),
        &merged,
        Some("overlay"),
        0,
        Some(&format!("lowerdir={lowerdir},upperdir=upper,workdir=work")),
    )?;
    // Every path of the sandbox is resolved in its root, as the sandbox will resolve it: this
    // process is still the host's root in the host's tree, where an image's symbolic link
    // (`etc -> ../../../../host/etc`) would lead its writes and mounts.
    let at = |p: &str| {
        in_root(&merged, Path::new(p), true).map_err(|source| IsolateError::Mount {
            what: "resolve a path in the sandbox's root",
            path: merged.join(p.trim_start_matches('/')),
            source,
        })
    };
    if let Some(egress) = iso.egress.as_ref().filter(|_| iso.net) {
        own_file(&merged, Path::new("/etc/resolv.conf"), iso.ids, &resolv_conf(&egress.dns))?;
    }
    if image {
        // What an image may lack that every sandbox has: the mount points of its own file
        // systems, and a hosts file for `localhost`; and the files that name the sandbox, as a
        // container's do.
        for point in ["/proc", "/sys", "/dev", "/tmp"] {
            own_path(&merged, Path::new(point), 0, 0o755)?;
        }
        if let Some(name) = &iso.hostname {
            own_file(&merged, Path::new("/etc/hostname"), iso.ids, &format!("{name}\n"))?;
        }
        let image_hosts = std::fs::read_to_string(at("/etc/hosts")?).ok();
        let addr = iso.egress.as_ref().filter(|_| iso.net).map(|e| e.addr);
        if let Some(text) = hosts_file(image_hosts.as_deref(), iso.hostname.as_deref(), addr) {
            own_file(&merged, Path::new("/etc/hosts"), iso.ids, &text)?;
        }
    }

    // Every directory of the sandbox's own is a directory of the layer, bind-mounted: one tmpfs
    // per sandbox, because each superblock is one more the kernel's reclaim walks (every
    // sandbox's, on every allocation that reclaims), and a bind mount makes none. They share the
    // layer's size, so everything the sandbox writes is bounded and charged to its memory.
    let own_dir = |name: &str, uid: u32, mode: u32| {
        let dir = root.join(name);
        prep("make the layer's directories", &dir, std::fs::create_dir(&dir))?;
        prep("make the layer's directories", &dir, ns::lchown(&dir, uid, uid))?;
        prep(
            "make the layer's directories",
            &dir,
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)),
        )?;
        Ok::<_, IsolateError>(dir)
    };
    let bind_own = |what, dir: &Path, target: &Path| mount(what, Some(dir), target, None, ns::MS_BIND, None);
    // An own directory in place of whatever the lower layer has at `inside` (made there first
    // when it has nothing: the mount point then belongs to the host's root, unseen under it).
    let own_at = |what, name: &str, mode: u32, inside: &Path| {
        let target = merged.join(inside.strip_prefix("/").unwrap_or(inside));
        if !target.symlink_metadata().is_ok_and(|m| m.is_dir()) {
            prep("make a mount point", &target, std::fs::create_dir_all(&target))?;
        }
        bind_own(what, &own_dir(name, iso.ids, mode)?, &target)
    };
    if image {
        // The image's own /tmp, /run and working directory, as a container of it has them.
        if let Some(workdir) = &iso.workdir {
            own_path(&merged, workdir, iso.ids, 0o755)?;
        }
    } else {
        // Sockets and state of the host's services live in /run and /var/tmp, and the host's
        // files in /tmp: the sandbox gets empty ones of its own.
        own_at("give the sandbox a /tmp", "tmp", 0o1777, Path::new("/tmp"))?;
        own_at("give the sandbox an empty /run", "run", 0o755, Path::new("/run"))?;
        if merged.join("var/tmp").symlink_metadata().is_ok_and(|m| m.is_dir()) {
            own_at("give the sandbox an empty /var/tmp", "var-tmp", 0o1777, Path::new("/var/tmp"))?;
        }
        if let Some(workdir) = &iso.workdir {
            own_at("give the sandbox its working directory", "home", 0o755, workdir)?;
        }
    }
    // A bind remount changes the flags of that one mount.
    let read_only = ns::MS_REMOUNT | ns::MS_BIND | ns::MS_RDONLY | no_exec;

    mount("mount /proc", Some(Path::new("proc")), &at("/proc")?, Some("proc"), no_exec, None)?;
    mount("mount /sys", Some(Path::new("sysfs")), &at("/sys")?, Some("sysfs"), no_exec | ns::MS_RDONLY, None)?;
    let (cgroups, host_cgroups) = (at("/sys/fs/cgroup")?, on_host(Path::new("/sys/fs/cgroup")));
    mount_cgroups(&cgroups, &host_cgroups, &on_host(Path::new("/proc")), root)?;

    let dev = at("/dev")?;
    bind_own("give the sandbox a /dev", &own_dir("dev", 0, 0o755)?, &dev)?;
    for name in DEVICES {
        let node = dev.join(name);
        prep("make a device's mount point", &node, std::fs::File::create(&node).map(drop))?;
        mount("bind a device", Some(&on_host(Path::new("/dev")).join(name)), &node, None, ns::MS_BIND, None)?;
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        prep("link a device", &dev.join(link), std::os::unix::fs::symlink(to, dev.join(link)))?;
    }
    let (pts, shm) = (dev.join("pts"), dev.join("shm"));
    prep("make /dev/pts", &pts, std::fs::create_dir(&pts))?;
    prep("make /dev/shm", &shm, std::fs::create_dir(&shm))?;
    // gid 5 is `tty` inside.
    let pts_opts = format!("newinstance,ptmxmode=0666,mode=0620,gid={}", iso.ids + 5);
    mount(
        "mount /dev/pts",
        Some(Path::new("devpts")),
        &pts,
        Some("devpts"),
        ns::MS_NOSUID | ns::MS_NOEXEC,
        Some(&pts_opts),
    )?;
    bind_own("give the sandbox a /dev/shm", &own_dir("shm", iso.ids, 0o1777)?, &shm)?;
    // Each device is a mount of its own, so `nodev` here stops only nodes made later (none can
    // be: it is read-only).
    mount("make /dev read-only", None, &dev, None, read_only, None)?;
    Ok(merged)
}

/// Whites `path` (a host path) out of the sandbox's root: an overlay whiteout at its place in the
/// writable layer `upper`. A path the host (its tree at `host`) does not have needs nothing.
fn white_out(upper: &Path, host: &Path, path: &Path) -> Result<(), IsolateError> {
    let Some(rel) = path.strip_prefix("/").ok().filter(|r| !r.as_os_str().is_empty()) else { return Ok(()) };
    if host.join(rel).symlink_metadata().is_err() {
        return Ok(());
    }
    upper_parents(upper, host, rel)?;
    let target = upper.join(rel);
    ns::whiteout(&target).map_err(|source| IsolateError::Mount {
        what: "white out a hidden path",
        path: target,
        source,
    })
}

/// Writes a file of the sandbox's own at `inside` (its `/etc/resolv.conf`, say) through its
/// merged root, so into its writable layer, owned by its root (`ids`): it takes the place of
/// whatever the lower layer has there, a symbolic link included.
fn own_file(merged: &Path, inside: &Path, ids: u32, text: &str) -> Result<(), IsolateError> {
    let target = in_root(merged, inside, false).map_err(|source| IsolateError::Mount {
        what: "resolve a path in the sandbox's root",
        path: merged.join(inside.strip_prefix("/").unwrap_or(inside)),
        source,
    })?;
    let fail = |source| IsolateError::Mount { what: "write a file of the sandbox's own", path: target.clone(), source };
    if let Some(parent) = target.parent().and_then(|p| p.strip_prefix(merged).ok()) {
        own_path(merged, &Path::new("/").join(parent), 0, 0o755)?;
    }
    if target.symlink_metadata().is_ok_and(|m| !m.is_file()) {
        std::fs::remove_file(&target).map_err(fail)?;
    }
    std::fs::write(&target, text).map_err(fail)?;
    ns::lchown(&target, ids, ids).map_err(fail)?;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).map_err(fail)
}

/// Makes the directory `inside` of the merged root (and what is missing above it), each made
/// owned by `uid` (host ids: the sandbox's root is `ids`, and the host's root shows as nobody)
/// with `mode`. One there already is left as it is.
fn own_path(merged: &Path, inside: &Path, uid: u32, mode: u32) -> Result<(), IsolateError> {
    let resolved = in_root(merged, inside, true).map_err(|source| IsolateError::Mount {
        what: "resolve a path in the sandbox's root",
        path: merged.join(inside.strip_prefix("/").unwrap_or(inside)),
        source,
    })?;
    let mut at = merged.to_path_buf();
    // No symbolic link is left on the way: what is missing is made inside the root.
    for part in resolved.strip_prefix(merged).unwrap_or(Path::new("")).components() {
        at.push(part);
        if at.symlink_metadata().is_ok() {
            continue;
        }
        let fail =
            |source| IsolateError::Mount { what: "make a directory of the sandbox's root", path: at.clone(), source };
        std::fs::create_dir(&at).map_err(fail)?;
        ns::lchown(&at, uid, uid).map_err(fail)?;
        std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode)).map_err(fail)?;
    }
    Ok(())
}

/// Makes the directories above `rel` in the writable layer `upper`, each with the owner and mode
/// of the lower layer's (the host's tree at `host`), since an upper directory's attributes are
/// what the merged one shows. A lower directory missing is made as the host's root's, 0755.
fn upper_parents(upper: &Path, host: &Path, rel: &Path) -> Result<(), IsolateError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let fail = |what, p: &Path| {
        let path = p.to_path_buf();
        move |source| IsolateError::Mount { what, path, source }
    };
    let (mut made, mut lower) = (upper.to_path_buf(), host.to_path_buf());
    for part in rel.parent().into_iter().flat_map(Path::components) {
        made.push(part);
        lower.push(part);
        if made.symlink_metadata().is_ok() {
            // Made for an earlier path.
            continue;
        }
        let (mode, uid, gid) = match lower.symlink_metadata() {
            Ok(meta) if meta.is_dir() => (meta.mode() & 0o7777, meta.uid(), meta.gid()),
            Ok(_) => {
                let not_dir = std::io::Error::other("not a directory in the lower layer (paths are given resolved)");
                return Err(fail("make a directory of the writable layer above", &lower)(not_dir));
            }
            Err(_) => (0o755, 0, 0),
        };
        std::fs::DirBuilder::new()
            .mode(mode)
            .create(&made)
            .map_err(fail("make a directory of the writable layer", &made))?;
        ns::lchown(&made, uid, gid).map_err(fail("make a directory of the writable layer", &made))?;
        std::fs::set_permissions(&made, std::fs::Permissions::from_mode(mode))
            .map_err(fail("make a directory of the writable layer", &made))?;
    }
    Ok(())
}

/// Where the sandbox path `inside` is under `root` once `root` is its `/`: every symbolic link
/// on the way resolved as the sandbox would resolve it (an absolute target from `root`, `..`
/// never above it), the last one too when `follow_last`. What does not exist yet is taken as it
/// is named. So the answer is under `root` whatever links the image holds; nothing in the
/// sandbox runs yet to change them.
fn in_root(root: &Path, inside: &Path, follow_last: bool) -> std::io::Result<PathBuf> {
    use std::collections::VecDeque;
    use std::path::Component;
    /// As the kernel's: past this many links a lookup fails with ELOOP.
    const MAX_LINKS: u32 = 40;
    let parts = |p: &Path| -> VecDeque<std::ffi::OsString> {
        p.components()
            .filter_map(|c| match c {
                Component::Normal(name) => Some(name.to_os_string()),
                Component::ParentDir => Some("..".into()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
            })
            .collect()
    };
    let (mut todo, mut resolved, mut links) = (parts(inside), PathBuf::new(), 0);
    while let Some(part) = todo.pop_front() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let next = resolved.join(&part);
        let is_link = root.join(&next).symlink_metadata().is_ok_and(|m| m.file_type().is_symlink());
        if !is_link || (todo.is_empty() && !follow_last) {
            resolved = next;
            continue;
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
        }
        let target = std::fs::read_link(root.join(&next))?;
        if target.is_absolute() {
            resolved = PathBuf::new();
        }
        let mut rest = parts(&target);
        rest.extend(todo);
        todo = rest;
    }
    Ok(root.join(resolved))
}

/// The `/etc/hosts` of an image that has none.
const HOSTS: &str = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";

/// What an image sandbox's `/etc/hosts` becomes, given the image's own (`None`: it has none):
/// [`HOSTS`] when it has none, and a line naming the sandbox's address by its hostname when it
/// has both (as Docker writes for a container on a network; without one, its name resolves to
/// nothing, as there). `None`: the image's stays as it is.
fn hosts_file(image: Option<&str>, hostname: Option<&str>, addr: Option<Ipv4Addr>) -> Option<String> {
    let line = hostname.zip(addr).map(|(name, addr)| format!("{addr}\t{name}\n"));
    match (image, line) {
        (None, line) => Some(format!("{HOSTS}{}", line.unwrap_or_default())),
        (Some(_), None) => None,
        (Some(text), Some(line)) if text.is_empty() || text.ends_with('\n') => Some(format!("{text}{line}")),
        (Some(text), Some(line)) => Some(format!("{text}\n{line}")),
    }
}

/// Checks a `--isolate-hostname`: what `sethostname` takes and resolvers read, 1 to 64 bytes of
/// letters, digits, `-` and `.`, neither first.
pub fn parse_hostname(name: &str) -> Result<String, String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['-', '.'])
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.'));
    if ok {
        Ok(name.to_string())
    } else {
        Err(format!("`{name}` is no hostname: 1 to 64 letters, digits, `-` and `.`, not starting with `-` or `.`"))
    }
}

/// A sandbox's `/etc/resolv.conf`: its resolvers (none: every lookup fails at once), tried for at
/// most two seconds each.
fn resolv_conf(dns: &[Ipv4Addr]) -> String {
    let mut text = String::from("# The sandbox's resolvers, given by its server (sandman serve --dns).\n");
    for server in dns {
        text.push_str(&format!("nameserver {server}\n"));
    }
    text.push_str("options timeout:2 attempts:2\n");
    text
}

/// Mounts, read-only under `at`, each cgroup hierarchy the host mounts under `/sys/fs/cgroup`
/// (`base` in this mount namespace, whose `/proc` is at `proc`); their mount points are made in a
/// directory of the sandbox's `layer`. The child is in a cgroup namespace of its own, so each
/// shows the sandbox's cgroup as its root: what the daemon's observer reads for
/// `GET /v1/conditions`.
fn mount_cgroups(at: &Path, base: &Path, proc: &Path, layer: &Path) -> Result<(), IsolateError> {
    let mountinfo = std::fs::read_to_string(proc.join("self/mountinfo")).unwrap_or_default();
    let hierarchies = cgroup_mounts(&mountinfo, base);
    if hierarchies.is_empty() {
        return Ok(());
    }
    let fail = |what, source| IsolateError::Mount { what, path: at.to_path_buf(), source };
    let ro = ns::MS_RDONLY | ns::MS_NOSUID | ns::MS_NODEV | ns::MS_NOEXEC;
    // The unified hierarchy alone (cgroup v2) is mounted on `at` itself; hierarchies below it
    // (v1, or the hybrid's `unified`) need a directory of their own for their mount points.
    let one_at_base = hierarchies.iter().any(|h| h.rel.as_os_str().is_empty());
    if !one_at_base {
        let points = layer.join("cgroup");
        std::fs::create_dir(&points).map_err(|e| fail("make the cgroups' mount points", e))?;
        ns::mount(Some(&points), at, None, ns::MS_BIND, None).map_err(|e| fail("bind the cgroups' mount points", e))?;
    }
    for h in &hierarchies {
        let target = if h.rel.as_os_str().is_empty() { at.to_path_buf() } else { at.join(&h.rel) };
        if target != at {
            std::fs::create_dir_all(&target).map_err(|e| fail("make a cgroup mount point", e))?;
        }
        ns::mount(Some(Path::new("cgroup")), &target, Some(h.fstype), ro, h.options.as_deref())
            .map_err(|e| fail("mount a cgroup hierarchy", e))?;
    }
    if !one_at_base {
        ns::mount(None, at, None, ns::MS_REMOUNT | ns::MS_BIND | ro, None)
            .map_err(|e| fail("make the cgroups' mount points read-only", e))?;
    }
    Ok(())
}

/// One cgroup hierarchy the host mounts under `/sys/fs/cgroup`.
#[derive(Debug, PartialEq, Eq)]
struct CgroupMount {
    /// Below `/sys/fs/cgroup` (empty for the unified hierarchy mounted there).
    rel: PathBuf,
    fstype: &'static str,
    /// v1: its controllers (or `name=…`); v2: none.
    options: Option<String>,
}

/// The cgroup hierarchies in `/proc/self/mountinfo` mounted under `base`, once each.
fn cgroup_mounts(mountinfo: &str, base: &Path) -> Vec<CgroupMount> {
    let mut out: Vec<CgroupMount> = Vec::new();
    for line in mountinfo.lines() {
        // `id parent maj:min root mountpoint options [optional...] - fstype source superoptions`
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let Some(point) = left.split(' ').nth(4) else { continue };
        let Ok(rel) = Path::new(point).strip_prefix(base) else { continue };
        let mut right = right.split(' ');
        let (Some(fstype), _, Some(superopts)) = (right.next(), right.next(), right.next()) else { continue };
        let (fstype, options) = match fstype {
            "cgroup2" => ("cgroup2", None),
            "cgroup" => {
                let keep: Vec<&str> = superopts.split(',').filter(|o| !matches!(*o, "rw" | "ro")).collect();
                ("cgroup", Some(keep.join(",")))
            }
            _ => continue,
        };
        if out.iter().all(|m| m.rel != rel) {
            out.push(CgroupMount { rel: rel.to_path_buf(), fstype, options });
        }
    }
    out
}

/// Makes `merged` this mount namespace's root and detaches the host's (`pivot_root(".", ".")`).
fn switch_root(merged: &Path) -> Result<(), IsolateError> {
    std::env::set_current_dir(merged).map_err(IsolateError::PivotRoot)?;
    ns::pivot_root(Path::new("."), Path::new(".")).map_err(IsolateError::PivotRoot)?;
    ns::umount_detach(Path::new(".")).map_err(IsolateError::PivotRoot)?;
    std::env::set_current_dir("/").map_err(IsolateError::PivotRoot)
}

/// [`switch_root`] in a copy of a template: moves `merged` (and every mount under it) to the
/// template's empty directory, detaches the host's tree, moves the sandbox's root onto `/` and
/// makes it this process's root. Every mount below it is mounted on the root of the one below,
/// so `..` cannot climb out of it (not even after a `chroot` elsewhere), and there is nothing to
/// climb to: the template's root is an empty read-only tmpfs and the host's tree is gone.
fn move_root(merged: &Path) -> Result<(), IsolateError> {
    let new = Path::new(TEMPLATE_NEW);
    ns::mount(Some(merged), new, None, ns::MS_MOVE, None).map_err(IsolateError::PivotRoot)?;
    std::env::set_current_dir("/").map_err(IsolateError::PivotRoot)?;
    ns::umount_detach(Path::new(TEMPLATE_HOST)).map_err(IsolateError::PivotRoot)?;
    std::env::set_current_dir(new).map_err(IsolateError::PivotRoot)?;
    ns::mount(Some(Path::new(".")), Path::new("/"), None, ns::MS_MOVE, None).map_err(IsolateError::PivotRoot)?;
    ns::chroot(Path::new(".")).map_err(IsolateError::PivotRoot)?;
    std::env::set_current_dir("/").map_err(IsolateError::PivotRoot)
}

/// Makes this process's mount namespace a template for sandboxes' (`sandmand
/// --make-isolation-template DIR`, run once per server, which keeps the process alive and hands
/// each daemon its `/proc/<pid>/ns/mnt`): a namespace of its own whose root is an empty tmpfs
/// mounted on `dir` (an empty directory), read-only, with the host's tree at [`TEMPLATE_HOST`]
/// and an empty [`TEMPLATE_NEW`]. Its one `pivot_root` is the only one the server's sandboxes
/// cost. Must be called while the process is single-threaded.
pub fn make_template(dir: &Path) -> Result<(), IsolateError> {
    let mount = |what, source: Option<&Path>, target: &Path, fstype: Option<&str>, flags, data: Option<&str>| {
        ns::mount(source, target, fstype, flags, data).map_err(|source| IsolateError::Mount {
            what,
            path: target.to_path_buf(),
            source,
        })
    };
    sys::unshare(sys::NS_MOUNT).map_err(IsolateError::Namespaces)?;
    mount("make the mounts private", None, Path::new("/"), None, ns::MS_REC | ns::MS_PRIVATE, None)?;
    let opts = ns::MS_NOSUID | ns::MS_NODEV | ns::MS_NOEXEC;
    mount("mount the template's root", Some(Path::new("tmpfs")), dir, Some("tmpfs"), opts, Some("mode=0755,size=16k"))?;
    for sub in [TEMPLATE_HOST, TEMPLATE_NEW] {
        let path = dir.join(sub.trim_start_matches('/'));
        std::fs::create_dir(&path).map_err(|source| IsolateError::Mount { what: "make a directory", path, source })?;
    }
    ns::pivot_root(dir, &dir.join(TEMPLATE_HOST.trim_start_matches('/'))).map_err(IsolateError::PivotRoot)?;
    std::env::set_current_dir("/").map_err(IsolateError::PivotRoot)?;
    let ro = ns::MS_REMOUNT | ns::MS_BIND | ns::MS_RDONLY | opts;
    mount("make the template's root read-only", None, Path::new("/"), None, ro, None)
}

/// The last steps, as the sandbox's root: nothing started from here may gain privileges,
/// hold the capabilities a container runtime withholds, signal or reach an abstract socket
/// outside the sandbox, or read the daemon's memory.
fn confine() -> Result<(), IsolateError> {
    let fail = |what| move |source| IsolateError::Confine { what, source };
    // Nested user namespaces would give a sandbox's process every capability over namespaces of
    // its own, and the kernel surface that comes with it.
    std::fs::write("/proc/sys/user/max_user_namespaces", "0").map_err(fail("no nested user namespaces"))?;
    ns::drop_bounding_caps(&KEPT_CAPS).map_err(fail("drop capabilities"))?;
    ns::no_new_privs().map_err(fail("set no_new_privs"))?;
    if ns::landlock_abi().is_some_and(|v| v >= 6) {
        ns::landlock_scope().map_err(fail("scope abstract sockets and signals with Landlock"))?;
    }
    ns::not_dumpable().map_err(fail("make the daemon undumpable"))
}

/// Whether this kernel confines abstract Unix sockets and signals to the sandbox (Landlock ABI
/// 6); reported in the sandbox's conditions.
pub fn scopes_abstract_sockets() -> bool {
    ns::landlock_abi().is_some_and(|v| v >= 6)
}

impl Waiter {
    /// Forwards SIGTERM and SIGINT to the daemon until it exits; returns its exit code (128 +
    /// the signal when it was killed by one).
    pub fn wait(self) -> i32 {
        loop {
            // Reap first: the daemon may have exited before we got here, its SIGCHLD pending.
            match sys::try_wait_pid(self.child) {
                Ok(Some(status)) => return sys::exit_code_of(status),
                Ok(None) => {}
                Err(err) => {
                    eprintln!("error: cannot wait for the isolated daemon: {err}");
                    return 2;
                }
            }
            match sys::wait_signal(&WAITED) {
                Ok(sys::SIGCHLD) => {}
                Ok(sig) => {
                    let _ = sys::kill_pid(self.child, sig);
                }
                Err(err) => {
                    eprintln!("error: cannot wait for signals: {err}");
                    let _ = sys::kill_pid(self.child, sys::SIGKILL);
                }
            }
        }
    }
}

/// Checks, before [`enter`] and as the host's root, what the sandbox is made from: root, and the
/// directory its root is assembled on.
pub fn precheck(iso: &Isolation) -> Result<(), IsolateError> {
    if sys::euid() != 0 {
        return Err(IsolateError::NotRoot(sys::euid()));
    }
    if !iso.root.is_dir() {
        return Err(IsolateError::Mount {
            what: "assemble the sandbox's root (no such directory)",
            path: iso.root.clone(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a stale veth of the sandbox's slot that went by itself between the make that
    /// found it and the delete failed the create (`No such device`).
    #[test]
    fn a_stale_veth_gone_by_itself_is_removed_and_other_errors_stay() {
        assert!(stale_removed(Ok(())).is_ok());
        assert!(stale_removed(Err(std::io::Error::from_raw_os_error(libc::ENODEV))).is_ok());
        let denied = stale_removed(Err(std::io::Error::from_raw_os_error(libc::EPERM)));
        assert_eq!(denied.map_err(|e| e.raw_os_error()), Err(Some(libc::EPERM)));
    }

    /// Regression: the daemon wrote an image sandbox's /etc/resolv.conf (and made its mount
    /// points and working directory) through the image's symbolic links while it was still the
    /// host's root in the host's tree, so `etc -> ../../../../host/etc` wrote the host's files.
    #[test]
    fn an_images_links_resolve_inside_its_root_never_out_of_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = dir.path().join("merged");
        std::fs::create_dir_all(root.join("usr/bin")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(root.join("data")).unwrap_or_else(|e| panic!("{e}"));
        let link = |at: &str, to: &str| std::os::unix::fs::symlink(to, root.join(at)).unwrap_or_else(|e| panic!("{e}"));
        link("bin", "usr/bin");
        link("up", &format!("{}outside", "../".repeat(20)));
        link("abs", "/outside/deeper");
        link("data/back", "../../../../usr");
        link("loop", "loop");
        link("hosts", "/run/hosts");
        let r = |p: &str, follow| {
            in_root(&root, Path::new(p), follow)
                .map(|p| p.strip_prefix(&root).unwrap_or_else(|e| panic!("{e}")).to_path_buf())
        };
        assert_eq!(r("/bin/sh", true).unwrap_or_else(|e| panic!("{e}")), Path::new("usr/bin/sh"));
        assert_eq!(
            r("/up/etc/resolv.conf", true).unwrap_or_else(|e| panic!("{e}")),
            Path::new("outside/etc/resolv.conf")
        );
        assert_eq!(r("/abs/x", true).unwrap_or_else(|e| panic!("{e}")), Path::new("outside/deeper/x"));
        assert_eq!(r("/data/back/bin", true).unwrap_or_else(|e| panic!("{e}")), Path::new("usr/bin"));
        assert_eq!(r("/../../etc", true).unwrap_or_else(|e| panic!("{e}")), Path::new("etc"));
        assert_eq!(r("/", true).unwrap_or_else(|e| panic!("{e}")), Path::new(""));
        // The last link is left for the caller to replace, or followed.
        assert_eq!(r("/hosts", false).unwrap_or_else(|e| panic!("{e}")), Path::new("hosts"));
        assert_eq!(r("/hosts", true).unwrap_or_else(|e| panic!("{e}")), Path::new("run/hosts"));
        assert_eq!(r("/loop/x", true).expect_err("a loop").raw_os_error(), Some(libc::ELOOP));
    }

    #[test]
    fn an_image_sandboxs_hosts_file_names_its_address_by_its_hostname() {
        let addr = Some(Ipv4Addr::new(10, 201, 0, 7));
        let named = "10.201.0.7\tsb-1\n";
        // The image has none: localhost, and the sandbox's own name with egress.
        assert_eq!(hosts_file(None, None, None).as_deref(), Some(HOSTS));
        assert_eq!(hosts_file(None, Some("sb-1"), None).as_deref(), Some(HOSTS), "no address, no name (as Docker)");
        assert_eq!(hosts_file(None, Some("sb-1"), addr), Some(format!("{HOSTS}{named}")));
        // The image's own is kept, the name added.
        assert_eq!(hosts_file(Some("1.2.3.4 db\n"), None, addr), None);
        assert_eq!(hosts_file(Some("1.2.3.4 db\n"), Some("sb-1"), None), None);
        assert_eq!(hosts_file(Some("1.2.3.4 db\n"), Some("sb-1"), addr), Some(format!("1.2.3.4 db\n{named}")));
        assert_eq!(hosts_file(Some("1.2.3.4 db"), Some("sb-1"), addr), Some(format!("1.2.3.4 db\n{named}")));
        assert_eq!(hosts_file(Some(""), Some("sb-1"), addr), Some(named.to_string()));
    }

    #[test]
    fn hostnames_are_what_sethostname_and_resolvers_take() {
        for ok in ["sb-9c3694e8b5b8", "a", "x.example", &"a".repeat(64)] {
            assert_eq!(parse_hostname(ok).as_deref(), Ok(ok));
        }
        for bad in ["", "-x", ".x", "a_b", "a b", "ä", &"a".repeat(65)] {
            assert!(parse_hostname(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cgroup_hierarchies_are_read_from_mountinfo() {
        let info = "\
30 25 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
33 30 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
34 30 0:30 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
40 25 0:40 / /proc rw - proc proc rw";
        let m = cgroup_mounts(info, Path::new("/sys/fs/cgroup"));
        assert_eq!(m.len(), 4, "{m:?}");
        assert_eq!(m[0], CgroupMount { rel: "cpu".into(), fstype: "cgroup", options: Some("cpu".into()) });
        assert_eq!(m[2], CgroupMount { rel: "unified".into(), fstype: "cgroup2", options: None });
        assert_eq!(m[3].options.as_deref(), Some("xattr,name=systemd"));
        let v2 =
            cgroup_mounts("28 1 0:25 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate", Path::new("/sys/fs/cgroup"));
        assert_eq!(v2, vec![CgroupMount { rel: "".into(), fstype: "cgroup2", options: None }]);
        // In a copy of a template, the host's hierarchies are under its `/host`.
        let copied = "31 30 0:27 / /host/sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu";
        let m = cgroup_mounts(copied, Path::new("/host/sys/fs/cgroup"));
        assert_eq!(m, vec![CgroupMount { rel: "cpu".into(), fstype: "cgroup", options: Some("cpu".into()) }]);
    }

    #[test]
    fn ids_must_leave_room_for_a_whole_range() {
        let iso = Isolation { ids: u32::MAX - 10, ..Default::default() };
        assert!(matches!(enter(&iso), Err(IsolateError::Ids(_))));
        let iso = Isolation { ids: 0, ..Default::default() };
        assert!(matches!(enter(&iso), Err(IsolateError::Ids(0))));
    }
}

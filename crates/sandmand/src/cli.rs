//! The daemon's command line: flags, isolation before the runtime starts, then [`crate::run`].
//! The `sandmand` binary is [`main_with`]; `sandman` embeds the same entry point.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use crate::isolate::{self, Isolation, Role};
use crate::sys::Rlimits;
use crate::{Ending, Listen, Settings};
use clap::{Parser, Subcommand};

/// Sandman's in-sandbox daemon: exec, processes, shell sessions, files and archives over HTTP.
#[derive(Debug, Parser)]
#[command(name = "sandmand", version)]
struct Args {
    /// `host:port` or `unix:/path/to.sock`.
    #[arg(long, default_value = "0.0.0.0:7778")]
    listen: Listen,
    /// Read the bearer token from this file (used when SANDMAN_TOKEN is unset).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Remove the --token-file once read, before anything else runs: what the daemon starts
    /// cannot find it (the docker provider hands the token over so). The daemon does not start
    /// when it cannot remove it.
    #[arg(long, requires = "token_file")]
    consume_token_file: bool,
    /// With no authenticated call for this long, kill every process and exit (e.g. 60s).
    #[arg(long, value_parser = crate::parse_duration)]
    lease: Option<Duration>,
    /// Shell for `command` strings and sessions.
    #[arg(long, default_value = "/bin/sh")]
    shell: String,
    /// Default working directory of commands (default: the daemon's own). With --isolate, a path
    /// inside the sandbox, made fresh and empty, owned by the sandbox's root.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Largest file or archive upload in bytes (0 = no limit).
    #[arg(long, default_value_t = 0)]
    max_upload_bytes: u64,
    /// The sandbox's disk, in bytes: a file upload or an archive extraction that would write
    /// more is stopped with 413 (0 = no limit).
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    disk_limit: u64,
    /// A gzipped archive may unpack to at most this many times its compressed size.
    #[arg(long, value_name = "N", default_value_t = crate::DEFAULT_EXPANSION_RATIO,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_expansion_ratio: u64,
    /// The largest `max_output_bytes` of `/v1/exec` and session runs, whose output is held
    /// until the command ends.
    #[arg(long, value_name = "BYTES", default_value_t = sandman_wire::bounds::MAX_OUTPUT_BYTES.max,
          value_parser = clap::value_parser!(u64).range(0..=sandman_wire::bounds::MAX_OUTPUT_BYTES.max))]
    max_output_bytes: u64,
    /// Command output held in memory at once, over every exec, background process and session run.
    #[arg(long, value_name = "BYTES", default_value_t = crate::budget::DEFAULT_MAX_BUFFERED_OUTPUT)]
    max_buffered_output: u64,
    /// Connections served at once; past it, new ones wait until one closes.
    #[arg(long, value_name = "N", default_value_t = crate::DEFAULT_MAX_CONNECTIONS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65_536))]
    max_connections: usize,
    /// A connection that sends no whole request head this long (after it opens, or after its
    /// last answer) is closed.
    #[arg(long, value_parser = crate::parse_duration, default_value = "60s")]
    header_read_timeout: Duration,
    /// Time children get between SIGTERM and SIGKILL when the daemon is asked to stop.
    #[arg(long, value_parser = crate::parse_duration, default_value = "5s")]
    shutdown_grace: Duration,
    /// Log filter (also RUST_LOG), e.g. `info` or `sandmand=debug`.
    #[arg(long, default_value = "info")]
    log: String,
    /// Run as PID 1 of a sandbox of its own (needs root): new user, mount, pid, cgroup, ipc and
    /// uts namespaces; an overlay over the host's root with a writable layer in memory; fresh
    /// /proc, /sys and /dev; the sandbox's root mapped to unprivileged host ids; no capability
    /// a container runtime withholds, no_new_privs, Landlock scopes.
    #[arg(long, requires_all = ["isolate_ids", "isolate_root"])]
    isolate: bool,
    /// With --isolate: a mount namespace made by `sandmand isolation-template` (its
    /// `/proc/<pid>/ns/mnt`) to copy, instead of the host's; the switch to the sandbox's root then
    /// costs the same however many processes the machine runs.
    #[arg(long, requires = "isolate", value_name = "FILE")]
    isolate_template: Option<PathBuf>,
    /// With --isolate: the host uid and gid the sandbox's root is (65536 ids from there).
    #[arg(long, requires = "isolate", value_name = "ID")]
    isolate_ids: Option<u32>,
    /// With --isolate: an empty directory where the sandbox's root is assembled.
    #[arg(long, requires = "isolate", value_name = "DIR")]
    isolate_root: Option<PathBuf>,
    /// With --isolate, a network namespace too: only `lo`, brought up.
    #[arg(long, requires = "isolate")]
    isolate_net: bool,
    /// With --isolate-net, a way out: a veth pair whose host end is NAME (the sandbox's end is
    /// its eth0), the host's route to --isolate-addr through it, and a default route through
    /// the host end. Needs --isolate-addr and --isolate-group.
    #[arg(long, requires_all = ["isolate_net", "isolate_addr", "isolate_group"], value_name = "NAME")]
    isolate_veth: Option<String>,
    /// With --isolate-veth: the sandbox's IPv4 address.
    #[arg(long, requires = "isolate_veth", value_name = "ADDR")]
    isolate_addr: Option<std::net::Ipv4Addr>,
    /// With --isolate-veth: the interface group of the host end, which the host's firewall names.
    #[arg(long, requires = "isolate_veth", value_name = "N")]
    isolate_group: Option<u32>,
    /// With --isolate-veth: a resolver for the sandbox's /etc/resolv.conf; repeatable.
    #[arg(long = "isolate-dns", requires = "isolate_veth", value_name = "ADDR")]
    isolate_dns: Vec<std::net::Ipv4Addr>,
    /// With --isolate: the most the sandbox may write, in bytes (its writable layer, in memory:
    /// its changes to the root, /tmp, /run, /var/tmp, /dev/shm and its working directory).
    #[arg(long, requires = "isolate", value_name = "BYTES")]
    isolate_layer_bytes: Option<u64>,
    /// With --isolate: an image's layer, unpacked on the host, as a lower layer of the sandbox's
    /// root instead of the host's root; repeatable, top first (as overlayfs's lowerdir).
    #[arg(long = "isolate-lower", requires = "isolate", value_name = "DIR")]
    isolate_lower: Vec<PathBuf>,
    /// With --isolate: the sandbox's hostname (else the host's shows). Over an image, also its
    /// /etc/hostname, and with --isolate-veth the name of its address in /etc/hosts.
    #[arg(long, requires = "isolate", value_name = "NAME", value_parser = isolate::parse_hostname)]
    isolate_hostname: Option<String>,
    /// With --isolate: a host path the sandbox must not see (whited out); repeatable.
    #[arg(long = "isolate-hide", requires = "isolate", value_name = "PATH")]
    isolate_hide: Vec<PathBuf>,
    /// Set up what --isolate asks for, then exit: 0 when this host can isolate a sandbox, else
    /// the reason. A provider runs it once at start.
    #[arg(long, requires = "isolate", hide = true)]
    check_isolation: bool,
    /// The commands' environment, a JSON object of strings, over the daemon's own (a request's
    /// `env` overrides both). Read before isolating; the daemon's own environment never takes it.
    #[arg(long, value_name = "PATH")]
    env_file: Option<PathBuf>,
    /// RLIMIT_AS (bytes of address space) of every process the daemon starts.
    #[arg(long, value_name = "BYTES")]
    rlimit_as: Option<u64>,
    /// RLIMIT_FSIZE (largest file written, in bytes) of every process the daemon starts.
    #[arg(long, value_name = "BYTES")]
    rlimit_fsize: Option<u64>,
    /// RLIMIT_NOFILE (open files) of every process the daemon starts.
    #[arg(long, value_name = "N")]
    rlimit_nofile: Option<u64>,
    /// Join this cgroup (v1 controller or v2 directory) before anything else; repeatable. The
    /// daemon and everything it starts are then held to its limits.
    #[arg(long = "cgroup", value_name = "DIR")]
    cgroups: Vec<PathBuf>,
    /// Leave variables whose names start with this out of the commands' environment (the
    /// daemon's own environment otherwise passes on); repeatable. For what a platform adds that
    /// a controlled run must not see (`KUBERNETES_`).
    #[arg(long = "drop-env", value_name = "PREFIX")]
    drop_env: Vec<String>,
    /// Write the exit code here when the daemon exits by itself, for a supervisor that is not
    /// its parent (and so cannot wait for it): `3` is the lease lapsing.
    #[arg(long, value_name = "PATH")]
    exit_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Copy this binary to DEST (for images without a shell or `cp`).
    Install { dest: PathBuf },
    /// Make a mount namespace for isolated daemons to copy (`--isolate-template`), its root an
    /// empty tmpfs mounted on DIR (an empty directory), and hold it until stdin closes: prints
    /// `ready` once it is made. A provider runs one for all its sandboxes.
    #[command(hide = true)]
    IsolationTemplate { dir: PathBuf },
    /// Start daemons by forking this process, on requests read from stdin (one end of a
    /// `SOCK_SEQPACKET` pair): a provider runs one for all its isolated sandboxes
    /// (`crate::fork_server`).
    #[command(hide = true)]
    ForkServer,
}

/// Runs the daemon with `argv` (the program name first) and answers its exit code.
pub fn main_with(argv: Vec<OsString>) -> ExitCode {
    let args = Args::parse_from(argv);
    if let Some(Command::ForkServer) = &args.command {
        return match crate::fork_server::serve() {
            crate::fork_server::Served::Closed => ExitCode::SUCCESS,
            // A forked child: the daemon, as an exec of it would have run.
            crate::fork_server::Served::Daemon(argv) => main_with(argv),
            crate::fork_server::Served::Failed(e) => {
                eprintln!("error: fork server: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(Command::IsolationTemplate { dir }) = &args.command {
        return match isolate::make_template(dir) {
            Ok(()) => {
                use std::io::{Read, Write};
                let mut out = std::io::stdout();
                if writeln!(out, "ready").and_then(|()| out.flush()).is_err() {
                    return ExitCode::from(2);
                }
                // Held until whoever started it closes stdin (or exits).
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        };
    }
    if let Some(Command::Install { dest }) = &args.command {
        return match crate::install(dest) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: cannot install sandmand to `{}`: {e}", dest.display());
                ExitCode::from(2)
            }
        };
    }
    // First of all: nothing the daemon allocates or starts may escape the sandbox's limits.
    if let Err(e) = join_cgroups(&args.cgroups) {
        return fail(&e);
    }
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| args.log.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    if args.check_isolation {
        let isolation = isolation_of(&args);
        return match isolate::precheck(&isolation).and_then(|()| isolate::enter(&isolation)) {
            Ok(Role::Daemon) => ExitCode::SUCCESS,
            Ok(Role::Waiter(waiter)) => ExitCode::from(waiter.wait().clamp(0, 255) as u8),
            Err(e) => fail(&e),
        };
    }
    // As a container's init, nothing the daemon starts may read its memory, environment or
    // descriptors (the token among them) through /proc/1: a container's root has no
    // CAP_SYS_PTRACE to overcome this. Before the token is read.
    if std::process::id() == 1
        && let Err(e) = crate::sys::ns::not_dumpable()
    {
        return fail(&crate::StartError::Undumpable(e));
    }
    let token = match crate::load_token(std::env::var("SANDMAN_TOKEN").ok(), args.token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail(&e),
    };
    if args.consume_token_file
        && let Some(path) = &args.token_file
        && let Err(source) = std::fs::remove_file(path)
    {
        return fail(&crate::StartError::ConsumeToken { path: path.clone(), source });
    }
    let env = match args.env_file.as_deref().map(read_env_file).transpose() {
        Ok(env) => env.unwrap_or_default(),
        Err(e) => return fail(&e),
    };
    // Namespaces before the runtime: forking needs a single-threaded process, and the token, the
    // environment and the listening socket are taken first because the sandbox cannot see them.
    let mut unix_listener = None;
    if args.isolate {
        if let Listen::Unix(path) = &args.listen {
            match bind_unix(path) {
                Ok(l) => unix_listener = Some(l),
                Err(e) => return fail(&e),
            }
        }
        let isolation = isolation_of(&args);
        if let Err(e) = isolate::precheck(&isolation) {
            return fail(&e);
        }
        match isolate::enter(&isolation) {
            Ok(Role::Daemon) => tracing::info!(net = args.isolate_net, "isolated: PID 1 of a sandbox of its own"),
            Ok(Role::Waiter(waiter)) => {
                // The sandbox has its own; this side's copy would keep the socket answering
                // after the daemon is gone.
                drop(unix_listener);
                let code = waiter.wait().clamp(0, 255) as u8;
                if let Some(path) = &args.exit_file
                    && let Err(e) = write_exit_file(path, code)
                {
                    eprintln!("warning: cannot write the exit code to `{}`: {e}", path.display());
                }
                return ExitCode::from(code);
            }
            Err(e) => return fail(&e),
        }
    }
    let exit_file = args.exit_file.clone();
    let args_isolated = args.isolate;
    let settings = Settings {
        listen: args.listen,
        token,
        lease: args.lease,
        shell: args.shell,
        workdir: args.workdir,
        max_upload_bytes: args.max_upload_bytes,
        limits: crate::Limits {
            disk_bytes: args.disk_limit,
            expansion_ratio: args.max_expansion_ratio,
            max_output_bytes: args.max_output_bytes,
            max_buffered_output: args.max_buffered_output,
            max_connections: args.max_connections,
            header_read_timeout: args.header_read_timeout.max(Duration::from_millis(1)),
        },
        shutdown_grace: args.shutdown_grace,
        drop_env: args.drop_env,
        env,
        unix_listener,
        rlimits: Rlimits {
            address_space: args.rlimit_as,
            file_size: args.rlimit_fsize,
            open_files: args.rlimit_nofile,
        },
    };
    // One thread serves: the daemon mostly waits on children and sockets, and a single thread
    // keeps its idle footprint to a few MiB. File work and the starts of commands go to the
    // blocking pool, whose threads leave after a second idle: thousands of idle sandboxes on
    // one machine keep no threads (each a task of the kernel's `pid_max`) for work done.
    let runtime = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let code = match runtime.block_on(crate::run(settings)) {
        Ok(Ending::Stopped) => 0,
        Ok(Ending::LeaseExpired) => crate::EXIT_LEASE_EXPIRED as u8,
        Err(e) => fail_code(&e),
    };
    // Isolated, the waiter outside writes it: the sandbox cannot see the path.
    if let Some(path) = exit_file.as_ref().filter(|_| !args_isolated)
        && let Err(e) = write_exit_file(path, code)
    {
        eprintln!("warning: cannot write the exit code to `{}`: {e}", path.display());
    }
    ExitCode::from(code)
}

/// How long a thread of the daemon's blocking pool waits for more work before it exits.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// The signals the daemon handles, which only the event loop's thread takes.
const HANDLED_SIGNALS: [i32; 3] = [crate::sys::SIGCHLD, crate::sys::SIGTERM, crate::sys::SIGINT];

/// The daemon's runtime: one thread serving, and a blocking pool that starts commands and does
/// file work. The pool's threads block the signals the daemon handles, so that the kernel hands
/// each SIGCHLD (one per command) to the event loop, which reads it, instead of waking a pool
/// thread asleep between starts to run the handler.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(16)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .on_thread_start(|| {
            if let Err(err) = crate::sys::mask_signals(&HANDLED_SIGNALS, true) {
                tracing::warn!(%err, "cannot block signals in a blocking-pool thread");
            }
        })
        .build()
}

/// Why the environment file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum EnvFileError {
    #[error("cannot read the environment file `{}`", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the environment file `{}` is not a JSON object of strings", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the environment file `{}` has an invalid variable `{name}`", path.display())]
    Invalid { path: PathBuf, name: String },
}

/// The commands' environment from `--env-file`.
fn read_env_file(path: &Path) -> Result<BTreeMap<String, String>, EnvFileError> {
    let bytes = std::fs::read(path).map_err(|source| EnvFileError::Read { path: path.to_path_buf(), source })?;
    let env: BTreeMap<String, String> =
        serde_json::from_slice(&bytes).map_err(|source| EnvFileError::Parse { path: path.to_path_buf(), source })?;
    if let Some((k, _)) =
        env.iter().find(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        return Err(EnvFileError::Invalid { path: path.to_path_buf(), name: k.clone() });
    }
    Ok(env)
}

/// Binds the daemon's Unix socket (replacing one an earlier run left).
fn bind_unix(path: &Path) -> Result<std::os::unix::net::UnixListener, crate::StartError> {
    let _ = std::fs::remove_file(path);
    std::os::unix::net::UnixListener::bind(path)
        .map_err(|source| crate::StartError::Listen { addr: format!("unix:{}", path.display()), source })
}

/// What `--isolate` and its flags ask for.
fn isolation_of(args: &Args) -> Isolation {
    Isolation {
        ids: args.isolate_ids.unwrap_or_default(),
        root: args.isolate_root.clone().unwrap_or_default(),
        net: args.isolate_net,
        egress: match (&args.isolate_veth, args.isolate_addr, args.isolate_group) {
            (Some(veth), Some(addr), Some(group)) => {
                Some(isolate::Egress { veth: veth.clone(), addr, group, dns: args.isolate_dns.clone() })
            }
            _ => None,
        },
        layer_bytes: args.isolate_layer_bytes,
        hide: args.isolate_hide.clone(),
        workdir: args.workdir.clone(),
        lower: args.isolate_lower.clone(),
        hostname: args.isolate_hostname.clone(),
        template: args.isolate_template.clone(),
    }
}

/// Writes `code` to `path` whole or not at all (a temporary file renamed over it).
fn write_exit_file(path: &Path, code: u8) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{code}\n"))?;
    std::fs::rename(&tmp, path)
}

/// A cgroup the daemon was told to join and could not.
#[derive(Debug, thiserror::Error)]
#[error("cannot join the cgroup `{}` (writing to its cgroup.procs)", dir.display())]
pub struct CgroupError {
    dir: PathBuf,
    #[source]
    source: std::io::Error,
}

/// Moves this process into each cgroup in `dirs`: `0` written to `cgroup.procs` names the writer,
/// and moves its whole thread group (here still one thread, before the runtime and any fork).
pub fn join_cgroups(dirs: &[PathBuf]) -> Result<(), CgroupError> {
    for dir in dirs {
        // Not `create`: a missing cgroup is an error, never a file made in its place.
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"0"))
            .map_err(|source| CgroupError { dir: dir.clone(), source })?;
    }
    Ok(())
}

fn fail(err: &dyn std::error::Error) -> ExitCode {
    ExitCode::from(fail_code(err))
}

/// Prints the error with its causes; answers the exit code of a failure.
fn fail_code(err: &dyn std::error::Error) -> u8 {
    let mut msg = format!("error: {err}");
    let mut cur = err.source();
    while let Some(e) = cur {
        msg.push_str(&format!("\n  caused by: {e}"));
        cur = e.source();
    }
    eprintln!("{msg}");
    2
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread of the blocking pool (every start runs on one) blocks SIGCHLD, so that the
    /// kernel never wakes one just to run the handler; the event loop's thread takes it.
    #[test]
    fn only_the_event_loop_takes_the_daemons_signals() {
        let rt = runtime().unwrap_or_else(|e| panic!("{e}"));
        let blocked = |status: String| {
            let mask = status.lines().find_map(|l| l.strip_prefix("SigBlk:\t")).unwrap_or("0").to_string();
            let mask = u64::from_str_radix(&mask, 16).unwrap_or(0);
            HANDLED_SIGNALS.iter().map(|&s| mask & (1 << (s - 1)) != 0).collect::<Vec<_>>()
        };
        let pool = rt
            .block_on(async {
                tokio::task::spawn_blocking(|| std::fs::read_to_string("/proc/thread-self/status")).await
            })
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(blocked(pool), [true; 3]);
        let this = std::fs::read_to_string("/proc/thread-self/status").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(blocked(this), [false; 3], "the event loop's thread blocks the daemon's signals");
    }

    #[test]
    fn a_cgroup_that_cannot_be_joined_is_named() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let missing = dir.path().join("no-such-cgroup");
        let err = join_cgroups(std::slice::from_ref(&missing)).err().unwrap_or_else(|| panic!("joined"));
        assert!(err.to_string().contains("no-such-cgroup"), "{err}");
        assert!(!missing.exists(), "a file was made in the cgroup's place");
        assert!(join_cgroups(&[]).is_ok());
    }
}

//! Turning a request's `argv`/`command`, `env`, `cwd` and `user` into a ready `Command`: its own
//! process group, a clean environment (never the daemon's token), and the user's ids.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use crate::error::{DaemonError, DaemonResult};
use crate::sys::{ChildSetup, Rlimits, SignalSet};

/// PATH used when neither the sandbox nor the request sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What every process started by the daemon inherits unless the request says otherwise.
#[derive(Debug, Clone)]
pub struct Defaults {
    /// The sandbox environment: the daemon's own, less anything `SANDMAN_*`. Shared by every
    /// launch ([`Env`]), never copied into each.
    pub env: Arc<BTreeMap<String, String>>,
    pub cwd: PathBuf,
    /// Shell for `command` strings and sessions.
    pub shell: String,
    /// Where user names are looked up.
    pub passwd: PathBuf,
    pub euid: u32,
    /// Resource limits set on every process started (`--rlimit-*`).
    pub rlimits: Rlimits,
    /// The daemon holds `rlimits.file_size` itself ([`crate::sys::hold_file_size`]): every child
    /// inherits it, so a start need not set it and can do without a fork.
    pub file_size_held: bool,
    /// The signals the daemon ignores (it was started from a background job, say, or SIGXFSZ
    /// once it holds the file size limit): every child resets them to their defaults before it
    /// execs.
    pub ignored_signals: SignalSet,
}

impl Defaults {
    /// Defaults from the daemon's own environment and working directory.
    pub fn from_process(shell: String, cwd: Option<PathBuf>) -> Self {
        let mut env: BTreeMap<String, String> = std::env::vars().filter(|(k, _)| !k.starts_with("SANDMAN_")).collect();
        env.entry("PATH".into()).or_insert_with(|| DEFAULT_PATH.into());
        let cwd = cwd.or_else(|| std::env::current_dir().ok()).unwrap_or_else(|| PathBuf::from("/"));
        Defaults {
            env: Arc::new(env),
            cwd,
            shell,
            passwd: PathBuf::from("/etc/passwd"),
            euid: crate::sys::euid(),
            rlimits: Rlimits::default(),
            file_size_held: false,
            ignored_signals: crate::sys::ignored_signals(),
        }
    }
}

/// A command's environment: the sandbox's, shared by every launch, with the call's own variables
/// over it.
#[derive(Debug, Clone, Default)]
pub struct Env {
    base: Arc<BTreeMap<String, String>>,
    over: BTreeMap<String, String>,
}

impl Env {
    pub fn new(base: Arc<BTreeMap<String, String>>) -> Env {
        Env { base, over: BTreeMap::new() }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.over.get(name).or_else(|| self.base.get(name)).map(String::as_str)
    }

    /// Sets `name` for this command only.
    pub fn insert(&mut self, name: String, value: String) {
        self.over.insert(name, value);
    }

    /// Every variable once, the call's own value where it set one.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let inherited = self.base.iter().filter(|(k, _)| !self.over.contains_key(*k));
        inherited.chain(&self.over).map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// A user to run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserIds {
    pub uid: u32,
    pub gid: u32,
    pub name: Option<String>,
    pub home: Option<String>,
}

/// A validated launch: every field checked, nothing started yet.
#[derive(Debug, Clone)]
pub struct Launch {
    pub argv: Vec<String>,
    pub env: Env,
    pub cwd: PathBuf,
    pub user: Option<UserIds>,
    pub rlimits: Rlimits,
    /// Signals the command starts with at their default action rather than ignored.
    pub ignored_signals: SignalSet,
}

/// The parts of a request that say what to run and how.
#[derive(Debug, Default)]
pub struct LaunchRequest {
    pub argv: Option<Vec<String>>,
    pub command: Option<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

impl Launch {
    /// Parses and checks a request against the defaults.
    pub fn parse(defaults: &Defaults, req: LaunchRequest) -> DaemonResult<Launch> {
        let argv = match (req.argv, req.command) {
            (Some(_), Some(_)) => {
                return Err(DaemonError::InvalidArgument("give either `argv` or `command`, not both".into()));
            }
            (None, None) => return Err(DaemonError::InvalidArgument("give `argv` or `command`".into())),
            (Some(argv), None) => {
                if argv.is_empty() || argv[0].is_empty() {
                    return Err(DaemonError::InvalidArgument("`argv` must name a program".into()));
                }
                argv
            }
            (None, Some(command)) => vec![defaults.shell.clone(), "-c".into(), command],
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(DaemonError::InvalidArgument("`argv` must not contain NUL bytes".into()));
        }
        let mut env = Env::new(Arc::clone(&defaults.env));
        for (k, v) in &req.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(DaemonError::InvalidArgument(format!("invalid environment variable `{k}`")));
            }
        }
        let user = match req.user.as_deref() {
            None | Some("") => None,
            Some(spec) => Some(lookup_user(&defaults.passwd, spec)?),
        };
        if let Some(u) = &user {
            if u.uid != defaults.euid && defaults.euid != 0 {
                return Err(DaemonError::InvalidArgument(format!(
                    "cannot run as uid {}: the daemon runs as uid {} and is not root",
                    u.uid, defaults.euid
                )));
            }
            if let Some(home) = &u.home {
                env.insert("HOME".into(), home.clone());
            }
            if let Some(name) = &u.name {
                env.insert("USER".into(), name.clone());
                env.insert("LOGNAME".into(), name.clone());
            }
        }
        for (k, v) in req.env {
            env.insert(k, v);
        }
        let cwd = match req.cwd {
            None => defaults.cwd.clone(),
            Some(cwd) => {
                let p = PathBuf::from(&cwd);
                if !p.is_absolute() {
                    return Err(DaemonError::InvalidArgument(format!("`cwd` `{cwd}` is not absolute")));
                }
                if !p.is_dir() {
                    return Err(DaemonError::InvalidArgument(format!("`cwd` `{cwd}` is not a directory")));
                }
                p
            }
        };
        let mut rlimits = defaults.rlimits;
        if defaults.file_size_held {
            rlimits.file_size = None;
        }
        Ok(Launch { argv, env, cwd, user, rlimits, ignored_signals: defaults.ignored_signals })
    }

    /// A `Command` in a new process group, with stdout and stderr piped and the given stdin.
    pub fn command(&self, stdin: Stdio) -> Command {
        let mut cmd = self.base();
        cmd.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        crate::sys::set_child_setup_on_exec(
            &mut cmd,
            ChildSetup {
                rlimits: self.rlimits,
                controlling_tty: false,
                reset_signals: !self.ignored_signals.is_empty(),
            },
        );
        cmd
    }

    /// A `Command` whose stdin, stdout and stderr are the terminal `slave`, in a session of its
    /// own (so also a process group of its own) with that terminal as its controlling terminal.
    pub fn command_on_pty(&self, slave: &OwnedFd) -> std::io::Result<Command> {
        let mut cmd = self.base();
        cmd.stdin(slave.try_clone()?).stdout(slave.try_clone()?).stderr(slave.try_clone()?);
        crate::sys::set_child_setup_on_exec(
            &mut cmd,
            ChildSetup {
                rlimits: self.rlimits,
                controlling_tty: true,
                reset_signals: !self.ignored_signals.is_empty(),
            },
        );
        Ok(cmd)
    }

    fn base(&self) -> Command {
        let mut cmd = Command::new(&self.argv[0]);
        cmd.args(&self.argv[1..]).env_clear().envs(self.env.iter()).current_dir(&self.cwd);
        if let Some(u) = &self.user {
            // std clears the supplementary groups (setgroups(0)) when root sets a uid.
            cmd.uid(u.uid).gid(u.gid);
        }
        cmd
    }

    pub fn program(&self) -> &str {
        &self.argv[0]
    }

    /// The PATH the program is looked up in: the command's own.
    pub fn path(&self) -> &str {
        self.env.get("PATH").unwrap_or(DEFAULT_PATH)
    }

    /// Whether it can start with `posix_spawn` (no fork): nothing to do between fork and exec
    /// that `posix_spawn` cannot (another user's ids, rlimits). Signals to reset it can do.
    pub fn spawns_without_fork(&self) -> bool {
        self.user.is_none() && self.rlimits.is_empty()
    }
}

/// Resolves `name`, `uid` or `uid:gid`. Names are read from `passwd` when it exists; numeric ids
/// always work, with no user database at all.
pub fn lookup_user(passwd: &Path, spec: &str) -> DaemonResult<UserIds> {
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let gid_override = match group {
        None => None,
        Some(g) => Some(match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => lookup_group(&passwd.with_file_name("group"), g).ok_or_else(|| {
                DaemonError::InvalidArgument(format!(
                    "unknown group `{g}` in user `{spec}`: not in {} (numeric gids always work)",
                    passwd.with_file_name("group").display()
                ))
            })?,
        }),
    };
    if let Ok(uid) = user.parse::<u32>() {
        let entry = read_passwd(passwd).into_iter().find(|e| e.uid == uid);
        return Ok(UserIds {
            uid,
            gid: gid_override.or(entry.as_ref().map(|e| e.gid)).unwrap_or(uid),
            name: entry.as_ref().map(|e| e.name.clone()),
            home: entry.map(|e| e.home),
        });
    }
    let entry = read_passwd(passwd).into_iter().find(|e| e.name == user).ok_or_else(|| {
        DaemonError::InvalidArgument(format!(
            "unknown user `{user}`: not in {} (numeric ids always work)",
            passwd.display()
        ))
    })?;
    Ok(UserIds {
        uid: entry.uid,
        gid: gid_override.unwrap_or(entry.gid),
        name: Some(entry.name),
        home: Some(entry.home),
    })
}

/// The gid of group `name` in a `/etc/group` file.
fn lookup_group(path: &Path, name: &str) -> Option<u32> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let mut f = line.split(':');
        (f.next()? == name).then_some(())?;
        f.nth(1)?.parse().ok()
    })
}

#[derive(Debug)]
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

fn read_passwd(path: &Path) -> Vec<PasswdEntry> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    text.lines().filter_map(parse_passwd_line).collect()
}

fn parse_passwd_line(line: &str) -> Option<PasswdEntry> {
    let mut f = line.split(':');
    let name = f.next()?.to_string();
    let _password = f.next()?;
    let uid = f.next()?.parse().ok()?;
    let gid = f.next()?.parse().ok()?;
    let _gecos = f.next()?;
    let home = f.next()?.to_string();
    Some(PasswdEntry { name, uid, gid, home })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults(passwd: PathBuf) -> Defaults {
        Defaults {
            env: Arc::new(BTreeMap::from([("PATH".into(), DEFAULT_PATH.into())])),
            cwd: PathBuf::from("/"),
            shell: "/bin/sh".into(),
            passwd,
            euid: 0,
            rlimits: Rlimits::default(),
            file_size_held: false,
            ignored_signals: SignalSet::default(),
        }
    }

    #[test]
    fn names_come_from_passwd_and_numbers_need_nothing() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let passwd = dir.path().join("passwd");
        std::fs::write(&passwd, "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1001::/home/agent:/bin/sh\n")
            .unwrap_or_else(|e| panic!("{e}"));
        let u = lookup_user(&passwd, "agent").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((u.uid, u.gid, u.home.as_deref()), (1000, 1001, Some("/home/agent")));
        let n = lookup_user(&dir.path().join("absent"), "4242:7").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((n.uid, n.gid, n.name), (4242, 7, None));
        std::fs::write(dir.path().join("group"), "root:x:0:\nstaff:x:50:agent\n").unwrap_or_else(|e| panic!("{e}"));
        let g = lookup_user(&passwd, "agent:staff").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((g.uid, g.gid), (1000, 50));
        assert!(lookup_user(&passwd, "agent:nobody-here").is_err());
        let bare = lookup_user(&dir.path().join("absent"), "4242").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(bare.gid, 4242);
        assert!(lookup_user(&dir.path().join("absent"), "agent").is_err());
    }

    #[test]
    fn argv_xor_command() {
        let d = defaults(PathBuf::from("/nonexistent"));
        let both =
            LaunchRequest { argv: Some(vec!["true".into()]), command: Some("true".into()), ..Default::default() };
        assert!(Launch::parse(&d, both).is_err());
        assert!(Launch::parse(&d, LaunchRequest::default()).is_err());
        let cmd = Launch::parse(&d, LaunchRequest { command: Some("echo hi".into()), ..Default::default() })
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cmd.argv, ["/bin/sh", "-c", "echo hi"]);
    }

    /// Regression (issue 16): every exec forked the daemon (std falls back to fork in a static
    /// build), copying its page tables; a plain command now starts with posix_spawn, and only
    /// what needs work between fork and exec forks.
    #[test]
    fn plain_commands_start_without_a_fork() {
        let d = defaults(PathBuf::from("/nonexistent"));
        let plain = LaunchRequest { argv: Some(vec!["true".into()]), ..Default::default() };
        assert!(Launch::parse(&d, plain).is_ok_and(|l| l.spawns_without_fork()));
        let as_user =
            LaunchRequest { argv: Some(vec!["true".into()]), user: Some("4242".into()), ..Default::default() };
        assert!(Launch::parse(&d, as_user).is_ok_and(|l| !l.spawns_without_fork()));
        // Signals the daemon inherited ignored are reset by posix_spawn too (regression: a daemon
        // started by a Rust program, the server, inherits one of glibc's signals ignored, and so
        // forked for every exec).
        let ignoring = Defaults { ignored_signals: SignalSet::default().with(2).with(32), ..d.clone() };
        let plain = LaunchRequest { argv: Some(vec!["true".into()]), ..Default::default() };
        assert!(Launch::parse(&ignoring, plain).is_ok_and(|l| l.spawns_without_fork()));
        let limited = Defaults { rlimits: Rlimits { file_size: Some(1), ..Rlimits::default() }, ..d };
        let plain = LaunchRequest { argv: Some(vec!["true".into()]), ..Default::default() };
        assert!(Launch::parse(&limited, plain).is_ok_and(|l| !l.spawns_without_fork()));
        // Regression (issue 34): the process provider gives every sandbox a file size limit, so
        // every exec forked. The daemon holds that limit itself now and its children inherit it.
        let held = Defaults { file_size_held: true, ..limited };
        let plain = LaunchRequest { argv: Some(vec!["true".into()]), ..Default::default() };
        assert!(Launch::parse(&held, plain).is_ok_and(|l| l.spawns_without_fork()));
    }

    #[test]
    fn programs_are_found_in_the_commands_path_as_execvp_would() {
        let cwd = Path::new("/");
        assert_eq!(crate::sys::find_program("sh", "/nonexistent:/bin", cwd).ok(), Some(PathBuf::from("/bin/sh")));
        assert_eq!(crate::sys::find_program("./x", "/bin", cwd).ok(), Some(PathBuf::from("./x")));
        let missing = crate::sys::find_program("no-such-program-here", "/bin:/usr/bin", cwd).err();
        assert_eq!(missing.map(|e| e.kind()), Some(std::io::ErrorKind::NotFound));
    }

    #[test]
    fn relative_cwd_is_refused() {
        let d = defaults(PathBuf::from("/nonexistent"));
        let req = LaunchRequest { argv: Some(vec!["true".into()]), cwd: Some("tmp".into()), ..Default::default() };
        let err = Launch::parse(&d, req).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("not absolute"), "{err}");
    }

    #[test]
    fn request_env_overrides_defaults() {
        let d = defaults(PathBuf::from("/nonexistent"));
        let req = LaunchRequest {
            argv: Some(vec!["true".into()]),
            env: BTreeMap::from([("PATH".into(), "/x".into()), ("A".into(), "1".into())]),
            ..Default::default()
        };
        let l = Launch::parse(&d, req).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.env.get("PATH"), Some("/x"));
        assert_eq!(l.env.get("A"), Some("1"));
        let all: Vec<(&str, &str)> = l.env.iter().collect();
        assert_eq!(all, [("A", "1"), ("PATH", "/x")], "each variable once, the request's value first");
    }
}

//! Reading `/proc`: a process's start time (to tell a daemon from a later process that got its
//! pid), whether it still runs, and killing a daemon's whole tree.

use std::collections::HashSet;

use crate::sys;

/// One process, named so that pid reuse cannot fool us: the pid and its start time in clock
/// ticks after boot (`/proc/<pid>/stat` field 22).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcId {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcId {
    /// The process now at `pid`, if any.
    pub fn of(pid: i32) -> Option<ProcId> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(ProcId { pid, start_time: parse_stat(&stat)?.start_time })
    }

    /// Whether this very process still runs (exists, is not a zombie, and has not been replaced by
    /// another with the same pid).
    pub fn is_running(&self) -> bool {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) else { return false };
        match parse_stat(&stat) {
            Some(s) => s.start_time == self.start_time && s.state != 'Z' && s.state != 'X',
            None => false,
        }
    }

    /// `pid start_time`, as `daemon.pid` holds it.
    pub fn to_line(self) -> String {
        format!("{} {}\n", self.pid, self.start_time)
    }

    pub fn parse(text: &str) -> Option<ProcId> {
        let mut it = text.split_whitespace();
        let pid = it.next()?.parse().ok()?;
        let start_time = it.next()?.parse().ok()?;
        Some(ProcId { pid, start_time })
    }
}

struct Stat {
    state: char,
    ppid: i32,
    start_time: u64,
}

/// Fields of a `/proc/<pid>/stat` line. The command name may hold spaces and parentheses, so
/// fields are counted from the last `)`: field 3 (state) comes first after it.
fn parse_stat(stat: &str) -> Option<Stat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(22 - 3)?.parse().ok()?,
    })
}

/// Whether the daemon was started with `--isolate` (it then waits on the init of new namespaces).
fn is_isolated(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|arg| arg == b"--isolate"))
}

/// The namespaces a sandbox has apart from this process, by name (`user`, `mount`, `pid`,
/// `cgroup`, `ipc`, `uts`, `net`), given its daemon's pid. An isolated daemon's waiter stays in
/// the host's namespaces: its one child, the sandbox's init, is the one to read.
pub fn namespaces_apart(daemon: i32) -> Vec<&'static str> {
    let pid = if is_isolated(daemon) { children_of(daemon).first().copied().unwrap_or(daemon) } else { daemon };
    let ns = |p: &str, file: &str| std::fs::read_link(format!("/proc/{p}/ns/{file}")).ok();
    [
        ("user", "user", "user"),
        ("mount", "mnt", "mnt"),
        ("pid", "pid", "pid"),
        ("cgroup", "cgroup", "cgroup"),
        ("ipc", "ipc", "ipc"),
        ("uts", "uts", "uts"),
        ("net", "net", "net"),
    ]
    .into_iter()
    .filter(|(_, theirs, ours)| {
        let (theirs, ours) = (ns(&pid.to_string(), theirs), ns("self", ours));
        theirs.is_some() && ours.is_some() && theirs != ours
    })
    .map(|(name, _, _)| name)
    .collect()
}

/// Of `pids` (the members of one sandbox's cgroup), the one at the top: whose parent is not
/// among them (the daemon a provider started; everything else descends from it). The earliest
/// started, should there be several.
pub fn top_of(pids: &[i32]) -> Option<ProcId> {
    let set: HashSet<i32> = pids.iter().copied().collect();
    pids.iter()
        .filter_map(|&pid| {
            let stat = parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)?;
            (!set.contains(&stat.ppid) && stat.state != 'Z').then_some(ProcId { pid, start_time: stat.start_time })
        })
        .min_by_key(|p| p.start_time)
}

/// The direct children of `pid`, from `/proc/PID/task/PID/children` (one small file).
fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The children of every thread of `pid` (a child belongs to the thread that forked it, or that
/// an orphan was handed to).
fn children_of_all_threads(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|text| text.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>())
        .collect()
}

/// Every descendant of `root` now alive, walked down the `children` files: as many reads as the
/// tree has processes, whatever else runs on the machine. A daemon is a child subreaper, so an
/// orphan of its tree is handed to it and stays a descendant.
fn descendants(root: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut seen = HashSet::from([root]);
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for k in children_of_all_threads(p) {
            if seen.insert(k) {
                out.push(k);
                stack.push(k);
            }
        }
    }
    out
}

/// SIGKILLs `daemon`, its process group and every descendant. The tree is frozen first (SIGSTOP,
/// rescanning until no new process appears) so that nothing forks away between the scan and the
/// kill; a daemon that is not isolated starts each command in a process group of its own, so the
/// group alone would miss them. Blocking: reads the tree's `/proc` entries.
pub fn kill_tree(daemon: ProcId) {
    if !daemon.is_running() {
        // Gone, or its pid now names someone else: signal nothing.
        return;
    }
    if is_isolated(daemon.pid) {
        // An isolated daemon's one child is PID 1 of the sandbox's pid namespace; when it dies the
        // kernel kills every process in the namespace, so nothing needs finding: no scan of
        // `/proc`, whose cost grows with every sandbox on the machine.
        for child in children_of(daemon.pid) {
            let _ = sys::kill(child, sys::SIGKILL, false);
        }
        let _ = sys::kill(daemon.pid, sys::SIGKILL, false);
        return;
    }
    let _ = sys::kill(daemon.pid, sys::SIGSTOP, false);
    let mut frozen: HashSet<i32> = HashSet::new();
    // Bounded: each round stops every process found, and stopped processes cannot fork.
    for _ in 0..20 {
        let found: Vec<i32> = descendants(daemon.pid).into_iter().filter(|p| !frozen.contains(p)).collect();
        if found.is_empty() {
            break;
        }
        for pid in found {
            let _ = sys::kill(pid, sys::SIGSTOP, false);
            frozen.insert(pid);
        }
    }
    let _ = sys::kill(daemon.pid, sys::SIGKILL, true);
    let _ = sys::kill(daemon.pid, sys::SIGKILL, false);
    for pid in frozen {
        let _ = sys::kill(pid, sys::SIGKILL, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let line = "42 (a b) c) S 7 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 123456 1000 10";
        let s = parse_stat(line).unwrap_or_else(|| panic!("unparsed"));
        assert_eq!((s.state, s.ppid, s.start_time), ('S', 7, 123456));
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn this_process_is_running_and_a_changed_start_time_is_not() {
        let me = ProcId::of(std::process::id() as i32).unwrap_or_else(|| panic!("no /proc entry"));
        assert!(me.is_running());
        assert!(!ProcId { start_time: me.start_time + 1, ..me }.is_running());
        assert_eq!(ProcId::parse(&me.to_line()), Some(me));
    }

    /// Every process whose parent chain reaches `root`, found the slow way: all of `/proc`.
    fn descendants_by_scan(root: i32) -> HashSet<i32> {
        let mut parent = std::collections::HashMap::new();
        for entry in std::fs::read_dir("/proc").unwrap_or_else(|e| panic!("{e}")).flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            if let Some(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|t| parse_stat(&t)) {
                parent.insert(pid, s.ppid);
            }
        }
        let reaches = |mut p: i32| loop {
            match parent.get(&p) {
                Some(&q) if q == root => return true,
                Some(&q) if q > 1 && q != p => p = q,
                _ => return false,
            }
        };
        parent.keys().copied().filter(|&p| reaches(p)).collect()
    }

    #[test]
    fn descendants_are_the_whole_tree_from_the_children_files() {
        // Three levels, with a subshell's children handed around: sh → (sh → sleep, sleep), sleep.
        let mut tree = std::process::Command::new("sh")
            .args(["-c", "(sleep 3001 & sleep 3002 & wait) & sleep 3003 & echo started; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(tree.stdout.take().unwrap_or_else(|| panic!("no stdout"))),
            &mut line,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let root = tree.id() as i32;
        // Until all four are forked (the subshell forks its two a moment later).
        let mut found: HashSet<i32> = HashSet::new();
        for _ in 0..500 {
            found = descendants(root).into_iter().collect();
            if found.len() >= 4 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let expected = descendants_by_scan(root);
        let _ = sys::kill(root, sys::SIGKILL, false);
        for pid in &expected {
            let _ = sys::kill(*pid, sys::SIGKILL, false);
        }
        let _ = tree.wait();
        assert_eq!(found.len(), 4, "{found:?}");
        assert_eq!(found, expected);
    }

    #[test]
    fn this_process_has_no_namespaces_apart_from_itself() {
        assert!(namespaces_apart(std::process::id() as i32).is_empty());
    }
}

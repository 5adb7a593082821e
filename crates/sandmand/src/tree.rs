//! Killing whole process trees: a process group plus every descendant found in `/proc`, so that
//! grandchildren that left the group (or were orphaned to the daemon) die too.

use std::collections::HashMap;

use crate::sys;

/// pid → (parent pid, process group) of every process visible in `/proc`. Empty when `/proc`
/// is not mounted.
fn processes() -> HashMap<i32, (i32, i32)> {
    let mut map = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return map };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        if let Some(ids) = parse_ids(&stat) {
            map.insert(pid, ids);
        }
    }
    map
}

fn parents() -> HashMap<i32, i32> {
    processes().into_iter().map(|(pid, (ppid, _))| (pid, ppid)).collect()
}

/// The parent pid and process group from a `/proc/PID/stat` line. The command name may hold
/// spaces and parentheses, so fields are counted from the last `)`.
fn parse_ids(stat: &str) -> Option<(i32, i32)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(1);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

#[cfg(test)]
fn parse_ppid(stat: &str) -> Option<i32> {
    parse_ids(stat).map(|(ppid, _)| ppid)
}

/// Every process of the group `leader` leads and every descendant of `leader`, but `leader`
/// itself: what a shell session has started.
pub fn group_members(leader: i32) -> Vec<i32> {
    let all = processes();
    let below = descendants_in(&all.iter().map(|(&pid, &(ppid, _))| (pid, ppid)).collect(), leader);
    let mut out: Vec<i32> =
        all.iter().filter(|&(&pid, &(_, pgrp))| pgrp == leader && pid != leader).map(|(&p, _)| p).collect();
    for pid in below {
        if !out.contains(&pid) {
            out.push(pid);
        }
    }
    out
}

/// SIGKILLs every [`group_members`] of `leader` but those in `spared`; never `leader`.
pub fn kill_group_members(leader: i32, spared: &[i32]) {
    for pid in group_members(leader) {
        if !spared.contains(&pid) {
            let _ = sys::kill_pid(pid, sys::SIGKILL);
        }
    }
}

/// Every descendant of `root` (not `root` itself).
pub fn descendants(root: i32) -> Vec<i32> {
    descendants_in(&parents(), root)
}

fn descendants_in(parents: &HashMap<i32, i32>, root: i32) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (&pid, &ppid) in parents {
        children.entry(ppid).or_default().push(pid);
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Some(kids) = children.get(&p) {
            for &k in kids {
                out.push(k);
                stack.push(k);
            }
        }
    }
    out
}

/// SIGKILLs the process group led by `leader` and every descendant of `leader`.
pub fn kill_tree(leader: i32) {
    // Collect first: once the leader dies its children re-parent and the tree is lost.
    let below = descendants(leader);
    let _ = sys::kill_group(leader, sys::SIGKILL);
    let _ = sys::kill_pid(leader, sys::SIGKILL);
    for pid in below {
        let _ = sys::kill_pid(pid, sys::SIGKILL);
    }
}

/// SIGKILLs every descendant of the daemon itself.
pub fn kill_all_descendants() {
    let me = std::process::id() as i32;
    for pid in descendants(me) {
        let _ = sys::kill_pid(pid, sys::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppid_survives_odd_command_names() {
        assert_eq!(parse_ppid("42 (a b) c) S 7 42 42 0"), Some(7));
        assert_eq!(parse_ppid("1 (init) S 0 1 1"), Some(0));
        assert_eq!(parse_ppid("garbage"), None);
    }

    #[test]
    fn finds_this_test_process_among_its_parents_children() {
        let me = std::process::id() as i32;
        let parent = parents().get(&me).copied().unwrap_or(0);
        assert!(parent > 0);
        assert!(descendants(parent).contains(&me));
    }
}

//! What a sandbox costs the server in open files: one pidfd for its daemon, and nothing else
//! held between calls. Its own test binary, so that no other test opens files meanwhile.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::process::Command;

use common::{dir_of, provider, ready, state_dir};
use sandman_provider::Provider;
use sandman_provider::conformance::{next_event, spec};
use sandman_provider_process::{HOST_IMAGE, Isolation};
use sandman_wire::server::Reason;

/// This process's open descriptors, by what they are (`anon_inode:[pidfd]`, `socket:`, a path).
fn open_files() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|target| {
            let t = target.to_string_lossy().into_owned();
            // `socket:[inode]` and `pipe:[inode]` differ by inode only; keep what kind they are.
            match t.split_once(':') {
                Some((kind @ ("socket" | "pipe"), _)) => format!("{kind}:"),
                _ => t,
            }
        })
        .collect()
}

#[tokio::test]
async fn a_sandbox_holds_one_descriptor_and_its_daemons_death_is_reaped_with_its_status() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    let mut events = p.events().unwrap();
    // The first create opens what the provider keeps for all of them.
    let first = spec("fd-first", HOST_IMAGE);
    ready(&p, &first).await;
    let before = open_files();
    let specs: Vec<_> = (0..5).map(|i| spec(&format!("fd-{i}"), HOST_IMAGE)).collect();
    let mut endpoints = Vec::new();
    for s in &specs {
        endpoints.push(ready(&p, s).await);
    }
    let mut added = open_files();
    for f in &before {
        if let Some(i) = added.iter().position(|a| a == f) {
            added.swap_remove(i);
        }
    }
    assert_eq!(added, vec!["anon_inode:[pidfd]"; 5], "what five more sandboxes hold open");
    // The daemons are spawned from a thread whose table holds none of them: a spawn copies a
    // table that does not grow with the sandboxes.
    let spawner = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| t.ok())
        .find(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "sandman-spawner"))
        .unwrap_or_else(|| panic!("no thread named sandman-spawner"));
    let in_spawner = std::fs::read_dir(spawner.path().join("fd")).unwrap().count();
    assert!(in_spawner <= 3 && open_files().len() > 6, "the spawner thread holds {in_spawner} descriptors");

    // Our child, killed from outside: its status comes from reaping it, and no zombie is left.
    let pid_line = std::fs::read_to_string(dir_of(&endpoints[0]).join("daemon.pid")).unwrap();
    let pid = pid_line.split_whitespace().next().unwrap().to_string();
    assert!(Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    let event = next_event(&mut events, &specs[0].id).await;
    assert_eq!(event.ended.reason, Reason::ProviderError);
    assert!(event.ended.message.starts_with("daemon was killed by signal 9"), "{event:?}");
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the daemon {pid} was not reaped");

    for s in specs.iter().chain([&first]) {
        p.delete(&s.id).await.unwrap();
    }
    assert!(p.list().await.unwrap().is_empty());
}

//! Where an isolated provider keeps its sandboxes' directories: on a tmpfs of its own mounted on
//! `<state>/sandboxes`, kept while sandboxes may still run (a restarted provider finds them
//! there), unmounted once none is left; left on disk without isolation or when a previous server
//! kept sandboxes there; and the tmpfs of a state directory nobody uses any more is unmounted by
//! the next provider that starts.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{out, provider, ready, require_root, sh, state_dir};
use sandman_provider::Provider;
use sandman_provider::conformance::spec;
use sandman_provider_process::{HOST_IMAGE, Isolation, RECORDS_TMPFS, Records};

/// Whether a tmpfs named as the provider names it is mounted on `point` in this mount namespace.
fn records_mounted_on(point: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let point = point.to_str().unwrap();
    info.lines().any(|line| {
        let (left, right) = line.split_once(" - ").unwrap();
        left.split(' ').nth(4) == Some(point) && right.starts_with(&format!("tmpfs {RECORDS_TMPFS} "))
    })
}

#[tokio::test]
async fn an_isolated_providers_sandbox_directories_are_in_memory_kept_across_a_restart_and_given_back() {
    require_root();
    let state = state_dir();
    let sandboxes = state.path().join("sandboxes");
    let p = provider(state.path(), Isolation::Full);
    assert_eq!(p.records(), Records::Tmpfs);
    assert!(records_mounted_on(&sandboxes), "no tmpfs on {}", sandboxes.display());
    let s = spec("records-kept", HOST_IMAGE);
    let ep = ready(&p, &s).await;
    assert_eq!(out(&sh(&ep, &s.token, "echo up").await), "up\n");
    assert!(sandboxes.join(&s.id).join("record.json").is_file());

    // Stopped with a sandbox running: its records stay for the next provider.
    p.shutdown().await;
    drop(p);
    assert!(records_mounted_on(&sandboxes), "unmounted with a sandbox still running");
    let again = provider(state.path(), Isolation::Full);
    assert_eq!(again.records(), Records::Tmpfs);
    let listed = again.list().await.unwrap();
    assert!(listed.iter().any(|r| r.spec.id == s.id), "the restarted provider lost {}: {listed:?}", s.id);
    assert_eq!(out(&sh(&ep, &s.token, "echo still").await), "still\n");

    // None left: the memory is given back as it goes (dropped here; `shutdown` does the same,
    // below).
    again.delete(&s.id).await.unwrap();
    drop(again);
    assert!(!records_mounted_on(&sandboxes), "still mounted with no sandbox left");
    assert!(sandboxes.is_dir());
}

#[tokio::test]
async fn without_isolation_or_with_sandboxes_on_disk_the_directories_stay_on_disk() {
    let state = state_dir();
    let p = provider(state.path(), Isolation::None);
    assert_eq!(p.records(), Records::Disk);
    assert!(!records_mounted_on(&state.path().join("sandboxes")));
    drop(p);

    require_root();
    // An earlier server's sandbox directory on disk: not hidden under a mount.
    let state = state_dir();
    let earlier = state.path().join("sandboxes").join("sb-earlier");
    std::fs::create_dir_all(&earlier).unwrap();
    let p = provider(state.path(), Isolation::Full);
    assert_eq!(p.records(), Records::Disk);
    assert!(!records_mounted_on(&state.path().join("sandboxes")));
    assert!(earlier.is_dir());
}

#[tokio::test]
async fn the_tmpfs_of_an_abandoned_state_directory_is_unmounted_by_the_next_provider() {
    require_root();
    // What a killed server leaves once its state directory is removed: the mount point, which
    // cannot be, under a directory holding nothing else, for over a minute.
    let old = state_dir();
    let abandoned = old.path().join("sandboxes");
    std::fs::create_dir(&abandoned).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", RECORDS_TMPFS]).arg(&abandoned).status().unwrap();
    assert!(mounted.success());
    // A recent one is left alone: a server starting there mounts before it writes anything else.
    let recent = state_dir();
    let fresh = recent.path().join("sandboxes");
    std::fs::create_dir(&fresh).unwrap();
    assert!(Command::new("mount").args(["-t", "tmpfs", RECORDS_TMPFS]).arg(&fresh).status().unwrap().success());
    let touched = Command::new("touch").args(["-d", "2 minutes ago"]).arg(old.path()).status().unwrap();
    assert!(touched.success());

    let state = state_dir();
    let p = provider(state.path(), Isolation::Full);
    assert_eq!(p.records(), Records::Tmpfs);
    assert!(!records_mounted_on(&abandoned), "the abandoned tmpfs is still mounted");
    assert!(records_mounted_on(&fresh), "a recent state directory's tmpfs was unmounted");
    p.shutdown().await;
    assert!(!records_mounted_on(&state.path().join("sandboxes")));
}

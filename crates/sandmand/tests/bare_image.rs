//! The static daemon in a root file system that holds nothing but itself: no shell, no libc, no
//! `/etc/passwd`. Exec with argv, files and archives still work; what needs a shell or a user
//! database is refused with a clear error.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Body, Daemon, TOKEN};
use serde_json::json;

#[tokio::test]
async fn runs_in_an_empty_root_with_nothing_but_itself() {
    let root = tempfile::tempdir_in(common::scratch()).unwrap();
    std::fs::copy(sandman_testkit::static_daemon(), root.path().join("sandmand")).unwrap();
    std::fs::create_dir(root.path().join("run")).unwrap();
    // chroot(8) with the daemon's own paths inside the new root; the socket shows up on the host
    // under the root directory.
    let d = Daemon::start_chrooted(root.path(), "/sandmand", "/run/d.sock").await;

    let r = d.exec(json!({"argv": ["/sandmand", "--version"]})).await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(r["stdout"].as_str().unwrap().starts_with("sandmand "), "{r}");
    let r = d.exec(json!({"argv": ["/sandmand", "--version"], "user": "1000:1000"})).await;
    assert_eq!(r["exit_code"], 0, "numeric ids need no user database: {r}");

    let shell = d.json("POST", "/v1/exec", json!({"command": "echo hi"})).await;
    let msg = shell.error(404, "not_found");
    assert!(msg.contains("/bin/sh"), "{msg}");
    let named = d.json("POST", "/v1/exec", json!({"argv": ["/sandmand"], "user": "agent"})).await;
    assert!(named.error(400, "invalid_argument").contains("/etc/passwd"));

    let put = d
        .call("PUT", "/v1/files?path=/work/a/b.txt&mode=0600", Some(TOKEN), Body::Bytes(b"bare".to_vec()))
        .await
        .unwrap();
    assert_eq!(put.status, 200, "{}", put.text());
    assert_eq!(std::fs::read(root.path().join("work/a/b.txt")).unwrap(), b"bare");
    let back = d.get("/v1/files?path=/work/a/b.txt").await;
    assert_eq!(&back.body[..], b"bare");
    let tar = d.get("/v1/archive?path=/work").await;
    assert_eq!(tar.status, 200);
    let up = d.call("PUT", "/v1/archive?path=/copy", Some(TOKEN), Body::Bytes(tar.body.to_vec())).await.unwrap();
    assert_eq!(up.status, 200, "{}", up.text());
    assert_eq!(std::fs::read(root.path().join("copy/a/b.txt")).unwrap(), b"bare");
}

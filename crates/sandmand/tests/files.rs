//! Files and archives through the real daemon: ranged reads, atomic writes with modes and parents,
//! stat, listings, mkdir, remove, move, and tar upload/download keeping modes and symlinks.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use bytes::Bytes;
use common::{Body, Daemon, TOKEN};
use serde_json::json;

fn q(path: &std::path::Path) -> String {
    path.display().to_string()
}

#[tokio::test]
async fn write_creates_parents_with_mode_then_read_ranges() {
    let d = Daemon::start().await;
    let path = d.dir().join("a/b/c.txt");
    let r = d
        .call(
            "PUT",
            &format!("/v1/files?path={}&mode=0640", q(&path)),
            Some(TOKEN),
            Body::Bytes(b"hello world".to_vec()),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["size"], 11);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o640);
    assert_eq!(std::fs::read(&path).unwrap(), b"hello world");
    let whole = d.get(&format!("/v1/files?path={}", q(&path))).await;
    assert_eq!(&whole.body[..], b"hello world");
    let range = d.get(&format!("/v1/files?path={}&offset=6&length=3", q(&path))).await;
    assert_eq!(&range.body[..], b"wor");
    assert_eq!(range.headers["content-length"], "3");
    // No temporary file is left beside it.
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[tokio::test]
async fn missing_files_and_directories_are_clear_errors() {
    let d = Daemon::start().await;
    d.get(&format!("/v1/files?path={}", q(&d.dir().join("nope")))).await.error(404, "not_found");
    d.get(&format!("/v1/files?path={}", q(d.dir()))).await.error(400, "invalid_argument");
    d.get("/v1/files?path=relative/x").await.error(400, "invalid_argument");
    d.get(&format!("/v1/stat?path={}", q(&d.dir().join("nope")))).await.error(404, "not_found");
}

/// Before, an upload refused for its path was answered before its body was read, and the
/// connection closed under the client's write: through the server, `relative.txt` came back as
/// "sandbox did not answer: broken pipe" instead of the 400.
#[tokio::test]
async fn an_upload_refused_for_its_path_is_read_before_the_answer() {
    let d = Daemon::start().await;
    for path in ["/v1/files?path=relative.txt", "/v1/archive?path=relative"] {
        let chunks = (0..64).map(|_| Bytes::from(vec![0u8; 16 << 10]));
        let r = d.call("PUT", path, Some(TOKEN), Body::Chunks(Box::new(chunks))).await;
        let r = r.unwrap_or_else(|e| panic!("{path}: the answer was lost: {e}"));
        r.error(400, "invalid_argument");
    }
}

#[tokio::test]
async fn stat_list_mkdir_remove_move() {
    let d = Daemon::start().await;
    let root = d.dir().join("tree");
    let r = d
        .call("POST", &format!("/v1/dir?path={}&mode=0700", q(&root.join("x/y"))), Some(TOKEN), Body::Empty)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["kind"], "dir");
    std::fs::write(root.join("x/f"), "data").unwrap();
    std::os::unix::fs::symlink("f", root.join("x/link")).unwrap();

    let st = d.get(&format!("/v1/stat?path={}", q(&root.join("x/link")))).await.json();
    assert_eq!(st["kind"], "symlink");
    assert_eq!(st["link_target"], "f");

    let one = d.get(&format!("/v1/dir?path={}", q(&root))).await.json();
    assert_eq!(one["entries"].as_array().unwrap().len(), 1);
    let deep = d.get(&format!("/v1/dir?path={}&depth=3", q(&root))).await.json();
    let paths: Vec<&str> = deep["entries"].as_array().unwrap().iter().map(|e| e["path"].as_str().unwrap()).collect();
    for want in ["x", "x/f", "x/link", "x/y"] {
        assert!(paths.contains(&q(&root.join(want)).as_str()), "{want} missing from {paths:?}");
    }

    let mv = d.json("POST", "/v1/move", json!({"from": q(&root.join("x/f")), "to": q(&root.join("moved/f2"))})).await;
    assert_eq!(mv.status, 200, "{}", mv.text());
    assert_eq!(std::fs::read_to_string(root.join("moved/f2")).unwrap(), "data");
    std::fs::write(root.join("other"), "o").unwrap();
    let clash =
        d.json("POST", "/v1/move", json!({"from": q(&root.join("other")), "to": q(&root.join("moved/f2"))})).await;
    clash.error(409, "conflict");
    let over = d
        .json(
            "POST",
            "/v1/move",
            json!({"from": q(&root.join("other")), "to": q(&root.join("moved/f2")), "overwrite": true}),
        )
        .await;
    assert_eq!(over.status, 200);

    let not_empty =
        d.call("DELETE", &format!("/v1/files?path={}", q(&root.join("x"))), Some(TOKEN), Body::Empty).await.unwrap();
    not_empty.error(409, "conflict");
    let gone = d
        .call("DELETE", &format!("/v1/files?path={}&recursive=true", q(&root.join("x"))), Some(TOKEN), Body::Empty)
        .await
        .unwrap();
    assert_eq!(gone.status, 204);
    assert!(!root.join("x").exists());
    let again =
        d.call("DELETE", &format!("/v1/files?path={}", q(&root.join("x"))), Some(TOKEN), Body::Empty).await.unwrap();
    again.error(404, "not_found");
}

#[tokio::test]
async fn large_upload_is_streamed_and_the_limit_refuses_more() {
    let d = Daemon::start_with(&["--max-upload-bytes", "1000000"], None).await;
    let path = d.dir().join("big.bin");
    let chunks = (0..10).map(|i| Bytes::from(vec![i as u8; 100_000]));
    let ok = d
        .call("PUT", &format!("/v1/files?path={}", q(&path)), Some(TOKEN), Body::Chunks(Box::new(chunks)))
        .await
        .unwrap();
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1_000_000);
    let chunks = (0..11).map(|_| Bytes::from(vec![0u8; 100_000]));
    let over = d
        .call(
            "PUT",
            &format!("/v1/files?path={}", q(&d.dir().join("over.bin"))),
            Some(TOKEN),
            Body::Chunks(Box::new(chunks)),
        )
        .await
        .unwrap();
    over.error(413, "too_large");
    assert!(!d.dir().join("over.bin").exists());
    let leftovers: Vec<_> = std::fs::read_dir(d.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("sandman"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

fn tar_of(entries: &[(&str, &[u8], u32)], symlink: Option<(&str, &str)>) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data, mode) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(*mode);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append_data(&mut h, name, *data).unwrap();
    }
    if let Some((name, target)) = symlink {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, name, target).unwrap();
    }
    b.into_inner().unwrap()
}

#[tokio::test]
async fn tar_round_trip_keeps_modes_and_symlinks() {
    let d = Daemon::start().await;
    let dest = d.dir().join("up");
    let tar = tar_of(
        &[("bin/run.sh", b"#!/bin/sh\necho hi\n", 0o755), ("data/x.txt", b"x", 0o600)],
        Some(("bin/latest", "run.sh")),
    );
    let r = d.call("PUT", &format!("/v1/archive?path={}", q(&dest)), Some(TOKEN), Body::Bytes(tar)).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["entries"], 3);
    assert_eq!(std::fs::metadata(dest.join("bin/run.sh")).unwrap().mode() & 0o777, 0o755);
    assert_eq!(std::fs::metadata(dest.join("data/x.txt")).unwrap().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read_link(dest.join("bin/latest")).unwrap().to_str(), Some("run.sh"));

    let down = d.get(&format!("/v1/archive?path={}", q(&dest))).await;
    assert_eq!(down.status, 200);
    let mut archive = tar::Archive::new(&down.body[..]);
    let mut seen = std::collections::BTreeMap::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().to_string_lossy().trim_start_matches("./").to_string();
        let mode = entry.header().mode().unwrap() & 0o777;
        let kind = entry.header().entry_type();
        let link = entry.link_name().unwrap().map(|l| l.to_string_lossy().into_owned());
        let mut body = String::new();
        entry.read_to_string(&mut body).unwrap();
        seen.insert(name, (mode, kind, link, body));
    }
    assert_eq!(seen["bin/run.sh"].0, 0o755);
    assert_eq!(seen["bin/run.sh"].3, "#!/bin/sh\necho hi\n");
    assert_eq!(seen["data/x.txt"].0, 0o600);
    assert!(seen["bin/latest"].1.is_symlink());
    assert_eq!(seen["bin/latest"].2.as_deref(), Some("run.sh"));
}

#[tokio::test]
async fn gzipped_tar_is_detected() {
    let d = Daemon::start().await;
    let tar = tar_of(&[("z.txt", b"zipped", 0o644)], None);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar).unwrap();
    let gz = gz.finish().unwrap();
    let dest = d.dir().join("gz");
    let r = d.call("PUT", &format!("/v1/archive?path={}", q(&dest)), Some(TOKEN), Body::Bytes(gz)).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(std::fs::read_to_string(dest.join("z.txt")).unwrap(), "zipped");
}

#[tokio::test]
async fn tar_entries_escaping_the_target_are_refused() {
    let d = Daemon::start().await;
    let dest = d.dir().join("inside");
    // tar::Builder refuses to write `..` names, so the header's name bytes are set directly.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(4);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    let name = b"../escaped.txt";
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.set_cksum();
    b.append(&h, &b"evil"[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let r = d.call("PUT", &format!("/v1/archive?path={}", q(&dest)), Some(TOKEN), Body::Bytes(tar)).await.unwrap();
    let msg = r.error(400, "invalid_argument");
    assert!(msg.contains("escaped.txt"), "{msg}");
    assert!(!d.dir().join("escaped.txt").exists(), "an entry was written outside the target");

    // A symlink pointing outside, then a file written through it.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    h.set_mode(0o777);
    b.append_link(&mut h, "out", d.dir()).unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_size(4);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    b.append_data(&mut h, "out/through.txt", &b"evil"[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let r = d
        .call("PUT", &format!("/v1/archive?path={}", q(&d.dir().join("inside2"))), Some(TOKEN), Body::Bytes(tar))
        .await
        .unwrap();
    r.error(400, "invalid_argument");
    assert!(!d.dir().join("through.txt").exists(), "a file was written through a symlink outside the target");
}

/// `(uid, gid)` of `path` itself.
fn owner_of(path: &std::path::Path) -> (u32, u32) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    (meta.uid(), meta.gid())
}

/// Before, files written, directories made and archives unpacked belonged to the daemon (root)
/// whatever the call's user; now what a call creates belongs to its `user` (the sandbox's
/// default user, which the server adds), and what was there keeps its owner.
#[tokio::test]
async fn files_directories_and_archives_belong_to_the_calls_user() {
    assert_eq!(sandmand::sys::euid(), 0, "this test needs root to give files away (CI and scripts/test run as root)");
    let d = Daemon::start().await;
    let me = owner_of(d.dir());
    let user = "4242:4343";

    // A file and the parents made for it; the directory that was there keeps its owner.
    let file = d.dir().join("w/x/f.txt");
    let r = d
        .call(
            "PUT",
            &format!("/v1/files?path={}&mode=4755&user={user}", q(&file)),
            Some(TOKEN),
            Body::Bytes(b"hi".to_vec()),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!((r.json()["uid"].as_u64(), r.json()["gid"].as_u64()), (Some(4242), Some(4343)));
    assert_eq!(owner_of(&file), (4242, 4343));
    // The change of owner came before the mode: the setuid bit is kept.
    assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o7777, 0o4755);
    assert_eq!((owner_of(&d.dir().join("w/x")), owner_of(&d.dir().join("w"))), ((4242, 4343), (4242, 4343)));
    assert_eq!(owner_of(d.dir()), me);
    // Written again without a user, the new file is the daemon's.
    let r =
        d.call("PUT", &format!("/v1/files?path={}", q(&file)), Some(TOKEN), Body::Bytes(b"2".to_vec())).await.unwrap();
    assert_eq!((r.status.as_u16(), owner_of(&file)), (200, (0, 0)));

    // mkdir -p: the directories made, not the one that was there.
    let made = d.dir().join("w/m/n");
    std::fs::create_dir(d.dir().join("w/m")).unwrap();
    let r = d.call("POST", &format!("/v1/dir?path={}&user={user}", q(&made)), Some(TOKEN), Body::Empty).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!((owner_of(&made), owner_of(&d.dir().join("w/m"))), ((4242, 4343), (0, 0)));

    // An archive: the target made for it, every entry (a symlink itself, not what it points
    // to), the directories made on the way; an existing directory in it keeps its owner.
    let dest = d.dir().join("up");
    std::fs::create_dir_all(dest.join("pre")).unwrap();
    let tar = tar_of(
        &[("bin/run.sh", b"#!/bin/sh\n", 0o4755), ("pre/in.txt", b"x", 0o600), ("a/b/c.txt", b"c", 0o644)],
        Some(("bin/latest", "run.sh")),
    );
    let r = d
        .call("PUT", &format!("/v1/archive?path={}&user={user}", q(&dest)), Some(TOKEN), Body::Bytes(tar))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    for made in ["bin", "bin/run.sh", "bin/latest", "pre/in.txt", "a", "a/b", "a/b/c.txt"] {
        assert_eq!(owner_of(&dest.join(made)), (4242, 4343), "{made}");
    }
    assert_eq!((owner_of(&dest), owner_of(&dest.join("pre"))), (me, me));
    assert_eq!(std::fs::metadata(dest.join("bin/run.sh")).unwrap().mode() & 0o7777, 0o4755);
    let fresh = d.dir().join("fresh/target");
    let r = d
        .call(
            "PUT",
            &format!("/v1/archive?path={}&user={user}", q(&fresh)),
            Some(TOKEN),
            Body::Bytes(tar_of(&[], None)),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!((owner_of(&fresh), owner_of(&d.dir().join("fresh"))), ((4242, 4343), (4242, 4343)));

    // A user the daemon does not know is refused, naming it, before anything is written.
    let nobody = d.dir().join("never/f");
    let r = d
        .call(
            "PUT",
            &format!("/v1/files?path={}&user=no-such-user", q(&nobody)),
            Some(TOKEN),
            Body::Bytes(b"x".to_vec()),
        )
        .await
        .unwrap();
    assert!(r.error(400, "invalid_argument").contains("no-such-user"));
    assert!(!d.dir().join("never").exists());
}

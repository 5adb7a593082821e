//! Images from the local Docker engine (Debian's docker.io 20.10, whose export is the legacy
//! docker-archive format): `docker-daemon:`, a plain reference the engine has, and what
//! `docker save` writes. Each test makes its image with `docker import` and removes it after.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sandman_image::{ImageError, ImageStore, Progress, StoreConfig};

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(sandman_testkit::scratch!()).unwrap_or_else(|e| panic!("{e}"))
}

fn config(dir: &Path) -> StoreConfig {
    let mut config = StoreConfig::new(dir.join("images"));
    config.stall = Duration::from_secs(120);
    // The engine on its usual socket (or DOCKER_HOST's).
    config.docker_socket = None;
    config
}

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap_or_else(|e| panic!("docker {args:?}: {e}"));
    assert!(
        out.status.success(),
        "docker {args:?}: {} (the engine must run: `setsid dockerd >/var/log/dockerd.log 2>&1 &`)",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// An image made with `docker import` of a small root file system (with a device node, as
/// debootstrap's have), removed from the engine when dropped.
struct Imported {
    name: String,
}

impl Imported {
    fn new(dir: &Path) -> Imported {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!("sandman-image-test/imported:{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let tar_path = dir.join("rootfs.tar");
        let file = std::fs::File::create(&tar_path).unwrap_or_else(|e| panic!("{e}"));
        let mut tar = tar::Builder::new(file);
        let mut add = |kind: tar::EntryType, path: &str, data: &[u8], mode: u32| {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_size(data.len() as u64);
            header.set_mode(mode);
            header.set_mtime(1_700_000_000);
            if kind == tar::EntryType::Char {
                header.set_device_major(1).unwrap_or_else(|e| panic!("{e}"));
                header.set_device_minor(3).unwrap_or_else(|e| panic!("{e}"));
            }
            tar.append_data(&mut header, path, data).unwrap_or_else(|e| panic!("{path}: {e}"));
        };
        add(tar::EntryType::Directory, "etc", b"", 0o755);
        add(tar::EntryType::Regular, "etc/hostname", b"imported\n", 0o644);
        add(tar::EntryType::Directory, "dev", b"", 0o755);
        add(tar::EntryType::Char, "dev/null", b"", 0o666);
        add(tar::EntryType::Regular, "bin/tool", b"#!/bin/sh\necho hi\n", 0o755);
        tar.into_inner().unwrap_or_else(|e| panic!("{e}"));
        docker(&[
            "import",
            "--change",
            "ENV GREETING=hello",
            "--change",
            "WORKDIR /srv",
            &tar_path.to_string_lossy(),
            &name,
        ]);
        Imported { name }
    }

    fn id(&self) -> String {
        docker(&["image", "inspect", "--format", "{{.Id}}", &self.name])
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", "-f", &self.name]).output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_daemon_imports_the_engines_image_without_its_device_nodes() {
    sandman_testkit::require_root();
    let dir = scratch();
    let imported = Imported::new(dir.path());
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let reference = format!("docker-daemon:{}", imported.name);
    let image = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(image.pulled);
    assert_eq!(image.id, imported.id());
    assert_eq!(image.layers.len(), 1);
    let root = &image.layers[0];
    assert_eq!(std::fs::read(root.join("etc/hostname")).unwrap_or_default(), b"imported\n");
    assert!(root.join("bin/tool").is_file());
    assert!(root.join("dev").is_dir() && !root.join("dev/null").exists(), "device nodes are skipped, not made");
    assert_eq!(image.config.env.get("GREETING").map(String::as_str), Some("hello"));
    assert_eq!(image.config.workdir.as_deref(), Some("/srv"));
    // Again: the engine is asked for the id only, and the store has it.
    let again = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!again.pulled);
    assert_eq!(again.layers, image.layers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_reference_the_engine_has_is_taken_from_it() {
    let dir = scratch();
    let imported = Imported::new(dir.path());
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    // No registry serves docker.io/sandman-image-test/…: only the engine can answer.
    let image = store.resolve(&imported.name, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(image.id, imported.id());
    assert_eq!(image.reference, format!("docker.io/{}", imported.name));
    let listed = store.list();
    assert_eq!(listed[0].references, [format!("docker.io/{}", imported.name)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_reference_follows_the_engine_when_its_image_is_rebuilt() {
    let dir = scratch();
    let imported = Imported::new(dir.path());
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let first = store.resolve(&imported.name, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    // `docker build -t task .` again: the same name, another image.
    let tar = dir.path().join("rootfs.tar");
    docker(&["import", "--change", "ENV GREETING=rebuilt", &tar.to_string_lossy(), &imported.name]);
    let rebuilt = imported.id();
    assert_ne!(first.id, rebuilt);
    // The engine's answer stands for a second; after it, the rebuilt image is what resolves.
    std::thread::sleep(Duration::from_millis(1100));
    let second = store.resolve(&imported.name, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second.id, rebuilt, "the store's earlier import shadowed the engine's rebuilt image");
    assert_eq!(second.config.env.get("GREETING").map(String::as_str), Some("rebuilt"));
    // And again, from the store: nothing imported twice.
    std::thread::sleep(Duration::from_millis(1100));
    let third = store.resolve(&imported.name, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(third.id, rebuilt);
    assert!(!third.pulled, "the same engine image was imported again");
    let tagged: Vec<_> = store.list().into_iter().filter(|i| !i.references.is_empty()).map(|i| i.id).collect();
    assert_eq!(tagged, [rebuilt], "the name still tags the old image too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_docker_save_writes_is_imported() {
    let dir = scratch();
    let imported = Imported::new(dir.path());
    let archive = dir.path().join("saved.tar");
    docker(&["save", "-o", &archive.to_string_lossy(), &imported.name]);
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let image = store
        .resolve(&format!("docker-archive:{}", archive.display()), Progress::none())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(image.id, imported.id());
    assert!(image.layers[0].join("etc/hostname").is_file());
    // Naming the image in the archive.
    let named = store
        .resolve(&format!("docker-archive:{}:{}", archive.display(), imported.name), Progress::none())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(named.id, image.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_the_engine_lacks_or_no_engine_is_said_clearly() {
    let dir = scratch();
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let err = store.resolve("docker-daemon:sandman-image-test/absent:never", Progress::none()).await.err();
    assert!(matches!(err, Some(ImageError::NotFound { .. })), "{err:?}");
    drop(store);
    let mut nowhere = config(dir.path());
    nowhere.docker_socket = Some(dir.path().join("no-engine.sock"));
    let store = ImageStore::open(nowhere).unwrap_or_else(|e| panic!("{e}"));
    let err = store.resolve("docker-daemon:anything:v1", Progress::none()).await.err();
    assert!(matches!(&err, Some(ImageError::Engine { said, .. }) if said.contains("no-engine.sock")), "{err:?}");
}

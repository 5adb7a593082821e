//! Pulls from a real registry (distribution 2.8, started by each test): anonymous, basic and
//! token auth, what is refused and how it is said, manifest lists, shared pulls, stalls, and the
//! store found again after a restart.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandman_image::{ImageError, ImageStore, LayerProgress, LayerState, Progress, StoreConfig};
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage, host_arch};

fn config(dir: &Path) -> StoreConfig {
    let mut config = StoreConfig::new(dir.join("images"));
    // No engine: these tests are about the registry.
    config.docker_socket = Some(dir.join("no-engine.sock"));
    config.stall = Duration::from_secs(60);
    config
}

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(sandman_testkit::scratch!()).unwrap_or_else(|e| panic!("{e}"))
}

/// A two-layer image: a base (gzip) and an upper layer (zstd) that deletes one base file,
/// makes one base directory opaque and adds a file.
fn two_layers() -> TestImage {
    let base = LayerBuilder::new()
        .dir("etc")
        .file("etc/os-release", b"ID=sandman-test\n")
        .file("etc/gone", b"deleted above")
        .dir("cache")
        .file("cache/old", b"hidden by the opaque directory above")
        .file_with("usr/bin/tool", b"#!/bin/sh\n", 0o4755, 0, 0)
        .build(Compression::Gzip);
    let upper = LayerBuilder::new()
        .whiteout("etc/gone")
        .opaque("cache")
        .file("cache/new", b"fresh")
        .file_with("work/notes", b"mine", 0o600, 1000, 1000)
        .build(Compression::Zstd);
    TestImage::new(vec![base, upper])
}

/// Unmounts when dropped.
struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_pull_unpacks_the_layers_bottom_first_and_overlayfs_honours_them() {
    sandman_testkit::require_root();
    let dir = scratch();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let image = two_layers();
    registry.push("team/app", "v1", &image).await;
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let lines: Arc<Mutex<Vec<LayerProgress>>> = Arc::default();
    let heard = lines.clone();
    let progress = Progress::new(move |line| heard.lock().unwrap_or_else(|e| e.into_inner()).push(line.clone()));
    let reference = registry.reference("team/app", "v1");
    let pulled = store.resolve(&reference, progress).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pulled.id, image.config_digest);
    assert_eq!(pulled.manifest_digest, image.manifest_digest);
    assert_eq!(pulled.reference, reference);
    assert!(pulled.pulled);
    assert_eq!(pulled.layers.len(), 2);
    assert!(pulled.layers[0].join("etc/os-release").is_file(), "bottom first");
    assert!(pulled.layers[1].join("cache/new").is_file());
    assert!(pulled.layers.iter().all(|l| l.starts_with(store.root())));
    assert_eq!(pulled.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(pulled.config.workdir.as_deref(), Some("/work"));
    assert_eq!(pulled.config.env.get("LANG").map(String::as_str), Some("C.UTF-8"));
    assert_eq!(pulled.config.cmd, Some(vec!["sh".to_string()]));
    {
        let lines = lines.lock().unwrap_or_else(|e| e.into_inner());
        for layer in &image.layers {
            let done = lines.iter().any(|l| l.layer == layer.digest && l.state == LayerState::Done);
            assert!(done, "a done line for {}: {lines:?}", layer.digest);
        }
        assert!(lines.iter().all(|l| l.image == reference));
    }
    // The overlay the provider will make: top first.
    let mnt = tempfile::tempdir_in(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let lower: Vec<String> = pulled.layers.iter().rev().map(|l| l.display().to_string()).collect();
    let options = format!("lowerdir={}", lower.join(":"));
    let mounted = Command::new("mount").args(["-t", "overlay", "overlay", "-o", &options]).arg(mnt.path()).status();
    assert!(mounted.is_ok_and(|s| s.success()), "mount -o {options}");
    let _mounted = Mounted(mnt.path().to_path_buf());
    let root = mnt.path();
    assert!(root.join("etc/os-release").is_file());
    assert!(!root.join("etc/gone").exists(), "whited out");
    assert!(!root.join("cache/old").exists(), "under an opaque directory");
    assert_eq!(std::fs::read(root.join("cache/new")).unwrap_or_default(), b"fresh");
    let tool = std::fs::metadata(root.join("usr/bin/tool")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&tool.permissions()) & 0o7777, 0o4755);
    let notes = std::fs::metadata(root.join("work/notes")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&notes), 1000);

    // Pinned: the next resolve asks the registry nothing.
    let before = registry.requests("GET", "/v2/");
    let again = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!again.pulled);
    assert_eq!(again.layers, pulled.layers);
    assert_eq!(registry.requests("GET", "/v2/"), before);
    // Pinned by digest: the same image, under a second reference.
    let (addr, digest) = (registry.addr(), &image.manifest_digest);
    let pinned = store.resolve(&format!("{addr}/team/app@{digest}"), Progress::none()).await;
    assert_eq!(pinned.map(|p| p.id).ok(), Some(image.config_digest.clone()));
    let wrong = format!("{addr}/team/app@sha256:{}", "0".repeat(64));
    let err = store.resolve(&wrong, Progress::none()).await.err();
    assert!(matches!(err, Some(ImageError::NotFound { .. })), "{err:?}");
    let listed = store.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].references, [reference, format!("{addr}/team/app@{digest}")]);
    assert_eq!(listed[0].layers, 2);
    assert_eq!(listed[0].size, pulled.size);
    // The store's top is root's and no one else's.
    let top = std::fs::metadata(store.root()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&top.permissions()) & 0o777, 0o700);
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&top), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_takes_credentials_from_a_config_file_and_is_refused_without() {
    let dir = scratch();
    let auth = Auth::Basic { user: "alice".into(), password: "wonder land".into() };
    let registry = Registry::start(auth, dir.path());
    registry.push("private/app", "v1", &two_layers()).await;
    let reference = registry.reference("private/app", "v1");

    let without = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let mut no_credentials = config(dir.path());
    no_credentials.auth_file = Some(dir.path().join("absent.json"));
    drop(without);
    let store = ImageStore::open(no_credentials).unwrap_or_else(|e| panic!("{e}"));
    let err = store.resolve(&reference, Progress::none()).await.err().unwrap_or_else(|| panic!("pulled"));
    eprintln!("without credentials: {err}");
    assert!(matches!(err, ImageError::Unauthorized { .. }), "{err}");
    let said = err.to_string();
    assert!(said.contains(&reference) && said.contains(registry.addr()), "{said}");
    assert!(said.contains("authentication required"), "the registry's own words: {said}");
    drop(store);

    let mut with = config(dir.path());
    with.auth_file = Some(registry.write_auth_file(dir.path()));
    let store = ImageStore::open(with).unwrap_or_else(|e| panic!("{e}"));
    let image = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(image.layers.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_auth_gets_a_token_with_the_credentials_and_is_refused_without() {
    let dir = scratch();
    let auth = Auth::Token { user: "bob".into(), password: "builder".into() };
    let registry = Registry::start(auth, dir.path());
    let image = two_layers();
    registry.push("tokens/app", "v1", &image).await;
    let reference = registry.reference("tokens/app", "v1");

    let mut anonymous = config(dir.path());
    anonymous.auth_file = Some(dir.path().join("absent.json"));
    let store = ImageStore::open(anonymous).unwrap_or_else(|e| panic!("{e}"));
    let err = store.resolve(&reference, Progress::none()).await.err().unwrap_or_else(|| panic!("pulled"));
    eprintln!("without a token: {err}");
    assert!(matches!(err, ImageError::Unauthorized { .. }), "{err}");
    assert!(err.to_string().contains("the test token server refuses these credentials"), "{err}");
    drop(store);

    let mut with = config(dir.path());
    with.auth_file = Some(registry.write_auth_file(dir.path()));
    let store = ImageStore::open(with).unwrap_or_else(|e| panic!("{e}"));
    let pulled = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pulled.id, image.config_digest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_or_tag_is_not_found_in_the_registrys_words() {
    let dir = scratch();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    registry.push("there/app", "v1", &two_layers()).await;
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    for (repository, tag, words) in [("there/app", "v2", "manifest unknown"), ("nowhere/app", "v1", "unknown")] {
        let reference = registry.reference(repository, tag);
        let err = store.resolve(&reference, Progress::none()).await.err().unwrap_or_else(|| panic!("pulled"));
        eprintln!("missing: {err}");
        assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
        let said = err.to_string();
        assert!(said.contains(&reference) && said.contains(registry.addr()) && said.contains(words), "{said}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_refused_and_leaves_nothing_behind() {
    let dir = scratch();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let image = two_layers();
    registry.push("bad/app", "v1", &image).await;
    let blob = registry.blob_path(&image.layers[1].digest);
    let mut bytes = std::fs::read(&blob).unwrap_or_else(|e| panic!("{}: {e}", blob.display()));
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&blob, bytes).unwrap_or_else(|e| panic!("{e}"));
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let err = store.resolve(&registry.reference("bad/app", "v1"), Progress::none()).await.err();
    eprintln!("corrupted: {err:?}");
    assert!(matches!(err, Some(ImageError::Digest { .. })), "{err:?}");
    assert!(store.list().is_empty());
    let tmp = std::fs::read_dir(store.root().join("tmp")).map(|d| d.count()).unwrap_or(1);
    assert_eq!(tmp, 0, "the refused layer's directory is removed");
    let layers = std::fs::read_dir(store.root().join("layers")).map(|d| d.count()).unwrap_or(0);
    assert!(layers <= 1, "only the sound layer may be kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_list_resolves_to_this_platform() {
    let dir = scratch();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let other = if host_arch() == "arm64" { "amd64" } else { "arm64" };
    let mine = TestImage::new(vec![LayerBuilder::new().file("arch", host_arch().as_bytes()).build(Compression::Gzip)]);
    let theirs =
        TestImage::for_arch(vec![LayerBuilder::new().file("arch", other.as_bytes()).build(Compression::Gzip)], other);
    registry.push_index("multi/app", "v1", &[&theirs, &mine]).await;
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let image =
        store.resolve(&registry.reference("multi/app", "v1"), Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(image.id, mine.config_digest);
    assert_eq!(image.manifest_digest, mine.manifest_digest);
    assert_eq!(std::fs::read_to_string(image.layers[0].join("arch")).unwrap_or_default(), host_arch());
    let theirs_pulled = registry.requests("GET", &theirs.layers[0].digest);
    assert_eq!(theirs_pulled, 0, "the other platform's layer is not fetched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_resolves_at_once_pull_each_blob_once_and_all_succeed() {
    let dir = scratch();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let layers = (0..4)
        .map(|i| {
            let data: Vec<u8> =
                (0..(1 << 20)).map(|n: u32| (n.wrapping_mul(2_654_435_761).wrapping_add(i) >> 13) as u8).collect();
            LayerBuilder::new().file(&format!("layer{i}/data"), &data).build(Compression::Gzip)
        })
        .collect();
    let image = TestImage::new(layers);
    registry.push("busy/app", "v1", &image).await;
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let reference = registry.reference("busy/app", "v1");
    let resolves = (0..16).map(|_| {
        let (store, reference) = (store.clone(), reference.clone());
        tokio::spawn(async move { store.resolve(&reference, Progress::none()).await })
    });
    let results = futures_util::future::join_all(resolves).await;
    for result in results {
        let image_got = result.unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(image_got.id, image.config_digest);
    }
    for layer in &image.layers {
        assert_eq!(registry.requests("GET", &format!("/blobs/{}", layer.digest)), 1, "{}", layer.digest);
    }
    assert_eq!(registry.requests("GET", &format!("/blobs/{}", image.config_digest)), 1);
    assert_eq!(registry.requests("GET", "/manifests/v1"), 1, "one resolve asked; the others joined it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_sends_nothing_stalls_the_pull() {
    let dir = scratch();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    // Accepts and never answers.
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let mut config = config(dir.path());
    config.stall = Duration::from_secs(1);
    let store = ImageStore::open(config).unwrap_or_else(|e| panic!("{e}"));
    let err = store.resolve(&format!("{addr}/silent/app:v1"), Progress::none()).await.err();
    silent.abort();
    let err = err.unwrap_or_else(|| panic!("pulled"));
    eprintln!("silent: {err}");
    assert!(matches!(err, ImageError::Stalled { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_store_is_as_it_was_less_what_an_interrupted_pull_left() {
    let dir = scratch();
    let reference;
    let first;
    {
        let registry = Registry::start(Auth::Anonymous, dir.path());
        registry.push("kept/app", "v1", &two_layers()).await;
        reference = registry.reference("kept/app", "v1");
        let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
        first = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
        let busy = ImageStore::open(config(dir.path())).err();
        assert!(matches!(busy, Some(ImageError::Locked { .. })), "{busy:?}");
        // What a crash mid-unpack leaves.
        let half = store.root().join("tmp/layer-half/fs/usr");
        std::fs::create_dir_all(&half).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(half.join("bin"), b"half").unwrap_or_else(|e| panic!("{e}"));
        // The registry is gone now.
    }
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(std::fs::read_dir(store.root().join("tmp")).map(|d| d.count()).unwrap_or(1), 0);
    let again = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again.id, first.id);
    assert_eq!(again.layers, first.layers);
    assert!(!again.pulled);
}

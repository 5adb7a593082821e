//! Images from this machine's disk: OCI layouts and archives written here and by `skopeo copy`
//! from a real registry; and the store's upkeep (LRU prune under a size bound, removal refused
//! while sandboxes use an image).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sandman_image::{ImageError, ImageStore, InUse, Progress, Removed, StoreConfig};
use sandman_testkit::registry::{Auth, Blob, Compression, LayerBuilder, Registry, TestImage};

fn config(dir: &Path) -> StoreConfig {
    let mut config = StoreConfig::new(dir.join("images"));
    config.docker_socket = Some(dir.join("no-engine.sock"));
    config.stall = Duration::from_secs(60);
    config
}

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(sandman_testkit::scratch!()).unwrap_or_else(|e| panic!("{e}"))
}

fn layer_of(name: &str, size: usize) -> Blob {
    let data: Vec<u8> =
        (0..size).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ name.len() as u8).collect();
    LayerBuilder::new().dir("data").file(&format!("data/{name}"), &data).build(Compression::Gzip)
}

fn two_layers() -> TestImage {
    let base = LayerBuilder::new().file("etc/os-release", b"ID=t\n").file("etc/gone", b"x").build(Compression::Gzip);
    let upper = LayerBuilder::new().whiteout("etc/gone").file("app", b"app").build(Compression::Zstd);
    TestImage::new(vec![base, upper])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_layouts_and_archives_are_imported_by_tag() {
    let dir = scratch();
    let image = two_layers();
    let layout = dir.path().join("layout");
    image.write_oci_layout(&layout, "v1");
    let archive = dir.path().join("image.tar");
    image.write_oci_archive(&archive, "v1");
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let from_dir = store
        .resolve(&format!("oci:{}:v1", layout.display()), Progress::none())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(from_dir.pulled);
    assert_eq!(from_dir.id, image.config_digest);
    assert_eq!(from_dir.manifest_digest, image.manifest_digest);
    assert!(from_dir.layers[0].join("etc/os-release").is_file());
    assert!(from_dir.layers[1].join("app").is_file());
    // The same image from the archive: nothing to unpack, one more reference.
    let from_archive = store
        .resolve(&format!("oci-archive:{}:v1", archive.display()), Progress::none())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(from_archive.id, from_dir.id);
    assert_eq!(from_archive.layers, from_dir.layers);
    assert_eq!(store.list()[0].references.len(), 2);
    // Without a tag, the layout's only image.
    let untagged = store.resolve(&format!("oci:{}", layout.display()), Progress::none()).await;
    assert_eq!(untagged.map(|i| i.id).ok(), Some(image.config_digest.clone()));
    let err = store.resolve(&format!("oci:{}:v9", layout.display()), Progress::none()).await.err();
    assert!(matches!(&err, Some(ImageError::NotFound { said, .. }) if said.contains("v9")), "{err:?}");
    let err = store.resolve(&format!("oci-archive:{}/absent.tar", dir.path().display()), Progress::none()).await.err();
    assert!(matches!(err, Some(ImageError::NotFound { .. })), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_skopeo_copies_from_a_registry_is_imported_as_the_registry_serves_it() {
    let dir = scratch();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let image = two_layers();
    registry.push("copied/app", "v1", &image).await;
    let layout = dir.path().join("skopeo-layout");
    let archive = dir.path().join("skopeo.tar");
    let source = format!("docker://{}", registry.reference("copied/app", "v1"));
    for destination in [format!("oci:{}:v1", layout.display()), format!("oci-archive:{}:v1", archive.display())] {
        let out = Command::new("skopeo")
            .args(["copy", "--quiet", "--src-tls-verify=false", &source, &destination])
            .output()
            .unwrap_or_else(|e| panic!("skopeo (apt-get install skopeo): {e}"));
        assert!(out.status.success(), "skopeo copy to {destination}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let pulled = store.resolve(&registry.reference("copied/app", "v1"), Progress::none()).await;
    let pulled = pulled.unwrap_or_else(|e| panic!("{e}"));
    for reference in [format!("oci:{}:v1", layout.display()), format!("oci-archive:{}:v1", archive.display())] {
        let imported = store.resolve(&reference, Progress::none()).await.unwrap_or_else(|e| panic!("{reference}: {e}"));
        assert_eq!(imported.id, pulled.id, "{reference}");
        assert_eq!(imported.layers, pulled.layers, "{reference}: the layers are shared, not unpacked again");
    }
    // Imported first into a store of its own, the archive unpacks alike.
    let other = scratch();
    let store = ImageStore::open(config(other.path())).unwrap_or_else(|e| panic!("{e}"));
    let imported = store.resolve(&format!("oci-archive:{}:v1", archive.display()), Progress::none()).await;
    let imported = imported.unwrap_or_else(|e| panic!("{e}"));
    assert!(imported.pulled);
    assert!(imported.layers[1].join("app").is_file());
    assert!(!imported.layers[1].join("etc/.wh.gone").exists(), "a whiteout is a whiteout, not a file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_removes_the_least_recently_used_images_no_sandbox_uses_until_under_the_bound() {
    let dir = scratch();
    let base = layer_of("base", 200_000);
    let images: Vec<TestImage> =
        ["a", "b", "c"].iter().map(|n| TestImage::new(vec![base.clone(), layer_of(n, 100_000)])).collect();
    let mut config = config(dir.path());
    // Room for the base and two of the three upper layers.
    config.max_size = Some(200_000 + 2 * 100_000);
    let store = ImageStore::open(config).unwrap_or_else(|e| panic!("{e}"));
    let mut ids = Vec::new();
    for (image, name) in images.iter().zip(["a", "b", "c"]) {
        let layout = dir.path().join(name);
        image.write_oci_layout(&layout, "v1");
        let got = store.resolve(&format!("oci:{}:v1", layout.display()), Progress::none()).await;
        ids.push(got.unwrap_or_else(|e| panic!("{e}")).id);
    }
    assert_eq!(store.size(), 200_000 + 3 * 100_000, "the base layer is stored once");
    // Uses: a, b, c, then a again: b is the least recently used, but a sandbox uses it.
    store.touch(&ids[0]).unwrap_or_else(|e| panic!("{e}"));
    let in_use: InUse = [ids[1].as_str()].into_iter().collect();
    let pruned = store.prune(&in_use).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pruned.images, [ids[2].clone()], "c: the least recently used of those no sandbox uses");
    assert_eq!(pruned.layers, 1);
    assert_eq!(pruned.freed, 100_000);
    assert_eq!(store.size(), 200_000 + 2 * 100_000);
    let left: Vec<String> = store.list().into_iter().map(|i| i.id).collect();
    assert_eq!(left, [ids[0].clone(), ids[1].clone()], "most recently used first");
    // Under the bound now: nothing more goes.
    assert_eq!(store.prune(&InUse::default()).map(|p| p.images.len()).ok(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_refuses_an_image_sandboxes_use_and_untags_a_shared_reference() {
    let dir = scratch();
    let base = layer_of("base", 10_000);
    let a = TestImage::new(vec![base.clone(), layer_of("a", 1_000)]);
    let b = TestImage::new(vec![base, layer_of("b", 1_000)]);
    let (layout_a, layout_b, archive_a) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("a.tar"));
    a.write_oci_layout(&layout_a, "v1");
    b.write_oci_layout(&layout_b, "v1");
    a.write_oci_archive(&archive_a, "v1");
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let ref_a = format!("oci:{}:v1", layout_a.display());
    let ref_a2 = format!("oci-archive:{}:v1", archive_a.display());
    let ref_b = format!("oci:{}:v1", layout_b.display());
    for r in [&ref_a, &ref_a2, &ref_b] {
        store.resolve(r, Progress::none()).await.unwrap_or_else(|e| panic!("{e}"));
    }
    let mut in_use = InUse::default();
    in_use.add(&a.config_digest);
    in_use.add(&a.config_digest);
    let err = store.remove(&a.config_digest, &in_use).err();
    assert!(matches!(err, Some(ImageError::InUse { sandboxes: 2, .. })), "{err:?}");
    assert!(err.is_some_and(|e| e.to_string().contains("2 sandbox")));
    // A reference another one shares is only untagged, in use or not.
    let untagged = store.remove(&ref_a2, &in_use).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(untagged, Removed::Untagged { reference: ref_a2.clone() });
    // The last reference is the image.
    let err = store.remove(&ref_a, &in_use).err();
    assert!(matches!(err, Some(ImageError::InUse { .. })), "{err:?}");
    let removed = store.remove(&ref_b, &InUse::default()).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(removed, Removed::Deleted { freed: 1_000, .. }), "{removed:?}: the shared base stays");
    let hex = b.config_digest.trim_start_matches("sha256:");
    let err = store.remove(&hex[..12], &InUse::default()).err();
    assert!(matches!(err, Some(ImageError::NotInStore(_))), "{err:?}");
    let removed = store.remove(&a.config_digest.trim_start_matches("sha256:")[..12], &InUse::default());
    assert!(matches!(removed, Ok(Removed::Deleted { freed: 11_000, .. })), "{removed:?}");
    assert!(store.list().is_empty());
    assert_eq!(store.size(), 0);
    let layers = std::fs::read_dir(store.root().join("layers")).map(|d| d.count()).unwrap_or(1);
    assert_eq!(layers, 0);
}

/// A tar of `dir`'s contents at `file`.
fn tar_dir(dir: &Path, file: &Path) {
    let out = std::fs::File::create(file).unwrap_or_else(|e| panic!("{e}"));
    let mut tar = tar::Builder::new(out);
    tar.append_dir_all(".", dir).unwrap_or_else(|e| panic!("{e}"));
    tar.into_inner().unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_archives_in_the_oci_forms_newer_engines_write_are_imported() {
    let dir = scratch();
    let image = two_layers();
    // Docker 25's `docker save`: an OCI layout with a `manifest.json` beside it.
    let layout = dir.path().join("docker25");
    image.write_oci_layout(&layout, "v1");
    let blob = |digest: &str| format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
    let manifest = serde_json::json!([{
        "Config": blob(&image.config_digest),
        "RepoTags": ["example/app:v1"],
        "Layers": image.layers.iter().map(|l| blob(&l.digest)).collect::<Vec<_>>(),
    }]);
    std::fs::write(layout.join("manifest.json"), manifest.to_string()).unwrap_or_else(|e| panic!("{e}"));
    let docker25 = dir.path().join("docker25.tar");
    tar_dir(&layout, &docker25);
    // Only the OCI layout.
    let oci_only = dir.path().join("oci-only.tar");
    image.write_oci_archive(&oci_only, "v1");
    for (n, archive) in [docker25, oci_only].iter().enumerate() {
        let store = ImageStore::open(config(&dir.path().join(format!("store{n}")))).unwrap_or_else(|e| panic!("{e}"));
        let got = store
            .resolve(&format!("docker-archive:{}", archive.display()), Progress::none())
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", archive.display()));
        assert_eq!(got.id, image.config_digest, "{}", archive.display());
        assert!(got.layers[1].join("app").is_file());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_leaves_blobs_a_pull_has_not_recorded_yet_and_the_next_open_sweeps_them() {
    let dir = scratch();
    let image = two_layers();
    let layout = dir.path().join("layout");
    image.write_oci_layout(&layout, "v1");
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    let id = store.resolve(&format!("oci:{}:v1", layout.display()), Progress::none()).await.map(|i| i.id);
    let id = id.unwrap_or_else(|e| panic!("{e}"));
    // A pull under way has written its manifest and config, and not yet its record.
    let blobs = dir.path().join("images/blobs/sha256");
    let pending = blobs.join("ab".repeat(32));
    std::fs::write(&pending, b"{}").unwrap_or_else(|e| panic!("{e}"));
    let in_use: InUse = [id.as_str()].into_iter().collect();
    store.prune(&in_use).unwrap_or_else(|e| panic!("{e}"));
    assert!(pending.is_file(), "a prune removed a blob a pull under way still needs");
    // What a failed or killed pull left goes when the store is next opened; the images' stay.
    drop(store);
    let store = ImageStore::open(config(dir.path())).unwrap_or_else(|e| panic!("{e}"));
    assert!(!pending.exists(), "a blob no image names outlived the store's opening");
    assert!(blobs.join(id.trim_start_matches("sha256:")).is_file(), "the image's config went with the orphan");
    let listed: Vec<String> = store.list().into_iter().map(|i| i.id).collect();
    assert_eq!(listed, [id]);
}

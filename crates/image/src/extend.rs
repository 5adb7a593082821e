//! An image in a registry grown by one layer and pushed under another reference, at the
//! registries' level: what the kubernetes provider's snapshots are. The layer is made of named
//! directories as a sandbox's daemon archived them ([`layer_of_dirs`]: names made absolute from
//! `/`, each directory opaque over what the image had there); the base's manifest and config
//! are read from its registry, its layer blobs copied to the target repository as they are
//! (skipped when there, mounted when in the same registry, streamed otherwise: never unpacked),
//! then the new layer, the config grown by its diff_id and a manifest listing them all are
//! pushed. Start at [`push_extended`].

use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;

use crate::ImageError;
use crate::manifest::{self, OCI_MANIFEST};
use crate::reference::DockerRef;
use crate::registry::Registries;

/// The OCI media type of an uncompressed layer, which [`layer_of_dirs`] writes.
const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

/// One directory of a layer: its absolute path, its own mode and owner, and its contents as a
/// tar whose names are relative to it (what `sandmand`'s `GET /v1/archive` answers).
#[derive(Debug, Clone, Copy)]
pub struct DirArchive<'a> {
    pub path: &'a str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub tar: &'a [u8],
}

/// A layer [`layer_of_dirs`] made: the uncompressed tar and its digest (its diff_id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirLayer {
    pub tar: Bytes,
    pub digest: String,
    /// Entries written, the directories themselves and their opaque markers included.
    pub entries: u64,
}

/// Writes `dirs` as one layer: each directory (with its mode and owner), an opaque whiteout in
/// it (so that it holds what the archive holds and nothing the image had there), and every
/// entry of its archive under it, names absolute from `/` as a layer's are. An archive entry
/// that would leave its directory (an absolute name, a `..`) is refused: the archives come from
/// a sandbox. Blocking.
pub fn layer_of_dirs(dirs: &[DirArchive<'_>]) -> Result<DirLayer, ImageError> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut entries = 0u64;
    let write_err = |e: std::io::Error| ImageError::io("cannot write a layer of named directories", e);
    for dir in dirs {
        let rel = relative(dir.path).ok_or_else(|| {
            ImageError::malformed(format!("directory `{}`", dir.path), "not an absolute path below `/`")
        })?;
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(dir.mode & 0o7777);
        header.set_uid(u64::from(dir.uid));
        header.set_gid(u64::from(dir.gid));
        header.set_size(0);
        builder.append_data(&mut header, &rel, std::io::empty()).map_err(write_err)?;
        let mut opaque = tar::Header::new_gnu();
        opaque.set_entry_type(tar::EntryType::Regular);
        opaque.set_mode(0o644);
        opaque.set_size(0);
        builder.append_data(&mut opaque, rel.join(".wh..wh..opq"), std::io::empty()).map_err(write_err)?;
        entries += 2;
        let what = format!("the archive of `{}`", dir.path);
        let mut archive = tar::Archive::new(dir.tar);
        for entry in archive.entries().map_err(|e| ImageError::malformed(&what, e))? {
            let mut entry = entry.map_err(|e| ImageError::malformed(&what, e))?;
            let name = entry.path().map_err(|e| ImageError::malformed(&what, e))?.into_owned();
            let inside = confined(&name).ok_or_else(|| {
                ImageError::malformed(&what, format!("entry `{}` leaves the directory", name.display()))
            })?;
            let Some(inside) = inside else { continue };
            let path = rel.join(inside);
            let mut header = entry.header().clone();
            match header.entry_type() {
                tar::EntryType::Symlink => {
                    let target = entry
                        .link_name()
                        .map_err(|e| ImageError::malformed(&what, e))?
                        .ok_or_else(|| ImageError::malformed(&what, "a symlink without a target"))?
                        .into_owned();
                    builder.append_link(&mut header, &path, &target).map_err(write_err)?;
                }
                tar::EntryType::Link => {
                    let target = entry
                        .link_name()
                        .map_err(|e| ImageError::malformed(&what, e))?
                        .ok_or_else(|| ImageError::malformed(&what, "a hard link without a target"))?
                        .into_owned();
                    let target = confined(&target).flatten().ok_or_else(|| {
                        ImageError::malformed(&what, format!("hard link `{}` leaves the directory", name.display()))
                    })?;
                    builder.append_link(&mut header, &path, rel.join(target)).map_err(write_err)?;
                }
                tar::EntryType::Regular | tar::EntryType::Directory | tar::EntryType::Fifo => {
                    let mut data = Vec::new();
                    entry.read_to_end(&mut data).map_err(|e| ImageError::malformed(&what, e))?;
                    header.set_size(data.len() as u64);
                    builder.append_data(&mut header, &path, data.as_slice()).map_err(write_err)?;
                }
                // Devices and the rest have no place in a snapshot of a directory.
                _ => continue,
            }
            entries += 1;
        }
    }
    let tar = builder.into_inner().map_err(write_err)?;
    let digest = manifest::sha256(&tar);
    Ok(DirLayer { tar: Bytes::from(tar), digest, entries })
}

/// `/a/b` as `a/b`; `None` for what is not absolute or holds `.` or `..`.
fn relative(path: &str) -> Option<PathBuf> {
    let path = Path::new(path);
    let mut components = path.components();
    if components.next() != Some(Component::RootDir) {
        return None;
    }
    let rest: PathBuf = components
        .map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect::<Option<PathBuf>>()?;
    (!rest.as_os_str().is_empty()).then_some(rest)
}

/// An archive entry's name below its directory: `Some(Some(name))`, `Some(None)` for the
/// directory itself (`.`), `None` when it would leave it.
fn confined(name: &Path) -> Option<Option<PathBuf>> {
    let mut out = PathBuf::new();
    for c in name.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some((!out.as_os_str().is_empty()).then_some(out))
}

/// How [`push_extended`] reaches registries: those reached over plain HTTP though not on
/// loopback, the credentials file (as a pull's), and how long a registry may send nothing.
#[derive(Debug, Clone)]
pub struct RegistryAccess {
    pub insecure_registries: Vec<String>,
    pub auth_file: Option<PathBuf>,
    pub stall: Duration,
}

/// What [`push_extended`] pushed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// The digest of the manifest pushed.
    pub digest: String,
    /// How many of the base's layer blobs were sent (the others were there already or mounted).
    pub copied_layers: usize,
}

/// Pushes to `target` (`registry/repository:tag`) the image `base` (in a registry) grown by
/// `layer` (an uncompressed tar, `layer.digest` its diff_id), with `base`'s config, its
/// `rootfs` and history grown by the layer (`created_by`).
pub async fn push_extended(
    access: &RegistryAccess,
    base: &str,
    layer: &DirLayer,
    created_by: &str,
    target: &str,
) -> Result<Pushed, ImageError> {
    let base_name = DockerRef::parse(base)?;
    let target_name = DockerRef::parse(target)?;
    let registries = Registries::new(access.insecure_registries.clone(), access.auth_file.clone(), access.stall);
    let from = registries.connect(&base_name).await?;
    let plan = from.plan().await?;
    let to = registries.connect(&target_name).await?;
    to.authorize_push().await?;
    let same_registry = base_name.registry() == target_name.registry();
    let mut layers = Vec::with_capacity(plan.layers.len() + 1);
    let mut copied_layers = 0;
    for planned in &plan.layers {
        let descriptor = planned.descriptor.as_ref().ok_or_else(|| {
            ImageError::malformed(format!("the manifest of `{base}`"), "a layer without a descriptor")
        })?;
        let there = to.has_blob(&descriptor.digest).await?
            || (same_registry && to.mount_from(from.name(), &descriptor.digest).await);
        if !there {
            let stream = from.blob(descriptor).await?;
            to.put_blob_stream(stream, &descriptor.digest, descriptor.size).await?;
            copied_layers += 1;
        }
        layers.push(serde_json::json!({
            "mediaType": oci_layer_type(&descriptor.media_type),
            "digest": descriptor.digest,
            "size": descriptor.size,
        }));
    }
    to.put_blob(layer.tar.clone(), &layer.digest).await?;
    layers.push(serde_json::json!({ "mediaType": OCI_LAYER_TAR, "digest": layer.digest, "size": layer.tar.len() }));

    let what = format!("the config of `{base}`");
    let mut config: serde_json::Value =
        serde_json::from_slice(&plan.config_bytes).map_err(|e| ImageError::malformed(&what, e))?;
    config
        .pointer_mut("/rootfs/diff_ids")
        .and_then(|d| d.as_array_mut())
        .ok_or_else(|| ImageError::malformed(&what, "it has no rootfs.diff_ids"))?
        .push(serde_json::Value::String(layer.digest.clone()));
    if let Some(history) = config.get_mut("history").and_then(|h| h.as_array_mut()) {
        history.push(serde_json::json!({ "created_by": created_by, "comment": "sandman snapshot" }));
    }
    let config = serde_json::to_vec(&config).map_err(|e| ImageError::malformed(&what, e))?;
    let config_digest = manifest::digest_of(&config);
    let config_size = config.len();
    to.put_blob(Bytes::from(config), &config_digest).await?;
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": { "mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size },
        "layers": layers,
    }))
    .map_err(|e| ImageError::malformed("a snapshot's manifest", e))?;
    let digest = manifest::digest_of(&manifest);
    to.put_manifest(manifest, OCI_MANIFEST).await?;
    Ok(Pushed { digest, copied_layers })
}

/// A Docker layer type as its OCI twin (the same bytes), so that one OCI manifest lists them all.
fn oci_layer_type(media_type: &str) -> &str {
    match media_type {
        "application/vnd.docker.image.rootfs.diff.tar.gzip" => "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.zstd" => "application/vnd.oci.image.layer.v1.tar+zstd",
        manifest::DOCKER_LAYER | "" => OCI_LAYER_TAR,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o640);
            h.set_uid(1000);
            h.set_size(data.len() as u64);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, *data).unwrap_or_else(|e| panic!("{e}"));
        }
        b.into_inner().unwrap_or_else(|e| panic!("{e}"))
    }

    fn names_of(layer: &DirLayer) -> Vec<(String, u64, u32)> {
        let mut a = tar::Archive::new(&layer.tar[..]);
        a.entries()
            .unwrap_or_else(|e| panic!("{e}"))
            .map(|e| {
                let e = e.unwrap_or_else(|e| panic!("{e}"));
                let h = e.header();
                (
                    e.path().unwrap_or_else(|e| panic!("{e}")).display().to_string(),
                    h.uid().unwrap_or_default(),
                    h.mode().unwrap_or_default(),
                )
            })
            .collect()
    }

    #[test]
    fn a_layer_of_named_directories_keeps_their_paths_absolute_and_makes_them_opaque() {
        let work = archive(&[("notes.txt", b"hello"), ("src/main.rs", b"fn main() {}")]);
        let cache = archive(&[("x", b"1")]);
        let long = format!("{}/deep.txt", "d".repeat(120));
        let deep = archive(&[(&long, b"2")]);
        let layer = layer_of_dirs(&[
            DirArchive { path: "/workspace", mode: 0o755, uid: 0, gid: 0, tar: &work },
            DirArchive { path: "/root/.cache", mode: 0o700, uid: 0, gid: 0, tar: &cache },
            DirArchive { path: "/deep", mode: 0o755, uid: 7, gid: 7, tar: &deep },
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let names = names_of(&layer);
        let got: Vec<&str> = names.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(
            got,
            [
                "workspace",
                "workspace/.wh..wh..opq",
                "workspace/notes.txt",
                "workspace/src/main.rs",
                "root/.cache",
                "root/.cache/.wh..wh..opq",
                "root/.cache/x",
                "deep",
                "deep/.wh..wh..opq",
                &format!("deep/{long}"),
            ]
        );
        assert_eq!((names[2].1, names[2].2), (1000, 0o640), "an entry keeps its owner and mode");
        assert_eq!(names[4].2, 0o700, "a directory gets its own mode");
        assert_eq!(layer.digest, manifest::sha256(&layer.tar), "the digest is the tar's, its diff_id");
        assert_eq!(layer.entries, 10);
    }

    #[test]
    fn an_archive_entry_leaving_its_directory_is_refused() {
        for bad in ["../etc/passwd", "a/../../b"] {
            // tar::Builder refuses to write `..` itself: write the name into the header by hand.
            let mut h = tar::Header::new_old();
            h.set_size(1);
            h.set_entry_type(tar::EntryType::Regular);
            h.as_old_mut().name[..bad.len()].copy_from_slice(bad.as_bytes());
            h.set_cksum();
            let mut tar = h.as_bytes().to_vec();
            tar.extend_from_slice(&[b'x'; 512]);
            tar.extend_from_slice(&[0; 1024]);
            let e = layer_of_dirs(&[DirArchive { path: "/w", mode: 0o755, uid: 0, gid: 0, tar: &tar }]);
            assert!(matches!(&e, Err(ImageError::Malformed { why, .. }) if why.contains("leaves")), "{bad}: {e:?}");
        }
        let e = layer_of_dirs(&[DirArchive { path: "w", mode: 0o755, uid: 0, gid: 0, tar: &[] }]);
        assert!(matches!(e, Err(ImageError::Malformed { .. })));
    }

    #[test]
    fn docker_layer_types_become_their_oci_twins() {
        assert_eq!(
            oci_layer_type("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            "application/vnd.oci.image.layer.v1.tar+gzip"
        );
        assert_eq!(
            oci_layer_type("application/vnd.oci.image.layer.v1.tar+gzip"),
            "application/vnd.oci.image.layer.v1.tar+gzip"
        );
    }
}

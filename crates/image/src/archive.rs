//! Images on this machine's disk: an OCI image layout directory (`oci:`), a tar of one
//! (`oci-archive:`), and what `docker save` or the engine's export writes (`docker-archive:`:
//! `manifest.json`, the config, `<id>/layer.tar`, or the OCI layout newer engines write).
//! A tar is indexed once (name → offset) and its members read in place, never extracted.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ImageError;
use crate::manifest::{
    self, Config, DOCKER_CONFIG, DOCKER_LAYER, DOCKER_MANIFEST, Descriptor, MAX_METADATA, Manifest, Parsed,
};
use crate::pull::{Plan, PlannedLayer};
use crate::reference::DockerRef;

/// Where a blob's bytes are: a whole file, or a member of a tar.
#[derive(Debug, Clone)]
pub(crate) struct BlobAt {
    pub path: PathBuf,
    pub offset: u64,
    pub len: u64,
}

impl BlobAt {
    /// Its bytes, read in place.
    pub(crate) fn open(&self) -> Result<impl Read + use<>, ImageError> {
        let mut file =
            File::open(&self.path).map_err(|e| ImageError::io(format!("cannot open {}", self.path.display()), e))?;
        file.seek(SeekFrom::Start(self.offset))
            .map_err(|e| ImageError::io(format!("cannot read {}", self.path.display()), e))?;
        Ok(file.take(self.len))
    }
}

/// The files of a layout: a directory's, or a tar's members.
enum Files {
    Dir(PathBuf),
    Tar { path: PathBuf, members: HashMap<String, (u64, u64)> },
}

impl Files {
    fn tar(path: &Path) -> Result<Files, ImageError> {
        let what = || format!("cannot read the archive {}", path.display());
        let file = File::open(path).map_err(|e| ImageError::io(what(), e))?;
        let mut archive = tar::Archive::new(file);
        let mut members = HashMap::new();
        for entry in archive.entries_with_seek().map_err(|e| ImageError::io(what(), e))? {
            let entry = entry.map_err(|e| ImageError::io(what(), e))?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let name = String::from_utf8_lossy(&entry.path_bytes()).trim_start_matches("./").to_string();
            members.insert(name, (entry.raw_file_position(), entry.size()));
        }
        Ok(Files::Tar { path: path.to_path_buf(), members })
    }

    fn describe(&self) -> String {
        match self {
            Files::Dir(dir) => format!("the OCI layout {}", dir.display()),
            Files::Tar { path, .. } => format!("the archive {}", path.display()),
        }
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Files::Dir(dir) => dir.join(name).is_file(),
            Files::Tar { members, .. } => members.contains_key(name),
        }
    }

    fn at(&self, name: &str) -> Result<BlobAt, ImageError> {
        let missing = || ImageError::malformed(self.describe(), format!("it has no `{name}`"));
        match self {
            Files::Dir(dir) => {
                let path = dir.join(name);
                let len = std::fs::metadata(&path).map_err(|_| missing())?.len();
                Ok(BlobAt { path, offset: 0, len })
            }
            Files::Tar { path, members } => {
                let (offset, len) = *members.get(name).ok_or_else(missing)?;
                Ok(BlobAt { path: path.clone(), offset, len })
            }
        }
    }

    /// A small member (a manifest, an index, a config), whole.
    fn read(&self, name: &str) -> Result<Vec<u8>, ImageError> {
        let at = self.at(name)?;
        if at.len > MAX_METADATA {
            return Err(ImageError::TooLarge {
                what: format!("`{name}` in {}", self.describe()),
                limit: MAX_METADATA,
                unit: "bytes",
            });
        }
        let mut bytes = Vec::with_capacity(at.len as usize);
        at.open()?
            .read_to_end(&mut bytes)
            .map_err(|e| ImageError::io(format!("cannot read `{name}` in {}", self.describe()), e))?;
        Ok(bytes)
    }

    /// A blob of an OCI layout by its descriptor, checked against it.
    fn read_blob(&self, descriptor: &Descriptor) -> Result<Vec<u8>, ImageError> {
        let name = blob_name(&descriptor.digest, &self.describe())?;
        let bytes = self.read(&name)?;
        let actual = manifest::sha256(&bytes);
        if actual != descriptor.digest || bytes.len() as u64 != descriptor.size {
            return Err(ImageError::Digest {
                what: format!("`{name}` in {}", self.describe()),
                expected: format!("{} ({} bytes)", descriptor.digest, descriptor.size),
                actual: format!("{actual} ({} bytes)", bytes.len()),
            });
        }
        Ok(bytes)
    }
}

fn blob_name(digest: &str, what: &str) -> Result<String, ImageError> {
    crate::reference::check_digest(digest)
        .map_err(|why| ImageError::malformed(what, format!("digest `{digest}`: {why}")))?;
    Ok(format!("blobs/sha256/{}", manifest::hex_of(digest)))
}

/// `oci:DIR[:TAG]`.
pub(crate) fn plan_oci_dir(dir: &Path, tag: Option<&str>, reference: &str) -> Result<(Plan, Vec<BlobAt>), ImageError> {
    if !dir.is_dir() {
        return Err(ImageError::NotFound {
            reference: reference.to_string(),
            source_name: format!("the OCI layout {}", dir.display()),
            said: "no such directory".into(),
        });
    }
    plan_oci(&Files::Dir(dir.to_path_buf()), tag, reference)
}

/// `oci-archive:FILE[:TAG]`.
pub(crate) fn plan_oci_archive(
    file: &Path,
    tag: Option<&str>,
    reference: &str,
) -> Result<(Plan, Vec<BlobAt>), ImageError> {
    exists(file, reference)?;
    plan_oci(&Files::tar(file)?, tag, reference)
}

/// `docker-archive:FILE[:REF]`, and the local engine's export (legacy or OCI form).
pub(crate) fn plan_docker_archive(
    file: &Path,
    wanted: Option<&str>,
    reference: &str,
) -> Result<(Plan, Vec<BlobAt>), ImageError> {
    exists(file, reference)?;
    let files = Files::tar(file)?;
    if !files.has("manifest.json") && files.has("index.json") {
        return plan_oci(&files, wanted, reference);
    }
    plan_legacy(&files, wanted, reference)
}

fn exists(file: &Path, reference: &str) -> Result<(), ImageError> {
    if file.is_file() {
        return Ok(());
    }
    Err(ImageError::NotFound {
        reference: reference.to_string(),
        source_name: format!("the archive {}", file.display()),
        said: "no such file".into(),
    })
}

#[derive(Deserialize)]
struct OciIndex {
    manifests: Vec<Descriptor>,
}

/// The annotation an OCI layout names its images by.
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The annotation containerd (and Docker 25's save) gives the full name by.
const IMAGE_NAME: &str = "io.containerd.image.name";

fn plan_oci(files: &Files, tag: Option<&str>, reference: &str) -> Result<(Plan, Vec<BlobAt>), ImageError> {
    let what = files.describe();
    if !files.has("oci-layout") {
        return Err(ImageError::malformed(&what, "it has no `oci-layout` file: not an OCI image layout"));
    }
    let index: OciIndex = serde_json::from_slice(&files.read("index.json")?)
        .map_err(|e| ImageError::malformed(format!("`index.json` in {what}"), e))?;
    let annotation = |d: &Descriptor, key: &str| d.annotations.as_ref().and_then(|a| a.get(key)).cloned();
    let chosen = match tag {
        Some(tag) => index.manifests.iter().find(|d| {
            annotation(d, REF_NAME).as_deref() == Some(tag)
                || annotation(d, IMAGE_NAME).is_some_and(|n| n == tag || same_image(&n, tag))
        }),
        None if index.manifests.len() == 1 => index.manifests.first(),
        None => {
            let names: Vec<String> = index.manifests.iter().filter_map(|d| annotation(d, REF_NAME)).collect();
            return Err(ImageError::Parse {
                reference: reference.to_string(),
                why: format!("{what} holds {} images; name one of: {}", index.manifests.len(), names.join(", ")),
            });
        }
    };
    let Some(chosen) = chosen else {
        return Err(ImageError::NotFound {
            reference: reference.to_string(),
            source_name: what,
            said: format!("no image is named `{}` in its index.json", tag.unwrap_or_default()),
        });
    };
    let bytes = files.read_blob(chosen)?;
    let manifest_what = format!("the manifest {} in {what}", chosen.digest);
    let (manifest_bytes, manifest_digest, manifest) = match manifest::parse_manifest(&bytes, &manifest_what)? {
        Parsed::Image(m) => (bytes, chosen.digest.clone(), m),
        Parsed::Index(inner) => {
            let Some(entry) = manifest::pick_platform(&inner) else {
                let (os, arch, _) = manifest::this_platform();
                return Err(ImageError::NotFound {
                    reference: reference.to_string(),
                    source_name: what,
                    said: format!("its index has no image for {os}/{arch} (it has {})", manifest::platforms(&inner)),
                });
            };
            let bytes = files.read_blob(entry)?;
            match manifest::parse_manifest(&bytes, &manifest_what)? {
                Parsed::Image(m) => (bytes, entry.digest.clone(), m),
                Parsed::Index(_) => return Err(ImageError::malformed(manifest_what, "an index inside an index")),
            }
        }
    };
    let config_bytes = files.read_blob(&manifest.config)?;
    let config_what = format!("the config {} in {what}", manifest.config.digest);
    let config = Config::parse(&config_bytes, &config_what)?;
    let layers = crate::registry::plan_layers(&manifest.layers, &config, &config_what)?;
    let blobs =
        manifest.layers.iter().map(|d| files.at(&blob_name(&d.digest, &what)?)).collect::<Result<Vec<_>, _>>()?;
    let plan = Plan {
        reference: reference.to_string(),
        manifest_digest,
        manifest_bytes,
        config_digest: manifest.config.digest.clone(),
        config_bytes,
        config,
        layers,
    };
    Ok((plan, blobs))
}

/// Whether two Docker references name the same image (`x` and `docker.io/library/x:latest`).
fn same_image(a: &str, b: &str) -> bool {
    match (DockerRef::parse(a), DockerRef::parse(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct LegacyEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// `docker save`'s own format: `manifest.json` lists each image's config and layer tars.
fn plan_legacy(files: &Files, wanted: Option<&str>, reference: &str) -> Result<(Plan, Vec<BlobAt>), ImageError> {
    let what = files.describe();
    let entries: Vec<LegacyEntry> = serde_json::from_slice(&files.read("manifest.json")?)
        .map_err(|e| ImageError::malformed(format!("`manifest.json` in {what}"), e))?;
    let entry = match wanted {
        Some(wanted) => {
            entries.iter().find(|e| e.repo_tags.iter().flatten().any(|t| t == wanted || same_image(t, wanted)))
        }
        None if entries.len() == 1 => entries.first(),
        None => {
            let tags: Vec<&String> = entries.iter().flat_map(|e| e.repo_tags.iter().flatten()).collect();
            return Err(ImageError::Parse {
                reference: reference.to_string(),
                why: format!(
                    "{what} holds {} images; name one of: {}",
                    entries.len(),
                    tags.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
                ),
            });
        }
    };
    let Some(entry) = entry else {
        return Err(ImageError::NotFound {
            reference: reference.to_string(),
            source_name: what,
            said: format!("no image is tagged `{}` in its manifest.json", wanted.unwrap_or_default()),
        });
    };
    let config_bytes = files.read(&entry.config)?;
    let config_digest = manifest::sha256(&config_bytes);
    let config_what = format!("the config `{}` in {what}", entry.config);
    let config = Config::parse(&config_bytes, &config_what)?;
    if config.rootfs.diff_ids.len() != entry.layers.len() {
        return Err(ImageError::malformed(
            config_what,
            format!("{} diff_ids for {} layers in manifest.json", config.rootfs.diff_ids.len(), entry.layers.len()),
        ));
    }
    let blobs = entry.layers.iter().map(|l| files.at(l)).collect::<Result<Vec<_>, _>>()?;
    // The archive has no registry manifest: one is made (uncompressed layers, whose digests
    // are their diff_ids), the same bytes for the same image, so that the store's records are
    // alike whatever an image came from.
    let manifest = Manifest {
        schema_version: 2,
        media_type: DOCKER_MANIFEST.to_string(),
        config: Descriptor {
            media_type: DOCKER_CONFIG.to_string(),
            digest: config_digest.clone(),
            size: config_bytes.len() as u64,
            platform: None,
            annotations: None,
            urls: None,
        },
        layers: blobs
            .iter()
            .zip(&config.rootfs.diff_ids)
            .map(|(blob, diff_id)| Descriptor {
                media_type: DOCKER_LAYER.to_string(),
                digest: diff_id.clone(),
                size: blob.len,
                platform: None,
                annotations: None,
                urls: None,
            })
            .collect(),
    };
    let manifest_bytes = to_json(&manifest)?;
    let layers = config
        .rootfs
        .diff_ids
        .iter()
        .map(|diff_id| PlannedLayer { diff_id: diff_id.clone(), blob: None, descriptor: None })
        .collect();
    let plan = Plan {
        reference: reference.to_string(),
        manifest_digest: manifest::sha256(&manifest_bytes),
        manifest_bytes,
        config_digest,
        config_bytes,
        config,
        layers,
    };
    Ok((plan, blobs))
}

fn to_json(value: &impl Serialize) -> Result<Vec<u8>, ImageError> {
    serde_json::to_vec(value).map_err(|e| ImageError::malformed("a made manifest", e))
}

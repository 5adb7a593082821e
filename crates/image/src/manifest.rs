//! The JSON an image is described by: manifests, indexes (manifest lists), configs, and their
//! digests; [`parse_manifest`] tells them apart and refuses Docker's schema 1, [`pick_platform`]
//! picks this machine's entry of an index, [`Config::image_config`] maps the run settings.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ImageError;

pub(crate) const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub(crate) const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub(crate) const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub(crate) const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub(crate) const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub(crate) const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar";
const SCHEMA1: &str = "application/vnd.docker.distribution.manifest.v1+json";
const SCHEMA1_SIGNED: &str = "application/vnd.docker.distribution.manifest.v1+prettyjws";

/// What a registry is asked for: every manifest kind, schema 1 included so that it is refused
/// with a clear error rather than "not found".
pub(crate) const ACCEPTED: &[&str] = &[OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST, SCHEMA1_SIGNED, SCHEMA1];

/// The largest manifest, index or config the store reads (real ones are a few KiB).
pub(crate) const MAX_METADATA: u64 = 4 << 20;

/// A content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub urls: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

/// An image manifest (OCI or Docker schema 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub media_type: String,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// An OCI index or Docker manifest list.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Index {
    pub manifests: Vec<Descriptor>,
}

/// A manifest of either kind.
#[derive(Debug)]
pub(crate) enum Parsed {
    Image(Box<Manifest>),
    Index(Index),
}

/// Just enough of any manifest to tell which kind it is.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    #[serde(default)]
    schema_version: u32,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    manifests: Option<serde_json::Value>,
    #[serde(default)]
    config: Option<serde_json::Value>,
}

/// Reads a manifest or index; `what` names it in errors (`the manifest of `…``).
pub(crate) fn parse_manifest(bytes: &[u8], what: &str) -> Result<Parsed, ImageError> {
    let probe: Probe = serde_json::from_slice(bytes).map_err(|e| ImageError::malformed(what, e))?;
    let media_type = probe.media_type.as_deref().unwrap_or_default();
    if probe.schema_version == 1 || media_type == SCHEMA1 || media_type == SCHEMA1_SIGNED {
        return Err(ImageError::Unsupported {
            what: what.to_string(),
            why: "it is a Docker schema 1 manifest, which Docker itself no longer pulls; push the image again \
                  with a current tool"
                .into(),
        });
    }
    if probe.schema_version != 2 {
        return Err(ImageError::malformed(what, format!("schemaVersion {} (not 2)", probe.schema_version)));
    }
    let is_index = media_type == OCI_INDEX || media_type == DOCKER_LIST || probe.manifests.is_some();
    if is_index {
        let index: Index = serde_json::from_slice(bytes).map_err(|e| ImageError::malformed(what, e))?;
        return Ok(Parsed::Index(index));
    }
    if probe.config.is_none() {
        return Err(ImageError::malformed(what, "neither `config` nor `manifests`"));
    }
    if !media_type.is_empty() && media_type != OCI_MANIFEST && media_type != DOCKER_MANIFEST {
        return Err(ImageError::Unsupported { what: what.to_string(), why: format!("media type {media_type}") });
    }
    let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| ImageError::malformed(what, e))?;
    Ok(Parsed::Image(Box::new(manifest)))
}

/// This machine's platform as OCI names it: (`linux`, architecture, variant).
pub(crate) fn this_platform() -> (&'static str, &'static str, Option<&'static str>) {
    match std::env::consts::ARCH {
        "x86_64" => ("linux", "amd64", None),
        "aarch64" => ("linux", "arm64", Some("v8")),
        "x86" => ("linux", "386", None),
        "arm" => ("linux", "arm", Some("v7")),
        "powerpc64" => ("linux", "ppc64le", None),
        "s390x" => ("linux", "s390x", None),
        "riscv64" => ("linux", "riscv64", None),
        other => ("linux", other, None),
    }
}

/// The entry of an index for this platform (linux and this architecture; of several, the one
/// whose variant matches, else one without a variant, else the first). `None` when it has none.
pub(crate) fn pick_platform(index: &Index) -> Option<&Descriptor> {
    let (os, arch, variant) = this_platform();
    let candidates: Vec<&Descriptor> = index
        .manifests
        .iter()
        .filter(|d| d.platform.as_ref().is_some_and(|p| p.os == os && p.architecture == arch))
        .collect();
    let variant_of = |d: &&Descriptor| d.platform.as_ref().and_then(|p| p.variant.clone());
    candidates
        .iter()
        .find(|d| variant.is_some() && variant_of(d).as_deref() == variant)
        .or_else(|| candidates.iter().find(|d| variant_of(d).is_none()))
        .or_else(|| candidates.first())
        .copied()
}

/// The platforms an index offers, for the error when none is this one.
pub(crate) fn platforms(index: &Index) -> String {
    let names: Vec<String> = index
        .manifests
        .iter()
        .filter_map(|d| d.platform.as_ref())
        .map(|p| match &p.variant {
            Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
            None => format!("{}/{}", p.os, p.architecture),
        })
        .collect();
    if names.is_empty() { "none named".into() } else { names.join(", ") }
}

/// An image's config: what the store needs of it.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Config {
    #[serde(default)]
    pub os: Option<String>,
    #[serde(default)]
    pub architecture: Option<String>,
    #[serde(default)]
    pub config: Option<RunConfig>,
    pub rootfs: RootFs,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct RunConfig {
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<String>,
}

impl Config {
    pub(crate) fn parse(bytes: &[u8], what: &str) -> Result<Config, ImageError> {
        let config: Config = serde_json::from_slice(bytes).map_err(|e| ImageError::malformed(what, e))?;
        if config.rootfs.kind != "layers" {
            return Err(ImageError::malformed(what, format!("rootfs type `{}` (not `layers`)", config.rootfs.kind)));
        }
        for diff_id in &config.rootfs.diff_ids {
            crate::reference::check_digest(diff_id)
                .map_err(|why| ImageError::malformed(what, format!("diff_id `{diff_id}`: {why}")))?;
        }
        if let Some(os) = config.os.as_deref()
            && os != "linux"
        {
            return Err(ImageError::Unsupported { what: what.to_string(), why: format!("an image for {os}") });
        }
        Ok(config)
    }

    /// The run settings as the sandbox's info shows them; empty strings and lists are "not set"
    /// (the same mapping as the docker provider's `config_of`).
    pub(crate) fn image_config(&self) -> sandman_wire::server::ImageConfig {
        let c = self.config.clone().unwrap_or_default();
        let text = |s: Option<String>| s.filter(|s| !s.is_empty());
        let list = |l: Option<Vec<String>>| l.filter(|l| !l.is_empty());
        sandman_wire::server::ImageConfig {
            user: text(c.user),
            workdir: text(c.working_dir),
            env: c
                .env
                .iter()
                .flatten()
                .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
                .collect(),
            entrypoint: list(c.entrypoint),
            cmd: list(c.cmd),
        }
    }
}

/// How a layer blob is compressed, from its first bytes (media types lie: `docker save` writes
/// plain tars, some registries label zstd as gzip).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// How many first bytes [`Compression::sniff`] needs (fewer only when the blob is shorter).
    pub(crate) const MAGIC: usize = 4;

    pub(crate) fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// Refuses layer media types that are not a (compressed) tar: encrypted layers, foreign
/// (Windows) layers, artifacts that are not images.
pub(crate) fn check_layer_type(media_type: &str, what: &str) -> Result<(), ImageError> {
    let unsupported = |why: &str| Err(ImageError::Unsupported { what: what.to_string(), why: why.to_string() });
    if media_type.contains("+encrypted") {
        return unsupported("an encrypted layer");
    }
    if media_type.contains("foreign") {
        return unsupported("a foreign (Windows) layer");
    }
    if !media_type.is_empty() && !media_type.contains("tar") {
        return unsupported(&format!("layer media type {media_type}"));
    }
    Ok(())
}

/// `sha256:<hex>` of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(ring::digest::digest(&ring::digest::SHA256, bytes)))
}

/// The hex part of a `sha256:` digest (checked by [`crate::reference::check_digest`] before).
pub(crate) fn hex_of(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

/// The digest (`sha256:…`) of `bytes`.
pub(crate) fn digest_of(bytes: &[u8]) -> String {
    let mut h = Hasher::new();
    h.update(bytes);
    h.finish()
}

/// A SHA-256 computed as bytes pass.
pub(crate) struct Hasher(ring::digest::Context);

impl Hasher {
    pub(crate) fn new() -> Hasher {
        Hasher(ring::digest::Context::new(&ring::digest::SHA256))
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub(crate) fn finish(self) -> String {
        format!("sha256:{}", hex::encode(self.0.finish()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_1_is_refused_clearly() {
        let schema1 = br#"{"schemaVersion":1,"name":"x","tag":"t","fsLayers":[]}"#;
        let err = parse_manifest(schema1, "the manifest of `x`").err().unwrap_or_else(|| panic!("parsed"));
        assert!(matches!(err, ImageError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("schema 1"), "{err}");
    }

    #[test]
    fn indexes_pick_this_platform() {
        let (os, arch, _) = this_platform();
        let json = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[
              {{"mediaType":"{OCI_MANIFEST}","digest":"sha256:{a}","size":1,"platform":{{"os":"linux","architecture":"mips"}}}},
              {{"mediaType":"{OCI_MANIFEST}","digest":"sha256:{b}","size":2,"platform":{{"os":"{os}","architecture":"{arch}"}}}},
              {{"mediaType":"{OCI_MANIFEST}","digest":"sha256:{c}","size":3,"platform":{{"os":"unknown","architecture":"unknown"}}}}]}}"#,
            a = "a".repeat(64),
            b = "b".repeat(64),
            c = "c".repeat(64),
        );
        let Ok(Parsed::Index(index)) = parse_manifest(json.as_bytes(), "index") else { panic!("not an index") };
        assert_eq!(pick_platform(&index).map(|d| d.size), Some(2));
        let other = Index { manifests: index.manifests.into_iter().filter(|d| d.size != 2).collect() };
        assert!(pick_platform(&other).is_none());
        assert!(platforms(&other).contains("linux/mips"));
    }

    #[test]
    fn the_run_config_maps_as_the_docker_providers() {
        let config = br#"{"os":"linux","architecture":"amd64","config":{"User":"1000:1000","WorkingDir":"",
            "Env":["PATH=/usr/bin","A=b=c","junk"],"Entrypoint":[],"Cmd":["bash"]},
            "rootfs":{"type":"layers","diff_ids":[]}}"#;
        let config = Config::parse(config, "config").unwrap_or_else(|e| panic!("{e}"));
        let mapped = config.image_config();
        assert_eq!(mapped.user.as_deref(), Some("1000:1000"));
        assert_eq!(mapped.workdir, None, "empty is not set");
        assert_eq!(mapped.env.get("A").map(String::as_str), Some("b=c"));
        assert_eq!(mapped.env.len(), 2);
        assert_eq!(mapped.entrypoint, None);
        assert_eq!(mapped.cmd, Some(vec!["bash".to_string()]));
    }

    #[test]
    fn compression_is_sniffed() {
        assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(Compression::sniff(&[0x28, 0xb5, 0x2f, 0xfd, 0]), Compression::Zstd);
        assert_eq!(Compression::sniff(b"etc/passwd"), Compression::None);
    }
}

//! Talking to registries through oci-client: one client per registry (plain HTTP for loopback
//! and listed insecure registries, as Docker), credentials and the token dance
//! ([`Registries::connect`]), manifests resolved to this platform ([`Remote::plan`]), blobs as
//! streams, and registry errors mapped onto [`ImageError`] with the registry's own words.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};

use crate::ImageError;
use crate::manifest::{self, Config, Descriptor, MAX_METADATA, Parsed};
use crate::pull::{Plan, PlannedLayer};
use crate::reference::{DockerRef, host_of};

/// The registries this store reaches, and how.
pub(crate) struct Registries {
    /// One client per registry (its scheme and token cache are its own). A std mutex: held to
    /// look one up.
    clients: Mutex<HashMap<String, Client>>,
    insecure: Vec<String>,
    auth_file: Option<PathBuf>,
    stall: Duration,
}

impl std::fmt::Debug for Registries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registries").field("insecure", &self.insecure).field("auth_file", &self.auth_file).finish()
    }
}

/// One repository of one registry, authenticated.
pub(crate) struct Remote {
    client: Client,
    auth: RegistryAuth,
    name: DockerRef,
    stall: Duration,
}

impl Registries {
    pub(crate) fn new(insecure: Vec<String>, auth_file: Option<PathBuf>, stall: Duration) -> Registries {
        // reqwest is built without a crypto provider; the workspace's rustls uses ring (kube's).
        // Installing fails when one is installed already, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Registries { clients: Mutex::default(), insecure, auth_file, stall }
    }

    /// Whether Docker would reach this registry over plain HTTP: on loopback, or listed.
    fn plain_http(&self, name: &DockerRef) -> bool {
        name.is_loopback() || self.insecure.iter().any(|i| i == name.registry() || i == host_of(name.registry()))
    }

    fn client(&self, name: &DockerRef) -> Client {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        clients
            .entry(name.registry().to_string())
            .or_insert_with(|| {
                let protocol = if self.plain_http(name) {
                    oci_client::client::ClientProtocol::Http
                } else {
                    oci_client::client::ClientProtocol::Https
                };
                Client::new(oci_client::client::ClientConfig {
                    protocol,
                    // This store picks the platform itself (variants included).
                    platform_resolver: None,
                    connect_timeout: Some(self.stall),
                    // A read that waits this long is a stall.
                    read_timeout: Some(self.stall),
                    user_agent: concat!("sandman-image/", env!("CARGO_PKG_VERSION")),
                    ..Default::default()
                })
            })
            .clone()
    }

    /// A client for `name`'s repository with its credentials, authenticated (the token dance
    /// when the registry asks for it).
    pub(crate) async fn connect(&self, name: &DockerRef) -> Result<Remote, ImageError> {
        let file = crate::auth::auth_file(self.auth_file.as_deref());
        let auth = crate::auth::credentials(file.as_deref(), name.registry(), name.repository(), self.stall).await?;
        let client = self.client(name);
        let reference = name.to_oci();
        let remote = Remote { client, auth, name: name.clone(), stall: self.stall };
        let authenticated = remote.client.auth(&reference, &remote.auth, RegistryOperation::Pull);
        match tokio::time::timeout(self.stall, authenticated).await {
            Err(_) => return Err(remote.stalled("authenticating")),
            Ok(Err(e)) => return Err(remote.error("authenticating", e).await),
            Ok(Ok(_)) => {}
        }
        Ok(remote)
    }
}

impl Remote {
    /// Pushes an image whose layers (uncompressed tars) and config are in memory under this
    /// remote's reference; answers the manifest's digest as the registry has it.
    pub(crate) async fn push(&self, layers: Vec<Bytes>, config: Bytes) -> Result<String, ImageError> {
        let reference = self.name.to_oci();
        let layers: Vec<oci_client::client::ImageLayer> =
            layers.into_iter().map(|data| oci_client::client::ImageLayer::oci_v1(data, None)).collect();
        let config = oci_client::client::Config::new(config, "application/vnd.oci.image.config.v1+json".into(), None);
        if let Err(e) = self.client.push(&reference, &layers, config, &self.auth, None).await {
            return Err(self.error("pushing", e).await);
        }
        match self.client.fetch_manifest_digest(&reference, &self.auth).await {
            Ok(digest) => Ok(digest),
            Err(e) => Err(self.error("reading the pushed manifest's digest", e).await),
        }
    }
}

/// Pushing blob by blob and a manifest of one's own ([`crate::extend`]).
impl Remote {
    /// Authenticates for pushing to this repository (a token server grants push and pull).
    pub(crate) async fn authorize_push(&self) -> Result<(), ImageError> {
        let reference = self.name.to_oci();
        let authenticated = self.client.auth(&reference, &self.auth, RegistryOperation::Push);
        match tokio::time::timeout(self.stall, authenticated).await {
            Err(_) => Err(self.stalled("authenticating to push")),
            Ok(Err(e)) => Err(self.error("authenticating to push", e).await),
            Ok(Ok(_)) => Ok(()),
        }
    }

    pub(crate) fn name(&self) -> &DockerRef {
        &self.name
    }

    /// Whether the repository holds blob `digest`.
    pub(crate) async fn has_blob(&self, digest: &str) -> Result<bool, ImageError> {
        match self.client.blob_exists(&self.name.to_oci(), digest).await {
            Ok(found) => Ok(found),
            Err(e) => Err(self.error(&format!("looking for blob {digest}"), e).await),
        }
    }

    /// Asks the registry to link blob `digest` of repository `from` (of the same registry)
    /// into this one; whether it did.
    pub(crate) async fn mount_from(&self, from: &DockerRef, digest: &str) -> bool {
        self.client.mount_blob(&self.name.to_oci(), &from.to_oci(), digest).await.is_ok()
    }

    /// Uploads blob `digest` from a stream of `size` bytes (the registry checks the digest).
    pub(crate) async fn put_blob_stream(
        &self,
        stream: futures_util::stream::BoxStream<'static, std::io::Result<Bytes>>,
        digest: &str,
        size: u64,
    ) -> Result<(), ImageError> {
        let stream = stream.map(|chunk| chunk.map_err(|e| OciDistributionError::GenericError(Some(e.to_string()))));
        match self.client.push_blob_stream(&self.name.to_oci(), stream, digest, Some(size)).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.error(&format!("pushing blob {digest}"), e).await),
        }
    }

    /// Uploads blob `digest` held in memory.
    pub(crate) async fn put_blob(&self, data: Bytes, digest: &str) -> Result<(), ImageError> {
        match self.client.push_blob(&self.name.to_oci(), data, digest).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.error(&format!("pushing blob {digest}"), e).await),
        }
    }

    /// Puts `manifest` (of type `media_type`) under this reference's tag.
    pub(crate) async fn put_manifest(&self, manifest: Vec<u8>, media_type: &str) -> Result<(), ImageError> {
        let content_type = reqwest::header::HeaderValue::from_str(media_type)
            .map_err(|e| ImageError::malformed(format!("media type `{media_type}`"), e))?;
        match self.client.push_manifest_raw(&self.name.to_oci(), manifest, content_type).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.error("pushing the manifest", e).await),
        }
    }
}

impl Remote {
    fn registry(&self) -> String {
        format!("registry {}", self.name.registry())
    }

    fn stalled(&self, step: &str) -> ImageError {
        ImageError::Stalled { what: format!("{} {step} for `{}`", self.registry(), self.name), after: self.stall }
    }

    /// The manifest `name` resolves to on this platform, its config and its layers.
    pub(crate) async fn plan(&self) -> Result<Plan, ImageError> {
        let reference = self.name.to_oci();
        let (bytes, digest) = self.manifest(&reference).await?;
        let what = format!("the manifest of `{}`", self.name);
        let (manifest_bytes, manifest_digest, manifest) = match manifest::parse_manifest(&bytes, &what)? {
            Parsed::Image(m) => (bytes, digest, m),
            Parsed::Index(index) => {
                let Some(entry) = manifest::pick_platform(&index) else {
                    let (os, arch, _) = manifest::this_platform();
                    return Err(ImageError::NotFound {
                        reference: self.name.to_string(),
                        source_name: self.registry(),
                        said: format!(
                            "its index has no image for {os}/{arch} (it has {})",
                            manifest::platforms(&index)
                        ),
                    });
                };
                let pinned = self.name.to_oci().clone_with_digest(entry.digest.clone());
                let (bytes, digest) = self.manifest(&pinned).await?;
                let what = format!("the {} manifest of `{}`", entry.digest, self.name);
                match manifest::parse_manifest(&bytes, &what)? {
                    Parsed::Image(m) => (bytes, digest, m),
                    Parsed::Index(_) => return Err(ImageError::malformed(what, "an index inside an index")),
                }
            }
        };
        let config_bytes = self.small_blob(&manifest.config).await?;
        let config_what = format!("the config of `{}`", self.name);
        let config = Config::parse(&config_bytes, &config_what)?;
        let layers = plan_layers(&manifest.layers, &config, &config_what)?;
        Ok(Plan {
            reference: self.name.to_string(),
            manifest_digest,
            manifest_bytes: manifest_bytes.to_vec(),
            config_digest: manifest.config.digest.clone(),
            config_bytes,
            config,
            layers,
        })
    }

    async fn manifest(&self, reference: &oci_client::Reference) -> Result<(Bytes, String), ImageError> {
        let pull = self.client.pull_manifest_raw(reference, &self.auth, manifest::ACCEPTED);
        let (bytes, digest) = match tokio::time::timeout(self.stall, pull).await {
            Err(_) => return Err(self.stalled("sending the manifest")),
            Ok(Err(e)) => return Err(self.error("fetching the manifest", e).await),
            Ok(Ok(found)) => found,
        };
        if bytes.len() as u64 > MAX_METADATA {
            return Err(ImageError::TooLarge {
                what: format!("the manifest of `{}`", self.name),
                limit: MAX_METADATA,
                unit: "bytes",
            });
        }
        Ok((bytes, digest))
    }

    /// A config blob, whole, checked against its descriptor.
    async fn small_blob(&self, descriptor: &Descriptor) -> Result<Vec<u8>, ImageError> {
        let what = format!("blob {} of `{}`", descriptor.digest, self.name);
        crate::reference::check_digest(&descriptor.digest).map_err(|why| ImageError::malformed(&what, why))?;
        if descriptor.size > MAX_METADATA {
            return Err(ImageError::TooLarge { what, limit: MAX_METADATA, unit: "bytes" });
        }
        let mut stream = self.blob(descriptor).await?;
        let mut bytes = Vec::with_capacity(descriptor.size as usize);
        loop {
            match tokio::time::timeout(self.stall, stream.next()).await {
                Err(_) => return Err(self.stalled(&format!("sending {what}"))),
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(self.stream_error(&what, e)),
                Ok(Some(Ok(chunk))) => {
                    bytes.extend_from_slice(&chunk);
                    // Never more than the descriptor says, however much is sent.
                    if bytes.len() as u64 > descriptor.size {
                        break;
                    }
                }
            }
        }
        let actual = manifest::sha256(&bytes);
        if bytes.len() as u64 != descriptor.size || actual != descriptor.digest {
            return Err(ImageError::Digest {
                what,
                expected: format!("{} ({} bytes)", descriptor.digest, descriptor.size),
                actual: format!("{actual} ({} bytes)", bytes.len()),
            });
        }
        Ok(bytes)
    }

    /// A blob as a stream, which the caller checks against its digest.
    pub(crate) async fn blob(
        &self,
        descriptor: &Descriptor,
    ) -> Result<futures_util::stream::BoxStream<'static, std::io::Result<Bytes>>, ImageError> {
        let oci = oci_client::manifest::OciDescriptor {
            media_type: descriptor.media_type.clone(),
            digest: descriptor.digest.clone(),
            size: descriptor.size as i64,
            urls: None,
            annotations: None,
            artifact_type: None,
        };
        let reference = self.name.to_oci();
        // Asked as a range from 0: the registry's 206 comes unverified by oci-client, whose own
        // SHA-256 would be the second of every byte (the store checks each blob itself, and a 200
        // is checked by both).
        let pull = self.client.pull_blob_stream_partial(&reference, &oci, 0, None);
        match tokio::time::timeout(self.stall, pull).await {
            Err(_) => Err(self.stalled(&format!("sending blob {}", descriptor.digest))),
            Ok(Err(e)) => Err(self.error(&format!("fetching blob {}", descriptor.digest), e).await),
            Ok(Ok(
                oci_client::client::BlobResponse::Full(stream) | oci_client::client::BlobResponse::Partial(stream),
            )) => Ok(stream.stream),
        }
    }

    /// An error of a blob's stream: a digest mismatch oci-client found, or the connection.
    pub(crate) fn stream_error(&self, what: &str, e: std::io::Error) -> ImageError {
        match e.downcast::<oci_client::errors::DigestError>() {
            Ok(oci_client::errors::DigestError::VerificationError { expected, actual }) => {
                ImageError::Digest { what: what.to_string(), expected, actual }
            }
            Ok(other) => ImageError::Digest {
                what: what.to_string(),
                expected: "a valid digest".into(),
                actual: other.to_string(),
            },
            Err(e) if is_timeout(&e) => {
                ImageError::Stalled { what: format!("{} sending {what}", self.registry()), after: self.stall }
            }
            Err(e) => ImageError::Registry {
                reference: self.name.to_string(),
                registry: self.registry(),
                step: format!("sending {what}"),
                said: error_chain(&e),
                source: None,
            },
        }
    }

    pub(crate) fn stall(&self) -> Duration {
        self.stall
    }

    /// Maps an oci-client error: a missing image, a refusal, a digest, or the rest.
    async fn error(&self, step: &str, e: OciDistributionError) -> ImageError {
        let reference = self.name.to_string();
        let registry = self.registry();
        let not_found =
            |said: String| ImageError::NotFound { reference: reference.clone(), source_name: registry.clone(), said };
        let refused =
            |said: String| ImageError::Unauthorized { reference: reference.clone(), registry: registry.clone(), said };
        match &e {
            OciDistributionError::RegistryError { envelope, .. } => {
                let said = envelope_words(envelope);
                let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|err| &err.code).collect();
                if codes.iter().any(|c| {
                    matches!(c, OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown | OciErrorCode::NotFound)
                }) {
                    return not_found(said);
                }
                if codes.iter().any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied)) {
                    return refused(said);
                }
            }
            OciDistributionError::ServerError { code: 404, message, .. } => {
                return not_found(format!("404: {message}"));
            }
            OciDistributionError::ServerError { code: code @ (401 | 403), message, .. } => {
                return refused(format!("{code}: {message}"));
            }
            OciDistributionError::ImageManifestNotFoundError(said) => return not_found(said.clone()),
            OciDistributionError::AuthenticationFailure(said) => {
                let words = serde_json::from_str::<oci_client::errors::OciEnvelope>(said)
                    .map(|envelope| envelope_words(&envelope))
                    .unwrap_or_else(|_| said.trim().to_string());
                return refused(format!("its token server refused the credentials: {words}"));
            }
            OciDistributionError::RequestError(e) if e.is_timeout() => return self.stalled(step),
            OciDistributionError::UnauthorizedError { url } => return refused(self.explain_401(url).await),
            OciDistributionError::DigestError(d) => {
                return ImageError::Digest {
                    what: format!("{step} for `{reference}`"),
                    expected: "the digest asked for".into(),
                    actual: d.to_string(),
                };
            }
            OciDistributionError::UnsupportedSchemaVersionError(1) => {
                return ImageError::Unsupported {
                    what: format!("the manifest of `{reference}`"),
                    why: "a Docker schema 1 manifest".into(),
                };
            }
            _ => {}
        }
        let said = error_chain(&e);
        ImageError::Registry { reference, registry, step: step.to_string(), said, source: Some(Arc::new(e)) }
    }

    /// oci-client keeps only the URL of a 401; this asks once more, with the same basic
    /// credentials if any, to give the user the registry's own words.
    async fn explain_401(&self, url: &str) -> String {
        let client = match reqwest::Client::builder().timeout(self.stall).build() {
            Ok(c) => c,
            Err(_) => return "401 Unauthorized".into(),
        };
        let mut request = client.get(url);
        if let RegistryAuth::Basic(user, password) = &self.auth {
            request = request.basic_auth(user, Some(password));
        }
        let Ok(response) = request.send().await else { return "401 Unauthorized".into() };
        let status = response.status();
        let challenge =
            response.headers().get(reqwest::header::WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).map(str::to_string);
        let body = response.bytes().await.unwrap_or_default();
        let words = serde_json::from_slice::<oci_client::errors::OciEnvelope>(&body)
            .map(|envelope| envelope_words(&envelope))
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).trim().to_string());
        let credentials = match &self.auth {
            RegistryAuth::Anonymous => "no credentials were found for it",
            _ => "the credentials were refused",
        };
        match challenge {
            Some(c) => format!("{status}: {words} ({credentials}; it asks for {c})"),
            None => format!("{status}: {words} ({credentials})"),
        }
    }
}

/// The layers of a manifest, with their diff_ids from the config.
pub(crate) fn plan_layers(layers: &[Descriptor], config: &Config, what: &str) -> Result<Vec<PlannedLayer>, ImageError> {
    if layers.len() != config.rootfs.diff_ids.len() {
        return Err(ImageError::malformed(
            what,
            format!("{} diff_ids for {} layers in the manifest", config.rootfs.diff_ids.len(), layers.len()),
        ));
    }
    layers
        .iter()
        .zip(&config.rootfs.diff_ids)
        .map(|(descriptor, diff_id)| {
            crate::reference::check_digest(&descriptor.digest)
                .map_err(|why| ImageError::malformed(what, format!("layer `{}`: {why}", descriptor.digest)))?;
            manifest::check_layer_type(&descriptor.media_type, &format!("layer {}", descriptor.digest))?;
            Ok(PlannedLayer {
                diff_id: diff_id.clone(),
                blob: Some((descriptor.digest.clone(), descriptor.size)),
                descriptor: Some(descriptor.clone()),
            })
        })
        .collect()
}

/// A registry's errors as it said them: `manifest unknown (MANIFEST_UNKNOWN)`.
fn envelope_words(envelope: &oci_client::errors::OciEnvelope) -> String {
    let code = |c: &OciErrorCode| serde_json::to_value(c).ok().and_then(|v| v.as_str().map(str::to_string));
    envelope
        .errors
        .iter()
        .map(|e| match code(&e.code) {
            Some(code) => format!("{} ({code})", e.message),
            None => e.message.clone(),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether a stream's error is its connection's read timing out (reqwest's read timeout is the
/// stall time).
fn is_timeout(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::TimedOut
        || e.get_ref().and_then(|inner| inner.downcast_ref::<reqwest::Error>()).is_some_and(reqwest::Error::is_timeout)
}

/// An error and its sources, as one line.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut said = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !said.contains(&text) {
            said.push_str(": ");
            said.push_str(&text);
        }
        source = s.source();
    }
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_listed_registries_are_reached_over_plain_http() {
        let listed = vec!["reg.internal:5000".to_string(), "other.internal".to_string()];
        let registries = Registries::new(listed, None, Duration::from_secs(1));
        let plain = |r: &str| registries.plain_http(&DockerRef::parse(r).unwrap_or_else(|e| panic!("{e}")));
        assert!(plain("127.0.0.1:5000/a"));
        assert!(plain("localhost:5000/a"));
        assert!(plain("[::1]:5000/a"));
        assert!(plain("reg.internal:5000/a"));
        assert!(!plain("reg.internal:6000/a"), "another port of a listed host:port is not listed");
        assert!(plain("other.internal:8443/a"), "a listed host is, at any port");
        assert!(!plain("ghcr.io/a"));
        assert!(!plain("python"));
    }
}

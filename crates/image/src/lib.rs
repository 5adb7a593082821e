//! Sandman's image store: OCI task images pulled from registries or imported from the local
//! Docker engine and image archives, each layer unpacked once for overlayfs into a
//! content-addressed store under a directory the caller gives, and shared read-only by every
//! sandbox. Start at [`ImageStore::open`] and [`ImageStore::resolve`].
//!
//! The rooms: [`reference`] reads what users write; `registry` (with `auth`) talks to
//! registries through oci-client, `engine` to the local Docker engine, `archive` reads image
//! layouts and archives on disk; `pull` installs what they describe, one flight per image and per
//! layer (`flight`); `unpack` turns a layer blob into a directory; `store` keeps the directory,
//! its records and its upkeep.

mod archive;
mod auth;
mod engine;
mod error;
pub mod extend;
mod flight;
pub mod layer;
mod manifest;
mod pull;
pub mod reference;
mod registry;
mod store;
mod unpack;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant, SystemTime};

pub use error::ImageError;
pub use extend::{DirArchive, DirLayer, Pushed, RegistryAccess, layer_of_dirs, push_extended};
pub use layer::{LayerWritten, write_layer};
pub use reference::{DockerRef, ImageSource};
use sandman_wire::server::ImageConfig;

use crate::pull::{Blobs, blocking};
use crate::store::{Disk, LayerRecord};

/// How the store is set up.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The store's directory (the process provider gives `<state_dir>/images`).
    pub root: PathBuf,
    /// The bound [`ImageStore::prune`] keeps the store's unpacked bytes under; `None`: unbounded.
    pub max_size: Option<u64>,
    pub limits: Limits,
    /// How long a registry, the engine's export or a credential helper may send nothing before
    /// the pull fails with [`ImageError::Stalled`].
    pub stall: Duration,
    /// How many layers download at once (over all pulls).
    pub concurrent_layers: usize,
    /// Registries (`host` or `host:port`) reached over plain HTTP though not on loopback (the
    /// server's `--insecure-registry`).
    pub insecure_registries: Vec<String>,
    /// The credentials file, instead of `$REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json` or
    /// `~/.docker/config.json`.
    pub auth_file: Option<PathBuf>,
    /// The local Docker engine's socket, instead of `DOCKER_HOST` (`unix://…`) or
    /// `/var/run/docker.sock`; a path where no engine answers means none is asked.
    pub docker_socket: Option<PathBuf>,
}

impl StoreConfig {
    /// The defaults for a store at `root`: unbounded, [`Limits::default`], a two-minute stall,
    /// three layers at once.
    pub fn new(root: impl Into<PathBuf>) -> StoreConfig {
        StoreConfig {
            root: root.into(),
            max_size: None,
            limits: Limits::default(),
            stall: pull::DEFAULT_STALL,
            concurrent_layers: 3,
            insecure_registries: Vec::new(),
            auth_file: None,
            docker_socket: None,
        }
    }
}

/// Bounds on what one pull may bring, against oversized and endless archives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Compressed bytes of one layer blob (default 8 GiB).
    pub max_layer_compressed: u64,
    /// Uncompressed bytes of all of one image's layers (default 32 GiB).
    pub max_image_uncompressed: u64,
    /// Entries in one layer (default 2,000,000).
    pub max_layer_entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_layer_compressed: 8 << 30, max_image_uncompressed: 32 << 30, max_layer_entries: 2_000_000 }
    }
}

/// An image in the store, ready to be a sandbox's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Its config's digest (`sha256:…`), as Docker's image id.
    pub id: String,
    /// The digest of its (platform) manifest.
    pub manifest_digest: String,
    /// The canonical reference it was resolved by (`docker.io/library/python:3.12`).
    pub reference: String,
    /// Its layers' directories, **bottom first** (the base layer first, as the manifest lists
    /// them). overlayfs's `lowerdir=` takes the top first: join them reversed.
    pub layers: Vec<PathBuf>,
    /// Unpacked bytes of its layers' files.
    pub size: u64,
    /// How its config says to run it.
    pub config: ImageConfig,
    /// Whether this resolve brought it into the store (a caller may [`ImageStore::prune`]).
    pub pulled: bool,
}

/// One image of [`ImageStore::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSummary {
    pub id: String,
    pub manifest_digest: String,
    /// The canonical references that name it.
    pub references: Vec<String>,
    pub size: u64,
    pub layers: usize,
    pub last_used: SystemTime,
}

/// The images sandboxes use (by id), with how many sandboxes use each: what
/// [`ImageStore::remove`] and [`ImageStore::prune`] leave alone. The caller includes the images
/// of sandboxes being created.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InUse(HashMap<String, usize>);

impl InUse {
    /// Counts one more sandbox using the image `id`.
    pub fn add(&mut self, id: &str) {
        *self.0.entry(id.to_string()).or_default() += 1;
    }

    /// How many sandboxes use the image `id`.
    pub fn count(&self, id: &str) -> usize {
        self.0.get(id).copied().unwrap_or(0)
    }
}

impl<S: AsRef<str>> FromIterator<S> for InUse {
    fn from_iter<I: IntoIterator<Item = S>>(ids: I) -> Self {
        let mut in_use = InUse::default();
        for id in ids {
            in_use.add(id.as_ref());
        }
        in_use
    }
}

/// What [`ImageStore::remove`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removed {
    /// The reference no longer names the image, which other references still name.
    Untagged { reference: String },
    /// The image is gone, with the layers no other image used (`freed` bytes).
    Deleted { id: String, freed: u64 },
}

/// What [`ImageStore::prune`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Image ids, least recently used first.
    pub images: Vec<String>,
    pub layers: usize,
    pub freed: u64,
}

/// Where a layer of a pull is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerState {
    /// Bytes are arriving (and being unpacked as they do).
    Downloading,
    /// All bytes are in (or, for a local archive, being read); the unpack is finishing.
    Unpacking,
    /// In the store now.
    Done,
    /// Was in the store already.
    Cached,
}

/// One line of a pull's progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerProgress {
    /// The canonical reference being resolved.
    pub image: String,
    /// The layer's blob digest (its diff_id when the source gives no blob digest).
    pub layer: String,
    /// Blob bytes done.
    pub done: u64,
    /// Blob bytes in all, when known.
    pub total: Option<u64>,
    pub state: LayerState,
}

/// Where a pull's progress goes: a callback, called from the pull's tasks and threads (so it must
/// be quick: a bounded channel's `try_send`, a log line).
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<Report>>);

/// What hears a pull's progress.
type Report = dyn Fn(&LayerProgress) + Send + Sync;

impl Progress {
    pub fn new(report: impl Fn(&LayerProgress) + Send + Sync + 'static) -> Progress {
        Progress(Some(Arc::new(report)))
    }

    /// Progress nobody hears.
    pub fn none() -> Progress {
        Progress(None)
    }

    pub(crate) fn report(&self, line: &LayerProgress) {
        if let Some(report) = &self.0 {
            report(line);
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Progress(callback)" } else { "Progress(none)" })
    }
}

/// The image store. Cheap to clone: clones share one store.
#[derive(Debug, Clone)]
pub struct ImageStore {
    inner: Arc<Inner>,
}

/// What the store's parts share.
pub(crate) struct Inner {
    disk: Arc<Disk>,
    registries: registry::Registries,
    limits: Limits,
    max_size: Option<u64>,
    stall: Duration,
    docker_socket: Option<PathBuf>,
    /// Turns to download a layer (and write it as it streams): `concurrent_layers` at once over
    /// all pulls. A layer gives its turn back once its files are written, before it is synced.
    downloads: Arc<tokio::sync::Semaphore>,
    /// Resolves under way, by reference and by manifest digest.
    images: flight::Flights<Image>,
    /// Layer unpacks under way, by diff_id.
    layers: flight::Flights<LayerRecord>,
    /// What the local engine said of a name lately (its image's id, or none): asked again at
    /// most once every [`ENGINE_ANSWER_KEPT`], so a burst of creates asks it once.
    engine_answers: std::sync::Mutex<HashMap<String, (Instant, EngineAnswer)>>,
}

/// The local engine and the id of its image of a name, or none (no engine, or no such image).
type EngineAnswer = Option<(engine::Engine, String)>;

/// How long the local engine's answer about a name stands: an image rebuilt there (`docker
/// build -t task .`) is what a create of `task` runs after at most this long.
const ENGINE_ANSWER_KEPT: Duration = Duration::from_secs(1);

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore").field("root", &self.disk.root()).field("limits", &self.limits).finish()
    }
}

impl ImageStore {
    /// Opens the store at `config.root`, making it (0700, root's) when it is not there, and
    /// recovers it: what an interrupted unpack left in `tmp/` is removed, and images whose layers
    /// are missing are forgotten. Fails with [`ImageError::Locked`] when another process has it
    /// open. Does file system work: call it where blocking briefly is fine (at start).
    pub fn open(config: StoreConfig) -> Result<ImageStore, ImageError> {
        let disk = Arc::new(Disk::open(&config.root)?);
        let inner = Inner {
            disk,
            registries: registry::Registries::new(config.insecure_registries, config.auth_file, config.stall),
            limits: config.limits,
            max_size: config.max_size,
            stall: config.stall,
            docker_socket: config.docker_socket,
            engine_answers: std::sync::Mutex::default(),
            downloads: Arc::new(tokio::sync::Semaphore::new(config.concurrent_layers.max(1))),
            images: flight::Flights::default(),
            layers: flight::Flights::default(),
        };
        Ok(ImageStore { inner: Arc::new(inner) })
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        self.inner.disk.root()
    }

    /// The image `reference` names, in the store, pulling or importing it first when it is not:
    ///
    /// - a plain reference: the store's tag index (an image pulled once stays pinned, as
    ///   `docker run` does), else the local Docker engine's image, else the registry;
    /// - `docker://REF`: the store's tag index, else the registry;
    /// - `docker-daemon:REF`: the local engine's image (imported unless the store has its id);
    /// - `oci:DIR[:TAG]`, `oci-archive:FILE[:TAG]`, `docker-archive:FILE[:REF]`: read from disk
    ///   (imported unless the store has its id).
    ///
    /// Records a use of the image (see [`ImageStore::touch`]). `host` is not an image here.
    pub async fn resolve(&self, reference: &str, progress: Progress) -> Result<Image, ImageError> {
        let source = ImageSource::parse(reference)?;
        let canonical = source.canonical();
        let inner = self.inner.clone();
        match source {
            ImageSource::Registry { name, registry_only } => {
                // The local engine's image of the name comes first, as in `from_registry`, and
                // over the store's tag too: the engine is where `docker build` puts a task image,
                // and a rebuilt one must not be shadowed by the copy an earlier create imported.
                if !registry_only && let Some((engine, id)) = inner.engine_image(&name).await {
                    if let Some(image) = self.cached(&canonical).await?.filter(|i| i.id == id) {
                        return Ok(image);
                    }
                    let key = format!("ref:engine:{id}:{canonical}");
                    let work = move || async move { inner.from_engine(&engine, &id, canonical, progress).await };
                    return self.inner.images.run(&key, work).await;
                }
                if let Some(image) = self.cached(&canonical).await? {
                    return Ok(image);
                }
                // `docker://` (registry only) and the plain form (engine first) are different work.
                let key = format!("ref:{}:{canonical}", if registry_only { "registry" } else { "any" });
                let work = move || async move { inner.from_registry(name, registry_only, canonical, progress).await };
                self.inner.images.run(&key, work).await
            }
            ImageSource::Daemon(name) => {
                let key = format!("ref:docker-daemon:{canonical}");
                let work = move || async move {
                    let socket = engine::socket(inner.docker_socket.as_deref());
                    let Some(engine) = engine::Engine::find(socket.as_deref()).await else {
                        return Err(ImageError::Engine {
                            step: format!("finding the image `{name}`"),
                            said: format!(
                                "no Docker engine answers on {}",
                                socket.map_or("a Unix socket (DOCKER_HOST is not unix://)".into(), |s| s
                                    .display()
                                    .to_string())
                            ),
                            source: None,
                        });
                    };
                    match engine.image_id(&name.familiar()).await? {
                        Some(id) => inner.from_engine(&engine, &id, canonical, progress).await,
                        None => Err(ImageError::NotFound {
                            reference: name.to_string(),
                            source_name: format!("the Docker engine on {}", engine.socket().display()),
                            said: format!("it has no image `{}`", name.familiar()),
                        }),
                    }
                };
                self.inner.images.run(&key, work).await
            }
            ImageSource::OciDir { dir, tag } => {
                let planned = canonical.clone();
                let plan = move || archive::plan_oci_dir(&dir, tag.as_deref(), &planned);
                self.inner.from_disk(plan, progress).await
            }
            ImageSource::OciArchive { file, tag } => {
                let planned = canonical.clone();
                let plan = move || archive::plan_oci_archive(&file, tag.as_deref(), &planned);
                self.inner.from_disk(plan, progress).await
            }
            ImageSource::DockerArchive { file, reference } => {
                let planned = canonical.clone();
                let plan = move || archive::plan_docker_archive(&file, reference.as_deref(), &planned);
                self.inner.from_disk(plan, progress).await
            }
        }
    }

    /// The image the tag index has for `canonical`, used now.
    async fn cached(&self, canonical: &str) -> Result<Option<Image>, ImageError> {
        let Some(image) = self.inner.disk.by_reference(canonical) else { return Ok(None) };
        let disk = self.inner.disk.clone();
        let id = image.id.clone();
        blocking(move || disk.touch(&id)).await?;
        Ok(Some(image))
    }

    /// Records a use of image `id` now (the provider calls it per create): the order
    /// [`ImageStore::prune`] removes images in. Written to disk at most once a minute per image.
    pub fn touch(&self, id: &str) -> Result<(), ImageError> {
        self.inner.disk.touch(id)
    }

    /// Every image in the store, most recently used first.
    pub fn list(&self) -> Vec<ImageSummary> {
        self.inner.disk.list()
    }

    /// The unpacked bytes of every layer in the store.
    pub fn size(&self) -> u64 {
        self.inner.disk.size()
    }

    /// Removes what `what` names: a reference that other references share is only untagged;
    /// an image (by id, a unique hex prefix of 12 or more digits, or its last reference) is
    /// removed with the layers no other image uses — unless `in_use` counts sandboxes on it
    /// ([`ImageError::InUse`]).
    pub fn remove(&self, what: &str, in_use: &InUse) -> Result<Removed, ImageError> {
        self.inner.disk.remove(what, in_use)
    }

    /// Removes images no sandbox uses (`in_use`), least recently used first, until the store is
    /// under its `max_size`, then every layer and blob no remaining image uses.
    pub fn prune(&self, in_use: &InUse) -> Result<Pruned, ImageError> {
        self.inner.disk.prune(self.inner.max_size, in_use)
    }
}

impl ImageStore {
    /// The image `reference` names in the store's tag index, if any: nothing is pulled.
    pub fn find(&self, reference: &str) -> Option<Image> {
        let canonical = ImageSource::parse(reference).ok()?.canonical();
        self.inner.disk.by_reference(&canonical)
    }

    /// A path in the store's `tmp/` (on the store's file system) to write a layer to before
    /// [`ImageStore::commit`]; the caller removes it.
    pub fn spool_path(&self, prefix: &str) -> PathBuf {
        self.inner.disk.spool_path(prefix)
    }

    /// Adds an image made of image `base`'s layers and one more, the uncompressed layer tar at
    /// `layer` ([`write_layer`] wrote it and says its digest), with `base`'s config (its
    /// `rootfs` and history grown by the layer), under `reference`. The layer is unpacked into
    /// the store as any pulled layer is, and shared read-only by every sandbox of the image.
    pub async fn commit(
        &self,
        base: &str,
        layer: &Path,
        written: &LayerWritten,
        reference: &str,
        created_by: &str,
    ) -> Result<Image, ImageError> {
        let canonical = ImageSource::parse(reference)?.canonical();
        let disk = self.inner.disk.clone();
        let base_id = base.to_string();
        let (record, config_bytes, manifest_bytes) = blocking(move || {
            let record = disk.image_record(&base_id).ok_or_else(|| ImageError::NotInStore(base_id.clone()))?;
            let config = disk.read_blob(&record.id)?;
            let manifest = disk.read_blob(&record.manifest_digest).unwrap_or_default();
            Ok((record, config, manifest))
        })
        .await?;
        let what = format!("the config of image {base}");
        let mut config: serde_json::Value =
            serde_json::from_slice(&config_bytes).map_err(|e| ImageError::malformed(&what, e))?;
        let diff_ids = config
            .pointer_mut("/rootfs/diff_ids")
            .and_then(|d| d.as_array_mut())
            .ok_or_else(|| ImageError::malformed(&what, "it has no rootfs.diff_ids"))?;
        diff_ids.push(serde_json::Value::String(written.digest.clone()));
        if let Some(history) = config.get_mut("history").and_then(|h| h.as_array_mut()) {
            history.push(serde_json::json!({ "created_by": created_by, "comment": "sandman snapshot" }));
        }
        let config_bytes = serde_json::to_vec(&config).map_err(|e| ImageError::malformed(&what, e))?;
        let config_digest = manifest::digest_of(&config_bytes);
        let parsed = manifest::Config::parse(&config_bytes, &what)?;
        let mut layers: Vec<serde_json::Value> = serde_json::from_slice::<serde_json::Value>(&manifest_bytes)
            .ok()
            .and_then(|m| m.get("layers").and_then(|l| l.as_array()).cloned())
            .unwrap_or_default();
        layers.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": written.digest,
            "size": written.size,
        }));
        let manifest_bytes = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": manifest::OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_bytes.len(),
            },
            "layers": layers,
        }))
        .map_err(|e| ImageError::malformed("a snapshot's manifest", e))?;
        let mut planned: Vec<pull::PlannedLayer> = record
            .layers
            .iter()
            .map(|diff_id| pull::PlannedLayer { diff_id: diff_id.clone(), blob: None, descriptor: None })
            .collect();
        planned.push(pull::PlannedLayer {
            diff_id: written.digest.clone(),
            blob: Some((written.digest.clone(), written.size)),
            descriptor: None,
        });
        // The base's layers are in the store (and pinned by the install): only the last is read.
        let at = archive::BlobAt { path: layer.to_path_buf(), offset: 0, len: written.size };
        let blobs = vec![at; planned.len()];
        let plan = pull::Plan {
            reference: canonical,
            manifest_digest: manifest::digest_of(&manifest_bytes),
            manifest_bytes,
            config_digest,
            config_bytes,
            config: parsed,
            layers: planned,
        };
        pull::install(&self.inner, plan, Blobs::Local(Arc::new(blobs)), Progress::none()).await
    }

    /// Pushes image `id` to `reference` (`registry/repository:tag`, with the credentials and
    /// insecure registries of a pull): each layer written again as an uncompressed tar (so its
    /// diff_id is what the pushed config says), the config with those diff_ids. The layers are
    /// held in memory while they are pushed. Answers the pushed manifest's digest.
    pub async fn push(&self, id: &str, reference: &str) -> Result<String, ImageError> {
        let ImageSource::Registry { name, .. } = ImageSource::parse(reference)? else {
            return Err(ImageError::Unsupported {
                what: format!("pushing to `{reference}`"),
                why: "an image can be pushed to a registry only: name one as registry/repository:tag".into(),
            });
        };
        let dirs = self.layers_of(id).ok_or_else(|| ImageError::NotInStore(id.to_string()))?;
        let config_bytes = self.config_bytes(id)?;
        let written = blocking(move || {
            let mut out = Vec::with_capacity(dirs.len());
            for dir in dirs {
                let mut tar = Vec::new();
                let layer = write_layer(&dir, 0, &mut tar)?;
                out.push((layer.digest, bytes::Bytes::from(tar)));
            }
            Ok(out)
        })
        .await?;
        let what = format!("the config of image {id}");
        let mut config: serde_json::Value =
            serde_json::from_slice(&config_bytes).map_err(|e| ImageError::malformed(&what, e))?;
        let diff_ids: Vec<serde_json::Value> =
            written.iter().map(|(d, _)| serde_json::Value::String(d.clone())).collect();
        let rootfs = config
            .pointer_mut("/rootfs/diff_ids")
            .ok_or_else(|| ImageError::malformed(&what, "it has no rootfs.diff_ids"))?;
        *rootfs = serde_json::Value::Array(diff_ids);
        let config = serde_json::to_vec(&config).map_err(|e| ImageError::malformed(&what, e))?;
        let remote = self.inner.registries.connect(&name).await?;
        remote.push(written.into_iter().map(|(_, b)| b).collect(), bytes::Bytes::from(config)).await
    }

    /// The directories of image `id`'s layers, bottom first, with its config and manifest
    /// bytes: what an export pushes.
    pub fn layers_of(&self, id: &str) -> Option<Vec<PathBuf>> {
        let record = self.inner.disk.image_record(id)?;
        Some(record.layers.iter().map(|l| self.inner.disk.layer_fs(l)).collect())
    }

    /// The config bytes of image `id`.
    pub fn config_bytes(&self, id: &str) -> Result<Vec<u8>, ImageError> {
        self.inner.disk.read_blob(id)
    }
}

impl Inner {
    /// A plain or `docker://` reference the tag index does not have.
    async fn from_registry(
        self: Arc<Self>,
        name: DockerRef,
        registry_only: bool,
        canonical: String,
        progress: Progress,
    ) -> Result<Image, ImageError> {
        // A caller that waited for the flight before this one finds it done.
        if let Some(image) = self.disk.by_reference(&canonical) {
            self.disk.touch(&image.id)?;
            return Ok(image);
        }
        if !registry_only && let Some((engine, id)) = self.engine_image(&name).await {
            return self.from_engine(&engine, &id, canonical, progress).await;
        }
        let remote = self.registries.connect(&name).await?;
        let plan = remote.plan().await?;
        pull::install(&self, plan, Blobs::Registry(Arc::new(remote)), progress).await
    }

    /// The local engine and the id of its image `name`, when an engine answers and has one:
    /// its answer of the last [`ENGINE_ANSWER_KEPT`] when there is one.
    async fn engine_image(&self, name: &DockerRef) -> EngineAnswer {
        let familiar = name.familiar();
        let answers = || self.engine_answers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((at, answer)) = answers().get(&familiar)
            && at.elapsed() < ENGINE_ANSWER_KEPT
        {
            return answer.clone();
        }
        let socket = engine::socket(self.docker_socket.as_deref());
        let answer = match engine::Engine::find(socket.as_deref()).await {
            Some(engine) => match engine.image_id(&familiar).await {
                Ok(id) => id.map(|id| (engine, id)),
                Err(e) => {
                    tracing::warn!(image = %name, error = %e, "the local Docker engine failed; pulling instead");
                    None
                }
            },
            None => None,
        };
        let mut answers = answers();
        answers.retain(|_, (at, _)| at.elapsed() < ENGINE_ANSWER_KEPT);
        answers.insert(familiar, (Instant::now(), answer.clone()));
        answer
    }

    /// The engine's image `id`, from the store when it has it, else exported and imported.
    async fn from_engine(
        self: &Arc<Self>,
        engine: &engine::Engine,
        id: &str,
        canonical: String,
        progress: Progress,
    ) -> Result<Image, ImageError> {
        if let Some(image) = self.disk.by_id(id, &canonical) {
            let disk = self.disk.clone();
            let layers: Vec<String> = Vec::new();
            return blocking(move || {
                disk.add_image(&image.id, &image.manifest_digest, &layers, image.config, &canonical)
            })
            .await;
        }
        let spool = Spool(self.disk.spool_path("export"));
        engine.export(id, &spool.0, self.stall).await?;
        let file = spool.0.clone();
        let planned = canonical.clone();
        let (plan, blobs) = blocking(move || archive::plan_docker_archive(&file, None, &planned)).await?;
        pull::install(self, plan, Blobs::Local(Arc::new(blobs)), progress).await
    }

    /// An image on this machine's disk: planned on a blocking thread, then installed (or found).
    async fn from_disk(
        self: &Arc<Self>,
        plan: impl FnOnce() -> Result<(pull::Plan, Vec<archive::BlobAt>), ImageError> + Send + 'static,
        progress: Progress,
    ) -> Result<Image, ImageError> {
        let (plan, blobs) = blocking(plan).await?;
        pull::install(self, plan, Blobs::Local(Arc::new(blobs)), progress).await
    }
}

/// An export's file, removed when the import is done with it.
struct Spool(PathBuf);

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

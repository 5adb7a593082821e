//! Task images on the process provider: every image but `host` comes from the image store
//! ([`sandman_image`]: pulled or imported once, each layer unpacked once), and a sandbox of it
//! has the image's layers as the lower layers of its root, mounted idmapped by its daemon
//! (`--isolate-lower`). What a sandbox runs is recorded in its directory (`image.json`) before its
//! daemon starts, so that a restarted server knows which images are in use and what each
//! sandbox's image says (its user, working directory and environment). Start at [`Images`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sandman_image::{ImageError, ImageSource, ImageStore, InUse, LayerProgress, Progress, StoreConfig};
use sandman_provider::{NodeProgress, NodeState, ProviderError, report_progress};
use sandman_wire::server::{ImageConfig, Reason};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// How often a create's pull tells the server how it gets on, at most.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// The image a sandbox runs, as its directory records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxImage {
    /// The image's id (its config's digest).
    pub id: String,
    /// The reference it was resolved by, canonical (`docker.io/library/python:3.12`).
    pub reference: String,
    /// Its layers' directories, bottom first.
    pub layers: Vec<PathBuf>,
    pub config: ImageConfig,
}

impl SandboxImage {
    /// `--isolate-lower` arguments: overlayfs takes the top layer first.
    pub fn lowerdirs(&self) -> impl Iterator<Item = &PathBuf> {
        self.layers.iter().rev()
    }

    /// The default working directory of its commands: the image's, else `/` (as Docker).
    pub fn workdir(&self) -> PathBuf {
        PathBuf::from(self.config.workdir.clone().unwrap_or_else(|| "/".into()))
    }
}

/// The image store, opened (and so locked: one process at a time) at the first image asked for.
#[derive(Debug)]
pub struct LazyImages {
    config: StoreConfig,
    opened: tokio::sync::OnceCell<Images>,
}

impl LazyImages {
    pub fn new(config: StoreConfig) -> LazyImages {
        LazyImages { config, opened: tokio::sync::OnceCell::new() }
    }

    /// The store, opened on first use (blocking work, off the async threads).
    pub async fn get(&self) -> Result<&Images, ProviderError> {
        self.opened
            .get_or_try_init(|| async {
                let config = self.config.clone();
                tokio::task::spawn_blocking(move || Images::open(config))
                    .await
                    .map_err(|e| ProviderError::io("cannot open the image store", std::io::Error::other(e)))?
            })
            .await
    }

    /// The store when something has opened it already.
    pub fn opened(&self) -> Option<&Images> {
        self.opened.get()
    }
}

/// The provider's image store.
#[derive(Debug, Clone)]
pub struct Images {
    store: Arc<ImageStore>,
}

impl Images {
    /// Opens (makes) the store. Blocking; at start.
    pub fn open(config: StoreConfig) -> Result<Images, ProviderError> {
        let root = config.root.clone();
        let store = ImageStore::open(config).map_err(|e| {
            ProviderError::Unsupported(format!("cannot open the image store `{}`: {e}", root.display()))
        })?;
        Ok(Images { store: Arc::new(store) })
    }

    pub fn store(&self) -> &ImageStore {
        &self.store
    }

    /// Refuses at once a reference that cannot name an image.
    pub fn check(reference: &str) -> Result<(), ProviderError> {
        ImageSource::parse(reference).map(drop).map_err(|e| ProviderError::Unsupported(e.to_string()))
    }

    /// The image `reference` names, pulled or imported when the store has none (the second
    /// value says it was), telling the server (through `progress`, for sandbox `id`) how its
    /// layers get on.
    pub async fn resolve(
        &self,
        id: &str,
        reference: &str,
        progress: &mpsc::Sender<sandman_provider::Progress>,
    ) -> Result<(SandboxImage, bool), ProviderError> {
        let told = Mutex::new(Told::default());
        let (tx, id_owned) = (progress.clone(), id.to_string());
        let on_layer = move |p: &LayerProgress| {
            let mut told = told.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(line) = told.line(p) {
                report_progress(&tx, &id_owned, line);
            }
        };
        let image =
            self.store.resolve(reference, Progress::new(on_layer)).await.map_err(|e| pull_failed(reference, &e))?;
        if let Err(err) = self.store.touch(&image.id) {
            tracing::warn!(image = %image.id, %err, "cannot record an image's use");
        }
        let pulled = image.pulled;
        Ok((
            SandboxImage { id: image.id, reference: image.reference, layers: image.layers, config: image.config },
            pulled,
        ))
    }

    /// `Provider::prepare`: the image pulled ahead of its creates, each layer's progress told.
    pub async fn prepare(
        &self,
        reference: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> Result<(), ProviderError> {
        let node = || "localhost".to_string();
        let tx = progress.clone();
        let on_layer = move |p: &LayerProgress| {
            let _ =
                tx.send(NodeProgress { node: node(), state: NodeState::Pulling, message: describe(p), nodes_total: 1 });
        };
        match self.store.resolve(reference, Progress::new(on_layer)).await {
            Ok(image) => {
                let _ = progress.send(NodeProgress {
                    node: node(),
                    state: NodeState::Ready,
                    message: format!("{} ({})", image.reference, image.id),
                    nodes_total: 1,
                });
                Ok(())
            }
            Err(e) => {
                let failed = pull_failed(reference, &e);
                let _ = progress.send(NodeProgress {
                    node: node(),
                    state: NodeState::Failed,
                    message: failed.to_string(),
                    nodes_total: 1,
                });
                Err(failed)
            }
        }
    }

    /// Removes the images no sandbox uses, least recently used first, until the store is under
    /// its bound. Blocking.
    pub fn prune(&self, in_use: &InUse) {
        match self.store.prune(in_use) {
            Ok(pruned) => tracing::debug!(?pruned, "image store pruned"),
            Err(err) => tracing::warn!(%err, "cannot prune the image store"),
        }
    }
}

/// A failed pull, as `image_pull_failed` with the store's (and so the registry's) words.
fn pull_failed(reference: &str, e: &ImageError) -> ProviderError {
    ProviderError::Failed { reason: Reason::ImagePullFailed, message: format!("cannot get image `{reference}`: {e}") }
}

/// A layer's progress as a line.
fn describe(p: &LayerProgress) -> String {
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let layer = p.layer.strip_prefix("sha256:").map_or(p.layer.as_str(), |h| &h[..h.len().min(12)]);
    match p.total {
        Some(total) => format!("{}: layer {layer} {:?} {:.1}/{:.1} MiB", p.image, p.state, mib(p.done), mib(total)),
        None => format!("{}: layer {layer} {:?} {:.1} MiB", p.image, p.state, mib(p.done)),
    }
}

/// Throttles a create's progress lines: a layer's state changes are always told, its bytes at
/// most every [`PROGRESS_EVERY`].
#[derive(Debug, Default)]
struct Told {
    states: BTreeMap<String, String>,
    last: Option<Instant>,
}

impl Told {
    fn line(&mut self, p: &LayerProgress) -> Option<String> {
        let state = format!("{:?}", p.state);
        let changed = self.states.insert(p.layer.clone(), state.clone()).as_ref() != Some(&state);
        let due = self.last.is_none_or(|at| at.elapsed() >= PROGRESS_EVERY);
        if !changed && !due {
            return None;
        }
        self.last = Some(Instant::now());
        Some(describe(p))
    }
}

/// The images the sandboxes under `sandboxes` run (their `image.json`), with how many each.
/// Blocking.
pub fn in_use(sandboxes: &Path, creating: &[String]) -> InUse {
    let mut used: InUse = creating.iter().collect();
    if let Ok(entries) = std::fs::read_dir(sandboxes) {
        for entry in entries.flatten() {
            if let Some(image) =
                crate::layout::SandboxDir::new(sandboxes, &entry.file_name().to_string_lossy()).read_image()
            {
                used.add(&image.id);
            }
        }
    }
    used
}

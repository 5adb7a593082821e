//! Getting an image into the store: what a source resolves to ([`Plan`]), then [`install`]:
//! its layers fetched a few at a time and unpacked as they stream (each layer once, however many
//! images and callers want it at once), its blobs and record written.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::archive::BlobAt;
use crate::manifest::{Config, Descriptor, Hasher};
use crate::registry::Remote;
use crate::store::LayerRecord;
use crate::unpack::{Budget, Expected};
use crate::{Image, ImageError, Inner, LayerProgress, LayerState, Progress};

/// How many chunks of a layer's download may wait for its unpack: with hyper's chunks of up to
/// about 400 KiB, some 12 MiB a layer, enough to keep the network busy while the unpack writes a
/// large file, little enough that pulls at once hold little memory and that a stalled unpack
/// stops the download (and so is seen as a stall).
const CHUNKS_IN_FLIGHT: usize = 32;
/// How often (in blob bytes) a layer's progress is reported.
const REPORT_EVERY: u64 = 1 << 20;
/// How much of a blob on this machine's disk is read at once.
const LOCAL_READ: usize = 256 << 10;

/// An image as its source describes it, before any layer is fetched.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// The canonical reference it is recorded under.
    pub reference: String,
    pub manifest_digest: String,
    pub manifest_bytes: Vec<u8>,
    /// The image's id.
    pub config_digest: String,
    pub config_bytes: Vec<u8>,
    pub config: Config,
    /// Bottom first.
    pub layers: Vec<PlannedLayer>,
}

#[derive(Debug, Clone)]
pub(crate) struct PlannedLayer {
    pub diff_id: String,
    /// The blob's digest and size, when the source gives them.
    pub blob: Option<(String, u64)>,
    /// The registry's descriptor of the blob.
    pub descriptor: Option<Descriptor>,
}

/// Where an install reads layer blobs from.
#[derive(Clone)]
pub(crate) enum Blobs {
    Registry(Arc<Remote>),
    /// Files (or members of a tar) on this machine, one per layer, in the plan's order.
    Local(Arc<Vec<BlobAt>>),
}

/// Installs `plan`: its layers (those the store lacks), its blobs, and its record under the
/// plan's reference. Callers at once for one manifest share one install.
pub(crate) async fn install(
    inner: &Arc<Inner>,
    plan: Plan,
    blobs: Blobs,
    progress: Progress,
) -> Result<Image, ImageError> {
    let reference = plan.reference.clone();
    let key = format!("manifest:{}", plan.manifest_digest);
    let leader = inner.clone();
    let image =
        inner.images.run(&key, move || async move { install_once(&leader, plan, blobs, progress).await }).await?;
    if image.reference == reference {
        return Ok(image);
    }
    // Another caller's install, under its reference: this one's is added.
    let disk = inner.disk.clone();
    let image =
        blocking(move || disk.add_image(&image.id, &image.manifest_digest, &[], image.config, &reference)).await?;
    Ok(image)
}

async fn install_once(inner: &Arc<Inner>, plan: Plan, blobs: Blobs, progress: Progress) -> Result<Image, ImageError> {
    let started = tokio::time::Instant::now();
    let (_, arch, _) = crate::manifest::this_platform();
    if let Some(theirs) = plan.config.architecture.as_deref().filter(|a| *a != arch) {
        // As Docker: pulled all the same (emulation may run it), but said.
        tracing::warn!(image = %plan.reference, image_architecture = theirs, host = arch, "the image is for another architecture");
    }
    let diff_ids: Vec<String> = plan.layers.iter().map(|l| l.diff_id.clone()).collect();
    let config = plan.config.image_config();
    let disk = inner.disk.clone();
    if disk.by_id(&plan.config_digest, &plan.reference).is_some() && diff_ids.iter().all(|l| disk.layer(l).is_some()) {
        let plan = plan.clone();
        return blocking(move || {
            disk.add_image(&plan.config_digest, &plan.manifest_digest, &diff_ids, config, &plan.reference)
        })
        .await;
    }
    // Held until the record names them, so that a prune meanwhile leaves them.
    let _pins = inner.disk.pin(&diff_ids);
    let budget = Arc::new(Budget::default());
    let layers = plan.layers.iter().enumerate().map(|(index, layer)| {
        layer_once(inner, &plan.reference, index, layer.clone(), blobs.clone(), budget.clone(), progress.clone())
    });
    // Every layer is waited for even when one fails, so that the call returns only once no
    // unpack of it is still writing (a refused layer's directory is gone by then; a sound one's
    // is in the store, for the next try).
    let records = futures_util::future::join_all(layers).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let disk = inner.disk.clone();
    let (manifest_digest, manifest_bytes) = (plan.manifest_digest.clone(), plan.manifest_bytes.clone());
    let (config_digest, config_bytes) = (plan.config_digest.clone(), plan.config_bytes.clone());
    let reference = plan.reference.clone();
    let mut image = blocking(move || {
        disk.put_blob(&manifest_digest, &manifest_bytes)?;
        disk.put_blob(&config_digest, &config_bytes)?;
        disk.add_image(&config_digest, &manifest_digest, &diff_ids, config, &reference)
    })
    .await?;
    image.pulled = true;
    let devices: u64 = records.iter().map(|r| r.devices_skipped).sum();
    let downloaded: u64 = records.iter().map(|r| r.blob_size).sum();
    tracing::info!(
        image = %plan.reference,
        id = %image.id,
        layers = records.len(),
        bytes = downloaded,
        unpacked = image.size,
        device_nodes_skipped = devices,
        seconds = started.elapsed().as_secs_f64(),
        "image added to the store"
    );
    Ok(image)
}

/// One layer: from the store when it is there, else fetched and unpacked once for every caller
/// that wants it at once.
async fn layer_once(
    inner: &Arc<Inner>,
    image: &str,
    index: usize,
    layer: PlannedLayer,
    blobs: Blobs,
    budget: Arc<Budget>,
    progress: Progress,
) -> Result<LayerRecord, ImageError> {
    let name = layer.blob.as_ref().map_or(layer.diff_id.clone(), |(digest, _)| digest.clone());
    let report = |state, done, total| {
        progress.report(&LayerProgress { image: image.to_string(), layer: name.clone(), done, total, state });
    };
    if let Some(record) = inner.disk.layer(&layer.diff_id) {
        budget.add(record.size);
        report(LayerState::Cached, record.blob_size, Some(record.blob_size));
        return Ok(record);
    }
    let leader = inner.clone();
    let (diff_id, image, reporter) = (layer.diff_id.clone(), image.to_string(), progress.clone());
    let record = inner
        .layers
        .run(&diff_id, move || async move { fetch(&leader, &image, index, layer, blobs, budget, reporter).await })
        .await?;
    report(LayerState::Done, record.blob_size, Some(record.blob_size));
    Ok(record)
}

/// Downloads (or reads) and unpacks one layer, then moves it into the store.
async fn fetch(
    inner: &Arc<Inner>,
    image: &str,
    index: usize,
    layer: PlannedLayer,
    blobs: Blobs,
    budget: Arc<Budget>,
    progress: Progress,
) -> Result<LayerRecord, ImageError> {
    // Downloads wait for a turn here, not for each other's bytes.
    let turn = inner.downloads.clone().acquire_owned().await.ok();
    if let Some(record) = inner.disk.layer(&layer.diff_id) {
        return Ok(record);
    }
    let name = layer.blob.as_ref().map_or(layer.diff_id.clone(), |(digest, _)| digest.clone());
    let total = layer.blob.as_ref().map(|(_, size)| *size);
    if let Some(size) = total
        && size > inner.limits.max_layer_compressed
    {
        return Err(ImageError::TooLarge {
            what: format!("layer {name} ({size} bytes)"),
            limit: inner.limits.max_layer_compressed,
            unit: "bytes",
        });
    }
    let report = {
        let (progress, image, name) = (progress.clone(), image.to_string(), name.clone());
        move |state, done| {
            progress.report(&LayerProgress { image: image.clone(), layer: name.clone(), done, total, state })
        }
    };
    let unpack = Unpack {
        disk: inner.disk.clone(),
        expected: Expected { diff_id: layer.diff_id.clone(), blob: layer.blob.clone() },
        limits: inner.limits.clone(),
        budget,
        turn,
    };
    match blobs {
        Blobs::Local(list) => {
            let at = list.get(index).cloned().ok_or_else(|| ImageError::malformed(image, "fewer blobs than layers"))?;
            report(LayerState::Unpacking, 0);
            let unpack_report = report.clone();
            blocking(move || {
                let reader = std::io::BufReader::with_capacity(LOCAL_READ, at.open()?);
                unpack.run(reader, &|done| unpack_report(LayerState::Unpacking, done))
            })
            .await
        }
        Blobs::Registry(remote) => {
            let Some(descriptor) = layer.descriptor.clone() else {
                return Err(ImageError::malformed(image, "a registry layer without a descriptor"));
            };
            stream_layer(&remote, image, &descriptor, unpack, &report).await
        }
    }
}

/// A registry layer: its bytes go to an unpack on a blocking thread as they arrive.
async fn stream_layer(
    remote: &Remote,
    image: &str,
    descriptor: &Descriptor,
    unpack: Unpack,
    report: &(impl Fn(LayerState, u64) + Clone + Send + 'static),
) -> Result<LayerRecord, ImageError> {
    let stall = remote.stall();
    let what = format!("layer {} of `{image}`", descriptor.digest);
    report(LayerState::Downloading, 0);
    let mut stream = remote.blob(descriptor).await?;
    let (tx, rx) = mpsc::channel::<Sent>(CHUNKS_IN_FLIGHT);
    let unpack = tokio::task::spawn_blocking(move || {
        unpack.run(ChannelReader { rx, chunk: Bytes::new(), digest: None }, &|_| {})
    });
    // The blob's digest, taken here as the chunks pass, off the unpack's threads.
    let mut hasher = Hasher::new();
    // One byte past the descriptor's size is sent on, for the unpack to see the blob is longer;
    // nothing after it is read.
    let cap = descriptor.size.saturating_add(1);
    let (mut sent, mut reported) = (0u64, 0u64);
    let mut failure = None;
    loop {
        match tokio::time::timeout(stall, stream.next()).await {
            Err(_) => {
                failure = Some(ImageError::Stalled { what: format!("the download of {what}"), after: stall });
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                failure = Some(remote.stream_error(&what, e));
                break;
            }
            Ok(Some(Ok(mut chunk))) => {
                if sent + chunk.len() as u64 > cap {
                    chunk.truncate((cap - sent) as usize);
                }
                sent += chunk.len() as u64;
                if sent - reported >= REPORT_EVERY {
                    reported = sent;
                    report(LayerState::Downloading, sent);
                }
                hasher.update(&chunk);
                match tokio::time::timeout(stall, tx.send(Sent::Chunk(chunk))).await {
                    Err(_) => {
                        failure = Some(ImageError::Stalled { what: format!("the unpack of {what}"), after: stall });
                        break;
                    }
                    // The unpack has ended (refused the layer): its result says why.
                    Ok(Err(_)) => break,
                    Ok(Ok(())) => {}
                }
                if sent >= cap {
                    break;
                }
            }
        }
    }
    drop(stream);
    if failure.is_none() && tokio::time::timeout(stall, tx.send(Sent::End(hasher.finish()))).await.is_err() {
        // The digest waits as a chunk would; a send that fails finds the unpack ended, and its
        // result says why.
        failure = Some(ImageError::Stalled { what: format!("the unpack of {what}"), after: stall });
    }
    drop(tx);
    report(LayerState::Unpacking, sent);
    let unpacked =
        unpack.await.map_err(|e| ImageError::io(format!("the unpack of {what} died"), std::io::Error::other(e)));
    if let Some(failure) = failure {
        return Err(failure);
    }
    unpacked?
}

/// What one layer's unpack into the store needs, besides its blob.
struct Unpack {
    disk: Arc<crate::store::Disk>,
    expected: Expected,
    limits: crate::Limits,
    budget: Arc<Budget>,
    /// The layer's turn, given back once its files are written: its sync waits for other layers'
    /// writes too, and the next layer need not.
    turn: Option<OwnedSemaphorePermit>,
}

impl Unpack {
    /// Unpacks the blob `reader` gives into a new directory of the store's `tmp/` and moves it
    /// into place.
    fn run(self, reader: impl crate::unpack::Blob, progress: &(dyn Fn(u64) + Sync)) -> Result<LayerRecord, ImageError> {
        let Unpack { disk, expected, limits, budget, turn } = self;
        let work = disk.layer_workspace()?;
        let unpacked = crate::unpack::unpack(reader, &work.path().join("fs"), &expected, &limits, &budget, progress);
        drop(turn);
        let unpacked = unpacked?;
        let record = LayerRecord {
            diff_id: expected.diff_id.clone(),
            blob_digest: unpacked.blob_digest,
            blob_size: unpacked.blob_size,
            size: unpacked.size,
            entries: unpacked.entries,
            devices_skipped: unpacked.devices,
        };
        disk.commit_layer(work, record.clone())?;
        Ok(record)
    }
}

/// What a download sends its unpack.
enum Sent {
    Chunk(Bytes),
    /// The digest of all the chunks, after the last.
    End(String),
}

/// The chunks a download sends, read in place by the unpack's thread.
struct ChannelReader {
    rx: mpsc::Receiver<Sent>,
    chunk: Bytes,
    digest: Option<String>,
}

impl crate::unpack::Blob for ChannelReader {
    fn hashes_itself(&self) -> bool {
        true
    }

    fn digest(&mut self) -> Option<String> {
        self.digest.take()
    }
}

impl std::io::BufRead for ChannelReader {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        while self.chunk.is_empty() && self.digest.is_none() {
            match self.rx.blocking_recv() {
                Some(Sent::Chunk(chunk)) => self.chunk = chunk,
                Some(Sent::End(digest)) => self.digest = Some(digest),
                None => break,
            }
        }
        Ok(&self.chunk)
    }

    fn consume(&mut self, n: usize) {
        self.chunk.advance(n);
    }
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let chunk = std::io::BufRead::fill_buf(self)?;
        let n = buf.len().min(chunk.len());
        buf[..n].copy_from_slice(&chunk[..n]);
        self.chunk.advance(n);
        Ok(n)
    }
}

/// Runs file system work on a blocking thread.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ImageError> + Send + 'static,
) -> Result<T, ImageError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ImageError::io("a blocking task of the image store died", std::io::Error::other(e)))?
}

/// How long a registry may send nothing before a pull fails: the default.
pub(crate) const DEFAULT_STALL: Duration = Duration::from_secs(120);

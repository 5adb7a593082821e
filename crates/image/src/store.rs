//! The store on disk and its index in memory ([`Disk`]): unpacked layers by diff_id, manifests
//! and configs as blobs by digest, one record per image (its references make the tag index), and
//! the upkeep: recovery at open, `touch`, `list`, `remove` and the LRU `prune`.
//!
//! ```text
//! <root>/            0700, root's
//!   lock             held (flock) by the one process that has the store open
//!   layers/<hex>/    one per layer, <hex> its diff_id's: `fs/` (the lower directory) and `layer.json`
//!   blobs/sha256/<hex>   manifests and configs
//!   images/<hex>.json    one per image, <hex> its id's (its config's digest)
//!   tmp/             unpacks under way and removals; emptied at open
//! ```
//!
//! A layer is unpacked in `tmp/`, synced, and renamed into `layers/` whole; an image's record is
//! written (a temporary file renamed over it) only once its layers are there. So a crash leaves
//! at most something in `tmp/` (removed at the next open), or layers no image names yet (reused
//! by the next pull, or pruned).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::manifest::{Config, hex_of};
use crate::reference::ImageSource;
use crate::{Image, ImageError, ImageSummary, InUse, Pruned, Removed};

/// How stale the last-used time on disk may be: a `touch` per sandbox create writes the record
/// only when the one on disk is older than this (LRU order to the minute is enough).
const TOUCH_WRITE_EVERY_MS: u64 = 60_000;

/// An image's record, `images/<hex>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ImageRecord {
    pub id: String,
    pub manifest_digest: String,
    /// Canonical references that name it (the tag index is their union).
    pub references: Vec<String>,
    /// diff_ids, bottom first.
    pub layers: Vec<String>,
    /// Unix milliseconds (the LRU order of uses in one second matters too).
    pub last_used_ms: u64,
    /// The store's count of uses at the last use: orders uses in the same millisecond.
    #[serde(default)]
    pub last_use: u64,
    pub added_ms: u64,
}

/// A layer's record, `layers/<hex>/layer.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LayerRecord {
    pub diff_id: String,
    pub blob_digest: String,
    pub blob_size: u64,
    /// Bytes of regular files unpacked.
    pub size: u64,
    pub entries: u64,
    pub devices_skipped: u64,
}

/// The store's directory and what it holds.
#[derive(Debug)]
pub(crate) struct Disk {
    root: PathBuf,
    /// The flock that keeps a second process out; held as long as the store is open. Also the
    /// file the store's syncs of its file system go through.
    lock: File,
    syncs: Syncs,
    /// The index of what is on disk. A std mutex: held for lookups and for the small record
    /// writes and renames that must agree with it, never across an await; the slow removals of
    /// layer trees happen after it is released.
    state: Mutex<State>,
    /// Names of temporary files and directories.
    counter: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    images: HashMap<String, ImageRecord>,
    configs: HashMap<String, sandman_wire::server::ImageConfig>,
    layers: HashMap<String, LayerRecord>,
    /// Reference → image id.
    tags: HashMap<String, String>,
    /// Layers that installs under way hold: prune leaves them.
    pins: HashMap<String, usize>,
    /// The last-used time on disk, per image.
    written_last_used: HashMap<String, u64>,
    /// Uses counted so far (kept on from the records at open).
    uses: u64,
}

impl State {
    fn image_size(&self, record: &ImageRecord) -> u64 {
        record.layers.iter().filter_map(|l| self.layers.get(l)).map(|l| l.size).sum()
    }

    /// The bytes the store would hold with only the layers images or installs name.
    fn kept_size(&self) -> u64 {
        let kept: HashSet<&String> =
            self.images.values().flat_map(|i| i.layers.iter()).chain(self.pins.keys()).collect();
        self.layers.values().filter(|l| kept.contains(&l.diff_id)).map(|l| l.size).sum()
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Disk {
    /// Opens (making it) the store at `root`, takes its lock, empties `tmp/`, and reads what is
    /// there: a layer without its record, or an image whose layers or blobs are missing, is
    /// dropped.
    pub(crate) fn open(root: &Path) -> Result<Disk, ImageError> {
        let made = |p: &Path, e| ImageError::io(format!("cannot make {}", p.display()), e);
        fs::DirBuilder::new().recursive(true).mode(0o700).create(root).map_err(|e| made(root, e))?;
        // Other users of the host must not reach the layers (they hold the images' setuid
        // binaries and secrets): 0700 at the top, root's where we are root.
        fs::set_permissions(root, fs::Permissions::from_mode(0o700))
            .map_err(|e| ImageError::io(format!("cannot set the mode of {}", root.display()), e))?;
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(root, Some(0), Some(0))
                .map_err(|e| ImageError::io(format!("cannot chown {} to root", root.display()), e))?;
        }
        for sub in ["layers", "blobs/sha256", "images", "tmp"] {
            let p = root.join(sub);
            fs::DirBuilder::new().recursive(true).mode(0o700).create(&p).map_err(|e| made(&p, e))?;
        }
        let lock_path = root.join("lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| ImageError::io(format!("cannot open {}", lock_path.display()), e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(ImageError::Locked { root: root.to_path_buf() }),
            Err(fs::TryLockError::Error(e)) => {
                return Err(ImageError::io(format!("cannot lock {}", lock_path.display()), e));
            }
        }
        let disk = Disk {
            root: root.to_path_buf(),
            lock,
            syncs: Syncs::default(),
            state: Mutex::default(),
            counter: AtomicU64::new(0),
        };
        disk.recover()?;
        Ok(disk)
    }

    fn recover(&self) -> Result<(), ImageError> {
        let tmp = self.root.join("tmp");
        for entry in read_dir(&tmp)? {
            remove_any(&entry);
        }
        let mut state = self.state();
        for dir in read_dir(&self.root.join("layers"))? {
            let record = fs::read(dir.join("layer.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<LayerRecord>(&b).ok())
                .filter(|r| dir.file_name().is_some_and(|n| n == hex_of(&r.diff_id)) && dir.join("fs").is_dir());
            match record {
                Some(record) => {
                    state.layers.insert(record.diff_id.clone(), record);
                }
                None => {
                    tracing::warn!(layer = %dir.display(), "removing a layer directory without a whole record");
                    remove_any(&dir);
                }
            }
        }
        for file in read_dir(&self.root.join("images"))? {
            let record = (file.extension().is_some_and(|e| e == "json"))
                .then(|| fs::read(&file).ok())
                .flatten()
                .and_then(|b| serde_json::from_slice::<ImageRecord>(&b).ok());
            let Some(record) = record else {
                remove_any(&file);
                continue;
            };
            let config = fs::read(self.blob_path(&record.id)).ok().and_then(|b| Config::parse(&b, "config").ok());
            let whole = record.layers.iter().all(|l| state.layers.contains_key(l))
                && self.blob_path(&record.manifest_digest).is_file();
            match config {
                Some(config) if whole => {
                    for reference in &record.references {
                        state.tags.insert(reference.clone(), record.id.clone());
                    }
                    state.configs.insert(record.id.clone(), config.image_config());
                    state.written_last_used.insert(record.id.clone(), record.last_used_ms);
                    state.uses = state.uses.max(record.last_use);
                    state.images.insert(record.id.clone(), record);
                }
                _ => {
                    tracing::warn!(image = %record.id, "dropping an image whose layers or blobs are missing");
                    remove_any(&file);
                }
            }
        }
        // Blobs no image names: what a pull that failed, or was killed, left. Nothing pulls yet
        // (the store is locked to this process and not handed out), so none is a pull's.
        let kept: HashSet<String> = state
            .images
            .values()
            .flat_map(|r| [hex_of(&r.id).to_string(), hex_of(&r.manifest_digest).to_string()])
            .collect();
        for blob in read_dir(&self.root.join("blobs/sha256"))? {
            if blob.file_name().is_some_and(|n| !kept.contains(&*n.to_string_lossy())) {
                remove_any(&blob);
            }
        }
        Ok(())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    fn blob_path(&self, digest: &str) -> PathBuf {
        self.root.join("blobs/sha256").join(hex_of(digest))
    }

    fn layer_dir(&self, diff_id: &str) -> PathBuf {
        self.root.join("layers").join(hex_of(diff_id))
    }

    /// The directory a layer's files are in: what overlayfs takes as a lower directory.
    pub(crate) fn layer_fs(&self, diff_id: &str) -> PathBuf {
        self.layer_dir(diff_id).join("fs")
    }

    fn temp_name(&self, prefix: &str) -> PathBuf {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        self.root.join("tmp").join(format!("{prefix}-{}-{n}", std::process::id()))
    }

    /// A new directory in `tmp/` for an unpack, with its (empty) `fs/`; removed when dropped
    /// unless committed.
    pub(crate) fn layer_workspace(&self) -> Result<tempfile::TempDir, ImageError> {
        let tmp = self.root.join("tmp");
        let dir = tempfile::Builder::new()
            .prefix("layer-")
            .tempdir_in(&tmp)
            .map_err(|e| ImageError::io(format!("cannot make a directory in {}", tmp.display()), e))?;
        let fs_dir = dir.path().join("fs");
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&fs_dir)
            .map_err(|e| ImageError::io(format!("cannot make {}", fs_dir.display()), e))?;
        // A layer's root is root's 0755 unless its tar says otherwise (the mode above is masked).
        fs::set_permissions(&fs_dir, fs::Permissions::from_mode(0o755))
            .map_err(|e| ImageError::io(format!("cannot set the mode of {}", fs_dir.display()), e))?;
        Ok(dir)
    }

    /// A place to spool an export or a download to, in `tmp/`.
    pub(crate) fn spool_path(&self, prefix: &str) -> PathBuf {
        self.temp_name(prefix)
    }

    pub(crate) fn layer(&self, diff_id: &str) -> Option<LayerRecord> {
        self.state().layers.get(diff_id).cloned()
    }

    /// Moves an unpacked, verified layer into the store: its files and record are synced first,
    /// so that after a crash of the machine it is either whole in `layers/` or not there.
    pub(crate) fn commit_layer(&self, work: tempfile::TempDir, record: LayerRecord) -> Result<(), ImageError> {
        if self.state().layers.contains_key(&record.diff_id) {
            return Ok(());
        }
        let json = serde_json::to_vec_pretty(&record).map_err(|e| ImageError::malformed("a layer record", e))?;
        let path = work.path().join("layer.json");
        // The sync below makes it durable with the layer's files.
        fs::write(&path, &json).map_err(|e| ImageError::io(format!("cannot write {}", path.display()), e))?;
        self.syncs.sync(&self.lock).map_err(|e| {
            ImageError::io(format!("layer {}: cannot sync the store's file system", record.diff_id), e.into())
        })?;
        let target = self.layer_dir(&record.diff_id);
        let mut state = self.state();
        if state.layers.contains_key(&record.diff_id) {
            return Ok(());
        }
        let from = work.keep();
        if let Err(e) = fs::rename(&from, &target) {
            remove_any(&from);
            return Err(ImageError::io(format!("cannot move a layer into {}", target.display()), e));
        }
        sync_dir(&self.root.join("layers"));
        state.layers.insert(record.diff_id.clone(), record);
        Ok(())
    }

    /// Keeps the layers from being pruned until the guard is dropped.
    pub(crate) fn pin(self: &Arc<Self>, diff_ids: &[String]) -> Pins {
        let mut state = self.state();
        for id in diff_ids {
            *state.pins.entry(id.clone()).or_default() += 1;
        }
        Pins { disk: self.clone(), diff_ids: diff_ids.to_vec() }
    }

    /// Stores a manifest or config by its digest (which the caller checked).
    pub(crate) fn put_blob(&self, digest: &str, bytes: &[u8]) -> Result<(), ImageError> {
        let path = self.blob_path(digest);
        if path.is_file() {
            return Ok(());
        }
        self.write_atomic(&path, bytes)
    }

    fn write_atomic(&self, path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
        let tmp = self.temp_name("write");
        write_synced(&tmp, bytes)?;
        fs::rename(&tmp, path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            ImageError::io(format!("cannot write {}", path.display()), e)
        })
    }

    fn write_record(&self, record: &ImageRecord) -> Result<(), ImageError> {
        let json = serde_json::to_vec_pretty(record).map_err(|e| ImageError::malformed("an image record", e))?;
        self.write_atomic(&self.root.join("images").join(format!("{}.json", hex_of(&record.id))), &json)
    }

    /// The record of image `id` (its manifest's digest and its layers' diff_ids).
    pub(crate) fn image_record(&self, id: &str) -> Option<ImageRecord> {
        self.state().images.get(id).cloned()
    }

    /// A manifest or config the store keeps, by digest.
    pub(crate) fn read_blob(&self, digest: &str) -> Result<Vec<u8>, ImageError> {
        let path = self.blob_path(digest);
        fs::read(&path).map_err(|e| ImageError::io(format!("cannot read {}", path.display()), e))
    }

    /// The image a reference names in the tag index.
    pub(crate) fn by_reference(&self, reference: &str) -> Option<Image> {
        let state = self.state();
        let id = state.tags.get(reference)?;
        self.image_in(&state, id, reference)
    }

    /// The image with this id, named by `reference`.
    pub(crate) fn by_id(&self, id: &str, reference: &str) -> Option<Image> {
        self.image_in(&self.state(), id, reference)
    }

    fn image_in(&self, state: &State, id: &str, reference: &str) -> Option<Image> {
        let record = state.images.get(id)?;
        Some(Image {
            id: record.id.clone(),
            manifest_digest: record.manifest_digest.clone(),
            reference: reference.to_string(),
            layers: record.layers.iter().map(|l| self.layer_fs(l)).collect(),
            size: state.image_size(record),
            config: state.configs.get(id).cloned().unwrap_or_default(),
            pulled: false,
        })
    }

    /// Records an image whose layers and blobs are in the store, under `reference` (taken from
    /// any image it named before), used now.
    pub(crate) fn add_image(
        &self,
        id: &str,
        manifest_digest: &str,
        layers: &[String],
        config: sandman_wire::server::ImageConfig,
        reference: &str,
    ) -> Result<Image, ImageError> {
        let mut state = self.state();
        if let Some(missing) = layers.iter().find(|l| !state.layers.contains_key(*l)) {
            return Err(ImageError::io(
                format!("cannot record image {id}"),
                std::io::Error::new(std::io::ErrorKind::NotFound, format!("its layer {missing} is not in the store")),
            ));
        }
        let now = now_ms();
        let mut record = state.images.get(id).cloned().unwrap_or_else(|| ImageRecord {
            id: id.to_string(),
            manifest_digest: manifest_digest.to_string(),
            references: Vec::new(),
            layers: layers.to_vec(),
            last_used_ms: now,
            last_use: 0,
            added_ms: now,
        });
        record.last_used_ms = now;
        state.uses += 1;
        record.last_use = state.uses;
        if !record.references.iter().any(|r| r == reference) {
            record.references.push(reference.to_string());
        }
        // A reference names one image: the one it named before loses it.
        if let Some(previous) = state.tags.get(reference).filter(|p| *p != id).cloned()
            && let Some(mut old) = state.images.get(&previous).cloned()
        {
            old.references.retain(|r| r != reference);
            self.write_record(&old)?;
            state.images.insert(previous, old);
        }
        self.write_record(&record)?;
        state.tags.insert(reference.to_string(), id.to_string());
        state.configs.insert(id.to_string(), config);
        state.written_last_used.insert(id.to_string(), now);
        state.images.insert(id.to_string(), record);
        self.image_in(&state, id, reference).ok_or_else(|| ImageError::NotInStore(id.to_string()))
    }

    /// Records a use of an image now (written to disk at most every minute).
    pub(crate) fn touch(&self, id: &str) -> Result<(), ImageError> {
        let mut state = self.state();
        let now = now_ms();
        state.uses += 1;
        let uses = state.uses;
        let Some(record) = state.images.get_mut(id) else { return Err(ImageError::NotInStore(id.to_string())) };
        record.last_used_ms = now;
        record.last_use = uses;
        let record = record.clone();
        if state.written_last_used.get(id).is_none_or(|&w| now.saturating_sub(w) >= TOUCH_WRITE_EVERY_MS) {
            self.write_record(&record)?;
            state.written_last_used.insert(id.to_string(), now);
        }
        Ok(())
    }

    pub(crate) fn list(&self) -> Vec<ImageSummary> {
        let state = self.state();
        let mut images: Vec<ImageSummary> = state
            .images
            .values()
            .map(|r| ImageSummary {
                id: r.id.clone(),
                manifest_digest: r.manifest_digest.clone(),
                references: r.references.clone(),
                size: state.image_size(r),
                layers: r.layers.len(),
                last_used: UNIX_EPOCH + Duration::from_millis(r.last_used_ms),
            })
            .collect();
        let order: HashMap<&String, u64> = state.images.values().map(|r| (&r.id, r.last_use)).collect();
        images.sort_by_key(|i| std::cmp::Reverse(order.get(&i.id).copied().unwrap_or(0)));
        images
    }

    /// The bytes of every layer in the store.
    pub(crate) fn size(&self) -> u64 {
        self.state().layers.values().map(|l| l.size).sum()
    }

    /// The id `what` names: an id (`sha256:…`), its hex, a unique prefix of it of 12 or more
    /// digits, or a reference in the tag index (with the reference, when it was one).
    fn find(state: &State, what: &str) -> Option<(String, Option<String>)> {
        let hex = hex_of(what);
        if state.images.contains_key(&format!("sha256:{hex}")) {
            return Some((format!("sha256:{hex}"), None));
        }
        if hex.len() >= 12 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            let mut matching = state.images.keys().filter(|id| hex_of(id).starts_with(hex));
            if let (Some(id), None) = (matching.next(), matching.next()) {
                return Some((id.clone(), None));
            }
        }
        let reference = ImageSource::parse(what).ok()?.canonical();
        let id = state.tags.get(&reference)?;
        Some((id.clone(), Some(reference)))
    }

    /// Removes a reference (when other references still name its image), or the image (named by
    /// id or by its last reference) unless sandboxes use it, with the layers no other image uses.
    pub(crate) fn remove(&self, what: &str, in_use: &InUse) -> Result<Removed, ImageError> {
        let mut state = self.state();
        let (id, reference) = Disk::find(&state, what).ok_or_else(|| ImageError::NotInStore(what.to_string()))?;
        let Some(mut record) = state.images.get(&id).cloned() else { return Err(ImageError::NotInStore(id)) };
        if let Some(reference) = reference
            && record.references.len() > 1
        {
            record.references.retain(|r| *r != reference);
            self.write_record(&record)?;
            state.tags.remove(&reference);
            state.images.insert(id, record);
            return Ok(Removed::Untagged { reference });
        }
        let sandboxes = in_use.count(&id);
        if sandboxes > 0 {
            return Err(ImageError::InUse { image: id, sandboxes });
        }
        self.forget_image(&mut state, &id);
        let (layers, freed) = self.take_unused_layers(&mut state);
        drop(state);
        self.finish_removal(layers);
        Ok(Removed::Deleted { id, freed })
    }

    /// Removes images no sandbox uses, least recently used first, until the store is under
    /// `max_size` (none when `None`), then every layer no image names.
    pub(crate) fn prune(&self, max_size: Option<u64>, in_use: &InUse) -> Result<Pruned, ImageError> {
        let mut state = self.state();
        let mut removed = Vec::new();
        if let Some(max) = max_size {
            // In the order of their last uses (a count, not the clock: uses in one millisecond,
            // or across a clock's step back, keep their order).
            let mut candidates: Vec<(u64, String)> = state
                .images
                .values()
                .filter(|r| in_use.count(&r.id) == 0)
                .map(|r| (r.last_use, r.id.clone()))
                .collect();
            candidates.sort();
            for (_, id) in candidates {
                if state.kept_size() <= max {
                    break;
                }
                self.forget_image(&mut state, &id);
                removed.push(id);
            }
        }
        // An image's manifest and config go with its record (`forget_image`). Blobs no record
        // names are not swept here: a pull under way has written its own and not yet its
        // record. What a failed pull or a crash left is swept when the store is opened.
        let (layers, freed) = self.take_unused_layers(&mut state);
        drop(state);
        let layer_count = layers.len();
        self.finish_removal(layers);
        Ok(Pruned { images: removed, layers: layer_count, freed })
    }

    /// Drops an image's record and its references (not its layers).
    fn forget_image(&self, state: &mut State, id: &str) {
        let Some(record) = state.images.remove(id) else { return };
        for reference in &record.references {
            if state.tags.get(reference).is_some_and(|i| i == id) {
                state.tags.remove(reference);
            }
        }
        state.configs.remove(id);
        state.written_last_used.remove(id);
        let path = self.root.join("images").join(format!("{}.json", hex_of(id)));
        if let Err(e) = fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove an image record");
        }
        let _ = fs::remove_file(self.blob_path(&record.manifest_digest));
        let _ = fs::remove_file(self.blob_path(&record.id));
    }

    /// Takes the layers no image names and no install holds out of the store (renamed into
    /// `tmp/`, so they are gone at once); their paths, to be removed after the lock, and bytes.
    fn take_unused_layers(&self, state: &mut State) -> (Vec<PathBuf>, u64) {
        let named: HashSet<String> =
            state.images.values().flat_map(|i| i.layers.iter().cloned()).chain(state.pins.keys().cloned()).collect();
        let unused: Vec<String> = state.layers.keys().filter(|l| !named.contains(*l)).cloned().collect();
        let mut taken = Vec::new();
        let mut freed = 0;
        for diff_id in unused {
            let from = self.layer_dir(&diff_id);
            let to = self.temp_name("removed");
            match fs::rename(&from, &to) {
                Ok(()) => taken.push(to),
                Err(e) => {
                    tracing::warn!(layer = %diff_id, error = %e, "cannot take a layer out of the store");
                    continue;
                }
            }
            if let Some(record) = state.layers.remove(&diff_id) {
                freed += record.size;
            }
        }
        (taken, freed)
    }

    fn finish_removal(&self, taken: Vec<PathBuf>) {
        for path in taken {
            remove_any(&path);
        }
    }
}

/// Layers an install holds against pruning.
#[derive(Debug)]
pub(crate) struct Pins {
    disk: Arc<Disk>,
    diff_ids: Vec<String>,
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut state = self.disk.state();
        for id in &self.diff_ids {
            if let Some(n) = state.pins.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    state.pins.remove(id);
                }
            }
        }
    }
}

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let entries = fs::read_dir(dir).map_err(|e| ImageError::io(format!("cannot read {}", dir.display()), e))?;
    Ok(entries.flatten().map(|e| e.path()).collect())
}

/// Removes a file or a directory tree (never following symlinks), logging what it cannot.
fn remove_any(path: &Path) {
    let result = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => Ok(()),
    };
    if let Err(e) = result {
        tracing::warn!(path = %path.display(), error = %e, "cannot remove");
    }
}

/// The syncs of the store's file system (`syncfs`), one at a time: a caller waits for one that
/// begins after it asks, which is as good as its own, so layers finishing together share one
/// instead of each waiting in turn for all the others' writes.
#[derive(Debug, Default)]
struct Syncs {
    /// What has begun and ended. A std mutex: held only to read and count, never across a sync.
    state: Mutex<SyncState>,
    /// Signalled when a sync ends.
    ended: Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    /// Syncs begun and ended, counted from 1.
    begun: u64,
    ended: u64,
    /// The last sync that failed, and how.
    failed: Option<(u64, rustix::io::Errno)>,
}

impl Syncs {
    /// Returns once a sync that began after this call has ended (made by this caller, or by
    /// another while this one waited); its error if it, or one after it, failed.
    fn sync(&self, fd: &File) -> Result<(), rustix::io::Errno> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let wanted = state.begun + 1;
        loop {
            if state.ended >= wanted {
                return match state.failed {
                    Some((sync, e)) if sync >= wanted => Err(e),
                    _ => Ok(()),
                };
            }
            if state.begun == state.ended {
                state.begun += 1;
                let this = state.begun;
                drop(state);
                let result = rustix::fs::syncfs(fd);
                state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                state.ended = this;
                if let Err(e) = result {
                    state.failed = Some((this, e));
                }
                self.ended.notify_all();
                continue;
            }
            state = self.ended.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    let mut file = File::create(path).map_err(|e| ImageError::io(format!("cannot create {}", path.display()), e))?;
    file.write_all(bytes).map_err(|e| ImageError::io(format!("cannot write {}", path.display()), e))?;
    file.sync_all().map_err(|e| ImageError::io(format!("cannot sync {}", path.display()), e))
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syncs_asked_for_at_once_are_all_answered_sharing_what_they_can() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = File::create(dir.path().join("f")).unwrap_or_else(|e| panic!("{e}"));
        let syncs = Syncs::default();
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| assert_eq!(syncs.sync(&file), Ok(())));
            }
        });
        let state = syncs.state.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(state.begun, state.ended, "none left running");
        assert!((1..=8).contains(&state.ended), "{} syncs for 8 callers", state.ended);
        drop(state);
        // One asked for after those have ended is a sync of its own.
        assert_eq!(syncs.sync(&file), Ok(()));
        let ended = syncs.state.lock().unwrap_or_else(|e| e.into_inner()).ended;
        assert!(ended >= 2);
    }
}

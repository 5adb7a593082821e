//! Snapshots on the process provider: a sandbox's writable layer, which its daemon keeps open at
//! [`LAYER_FD`] (the layer's tmpfs is in no mount the host sees), is written as one more OCI
//! layer over the sandbox's image into the image store, with the image's config, under
//! [`reference_of`] the snapshot. A create of `snapshot:<id>` runs that image: its layers,
//! the snapshot's included, are shared read-only by every sandbox of it (copy on write), so a
//! fork costs the size of the changes once. The sandbox is frozen (cgroup v2 `cgroup.freeze`)
//! while its layer is read, so the files hold still. Start at [`ProcessProvider::take_snapshot`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandman_provider::{ProviderError, SnapshotMade};
use sandman_wire::snapshots::{LAYER_FD, snapshot_of_image};

use crate::ProcessProvider;
use crate::cgroup::{Dirs, Version};
use crate::layout::SandboxDir;

/// The registry host of snapshots' references in the image store: no registry answers there,
/// and a create names them only as `snapshot:<id>`.
pub const SNAPSHOT_REGISTRY: &str = "sandman.snapshot";

/// How long a freeze may take to settle before the snapshot is taken unfrozen.
const FREEZE_WAIT: Duration = Duration::from_secs(5);

/// The store's reference of snapshot `id`.
pub fn reference_of(id: &str) -> String {
    format!("{SNAPSHOT_REGISTRY}/{id}:latest")
}

/// The store reference a create's image stands for: a snapshot's, or the image as written.
pub fn store_reference(image: &str) -> Option<String> {
    snapshot_of_image(image).map(reference_of)
}

/// Refuses a snapshot id that could not be part of a reference.
pub fn check_snapshot_id(id: &str) -> Result<(), ProviderError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-');
    if ok { Ok(()) } else { Err(ProviderError::NotFound(format!("snapshot `{id}`"))) }
}

impl ProcessProvider {
    /// `Provider::snapshot`: the sandbox's layer, written while it is frozen, committed into the
    /// store over its image.
    pub(crate) async fn take_snapshot(&self, id: &str, snapshot: &str) -> Result<SnapshotMade, ProviderError> {
        check_snapshot_id(snapshot)?;
        if crate::check_id(id).is_err() {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let Some(lazy) = &self.images else {
            return Err(ProviderError::Unsupported(
                "the process provider takes snapshots of isolated sandboxes only, and its isolation is off (--isolation none): a snapshot is the sandbox's own writable layer, which such a sandbox does not have".into(),
            ));
        };
        let images = lazy.get().await?.clone();
        let dir = SandboxDir::new(&self.sandboxes, id);
        let watched = self.lock_watched().get(id).map(|w| w.daemon);
        let found = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || {
                let spec = dir.read_spec().ok()?;
                Some((spec, dir.read_image(), dir.read_ids(), dir.read_cgroups(), dir.read_pid()))
            })
            .await
            .map_err(|e| ProviderError::io("cannot read a sandbox's records", std::io::Error::other(e)))?
        };
        let Some((_, image, ids, cgroups, recorded)) = found else {
            return Err(ProviderError::NotFound(id.to_string()));
        };
        let Some(image) = image else {
            return Err(ProviderError::Unsupported(format!(
                "sandbox `{id}` runs `host`, the host's own root: a snapshot is a layer over an image; create the sandbox from an image to snapshot it"
            )));
        };
        let Some(ids) = ids else {
            return Err(ProviderError::Unsupported(format!(
                "sandbox `{id}` is not isolated: it has no layer of its own"
            )));
        };
        let waiter = watched.or(recorded).filter(|w| w.is_running()).ok_or_else(|| ProviderError::Failed {
            reason: sandman_wire::server::Reason::ProviderError,
            message: format!("sandbox `{id}`: its daemon is not running"),
        })?;
        let spool = images.store().spool_path("snapshot");
        let layer = Spool(spool.clone());
        let what = format!("sandbox `{id}`");
        let written = tokio::task::spawn_blocking(move || {
            let daemon = daemon_of(waiter.pid)
                .ok_or_else(|| ProviderError::Backend(format!("{what}: its daemon is not running")))?;
            let upper = PathBuf::from(format!("/proc/{daemon}/fd/{LAYER_FD}"));
            let frozen = cgroups.as_ref().and_then(Frozen::freeze);
            let file = std::fs::File::create(&spool)
                .map_err(|e| ProviderError::io(format!("cannot make `{}`", spool.display()), e))?;
            let written = sandman_image::write_layer(&upper, ids, file)
                .map_err(|e| ProviderError::Backend(format!("cannot read the layer of {what}: {e}")));
            drop(frozen);
            written
        })
        .await
        .map_err(|e| ProviderError::io("cannot write a snapshot's layer", std::io::Error::other(e)))??;
        let made = images
            .store()
            .commit(&image.id, &layer.0, &written, &reference_of(snapshot), &format!("sandman snapshot of {id}"))
            .await
            .map_err(|e| ProviderError::Backend(format!("cannot add snapshot `{snapshot}` to the image store: {e}")))?;
        drop(layer);
        tracing::info!(sandbox = id, snapshot, image = %made.id, bytes = written.size, files = written.file_bytes, "snapshot committed to the image store");
        Ok(SnapshotMade { size: Some(written.size), pushed: None })
    }

    /// `Provider::delete_snapshot`: the snapshot's image leaves the store unless sandboxes run
    /// it; then its reference goes now and the image with the next prune once they are gone.
    pub(crate) async fn remove_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        if check_snapshot_id(snapshot).is_err() {
            return Ok(());
        }
        let (images, in_use) = self.store_and_use().await?;
        let reference = reference_of(snapshot);
        tokio::task::spawn_blocking(move || {
            let Some(image) = images.store().find(&reference) else { return Ok(()) };
            match images.store().remove(&reference, &in_use) {
                Ok(_) | Err(sandman_image::ImageError::NotInStore(_)) => Ok(()),
                Err(sandman_image::ImageError::InUse { .. }) => {
                    tracing::info!(snapshot = %reference, image = %image.id, "a snapshot's image stays in the store while sandboxes run it");
                    Ok(())
                }
                Err(e) => Err(crate::image_error(e)),
            }
        })
        .await
        .map_err(|e| ProviderError::io("cannot remove a snapshot", std::io::Error::other(e)))?
    }
}

impl ProcessProvider {
    /// `Provider::export_snapshot`: the snapshot's image (its image's layers and its own) pushed
    /// from the store to `reference`, with the credentials of a pull.
    pub(crate) async fn push_snapshot(&self, snapshot: &str, reference: &str) -> Result<String, ProviderError> {
        check_snapshot_id(snapshot)?;
        let (images, _) = self.store_and_use().await?;
        let image = images
            .store()
            .find(&reference_of(snapshot))
            .ok_or_else(|| ProviderError::NotFound(format!("snapshot `{snapshot}` in the image store")))?;
        images
            .store()
            .push(&image.id, reference)
            .await
            .map_err(|e| ProviderError::Backend(format!("cannot push snapshot `{snapshot}` to `{reference}`: {e}")))
    }
}

/// The daemon of an isolated sandbox: the child of the waiter the provider started.
fn daemon_of(waiter: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children"))
        .ok()?
        .split_whitespace()
        .find_map(|p| p.parse().ok())
}

/// A file in the store's `tmp/`, removed when dropped.
struct Spool(PathBuf);

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A sandbox's v2 cgroup frozen by a snapshot, thawed when dropped, unless it was frozen before
/// (a paused sandbox stays paused).
struct Frozen(PathBuf);

impl Frozen {
    fn freeze(dirs: &Dirs) -> Option<Frozen> {
        if dirs.version != Version::V2 {
            return None;
        }
        let dir = dirs.pids.clone();
        let freeze = dir.join("cgroup.freeze");
        if std::fs::read_to_string(&freeze).ok()?.trim() == "1" {
            return None;
        }
        std::fs::write(&freeze, "1").ok()?;
        let started = std::time::Instant::now();
        while !is_frozen(&dir) && started.elapsed() < FREEZE_WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        Some(Frozen(dir))
    }
}

fn is_frozen(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events")).is_ok_and(|e| e.lines().any(|l| l == "frozen 1"))
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(self.0.join("cgroup.freeze"), "0") {
            tracing::warn!(cgroup = %self.0.display(), error = %e, "cannot thaw a sandbox after its snapshot");
        }
    }
}

//! Snapshots on Kubernetes: the directories a request names, archived by the server through the
//! sandbox's daemon, become one layer over the pod's image (`sandman_image::layer_of_dirs`),
//! pushed with the image's config to the registry of [`SnapshotsConfig`] as
//! `<registry>:<snapshot id>` (`sandman_image::push_extended`: the image's own layers are copied
//! between registries as they are, never unpacked). A create of `snapshot:<id>` runs that image
//! ([`task_image`]). A pod's whole file system cannot be recorded: it belongs to the node's
//! container runtime, which the Kubernetes API cannot commit. Start at
//! [`KubeProvider::push_snapshot`].

use std::time::Duration;

use sandman_provider::{NamedDir, ProviderError, SnapshotMade};
use sandman_wire::snapshots::snapshot_of_image;

use crate::KubeProvider;
use crate::config::{KubeConfig, SnapshotsConfig};
use crate::pod::{TASK_CONTAINER, pod_name};

/// Why the provider records only named directories.
pub const WHOLE_REFUSED: &str = "a pod's file system belongs to its node's container runtime, which the Kubernetes \
                                 API cannot commit into an image; the named directories are archived through the \
                                 sandbox's daemon and pushed as one layer over the pod's image";

/// How long a registry may send nothing during a snapshot's push.
const STALL: Duration = Duration::from_secs(120);

/// Why snapshots are refused when no registry is configured.
pub fn no_registry() -> ProviderError {
    ProviderError::Unsupported(
        "the kubernetes provider pushes snapshots to a registry its nodes pull from, and none is configured: set \
         `snapshots: {registry: \"host:port/repository\"}` in its configuration (docs/kubernetes.md, \"Snapshots and \
         forks\")"
            .into(),
    )
}

/// The image reference snapshot `id` is pushed to.
pub fn snapshot_reference(snapshots: &SnapshotsConfig, id: &str) -> String {
    format!("{}:{id}", snapshots.registry)
}

/// The image a pod of `image` runs: a snapshot's pushed image for `snapshot:<id>`, else `image`.
pub fn task_image(image: &str, config: &KubeConfig) -> Result<String, ProviderError> {
    match snapshot_of_image(image.trim()) {
        None => Ok(image.trim().to_string()),
        Some(id) => {
            let snapshots = config.snapshots.as_ref().ok_or_else(no_registry)?;
            let ok = !id.is_empty()
                && id.len() <= 128
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
            if !ok {
                return Err(ProviderError::Unsupported(format!("`{image}` does not name a snapshot")));
            }
            Ok(snapshot_reference(snapshots, id))
        }
    }
}

impl KubeProvider {
    /// `Provider::snapshot_dirs`: `dirs` as one layer over the image sandbox `id`'s pod runs,
    /// pushed to the configured registry.
    pub(crate) async fn push_snapshot(
        &self,
        id: &str,
        snapshot: &str,
        dirs: Vec<NamedDir>,
    ) -> Result<SnapshotMade, ProviderError> {
        let snapshots = self.config.snapshots.as_ref().ok_or_else(no_registry)?;
        let target = task_image(&format!("{}{snapshot}", sandman_wire::snapshots::IMAGE_PREFIX), &self.config)?;
        let pod = self
            .api
            .get_pod(&pod_name(id))
            .await
            .map_err(|e| {
                ProviderError::Backend(format!("cannot read the pod of sandbox `{id}`: {}", crate::chain(&e)))
            })?
            .ok_or_else(|| ProviderError::NotFound(id.to_string()))?;
        let base = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.iter().find(|c| c.name == TASK_CONTAINER))
            .and_then(|c| c.image.clone())
            .ok_or_else(|| ProviderError::Backend(format!("the pod of sandbox `{id}` has no task image")))?;
        let layer = tokio::task::spawn_blocking(move || {
            let archives: Vec<sandman_image::DirArchive<'_>> = dirs
                .iter()
                .map(|d| sandman_image::DirArchive { path: &d.path, mode: d.mode, uid: d.uid, gid: d.gid, tar: &d.tar })
                .collect();
            sandman_image::layer_of_dirs(&archives)
        })
        .await
        .map_err(|e| ProviderError::io("cannot write a snapshot's layer", std::io::Error::other(e)))?
        .map_err(|e| {
            ProviderError::Backend(format!("cannot make the layer of snapshot `{snapshot}`: {}", crate::chain(&e)))
        })?;
        let access = sandman_image::RegistryAccess {
            insecure_registries: if snapshots.insecure {
                vec![snapshots.registry.split('/').next().unwrap_or_default().to_string()]
            } else {
                Vec::new()
            },
            auth_file: snapshots.auth_file.clone(),
            stall: STALL,
        };
        let created_by = format!("sandman snapshot of {id}");
        let pushed = sandman_image::push_extended(&access, &base, &layer, &created_by, &target).await.map_err(|e| {
            ProviderError::Backend(format!(
                "cannot push snapshot `{snapshot}` of `{base}` to `{target}`: {}",
                crate::chain(&e)
            ))
        })?;
        tracing::info!(
            sandbox = id,
            snapshot,
            base = %base,
            image = %target,
            digest = %pushed.digest,
            bytes = layer.tar.len(),
            entries = layer.entries,
            copied_layers = pushed.copied_layers,
            "snapshot pushed"
        );
        Ok(SnapshotMade { size: Some(layer.tar.len() as u64), pushed: Some(format!("{target}@{}", pushed.digest)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_image_runs_its_pushed_reference_and_other_images_run_as_written() {
        let mut config = KubeConfig::default();
        assert_eq!(task_image(" python:3.12 ", &config).ok().as_deref(), Some("python:3.12"));
        assert!(matches!(task_image("snapshot:snap-1", &config), Err(ProviderError::Unsupported(_))));
        config.snapshots = Some(SnapshotsConfig {
            registry: "reg.example:5000/snaps".into(),
            insecure: false,
            auth_file: None,
            max_bytes: 1,
        });
        assert_eq!(task_image("snapshot:snap-1", &config).ok().as_deref(), Some("reg.example:5000/snaps:snap-1"));
        for bad in ["snapshot:", "snapshot:a/b", "snapshot:x:y"] {
            assert!(task_image(bad, &config).is_err(), "{bad}");
        }
    }
}

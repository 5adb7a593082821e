//! Snapshots on the docker provider: `docker commit` of the sandbox's container (paused while
//! the engine reads its changes) into the image `sandman-snapshot:<id>`, with the configuration
//! of the image the container was made from (never the container's own, which holds the
//! daemon's entry point). A create of `snapshot:<id>` runs that image; it is never pulled.
//! Start at [`DockerProvider::take_snapshot`].

use bollard::errors::Error as BollardError;
use bollard::models::ContainerConfig;
use bollard::query_parameters::{CommitContainerOptions, PushImageOptions, RemoveImageOptions, TagImageOptions};
use futures_util::StreamExt;
use sandman_provider::{ProviderError, SnapshotMade};
use sandman_wire::server::Reason;
use sandman_wire::snapshots::snapshot_of_image;

use crate::container::{OWNER_LABEL, container_name};
use crate::{DockerProvider, check_id, engine_error, engine_message};

/// The repository of snapshots' images on the engine; the tag is the snapshot's id.
pub const SNAPSHOT_REPO: &str = "sandman-snapshot";
/// The label that names a snapshot image's snapshot.
pub const SNAPSHOT_LABEL: &str = "sandman.dev/snapshot";

/// The engine's image of snapshot `id`.
pub fn image_of(id: &str) -> String {
    format!("{SNAPSHOT_REPO}:{id}")
}

/// The engine image a create's image stands for, when it names a snapshot.
pub fn engine_image(image: &str) -> Option<String> {
    snapshot_of_image(image).map(image_of)
}

fn check_snapshot_id(id: &str) -> Result<(), ProviderError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-');
    if ok { Ok(()) } else { Err(ProviderError::NotFound(format!("snapshot `{id}`"))) }
}

impl DockerProvider {
    /// `Provider::snapshot`: the container committed, paused meanwhile.
    pub(crate) async fn take_snapshot(&self, id: &str, snapshot: &str) -> Result<SnapshotMade, ProviderError> {
        check_snapshot_id(snapshot)?;
        check_id(id).map_err(|_| ProviderError::NotFound(id.to_string()))?;
        let name = container_name(id);
        let found = match self.docker.inspect_container(&name, None).await {
            Ok(c) => c,
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => {
                return Err(ProviderError::NotFound(id.to_string()));
            }
            Err(e) => return Err(engine_error(&format!("cannot inspect container `{name}`"), e)),
        };
        let labels = found.config.as_ref().and_then(|c| c.labels.as_ref());
        if labels.and_then(|l| l.get(OWNER_LABEL)) != Some(&self.owner) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let base =
            found.image.clone().ok_or_else(|| ProviderError::Backend(format!("container `{name}` names no image")))?;
        let base_image = self
            .docker
            .inspect_image(&base)
            .await
            .map_err(|e| engine_error(&format!("cannot inspect image `{base}`"), e))?;
        let c = base_image.config.clone().unwrap_or_default();
        let mut image_labels = c.labels.clone().unwrap_or_default();
        image_labels.insert(SNAPSHOT_LABEL.to_string(), snapshot.to_string());
        image_labels.insert(OWNER_LABEL.to_string(), self.owner.clone());
        let config = ContainerConfig {
            user: c.user.clone(),
            env: c.env.clone(),
            cmd: c.cmd.clone(),
            entrypoint: c.entrypoint.clone(),
            working_dir: c.working_dir.clone(),
            labels: Some(image_labels),
            stop_signal: c.stop_signal.clone(),
            ..Default::default()
        };
        let options = CommitContainerOptions {
            container: Some(name.clone()),
            repo: Some(SNAPSHOT_REPO.to_string()),
            tag: Some(snapshot.to_string()),
            comment: Some(format!("sandman snapshot of {id}")),
            pause: true,
            ..Default::default()
        };
        self.docker
            .commit_container(options, config)
            .await
            .map_err(|e| engine_error(&format!("cannot commit container `{name}`"), e))?;
        let made = self
            .docker
            .inspect_image(&image_of(snapshot))
            .await
            .map_err(|e| engine_error(&format!("cannot inspect the snapshot `{}`", image_of(snapshot)), e))?;
        let size = match (made.size, base_image.size) {
            (Some(all), Some(base)) => Some(all.saturating_sub(base).max(0) as u64),
            _ => None,
        };
        tracing::info!(sandbox = id, snapshot, ?size, "container committed as a snapshot");
        Ok(SnapshotMade { size, pushed: None })
    }

    /// A create's image: a snapshot's is on the engine or nowhere (never pulled).
    pub(crate) async fn check_snapshot_image(&self, image: &str) -> Result<(), ProviderError> {
        let Some(engine) = engine_image(image) else { return Ok(()) };
        match self.docker.inspect_image(&engine).await {
            Ok(_) => Ok(()),
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => Err(ProviderError::Failed {
                reason: Reason::ImagePullFailed,
                message: format!("`{image}`: no such snapshot on the engine"),
            }),
            Err(e) => Err(engine_error(&format!("cannot inspect image `{engine}`"), e)),
        }
    }

    /// `Provider::delete_snapshot`: the image's tag goes; the engine keeps its layers while
    /// containers run it.
    pub(crate) async fn remove_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        if check_snapshot_id(snapshot).is_err() {
            return Ok(());
        }
        let image = image_of(snapshot);
        let options = RemoveImageOptions { force: true, noprune: false, ..Default::default() };
        match self.docker.remove_image(&image, Some(options), None).await {
            Ok(_) => Ok(()),
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => Ok(()),
            // In use by a container: untagged all the same, its layers kept while it runs.
            Err(BollardError::DockerResponseServerError { status_code: 409, message }) => {
                tracing::info!(snapshot, %message, "a snapshot's image stays on the engine while containers run it");
                Ok(())
            }
            Err(e) => Err(engine_error(&format!("cannot remove image `{image}`"), e)),
        }
    }

    /// `Provider::export_snapshot`: tagged as `reference` and pushed by the engine.
    pub(crate) async fn push_snapshot(&self, snapshot: &str, reference: &str) -> Result<String, ProviderError> {
        check_snapshot_id(snapshot)?;
        let (repo, tag) = crate::image::split_tag(reference);
        let tag_options = TagImageOptions { repo: Some(repo.clone()), tag: Some(tag.clone()) };
        self.docker
            .tag_image(&image_of(snapshot), Some(tag_options))
            .await
            .map_err(|e| engine_error(&format!("cannot tag snapshot `{snapshot}` as `{reference}`"), e))?;
        let mut stream =
            self.docker.push_image(&repo, Some(PushImageOptions { tag: Some(tag), ..Default::default() }), None);
        let mut digest = None;
        while let Some(item) = stream.next().await {
            let info =
                item.map_err(|e| ProviderError::Backend(format!("cannot push `{reference}`: {}", engine_message(&e))))?;
            if let Some(detail) = info.error_detail.as_ref().and_then(|d| d.message.clone()) {
                return Err(ProviderError::Backend(format!("cannot push `{reference}`: {detail}")));
            }
            if let Some(status) = info.status.as_deref()
                && let Some(at) = status.find("digest: ")
            {
                digest = status[at + 8..].split_whitespace().next().map(str::to_string);
            }
        }
        let _ = self.docker.remove_image(reference, None::<RemoveImageOptions>, None).await;
        digest.ok_or_else(|| ProviderError::Backend(format!("pushed `{reference}`, but the engine told no digest")))
    }
}

//! The image store's calls (`GET /v1/images`, `DELETE /v1/images?image=`,
//! `POST /v1/images/prune`): the process provider's store, which only it has. Pulling ahead is
//! `POST /v1/prepare` ([`super::prepare`]).

use sandman_provider::ProviderError;
use sandman_wire::server::{ImageList, ImagesRemoved};

use super::Service;
use crate::error::{ServerError, ServerResult};
use crate::provider::AnyProvider;

impl Service {
    pub async fn images(&self) -> ServerResult<ImageList> {
        self.image_store()?.images().await.map_err(store_error)
    }

    pub async fn remove_image(&self, what: &str) -> ServerResult<ImagesRemoved> {
        if what.trim().is_empty() {
            return Err(ServerError::InvalidArgument("`image` is required: a reference or an image id".into()));
        }
        self.image_store()?.remove_image(what).await.map_err(store_error)
    }

    pub async fn prune_images(&self) -> ServerResult<ImagesRemoved> {
        self.image_store()?.prune_images().await.map_err(store_error)
    }

    fn image_store(&self) -> ServerResult<&sandman_provider_process::ProcessProvider> {
        match &self.provider {
            AnyProvider::Process(p) => Ok(p),
            other => Err(ServerError::InvalidArgument(format!(
                "the {} provider keeps no image store of the server's: its images are the {}'s",
                sandman_provider::Provider::name(other),
                if matches!(other, AnyProvider::Docker(_)) { "engine" } else { "nodes'" }
            ))),
        }
    }
}

/// An image some sandbox runs is a conflict, not the server's failure.
fn store_error(e: ProviderError) -> ServerError {
    match e {
        ProviderError::Claimed(message) => ServerError::Conflict(message),
        other => ServerError::Provider(other),
    }
}

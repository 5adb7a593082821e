//! The local Docker engine as a source of images: found on its Unix socket (`DOCKER_HOST`
//! `unix://…`, else `/var/run/docker.sock`) and skipped quickly and silently when none answers;
//! an image is looked up by name and exported (`docker save`'s archive) to a file of the store's
//! `tmp/`, which the archive reader then imports.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as BollardError;
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::ImageError;

/// How long a socket may take to answer before the engine counts as absent: a running engine
/// answers a version negotiation in milliseconds.
const ANSWER_WITHIN: Duration = Duration::from_secs(3);
const DEFAULT_SOCKET: &str = "/var/run/docker.sock";

/// A local engine that answered.
#[derive(Clone)]
pub(crate) struct Engine {
    docker: Docker,
    socket: PathBuf,
}

/// The socket the local engine would answer on: `explicit`, else `DOCKER_HOST` when it is
/// `unix://…` (none when it names another kind of host), else the default.
pub(crate) fn socket(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return Some(path.to_path_buf());
    }
    match std::env::var("DOCKER_HOST") {
        Ok(host) if !host.is_empty() => host.strip_prefix("unix://").map(PathBuf::from),
        _ => Some(PathBuf::from(DEFAULT_SOCKET)),
    }
}

impl Engine {
    /// The engine on `socket`, when one answers there.
    pub(crate) async fn find(socket: Option<&Path>) -> Option<Engine> {
        let socket = socket?;
        if !socket.exists() {
            return None;
        }
        let docker = Docker::connect_with_unix(&socket.to_string_lossy(), 600, bollard::API_DEFAULT_VERSION).ok()?;
        match tokio::time::timeout(ANSWER_WITHIN, docker.negotiate_version()).await {
            Ok(Ok(docker)) => Some(Engine { docker, socket: socket.to_path_buf() }),
            Ok(Err(e)) => {
                tracing::debug!(socket = %socket.display(), error = %e, "no Docker engine answers");
                None
            }
            Err(_) => {
                tracing::debug!(socket = %socket.display(), "the Docker engine did not answer in time");
                None
            }
        }
    }

    /// The engine's error, saying what it was doing.
    fn error(step: &str, e: BollardError) -> ImageError {
        let said = match &e {
            BollardError::DockerResponseServerError { status_code, message } => format!("{status_code}: {message}"),
            other => other.to_string(),
        };
        ImageError::Engine { step: step.to_string(), said, source: Some(Arc::new(e)) }
    }

    /// The id (config digest) of the engine's image `name`, or `None` when it has none.
    pub(crate) async fn image_id(&self, name: &str) -> Result<Option<String>, ImageError> {
        match self.docker.inspect_image(name).await {
            Ok(found) => Ok(found.id),
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => Ok(None),
            Err(e) => Err(Engine::error(&format!("looking up the image `{name}`"), e)),
        }
    }

    /// Exports the image `id` into `file`; fails when the export sends nothing for `stall`.
    pub(crate) async fn export(&self, id: &str, file: &Path, stall: Duration) -> Result<(), ImageError> {
        let what = || format!("cannot write the export of {id} to {}", file.display());
        let mut out = tokio::fs::File::create(file).await.map_err(|e| ImageError::io(what(), e))?;
        let mut stream = self.docker.export_image(id);
        loop {
            match tokio::time::timeout(stall, stream.next()).await {
                Err(_) => {
                    return Err(ImageError::Stalled {
                        what: format!("the export of {id} from the Docker engine on {}", self.socket.display()),
                        after: stall,
                    });
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(Engine::error(&format!("exporting {id}"), e)),
                Ok(Some(Ok(chunk))) => out.write_all(&chunk).await.map_err(|e| ImageError::io(what(), e))?,
            }
        }
        out.flush().await.map_err(|e| ImageError::io(what(), e))
    }

    pub(crate) fn socket(&self) -> &Path {
        &self.socket
    }
}

//! Images: a local image is used as it is; a missing one is pulled, with its progress logged (and,
//! for a create, reported to whoever waits for the sandbox), and a pull that fails (or stalls) is
//! `image_pull_failed` with the engine's message. Either way the reference is resolved to the
//! image's ID, which the container is made from.

use std::collections::HashMap;
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as BollardError;
use bollard::models::{CreateImageInfo, ImageConfig, ImageInspect};
use bollard::query_parameters::CreateImageOptions;
use futures_util::StreamExt;
use sandman_provider::{Progress as ProgressLine, ProviderError, report_progress};
use sandman_wire::server::Reason;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often a pull's progress is logged at most.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// How often a create's pull reports progress to the server at most.
const REPORT_EVERY: Duration = Duration::from_millis(500);

/// Where a create's pull reports its progress: the sandbox it is for, and the provider's
/// progress channel.
#[derive(Debug, Clone, Copy)]
pub struct Reporter<'a> {
    pub id: &'a str,
    pub tx: &'a mpsc::Sender<ProgressLine>,
}

/// An image as a reference named it at one moment: what a container made from `id` runs, however
/// the reference is re-pointed later.
#[derive(Debug, Clone)]
pub struct Pinned {
    /// The image's ID, `sha256:…` (the digest of its configuration).
    pub id: String,
    pub config: ImageConfig,
}

impl Pinned {
    fn of(image: &str, found: ImageInspect) -> Result<Pinned, ProviderError> {
        let id = found.id.filter(|id| !id.is_empty()).ok_or_else(|| {
            ProviderError::Backend(format!("the engine's inspect of image `{image}` gives no image ID"))
        })?;
        Ok(Pinned { id, config: found.config.unwrap_or_default() })
    }
}

/// What the sandbox's info shows of an image's configuration; empty strings and lists are "not
/// set". An entry point that is the daemon's (a snapshot of an image that named neither an entry
/// point nor a command: `docker commit` fills them from the container) is not the image's: none.
pub fn config_of(c: &ImageConfig) -> sandman_wire::server::ImageConfig {
    let text = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
    let daemons = c
        .entrypoint
        .as_ref()
        .is_some_and(|e| e.first().map(String::as_str) == Some(crate::container::DAEMON_IN_CONTAINER));
    let list = |l: &Option<Vec<String>>| l.clone().filter(|l| !l.is_empty() && !daemons);
    sandman_wire::server::ImageConfig {
        user: text(&c.user),
        workdir: text(&c.working_dir),
        env: c
            .env
            .iter()
            .flatten()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect(),
        entrypoint: list(&c.entrypoint),
        cmd: list(&c.cmd),
    }
}

/// The image `image` names now, pulling it first when it is not on this engine.
pub async fn ensure(
    docker: &Docker,
    image: &str,
    stall: Duration,
    reporter: Option<Reporter<'_>>,
) -> Result<Pinned, ProviderError> {
    match docker.inspect_image(image).await {
        Ok(found) => return Pinned::of(image, found),
        Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => {}
        Err(e) => return Err(crate::engine_error(&format!("cannot inspect image `{image}`"), e)),
    }
    pull(docker, image, stall, reporter).await?;
    match docker.inspect_image(image).await {
        Ok(found) => Pinned::of(image, found),
        Err(e) => {
            Err(failed(image, &format!("pulled, but the engine does not find it: {}", crate::engine_message(&e))))
        }
    }
}

/// Pulls `image`, logging progress (and reporting it, for a create); fails when the engine fails or
/// sends nothing for `stall`.
async fn pull(
    docker: &Docker,
    image: &str,
    stall: Duration,
    reporter: Option<Reporter<'_>>,
) -> Result<(), ProviderError> {
    let (from_image, tag) = split_tag(image);
    tracing::info!(image, "image not on this engine; pulling it");
    let options = CreateImageOptions { from_image: Some(from_image), tag: Some(tag), ..Default::default() };
    let mut stream = docker.create_image(Some(options), None, None);
    let started = Instant::now();
    let mut progress = Progress::default();
    loop {
        let item = match tokio::time::timeout(stall, stream.next()).await {
            Err(_) => {
                return Err(failed(image, &format!("the pull made no progress for {} s", stall.as_secs())));
            }
            Ok(None) => break,
            Ok(Some(item)) => item,
        };
        let info = item.map_err(|e| failed(image, &crate::engine_message(&e)))?;
        if let Some(detail) = info.error_detail.as_ref().and_then(|d| d.message.clone()) {
            return Err(failed(image, &detail));
        }
        progress.update(&info);
        if progress.last_logged.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
            progress.last_logged = Some(Instant::now());
            tracing::info!(image, layers = progress.layers.len(), done = progress.done(), status = %progress.latest, "pulling");
        }
        if let Some(r) = reporter
            && let Some(line) = progress.report(image)
        {
            report_progress(r.tx, r.id, line);
        }
    }
    tracing::info!(image, seconds = started.elapsed().as_secs_f64(), layers = progress.layers.len(), "pulled");
    Ok(())
}

/// What the pull has said so far: each layer's last status and bytes.
#[derive(Debug, Default)]
struct Progress {
    layers: HashMap<String, String>,
    /// Each layer's bytes downloaded and its size, as last told.
    bytes: HashMap<String, (u64, u64)>,
    latest: String,
    last_logged: Option<Instant>,
    last_reported: Option<Instant>,
}

impl Progress {
    fn update(&mut self, info: &CreateImageInfo) {
        let status = info.status.clone().unwrap_or_default();
        let bytes = info.progress_detail.as_ref().and_then(|d| Some((d.current?, d.total?)));
        let line = match (&info.id, bytes) {
            (Some(id), Some((current, total))) => format!("{id}: {status} {}/{} MiB", current >> 20, total >> 20),
            (Some(id), None) => format!("{id}: {status}"),
            (None, _) => status.clone(),
        };
        if let Some(id) = &info.id {
            if let Some((current, total)) = bytes
                && status.starts_with("Downloading")
            {
                self.bytes.insert(id.clone(), (current.max(0) as u64, total.max(0) as u64));
            } else if (status.starts_with("Download complete") || status.starts_with("Pull complete"))
                && let Some((current, total)) = self.bytes.get_mut(id)
            {
                *current = *total;
            }
            self.layers.insert(id.clone(), status);
        }
        self.latest = line;
    }

    /// `pulling IMAGE: 2/5 layers, 12/48 MiB`, at most every [`REPORT_EVERY`] (the first at once).
    fn report(&mut self, image: &str) -> Option<String> {
        if self.last_reported.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
            return None;
        }
        self.last_reported = Some(Instant::now());
        Some(self.summary(image))
    }

    fn summary(&self, image: &str) -> String {
        let mut line = format!("pulling {image}: {}/{} layers", self.done(), self.layers.len());
        let (current, total) = self.bytes.values().fold((0, 0), |(c, t), (bc, bt)| (c + bc, t + bt));
        if total > 0 {
            line.push_str(&format!(", {}/{} MiB", current >> 20, total >> 20));
        }
        line
    }

    fn done(&self) -> usize {
        self.layers.values().filter(|s| s.starts_with("Pull complete") || s.starts_with("Already exists")).count()
    }
}

fn failed(image: &str, message: &str) -> ProviderError {
    ProviderError::Failed {
        reason: Reason::ImagePullFailed,
        message: format!("cannot pull image `{image}`: {message}"),
    }
}

/// `name[:tag][@digest]` → (`name`, tag or digest). A reference without either is `latest`: the
/// engine would otherwise pull every tag of the repository.
pub fn split_tag(image: &str) -> (String, String) {
    if let Some((name, digest)) = image.split_once('@') {
        return (name.to_string(), digest.to_string());
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, tag)) => {
            let name = &image[..image.len() - tag.len() - 1];
            (name.to_string(), tag.to_string())
        }
        None => (image.to_string(), "latest".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_images_config_is_shown_with_unset_fields_left_out() {
        let c = ImageConfig {
            user: Some("agent:agent".into()),
            working_dir: Some(String::new()),
            env: Some(vec!["PATH=/usr/bin".into(), "EMPTY=".into(), "A=b=c".into()]),
            entrypoint: Some(vec![]),
            cmd: Some(vec!["python3".into(), "-m".into(), "app".into()]),
            ..Default::default()
        };
        let w = config_of(&c);
        assert_eq!(w.user.as_deref(), Some("agent:agent"));
        assert_eq!((w.workdir, w.entrypoint), (None, None));
        assert_eq!(w.env.get("A").map(String::as_str), Some("b=c"));
        assert_eq!(w.env.get("EMPTY").map(String::as_str), Some(""));
        assert_eq!(w.cmd, Some(vec!["python3".to_string(), "-m".into(), "app".into()]));
    }

    #[test]
    fn a_reference_without_a_tag_means_latest_and_registry_ports_are_not_tags() {
        let s = |i: &str| {
            let (n, t) = split_tag(i);
            format!("{n} {t}")
        };
        assert_eq!(s("busybox"), "busybox latest");
        assert_eq!(s("python:3.12"), "python 3.12");
        assert_eq!(s("localhost:5000/team/img"), "localhost:5000/team/img latest");
        assert_eq!(s("localhost:5000/team/img:v1"), "localhost:5000/team/img v1");
        assert_eq!(s("img@sha256:abc"), "img sha256:abc");
    }

    fn info(id: &str, status: &str, bytes: Option<(i64, i64)>) -> CreateImageInfo {
        CreateImageInfo {
            id: Some(id.into()),
            status: Some(status.into()),
            progress_detail: bytes
                .map(|(current, total)| bollard::models::ProgressDetail { current: Some(current), total: Some(total) }),
            ..Default::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pulls_report_sums_layers_and_bytes_at_most_every_half_second() {
        let mut p = Progress::default();
        p.update(&info("a", "Pulling fs layer", None));
        p.update(&info("b", "Already exists", None));
        assert_eq!(p.report("img:1").as_deref(), Some("pulling img:1: 1/2 layers"));
        p.update(&info("a", "Downloading", Some((3 << 20, 8 << 20))));
        assert_eq!(p.report("img:1"), None, "reported again within 500 ms");
        tokio::time::advance(Duration::from_millis(499)).await;
        assert_eq!(p.report("img:1"), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(p.report("img:1").as_deref(), Some("pulling img:1: 1/2 layers, 3/8 MiB"));
        p.update(&info("a", "Download complete", None));
        p.update(&info("a", "Pull complete", None));
        tokio::time::advance(REPORT_EVERY).await;
        assert_eq!(p.report("img:1").as_deref(), Some("pulling img:1: 2/2 layers, 8/8 MiB"));
    }
}

//! Preparing images ahead of the creates that need them (`POST /v1/prepare`), and holding a
//! job's creates of an image until enough nodes have it (the gates are [`crate::prepare`]'s).

use std::collections::BTreeSet;

use futures_util::StreamExt;
use sandman_provider::{NodeProgress, NodeState, Provider, SandboxSpec};
use sandman_wire::server::{PoolSpec, PreparePhase, PrepareRequest, PrepareResult, PreparedImage};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Service;
use crate::error::{ServerError, ServerResult};

/// Images prepared at once by one `POST /v1/prepare`.
const PREPARE_CONCURRENCY: usize = 4;
/// Most images one `POST /v1/prepare` takes.
const MAX_PREPARE_IMAGES: usize = 256;

impl Service {
    /// Makes images ready ahead of the creates that need them, a few at once, reporting each
    /// image's progress (and each node's) as events; answers once every image is ready or has
    /// failed. With `hold_until`, the job's creates of each image wait until that fraction of
    /// the nodes has it.
    pub async fn prepare(&self, req: PrepareRequest) -> ServerResult<PrepareResult> {
        if req.images.is_empty() || req.images.len() > MAX_PREPARE_IMAGES {
            return Err(ServerError::InvalidArgument(format!(
                "`images` must name between 1 and {MAX_PREPARE_IMAGES} images"
            )));
        }
        if let Some(img) = req.images.iter().find(|i| i.trim().is_empty()) {
            return Err(ServerError::InvalidArgument(format!("invalid image name `{img}`")));
        }
        let hold = match (req.hold_until, req.job.as_deref()) {
            (None, _) => None,
            (Some(f), Some(job)) if f > 0.0 && f <= 1.0 => Some((job, f)),
            (Some(f), Some(_)) => {
                return Err(ServerError::InvalidArgument(format!(
                    "`hold_until` is a fraction of nodes above 0 and at most 1, not {f}"
                )));
            }
            (Some(_), None) => {
                return Err(ServerError::InvalidArgument(
                    "`hold_until` holds a job's creates: name the job in `job`".into(),
                ));
            }
        };
        let job = req.job.as_deref();
        let one = |image: String| async move {
            let gate = hold.map(|(job, _)| self.gates.close(job, &image));
            let started = Instant::now();
            self.events.emit_prepare(&image, job, PreparePhase::Started, None);
            // Checked as a create of the image would be: a provider refuses images it cannot run.
            let mut probe: SandboxSpec = self.pool_member_spec("prepare", &PoolSpec::default());
            probe.image = image.clone();
            let (tx, mut rx) = mpsc::unbounded_channel::<NodeProgress>();
            let work = async {
                self.provider.check(&probe)?;
                self.provider.prepare(&image, tx).await
            };
            let report = async {
                let mut ready = BTreeSet::new();
                while let Some(line) = rx.recv().await {
                    if line.state == NodeState::Ready {
                        ready.insert(line.node.clone());
                    }
                    let n = ready.len() as u32;
                    self.events.emit_node(&image, job, &line.node, line.message, n, line.nodes_total);
                    if let (Some(gate), Some((_, f))) = (&gate, hold)
                        && line.nodes_total > 0
                        && f64::from(n) >= f * f64::from(line.nodes_total)
                    {
                        gate.open();
                    }
                }
            };
            let (result, ()) = tokio::join!(work, report);
            drop(gate);
            let (message, nodes_ready, nodes_total) = match result {
                Ok(p) => (None, p.nodes_ready, p.nodes_total),
                Err(e) => (Some(e.to_string()), 0, 0),
            };
            let phase = if message.is_some() { PreparePhase::Failed } else { PreparePhase::Ready };
            self.events.emit_prepare(&image, job, phase, message.clone());
            PreparedImage {
                image,
                ok: message.is_none(),
                message,
                nodes_ready,
                nodes_total,
                duration_ms: started.elapsed().as_millis() as u64,
            }
        };
        let images: Vec<PreparedImage> =
            futures_util::stream::iter(req.images.clone()).map(one).buffered(PREPARE_CONCURRENCY).collect().await;
        Ok(PrepareResult { images })
    }
}

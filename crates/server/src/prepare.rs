//! Preparing images ahead of the creates that need them (`POST /v1/prepare`), and holding a
//! job's creates of an image until enough nodes have it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::StreamExt;
use sandman_provider::{NodeProgress, NodeState, Provider, SandboxSpec};
use sandman_wire::server::{PoolSpec, PreparePhase, PrepareRequest, PrepareResult, PreparedImage};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::error::{ServerError, ServerResult};
use crate::service::Service;

/// Images prepared at once by one `POST /v1/prepare`.
const PREPARE_CONCURRENCY: usize = 4;
/// Most images one `POST /v1/prepare` takes.
const MAX_PREPARE_IMAGES: usize = 256;

/// Closed gates holding a job's creates of an image, by (job, image). A gate opens (its sender
/// sends `true` and is dropped) when enough nodes have the image or its preparation ends, the
/// latter however it ends: the request dropped included.
#[derive(Debug, Default)]
pub struct Gates {
    held: Mutex<Held>,
}

/// Gate senders by (job, image).
type Held = HashMap<(String, String), Arc<watch::Sender<bool>>>;

impl Gates {
    /// Closes the gate of (job, image) until the returned guard opens it or is dropped.
    fn close(&self, job: &str, image: &str) -> Gate<'_> {
        let key = (job.to_string(), image.to_string());
        let tx = self.lock().entry(key.clone()).or_insert_with(|| Arc::new(watch::channel(false).0)).clone();
        Gate { gates: self, key, tx }
    }

    /// The gate a create of `image` for `job` must pass, when one is closed.
    pub fn waiter(&self, job: Option<&str>, image: &str) -> Option<watch::Receiver<bool>> {
        let key = (job?.to_string(), image.to_string());
        self.lock().get(&key).map(|tx| tx.subscribe())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Gate<'a> {
    gates: &'a Gates,
    key: (String, String),
    tx: Arc<watch::Sender<bool>>,
}

impl Gate<'_> {
    fn open(&self) {
        let mut held = self.gates.lock();
        if held.get(&self.key).is_some_and(|tx| Arc::ptr_eq(tx, &self.tx)) {
            held.remove(&self.key);
        }
        self.tx.send_replace(true);
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        self.open();
    }
}

/// How a create may wait at a gate: until it opens or its sender is gone.
pub async fn pass(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|open| *open).await;
}

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

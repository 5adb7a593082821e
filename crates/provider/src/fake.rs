//! `FakeProvider`: an in-memory provider whose sandboxes are records only, with switches to make
//! creates fail and sandboxes die; the server's and the conformance suite's tests run on it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use sandman_wire::server::{Applied, Reason};
use tokio::sync::mpsc;

use crate::{
    Claim, EVENT_CAPACITY, Ended, Endpoint, NodeProgress, NodeState, PROGRESS_CAPACITY, Prepared, Progress, Provider,
    ProviderError, ProviderEvent, Record, SandboxSpec, report_progress,
};

/// An image the fake refuses at once, as a provider refuses what it cannot run.
pub const UNSUPPORTED_IMAGE: &str = "unsupported";

#[derive(Debug)]
pub struct FakeProvider {
    /// The records, by sandbox id.
    records: Mutex<BTreeMap<String, Record>>,
    /// Images whose create fails with `image_pull_failed`.
    missing_images: Mutex<Vec<String>>,
    events_tx: mpsc::Sender<ProviderEvent>,
    /// Handed to the server once.
    events_rx: Mutex<Option<mpsc::Receiver<ProviderEvent>>>,
    /// Progress lines a create of an image reports, by image (as a pull would).
    pulls: Mutex<BTreeMap<String, Vec<String>>>,
    progress_tx: mpsc::Sender<Progress>,
    /// Handed to the server once.
    progress_rx: Mutex<Option<mpsc::Receiver<Progress>>>,
    /// The endpoint of each sandbox (the tests point it at a daemon when they need one).
    endpoint: Endpoints,
    /// What every sandbox reports as applied (see [`FakeProvider::set_applied`]).
    applied: Mutex<Applied>,
    /// Nodes a prepare pulls on, and how long each takes after the one before.
    nodes: Mutex<(u32, std::time::Duration)>,
    /// How many of the next claims another server wins, and the sandboxes so lost.
    elsewhere: Mutex<(usize, Vec<String>)>,
    /// How long a create takes.
    create_delay: Mutex<std::time::Duration>,
    /// What [`Provider::proves_daemon`] answers (see [`FakeProvider::set_proves_daemon`]).
    proves_daemon: AtomicBool,
    /// The snapshots taken, each with the image of the sandbox it was taken of.
    snapshots: Mutex<BTreeMap<String, String>>,
    /// Whether snapshots record named directories only, and then their bound in bytes (as the
    /// kubernetes provider's do), with the directories each such snapshot got.
    named: Mutex<Named>,
}

/// The bound of named-directory snapshots when they are on, and the directories each got.
type Named = (Option<u64>, BTreeMap<String, Vec<crate::NamedDir>>);

/// Where the fake's sandboxes answer.
enum Endpoints {
    /// Every sandbox at the same one.
    Same(Endpoint),
    /// Each at what the function makes of its spec (a stand-in daemon that knows its token).
    Each(Box<dyn Fn(&SandboxSpec) -> Endpoint + Send + Sync>),
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoints::Same(e) => f.debug_tuple("Same").field(e).finish(),
            Endpoints::Each(_) => f.write_str("Each(..)"),
        }
    }
}

impl FakeProvider {
    /// Every sandbox answers at `endpoint`.
    pub fn new(endpoint: Endpoint) -> Self {
        Self::with_endpoints(Endpoints::Same(endpoint))
    }

    /// Each sandbox answers at what `endpoint_of` makes of its spec, called once per create: a
    /// test starts a stand-in daemon there that holds the sandbox's token, as a real one would.
    pub fn each_at(endpoint_of: impl Fn(&SandboxSpec) -> Endpoint + Send + Sync + 'static) -> Self {
        Self::with_endpoints(Endpoints::Each(Box::new(endpoint_of)))
    }

    fn with_endpoints(endpoint: Endpoints) -> Self {
        let (events_tx, events_rx) = mpsc::channel(EVENT_CAPACITY);
        let (progress_tx, progress_rx) = mpsc::channel(PROGRESS_CAPACITY);
        FakeProvider {
            records: Mutex::default(),
            missing_images: Mutex::default(),
            events_tx,
            events_rx: Mutex::new(Some(events_rx)),
            pulls: Mutex::default(),
            progress_tx,
            progress_rx: Mutex::new(Some(progress_rx)),
            endpoint,
            applied: Mutex::default(),
            nodes: Mutex::new((1, std::time::Duration::ZERO)),
            elsewhere: Mutex::default(),
            create_delay: Mutex::default(),
            proves_daemon: AtomicBool::new(false),
            snapshots: Mutex::default(),
            named: Mutex::default(),
        }
    }

    /// Keeps `record` as if an earlier server had made it: what a restarted server's `list`
    /// finds.
    pub fn restore(&self, record: Record) {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).insert(record.spec.id.clone(), record);
    }

    /// Makes the fake say that its creates prove the daemon ([`Provider::proves_daemon`]), as
    /// the Kubernetes provider's do. The fake itself asks the daemon nothing: a test sees that
    /// the server does not ask either.
    pub fn set_proves_daemon(&self, proves: bool) {
        self.proves_daemon.store(proves, Ordering::Relaxed);
    }

    /// Makes creates of `image` fail as a failed pull would.
    pub fn fail_image(&self, image: &str) {
        self.missing_images.lock().unwrap_or_else(PoisonError::into_inner).push(image.to_string());
    }

    /// Makes a prepare pull on `nodes` nodes, one after the other, each taking `step`.
    pub fn set_nodes(&self, nodes: u32, step: std::time::Duration) {
        *self.nodes.lock().unwrap_or_else(PoisonError::into_inner) = (nodes, step);
    }

    /// Makes every create take `delay`, as a real one takes a while.
    pub fn set_create_delay(&self, delay: std::time::Duration) {
        *self.create_delay.lock().unwrap_or_else(PoisonError::into_inner) = delay;
    }

    /// Makes another server win the next `n` claims, as when servers share the records.
    pub fn claim_elsewhere(&self, n: usize) {
        self.elsewhere.lock().unwrap_or_else(PoisonError::into_inner).0 = n;
    }

    /// The sandboxes whose claim another server won.
    pub fn claimed_elsewhere(&self) -> Vec<String> {
        self.elsewhere.lock().unwrap_or_else(PoisonError::into_inner).1.clone()
    }

    /// Makes every sandbox report `applied` as what the provider applied to it.
    pub fn set_applied(&self, applied: Applied) {
        *self.applied.lock().unwrap_or_else(PoisonError::into_inner) = applied;
    }

    /// Makes creates of `image` report `lines` as progress, as a pull would.
    pub fn pull_progress(&self, image: &str, lines: &[&str]) {
        let lines = lines.iter().map(|l| l.to_string()).collect();
        self.pulls.lock().unwrap_or_else(PoisonError::into_inner).insert(image.to_string(), lines);
    }

    /// Ends a sandbox as if its backend had killed it, and reports it.
    pub async fn kill(&self, id: &str, reason: Reason, message: &str) {
        let ended = Ended { reason, message: message.to_string() };
        if let Some(r) = self.records.lock().unwrap_or_else(PoisonError::into_inner).get_mut(id) {
            r.ended = Some(ended.clone());
        }
        let _ = self.events_tx.send(ProviderEvent { id: id.to_string(), ended }).await;
    }

    pub fn count(&self) -> usize {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// The snapshots the fake holds.
    pub fn snapshots(&self) -> Vec<String> {
        self.snapshots.lock().unwrap_or_else(PoisonError::into_inner).keys().cloned().collect()
    }

    /// Makes snapshots record named directories only, of at most `max_bytes` together, as the
    /// kubernetes provider's do.
    pub fn set_named_snapshots(&self, max_bytes: u64) {
        self.named.lock().unwrap_or_else(PoisonError::into_inner).0 = Some(max_bytes);
    }

    /// The directories snapshot `snapshot` got, when it recorded named ones.
    pub fn snapshot_dirs_of(&self, snapshot: &str) -> Vec<crate::NamedDir> {
        self.named.lock().unwrap_or_else(PoisonError::into_inner).1.get(snapshot).cloned().unwrap_or_default()
    }
}

impl Provider for FakeProvider {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        if spec.image == UNSUPPORTED_IMAGE {
            return Err(ProviderError::Unsupported(format!(
                "image `{UNSUPPORTED_IMAGE}` is never supported by the fake"
            )));
        }
        Ok(())
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Endpoint, ProviderError> {
        if self.missing_images.lock().unwrap_or_else(PoisonError::into_inner).contains(&spec.image) {
            return Err(ProviderError::Failed {
                reason: Reason::ImagePullFailed,
                message: format!("pull access denied for {}", spec.image),
            });
        }
        if let Some(snapshot) = sandman_wire::snapshots::snapshot_of_image(&spec.image)
            && !self.snapshots.lock().unwrap_or_else(PoisonError::into_inner).contains_key(snapshot)
        {
            return Err(ProviderError::Failed {
                reason: Reason::ImagePullFailed,
                message: format!("the fake holds no snapshot `{snapshot}`"),
            });
        }
        let delay = *self.create_delay.lock().unwrap_or_else(PoisonError::into_inner);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let lines = self.pulls.lock().unwrap_or_else(PoisonError::into_inner).get(&spec.image).cloned();
        for line in lines.unwrap_or_default() {
            report_progress(&self.progress_tx, &spec.id, line);
            // As a pull takes a while: whoever reads the progress sees it while this still creates.
            tokio::task::yield_now().await;
        }
        let endpoint = match &self.endpoint {
            Endpoints::Same(endpoint) => endpoint.clone(),
            Endpoints::Each(endpoint_of) => endpoint_of(spec),
        };
        let record = Record {
            spec: spec.clone(),
            endpoint: endpoint.clone(),
            ended: None,
            claim: None,
            paused: false,
            ready: None,
        };
        self.records.lock().unwrap_or_else(PoisonError::into_inner).insert(spec.id.clone(), record);
        Ok(endpoint)
    }

    fn proves_daemon(&self) -> bool {
        self.proves_daemon.load(Ordering::Relaxed)
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Record>, ProviderError> {
        Ok(self.records.lock().unwrap_or_else(PoisonError::into_inner).values().cloned().collect())
    }

    fn events(&self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    fn progress(&self) -> Option<mpsc::Receiver<Progress>> {
        self.progress_rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    async fn prepare(
        &self,
        image: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> Result<Prepared, ProviderError> {
        if self.missing_images.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|m| m == image) {
            return Err(ProviderError::Failed {
                reason: Reason::ImagePullFailed,
                message: format!("pull access denied for {image}"),
            });
        }
        let (nodes, step) = *self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        for n in 0..nodes {
            let node = format!("node-{n}");
            let line = |state, message| NodeProgress { node: node.clone(), state, message, nodes_total: nodes };
            let _ = progress.send(line(NodeState::Pulling, format!("pulling {image}")));
            tokio::time::sleep(step).await;
            let _ = progress.send(line(NodeState::Ready, format!("{image} is ready")));
        }
        Ok(Prepared { nodes_ready: nodes, nodes_total: nodes })
    }

    async fn applied(&self, id: &str) -> Result<Applied, ProviderError> {
        if !self.records.lock().unwrap_or_else(PoisonError::into_inner).contains_key(id) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        Ok(self.applied.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    async fn claim(&self, claim: &Claim) -> Result<(), ProviderError> {
        let id = &claim.spec.id;
        {
            let mut elsewhere = self.elsewhere.lock().unwrap_or_else(PoisonError::into_inner);
            if elsewhere.0 > 0 {
                elsewhere.0 -= 1;
                elsewhere.1.push(id.clone());
                return Err(ProviderError::Claimed(format!("another server claimed `{id}` first")));
            }
        }
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let record = records.get_mut(id).ok_or_else(|| ProviderError::NotFound(id.clone()))?;
        if record.claim.is_some() {
            return Err(ProviderError::Claimed(format!("`{id}` is claimed already")));
        }
        record.claim = Some(claim.clone());
        Ok(())
    }

    /// Kept on the record, as a provider shared by several servers keeps it.
    async fn mark_ready(&self, id: &str, line: &str) -> Result<(), ProviderError> {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let record = records.get_mut(id).ok_or_else(|| ProviderError::NotFound(id.to_string()))?;
        record.ready = Some(line.to_string());
        Ok(())
    }

    async fn snapshot(&self, id: &str, snapshot: &str) -> Result<crate::SnapshotMade, ProviderError> {
        let image = match self.records.lock().unwrap_or_else(PoisonError::into_inner).get(id) {
            Some(r) => r.spec.image.clone(),
            None => return Err(ProviderError::NotFound(id.to_string())),
        };
        self.snapshots.lock().unwrap_or_else(PoisonError::into_inner).insert(snapshot.to_string(), image);
        Ok(crate::SnapshotMade { size: Some(0), pushed: None })
    }

    fn snapshot_scope(&self) -> crate::SnapshotScope {
        match self.named.lock().unwrap_or_else(PoisonError::into_inner).0 {
            Some(max_bytes) => crate::SnapshotScope::Named { why: "the fake is told to", max_bytes },
            None => crate::SnapshotScope::Whole,
        }
    }

    async fn snapshot_dirs(
        &self,
        id: &str,
        snapshot: &str,
        dirs: Vec<crate::NamedDir>,
    ) -> Result<crate::SnapshotMade, ProviderError> {
        self.snapshot(id, snapshot).await?;
        let size = dirs.iter().map(|d| d.tar.len() as u64).sum();
        self.named.lock().unwrap_or_else(PoisonError::into_inner).1.insert(snapshot.to_string(), dirs);
        Ok(crate::SnapshotMade { size: Some(size), pushed: Some(format!("fake.registry/snapshots:{snapshot}")) })
    }

    async fn delete_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        self.named.lock().unwrap_or_else(PoisonError::into_inner).1.remove(snapshot);
        self.snapshots.lock().unwrap_or_else(PoisonError::into_inner).remove(snapshot);
        Ok(())
    }

    async fn pause(&self, id: &str) -> Result<(), ProviderError> {
        self.set_paused(id, true)
    }

    async fn resume(&self, id: &str) -> Result<(), ProviderError> {
        self.set_paused(id, false)
    }
}

impl FakeProvider {
    /// Whether sandbox `id` is paused, as its record says.
    pub fn is_paused(&self, id: &str) -> bool {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).get(id).is_some_and(|r| r.paused)
    }

    fn set_paused(&self, id: &str, paused: bool) -> Result<(), ProviderError> {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let record = records.get_mut(id).ok_or_else(|| ProviderError::NotFound(id.to_string()))?;
        record.paused = paused;
        Ok(())
    }
}

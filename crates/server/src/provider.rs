//! `AnyProvider`: the closed set of providers the server can run, dispatched by an enum (no
//! trait objects), with the fake beside the real ones.

use sandman_provider::fake::FakeProvider;
use sandman_provider::{
    Claim, Endpoint, NamedDir, NodeProgress, Prepared, Progress, Provider, ProviderError, ProviderEvent, Record,
    SandboxSpec, SnapshotMade, SnapshotScope,
};
use sandman_provider_docker::DockerProvider;
use sandman_provider_kube::KubeProvider;
use sandman_provider_process::ProcessProvider;
use sandman_wire::server::{Applied, ImageConfig, Isolation};
use tokio::sync::mpsc;

#[derive(Debug)]
pub enum AnyProvider {
    // Boxed, as the kube provider is: its configuration and host network make it the larger.
    Process(Box<ProcessProvider>),
    Docker(DockerProvider),
    // Boxed: the kube client and its caches make it several times larger than the others.
    Kube(Box<KubeProvider>),
    Fake(FakeProvider),
}

impl AnyProvider {
    /// What a provider does as the server stops: the process provider stops watching and gives
    /// back the memory its sandboxes' directories took when none is left. Sandboxes keep running.
    pub async fn stop(&self) {
        if let AnyProvider::Process(p) = self {
            p.shutdown().await;
        }
    }
}

/// The provider names `--provider` accepts.
pub const NAMES: &[&str] = &["process", "docker", "kubernetes"];

impl Provider for AnyProvider {
    fn name(&self) -> &'static str {
        match self {
            AnyProvider::Process(p) => p.name(),
            AnyProvider::Docker(p) => p.name(),
            AnyProvider::Kube(p) => p.name(),
            AnyProvider::Fake(p) => p.name(),
        }
    }

    fn isolation(&self) -> Isolation {
        match self {
            AnyProvider::Process(p) => p.isolation(),
            AnyProvider::Docker(p) => p.isolation(),
            AnyProvider::Kube(p) => p.isolation(),
            AnyProvider::Fake(p) => p.isolation(),
        }
    }

    fn defaults(&self) -> sandman_wire::server::Resources {
        match self {
            AnyProvider::Process(p) => p.defaults(),
            AnyProvider::Docker(p) => p.defaults(),
            AnyProvider::Kube(p) => p.defaults(),
            AnyProvider::Fake(p) => p.defaults(),
        }
    }

    fn check(&self, spec: &SandboxSpec) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.check(spec),
            AnyProvider::Docker(p) => p.check(spec),
            AnyProvider::Kube(p) => p.check(spec),
            AnyProvider::Fake(p) => p.check(spec),
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Endpoint, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.create(spec).await,
            AnyProvider::Docker(p) => p.create(spec).await,
            AnyProvider::Kube(p) => p.create(spec).await,
            AnyProvider::Fake(p) => p.create(spec).await,
        }
    }

    fn proves_daemon(&self) -> bool {
        match self {
            AnyProvider::Process(p) => p.proves_daemon(),
            AnyProvider::Docker(p) => p.proves_daemon(),
            AnyProvider::Kube(p) => p.proves_daemon(),
            AnyProvider::Fake(p) => p.proves_daemon(),
        }
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.delete(id).await,
            AnyProvider::Docker(p) => p.delete(id).await,
            AnyProvider::Kube(p) => p.delete(id).await,
            AnyProvider::Fake(p) => p.delete(id).await,
        }
    }

    async fn list(&self) -> Result<Vec<Record>, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.list().await,
            AnyProvider::Docker(p) => p.list().await,
            AnyProvider::Kube(p) => p.list().await,
            AnyProvider::Fake(p) => p.list().await,
        }
    }

    fn events(&self) -> Option<mpsc::Receiver<ProviderEvent>> {
        match self {
            AnyProvider::Process(p) => p.events(),
            AnyProvider::Docker(p) => p.events(),
            AnyProvider::Kube(p) => p.events(),
            AnyProvider::Fake(p) => p.events(),
        }
    }

    fn progress(&self) -> Option<mpsc::Receiver<Progress>> {
        match self {
            AnyProvider::Process(p) => p.progress(),
            AnyProvider::Docker(p) => p.progress(),
            AnyProvider::Kube(p) => p.progress(),
            AnyProvider::Fake(p) => p.progress(),
        }
    }

    async fn prepare(
        &self,
        image: &str,
        progress: mpsc::UnboundedSender<NodeProgress>,
    ) -> Result<Prepared, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.prepare(image, progress).await,
            AnyProvider::Docker(p) => p.prepare(image, progress).await,
            AnyProvider::Kube(p) => p.prepare(image, progress).await,
            AnyProvider::Fake(p) => p.prepare(image, progress).await,
        }
    }

    async fn applied(&self, id: &str) -> Result<Applied, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.applied(id).await,
            AnyProvider::Docker(p) => p.applied(id).await,
            AnyProvider::Kube(p) => p.applied(id).await,
            AnyProvider::Fake(p) => p.applied(id).await,
        }
    }

    async fn image_config(&self, id: &str) -> Result<Option<ImageConfig>, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.image_config(id).await,
            AnyProvider::Docker(p) => p.image_config(id).await,
            AnyProvider::Kube(p) => p.image_config(id).await,
            AnyProvider::Fake(p) => p.image_config(id).await,
        }
    }

    async fn claim(&self, claim: &Claim) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.claim(claim).await,
            AnyProvider::Docker(p) => p.claim(claim).await,
            AnyProvider::Kube(p) => p.claim(claim).await,
            AnyProvider::Fake(p) => p.claim(claim).await,
        }
    }

    async fn mark_ready(&self, id: &str, line: &str) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.mark_ready(id, line).await,
            AnyProvider::Docker(p) => p.mark_ready(id, line).await,
            AnyProvider::Kube(p) => p.mark_ready(id, line).await,
            AnyProvider::Fake(p) => p.mark_ready(id, line).await,
        }
    }

    async fn snapshot(&self, id: &str, snapshot: &str) -> Result<SnapshotMade, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.snapshot(id, snapshot).await,
            AnyProvider::Docker(p) => p.snapshot(id, snapshot).await,
            AnyProvider::Kube(p) => p.snapshot(id, snapshot).await,
            AnyProvider::Fake(p) => p.snapshot(id, snapshot).await,
        }
    }

    fn snapshot_scope(&self) -> SnapshotScope {
        match self {
            AnyProvider::Process(p) => p.snapshot_scope(),
            AnyProvider::Docker(p) => p.snapshot_scope(),
            AnyProvider::Kube(p) => p.snapshot_scope(),
            AnyProvider::Fake(p) => p.snapshot_scope(),
        }
    }

    fn check_snapshot(&self) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.check_snapshot(),
            AnyProvider::Docker(p) => p.check_snapshot(),
            AnyProvider::Kube(p) => p.check_snapshot(),
            AnyProvider::Fake(p) => p.check_snapshot(),
        }
    }

    async fn snapshot_dirs(
        &self,
        id: &str,
        snapshot: &str,
        dirs: Vec<NamedDir>,
    ) -> Result<SnapshotMade, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.snapshot_dirs(id, snapshot, dirs).await,
            AnyProvider::Docker(p) => p.snapshot_dirs(id, snapshot, dirs).await,
            AnyProvider::Kube(p) => p.snapshot_dirs(id, snapshot, dirs).await,
            AnyProvider::Fake(p) => p.snapshot_dirs(id, snapshot, dirs).await,
        }
    }

    async fn delete_snapshot(&self, snapshot: &str) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.delete_snapshot(snapshot).await,
            AnyProvider::Docker(p) => p.delete_snapshot(snapshot).await,
            AnyProvider::Kube(p) => p.delete_snapshot(snapshot).await,
            AnyProvider::Fake(p) => p.delete_snapshot(snapshot).await,
        }
    }

    async fn export_snapshot(&self, snapshot: &str, reference: &str) -> Result<String, ProviderError> {
        match self {
            AnyProvider::Process(p) => p.export_snapshot(snapshot, reference).await,
            AnyProvider::Docker(p) => p.export_snapshot(snapshot, reference).await,
            AnyProvider::Kube(p) => p.export_snapshot(snapshot, reference).await,
            AnyProvider::Fake(p) => p.export_snapshot(snapshot, reference).await,
        }
    }

    async fn pause(&self, id: &str) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.pause(id).await,
            AnyProvider::Docker(p) => p.pause(id).await,
            AnyProvider::Kube(p) => p.pause(id).await,
            AnyProvider::Fake(p) => p.pause(id).await,
        }
    }

    async fn resume(&self, id: &str) -> Result<(), ProviderError> {
        match self {
            AnyProvider::Process(p) => p.resume(id).await,
            AnyProvider::Docker(p) => p.resume(id).await,
            AnyProvider::Kube(p) => p.resume(id).await,
            AnyProvider::Fake(p) => p.resume(id).await,
        }
    }
}

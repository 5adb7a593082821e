//! Snapshots and forks: `POST /v1/sandboxes/{id}/snapshots` asks the provider to record a
//! sandbox's files as a snapshot, which [`Snapshots`] keeps (in `snapshots.json`, across
//! restarts) until it is deleted or its job is; a create whose image is `snapshot:<id>` starts
//! from one; `POST /v1/sandboxes/{id}/fork` is a snapshot and creates from it in one call.
//! Start at [`Service::take_snapshot`] and [`Service::fork`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sandman_provider::{NamedDir, Provider, SnapshotScope};
use sandman_wire::daemon::{FileKind, FileStat};
use sandman_wire::server::{CreateSandbox, SandboxState};
use sandman_wire::snapshots::{CreateSnapshot, ForkRequest, Forked, IMAGE_PREFIX, Snapshot, normal, snapshot_of_image};

use super::Service;
use super::request::bad_number;
use crate::error::{ServerError, ServerResult};
use crate::sandbox::now_ms;
use crate::store::{self, Store};

/// The snapshots the server holds, by id, and the file that keeps them.
#[derive(Debug)]
pub(super) struct Snapshots {
    store: Store,
    /// Locked briefly to read or change the map (and write the file), never across an await.
    entries: Mutex<BTreeMap<String, Snapshot>>,
}

impl Snapshots {
    pub(super) fn open(store: &Store) -> Snapshots {
        Snapshots { entries: Mutex::new(store.load(store::SNAPSHOTS)), store: store.clone() }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Snapshot>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(&self, snapshot: Snapshot) {
        let mut entries = self.lock();
        entries.insert(snapshot.id.clone(), snapshot);
        self.save(&entries);
    }

    fn get(&self, id: &str) -> Option<Snapshot> {
        self.lock().get(id).cloned()
    }

    fn remove(&self, id: &str) -> Option<Snapshot> {
        let mut entries = self.lock();
        let removed = entries.remove(id);
        if removed.is_some() {
            self.save(&entries);
        }
        removed
    }

    fn list(&self, filter: impl Fn(&Snapshot) -> bool) -> Vec<Snapshot> {
        let mut out: Vec<Snapshot> = self.lock().values().filter(|s| filter(s)).cloned().collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        out
    }

    fn save(&self, entries: &BTreeMap<String, Snapshot>) {
        self.store.save(store::SNAPSHOTS, entries);
    }
}

fn no_snapshot(id: &str) -> ServerError {
    ServerError::NotFound(format!("no snapshot `{id}`; `GET /v1/snapshots` lists those the server holds"))
}

impl Service {
    /// Records sandbox `id`'s files as a new snapshot (its processes are not kept). The
    /// sandbox must be ready; its lease is held while the provider works.
    pub async fn take_snapshot(&self, id: &str, req: CreateSnapshot) -> ServerResult<Snapshot> {
        req.check_bounds().map_err(bad_number)?;
        let paths: Vec<String> = req.paths.iter().map(|p| normal(p)).collect();
        let scope = self.provider.snapshot_scope();
        self.check_scope(scope, &paths)?;
        self.provider.check_snapshot().map_err(ServerError::Provider)?;
        let target = self.call_target(id)?;
        let sb = self.get(id)?;
        let snap_id = format!("snap-{}", &crate::sys::random_hex()[..12]);
        let made = match scope {
            SnapshotScope::Whole => self.provider.snapshot(id, &snap_id).await,
            SnapshotScope::Named { max_bytes, .. } => {
                let dirs = self.archive_dirs(id, &target, &paths, max_bytes).await?;
                self.provider.snapshot_dirs(id, &snap_id, dirs).await
            }
        }
        .map_err(ServerError::Provider)?;
        drop(target);
        let snapshot = Snapshot {
            image: format!("{IMAGE_PREFIX}{snap_id}"),
            id: snap_id,
            name: req.name,
            source: id.to_string(),
            job: sb.spec.job.clone(),
            provider: self.provider.name().to_string(),
            base_image: sb.spec.image.clone(),
            size: made.size,
            paths,
            pushed: made.pushed,
            created_at_ms: now_ms(),
        };
        tracing::info!(sandbox = id, snapshot = %snapshot.id, size = ?snapshot.size, "snapshot taken");
        self.snapshots.insert(snapshot.clone());
        Ok(snapshot)
    }

    /// Refuses at once a snapshot that names no directories on a provider that records named
    /// ones only, and one that names some on a provider that records the whole file system.
    fn check_scope(&self, scope: SnapshotScope, paths: &[String]) -> ServerResult<()> {
        let name = self.provider.name();
        match scope {
            SnapshotScope::Named { why, .. } if paths.is_empty() => Err(ServerError::InvalidArgument(format!(
                "`paths` is required: the {name} provider snapshots only the directories a request names (such as \
                 {{\"paths\": [\"/workspace\"]}}), because {why}"
            ))),
            SnapshotScope::Whole if !paths.is_empty() => Err(ServerError::InvalidArgument(format!(
                "`paths`: the {name} provider records a sandbox's whole file system; leave `paths` out"
            ))),
            _ => Ok(()),
        }
    }

    /// Each of `paths` of sandbox `id` as its daemon archives it (`GET /v1/archive`), with the
    /// directory's own mode and owner (`GET /v1/stat`), at most `max_bytes` together.
    async fn archive_dirs(
        &self,
        id: &str,
        target: &super::CallTarget,
        paths: &[String],
        max_bytes: u64,
    ) -> ServerResult<Vec<NamedDir>> {
        let failed = |path: &str, e: crate::daemon::CallError| {
            ServerError::Unavailable(format!("cannot archive `{path}` of sandbox `{id}` for its snapshot: {e}"))
        };
        let mut dirs = Vec::with_capacity(paths.len());
        let mut left = max_bytes;
        for path in paths {
            let query = form_urlencoded::Serializer::new(String::new()).append_pair("path", path).finish();
            let stat: FileStat = crate::daemon::call_json::<(), _>(
                &self.daemons,
                &target.route.endpoint,
                &target.route.token,
                http::Method::GET,
                &format!("/v1/stat?{query}"),
                None,
            )
            .await
            .map_err(|e| failed(path, e))?;
            if stat.kind != FileKind::Dir {
                return Err(ServerError::InvalidArgument(format!(
                    "`paths`: `{path}` is not a directory in sandbox `{id}` (it is a {:?})",
                    stat.kind
                )));
            }
            let archive_path = format!("/v1/archive?{query}");
            let tar = crate::daemon::fetch_bytes(
                &self.daemons,
                &target.route.endpoint,
                &target.route.token,
                &archive_path,
                left,
            )
            .await
            .map_err(|e| failed(path, e))?
            .ok_or_else(|| {
                ServerError::InvalidArgument(format!(
                    "the directories named in `paths` hold more than {max_bytes} bytes, the {} provider's bound \
                         for one snapshot",
                    self.provider.name()
                ))
            })?;
            left -= tar.len() as u64;
            dirs.push(NamedDir { path: path.clone(), mode: stat.mode, uid: stat.uid, gid: stat.gid, tar });
        }
        Ok(dirs)
    }

    pub fn snapshot_info(&self, id: &str) -> ServerResult<Snapshot> {
        self.snapshots.get(id).ok_or_else(|| no_snapshot(id))
    }

    /// The snapshots held, oldest first: of job `job`, of sandbox `source`, or all.
    pub fn snapshot_list(&self, job: Option<&str>, source: Option<&str>) -> Vec<Snapshot> {
        self.snapshots
            .list(|s| job.is_none_or(|j| s.job.as_deref() == Some(j)) && source.is_none_or(|src| s.source == src))
    }

    /// Deletes a snapshot; the sandboxes started from it keep running (the provider keeps its
    /// layer while they use it).
    pub async fn delete_snapshot(&self, id: &str) -> ServerResult<Snapshot> {
        let snapshot = self.snapshot_info(id)?;
        self.provider.delete_snapshot(id).await.map_err(ServerError::Provider)?;
        self.snapshots.remove(id);
        tracing::info!(snapshot = id, "snapshot deleted");
        Ok(snapshot)
    }

    /// Pushes a snapshot to a registry as an image.
    pub async fn export_snapshot(&self, id: &str, reference: &str) -> ServerResult<String> {
        self.snapshot_info(id)?;
        if reference.trim().is_empty() {
            return Err(ServerError::InvalidArgument("`reference` is required: registry/repository:tag".into()));
        }
        self.provider.export_snapshot(id, reference).await.map_err(ServerError::Provider)
    }

    /// Deletes the snapshots of a job that ends; how many.
    pub(super) async fn delete_job_snapshots(&self, job: &str) -> usize {
        let mut n = 0;
        for snapshot in self.snapshots.list(|s| s.job.as_deref() == Some(job)) {
            match self.delete_snapshot(&snapshot.id).await {
                Ok(_) => n += 1,
                Err(e) => tracing::warn!(job, snapshot = %snapshot.id, error = %e, "cannot delete a job's snapshot"),
            }
        }
        n
    }

    /// Refuses at once a create from a snapshot the server does not hold, or holds for another
    /// provider.
    pub(super) fn check_snapshot_image(&self, image: &str) -> ServerResult<()> {
        let Some(id) = snapshot_of_image(image) else { return Ok(()) };
        let snapshot = self.snapshots.get(id).ok_or_else(|| no_snapshot(id))?;
        if snapshot.provider != self.provider.name() {
            return Err(ServerError::InvalidArgument(format!(
                "snapshot `{id}` is the {} provider's, and this server runs the {} provider",
                snapshot.provider,
                self.provider.name()
            )));
        }
        Ok(())
    }

    /// A snapshot of sandbox `id` and `count` creates from it, with the source's job, labels,
    /// resources, environment, profile, network, lease and user unless the request gives them.
    /// All or nothing: when a child fails, those made are released and the error answered.
    pub async fn fork(self: &Arc<Self>, id: &str, req: ForkRequest) -> ServerResult<Forked> {
        req.check_bounds().map_err(bad_number)?;
        let source = self.get(id)?;
        if source.state() != SandboxState::Ready {
            // The snapshot's call says why (gone with its reason, or not ready).
            self.call_target(id)?;
        }
        let snapshot =
            self.take_snapshot(id, CreateSnapshot { name: req.name.clone(), paths: req.paths.clone() }).await?;
        let spec = &source.spec;
        let mut env = spec.env.clone();
        env.extend(req.env.clone());
        let child = CreateSandbox {
            image: snapshot.image.clone(),
            provider: None,
            resources: req.resources.clone().unwrap_or_else(|| spec.resources.clone()),
            env,
            labels: req.labels.clone().unwrap_or_else(|| spec.labels.clone()),
            job: req.job.clone().or_else(|| spec.job.clone()),
            profile: spec.profile,
            network: spec.network,
            ttl_s: req.ttl_s.or(spec.server.ttl_s),
            idle_timeout_s: req.idle_timeout_s.or(spec.server.idle_timeout_s),
            lease_s: req.lease_s.or(Some(spec.server.lease_s)),
            pool: None,
            setup: Vec::new(),
            idempotency_key: None,
            wait: req.wait,
            wait_timeout_s: req.wait_timeout_s,
            user: spec.server.user.clone(),
            auto_resume: spec.server.auto_resume,
        };
        let creates = (0..req.count).map(|_| self.create(child.clone()));
        let results = futures_util::future::join_all(creates).await;
        let mut sandboxes = Vec::with_capacity(results.len());
        let mut failure = None;
        for result in results {
            match result {
                Ok(sb) => sandboxes.push(sb),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        if let Some(e) = failure {
            for made in &sandboxes {
                let _ = self.release(&made.id, sandman_wire::server::Reason::Released).await;
            }
            return Err(e);
        }
        tracing::info!(sandbox = id, snapshot = %snapshot.id, children = sandboxes.len(), "sandbox forked");
        Ok(Forked { snapshot, sandboxes })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::time::Duration;

    use sandman_provider::Endpoint;
    use sandman_provider::fake::FakeProvider;

    use super::*;
    use crate::provider::AnyProvider;
    use crate::service::{Daemons, Settings};

    fn service(dir: &Path) -> Arc<Service> {
        let settings = Settings {
            default_lease: Duration::from_secs(30),
            max_ttl: None,
            ready_timeout: Duration::from_secs(5),
            create_rate: None,
            daemons: Daemons::Absent,
            ..Settings::new(dir.to_path_buf())
        };
        let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("nowhere.sock"))));
        let s = Service::new(settings, provider, "t".into());
        s.start_background();
        s
    }

    fn fake(s: &Service) -> &FakeProvider {
        match &s.provider {
            AnyProvider::Fake(f) => f,
            _ => unreachable!(),
        }
    }

    #[tokio::test]
    async fn a_fork_copies_the_sources_job_and_labels_and_its_snapshot_ends_with_the_job() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = service(dir.path());
        let labels = BTreeMap::from([("role".to_string(), "source".to_string())]);
        let req = CreateSandbox {
            image: "img".into(),
            job: Some("j".into()),
            labels,
            wait: true,
            ..CreateSandbox::default()
        };
        let source = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));

        let bad = s.fork(&source.id, ForkRequest { count: 0, ..ForkRequest::default() }).await;
        assert!(matches!(&bad, Err(ServerError::InvalidArgument(m)) if m.contains("`count`")), "{bad:?}");

        let forked = s
            .fork(&source.id, ForkRequest { count: 3, wait: true, ..ForkRequest::default() })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(forked.sandboxes.len(), 3);
        for kid in &forked.sandboxes {
            assert_eq!((kid.job.as_deref(), kid.labels.get("role").map(String::as_str)), (Some("j"), Some("source")));
            assert_eq!(kid.image, forked.snapshot.image);
        }
        assert_eq!(fake(&s).snapshots(), vec![forked.snapshot.id.clone()]);

        // Unknown snapshots are refused before the provider is asked.
        let missing = CreateSandbox { image: "snapshot:snap-none".into(), ..CreateSandbox::default() };
        assert!(matches!(s.create(missing).await, Err(ServerError::NotFound(m)) if m.contains("snap-none")));

        // Kept across a restart, then gone with the job.
        let again = service(dir.path());
        assert_eq!(again.snapshot_list(Some("j"), None).len(), 1);
        s.delete_job("j").await.unwrap_or_else(|e| panic!("{e}"));
        assert!(s.snapshot_list(None, None).is_empty());
        assert!(fake(&s).snapshots().is_empty());
        assert!(matches!(s.snapshot_info(&forked.snapshot.id), Err(ServerError::NotFound(_))));
    }

    /// A service over a fake that records named directories, each sandbox's daemon a stand-in
    /// answering `stat` and `archive`.
    fn named(dir: &Path) -> (Arc<Service>, Arc<Mutex<Vec<sandman_testkit::standin::StandIn>>>) {
        let standins = Arc::new(Mutex::new(Vec::new()));
        let (kept, sockets) = (standins.clone(), dir.to_path_buf());
        let fake = FakeProvider::each_at(move |spec| {
            let socket = sockets.join(format!("{}.sock", spec.id));
            let standin = sandman_testkit::standin::StandIn::unix(&socket, Some(&spec.token));
            standin.answer("/v1/stat", stat(FileKind::Dir));
            standin.answer_bytes("/v1/archive", bytes::Bytes::from_static(b"the archive"));
            kept.lock().unwrap_or_else(|e| panic!("{e}")).push(standin);
            Endpoint::Unix(socket)
        });
        fake.set_named_snapshots(1 << 20);
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap_or_else(|e| panic!("{e}"));
        let settings = Settings { ready_timeout: Duration::from_secs(5), ..Settings::new(state) };
        let s = Service::new(settings, AnyProvider::Fake(fake), "t".into());
        s.start_background();
        (s, standins)
    }

    fn stat(kind: FileKind) -> serde_json::Value {
        let stat = FileStat {
            path: "/workspace".into(),
            kind,
            size: 0,
            mode: 0o750,
            uid: 1000,
            gid: 1001,
            mtime_ms: 0,
            link_target: None,
        };
        serde_json::to_value(stat).unwrap_or_else(|e| panic!("{e}"))
    }

    fn paths(p: &[&str]) -> CreateSnapshot {
        CreateSnapshot { name: None, paths: p.iter().map(|s| s.to_string()).collect() }
    }

    #[tokio::test]
    async fn a_provider_of_named_directories_gets_their_archives_and_a_snapshot_naming_none_is_refused() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (s, standins) = named(dir.path());
        let req = CreateSandbox { image: "img".into(), wait: true, ..CreateSandbox::default() };
        let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));

        let none = s.take_snapshot(&sb.id, paths(&[])).await;
        let Err(ServerError::InvalidArgument(m)) = &none else { panic!("{none:?}") };
        for words in ["`paths` is required", "the fake provider", "because the fake is told to"] {
            assert!(m.contains(words), "{m}");
        }

        let snap = s.take_snapshot(&sb.id, paths(&["/workspace/"])).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(snap.paths, vec!["/workspace".to_string()]);
        assert_eq!(snap.pushed.as_deref(), Some(format!("fake.registry/snapshots:{}", snap.id).as_str()));
        let got = fake(&s).snapshot_dirs_of(&snap.id);
        let want =
            NamedDir { path: "/workspace".into(), mode: 0o750, uid: 1000, gid: 1001, tar: b"the archive".to_vec() };
        assert_eq!(got, vec![want]);

        // A fork names the directories of its snapshot.
        let forked = s
            .fork(
                &sb.id,
                ForkRequest { count: 2, paths: vec!["/workspace".into()], wait: true, ..ForkRequest::default() },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(forked.snapshot.paths, vec!["/workspace".to_string()]);
        assert!(forked.sandboxes.iter().all(|k| k.image == forked.snapshot.image));
        let unnamed = s.fork(&sb.id, ForkRequest { count: 1, wait: true, ..ForkRequest::default() }).await;
        assert!(matches!(unnamed, Err(ServerError::InvalidArgument(_))), "{unnamed:?}");

        // Over the provider's bound, and a path that is not a directory.
        fake(&s).set_named_snapshots(4);
        let big = s.take_snapshot(&sb.id, paths(&["/workspace"])).await;
        assert!(matches!(&big, Err(ServerError::InvalidArgument(m)) if m.contains("more than 4 bytes")), "{big:?}");
        fake(&s).set_named_snapshots(1 << 20);
        standins.lock().unwrap_or_else(|e| panic!("{e}"))[0].answer("/v1/stat", stat(FileKind::File));
        let file = s.take_snapshot(&sb.id, paths(&["/workspace"])).await;
        assert!(matches!(&file, Err(ServerError::InvalidArgument(m)) if m.contains("not a directory")), "{file:?}");

        // A provider that records the whole file system takes no `paths`.
        let other = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let whole = service(other.path());
        let sb = whole.create(CreateSandbox { image: "img".into(), wait: true, ..CreateSandbox::default() }).await;
        let sb = sb.unwrap_or_else(|e| panic!("{e}"));
        let named = whole.take_snapshot(&sb.id, paths(&["/workspace"])).await;
        assert!(matches!(&named, Err(ServerError::InvalidArgument(m)) if m.contains("leave `paths` out")), "{named:?}");
    }
}

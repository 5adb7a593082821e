//! The one shared watch of every sandbox pod of this server (kube-runtime's `watcher` with a
//! label selector, feeding a reflector store), and the [`Tracker`] it feeds: what each pod last
//! looked like, which creates wait for it, and which deaths nobody asked for, reported as
//! [`ProviderEvent`]s. Nothing polls per pod.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use sandman_provider::{Ended, ProviderEvent};
use sandman_wire::server::Reason;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::pod::{LABEL_JOB, sandbox_id};
use crate::status::{PodState, classify};

/// How long a job's release is remembered, so that its pods the watch first sees while they
/// are being deleted are not reported as deaths.
const DELETED_JOB_MEMORY: Duration = Duration::from_secs(600);
/// Server-side timeout of each watch request; the watcher resumes from the last version.
const WATCH_TIMEOUT_S: u32 = 290;

/// What the watch knows of each sandbox pod. Locked briefly, never across an await.
#[derive(Debug, Default)]
pub struct Tracker {
    slots: Mutex<HashMap<String, Slot>>,
    /// Job labels released with `delete_job`, and when.
    deleted_jobs: Mutex<HashMap<String, Instant>>,
}

#[derive(Debug)]
struct Slot {
    /// The pod's last state; a create awaits its changes.
    state: watch::Sender<PodState>,
    job: Option<String>,
    /// A create of this provider waits for it: its end is the create's error, not an event.
    creating: bool,
    /// This provider deleted it: its end is not news.
    deleting: bool,
    /// Its end has been told (as an event or a failed create), or it was found ended.
    told: bool,
    /// Seen by the watch since the slot was made.
    present: bool,
}

impl Slot {
    fn new(job: Option<String>) -> Self {
        Slot {
            state: watch::Sender::new(PodState::Pending),
            job,
            creating: false,
            deleting: false,
            told: false,
            present: false,
        }
    }
}

/// Whether one watch event came from a (re)list or from the live watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Listed,
    Live,
}

impl Tracker {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many sandboxes it follows now.
    pub fn tracked(&self) -> usize {
        self.slots().len()
    }

    /// A create begins: its changes are awaited on the answer, and its end is the create's.
    pub fn begin_create(&self, id: &str, job: Option<String>) -> watch::Receiver<PodState> {
        let mut slots = self.slots();
        let slot = slots.entry(id.to_string()).or_insert_with(|| Slot::new(job));
        slot.creating = true;
        slot.deleting = false;
        slot.told = false;
        slot.state.subscribe()
    }

    /// A create ended; after a failure the sandbox's end has been told.
    pub fn end_create(&self, id: &str, ok: bool) {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(id) else { return };
        slot.creating = false;
        if !ok {
            slot.told = true;
        }
        if !slot.present && !ok {
            slots.remove(id);
        }
    }

    pub fn is_creating(&self, id: &str) -> bool {
        self.slots().get(id).is_some_and(|s| s.creating)
    }

    /// This provider is deleting the sandbox: its end is not news.
    pub fn mark_deleting(&self, id: &str) {
        self.slots().entry(id.to_string()).or_insert_with(|| Slot::new(None)).deleting = true;
    }

    /// This provider is deleting the sandbox, if it follows it: a release-all names pods that
    /// may be gone already (their deletion seen), whose slots must not come back.
    pub fn mark_deleting_if_tracked(&self, id: &str) {
        if let Some(slot) = self.slots().get_mut(id) {
            slot.deleting = true;
        }
    }

    /// Forgets a sandbox whose pod was not there to delete.
    pub fn forget(&self, id: &str) {
        let mut slots = self.slots();
        if slots.get(id).is_some_and(|s| !s.creating) {
            slots.remove(id);
        }
    }

    /// The sandbox now belongs to `job` (its label value): a pool sandbox this provider has
    /// just claimed, so that releasing the claimer's job counts it in before the watch sees it.
    pub fn set_job(&self, id: &str, job: Option<String>) {
        if let Some(slot) = self.slots().get_mut(id) {
            slot.job = job;
        }
    }

    /// This provider is deleting every sandbox of a job (its label value).
    pub fn mark_job_deleting(&self, job: &str) {
        {
            let now = Instant::now();
            let mut jobs = self.deleted_jobs.lock().unwrap_or_else(PoisonError::into_inner);
            jobs.retain(|_, at| now.duration_since(*at) < DELETED_JOB_MEMORY);
            jobs.insert(job.to_string(), now);
        }
        for slot in self.slots().values_mut() {
            if slot.job.as_deref() == Some(job) {
                slot.deleting = true;
            }
        }
    }

    fn job_deleted(&self, job: &str) -> bool {
        self.deleted_jobs.lock().unwrap_or_else(PoisonError::into_inner).contains_key(job)
    }

    /// A pod as the watch sees it; answers the event to report, if its death is news.
    pub fn apply(&self, pod: &Pod, seen: Seen) -> Option<ProviderEvent> {
        let id = sandbox_id(&pod.metadata)?;
        let job = pod.metadata.labels.as_ref().and_then(|l| l.get(LABEL_JOB)).cloned();
        let being_deleted = pod.metadata.deletion_timestamp.is_some();
        let job_deleted = being_deleted && job.as_deref().is_some_and(|j| self.job_deleted(j));
        let state = classify(pod);
        let mut slots = self.slots();
        let fresh = !slots.contains_key(id);
        let slot = slots.entry(id.to_string()).or_insert_with(|| Slot::new(job.clone()));
        // The pod's label is the truth: a claimed pool sandbox takes its claimer's job.
        slot.job = job;
        slot.present = true;
        if fresh && (job_deleted || (seen == Seen::Listed && state.is_ended())) {
            // Released with its job, or found ended when (re)listing: `list` reports it.
            slot.told = true;
        }
        let news = tell(id, slot, &state);
        slot.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
        news
    }

    /// A pod is gone. Unless this provider deleted it, that is a death: the last state's reason
    /// when it had ended, else a deletion from outside.
    pub fn deleted(&self, pod: &Pod) -> Option<ProviderEvent> {
        let id = sandbox_id(&pod.metadata)?;
        let state = match classify(pod) {
            s if s.is_ended() => s,
            _ => PodState::Ended(Ended {
                reason: Reason::ProviderError,
                message: "the pod was deleted by someone other than sandman".into(),
            }),
        };
        self.gone(id, state)
    }

    /// A (re)list is complete: the pods it did not list are gone.
    pub fn relisted(&self, listed: &HashSet<String>) -> Vec<ProviderEvent> {
        let missing: Vec<String> = self.slots().keys().filter(|id| !listed.contains(*id)).cloned().collect();
        let mut news = Vec::new();
        for id in missing {
            let present = self.slots().get(&id).is_some_and(|s| s.present);
            if !present {
                // Never seen: a create whose pod is newer than the list, or a delete of a pod
                // that was gone already.
                self.forget_unless_creating(&id);
                continue;
            }
            let state = PodState::Ended(Ended {
                reason: Reason::ProviderError,
                message: "the pod disappeared while the watch was interrupted".into(),
            });
            news.extend(self.gone(&id, state));
        }
        news
    }

    fn forget_unless_creating(&self, id: &str) {
        let mut slots = self.slots();
        if slots.get(id).is_some_and(|s| !s.creating && !s.present) {
            slots.remove(id);
        }
    }

    fn gone(&self, id: &str, state: PodState) -> Option<ProviderEvent> {
        let mut slots = self.slots();
        let slot = slots.get_mut(id)?;
        let news = if slot.deleting { None } else { tell(id, slot, &state) };
        if slot.creating {
            slot.present = false;
            slot.state.send_replace(state);
        } else {
            slots.remove(id);
        }
        news
    }
}

/// The event for a death not yet told, and marks it told.
fn tell(id: &str, slot: &mut Slot, state: &PodState) -> Option<ProviderEvent> {
    let ended = state.ended()?;
    if slot.told || slot.creating || slot.deleting || slot.state.borrow().is_ended() {
        return None;
    }
    slot.told = true;
    Some(ProviderEvent { id: id.to_string(), ended: ended.clone() })
}

/// Runs the shared watch until cancelled: every event goes into the reflector store, then to the
/// tracker, and the deaths it finds to `events`.
pub async fn run(
    pods: Api<Pod>,
    selector: String,
    writer: Writer<Pod>,
    tracker: Arc<Tracker>,
    events: mpsc::Sender<ProviderEvent>,
    cancel: CancellationToken,
) {
    let config = watcher::Config::default().labels(&selector).timeout(WATCH_TIMEOUT_S);
    // The store keeps every sandbox pod: not their managed fields (about 40% of a running pod's
    // JSON, and more of its memory), which nothing here reads.
    let pods = watcher::watcher(pods, config).default_backoff().modify(|pod| pod.managed_fields_mut().clear());
    let stream = reflector::reflector(writer, pods);
    let mut stream = std::pin::pin!(stream);
    let mut listed: HashSet<String> = HashSet::new();
    let mut failing = false;
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            next = stream.next() => next,
        };
        let Some(event) = next else {
            tracing::error!("the pod watch ended");
            return;
        };
        let news: Vec<ProviderEvent> = match event {
            Ok(Event::Init) => {
                listed.clear();
                Vec::new()
            }
            Ok(Event::InitApply(pod)) => {
                if let Some(id) = sandbox_id(&pod.metadata) {
                    listed.insert(id.to_string());
                }
                tracker.apply(&pod, Seen::Listed).into_iter().collect()
            }
            Ok(Event::InitDone) => {
                if failing {
                    tracing::info!("the pod watch is back");
                    failing = false;
                }
                let news = tracker.relisted(&listed);
                listed.clear();
                news
            }
            Ok(Event::Apply(pod)) => tracker.apply(&pod, Seen::Live).into_iter().collect(),
            Ok(Event::Delete(pod)) => tracker.deleted(&pod).into_iter().collect(),
            Err(err) => {
                // The watcher re-lists after a 410 and resumes after a dropped stream by itself,
                // with backoff; only the first of a run of errors is worth a warning.
                let err = crate::api::chain(&err);
                if failing {
                    tracing::debug!(%err, "the pod watch is still failing");
                } else {
                    tracing::warn!(%err, "the pod watch failed; resuming");
                    failing = true;
                }
                Vec::new()
            }
        };
        for event in news {
            tracing::warn!(sandbox = %event.id, reason = %event.ended.reason, message = %event.ended.message, "sandbox pod ended");
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = events.send(event) => {}
            }
        }
    }
}

//! The one shared watch of every sandbox pod of this server (kube-runtime's `watcher` with a
//! label selector), and the [`Tracker`] it feeds: what each pod last looked like, which creates
//! wait for it, and which deaths nobody asked for, reported as [`ProviderEvent`]s. Nothing polls
//! per pod, and no pod object is kept: each event is read into the tracker's few fields and
//! dropped, so that what the provider holds per sandbox is a slot, not a pod.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use sandman_provider::{Ended, ProviderEvent};
use sandman_wire::server::Reason;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::pod::{LABEL_JOB, sandbox_id};
use crate::status::{PodState, classify, describe};

/// How long a job's release is remembered, so that its pods the watch first sees while they
/// are being deleted are not reported as deaths.
const DELETED_JOB_MEMORY: Duration = Duration::from_secs(600);
/// Server-side timeout of each watch request; the watcher resumes from the last version.
const WATCH_TIMEOUT_S: u32 = 290;
/// Slots the tracker's map keeps room for however few sandboxes are left; above it, the map
/// is shrunk once it is three-quarters empty, so that a burst's room is given back after it.
const MIN_SLOTS_CAPACITY: usize = 64;

/// What the watch knows of each sandbox pod. Locked briefly, never across an await.
#[derive(Debug)]
pub struct Tracker {
    slots: Mutex<HashMap<String, Slot>>,
    /// Job labels released with `delete_job`, and when.
    deleted_jobs: Mutex<HashMap<String, Instant>>,
    /// Set once the watch has listed the pods (and again after each relist).
    synced: watch::Sender<bool>,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker { slots: Mutex::default(), deleted_jobs: Mutex::default(), synced: watch::Sender::new(false) }
    }
}

/// One sandbox: a few words, whatever its pod holds (a pod as the API server sends it is
/// kilobytes of JSON and more once parsed).
#[derive(Debug)]
struct Slot {
    /// The pod's last state.
    state: PodState,
    /// Where the pod was when last seen, while it is not running: a timeout's message.
    seen: Option<Box<str>>,
    /// While a create waits for the pod: its changes, sent to the create.
    waiter: Option<watch::Sender<PodState>>,
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
            state: PodState::Pending,
            seen: None,
            waiter: None,
            job,
            creating: false,
            deleting: false,
            told: false,
            present: false,
        }
    }

    /// The pod's new state, sent to the create waiting for it when it changed.
    fn set_state(&mut self, state: PodState) {
        if self.state == state {
            return;
        }
        if let Some(waiter) = &self.waiter {
            waiter.send_replace(state.clone());
        }
        self.state = state;
    }
}

/// Removes a slot, and gives back the map's room once it is mostly empty.
fn remove_slot(slots: &mut HashMap<String, Slot>, id: &str) {
    slots.remove(id);
    if slots.capacity() > MIN_SLOTS_CAPACITY && slots.len() * 4 < slots.capacity() {
        slots.shrink_to((slots.len() * 2).max(MIN_SLOTS_CAPACITY));
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

    /// How many of them the watch sees now (the others are being made or deleted).
    pub fn present(&self) -> usize {
        self.slots().values().filter(|s| s.present).count()
    }

    /// Slots its map has room for: shrinks back after a burst.
    pub fn capacity(&self) -> usize {
        self.slots().capacity()
    }

    /// The sandbox's pod state as last seen, and where it was when not running.
    pub fn state(&self, id: &str) -> Option<(PodState, Option<String>)> {
        self.slots().get(id).map(|s| (s.state.clone(), s.seen.as_deref().map(str::to_string)))
    }

    /// Waits until the watch has listed the pods once.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|listed| *listed).await;
    }

    /// A create begins: its changes are awaited on the answer, and its end is the create's.
    pub fn begin_create(&self, id: &str, job: Option<String>) -> watch::Receiver<PodState> {
        let mut slots = self.slots();
        let slot = slots.entry(id.to_string()).or_insert_with(|| Slot::new(job));
        slot.creating = true;
        slot.deleting = false;
        slot.told = false;
        let state = slot.state.clone();
        slot.waiter.get_or_insert_with(|| watch::Sender::new(state)).subscribe()
    }

    /// A create ended; after a failure the sandbox's end has been told. Nothing waits for the
    /// pod's changes any more.
    pub fn end_create(&self, id: &str, ok: bool) {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(id) else { return };
        slot.creating = false;
        slot.waiter = None;
        if !ok {
            slot.told = true;
        }
        if !slot.present && !ok {
            remove_slot(&mut slots, id);
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
            remove_slot(&mut slots, id);
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
        slot.seen = matches!(state, PodState::Pending | PodState::Unschedulable(_)).then(|| describe(pod).into());
        slot.set_state(state);
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
            remove_slot(&mut slots, id);
        }
    }

    fn gone(&self, id: &str, state: PodState) -> Option<ProviderEvent> {
        let mut slots = self.slots();
        let slot = slots.get_mut(id)?;
        let news = if slot.deleting { None } else { tell(id, slot, &state) };
        if slot.creating {
            slot.present = false;
            slot.seen = None;
            slot.set_state(state);
        } else {
            remove_slot(&mut slots, id);
        }
        news
    }
}

/// The event for a death not yet told, and marks it told.
fn tell(id: &str, slot: &mut Slot, state: &PodState) -> Option<ProviderEvent> {
    let ended = state.ended()?;
    if slot.told || slot.creating || slot.deleting || slot.state.is_ended() {
        return None;
    }
    slot.told = true;
    Some(ProviderEvent { id: id.to_string(), ended: ended.clone() })
}

/// Runs the shared watch until cancelled: every event goes to the tracker, and the deaths it
/// finds to `events`.
pub async fn run(
    pods: Api<Pod>,
    selector: String,
    tracker: Arc<Tracker>,
    events: mpsc::Sender<ProviderEvent>,
    cancel: CancellationToken,
) {
    let config = watcher::Config::default().labels(&selector).timeout(WATCH_TIMEOUT_S);
    let stream = watcher::watcher(pods, config).default_backoff();
    let mut stream = std::pin::pin!(stream);
    // The sandboxes a (re)list has named so far; dropped when it is done, not kept at the size
    // of the largest list.
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
                listed = HashSet::new();
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
                let news = tracker.relisted(&std::mem::take(&mut listed));
                tracker.synced.send_replace(true);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox pod as the watch sees it: pending, or running at `ip`.
    fn pod(id: &str, ip: Option<&str>) -> Pod {
        let status = match ip {
            Some(ip) => serde_json::json!({
                "phase": "Running",
                "podIP": ip,
                "containerStatuses": [{"name": "task", "image": "busybox", "imageID": "", "ready": true,
                    "restartCount": 0, "state": {"running": {}}}],
            }),
            None => serde_json::json!({
                "phase": "Pending",
                "containerStatuses": [{"name": "task", "image": "busybox", "imageID": "", "ready": false,
                    "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}],
            }),
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("sandman-{id}"), "labels": {"sandman.dev/sandbox": id, "sandman.dev/job": "j"}},
            "spec": {"containers": [{"name": "task", "image": "busybox"}], "nodeName": "node-1"},
            "status": status,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Regression: the provider kept every sandbox pod whole in a reflector store (kilobytes
    /// each), and its maps at the size of the largest burst after it was released.
    #[test]
    fn a_released_burst_leaves_no_slot_and_gives_its_room_back() {
        let tracker = Tracker::default();
        let n = 5000;
        for i in 0..n {
            let id = format!("s{i:05}");
            let rx = tracker.begin_create(&id, Some("j".into()));
            tracker.apply(&pod(&id, None), Seen::Live);
            tracker.apply(&pod(&id, Some("10.0.0.1")), Seen::Live);
            assert_eq!(*rx.borrow(), PodState::Ready { ip: "10.0.0.1".into() }, "the create sees its pod run");
            tracker.end_create(&id, true);
        }
        assert_eq!(tracker.tracked(), n);
        assert_eq!(tracker.present(), n);
        let held = tracker.capacity();
        assert!(held >= n);
        {
            let slots = tracker.slots();
            for (id, slot) in slots.iter() {
                assert!(slot.waiter.is_none(), "{id}: a finished create left its channel");
                assert!(slot.seen.is_none(), "{id}: a running pod kept its description");
            }
        }
        tracker.mark_job_deleting("j");
        for i in 0..n {
            let id = format!("s{i:05}");
            assert_eq!(tracker.deleted(&pod(&id, Some("10.0.0.1"))), None, "a release is no news");
        }
        assert_eq!(tracker.tracked(), 0);
        assert!(
            tracker.capacity() <= 2 * MIN_SLOTS_CAPACITY,
            "the map kept room for {} slots after the burst of {n} was gone (it had {held})",
            tracker.capacity()
        );
    }

    /// A slot is a few words: a pod (kilobytes once parsed) never goes into one.
    #[test]
    fn a_slot_holds_no_pod() {
        assert!(size_of::<Slot>() <= 128, "a slot is {} bytes", size_of::<Slot>());
        let tracker = Tracker::default();
        let _rx = tracker.begin_create("s1", None);
        tracker.apply(&pod("s1", None), Seen::Live);
        let (state, seen) = tracker.state("s1").unwrap_or_else(|| panic!("not tracked"));
        assert_eq!(state, PodState::Pending);
        assert_eq!(seen.as_deref(), Some("Pending, container `task` ContainerCreating"));
    }

    /// A relist that no longer names a pod reports it gone and forgets it.
    #[test]
    fn a_relist_reports_the_pods_it_no_longer_lists_and_forgets_them() {
        let tracker = Tracker::default();
        for i in 0..200 {
            tracker.apply(&pod(&format!("s{i}"), Some("10.0.0.1")), Seen::Listed);
        }
        let listed: HashSet<String> = (0..100).map(|i| format!("s{i}")).collect();
        let news = tracker.relisted(&listed);
        assert_eq!(news.len(), 100, "the pods not listed again are gone");
        assert_eq!(tracker.tracked(), 100);
    }
}

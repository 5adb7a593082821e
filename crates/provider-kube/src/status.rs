//! A pod's status mapped onto the sandbox lifecycle: [`classify`] reads the phase, conditions,
//! container states and deletion of one pod and says whether it is still coming up, ready
//! (running, with an IP), unschedulable, or ended with which [`Reason`] and message.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod, PodCondition};
use sandman_provider::Ended;
use sandman_wire::server::Reason;

use crate::pod::{INIT_CONTAINER, TASK_CONTAINER};

/// Exit code with which `sandmand` reports that its lease lapsed.
const EXIT_LEASE_EXPIRED: i32 = 3;

/// Waiting reasons of a container whose image cannot be had.
const PULL_FAILURES: [&str; 7] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "ImageInspectError",
    "RegistryUnavailable",
    "SignatureValidationFailed",
];

/// Waiting reasons of a container that cannot be started (its image is there).
const START_FAILURES: [&str; 4] =
    ["CreateContainerError", "CreateContainerConfigError", "RunContainerError", "StartError"];

/// Where a sandbox pod is, as far as the provider cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodState {
    /// Not running yet: being scheduled, pulling, initialising, starting.
    Pending,
    /// The scheduler found no node (its message). May clear: an autoscaler adds a node, a
    /// preemption makes room.
    Unschedulable(String),
    /// Running, with an IP: the daemon can be reached (once it listens).
    Ready { ip: String },
    /// It will never run (again).
    Ended(Ended),
    /// The daemon itself exited (neither OOM-killed nor unable to start): before the sandbox was
    /// ready that is `daemon_start_failed`, after it the reason given here.
    Exited(Ended),
}

impl PodState {
    pub fn ended(&self) -> Option<&Ended> {
        match self {
            PodState::Ended(e) | PodState::Exited(e) => Some(e),
            _ => None,
        }
    }

    pub fn is_ended(&self) -> bool {
        self.ended().is_some()
    }
}

fn ended(reason: Reason, message: String) -> PodState {
    PodState::Ended(Ended { reason, message })
}

/// Maps one pod onto the lifecycle. Failures are surfaced as soon as the status shows them:
/// a pull error at its first `ErrImagePull`, not after the back-off gives up.
pub fn classify(pod: &Pod) -> PodState {
    let Some(status) = pod.status.as_ref() else { return PodState::Pending };
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let message = status.message.as_deref().unwrap_or("").trim();
    let init = container(status.init_container_statuses.as_deref(), INIT_CONTAINER);
    let task = container(status.container_statuses.as_deref(), TASK_CONTAINER);

    // Ended by the kubelet, whatever else the pod shows.
    match status.reason.as_deref() {
        Some("Evicted") => return ended(Reason::Evicted, with_detail("the kubelet evicted the pod", message)),
        Some("DeadlineExceeded") => {
            let deadline = pod.spec.as_ref().and_then(|s| s.active_deadline_seconds);
            let what = match deadline {
                Some(s) => format!("the pod outlived its activeDeadlineSeconds ({s} s, the sandbox's ttl)"),
                None => "the pod outlived its activeDeadlineSeconds".to_string(),
            };
            return ended(Reason::TtlExpired, what);
        }
        _ => {}
    }
    for (which, c) in [("task", task), ("init", init)] {
        if let Some(c) = c
            && terminated_reason(c) == Some("OOMKilled")
        {
            let limit = memory_limit(pod, &c.name).map(|l| format!(" (memory limit {l})")).unwrap_or_default();
            let whose = if which == "task" { "the sandbox" } else { "the daemon's init container" };
            return ended(Reason::OomKilled, format!("{whose} ran out of memory and was OOM-killed{limit}"));
        }
    }
    if let Some(state) = disruption(pod) {
        return state;
    }

    // The daemon could not be put in place or started.
    if let Some(c) = init {
        if let Some(t) = c.state.as_ref().and_then(|s| s.terminated.as_ref())
            && t.exit_code != 0
        {
            return ended(
                Reason::DaemonStartFailed,
                with_detail(
                    &format!(
                        "the daemon's init container `{}` failed (exit {}, {})",
                        c.name,
                        t.exit_code,
                        t.reason.as_deref().unwrap_or("Error")
                    ),
                    t.message.as_deref().unwrap_or(""),
                ),
            );
        }
        if let Some(state) = waiting_failure(c, "the daemon image") {
            return state;
        }
    }
    if let Some(c) = task {
        if let Some(t) = c.state.as_ref().and_then(|s| s.terminated.as_ref()) {
            let reason = t.reason.as_deref().unwrap_or("Error");
            let detail = t.message.as_deref().unwrap_or("");
            if START_FAILURES.contains(&reason) || reason == "ContainerCannotRun" {
                return ended(
                    Reason::DaemonStartFailed,
                    with_detail(&format!("the daemon could not be started in image `{}` ({reason})", c.image), detail),
                );
            }
            if t.exit_code == EXIT_LEASE_EXPIRED {
                return PodState::Exited(Ended {
                    reason: Reason::LeaseExpired,
                    message: "the daemon's lease lapsed: no call reached it in time".into(),
                });
            }
            let how = match t.exit_code {
                0 => "the daemon stopped (exit 0)".to_string(),
                code if code > 128 => format!("the daemon was killed by signal {} (exit {code}, {reason})", code - 128),
                code => format!("the daemon exited with status {code} ({reason})"),
            };
            return PodState::Exited(Ended { reason: Reason::ProviderError, message: with_detail(&how, detail) });
        }
        if let Some(state) = waiting_failure(c, "image") {
            return state;
        }
    }
    match phase {
        "Failed" => return ended(Reason::ProviderError, with_detail("the pod failed", message)),
        "Succeeded" => return ended(Reason::ProviderError, "the pod's containers all exited".into()),
        _ => {}
    }

    if let Some(c) = condition(pod, "PodScheduled")
        && c.status == "False"
        && c.reason.as_deref() == Some("Unschedulable")
        && status.nominated_node_name.is_none()
    {
        return PodState::Unschedulable(c.message.clone().unwrap_or_else(|| "no node can run the pod".into()));
    }
    let running = task.and_then(|c| c.state.as_ref()).is_some_and(|s| s.running.is_some());
    match status.pod_ip.as_deref() {
        Some(ip) if phase == "Running" && running && !ip.is_empty() => PodState::Ready { ip: ip.to_string() },
        _ => PodState::Pending,
    }
}

/// A pod being deleted: by whom, from its `DisruptionTarget` condition. Only called for a
/// deletion the provider did not ask for.
fn disruption(pod: &Pod) -> Option<PodState> {
    pod.metadata.deletion_timestamp.as_ref()?;
    let cond = condition(pod, "DisruptionTarget").filter(|c| c.status == "True");
    let detail = cond.and_then(|c| c.message.as_deref()).unwrap_or("");
    Some(match cond.and_then(|c| c.reason.as_deref()) {
        Some(r @ ("DeletionByTaintManager" | "DeletionByPodGC")) => {
            ended(Reason::NodeLost, with_detail(&format!("the pod's node was lost ({r})"), detail))
        }
        Some(r @ ("EvictionByEvictionAPI" | "PreemptionByScheduler" | "TerminationByKubelet")) => {
            ended(Reason::Evicted, with_detail(&format!("the pod was evicted ({r})"), detail))
        }
        _ => ended(Reason::ProviderError, "the pod was deleted by someone other than sandman".into()),
    })
}

/// A container waiting for an image it cannot have, or unable to start.
fn waiting_failure(c: &ContainerStatus, whose: &str) -> Option<PodState> {
    let w = c.state.as_ref()?.waiting.as_ref()?;
    let reason = w.reason.as_deref()?;
    let detail = w.message.as_deref().unwrap_or("");
    if PULL_FAILURES.contains(&reason) {
        return Some(ended(
            Reason::ImagePullFailed,
            with_detail(&format!("cannot pull {whose} `{}` ({reason})", c.image), detail),
        ));
    }
    if START_FAILURES.contains(&reason) {
        return Some(ended(
            Reason::DaemonStartFailed,
            with_detail(&format!("cannot start container `{}` ({reason})", c.name), detail),
        ));
    }
    None
}

fn with_detail(what: &str, detail: &str) -> String {
    let detail = detail.trim();
    if detail.is_empty() { what.to_string() } else { format!("{what}: {detail}") }
}

fn container<'a>(statuses: Option<&'a [ContainerStatus]>, name: &str) -> Option<&'a ContainerStatus> {
    statuses?.iter().find(|c| c.name == name)
}

fn terminated_reason(c: &ContainerStatus) -> Option<&str> {
    let now = c.state.as_ref().and_then(|s| s.terminated.as_ref());
    let before = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
    now.or(before).and_then(|t| t.reason.as_deref())
}

fn condition<'a>(pod: &'a Pod, kind: &str) -> Option<&'a PodCondition> {
    pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == kind)
}

fn memory_limit(pod: &Pod, container: &str) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let all = spec.containers.iter().chain(spec.init_containers.iter().flatten());
    let c = all.into_iter().find(|c| c.name == container)?;
    c.resources.as_ref()?.limits.as_ref()?.get("memory").map(|q| q.0.clone())
}

/// Where the pod of a [`crate::prepare`] pull is: the image on its node or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullState {
    /// Still pulling (or waiting for the daemon's init container).
    Pending,
    /// The image is on the node: its container started, or ran and exited 0. `image_id` is the
    /// digest the runtime resolved, when the status names it.
    Pulled { image_id: Option<String> },
    /// It will not get there, and why.
    Failed(String),
}

/// Reads the pod of a pull: the same classification as sandbox pods (pull and start failures
/// by their waiting reasons, at the first `ErrImagePull`), for container `name`.
pub fn pull_state(pod: &Pod, name: &str) -> PullState {
    let Some(status) = pod.status.as_ref() else { return PullState::Pending };
    let init = container(status.init_container_statuses.as_deref(), INIT_CONTAINER);
    let pull = container(status.container_statuses.as_deref(), name);
    if let Some(c) = init {
        if let Some(t) = c.state.as_ref().and_then(|s| s.terminated.as_ref())
            && t.exit_code != 0
        {
            let what = format!("the daemon's init container failed (exit {})", t.exit_code);
            return PullState::Failed(with_detail(&what, t.message.as_deref().unwrap_or("")));
        }
        if let Some(PodState::Ended(e)) = waiting_failure(c, "the daemon image") {
            return PullState::Failed(e.message);
        }
    }
    if let Some(c) = pull {
        let image_id = Some(c.image_id.clone()).filter(|i| !i.is_empty());
        let state = c.state.as_ref();
        if state.is_some_and(|s| s.running.is_some()) {
            return PullState::Pulled { image_id };
        }
        if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
            let reason = t.reason.as_deref().unwrap_or("Error");
            let detail = t.message.as_deref().unwrap_or("");
            return match t.exit_code {
                0 => PullState::Pulled { image_id },
                _ if START_FAILURES.contains(&reason) || reason == "ContainerCannotRun" => {
                    PullState::Failed(with_detail(
                        &format!("`{}` is on the node, but the daemon cannot start in it ({reason})", c.image),
                        detail,
                    ))
                }
                code => PullState::Failed(with_detail(
                    &format!("`{}` is on the node, but the daemon exited {code} in it ({reason})", c.image),
                    detail,
                )),
            };
        }
        if let Some(PodState::Ended(e)) = waiting_failure(c, "image") {
            return PullState::Failed(e.message);
        }
    }
    match status.phase.as_deref() {
        Some("Succeeded") => PullState::Pulled { image_id: None },
        Some("Failed") => {
            let why = status.reason.as_deref().unwrap_or("the pod failed");
            PullState::Failed(with_detail(why, status.message.as_deref().unwrap_or("")))
        }
        _ => PullState::Pending,
    }
}

/// One line on where a pending pod is, for a timeout's message.
pub fn describe(pod: &Pod) -> String {
    let Some(status) = pod.status.as_ref() else { return "not yet seen by the scheduler".into() };
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let statuses = status.init_container_statuses.iter().flatten().chain(status.container_statuses.iter().flatten());
    for c in statuses {
        if let Some(w) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) {
            let reason = w.reason.as_deref().unwrap_or("waiting");
            return with_detail(
                &format!("{phase}, container `{}` {reason}", c.name),
                w.message.as_deref().unwrap_or(""),
            );
        }
    }
    if pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none() {
        return format!("{phase}, not scheduled yet");
    }
    phase.to_string()
}

//! The pod-status-to-reason mapping, on the real pod documents recorded from a v1.36.2 API server
//! and kubelet (`tests/fixtures/`): every failure mode the recordings show maps to its reason.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use common::{json, pod};
use sandman_provider_kube::status::{PodState, PullState, classify, pull_state};
use sandman_wire::server::Reason;

/// The reason and message of an ended state, or a panic naming what it was instead.
fn ended(name: &str) -> (Reason, String) {
    match classify(&pod(name)) {
        PodState::Ended(e) | PodState::Exited(e) => (e.reason, e.message),
        other => panic!("{name}: expected an ended pod, got {other:?}"),
    }
}

#[test]
fn pods_coming_up_are_pending_and_a_running_pod_with_an_ip_is_ready() {
    assert_eq!(classify(&pod("pod-create-201.json")), PodState::Pending);
    assert_eq!(classify(&pod("status-init-running.json")), PodState::Pending);
    assert_eq!(classify(&pod("pod-running-ready.json")), PodState::Ready { ip: "10.244.0.26".into() });
}

#[test]
fn pull_errors_are_image_pull_failed_with_the_kubelets_message_at_the_first_error() {
    let (reason, message) = ended("status-errimagepull.json");
    assert_eq!(reason, Reason::ImagePullFailed);
    assert!(message.contains("`nonexistent.invalid/task:1` (ErrImagePull)"), "{message}");
    assert!(message.contains("lookup nonexistent.invalid on 10.255.255.53:53: no such host"), "{message}");
    let (reason, message) = ended("status-imagepullbackoff.json");
    assert_eq!(reason, Reason::ImagePullFailed);
    assert!(message.contains("Back-off pulling image"), "{message}");
}

#[test]
fn an_unschedulable_pod_carries_the_schedulers_message() {
    let PodState::Unschedulable(message) = classify(&pod("status-unschedulable.json")) else {
        panic!("not unschedulable")
    };
    assert!(message.starts_with("0/1 nodes are available: 1 Insufficient cpu."), "{message}");
    // A preemption under way: the pod waits for its nominated node.
    let mut nominated = json("status-unschedulable.json");
    nominated["status"]["nominatedNodeName"] = "vm".into();
    let nominated = serde_json::from_value(nominated).unwrap();
    assert_eq!(classify(&nominated), PodState::Pending);
}

#[test]
fn oom_kills_name_the_memory_limit() {
    let (reason, message) = ended("status-oomkilled.json");
    assert_eq!(reason, Reason::OomKilled);
    assert_eq!(message, "the sandbox ran out of memory and was OOM-killed (memory limit 16Mi)");
}

#[test]
fn the_active_deadline_is_the_ttl() {
    let (reason, message) = ended("status-deadline-exceeded.json");
    assert_eq!(reason, Reason::TtlExpired);
    assert!(message.contains("activeDeadlineSeconds (3 s"), "{message}");
}

#[test]
fn a_daemon_that_cannot_start_is_daemon_start_failed() {
    let (reason, message) = ended("status-init-container-failed.json");
    assert_eq!(reason, Reason::DaemonStartFailed);
    assert!(message.starts_with("the daemon's init container `sandman-init` failed (exit 1, Error)"), "{message}");
    let (reason, message) = ended("status-start-error-command-not-found.json");
    assert_eq!(reason, Reason::DaemonStartFailed);
    assert!(message.contains("(StartError)") && message.contains("/no/such/daemon"), "{message}");
}

#[test]
fn daemon_exits_are_reported_as_exits_and_exit_3_is_its_lease() {
    let exited = |name: &str| match classify(&pod(name)) {
        PodState::Exited(e) => (e.reason, e.message),
        other => panic!("{name}: expected the daemon's exit, got {other:?}"),
    };
    assert_eq!(exited("status-failed-exit-3.json").0, Reason::LeaseExpired);
    let (reason, message) = exited("status-daemon-exit-127.json");
    assert_eq!(reason, Reason::ProviderError);
    assert_eq!(message, "the daemon exited with status 127 (Error)");
    assert_eq!(exited("status-succeeded.json").1, "the daemon stopped (exit 0)");
}

#[test]
fn deletions_nobody_asked_for_say_by_whom() {
    for name in ["status-deleted-during-init-terminating.json", "status-deleted-during-init-failed.json"] {
        let (reason, message) = ended(name);
        assert_eq!(reason, Reason::ProviderError, "{name}");
        assert_eq!(message, "the pod was deleted by someone other than sandman", "{name}");
    }
    let (reason, message) = ended("status-node-lost-taint-eviction.json");
    assert_eq!(reason, Reason::NodeLost);
    assert!(message.contains("DeletionByTaintManager") && message.contains("NoExecute taint"), "{message}");
}

#[test]
fn an_evicted_pod_is_evicted() {
    // No eviction was recorded; this is the kubelet's node-pressure eviction written on the
    // recorded running pod, as the kubelet writes it.
    let mut evicted = json("pod-running-ready.json");
    evicted["status"]["phase"] = "Failed".into();
    evicted["status"]["reason"] = "Evicted".into();
    evicted["status"]["message"] = "The node was low on resource: memory.".into();
    let (reason, message) = match classify(&serde_json::from_value(evicted).unwrap()) {
        PodState::Ended(e) => (e.reason, e.message),
        other => panic!("{other:?}"),
    };
    assert_eq!(reason, Reason::Evicted);
    assert_eq!(message, "the kubelet evicted the pod: The node was low on resource: memory.");
    let mut preempted = json("status-node-lost-taint-eviction.json");
    preempted["status"]["conditions"][5]["reason"] = "PreemptionByScheduler".into();
    let state = classify(&serde_json::from_value(preempted).unwrap());
    assert_eq!(state.ended().map(|e| e.reason), Some(Reason::Evicted));
}

#[test]
fn the_recorded_list_of_mixed_states_maps_like_each_pod_alone() {
    let list = json("pod-list-mixed-states.json");
    let reasons: Vec<(String, Option<Reason>)> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(p.clone()).unwrap();
            let state = classify(&pod);
            (pod.metadata.name.unwrap(), state.ended().map(|e| e.reason))
        })
        .collect();
    let want = [
        ("sandman-sbx-0002", None),
        ("sandman-sbx-applet", Some(Reason::ProviderError)),
        ("sandman-sbx-deadline", Some(Reason::TtlExpired)),
        ("sandman-sbx-exit3", Some(Reason::LeaseExpired)),
        ("sandman-sbx-imgpull", Some(Reason::ImagePullFailed)),
        ("sandman-sbx-initfail", Some(Reason::DaemonStartFailed)),
        ("sandman-sbx-nocmd", Some(Reason::DaemonStartFailed)),
        ("sandman-sbx-oom", Some(Reason::OomKilled)),
        ("sandman-sbx-succeeded", Some(Reason::ProviderError)),
        ("sandman-sbx-unsched", None),
    ];
    let want: Vec<(String, Option<Reason>)> = want.iter().map(|(n, r)| (n.to_string(), *r)).collect();
    assert_eq!(reasons, want);
}

/// A pull of `prepare` read from the recorded pods, their main container taken as the pull's.
fn pull(name: &str) -> PullState {
    pull_state(&pod(name), "task")
}

#[test]
fn a_pull_is_done_once_its_container_started_or_succeeded_and_failed_by_the_same_reasons() {
    let digest = Some("sha256:c0966323d8fdf2e5ca2a03565cd3bd6d24d9d19a25e2c4aeb1f7005767e4adba".to_string());
    assert_eq!(pull("pod-create-201.json"), PullState::Pending);
    assert_eq!(pull("status-init-running.json"), PullState::Pending);
    assert_eq!(pull("pod-running-ready.json"), PullState::Pulled { image_id: digest.clone() });
    assert_eq!(pull("status-succeeded.json"), PullState::Pulled { image_id: digest });
    for (name, says) in [
        ("status-errimagepull.json", "(ErrImagePull): failed to pull and unpack"),
        ("status-imagepullbackoff.json", "(ImagePullBackOff)"),
        ("status-start-error-command-not-found.json", "the daemon cannot start in it (StartError)"),
        ("status-failed-exit-3.json", "the daemon exited 3 in it"),
        ("status-init-container-failed.json", "the daemon's init container failed (exit 1)"),
        ("status-deadline-exceeded.json", "exited 137"),
    ] {
        match pull(name) {
            PullState::Failed(m) => assert!(m.contains(says), "{name}: `{m}` does not say `{says}`"),
            other => panic!("{name}: {other:?}"),
        }
    }
}

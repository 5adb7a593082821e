//! What the provider reports it applied ([`applied::applied`]), read from recorded pods: the
//! recorded Burstable pod as the API server returned it, and an eval pod as this provider builds
//! it, given the status the API server and kubelet recorded.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use common::json;
use k8s_openapi::api::core::v1::Pod;
use sandman_provider::conformance::spec;
use sandman_provider_kube::KubeConfig;
use sandman_provider_kube::applied::applied;
use sandman_provider_kube::pod::build_pod;
use sandman_wire::server::{Profile, Quantity, Resources};
use serde_json::{Value, json as j};

/// The digest the recording's runtime resolved `busybox:local` to.
const IMAGE_ID: &str = "sha256:c0966323d8fdf2e5ca2a03565cd3bd6d24d9d19a25e2c4aeb1f7005767e4adba";

fn config() -> KubeConfig {
    KubeConfig { namespace: "sandman-fixtures".into(), pod_pids_limit: Some(1024), ..KubeConfig::default() }
}

#[test]
fn the_recorded_burstable_pod() {
    let pod: Pod = serde_json::from_value(json("pod-running-ready.json")).unwrap();
    let a = applied(&pod, &config());
    assert_eq!(a.image.as_deref(), Some(IMAGE_ID), "the digest that runs, not the tag");
    assert_eq!(a.cpu, Some(1.0));
    assert_eq!(a.memory, Some(256 * 1024 * 1024));
    assert_eq!(a.swap, None, "a Burstable pod may be given swap");
    assert_eq!(a.pids, Some(1024));
    assert_eq!(a.network.as_deref(), Some("egress"));
    assert_eq!((a.timezone, a.locale), (None, None));
    assert_eq!(a.details["qosClass"], "Burstable");
    assert_eq!(a.details["nodeName"], "vm");
    assert_eq!(a.details["uid"], "0292c379-16d0-4bdb-b9b5-5d0914c57894");
    assert_eq!(a.details["resourceVersion"], "854");
    assert_eq!(a.details["runtimeClassName"], Value::Null);
    assert_eq!(a.details["requests"], j!({"cpu": "100m", "memory": "64Mi"}));
    assert_eq!(a.details["limits"], j!({"cpu": "1", "memory": "256Mi"}));
    assert_eq!(a.details["imageRef"], "busybox:local");
    assert_eq!(a.details["pidsScope"], "pod");
    // Without a declared podPidsLimit there is no pids limit to report.
    let a = applied(&pod, &KubeConfig::default());
    assert_eq!(a.pids, None);
    assert!(!a.details.contains_key("pidsScope"));
}

/// An eval pod as built, as the API server stores it once running: the recorded running pod's
/// metadata and status, its QoS class Guaranteed, its container status reporting the limits.
fn running_eval_pod() -> Pod {
    let mut s = spec("sbx-eval", "busybox:local");
    s.profile = Profile::Eval;
    s.resources = Resources {
        cpu: Some(Quantity::Text("500m".into())),
        memory: Some(Quantity::Text("512Mi".into())),
        ..Resources::default()
    };
    let built = serde_json::to_value(build_pod(&s, &config()).unwrap()).unwrap();
    let recorded = json("pod-running-ready.json");
    let mut pod = built.clone();
    for k in ["uid", "resourceVersion", "creationTimestamp"] {
        pod["metadata"][k] = recorded["metadata"][k].clone();
    }
    pod["spec"]["nodeName"] = "vm".into();
    pod["status"] = recorded["status"].clone();
    pod["status"]["qosClass"] = "Guaranteed".into();
    let limits = built["spec"]["containers"][0]["resources"].clone();
    pod["status"]["containerStatuses"][0]["resources"] = limits;
    serde_json::from_value(pod).unwrap()
}

#[test]
fn an_eval_pod_reports_what_its_daemon_will_observe() {
    let a = applied(&running_eval_pod(), &config());
    assert_eq!(a.cpu, Some(0.5));
    assert_eq!(a.memory, Some(512 * 1024 * 1024));
    assert_eq!(a.swap, Some(0), "the kubelet gives no swap to a Guaranteed pod");
    assert_eq!(a.pids, Some(1024));
    assert_eq!(a.network.as_deref(), Some("policy"), "cut off by the NetworkPolicy; its interfaces remain");
    assert_eq!(a.timezone.as_deref(), Some("UTC"));
    assert_eq!(a.locale.as_deref(), Some("C.UTF-8"));
    assert_eq!(a.image.as_deref(), Some(IMAGE_ID));
    assert_eq!(a.details["qosClass"], "Guaranteed");
    assert_eq!(a.details["requests"], a.details["limits"]);
    assert!(a.details["networkPolicy"].as_str().unwrap().contains("sandman-network-none"));
}

#[test]
fn the_limits_the_kubelet_reports_win_over_the_spec() {
    // Resized in place (or adjusted by the node): the record states what was applied.
    let mut pod = serde_json::to_value(running_eval_pod()).unwrap();
    pod["status"]["containerStatuses"][0]["resources"]["limits"] = j!({"cpu": "250m", "memory": "256Mi"});
    let a = applied(&serde_json::from_value(pod).unwrap(), &config());
    assert_eq!((a.cpu, a.memory), (Some(0.25), Some(256 * 1024 * 1024)));
}

#[test]
fn a_pod_not_yet_started_names_the_reference_asked_for_and_no_swap() {
    // The recorded create answer: Pending, no node, no container status.
    let pod: Pod = serde_json::from_value(json("pod-create-201.json")).unwrap();
    let a = applied(&pod, &config());
    assert_eq!(a.image.as_deref(), Some("busybox:local"));
    assert_eq!(a.cpu, Some(1.0));
    assert_eq!(a.swap, None);
    assert_eq!(a.details["nodeName"], Value::Null);
}

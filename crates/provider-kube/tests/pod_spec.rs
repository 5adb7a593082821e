//! The sandbox pod, snapshot-tested: each case's pod (or Secret, or NetworkPolicy) is compared
//! with `tests/snapshots/<case>.json`. After an intended change, regenerate them with
//! `SANDMAN_BLESS=1 cargo test -p sandman-provider-kube --test pod_spec` and review the diff.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, Toleration};
use sandman_provider::conformance::spec;
use sandman_provider::{ProviderError, SandboxSpec};
use sandman_provider_kube::pod::{self, build_pod, build_secret};
use sandman_provider_kube::prepare;
use sandman_provider_kube::{Injection, KubeConfig, PullPolicy, TokenDelivery, network_none_policy};
use sandman_wire::server::{Network, Profile, Quantity, Resources};
use serde_json::Value;

fn assert_snapshot(case: &str, value: &impl serde::Serialize) {
    let actual = serde_json::to_value(value).unwrap();
    let path = format!("{}/tests/snapshots/{case}.json", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("SANDMAN_BLESS").is_some() {
        std::fs::create_dir_all(format!("{}/tests/snapshots", env!("CARGO_MANIFEST_DIR"))).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&actual).unwrap() + "\n").unwrap();
        return;
    }
    let expected: Value = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).unwrap(),
        Err(e) => panic!("no snapshot {path} ({e}); create it with SANDMAN_BLESS=1 and review it"),
    };
    assert!(
        actual == expected,
        "{case} differs from its snapshot {path}\n--- actual ---\n{}\n(regenerate with SANDMAN_BLESS=1 if intended)",
        serde_json::to_string_pretty(&actual).unwrap()
    );
}

fn config() -> KubeConfig {
    KubeConfig {
        namespace: "sandman-fixtures".into(),
        daemon_image: "registry.example/sandmand:0.1.0".into(),
        ..KubeConfig::default()
    }
}

/// A sandbox as the server would ask for it: an id like the server's, a job, a ttl.
fn sandbox() -> SandboxSpec {
    let mut s = spec("sb-0123456789ab", "python:3.12-slim");
    s.job = Some("job-a".into());
    s.resources = Resources {
        cpu: Some(Quantity::Number(0.5)),
        memory: Some(Quantity::Text("512Mi".into())),
        ..Resources::default()
    };
    s.env.insert("PYTHONUNBUFFERED".into(), "1".into());
    s.env.insert("SANDMAN_TOKEN".into(), "not-for-the-pod".into());
    s
}

fn eval_sandbox() -> SandboxSpec {
    let mut s = sandbox();
    s.id = "sb-eval00000001".into();
    s.profile = Profile::Eval;
    s.resources = Resources {
        cpu: Some(Quantity::Number(2.0)),
        memory: Some(Quantity::Text("4Gi".into())),
        disk: Some(Quantity::Text("10Gi".into())),
        pids: None,
    };
    s
}

fn json_of(pod: &Pod) -> String {
    serde_json::to_string(pod).unwrap()
}

#[test]
fn the_default_pod() {
    let pod = build_pod(&sandbox(), &config()).unwrap();
    assert_snapshot("pod-default", &pod);
}

/// The provider's config with the nodes' podPidsLimit declared, as eval needs.
fn eval_config() -> KubeConfig {
    KubeConfig { pod_pids_limit: Some(1024), ..config() }
}

#[test]
fn the_eval_pod_is_guaranteed_and_cut_off() {
    let pod = build_pod(&eval_sandbox(), &eval_config()).unwrap();
    assert_snapshot("pod-eval", &pod);
    let spec = pod.spec.as_ref().unwrap();
    for c in spec.containers.iter().chain(spec.init_containers.iter().flatten()) {
        let r = c.resources.as_ref().unwrap();
        for what in ["cpu", "memory"] {
            let request = r.requests.as_ref().and_then(|m| m.get(what));
            assert!(request.is_some(), "{}: no {what} request", c.name);
            assert_eq!(request, r.limits.as_ref().and_then(|m| m.get(what)), "{}: {what} request != limit", c.name);
        }
    }
    let labels = pod.metadata.labels.as_ref().unwrap();
    assert_eq!(labels.get("sandman.dev/network").map(String::as_str), Some("none"));
    let env: BTreeMap<String, String> = spec.containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect();
    assert_eq!(env.get("TZ").map(String::as_str), Some("UTC"));
    assert_eq!(env.get("LC_ALL").map(String::as_str), Some("C.UTF-8"));
    assert_eq!(env.get("LANG").map(String::as_str), Some("C.UTF-8"));
    // What the kubelet adds anyway stays away from the commands.
    let args = spec.containers[0].args.clone().unwrap_or_default();
    assert!(args.windows(2).any(|w| w == ["--drop-env", "KUBERNETES_"]), "{args:?}");
    // The reference is the one asked for: Kubernetes resolves it when the pod starts, and the
    // record names the digest it ran (the container status's imageID).
    assert_eq!(spec.containers[0].image.as_deref(), Some("python:3.12-slim"));
}

#[test]
fn the_eval_environment_wins_over_the_asked_one() {
    let mut s = eval_sandbox();
    s.env.insert("TZ".into(), "Europe/Paris".into());
    s.env.insert("LANG".into(), "fr_FR.UTF-8".into());
    let pod = build_pod(&s, &eval_config()).unwrap();
    let env = &pod.spec.as_ref().unwrap().containers[0].env;
    let get = |k: &str| env.iter().flatten().find(|e| e.name == k).and_then(|e| e.value.clone());
    assert_eq!(get("TZ").as_deref(), Some("UTC"));
    assert_eq!(get("LANG").as_deref(), Some("C.UTF-8"));
}

#[test]
fn eval_is_refused_where_its_pids_limit_is_unknown_or_not_the_asked_one() {
    let refused = |s: &SandboxSpec, config: &KubeConfig| match pod::check(s, config) {
        Err(ProviderError::Unsupported(m)) => m,
        other => panic!("not refused: {other:?}"),
    };
    // No declared podPidsLimit: eval cannot state its pids limit.
    let m = refused(&eval_sandbox(), &config());
    assert!(m.contains("podPidsLimit") && m.contains("pod_pids_limit"), "{m}");
    assert!(build_pod(&eval_sandbox(), &config()).is_err(), "build_pod must refuse what check refuses");
    // Declared, and asked for the same: fine; asked for another: both named.
    let mut s = eval_sandbox();
    s.resources.pids = Some(1024);
    pod::check(&s, &eval_config()).unwrap();
    s.resources.pids = Some(256);
    let m = refused(&s, &eval_config());
    assert!(m.contains("256") && m.contains("1024") && m.contains("podPidsLimit"), "{m}");
    // The default profile may ask for the declared limit too, and no other.
    let mut s = sandbox();
    s.resources.pids = Some(1024);
    pod::check(&s, &eval_config()).unwrap();
    assert!(refused(&s, &config()).contains("pod_pids_limit"));
    // The default profile needs none.
    pod::check(&sandbox(), &config()).unwrap();
}

#[test]
fn an_eval_cpu_limit_the_kubelet_would_raise_is_refused() {
    let refused = |s: &SandboxSpec| match pod::check(s, &eval_config()) {
        Err(ProviderError::Unsupported(m)) => m,
        other => panic!("not refused: {other:?}"),
    };
    let mut s = eval_sandbox();
    // Memory in any unit: the kernel rounds it down by less than a page, which is allowed for.
    s.resources.memory = Some(Quantity::Text("1G".into()));
    pod::check(&s, &eval_config()).unwrap();
    s.resources.cpu = Some(Quantity::Text("5m".into()));
    assert!(refused(&s).contains("10m"));
    s.resources.cpu = Some(Quantity::Text("10m".into()));
    pod::check(&s, &eval_config()).unwrap();
    // The default profile sets no cpu limit.
    let mut s = sandbox();
    s.resources.cpu = Some(Quantity::Text("5m".into()));
    pod::check(&s, &config()).unwrap();
}

#[test]
fn the_host_path_pod_with_every_option() {
    let mut config = config();
    config.injection = Injection::HostPath { path: "/opt/sandman".into() };
    config.token = TokenDelivery::PodAnnotation;
    config.image_pull_policy = Some(PullPolicy::IfNotPresent);
    config.runtime_class = Some("gvisor".into());
    config.priority_class = Some("sandman-sandbox".into());
    config.scheduler_name = Some("sandman-fake-scheduler".into());
    config.service_account = Some("sandman-sandbox".into());
    config.node_selector = BTreeMap::from([("sandman.dev/pool".into(), "sandboxes".into())]);
    config.tolerations = vec![Toleration {
        key: Some("sandman.dev/pool".into()),
        operator: Some("Equal".into()),
        value: Some("sandboxes".into()),
        effect: Some("NoSchedule".into()),
        toleration_seconds: None,
    }];
    config.image_pull_secrets = vec!["regcred".into()];
    config.pod_labels = BTreeMap::from([("team".into(), "rl".into())]);
    config.pod_annotations =
        BTreeMap::from([("cluster-autoscaler.kubernetes.io/safe-to-evict".into(), "false".into())]);
    config.node_lost_after_s = None;
    config.termination_grace_s = 5;
    let mut s = sandbox();
    s.server.ttl_s = None;
    s.network = Network::None;
    s.resources = Resources::default();
    config.default_deadline_s = Some(86_400);
    let pod = build_pod(&s, &config).unwrap();
    assert_snapshot("pod-hostpath-annotation-token", &pod);
    assert!(pod.spec.as_ref().unwrap().init_containers.is_none());
}

#[test]
fn the_image_volume_pod() {
    let config = KubeConfig { injection: Injection::ImageVolume, ..config() };
    let pod = build_pod(&sandbox(), &config).unwrap();
    assert_snapshot("pod-image-volume", &pod);
}

#[test]
fn the_token_secret_and_the_network_policy() {
    let secret = build_secret(&sandbox(), &config(), "0292c379-16d0-4bdb-b9b5-5d0914c57894");
    assert_snapshot("secret", &secret);
    assert_snapshot("networkpolicy-network-none", &network_none_policy(&config()));
}

#[test]
fn the_token_never_appears_in_the_pod_with_a_secret() {
    let s = sandbox();
    let pod = build_pod(&s, &config()).unwrap();
    let text = json_of(&pod);
    assert!(!text.contains(&s.token), "the token is in the pod: {text}");
    let env = pod.spec.as_ref().unwrap().containers[0].env.clone().unwrap_or_default();
    assert!(env.iter().all(|e| !e.name.starts_with("SANDMAN_")), "SANDMAN_* env reached the daemon: {env:?}");
    // With the annotation delivery it is in the annotation, and nowhere else.
    let config = KubeConfig { token: TokenDelivery::PodAnnotation, ..config() };
    let pod = build_pod(&s, &config).unwrap();
    assert_eq!(pod::annotation_token(&pod).as_deref(), Some(s.token.as_str()));
    assert_eq!(json_of(&pod).matches(&s.token).count(), 1);
}

#[test]
fn the_spec_is_recovered_from_the_pod() {
    let s = sandbox();
    let pod = build_pod(&s, &config()).unwrap();
    let mut want = s.clone();
    want.token = String::new();
    assert_eq!(pod::spec_of(&pod), Some(want));
    // A pod whose annotation names another sandbox is not taken for this one.
    let mut other = pod.clone();
    other.metadata.labels.as_mut().unwrap().insert("sandman.dev/sandbox".into(), "sb-other".into());
    assert_eq!(pod::spec_of(&other), None);
}

#[test]
fn a_job_name_that_is_no_label_value_gets_a_stable_one() {
    let mut s = sandbox();
    s.job = Some("job a".into());
    let pod = build_pod(&s, &config()).unwrap();
    let label = pod.metadata.labels.as_ref().unwrap().get("sandman.dev/job").cloned().unwrap();
    assert!(pod::is_label_value(&label), "{label}");
    assert!(pod::job_selector("sandman", "job a").ends_with(&format!("sandman.dev/job={label}")));
    assert_eq!(pod::spec_of(&pod).and_then(|s| s.job).as_deref(), Some("job a"));
}

/// Capacity-aware admission tells whose room a pod holds from its labels: an unclaimed pool
/// sandbox's pod carries its pool (its Secret does not: a claim relabels only the pod).
#[test]
fn a_pool_sandboxs_pod_carries_its_pool_and_a_jobs_pod_its_job() {
    let mut s = sandbox();
    s.job = None;
    s.labels.insert("sandman.dev/pool".into(), "warm pool".into());
    let pod = build_pod(&s, &config()).unwrap();
    let labels = pod.metadata.labels.as_ref().unwrap();
    assert_eq!(labels.get("sandman.dev/pool"), Some(&pod::label_value("warm pool")));
    assert!(!labels.contains_key("sandman.dev/job"));
    assert_eq!(sandman_provider_kube::capacity::Tenant::of_pod(&pod), sandman_provider_kube::capacity::Tenant::Refill);
    assert!(!build_secret(&s, &config(), "uid").metadata.labels.unwrap().contains_key("sandman.dev/pool"));
    s.job = Some("job a".into());
    let pod = build_pod(&s, &config()).unwrap();
    assert!(!pod.metadata.labels.as_ref().unwrap().contains_key("sandman.dev/pool"));
}

#[test]
fn what_no_pod_can_be_made_from_is_refused_clearly() {
    let refused = |s: SandboxSpec, config: &KubeConfig| match pod::check(&s, config) {
        Err(ProviderError::Unsupported(m)) => m,
        other => panic!("not refused: {other:?}"),
    };
    let mut s = sandbox();
    s.resources.pids = Some(100);
    assert!(refused(s, &config()).contains("podPidsLimit"));
    let mut s = sandbox();
    s.id = "SB_1".into();
    assert!(refused(s, &config()).contains("cannot name a pod"));
    let mut s = eval_sandbox();
    s.resources = Resources::default();
    assert!(refused(s.clone(), &eval_config()).contains("Guaranteed"));
    let with_defaults =
        KubeConfig { default_cpu: Some("1".into()), default_memory: Some("1Gi".into()), ..eval_config() };
    assert!(pod::check(&s, &with_defaults).is_ok(), "the configured defaults make it Guaranteed");
    let mut s = sandbox();
    s.image = " ".into();
    assert!(refused(s, &config()).contains("not an image reference"));
    let mut s = sandbox();
    s.resources.memory = Some(Quantity::Text("plenty".into()));
    assert!(refused(s, &config()).contains("resources.memory"));
}

// ---- prepare ----

#[test]
fn the_pull_pod_of_prepare() {
    let mut config = config();
    config.tolerations = vec![Toleration {
        key: Some("sandman.dev/pool".into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Toleration::default()
    }];
    config.image_pull_secrets = vec!["regcred".into()];
    config.runtime_class = Some("gvisor".into());
    let pod = prepare::build_pull_pod(
        "python:3.12-slim",
        "node-a",
        "sandman-prepare-0123456789ab-0",
        "0123456789ab",
        &config,
    );
    assert_snapshot("pod-prepare", &pod);
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some("node-a"), "bound to its node, no scheduler");
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    let pull = &spec.containers[0];
    assert_eq!(pull.image.as_deref(), Some("python:3.12-slim"));
    assert_eq!(pull.image_pull_policy.as_deref(), Some("IfNotPresent"));
    assert_eq!(pull.command.as_deref(), Some(&["/.sandman/sandmand".to_string(), "--version".to_string()][..]));
    let sc = pull.security_context.as_ref().unwrap();
    assert_eq!(
        (sc.privileged, sc.allow_privilege_escalation, sc.run_as_non_root),
        (Some(false), Some(false), Some(true))
    );
    assert_eq!(sc.capabilities.as_ref().and_then(|c| c.drop.clone()), Some(vec!["ALL".to_string()]));
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert!(spec.host_network.is_none() && spec.host_pid.is_none() && spec.host_ipc.is_none());
    // The daemon comes as into sandbox pods: the same init container.
    let sandbox_pod = build_pod(&sandbox(), &config).unwrap();
    assert_eq!(spec.init_containers, sandbox_pod.spec.unwrap().init_containers);
    // Found by its run's label, and never by the shared watch of sandbox pods.
    let labels = pod.metadata.labels.as_ref().unwrap();
    assert!(prepare::selector("sandman", "0123456789ab").split(',').all(|t| {
        let (k, v) = t.split_once('=').unwrap();
        labels.get(k).map(String::as_str) == Some(v)
    }));
    assert!(!labels.contains_key("sandman.dev/sandbox"));
}

/// A recorded Node, made Ready (as a kubelet's status would) with these taints.
fn ready_node(name: &str, taints: Value) -> k8s_openapi::api::core::v1::Node {
    let mut node = common::json("node-create-fake-201.json");
    node["metadata"]["name"] = name.into();
    node["spec"]["taints"] = taints;
    node["status"]["conditions"] = serde_json::json!([{"type": "Ready", "status": "True", "reason": "KubeletReady"}]);
    serde_json::from_value(node).unwrap()
}

#[test]
fn prepare_takes_the_nodes_a_sandbox_could_land_on() {
    let fake = serde_json::json!([{"key": "sandman.dev/fake", "value": "true", "effect": "NoSchedule"}]);
    let tolerated = vec![Toleration {
        key: Some("sandman.dev/fake".into()),
        operator: Some("Exists".into()),
        ..Toleration::default()
    }];
    // The recorded node as created: no Ready condition yet.
    let created: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(common::json("node-create-fake-201.json")).unwrap();
    assert!(prepare::eligible(&created, &tolerated).unwrap_err().contains("not Ready"));
    // The recorded node after the node controller gave up on it.
    let lost: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(common::json("node-fake-unreachable.json")).unwrap();
    assert!(prepare::eligible(&lost, &tolerated).unwrap_err().contains("Unknown"));
    let ready = ready_node("a", fake.clone());
    prepare::eligible(&ready, &tolerated).unwrap();
    let why = prepare::eligible(&ready, &[]).unwrap_err();
    assert!(why.contains("sandman.dev/fake=true:NoSchedule"), "{why}");
    let equal_other_value = vec![Toleration {
        key: Some("sandman.dev/fake".into()),
        operator: Some("Equal".into()),
        value: Some("false".into()),
        ..Toleration::default()
    }];
    assert!(prepare::eligible(&ready, &equal_other_value).is_err());
    let soft = ready_node("b", serde_json::json!([{"key": "x", "effect": "PreferNoSchedule"}]));
    prepare::eligible(&soft, &[]).unwrap();
    let mut cordoned = ready_node("c", serde_json::json!([]));
    cordoned.spec.as_mut().unwrap().unschedulable = Some(true);
    assert!(prepare::eligible(&cordoned, &[]).unwrap_err().contains("cordoned"));
}

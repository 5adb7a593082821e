//! What the provider applied to a sandbox, read back from its pod: [`applied`] turns the pod
//! (its task container's limits and environment, its QoS class, the image digest the runtime
//! resolved) into the [`Applied`] part of the sandbox's conditions record, with no I/O.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as KubeQuantity;
use sandman_wire::server::{Applied, Quantity};
use serde_json::{Value, json};

use crate::config::KubeConfig;
use crate::pod::{LABEL_NETWORK, TASK_CONTAINER};

/// The pod's conditions as the provider applied them:
///
/// - `cpu` (cores) and `memory` (bytes): the task container's limits, as the kubelet reports
///   having applied them (`status.containerStatuses[].resources`, Kubernetes 1.33+), else as
///   the spec sets them. For `eval` both equal the requests (Guaranteed QoS).
/// - `swap`: `0` for a Guaranteed pod on a node, since the kubelet never gives swap to
///   Guaranteed pods (with swap off, `NoSwap` or `LimitedSwap` alike; on cgroup v2 it writes
///   `memory.swap.max = 0`). Unknown (`None`) otherwise: a Burstable pod may get swap under
///   `LimitedSwap`.
/// - `pids`: the declared `pod_pids_limit` (the kubelet's `podPidsLimit`, applied per pod by
///   the node, which the API does not show); `None` when not declared.
/// - `network`: `policy` when the pod is labelled for the provider's NetworkPolicy (`network:
///   none` and `eval`): its traffic is denied, but its interfaces remain. Else `egress`.
/// - `timezone`, `locale`: `TZ`, and `LC_ALL` else `LANG`, of the task container's environment,
///   which the daemon hands to every command.
/// - `image`: the `imageID` of the running container (the digest the runtime resolved the
///   reference to when the pod started), else the reference as asked, before it has started.
pub fn applied(pod: &Pod, config: &KubeConfig) -> Applied {
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let task: Option<&Container> = spec.and_then(|s| s.containers.iter().find(|c| c.name == TASK_CONTAINER));
    let task_status: Option<&ContainerStatus> =
        status.and_then(|s| s.container_statuses.as_ref()).and_then(|cs| cs.iter().find(|c| c.name == TASK_CONTAINER));
    let spec_resources = task.and_then(|c| c.resources.as_ref());
    let limits = task_status
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .or_else(|| spec_resources.and_then(|r| r.limits.as_ref()));
    let limit = |what: &str| limits.and_then(|l| l.get(what)).and_then(value);

    let qos = status.and_then(|s| s.qos_class.clone());
    let node = spec.and_then(|s| s.node_name.clone());
    let guaranteed_on_node = qos.as_deref() == Some("Guaranteed") && node.is_some();
    let cut_off = pod.metadata.labels.as_ref().and_then(|l| l.get(LABEL_NETWORK)).is_some_and(|v| v == "none");
    let env: BTreeMap<&str, &str> = task
        .and_then(|c| c.env.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e.name.as_str(), e.value.as_deref()?)))
        .collect();
    let image = task_status
        .map(|c| c.image_id.as_str())
        .filter(|i| !i.is_empty())
        .map(str::to_string)
        .or_else(|| task.and_then(|c| c.image.clone()));

    let quantities = |m: Option<&BTreeMap<String, KubeQuantity>>| -> Value {
        m.map(|m| m.iter().map(|(k, v)| (k.clone(), Value::String(v.0.clone()))).collect()).unwrap_or(Value::Null)
    };
    let mut details = BTreeMap::from([
        ("pod".to_string(), json!(pod.metadata.name)),
        ("uid".to_string(), json!(pod.metadata.uid)),
        ("resourceVersion".to_string(), json!(pod.metadata.resource_version)),
        ("qosClass".to_string(), json!(qos)),
        ("nodeName".to_string(), json!(node)),
        ("runtimeClassName".to_string(), json!(spec.and_then(|s| s.runtime_class_name.clone()))),
        ("requests".to_string(), quantities(spec_resources.and_then(|r| r.requests.as_ref()))),
        ("limits".to_string(), quantities(spec_resources.and_then(|r| r.limits.as_ref()))),
        ("imageRef".to_string(), json!(task.and_then(|c| c.image.clone()))),
    ]);
    if config.pod_pids_limit.is_some() {
        // Machine-readable: the limit is on the pod's cgroup, which the daemon cannot see from
        // its container's (whose `pids.max` stays `max`).
        details.insert("pidsScope".into(), json!("pod"));
    }
    if cut_off {
        details.insert("networkPolicy".into(), json!(policy_source(config)));
    }

    Applied {
        image,
        cpu: limit("cpu"),
        memory: limit("memory").map(|b| b.round() as u64),
        swap: guaranteed_on_node.then_some(0),
        pids: config.pod_pids_limit,
        network: Some(if cut_off { "policy" } else { "egress" }.to_string()),
        timezone: env.get("TZ").map(|s| s.to_string()),
        locale: env.get("LC_ALL").or_else(|| env.get("LANG")).map(|s| s.to_string()),
        details,
    }
}

/// Which NetworkPolicy cuts the pod off.
fn policy_source(config: &KubeConfig) -> String {
    if config.manage_network_policy {
        format!("{} (applied by the provider)", crate::NETWORK_NONE_POLICY)
    } else {
        "managed outside the provider (deploy/base/networkpolicy.yaml)".to_string()
    }
}

/// A Kubernetes quantity in base units (cores, bytes).
fn value(q: &KubeQuantity) -> Option<f64> {
    Quantity::Text(q.0.clone()).value().ok()
}

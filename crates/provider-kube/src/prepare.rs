//! `prepare`: an image pulled ahead of a burst on every node that may run sandboxes. One
//! short-lived pod per node ([`build_pull_pod`]: `nodeName` set, the image with
//! `IfNotPresent`, the daemon injected as into sandbox pods and run with `--version`, which exits
//! at once), one watch on their label, progress per node, and one `deletecollection` at the
//! end. Start at [`run`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{
    Container, LocalObjectReference, Node, Pod, PodSpec, ResourceRequirements, Taint, Toleration, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as KubeQuantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use sandman_provider::{NodeProgress, NodeState, Prepared, ProviderError};
use sandman_wire::server::Reason;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::api::{KubeApi, chain};
use crate::config::KubeConfig;
use crate::pod::{DAEMON_DIR, DAEMON_PATH, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY, label_value};
use crate::status::{PullState, describe, pull_state};

/// The run a pull pod belongs to; the watch and the cleanup select on it.
pub const LABEL_PREPARE: &str = "sandman.dev/prepare";
/// The node a pull pod is for (as a label value).
pub const LABEL_NODE: &str = "sandman.dev/node";
/// The image being prepared, for whoever lists the pods.
pub const ANNOTATION_IMAGE: &str = "sandman.dev/image";
/// Name of the pull pod's one container.
pub const PULL_CONTAINER: &str = "pull";
/// Resources of the pull container, requests = limits: it only prints the daemon's version, and
/// a small request still fits on a node full of sandboxes.
const PULL_CPU: &str = "100m";
const PULL_MEMORY: &str = "32Mi";
/// Added to the prepare's deadline for the pods' `activeDeadlineSeconds`, so that a pod left by
/// a server that died mid-prepare still ends on its own.
const POD_DEADLINE_MARGIN_S: u64 = 60;

/// A fresh id for one prepare (a valid label value): random per call, from the standard
/// library's randomly keyed hasher.
pub fn run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:012x}", h.finish() & 0xffff_ffff_ffff)
}

/// The label selector of one prepare's pods.
pub fn selector(instance: &str, run: &str) -> String {
    format!("{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_INSTANCE}={},{LABEL_PREPARE}={run}", label_value(instance))
}

/// The provider's `node_selector` as a label selector (empty: every node).
pub fn node_selector(config: &KubeConfig) -> String {
    config.node_selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// Whether a sandbox could land on `node`: schedulable, Ready, and every NoSchedule or
/// NoExecute taint tolerated by the provider's tolerations. `Err` says why not.
pub fn eligible(node: &Node, tolerations: &[Toleration]) -> Result<(), String> {
    let spec = node.spec.as_ref();
    if spec.and_then(|s| s.unschedulable).unwrap_or(false) {
        return Err("cordoned (unschedulable)".into());
    }
    let ready =
        node.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => {}
        Some(c) => return Err(format!("not Ready ({}: {})", c.status, c.reason.as_deref().unwrap_or("no reason"))),
        None => return Err("not Ready (no Ready condition)".into()),
    }
    for taint in spec.and_then(|s| s.taints.as_ref()).into_iter().flatten() {
        if matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations.iter().any(|t| tolerates(t, taint))
        {
            let value = taint.value.as_deref().map(|v| format!("={v}")).unwrap_or_default();
            return Err(format!("taint {}{value}:{} not tolerated", taint.key, taint.effect));
        }
    }
    Ok(())
}

/// Kubernetes' toleration matching: the effect (empty: any), then `Exists` on the key (empty:
/// every key) or `Equal` on key and value.
fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = t.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    let key = t.key.as_deref().unwrap_or("");
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        _ => key == taint.key && t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
    }
}

/// The pod that pulls `image` on `node`: bound to it by `nodeName` (no scheduler), the image
/// with `IfNotPresent`, its command the daemon (injected as into sandbox pods, so that it runs
/// in any image) with `--version`, which exits at once. It runs as nobody, with no privileges,
/// no service account token and no service links.
pub fn build_pull_pod(image: &str, node: &str, name: &str, run: &str, config: &KubeConfig) -> Pod {
    let mut labels = config.pod_labels.clone();
    labels.extend([
        (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
        (LABEL_INSTANCE.to_string(), label_value(&config.instance)),
        (LABEL_PREPARE.to_string(), run.to_string()),
        (LABEL_NODE.to_string(), label_value(node)),
    ]);
    let (daemon_volume, init) = crate::pod::daemon_injection(config);
    let fixed = BTreeMap::from([
        ("cpu".to_string(), KubeQuantity(PULL_CPU.into())),
        ("memory".to_string(), KubeQuantity(PULL_MEMORY.into())),
    ]);
    let pull = Container {
        name: PULL_CONTAINER.into(),
        image: Some(image.trim().to_string()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![DAEMON_PATH.into(), "--version".into()]),
        resources: Some(ResourceRequirements {
            requests: Some(fixed.clone()),
            limits: Some(fixed),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: daemon_volume.name.clone(),
            mount_path: DAEMON_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        }]),
        security_context: Some(crate::pod::nobody()),
        ..Default::default()
    };
    let deadline = config.prepare_timeout_s.saturating_add(POD_DEADLINE_MARGIN_S);
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(config.namespace.clone()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(ANNOTATION_IMAGE.to_string(), image.trim().to_string())])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(1),
            active_deadline_seconds: Some(i64::try_from(deadline).unwrap_or(i64::MAX)),
            // The same runtime as the sandboxes (gVisor, Kata pull and unpack their own way).
            runtime_class_name: config.runtime_class.clone(),
            service_account_name: config.service_account.clone(),
            // nodeName skips the scheduler, but a NoExecute taint would still evict the pod.
            tolerations: (!config.tolerations.is_empty()).then(|| config.tolerations.clone()),
            image_pull_secrets: (!config.image_pull_secrets.is_empty())
                .then(|| config.image_pull_secrets.iter().map(|n| LocalObjectReference { name: n.clone() }).collect()),
            init_containers: init.map(|c| vec![c]),
            containers: vec![pull],
            volumes: Some(vec![daemon_volume]),
            ..Default::default()
        }),
        status: None,
    }
}

/// One node of a prepare.
#[derive(Debug)]
struct Target {
    node: String,
    /// Its pod was created and it has not been judged yet.
    pending: bool,
    ready: bool,
    /// The pod as last seen, for a timeout's message.
    last: Option<Pod>,
}

/// Sends the progress lines of one prepare (a closed channel loses them, nothing else).
struct Reporter<'a> {
    tx: &'a mpsc::UnboundedSender<NodeProgress>,
    total: u32,
}

impl Reporter<'_> {
    fn send(&self, node: &str, state: NodeState, message: String) {
        let _ = self.tx.send(NodeProgress { node: node.to_string(), state, message, nodes_total: self.total });
    }
}

/// Deletes one prepare's pods if the prepare is dropped before it did (a cancelled request).
struct Cleanup {
    api: Arc<KubeApi>,
    selector: String,
    armed: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (api, selector) = (self.api.clone(), std::mem::take(&mut self.selector));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = api.delete_pods(&selector, 1).await {
                    tracing::warn!(%selector, err = %chain(&e), "cannot delete the pods of a cancelled prepare");
                }
            });
        }
    }
}

/// Pulls `image` on every node that may run sandboxes: lists the nodes of the provider's
/// `node_selector` (skipping cordoned, not Ready and untolerated ones), creates one pull pod per
/// node, follows them on one watch of their label, tells `progress` how each node gets on
/// (`Pulling` once its pod is made, `Ready` or `Failed`), and fails the nodes not done by
/// `prepare_timeout_s`. The pods are deleted at the end, with one `deletecollection`.
pub async fn run(
    api: &Arc<KubeApi>,
    pods: kube::Api<Pod>,
    config: &KubeConfig,
    image: &str,
    progress: mpsc::UnboundedSender<NodeProgress>,
) -> Result<Prepared, ProviderError> {
    crate::pod::check_image(image)?;
    let image = image.trim();
    let nodes = find_nodes(api, config).await?;
    let total = u32::try_from(nodes.len()).unwrap_or(u32::MAX);
    let report = Reporter { tx: &progress, total };
    let run = run_id();
    let selector = selector(&config.instance, &run);
    let deadline = Instant::now() + Duration::from_secs(config.prepare_timeout_s);
    tracing::info!(image, nodes = total, run = %run, "preparing an image");

    let mut cleanup = Cleanup { api: api.clone(), selector: selector.clone(), armed: true };
    let mut targets: HashMap<String, Target> = HashMap::new();
    let made = futures_util::future::join_all(nodes.iter().enumerate().map(|(i, node)| {
        let pod = build_pull_pod(image, node, &format!("sandman-prepare-{run}-{i}"), &run, config);
        async move { (node, pod.metadata.name.clone().unwrap_or_default(), api.create_pod(&pod).await) }
    }))
    .await;
    let mut first_error = None;
    for (node, name, result) in made {
        let mut target = Target { node: node.clone(), pending: false, ready: false, last: None };
        match result {
            Ok(_) => {
                target.pending = true;
                report.send(node, NodeState::Pulling, format!("pulling `{image}`"));
            }
            Err(e) => {
                report.send(node, NodeState::Failed, format!("cannot create the pull pod: {}", chain(&e)));
                first_error.get_or_insert(e);
            }
        }
        targets.insert(name, target);
    }
    if let Some(e) = first_error.take()
        && !targets.values().any(|t| t.pending)
    {
        // Not one pod was made (RBAC, quota): the API server's answer is the error.
        cleanup.armed = false;
        return Err(e.into());
    }

    follow(pods, &selector, &mut targets, &report, deadline, image).await;
    for t in targets.values_mut().filter(|t| t.pending) {
        t.pending = false;
        let seen = t.last.as_ref().map(describe).unwrap_or_else(|| "not seen by the watch".into());
        report.send(
            &t.node,
            NodeState::Failed,
            format!("`{image}` was not pulled within {} s ({seen})", config.prepare_timeout_s),
        );
    }

    cleanup.armed = false;
    if let Err(e) = api.delete_pods(&selector, 1).await {
        tracing::warn!(%selector, err = %chain(&e), "cannot delete the pull pods");
    }
    let ready = u32::try_from(targets.values().filter(|t| t.ready).count()).unwrap_or(u32::MAX);
    tracing::info!(image, ready, total, "prepared an image");
    if ready == 0 {
        return Err(ProviderError::Failed {
            reason: Reason::ImagePullFailed,
            message: format!("no node could pull `{image}` ({total} tried; see each node's progress for why)"),
        });
    }
    Ok(Prepared { nodes_ready: ready, nodes_total: total })
}

/// The names of the nodes a sandbox could land on; none is an error naming the selector and why
/// each node matched was left out.
async fn find_nodes(api: &KubeApi, config: &KubeConfig) -> Result<Vec<String>, ProviderError> {
    let selector = node_selector(config);
    let listed = api.list_nodes(&selector).await.map_err(|e| match e.code() {
        Some(403) => ProviderError::Backend(format!(
            "prepare lists the nodes, which the server's ServiceAccount may not do (the ClusterRole \
             `sandman-server-nodes` of deploy/base/rbac.yaml grants it): {}",
            chain(&e)
        )),
        _ => ProviderError::from(e),
    })?;
    let mut names = Vec::new();
    let mut skipped = Vec::new();
    for node in &listed {
        let name = node.metadata.name.clone().unwrap_or_default();
        match eligible(node, &config.tolerations) {
            Ok(()) => names.push(name),
            Err(why) => {
                tracing::info!(node = %name, %why, "prepare skips a node");
                skipped.push(format!("{name}: {why}"));
            }
        }
    }
    if names.is_empty() {
        let which = if selector.is_empty() {
            "no node_selector (every node)".to_string()
        } else {
            format!("node_selector `{selector}`")
        };
        let why = if skipped.is_empty() { String::new() } else { format!(" ({})", skipped.join("; ")) };
        return Err(ProviderError::Failed {
            reason: Reason::Unschedulable,
            message: format!(
                "no node may run sandboxes: {which} matches {} node(s), none ready, schedulable and tolerated{why}",
                listed.len()
            ),
        });
    }
    names.sort();
    Ok(names)
}

/// Follows the pull pods on one watch of their label until every node is judged, the watch
/// ends, or the deadline passes.
async fn follow(
    pods: kube::Api<Pod>,
    selector: &str,
    targets: &mut HashMap<String, Target>,
    report: &Reporter<'_>,
    deadline: Instant,
    image: &str,
) {
    let stream = watcher::watcher(pods, watcher::Config::default().labels(selector)).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while targets.values().any(|t| t.pending) {
        let event = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => return,
            event = stream.next() => event,
        };
        let (pod, deleted) = match event {
            None => return,
            Some(Ok(Event::Apply(pod) | Event::InitApply(pod))) => (pod, false),
            Some(Ok(Event::Delete(pod))) => (pod, true),
            Some(Ok(Event::Init | Event::InitDone)) => continue,
            Some(Err(e)) => {
                tracing::debug!(err = %chain(&e), "the prepare watch failed; resuming");
                continue;
            }
        };
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(target) = targets.get_mut(&name).filter(|t| t.pending) else { continue };
        let verdict = match pull_state(&pod, PULL_CONTAINER) {
            PullState::Pending if deleted => Some(Err("its pull pod was deleted before it finished".to_string())),
            PullState::Pending => None,
            PullState::Pulled { image_id } => Some(Ok(image_id)),
            PullState::Failed(why) => Some(Err(why)),
        };
        target.last = Some(pod);
        match verdict {
            None => {}
            Some(Ok(image_id)) => {
                target.pending = false;
                target.ready = true;
                let id = image_id.map(|i| format!(" ({i})")).unwrap_or_default();
                report.send(&target.node, NodeState::Ready, format!("has `{image}`{id}"));
            }
            Some(Err(why)) => {
                target.pending = false;
                report.send(&target.node, NodeState::Failed, why);
            }
        }
    }
}

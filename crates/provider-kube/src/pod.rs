//! The sandbox pod and its token Secret, built from a [`SandboxSpec`] and the [`KubeConfig`] with
//! no I/O; and the way back, from a pod's labels and annotation to the spec (recovery). Start
//! at [`build_pod`].

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, DownwardAPIVolumeFile, DownwardAPIVolumeSource, EmptyDirVolumeSource,
    EnvVar, HostPathVolumeSource, ImageVolumeSource, KeyToPath, LocalObjectReference, ObjectFieldSelector, Pod,
    PodSpec, ResourceRequirements, Secret, SecretVolumeSource, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as KubeQuantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use sandman_provider::{Claim, ProviderError, SandboxSpec};
use sandman_wire::server::{Network, Profile, Quantity};

use crate::config::{Injection, KubeConfig, TokenDelivery};

pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "sandman";
pub const LABEL_INSTANCE: &str = "sandman.dev/instance";
pub const LABEL_SANDBOX: &str = "sandman.dev/sandbox";
pub const LABEL_JOB: &str = "sandman.dev/job";
/// On an unclaimed warm pool sandbox's pod: the pool (as a label value). A claim takes it off.
pub const LABEL_POOL: &str = sandman_provider::POOL_LABEL;
/// `egress` or `none`; the NetworkPolicy for `none` selects on it.
pub const LABEL_NETWORK: &str = "sandman.dev/network";
pub const LABEL_PROFILE: &str = "sandman.dev/profile";
/// The sandbox's spec as JSON, token left out: what `list` recovers a sandbox from.
pub const ANNOTATION_SPEC: &str = "sandman.dev/spec";
/// The daemon's token, only with [`TokenDelivery::PodAnnotation`].
pub const ANNOTATION_TOKEN: &str = "sandman.dev/token";
/// `"true"` once a create has claimed the warm-pool sandbox the pod runs (see [`claim_patch`]).
pub const LABEL_CLAIMED: &str = "sandman.dev/claimed";
/// The server's line about a sandbox that became ready ([`Provider::mark_ready`]), kept for a
/// replica taking over.
///
/// [`Provider::mark_ready`]: sandman_provider::Provider::mark_ready
pub const ANNOTATION_READY: &str = "sandman.dev/ready";
/// The claim of a warm-pool sandbox as JSON, token left out: what `list` answers as
/// `Record::claim`, so that a restarted or second server knows the sandbox is taken, and by whom.
pub const ANNOTATION_CLAIM: &str = "sandman.dev/claim";

/// Name of the task container (the image's, running `sandmand`).
pub const TASK_CONTAINER: &str = "task";
/// Name of the init container that installs the daemon.
pub const INIT_CONTAINER: &str = "sandman-init";
/// Where the daemon's volume is mounted, and the daemon in it.
pub const DAEMON_DIR: &str = "/.sandman";
pub const DAEMON_PATH: &str = "/.sandman/sandmand";
/// Where the token's volume is mounted, and the token file in it.
pub const TOKEN_DIR: &str = "/.sandman-token";
pub const TOKEN_FILE: &str = "/.sandman-token/token";
/// The key of the token in its Secret.
pub const TOKEN_KEY: &str = "token";
const DAEMON_VOLUME: &str = "sandman-bin";
const TOKEN_VOLUME: &str = "sandman-token";
/// Largest spec annotation accepted (the API server allows 256 KiB for all annotations).
const MAX_SPEC_ANNOTATION: usize = 128 * 1024;
/// Resources of the init container: requests = limits, so an `eval` pod stays Guaranteed.
const INIT_CPU: &str = "100m";
const INIT_MEMORY: &str = "32Mi";
/// Longest sandbox id: `sandman-<id>` stays a 63-character DNS label (the pod's hostname).
const MAX_ID: usize = 55;

/// The pod (and Secret) name of a sandbox.
pub fn pod_name(id: &str) -> String {
    format!("sandman-{id}")
}

/// The label selector of every sandbox pod of one server instance.
pub fn selector(instance: &str) -> String {
    format!("{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_INSTANCE}={},{LABEL_SANDBOX}", label_value(instance))
}

/// The label selector of everything one server instance makes (pods, their Secrets, shared
/// token Secrets).
pub fn owned_selector(instance: &str) -> String {
    format!("{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_INSTANCE}={}", label_value(instance))
}

/// The label selector of one job's sandbox pods.
pub fn job_selector(instance: &str, job: &str) -> String {
    format!("{},{LABEL_JOB}={}", selector(instance), label_value(job))
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Empty, or `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]` of at most 63 characters.
pub fn is_label_value(s: &str) -> bool {
    if s.is_empty() {
        return true;
    }
    let ok_inner = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    s.len() <= 63
        && s.bytes().all(ok_inner)
        && s.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
        && s.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric)
}

/// `s` as a label value: itself when valid, else its valid characters (at most 46) and a hash
/// of the whole, so that two job names never share a label and the same name always gets the
/// same one.
pub fn label_value(s: &str) -> String {
    if is_label_value(s) {
        return s.to_string();
    }
    let kept: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' })
        .take(46)
        .collect();
    let kept = kept.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let hash = fnv1a(s.as_bytes());
    if kept.is_empty() { format!("h-{hash:016x}") } else { format!("{kept}-{hash:016x}") }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The daemon's address given a pod IP: `ip:port`, bracketed for IPv6.
pub fn daemon_addr(ip: &str, port: u16) -> String {
    if ip.contains(':') { format!("[{ip}]:{port}") } else { format!("{ip}:{port}") }
}

/// Refuses, touching nothing, a spec no pod could be made from, or an `eval` sandbox whose
/// conditions this provider could not apply and report.
pub fn check(spec: &SandboxSpec, config: &KubeConfig) -> Result<(), ProviderError> {
    let refuse = |m: String| Err(ProviderError::Unsupported(m));
    if !is_dns_label(&spec.id) || spec.id.len() > MAX_ID {
        return refuse(format!(
            "sandbox id `{}` cannot name a pod: use at most {MAX_ID} lowercase letters, digits and `-`",
            spec.id
        ));
    }
    check_image(&spec.image)?;
    crate::snapshot::task_image(&spec.image, config)?;
    resources(spec, config)?;
    check_pids(spec, config)?;
    for k in spec.env.keys() {
        if k.is_empty() || k.contains('=') || k.chars().any(char::is_control) {
            return refuse(format!("invalid environment variable name `{k}`"));
        }
    }
    let annotation = spec_annotation(spec)?;
    if annotation.len() > MAX_SPEC_ANNOTATION {
        return refuse(format!(
            "the sandbox's spec is {} KiB as JSON; Kubernetes keeps at most {} KiB of it (fewer or shorter env and labels)",
            annotation.len() / 1024,
            MAX_SPEC_ANNOTATION / 1024
        ));
    }
    Ok(())
}

/// Refuses what cannot be an image reference (Kubernetes would only say so at pull time).
pub fn check_image(image: &str) -> Result<(), ProviderError> {
    let trimmed = image.trim();
    if trimmed.is_empty() || trimmed.chars().any(char::is_whitespace) {
        return Err(ProviderError::Unsupported(format!("image `{image}` is not an image reference")));
    }
    Ok(())
}

/// The pids limit. Kubernetes has no per-pod field: the kubelet applies its `podPidsLimit` to
/// every pod of its node. So a sandbox may only ask for the limit the operator declared as
/// `pod_pids_limit`, and `eval` (which needs a known pids limit) needs it declared.
fn check_pids(spec: &SandboxSpec, config: &KubeConfig) -> Result<(), ProviderError> {
    let refuse = |m: String| Err(ProviderError::Unsupported(m));
    match (spec.resources.pids, config.pod_pids_limit) {
        (Some(asked), Some(declared)) if asked != declared => refuse(format!(
            "resources.pids is {asked}, but the kubelet sets pids limits per node (podPidsLimit) and this \
             provider's nodes declare pod_pids_limit {declared}: ask for {declared} or leave it out"
        )),
        (Some(asked), None) => refuse(format!(
            "resources.pids is {asked}, but the kubelet sets pids limits per node (podPidsLimit), not per pod, and \
             this provider declares none: leave it out, or declare the nodes' podPidsLimit as pod_pids_limit in the \
             provider config"
        )),
        (None, None) if spec.profile == Profile::Eval => refuse(
            "the eval profile needs a pids limit: the kubelet sets pids limits per node (podPidsLimit); declare it \
             as pod_pids_limit in the provider config"
                .into(),
        ),
        _ => Ok(()),
    }
}

/// The spec as stored in the pod's annotation: JSON with the token left out.
pub fn spec_annotation(spec: &SandboxSpec) -> Result<String, ProviderError> {
    let mut stored = spec.clone();
    stored.token = String::new();
    serde_json::to_string(&stored)
        .map_err(|e| ProviderError::Backend(format!("cannot encode sandbox `{}` as JSON: {e}", spec.id)))
}

/// Whether the sandbox is cut off from the network: asked for, or the `eval` profile.
pub fn no_network(spec: &SandboxSpec) -> bool {
    spec.network == Network::None || spec.profile == Profile::Eval
}

/// The labels every object of a sandbox carries.
fn labels(spec: &SandboxSpec, config: &KubeConfig) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
        (LABEL_INSTANCE.to_string(), label_value(&config.instance)),
        (LABEL_SANDBOX.to_string(), spec.id.clone()),
    ]);
    if let Some(job) = &spec.job {
        labels.insert(LABEL_JOB.to_string(), label_value(job));
    }
    labels
}

/// The pod of a sandbox (`check` has passed).
pub fn build_pod(spec: &SandboxSpec, config: &KubeConfig) -> Result<Pod, ProviderError> {
    check(spec, config)?;
    let name = pod_name(&spec.id);
    let mut labels = config.pod_labels.clone();
    labels.extend(labels_of(spec, config));
    let mut annotations = config.pod_annotations.clone();
    annotations.insert(ANNOTATION_SPEC.to_string(), spec_annotation(spec)?);
    if config.token == TokenDelivery::PodAnnotation {
        annotations.insert(ANNOTATION_TOKEN.to_string(), spec.token.clone());
    }

    let (daemon_volume, init) = daemon_injection(config);
    let token_volume = match config.token {
        TokenDelivery::Secret => Volume {
            name: TOKEN_VOLUME.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(name.clone()),
                items: Some(vec![KeyToPath { key: TOKEN_KEY.into(), path: TOKEN_KEY.into(), ..Default::default() }]),
                // Readable by whatever user the image runs as; the token only guards the daemon
                // from the network, and code in the sandbox is already inside.
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
        // The Secret is named once the token is in one ([`set_token_secret`]); the pod mounts
        // only its own key of it.
        TokenDelivery::SharedSecret => Volume {
            name: TOKEN_VOLUME.into(),
            secret: Some(SecretVolumeSource {
                secret_name: None,
                items: Some(vec![KeyToPath { key: spec.id.clone(), path: TOKEN_KEY.into(), ..Default::default() }]),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
        TokenDelivery::PodAnnotation => Volume {
            name: TOKEN_VOLUME.into(),
            downward_api: Some(DownwardAPIVolumeSource {
                items: Some(vec![DownwardAPIVolumeFile {
                    path: TOKEN_KEY.into(),
                    field_ref: Some(ObjectFieldSelector {
                        field_path: format!("metadata.annotations['{ANNOTATION_TOKEN}']"),
                        api_version: None,
                    }),
                    ..Default::default()
                }]),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
    };

    let mut tolerations = config.tolerations.clone();
    if let Some(after) = config.node_lost_after_s {
        for key in ["node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"] {
            tolerations.push(Toleration {
                key: Some(key.into()),
                operator: Some("Exists".into()),
                effect: Some("NoExecute".into()),
                toleration_seconds: Some(i64::try_from(after).unwrap_or(i64::MAX)),
                value: None,
            });
        }
    }
    let deadline = spec
        .server
        .ttl_s
        .map(|ttl| ttl.saturating_add(config.deadline_margin_s))
        .or(config.default_deadline_s)
        .map(|s| i64::try_from(s.max(1)).unwrap_or(i64::MAX));

    let pod_spec = PodSpec {
        restart_policy: Some("Never".into()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        termination_grace_period_seconds: Some(i64::from(config.termination_grace_s)),
        active_deadline_seconds: deadline,
        runtime_class_name: config.runtime_class.clone(),
        priority_class_name: config.priority_class.clone(),
        scheduler_name: config.scheduler_name.clone(),
        service_account_name: config.service_account.clone(),
        node_selector: (!config.node_selector.is_empty()).then(|| config.node_selector.clone()),
        tolerations: (!tolerations.is_empty()).then_some(tolerations),
        image_pull_secrets: (!config.image_pull_secrets.is_empty())
            .then(|| config.image_pull_secrets.iter().map(|n| LocalObjectReference { name: n.clone() }).collect()),
        init_containers: init.map(|c| vec![c]),
        containers: vec![task_container(spec, config)?],
        volumes: Some(vec![daemon_volume, token_volume]),
        ..Default::default()
    };
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(config.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(pod_spec),
        status: None,
    })
}

/// How the daemon reaches a pod's containers (at [`DAEMON_DIR`]): its volume, and the init
/// container that fills it when [`Injection::InitContainer`]. Shared by sandbox pods and the
/// pods of [`crate::prepare`], so that both get the daemon the same way.
pub fn daemon_injection(config: &KubeConfig) -> (Volume, Option<Container>) {
    match &config.injection {
        Injection::InitContainer => (
            Volume {
                name: DAEMON_VOLUME.into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    size_limit: Some(KubeQuantity("64Mi".into())),
                    ..Default::default()
                }),
                ..Default::default()
            },
            Some(init_container(config)),
        ),
        Injection::HostPath { path } => (
            Volume {
                name: DAEMON_VOLUME.into(),
                host_path: Some(HostPathVolumeSource { path: path.clone(), type_: Some("Directory".into()) }),
                ..Default::default()
            },
            None,
        ),
        Injection::ImageVolume => (
            Volume {
                name: DAEMON_VOLUME.into(),
                image: Some(ImageVolumeSource {
                    reference: Some(config.daemon_image.clone()),
                    pull_policy: Some(config.daemon_image_pull_policy.as_str().into()),
                }),
                ..Default::default()
            },
            None,
        ),
    }
}

/// The labels of the pod: ownership, the sandbox, its job or warm pool, and how it is cut off.
fn labels_of(spec: &SandboxSpec, config: &KubeConfig) -> BTreeMap<String, String> {
    let mut l = labels(spec, config);
    if let (None, Some(pool)) = (&spec.job, spec.labels.get(LABEL_POOL)) {
        l.insert(LABEL_POOL.into(), label_value(pool));
    }
    l.insert(LABEL_NETWORK.into(), if no_network(spec) { "none" } else { "egress" }.into());
    l.insert(LABEL_PROFILE.into(), if spec.profile == Profile::Eval { "eval" } else { "default" }.into());
    l
}

fn init_container(config: &KubeConfig) -> Container {
    let fixed = BTreeMap::from([
        ("cpu".to_string(), KubeQuantity(INIT_CPU.into())),
        ("memory".to_string(), KubeQuantity(INIT_MEMORY.into())),
    ]);
    Container {
        name: INIT_CONTAINER.into(),
        image: Some(config.daemon_image.clone()),
        image_pull_policy: Some(config.daemon_image_pull_policy.as_str().into()),
        // The daemon image has no shell and no `cp`: the daemon copies itself.
        command: Some(vec!["/sandmand".into(), "install".into(), DAEMON_PATH.into()]),
        resources: Some(ResourceRequirements {
            requests: Some(fixed.clone()),
            limits: Some(fixed),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: DAEMON_VOLUME.into(),
            mount_path: DAEMON_DIR.into(),
            ..Default::default()
        }]),
        // It only copies one file into the emptyDir (world-writable): no privilege needed.
        security_context: Some(nobody()),
        ..Default::default()
    }
}

/// A container that needs no privilege at all: `nobody`, no capabilities, no escalation, a
/// read-only root (the init container that copies the daemon, the pods that pull images).
pub fn nobody() -> SecurityContext {
    SecurityContext {
        run_as_user: Some(65534),
        run_as_group: Some(65534),
        run_as_non_root: Some(true),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), add: None }),
        ..Default::default()
    }
}

fn task_container(spec: &SandboxSpec, config: &KubeConfig) -> Result<Container, ProviderError> {
    let mut args = vec![
        "--listen".to_string(),
        format!("0.0.0.0:{}", config.daemon_port),
        "--token-file".into(),
        TOKEN_FILE.into(),
    ];
    if spec.daemon_lease_s > 0 {
        args.extend(["--lease".into(), format!("{}s", spec.daemon_lease_s)]);
    }
    // The daemon stops uploads and archive extraction at the pod's ephemeral storage, before
    // the kubelet evicts the pod for it.
    if let Some(bytes) = spec.resources.disk.as_ref().and_then(|q| q.value().ok()) {
        args.extend(["--disk-limit".into(), format!("{}", bytes.ceil() as u64)]);
    }
    // Within the pod's grace period: the kubelet's SIGKILL should not beat the daemon's own.
    let grace_ms = u64::from(config.termination_grace_s).saturating_mul(1000).saturating_sub(500).max(500);
    args.extend(["--shutdown-grace".into(), format!("{grace_ms}ms")]);
    if spec.profile == Profile::Eval {
        // The kubelet adds the API server's address to every container, service links or not;
        // an evaluation's commands must not see the platform they run on.
        args.extend(["--drop-env".into(), "KUBERNETES_".into()]);
    }

    let mut env: BTreeMap<String, String> = spec
        .env
        .iter()
        // The daemon would take SANDMAN_TOKEN for its token, and hides SANDMAN_* from commands.
        .filter(|(k, _)| !k.starts_with("SANDMAN_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if spec.profile == Profile::Eval {
        env.insert("TZ".into(), "UTC".into());
        env.insert("LANG".into(), "C.UTF-8".into());
        env.insert("LC_ALL".into(), "C.UTF-8".into());
    }
    let env: Vec<EnvVar> =
        env.into_iter().map(|(name, value)| EnvVar { name, value: Some(value), value_from: None }).collect();

    Ok(Container {
        name: TASK_CONTAINER.into(),
        image: Some(crate::snapshot::task_image(&spec.image, config)?),
        image_pull_policy: config.image_pull_policy.map(|p| p.as_str().to_string()),
        // The image's entry point is replaced by the daemon; its working directory, user and
        // environment stay.
        command: Some(vec![DAEMON_PATH.into()]),
        args: Some(args),
        env: (!env.is_empty()).then_some(env),
        ports: Some(vec![ContainerPort {
            name: Some("sandmand".into()),
            container_port: i32::from(config.daemon_port),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        resources: Some(resources(spec, config)?),
        volume_mounts: Some(vec![
            VolumeMount {
                name: DAEMON_VOLUME.into(),
                mount_path: DAEMON_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: TOKEN_VOLUME.into(),
                mount_path: TOKEN_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]),
        ..Default::default()
    })
}

/// Requests and limits of the task container. `default`: requests as asked (or the configured
/// defaults), a memory limit equal to the request, no cpu limit (Burstable: idle cores are used,
/// nothing is throttled). `eval`: requests = limits for cpu and memory (Guaranteed QoS), both
/// required. `disk` is ephemeral storage, requested and limited.
pub fn resources(spec: &SandboxSpec, config: &KubeConfig) -> Result<ResourceRequirements, ProviderError> {
    let r = &spec.resources;
    let cpu = match &r.cpu {
        Some(q) => Some(cpu_quantity(q)?),
        None => config.default_cpu.clone().map(KubeQuantity),
    };
    let memory = match &r.memory {
        Some(q) => Some(byte_quantity("memory", q)?),
        None => config.default_memory.clone().map(KubeQuantity),
    };
    let disk = r.disk.as_ref().map(|q| byte_quantity("disk", q)).transpose()?;
    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if spec.profile == Profile::Eval {
        let (Some(cpu), Some(memory)) = (cpu, memory) else {
            return Err(ProviderError::Unsupported(
                "the eval profile means Guaranteed QoS: give resources.cpu and resources.memory (or configure default_cpu and default_memory)"
                    .into(),
            ));
        };
        check_eval_cpu(&cpu)?;
        requests.insert("cpu".to_string(), cpu.clone());
        limits.insert("cpu".to_string(), cpu);
        requests.insert("memory".to_string(), memory.clone());
        limits.insert("memory".to_string(), memory);
    } else {
        if let Some(cpu) = cpu {
            requests.insert("cpu".to_string(), cpu);
        }
        if let Some(memory) = memory {
            requests.insert("memory".to_string(), memory.clone());
            limits.insert("memory".to_string(), memory);
        }
    }
    if let Some(disk) = disk {
        requests.insert("ephemeral-storage".to_string(), disk.clone());
        limits.insert("ephemeral-storage".to_string(), disk);
    }
    Ok(ResourceRequirements {
        requests: (!requests.is_empty()).then_some(requests),
        limits: (!limits.is_empty()).then_some(limits),
        ..Default::default()
    })
}

/// Smallest cpu limit the kubelet applies as asked (a 1 ms CFS quota per 100 ms period).
const MIN_CPU_LIMIT: f64 = 0.01;

/// Refuses an eval cpu limit the sandbox would not see as given, since the record of an eval
/// sandbox must state what its commands ran under: the kubelet raises a cpu quota below 10m.
/// (Memory needs no such check: the kernel rounds `memory.max` down by less than a page, which
/// the comparison of applied and observed allows for.)
fn check_eval_cpu(cpu: &KubeQuantity) -> Result<(), ProviderError> {
    let cores =
        Quantity::Text(cpu.0.clone()).value().map_err(|e| ProviderError::Unsupported(format!("resources.cpu: {e}")))?;
    if cores < MIN_CPU_LIMIT {
        return Err(ProviderError::Unsupported(format!(
            "the eval profile needs resources.cpu of at least 10m: the kubelet raises a smaller cpu limit ({}) to 10m",
            cpu.0
        )));
    }
    Ok(())
}

/// A cpu quantity: a number of cores (to the millicore) or a Kubernetes string.
fn cpu_quantity(q: &Quantity) -> Result<KubeQuantity, ProviderError> {
    let cores = q.value().map_err(|e| ProviderError::Unsupported(format!("resources.cpu: {e}")))?;
    if cores < 0.001 {
        return Err(ProviderError::Unsupported("resources.cpu must be at least 1m (0.001 cores)".into()));
    }
    Ok(KubeQuantity(match q {
        Quantity::Text(t) => t.trim().to_string(),
        Quantity::Number(_) => {
            let milli = (cores * 1000.0).round() as u64;
            if milli.is_multiple_of(1000) { format!("{}", milli / 1000) } else { format!("{milli}m") }
        }
    }))
}

/// A memory or disk quantity: a number of bytes or a Kubernetes string.
fn byte_quantity(what: &str, q: &Quantity) -> Result<KubeQuantity, ProviderError> {
    let bytes = q.value().map_err(|e| ProviderError::Unsupported(format!("resources.{what}: {e}")))?;
    if bytes < 1.0 {
        return Err(ProviderError::Unsupported(format!("resources.{what} must be at least one byte")));
    }
    Ok(KubeQuantity(match q {
        Quantity::Text(t) => t.trim().to_string(),
        Quantity::Number(n) => format!("{}", n.round() as u64),
    }))
}

/// The token Secret of a sandbox, owned by its pod so that the garbage collector deletes it
/// with the pod.
pub fn build_secret(spec: &SandboxSpec, config: &KubeConfig, pod_uid: &str) -> Secret {
    let name = pod_name(&spec.id);
    Secret {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(config.namespace.clone()),
            labels: Some(labels(spec, config)),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name,
                uid: pod_uid.to_string(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        immutable: Some(true),
        string_data: Some(BTreeMap::from([(TOKEN_KEY.to_string(), spec.token.clone())])),
        ..Default::default()
    }
}

/// Names the shared Secret that holds the pod's token (`token: shared_secret`).
pub fn set_token_secret(pod: &mut Pod, secret: &str) {
    let volumes = pod.spec.as_mut().and_then(|s| s.volumes.as_mut());
    if let Some(source) = volumes.into_iter().flatten().find(|v| v.name == TOKEN_VOLUME).and_then(|v| v.secret.as_mut())
    {
        source.secret_name = Some(secret.to_string());
    }
}

/// The Secret and key a pod's token volume mounts.
pub fn token_secret_of(pod: &Pod) -> Option<(&str, &str)> {
    let volumes = pod.spec.as_ref()?.volumes.as_ref()?;
    let source = volumes.iter().find(|v| v.name == TOKEN_VOLUME)?.secret.as_ref()?;
    let key = source.items.as_ref()?.first()?.key.as_str();
    Some((source.secret_name.as_deref()?, key))
}

/// The sandbox id of a pod (or Secret): its `sandman.dev/sandbox` label.
pub fn sandbox_id(meta: &ObjectMeta) -> Option<&str> {
    meta.labels.as_ref()?.get(LABEL_SANDBOX).map(String::as_str)
}

/// The spec a pod was made from, token left empty; `None` when the annotation is missing or
/// does not match the pod's sandbox label.
pub fn spec_of(pod: &Pod) -> Option<SandboxSpec> {
    let text = pod.metadata.annotations.as_ref()?.get(ANNOTATION_SPEC)?;
    let spec: SandboxSpec = serde_json::from_str(text).ok()?;
    (sandbox_id(&pod.metadata) == Some(spec.id.as_str())).then_some(spec)
}

/// The token a pod's annotation carries, with [`TokenDelivery::PodAnnotation`].
pub fn annotation_token(pod: &Pod) -> Option<String> {
    pod.metadata.annotations.as_ref()?.get(ANNOTATION_TOKEN).cloned()
}

/// The claim as stored in the pod's annotation: JSON with the token left out, as the spec's.
pub fn claim_annotation(claim: &Claim) -> Result<String, ProviderError> {
    serde_json::to_string(&without_token(claim)).map_err(|e| {
        ProviderError::Backend(format!("cannot encode the claim of sandbox `{}` as JSON: {e}", claim.spec.id))
    })
}

fn without_token(claim: &Claim) -> Claim {
    let mut stored = claim.clone();
    stored.spec.token = String::new();
    stored
}

/// The JSON merge patch that records `claim` on its pool sandbox's pod, read at
/// `resource_version`. The version makes it a conditional update: the API server refuses it
/// with `409 Conflict` when anything wrote the pod since (another server's claim first of all).
/// It adds [`LABEL_CLAIMED`], sets the claimer's job label (removes the pool's, when the claimer
/// has none), removes [`LABEL_POOL`] (the sandbox is the claimer's now), and stores the claim and the claimed spec as annotations, both without the token,
/// exactly as [`build_pod`] stores a spec; the token stays where create put it.
pub fn claim_patch(claim: &Claim, resource_version: &str) -> Result<serde_json::Value, ProviderError> {
    let job = claim.spec.job.as_deref().map(label_value);
    Ok(serde_json::json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {LABEL_CLAIMED: "true", LABEL_JOB: job, LABEL_POOL: null},
            "annotations": {
                ANNOTATION_CLAIM: claim_annotation(claim)?,
                ANNOTATION_SPEC: spec_annotation(&claim.spec)?,
            },
        }
    }))
}

/// The merge patch that records the server's `line` about a sandbox that became ready.
pub fn ready_patch(line: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_READY: line}}})
}

/// The line [`ready_patch`] recorded on the pod, if any.
pub fn ready_of(pod: &Pod) -> Option<String> {
    pod.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_READY)).cloned()
}

/// Whether the pod carries [`LABEL_CLAIMED`].
pub fn is_claimed(pod: &Pod) -> bool {
    pod.metadata.labels.as_ref().and_then(|l| l.get(LABEL_CLAIMED)).is_some_and(|v| v == "true")
}

/// The claim recorded on a pod, token left empty: `None` when it has none; why not, when it is
/// labelled claimed without a readable claim of its own sandbox.
pub fn claim_of(pod: &Pod) -> Result<Option<Claim>, String> {
    let text = pod.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_CLAIM));
    let Some(text) = text else {
        return if is_claimed(pod) {
            Err(format!("it is labelled `{LABEL_CLAIMED}` but has no `{ANNOTATION_CLAIM}` annotation"))
        } else {
            Ok(None)
        };
    };
    let claim: Claim =
        serde_json::from_str(text).map_err(|e| format!("its `{ANNOTATION_CLAIM}` annotation is not a claim: {e}"))?;
    if sandbox_id(&pod.metadata) != Some(claim.spec.id.as_str()) {
        return Err(format!("its `{ANNOTATION_CLAIM}` annotation claims sandbox `{}`, not its own", claim.spec.id));
    }
    Ok(Some(claim))
}

/// Whether the pod records this very claim (a claim whose answer was lost, tried again).
pub fn records_claim(pod: &Pod, claim: &Claim) -> bool {
    is_claimed(pod) && claim_of(pod).ok().flatten().is_some_and(|c| c == without_token(claim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_kept_or_made_valid_and_distinct() {
        assert_eq!(label_value("job-a"), "job-a");
        let a = label_value("job a");
        let b = label_value("job_a");
        assert!(is_label_value(&a), "{a}");
        assert_ne!(a, b);
        assert_eq!(a, label_value("job a"), "the same job always gets the same label");
        let long = "x".repeat(200);
        assert!(is_label_value(&label_value(&long)));
        assert!(is_label_value(&label_value("  ")));
        assert!(is_label_value(&label_value("über/job")));
    }

    #[test]
    fn names_and_addresses() {
        assert_eq!(pod_name("sb-0123456789ab"), "sandman-sb-0123456789ab");
        assert!(is_dns_label("sb-0123456789ab"));
        for bad in ["", "-a", "a-", "A", "a_b", "a.b"] {
            assert!(!is_dns_label(bad), "{bad}");
        }
        assert_eq!(daemon_addr("10.244.0.26", 7778), "10.244.0.26:7778");
        assert_eq!(daemon_addr("fd00::1", 7778), "[fd00::1]:7778");
        assert_eq!(
            selector("sandman"),
            "app.kubernetes.io/managed-by=sandman,sandman.dev/instance=sandman,sandman.dev/sandbox"
        );
    }

    /// A pod of sandbox `id` whose metadata a claim patch was merged into.
    fn claimed_pod(id: &str, claim_json: Option<String>) -> Pod {
        let mut labels = BTreeMap::from([(LABEL_SANDBOX.to_string(), id.to_string())]);
        labels.insert(LABEL_CLAIMED.into(), "true".into());
        Pod {
            metadata: ObjectMeta {
                labels: Some(labels),
                annotations: claim_json.map(|c| BTreeMap::from([(ANNOTATION_CLAIM.to_string(), c)])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_claim_is_read_back_only_for_its_own_sandbox() {
        let mut spec = sandman_provider::conformance::spec("pool-0", "busybox:1");
        spec.token = "secret-token".into();
        let claim = Claim { spec, env: BTreeMap::new(), claimed_ms: 2, pool_created_ms: 1 };
        let patch = claim_patch(&claim, "7").unwrap_or_else(|e| panic!("{e}"));
        let text = patch["metadata"]["annotations"][ANNOTATION_CLAIM].as_str().unwrap_or_default().to_string();
        assert!(!patch.to_string().contains("secret-token"));
        let read = claim_of(&claimed_pod("pool-0", Some(text.clone()))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read.map(|c| c.spec.id), Some("pool-0".to_string()));
        assert!(records_claim(&claimed_pod("pool-0", Some(text.clone())), &claim));
        let other = claim_of(&claimed_pod("pool-1", Some(text)));
        assert!(other.as_ref().is_err_and(|e| e.contains("claims sandbox `pool-0`")), "{other:?}");
        let bare = claim_of(&claimed_pod("pool-0", None));
        assert!(bare.as_ref().is_err_and(|e| e.contains("no `sandman.dev/claim` annotation")), "{bare:?}");
        assert_eq!(claim_of(&Pod::default()).ok(), Some(None));
    }

    #[test]
    fn quantities() {
        assert_eq!(cpu_quantity(&Quantity::Number(0.5)).ok(), Some(KubeQuantity("500m".into())));
        assert_eq!(cpu_quantity(&Quantity::Number(2.0)).ok(), Some(KubeQuantity("2".into())));
        assert_eq!(cpu_quantity(&Quantity::Text("250m".into())).ok(), Some(KubeQuantity("250m".into())));
        assert!(cpu_quantity(&Quantity::Number(0.0001)).is_err());
        assert!(cpu_quantity(&Quantity::Text("fast".into())).is_err());
        assert_eq!(byte_quantity("memory", &Quantity::Number(1048576.0)).ok(), Some(KubeQuantity("1048576".into())));
        assert_eq!(byte_quantity("memory", &Quantity::Text("2Gi".into())).ok(), Some(KubeQuantity("2Gi".into())));
    }
}

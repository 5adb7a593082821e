//! [`KubeConfig`]: everything the Kubernetes provider is told by the platform engineer, loadable
//! from a YAML or JSON file; every field has a default, and unknown fields are refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Toleration;
use serde::{Deserialize, Serialize};

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read `{path}`")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{path}` is not a valid kubernetes provider configuration (JSON)")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("`{path}` is not a valid kubernetes provider configuration (YAML)")]
    Yaml {
        path: PathBuf,
        #[source]
        source: Box<serde_saphyr::Error>,
    },
    #[error("invalid kubernetes provider configuration: {0}")]
    Invalid(String),
}

impl From<ConfigError> for sandman_provider::ProviderError {
    fn from(e: ConfigError) -> Self {
        sandman_provider::ProviderError::Unsupported(crate::api::chain(&e))
    }
}

/// Where the task container's `sandmand` comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Injection {
    /// An init container of `daemon_image` copies the daemon into an `emptyDir` (`sandmand
    /// install`). Works on every cluster; costs one small image pull per node and one short init
    /// container per pod.
    #[default]
    InitContainer,
    /// The daemon is read from a directory of the node (`path`/sandmand), put there by the
    /// `sandman-daemon-installer` DaemonSet (`deploy/overlays/hostpath`). No init container.
    HostPath { path: String },
    /// `daemon_image` mounted as an image volume (Kubernetes 1.33+ with the `ImageVolume`
    /// feature; on by default from 1.35) and a runtime that mounts image volumes (containerd 2.1+,
    /// CRI-O 1.31+). No init container, no copy.
    ImageVolume,
}

/// A Kubernetes image pull policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullPolicy {
    Always,
    #[default]
    IfNotPresent,
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// How the daemon's bearer token reaches the pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenDelivery {
    /// A Secret per sandbox, owned by its pod (so the garbage collector removes it with the
    /// pod), mounted read-only. The token never appears in the pod object. Two API writes per
    /// create.
    #[default]
    Secret,
    /// Secrets shared by the sandboxes created together, each pod mounting only its own key
    /// ([`crate::tokens`]): about one API write per create in a burst instead of two. The
    /// token never appears in the pod object; a node that runs one of a Secret's pods may read
    /// the Secret's other tokens (see `docs/kubernetes.md`).
    SharedSecret,
    /// A pod annotation projected into a file through the downward API. One write per create,
    /// but whoever may read pods in the namespace can read the token.
    PodAnnotation,
}

/// The Kubernetes provider's configuration. Start from [`KubeConfig::default`] or
/// [`KubeConfig::from_file`]; `docs/kubernetes.md` describes each field and how to size it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeConfig {
    /// Namespace of the sandbox pods (and their Secrets).
    pub namespace: String,
    /// Tells this server's sandboxes from another server's in the same namespace (label
    /// `sandman.dev/instance`); replicas of one server share it.
    pub instance: String,
    /// The tiny image holding the static `sandmand` at `/sandmand` (`deploy/docker/daemon.Dockerfile`).
    pub daemon_image: String,
    pub daemon_image_pull_policy: PullPolicy,
    /// Pull policy of the task images; unset leaves Kubernetes' default.
    pub image_pull_policy: Option<PullPolicy>,
    pub injection: Injection,
    pub token: TokenDelivery,
    /// The port `sandmand` listens on inside each pod.
    pub daemon_port: u16,
    pub runtime_class: Option<String>,
    pub priority_class: Option<String>,
    /// Unset: the default scheduler.
    pub scheduler_name: Option<String>,
    /// Unset: the namespace's `default` (its token is never mounted either way).
    pub service_account: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    /// Names of Secrets in `namespace` used to pull task images.
    pub image_pull_secrets: Vec<String>,
    /// Extra labels and annotations on every sandbox pod (cost allocation, safe-to-evict…).
    pub pod_labels: BTreeMap<String, String>,
    pub pod_annotations: BTreeMap<String, String>,
    /// Writes to the API server per second, on average, over all of this server's sandboxes.
    pub write_qps: f64,
    /// Writes that may go at once before the average applies.
    pub write_burst: u32,
    /// Calls to the API server (writes and reads, the watch aside) in flight at once. Each is
    /// one connection of the client's pool (HTTP/1.1), reused from call to call: past a few
    /// dozen, a burst opens connections (a TLS handshake each) instead of making pods.
    pub api_concurrency: u32,
    /// cpu and memory of a sandbox that asks for none (unset: none, so the namespace's
    /// LimitRange decides). The `eval` profile needs both, from the request or from here.
    pub default_cpu: Option<String>,
    pub default_memory: Option<String>,
    /// `terminationGracePeriodSeconds` of sandbox pods.
    pub termination_grace_s: u32,
    /// Added to the sandbox's ttl for `activeDeadlineSeconds`, so that the server's reaper, not
    /// the kubelet, normally ends it.
    pub deadline_margin_s: u64,
    /// `activeDeadlineSeconds` of a sandbox without a ttl (unset: none).
    pub default_deadline_s: Option<u64>,
    /// How long pods tolerate an unreachable or not-ready node before they are evicted and
    /// reported `node_lost` (Kubernetes' default is 300 s).
    pub node_lost_after_s: Option<u64>,
    /// How long a create waits for its pod to run before it fails with `ready_timeout`.
    pub create_timeout_s: u64,
    /// How long an unschedulable pod may wait for room (a cluster autoscaler, a preemption)
    /// before its create fails with `unschedulable`; 0 fails at once.
    pub unschedulable_grace_s: u64,
    /// Apply the NetworkPolicy that cuts off `network: none` and `eval` sandboxes (one write at
    /// the first such create). Off when `deploy/` manifests manage it.
    pub manage_network_policy: bool,
    /// The kubelet's `podPidsLimit` on the nodes that run sandboxes, as the operator declares
    /// it. Kubernetes has no per-pod pids field: the kubelet applies its own setting to every
    /// pod of its node, and the provider cannot read it back through the API. Declared, it is
    /// reported as each sandbox's pids limit, and it is what the `eval` profile needs (eval
    /// sandboxes are refused without it); unset, no pids limit is reported.
    pub pod_pids_limit: Option<u64>,
    /// How long [`Provider::prepare`](sandman_provider::Provider::prepare) waits for the nodes
    /// to pull an image; the nodes not done by then are reported failed.
    pub prepare_timeout_s: u64,
    /// Capacity-aware admission ([`crate::capacity`]), on by default: creates wait in the
    /// provider for room on the eligible nodes instead of becoming pods the scheduler cannot
    /// place. It watches every Node and every pod of the cluster, so it needs list and watch on
    /// both cluster-wide; `enabled: false` turns it off (every create makes its pod at once).
    pub capacity: CapacityConfig,
    /// Where snapshots go ([`crate::snapshot`]): unset, snapshots and forks are refused.
    pub snapshots: Option<SnapshotsConfig>,
}

/// The registry the provider pushes snapshots to, as images its nodes pull.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsConfig {
    /// `host[:port]/repository`: snapshot `snap-…` is pushed as `<registry>:snap-…`. The nodes'
    /// container runtime must be able to pull from it (a plain-HTTP registry must be named in
    /// its registry configuration, except on the node's loopback).
    pub registry: String,
    /// Reach the registry over plain HTTP though it is not on loopback.
    #[serde(default)]
    pub insecure: bool,
    /// The credentials file for the pushes and for reading the pods' images from their
    /// registries, instead of `$REGISTRY_AUTH_FILE` or `~/.docker/config.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_file: Option<PathBuf>,
    /// The most bytes the named directories of one snapshot may archive to (held in the
    /// server's memory while the snapshot is made).
    #[serde(default = "default_snapshot_bytes")]
    pub max_bytes: u64,
}

/// 1 GiB.
fn default_snapshot_bytes() -> u64 {
    1 << 30
}

/// The largest `max_bytes` of snapshots: 16 GiB.
pub const MAX_SNAPSHOT_BYTES: u64 = 16 << 30;

/// Capacity-aware admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacityConfig {
    /// On unless set to false.
    pub enabled: bool,
    /// Creates that may make their pods while no eligible node has room for them, so that a
    /// cluster autoscaler sees pending pods and adds nodes. Creates that fit a node are not
    /// bounded by it (they are counted on that node until their pods are bound).
    pub max_pending: usize,
    /// How long a create may wait for room before it fails with `unschedulable`.
    pub wait_s: u64,
}

impl CapacityConfig {
    /// Off: every create makes its pod at once.
    pub fn disabled() -> Self {
        CapacityConfig { enabled: false, ..CapacityConfig::default() }
    }
}

impl Default for CapacityConfig {
    /// A few pending pods are enough for an autoscaler to see the demand (it adds nodes for
    /// all of them at once, and more as those are placed); 10 minutes is what a node takes to
    /// join on most clouds, and what `create_timeout_s` gives a create by default.
    fn default() -> Self {
        CapacityConfig { enabled: true, max_pending: 4, wait_s: 600 }
    }
}

impl Default for KubeConfig {
    fn default() -> Self {
        KubeConfig {
            namespace: "sandman-sandboxes".into(),
            instance: "sandman".into(),
            daemon_image: format!("ghcr.io/sandman-dev/sandmand:{}", env!("CARGO_PKG_VERSION")),
            daemon_image_pull_policy: PullPolicy::IfNotPresent,
            image_pull_policy: None,
            injection: Injection::InitContainer,
            token: TokenDelivery::Secret,
            daemon_port: 7778,
            runtime_class: None,
            priority_class: None,
            scheduler_name: None,
            service_account: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            image_pull_secrets: Vec::new(),
            pod_labels: BTreeMap::new(),
            pod_annotations: BTreeMap::new(),
            write_qps: 50.0,
            write_burst: 100,
            api_concurrency: 32,
            default_cpu: None,
            default_memory: None,
            termination_grace_s: 2,
            deadline_margin_s: 60,
            default_deadline_s: None,
            node_lost_after_s: Some(60),
            create_timeout_s: 600,
            unschedulable_grace_s: 0,
            manage_network_policy: true,
            pod_pids_limit: None,
            prepare_timeout_s: 600,
            capacity: CapacityConfig::default(),
            snapshots: None,
        }
    }
}

impl KubeConfig {
    /// Capacity-aware admission's settings, unless it is turned off.
    pub fn admission(&self) -> Option<&CapacityConfig> {
        self.capacity.enabled.then_some(&self.capacity)
    }

    /// Reads a configuration file: JSON when its name ends in `.json`, YAML otherwise.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let config = if path.extension().is_some_and(|e| e == "json") {
            Self::from_json(&text).map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })?
        } else {
            Self::from_yaml(&text).map_err(|e| ConfigError::Yaml { path: path.to_path_buf(), source: Box::new(e) })?
        };
        config.validate()?;
        Ok(config)
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    pub fn from_yaml(text: &str) -> Result<Self, serde_saphyr::Error> {
        if text.trim().is_empty() {
            return Ok(KubeConfig::default());
        }
        serde_saphyr::from_str(text)
    }

    /// Refuses values no cluster would accept, before any pod is made.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !crate::pod::is_dns_label(&self.namespace) {
            return bad(format!("namespace `{}` is not a valid namespace name", self.namespace));
        }
        if !crate::pod::is_label_value(&self.instance) || self.instance.is_empty() {
            return bad(format!("instance `{}` must be a valid label value", self.instance));
        }
        if self.daemon_image.trim().is_empty() && !matches!(self.injection, Injection::HostPath { .. }) {
            return bad("daemon_image must name the sandmand image".into());
        }
        if let Injection::HostPath { path } = &self.injection
            && (!path.starts_with('/') || path.contains(".."))
        {
            return bad(format!("injection.host_path.path `{path}` must be an absolute path"));
        }
        if !(self.write_qps.is_finite() && self.write_qps > 0.0) {
            return bad(format!("write_qps must be above 0 (it is {})", self.write_qps));
        }
        if self.write_burst == 0 {
            return bad("write_burst must be at least 1".into());
        }
        if self.api_concurrency == 0 {
            return bad("api_concurrency must be at least 1".into());
        }
        if self.daemon_port == 0 {
            return bad("daemon_port must not be 0".into());
        }
        if self.create_timeout_s == 0 {
            return bad("create_timeout_s must be at least 1".into());
        }
        if self.prepare_timeout_s == 0 {
            return bad("prepare_timeout_s must be at least 1".into());
        }
        if self.pod_pids_limit == Some(0) {
            return bad("pod_pids_limit must be at least 1 (leave it out when the nodes set none)".into());
        }
        for (what, q) in [("default_cpu", &self.default_cpu), ("default_memory", &self.default_memory)] {
            if let Some(q) = q
                && let Err(e) = sandman_wire::server::Quantity::Text(q.clone()).value()
            {
                return bad(format!("{what}: {e}"));
            }
        }
        if let Some(snapshots) = &self.snapshots {
            let probe = format!("{}:probe", snapshots.registry);
            if snapshots.registry.contains('@')
                || !snapshots.registry.contains('/')
                || sandman_image::DockerRef::parse(&probe).is_err()
            {
                return bad(format!(
                    "snapshots.registry `{}` must be `host[:port]/repository`, without a tag",
                    snapshots.registry
                ));
            }
            if snapshots.max_bytes == 0 || snapshots.max_bytes > MAX_SNAPSHOT_BYTES {
                return bad(format!("snapshots.max_bytes must be 1 to {MAX_SNAPSHOT_BYTES}"));
            }
        }
        for (k, v) in &self.pod_labels {
            if k.starts_with("sandman.dev/") || k == crate::pod::LABEL_MANAGED_BY {
                return bad(format!("pod_labels: `{k}` is set by sandman itself"));
            }
            if !crate::pod::is_label_value(v) {
                return bad(format!("pod_labels: `{v}` is not a valid label value"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_give_the_same_config() {
        let yaml = r#"
namespace: rl-sandboxes
daemon_image: registry.example/sandmand:1.2.3
daemon_image_pull_policy: Always
injection:
  host_path:
    path: /opt/sandman
runtime_class: gvisor
priority_class: sandman-sandbox
node_selector:
  pool: sandboxes
tolerations:
  - key: dedicated
    operator: Equal
    value: sandboxes
    effect: NoSchedule
image_pull_secrets: [regcred]
write_qps: 20
write_burst: 40
"#;
        let json = r#"{"namespace": "rl-sandboxes", "daemon_image": "registry.example/sandmand:1.2.3",
            "daemon_image_pull_policy": "Always", "injection": {"host_path": {"path": "/opt/sandman"}},
            "runtime_class": "gvisor", "priority_class": "sandman-sandbox", "node_selector": {"pool": "sandboxes"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "sandboxes", "effect": "NoSchedule"}],
            "image_pull_secrets": ["regcred"], "write_qps": 20, "write_burst": 40}"#;
        let from_yaml = KubeConfig::from_yaml(yaml).unwrap_or_else(|e| panic!("{e}"));
        let from_json = KubeConfig::from_json(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from_yaml, from_json);
        assert_eq!(from_yaml.injection, Injection::HostPath { path: "/opt/sandman".into() });
        assert_eq!(from_yaml.tolerations[0].value.as_deref(), Some("sandboxes"));
        assert_eq!(from_yaml.write_burst, 40);
        assert_eq!(from_yaml.create_timeout_s, KubeConfig::default().create_timeout_s);
        from_yaml.validate().unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn a_snapshots_registry_is_a_repository_without_a_tag_and_its_bound_is_bounded() {
        let with = |text: &str| KubeConfig::from_yaml(text).unwrap_or_else(|e| panic!("{e}"));
        let ok = with("snapshots: {registry: \"10.88.0.1:5000/sandman/snapshots\", insecure: true}");
        ok.validate().unwrap_or_else(|e| panic!("{e}"));
        let snapshots = ok.snapshots.unwrap_or_else(|| panic!("no snapshots"));
        assert_eq!((snapshots.insecure, snapshots.max_bytes), (true, 1 << 30));
        for bad in [
            "snapshots: {registry: snapshots}",
            "snapshots: {registry: \"reg.example/snaps:latest\"}",
            "snapshots: {registry: \"reg.example/snaps@sha256:00\"}",
            "snapshots: {registry: \"reg.example/snaps\", max_bytes: 0}",
        ] {
            assert!(matches!(with(bad).validate(), Err(ConfigError::Invalid(m)) if m.contains("snapshots.")), "{bad}");
        }
        assert!(KubeConfig::from_yaml("snapshots: {registry: r.example/s, regsitry: x}").is_err());
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused() {
        assert!(KubeConfig::from_json(r#"{"namespaces": "x"}"#).is_err());
        assert!(KubeConfig::from_yaml("write_qsp: 3\n").is_err());
        assert_eq!(
            KubeConfig::from_yaml("injection: image_volume\n").map(|c| c.injection).ok(),
            Some(Injection::ImageVolume)
        );
        let mut c = KubeConfig { write_qps: 0.0, ..KubeConfig::default() };
        assert!(c.validate().is_err());
        c.write_qps = 5.0;
        c.namespace = "Not_A_Namespace".into();
        assert!(c.validate().is_err());
        c.namespace = "ok".into();
        c.injection = Injection::HostPath { path: "relative/dir".into() };
        assert!(c.validate().is_err());
        c.injection = Injection::InitContainer;
        c.default_memory = Some("lots".into());
        assert!(c.validate().is_err());
        c.default_memory = None;
        c.pod_pids_limit = Some(0);
        assert!(c.validate().is_err());
        c.pod_pids_limit = Some(4096);
        c.prepare_timeout_s = 0;
        assert!(c.validate().is_err());
        c.prepare_timeout_s = 60;
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(KubeConfig::from_yaml("pod_pids_limit: 4096\n").ok().and_then(|c| c.pod_pids_limit), Some(4096));
    }

    #[test]
    fn the_shipped_deploy_configs_load() {
        let files = [
            ("deploy/base/kubernetes.yaml", Injection::InitContainer),
            ("deploy/overlays/hostpath/kubernetes.yaml", Injection::HostPath { path: "/opt/sandman".into() }),
            ("deploy/overlays/image-volume/kubernetes.yaml", Injection::ImageVolume),
        ];
        for (file, injection) in files {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(file);
            let config = KubeConfig::from_file(&path).unwrap_or_else(|e| panic!("{file}: {}", crate::api::chain(&e)));
            assert_eq!(config.namespace, "sandman-sandboxes", "{file}");
            assert_eq!(config.priority_class.as_deref(), Some("sandman-sandbox"), "{file}");
            assert_eq!(config.injection, injection, "{file}");
            assert_eq!(config.admission(), Some(&CapacityConfig::default()), "{file}");
        }
    }

    #[test]
    fn an_empty_file_is_the_default() {
        assert_eq!(KubeConfig::from_yaml("\n").ok(), Some(KubeConfig::default()));
    }

    /// A new user's first burst beyond the nodes' room waited for it only if they had found the
    /// `capacity:` block; without it most creates failed `unschedulable` at once.
    #[test]
    fn capacity_aware_admission_is_on_unless_turned_off() {
        let default = KubeConfig::default();
        let on = default.admission().unwrap_or_else(|| panic!("capacity-aware admission is off by default"));
        assert_eq!((on.max_pending, on.wait_s), (4, 600));
        let some = KubeConfig::from_yaml("capacity: {max_pending: 16}\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(some.admission().map(|c| (c.max_pending, c.wait_s)), Some((16, 600)));
        let off = KubeConfig::from_yaml("capacity: {enabled: false}\n").unwrap_or_else(|e| panic!("{e}"));
        assert!(off.admission().is_none());
        assert!(KubeConfig::from_yaml("capacity: {max_pendin: 1}\n").is_err());
    }
}

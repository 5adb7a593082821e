//! What a sandbox's container is made of, without I/O: its labels (the state of record), the
//! create body (the daemon as entry point, mounts, limits, network, the `eval` profile's fixed
//! conditions), what an inspected container says was applied, and how a container that stopped
//! is reported.

use std::collections::HashMap;
use std::path::Path;

use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerState, HealthConfig, HostConfig, ImageConfig, Mount,
    MountType, RestartPolicy, RestartPolicyNameEnum,
};
use sandman_provider::{Ended, ProviderError, SandboxSpec};
use sandman_wire::server::{Applied, Network, Profile, Quantity, Reason};

use crate::hostdir::HostDir;
use crate::network::Egress;

/// Every sandman container carries it; the events stream and `list` filter on it.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY_VALUE: &str = "sandman";
/// The sandbox id.
pub const SANDBOX_LABEL: &str = "sandman.dev/sandbox";
/// The job, when the sandbox has one.
pub const JOB_LABEL: &str = "sandman.dev/job";
/// The whole `SandboxSpec` as JSON, less the token (which `docker inspect` would show): the
/// state of record a restarted server reads back.
pub const SPEC_LABEL: &str = "sandman.dev/spec";
/// Which provider instance owns the container: its host directory (`<state_dir>/docker`). Servers
/// with other state directories on the same engine leave each other's containers alone.
pub const OWNER_LABEL: &str = "sandman.dev/owner";
/// The image reference the sandbox asked for; the container itself is made from the image's ID
/// that reference named at create, so a tag moved later changes nothing.
pub const IMAGE_LABEL: &str = "sandman.dev/image";

/// Where the daemon binary is mounted (read-only) in every container.
pub const DAEMON_IN_CONTAINER: &str = "/.sandman/sandmand";
/// Where the sandbox's `run/` directory is mounted; the daemon listens on a socket in it.
pub const RUN_IN_CONTAINER: &str = "/.sandman/run";
/// Where the daemon finds its token as it starts, in `run/`, and removes it once read
/// (`--consume-token-file`): nothing that runs in the sandbox after it finds the token there,
/// nor in a mount, the container's environment or `docker inspect`.
pub const TOKEN_IN_CONTAINER: &str = "/.sandman/run/token";
/// The daemon's `--listen` inside the container.
pub const LISTEN_IN_CONTAINER: &str = "unix:/.sandman/run/d.sock";

/// The smallest memory limit the engine accepts.
pub const MIN_MEMORY: u64 = 6 << 20;
/// The smallest cpu limit the engine accepts.
pub const MIN_CPU: f64 = 0.01;

/// The environment of the daemon and of every command in an `eval` sandbox, whatever the image
/// says; a spec that sets one of these to another value is refused.
pub const EVAL_ENV: [(&str, &str); 3] = [("TZ", "UTC"), ("LANG", "C.UTF-8"), ("LC_ALL", "C.UTF-8")];
/// The pids limit of an `eval` sandbox that asks for none.
pub const EVAL_PIDS: i64 = 1024;
/// The kernel keeps a memory limit in whole pages, rounding down; 4 KiB on x86_64, the daemon's
/// target.
pub const PAGE_SIZE: i64 = 4096;
/// The engine turns `NanoCpus` into a CFS quota of this period, truncated to whole microseconds
/// (steps of 0.00001 cores).
pub const CPU_PERIOD_US: i64 = 100_000;

/// `sandman-<id>`.
pub fn container_name(id: &str) -> String {
    format!("sandman-{id}")
}

/// The spec as stored in [`SPEC_LABEL`]: everything but the token.
pub fn spec_label(spec: &SandboxSpec) -> Result<String, ProviderError> {
    let stored = SandboxSpec { token: String::new(), ..spec.clone() };
    serde_json::to_string(&stored).map_err(|e| ProviderError::Backend(format!("cannot encode the spec label: {e}")))
}

/// Reads a spec back from a container's labels; the token comes from the sandbox's host dir.
pub fn spec_from_labels(labels: &HashMap<String, String>, token: String) -> Result<SandboxSpec, String> {
    let raw = labels.get(SPEC_LABEL).ok_or_else(|| format!("no `{SPEC_LABEL}` label"))?;
    let spec: SandboxSpec = serde_json::from_str(raw).map_err(|e| format!("unreadable `{SPEC_LABEL}` label: {e}"))?;
    if labels.get(SANDBOX_LABEL) != Some(&spec.id) {
        return Err(format!("the `{SPEC_LABEL}` label names another sandbox than `{SANDBOX_LABEL}`"));
    }
    Ok(SandboxSpec { token, ..spec })
}

/// Resource limits in the engine's units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub nano_cpus: Option<i64>,
    pub memory: Option<i64>,
    pub pids: Option<i64>,
}

/// Turns `resources` into engine limits, refusing what the engine cannot honour. `host_cpus` is
/// the engine's cpu count: it refuses a larger limit.
pub fn limits(spec: &SandboxSpec, host_cpus: f64) -> Result<Limits, ProviderError> {
    let r = &spec.resources;
    let value =
        |what: &str, q: &Quantity| q.value().map_err(|e| ProviderError::Unsupported(format!("resources.{what}: {e}")));
    if r.disk.is_some() {
        return Err(ProviderError::Unsupported(
            "resources.disk cannot be honoured by the docker provider: the engine limits a container's disk only \
             with a storage driver that has quotas (overlay2 on xfs with pquota); leave it unset"
                .into(),
        ));
    }
    let nano_cpus = match &r.cpu {
        None => None,
        Some(q) => {
            let cpu = value("cpu", q)?;
            if cpu < MIN_CPU {
                return Err(ProviderError::Unsupported(format!("resources.cpu must be at least {MIN_CPU}")));
            }
            if host_cpus > 0.0 && cpu > host_cpus {
                return Err(ProviderError::Unsupported(format!(
                    "resources.cpu {cpu} is more than the docker engine's {host_cpus} cpus"
                )));
            }
            Some((cpu * 1e9).round() as i64)
        }
    };
    let memory = match &r.memory {
        None => None,
        Some(q) => {
            let bytes = value("memory", q)?;
            if bytes < MIN_MEMORY as f64 || bytes >= i64::MAX as f64 {
                return Err(ProviderError::Unsupported(format!(
                    "resources.memory must be at least 6Mi (the engine's minimum), not {bytes} bytes"
                )));
            }
            Some(bytes.round() as i64)
        }
    };
    let pids = match r.pids {
        None => None,
        Some(0) => return Err(ProviderError::Unsupported("resources.pids must be at least 1".into())),
        Some(n) => Some(i64::try_from(n).unwrap_or(i64::MAX)),
    };
    let limits = Limits { nano_cpus, memory, pids };
    if spec.profile == Profile::Eval { eval_limits(spec, limits) } else { Ok(limits) }
}

/// The `eval` profile's fixed resources: cpu and memory are required, and rounded down as the
/// kernel would round them (whole microseconds of quota, whole pages), so that what is applied,
/// and recorded, is exactly what the daemon observes; pids defaults to [`EVAL_PIDS`]. The
/// environment must not contradict [`EVAL_ENV`].
fn eval_limits(spec: &SandboxSpec, limits: Limits) -> Result<Limits, ProviderError> {
    let missing: Vec<&str> = [("resources.cpu", limits.nano_cpus), ("resources.memory", limits.memory)]
        .into_iter()
        .filter_map(|(what, v)| v.is_none().then_some(what))
        .collect();
    if !missing.is_empty() {
        return Err(ProviderError::Unsupported(format!(
            "profile `eval` needs fixed resources: give {} (the docker provider has no default)",
            missing.join(" and ")
        )));
    }
    let contradicting: Vec<String> = EVAL_ENV
        .iter()
        .filter_map(|(k, fixed)| spec.env.get(*k).filter(|v| v != fixed).map(|v| format!("{k}={v}")))
        .collect();
    if !contradicting.is_empty() {
        return Err(ProviderError::Unsupported(format!(
            "profile `eval` fixes TZ=UTC, LANG=C.UTF-8 and LC_ALL=C.UTF-8; the spec's env sets {}: leave them unset",
            contradicting.join(", ")
        )));
    }
    let nano_per_us = 1_000_000_000 / CPU_PERIOD_US;
    Ok(Limits {
        // At least MIN_CPU and 6Mi, both whole steps: rounding never goes below the minimums.
        nano_cpus: limits.nano_cpus.map(|n| n - n % nano_per_us),
        memory: limits.memory.map(|m| m - m % PAGE_SIZE),
        pids: limits.pids.or(Some(EVAL_PIDS)),
    })
}

/// Whether the sandbox has no network beyond loopback: asked for, or the `eval` profile.
pub fn no_network(spec: &SandboxSpec) -> bool {
    spec.network == Network::None || spec.profile == Profile::Eval
}

/// Everything that goes into creating the container.
#[derive(Debug)]
pub struct Plan<'a> {
    pub spec: &'a SandboxSpec,
    /// The image's ID (`sha256:…`) that `spec.image` named at create: the container is made from it.
    pub image_id: &'a str,
    pub image: &'a ImageConfig,
    pub limits: Limits,
    pub owner: &'a str,
    pub daemon_bin: &'a Path,
    pub dir: &'a HostDir,
    /// Where an egress sandbox sits.
    pub egress: &'a Egress,
}

/// The container: the image unmodified (pinned to its ID), the daemon mounted in as its entry
/// point (the image's own entrypoint and command are not run), running as root so that it can
/// reap, kill, take its token and switch users; the image's `Env` and `WorkingDir` are the
/// defaults of every command. An `eval` sandbox also gets [`EVAL_ENV`] and no network.
pub fn body(plan: &Plan<'_>) -> Result<ContainerCreateBody, ProviderError> {
    let spec = plan.spec;
    let workdir = plan.image.working_dir.clone().filter(|w| !w.is_empty()).unwrap_or_else(|| "/".to_string());
    let mut cmd = vec![
        "--listen".to_string(),
        LISTEN_IN_CONTAINER.to_string(),
        "--token-file".to_string(),
        TOKEN_IN_CONTAINER.to_string(),
        "--consume-token-file".to_string(),
        "--workdir".to_string(),
        workdir.clone(),
    ];
    if spec.daemon_lease_s > 0 {
        cmd.push("--lease".into());
        cmd.push(format!("{}s", spec.daemon_lease_s));
    }

    // The engine adds the image's Env to these; the spec's win. SANDMAN_* stays out: the daemon
    // would take SANDMAN_TOKEN for its token (a name without `=` unsets an image's variable).
    let mut env = Vec::new();
    for var in plan.image.env.iter().flatten() {
        let name = var.split_once('=').map_or(var.as_str(), |(k, _)| k);
        if name.starts_with("SANDMAN_") {
            env.push(name.to_string());
        }
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ProviderError::Unsupported(format!("invalid environment variable `{k}`")));
        }
        let fixed = spec.profile == Profile::Eval && EVAL_ENV.iter().any(|(name, _)| name == k);
        if !k.starts_with("SANDMAN_") && !fixed {
            env.push(format!("{k}={v}"));
        }
    }
    // The daemon's own environment is every command's default: these reach them all.
    if spec.profile == Profile::Eval {
        env.extend(EVAL_ENV.iter().map(|(k, v)| format!("{k}={v}")));
    }

    let mut labels = HashMap::from([
        (MANAGED_BY.to_string(), MANAGED_BY_VALUE.to_string()),
        (SANDBOX_LABEL.to_string(), spec.id.clone()),
        (OWNER_LABEL.to_string(), plan.owner.to_string()),
        (SPEC_LABEL.to_string(), spec_label(spec)?),
        (IMAGE_LABEL.to_string(), spec.image.clone()),
    ]);
    if let Some(job) = &spec.job {
        labels.insert(JOB_LABEL.to_string(), job.clone());
    }

    let bind = |source: &Path, target: &str, read_only: bool| Mount {
        source: Some(source.display().to_string()),
        target: Some(target.to_string()),
        typ: Some(MountType::BIND),
        read_only: Some(read_only),
        ..Default::default()
    };
    let host_config = HostConfig {
        mounts: Some(vec![
            bind(plan.daemon_bin, DAEMON_IN_CONTAINER, true),
            bind(&plan.dir.run(), RUN_IN_CONTAINER, false),
        ]),
        // Never the engine's default bridge: sandman's own, held by the host firewall.
        network_mode: Some(if no_network(spec) { "none".to_string() } else { plan.egress.network.clone() }),
        dns: plan.egress.dns.as_ref().filter(|_| !no_network(spec)).map(|d| d.iter().map(|a| a.to_string()).collect()),
        nano_cpus: plan.limits.nano_cpus,
        memory: plan.limits.memory,
        // Equal to memory: no swap on top of the limit.
        memory_swap: plan.limits.memory,
        pids_limit: plan.limits.pids,
        // The daemon is PID 1 and reaps; no docker-init in front of it.
        init: Some(false),
        // Its exit status is the news; the container is removed by `delete`.
        auto_remove: Some(false),
        restart_policy: Some(RestartPolicy { name: Some(RestartPolicyNameEnum::NO), maximum_retry_count: None }),
        ..Default::default()
    };
    Ok(ContainerCreateBody {
        image: Some(plan.image_id.to_string()),
        entrypoint: Some(vec![DAEMON_IN_CONTAINER.to_string()]),
        cmd: Some(cmd),
        env: Some(env),
        working_dir: Some(workdir),
        user: Some("0:0".to_string()),
        // The image's HEALTHCHECK would run its own command in the sandbox; readiness is the
        // daemon's health, asked by the server.
        healthcheck: Some(HealthConfig { test: Some(vec!["NONE".to_string()]), ..Default::default() }),
        labels: Some(labels),
        host_config: Some(host_config),
        ..Default::default()
    })
}

/// The `HostConfig` fields `Applied::details` keeps, under Docker's own names; an unset one is `null`.
pub const HOST_CONFIG_FIELDS: [&str; 16] = [
    "NanoCpus",
    "CpuQuota",
    "CpuPeriod",
    "CpuShares",
    "CpusetCpus",
    "Memory",
    "MemorySwap",
    "MemoryReservation",
    "MemorySwappiness",
    "PidsLimit",
    "NetworkMode",
    "ReadonlyRootfs",
    "Runtime",
    "Init",
    "Privileged",
    "CgroupParent",
];

/// What the engine says it applied to a container, from its `docker inspect`: `repo_digests` are
/// its image's (empty when it has none, as for a locally built image), `cgroup_version` the
/// engine's. Limits the engine leaves unset are `None`.
pub fn applied_of(c: &ContainerInspectResponse, repo_digests: &[String], cgroup_version: Option<&str>) -> Applied {
    let hc = c.host_config.clone().unwrap_or_default();
    let config = c.config.clone().unwrap_or_default();
    let positive = |v: Option<i64>| v.filter(|v| *v > 0);
    let cpu = match (positive(hc.nano_cpus), positive(hc.cpu_quota)) {
        (Some(nano), _) => Some(nano as f64 / 1e9),
        // A period left unset is the kernel's default.
        (None, Some(quota)) => Some(quota as f64 / positive(hc.cpu_period).unwrap_or(CPU_PERIOD_US) as f64),
        (None, None) => None,
    };
    let memory = positive(hc.memory);
    // MemorySwap is memory plus swap; -1 is unlimited, and unset means the engine's default of as
    // much swap as memory.
    let swap = match (memory, hc.memory_swap) {
        (Some(m), Some(total)) if total > 0 => Some(total.saturating_sub(m).max(0) as u64),
        (Some(m), None | Some(0)) => Some(m as u64),
        _ => None,
    };
    let env: HashMap<&str, &str> = config.env.iter().flatten().filter_map(|var| var.split_once('=')).collect();
    let network = if hc.network_mode.as_deref() == Some("none") { "none" } else { "egress" };

    let host = serde_json::to_value(&hc).unwrap_or_default();
    let kept: serde_json::Map<String, serde_json::Value> = HOST_CONFIG_FIELDS
        .iter()
        .map(|k| (k.to_string(), host.get(*k).cloned().unwrap_or(serde_json::Value::Null)))
        .collect();
    let mut details = std::collections::BTreeMap::from([
        ("HostConfig".to_string(), serde_json::Value::Object(kept)),
        ("Config".to_string(), serde_json::json!({ "Image": config.image })),
    ]);
    if !repo_digests.is_empty() {
        details.insert("RepoDigests".to_string(), serde_json::json!(repo_digests));
    }
    if let Some(reference) = config.labels.as_ref().and_then(|l| l.get(IMAGE_LABEL)) {
        details.insert("ImageReference".to_string(), serde_json::json!(reference));
    }
    if let Some(version) = cgroup_version {
        details.insert("CgroupVersion".to_string(), serde_json::json!(version));
    }
    Applied {
        image: c.image.clone(),
        cpu,
        memory: memory.map(|m| m as u64),
        swap,
        pids: positive(hc.pids_limit).map(|p| p as u64),
        network: Some(network.to_string()),
        timezone: env.get("TZ").map(|v| v.to_string()),
        locale: env.get("LC_ALL").or_else(|| env.get("LANG")).map(|v| v.to_string()),
        details,
    }
}

/// Exit code with which `sandmand` reports that its lease lapsed.
pub const EXIT_LEASE_EXPIRED: i64 = 3;

/// How a container that no longer runs is reported. `spec` gives the lease and memory limit for
/// the message; `last_words` is the daemon's last log line, used for exits that are not signals.
pub fn ended_of(state: &ContainerState, spec: Option<&SandboxSpec>, last_words: Option<String>) -> Ended {
    use bollard::models::ContainerStateStatusEnum as Status;
    if state.oom_killed == Some(true) {
        return oom_killed(spec);
    }
    if state.status == Some(Status::CREATED) {
        return Ended { reason: Reason::ProviderError, message: "the container was created but never started".into() };
    }
    let code = state.exit_code.unwrap_or(-1);
    let tail = last_words.map(|w| format!(": {w}")).unwrap_or_default();
    let engine = state.error.as_deref().filter(|e| !e.is_empty()).map(|e| format!(" ({e})")).unwrap_or_default();
    match code {
        EXIT_LEASE_EXPIRED => Ended {
            reason: Reason::LeaseExpired,
            message: match spec {
                Some(s) => format!("the daemon's lease lapsed: no call reached it for {} s", s.daemon_lease_s),
                None => "the daemon's lease lapsed".into(),
            },
        },
        c if c > 128 => Ended {
            reason: Reason::ProviderError,
            message: format!("daemon was killed by signal {} (exit status {c}){engine}", c - 128),
        },
        c => Ended { reason: Reason::ProviderError, message: format!("daemon exited with status {c}{engine}{tail}") },
    }
}

/// The report of a sandbox that went over its memory limit.
pub fn oom_killed(spec: Option<&SandboxSpec>) -> Ended {
    let limit = spec.and_then(|s| s.resources.memory.as_ref()).map(|q| match q {
        Quantity::Text(t) => format!(" of {t}"),
        Quantity::Number(n) => format!(" of {n} bytes"),
    });
    Ended {
        reason: Reason::OomKilled,
        message: format!(
            "out of memory: the sandbox went over its memory limit{} and was killed",
            limit.unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use bollard::models::ContainerStateStatusEnum;
    use sandman_provider::conformance::spec as conformance_spec;
    use sandman_wire::server::Resources;
    use serde_json::json;

    fn spec() -> SandboxSpec {
        let mut s = conformance_spec("sb-1", "img:1");
        s.env.insert("SANDMAN_TOKEN".into(), "hijack".into());
        s
    }

    #[test]
    fn the_spec_label_keeps_everything_but_the_token() {
        let s = spec();
        let label = spec_label(&s).unwrap_or_else(|e| panic!("{e}"));
        assert!(!label.contains(&s.token), "{label}");
        let labels = HashMap::from([(SPEC_LABEL.to_string(), label), (SANDBOX_LABEL.to_string(), s.id.clone())]);
        let back = spec_from_labels(&labels, s.token.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, s);
        let other = HashMap::from([(SPEC_LABEL.to_string(), labels[SPEC_LABEL].clone())]);
        assert!(spec_from_labels(&other, "t".into()).is_err());
        let broken = HashMap::from([(SPEC_LABEL.to_string(), "{".into()), (SANDBOX_LABEL.to_string(), s.id)]);
        assert!(spec_from_labels(&broken, "t".into()).err().unwrap_or_default().contains("unreadable"));
    }

    fn refusal(s: &SandboxSpec) -> String {
        limits(s, 2.0).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn resources_become_engine_limits_and_what_cannot_be_honoured_is_refused() {
        let mut s = spec();
        assert_eq!(limits(&s, 2.0).ok(), Some(Limits::default()));
        s.resources.cpu = Some(Quantity::Text("500m".into()));
        s.resources.memory = Some(Quantity::Text("32Mi".into()));
        s.resources.pids = Some(64);
        let l = limits(&s, 2.0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l, Limits { nano_cpus: Some(500_000_000), memory: Some(32 << 20), pids: Some(64) });
        s.resources.cpu = Some(Quantity::Number(4.0));
        assert!(refusal(&s).contains("2 cpus"));
        s.resources.cpu = None;
        s.resources.memory = Some(Quantity::Text("1Mi".into()));
        assert!(refusal(&s).contains("6Mi"));
        s.resources.memory = None;
        s.resources.disk = Some(Quantity::Text("1Gi".into()));
        assert!(refusal(&s).contains("resources.disk"));
    }

    #[test]
    fn the_daemon_is_the_entry_point_and_the_image_gives_env_and_workdir() {
        let s = SandboxSpec { network: Network::None, ..spec() };
        let image = ImageConfig {
            env: Some(vec!["PATH=/bin".into(), "SANDMAN_TOKEN=from-image".into()]),
            working_dir: Some("/src".into()),
            entrypoint: Some(vec!["/entry".into()]),
            cmd: Some(vec!["serve".into()]),
            ..Default::default()
        };
        let dir = HostDir::new(Path::new("/state/docker"), &s.id);
        let limits = Limits { nano_cpus: None, memory: Some(64 << 20), pids: Some(100) };
        let plan = Plan {
            spec: &s,
            image_id: "sha256:0123",
            image: &image,
            limits,
            owner: "/state/docker",
            daemon_bin: Path::new("/bin/d"),
            dir: &dir,
            egress: &Egress::default(),
        };
        let b = body(&plan).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.image.as_deref(), Some("sha256:0123"), "the container is not made from the pinned ID");
        assert_eq!(b.entrypoint, Some(vec![DAEMON_IN_CONTAINER.to_string()]));
        let cmd = b.cmd.clone().unwrap_or_default().join(" ");
        assert_eq!(
            cmd,
            "--listen unix:/.sandman/run/d.sock --token-file /.sandman/run/token --consume-token-file --workdir /src --lease 300s"
        );
        assert_eq!(b.working_dir.as_deref(), Some("/src"));
        assert_eq!(b.healthcheck.as_ref().and_then(|h| h.test.clone()), Some(vec!["NONE".to_string()]));
        let env = b.env.clone().unwrap_or_default();
        assert!(env.contains(&"CONFORMANCE=yes".to_string()), "{env:?}");
        assert!(env.contains(&"SANDMAN_TOKEN".to_string()), "the image's SANDMAN_TOKEN is not unset: {env:?}");
        assert!(!env.iter().any(|e| e.contains("hijack") || e.contains(&s.token)), "{env:?}");
        let labels = b.labels.clone().unwrap_or_default();
        assert_eq!(labels.get(MANAGED_BY).map(String::as_str), Some("sandman"));
        assert_eq!(labels.get(SANDBOX_LABEL), Some(&s.id));
        assert_eq!(labels.get(JOB_LABEL).map(String::as_str), Some("conformance-job"));
        assert_eq!(labels.get(IMAGE_LABEL).map(String::as_str), Some("img:1"));
        let hc = b.host_config.unwrap_or_default();
        assert_eq!(hc.network_mode.as_deref(), Some("none"));
        assert_eq!((hc.memory, hc.memory_swap, hc.pids_limit), (Some(64 << 20), Some(64 << 20), Some(100)));
        assert_eq!(hc.init, Some(false));
        let mounts = hc.mounts.unwrap_or_default();
        let targets: Vec<_> = mounts.iter().map(|m| (m.target.clone().unwrap_or_default(), m.read_only)).collect();
        assert_eq!(
            targets,
            [(DAEMON_IN_CONTAINER.to_string(), Some(true)), (RUN_IN_CONTAINER.to_string(), Some(false))]
        );
        // Default network and workdir.
        let s = spec();
        let image = ImageConfig::default();
        let plan = Plan { spec: &s, image: &image, limits: Limits::default(), ..plan };
        let b = body(&plan).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.working_dir.as_deref(), Some("/"));
        assert_eq!(b.host_config.and_then(|h| h.network_mode).as_deref(), Some("sandman"), "not on sandman's network");
    }

    fn eval_spec() -> SandboxSpec {
        let mut s = SandboxSpec { profile: Profile::Eval, ..spec() };
        s.resources.cpu = Some(Quantity::Text("500m".into()));
        s.resources.memory = Some(Quantity::Text("64Mi".into()));
        s
    }

    #[test]
    fn eval_requires_cpu_and_memory_rounds_them_as_the_kernel_does_and_defaults_pids() {
        let s = eval_spec();
        let l = limits(&s, 2.0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l, Limits { nano_cpus: Some(500_000_000), memory: Some(64 << 20), pids: Some(EVAL_PIDS) });
        let asked = SandboxSpec { resources: Resources { pids: Some(64), ..s.resources.clone() }, ..s.clone() };
        assert_eq!(limits(&asked, 2.0).ok().and_then(|l| l.pids), Some(64));

        let mut no_cpu = s.clone();
        no_cpu.resources.cpu = None;
        let msg = refusal(&no_cpu);
        assert!(msg.contains("resources.cpu") && !msg.contains("resources.memory"), "{msg}");
        let mut no_memory = s.clone();
        no_memory.resources.memory = None;
        let msg = refusal(&no_memory);
        assert!(msg.contains("resources.memory") && !msg.contains("resources.cpu"), "{msg}");
        let neither = SandboxSpec { resources: Resources::default(), ..s.clone() };
        assert!(refusal(&neither).contains("resources.cpu and resources.memory"), "{}", refusal(&neither));

        // Values the kernel would round are rounded as it would, so the record says what holds.
        let mut odd = s.clone();
        odd.resources.memory = Some(Quantity::Text("1G".into()));
        odd.resources.cpu = Some(Quantity::Number(0.123456789));
        let l = limits(&odd, 2.0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((l.nano_cpus, l.memory), (Some(123_450_000), Some(999_997_440)));

        // The fixed TZ and locale: the same value is fine, another is refused by name.
        let mut same = s.clone();
        same.env.insert("TZ".into(), "UTC".into());
        assert!(limits(&same, 2.0).is_ok());
        let mut other = s;
        other.env.insert("TZ".into(), "Europe/Paris".into());
        other.env.insert("LC_ALL".into(), "fr_FR.UTF-8".into());
        let msg = refusal(&other);
        assert!(msg.contains("TZ=Europe/Paris, LC_ALL=fr_FR.UTF-8"), "{msg}");
        // The default profile is unchanged: no requirement, no default pids.
        let mut default = spec();
        default.env.insert("TZ".into(), "Europe/Paris".into());
        assert_eq!(limits(&default, 2.0).ok(), Some(Limits::default()));
    }

    /// A container inspected as the engine would report the body's create.
    fn inspected(b: &ContainerCreateBody, image_env: &[&str]) -> ContainerInspectResponse {
        let mut config = bollard::models::ContainerConfig {
            image: b.image.clone(),
            labels: b.labels.clone(),
            env: Some(image_env.iter().map(|v| v.to_string()).collect()),
            ..Default::default()
        };
        config.env.get_or_insert_default().extend(b.env.clone().unwrap_or_default());
        ContainerInspectResponse {
            image: b.image.clone(),
            config: Some(config),
            host_config: b.host_config.clone(),
            ..Default::default()
        }
    }

    #[test]
    fn an_eval_container_is_fixed_and_what_was_applied_reads_back() {
        let s = SandboxSpec {
            network: Network::Egress,
            env: BTreeMap::from([("LANG".into(), "C.UTF-8".into()), ("KEEP".into(), "1".into())]),
            ..eval_spec()
        };
        let image = ImageConfig { env: Some(vec!["TZ=America/New_York".into()]), ..Default::default() };
        let dir = HostDir::new(Path::new("/state/docker"), &s.id);
        let limits = limits(&s, 2.0).unwrap_or_else(|e| panic!("{e}"));
        let plan = Plan {
            spec: &s,
            image_id: "sha256:abcd",
            image: &image,
            limits,
            owner: "/state/docker",
            daemon_bin: Path::new("/bin/d"),
            dir: &dir,
            egress: &Egress::default(),
        };
        let b = body(&plan).unwrap_or_else(|e| panic!("{e}"));
        let env = b.env.clone().unwrap_or_default();
        assert_eq!(env, ["KEEP=1", "TZ=UTC", "LANG=C.UTF-8", "LC_ALL=C.UTF-8"], "the spec's LANG is doubled");
        let hc = b.host_config.clone().unwrap_or_default();
        assert_eq!(hc.network_mode.as_deref(), Some("none"), "eval keeps the default network");
        assert_eq!((hc.memory, hc.memory_swap, hc.pids_limit), (Some(64 << 20), Some(64 << 20), Some(EVAL_PIDS)));

        // The engine merges the image's Env under the container's: the image's TZ loses.
        let a = applied_of(&inspected(&b, &["TZ=America/New_York"]), &["img@sha256:ffff".into()], Some("1"));
        assert_eq!(a.image.as_deref(), Some("sha256:abcd"));
        assert_eq!((a.cpu, a.memory, a.swap, a.pids), (Some(0.5), Some(64 << 20), Some(0), Some(1024)));
        assert_eq!(a.network.as_deref(), Some("none"));
        assert_eq!((a.timezone.as_deref(), a.locale.as_deref()), (Some("UTC"), Some("C.UTF-8")));
        let hc = &a.details["HostConfig"];
        assert_eq!((hc["NanoCpus"].clone(), hc["MemorySwap"].clone()), (json!(500_000_000), json!(64 << 20)));
        assert_eq!(hc["NetworkMode"], "none");
        assert!(hc.as_object().is_some_and(|o| o.len() == HOST_CONFIG_FIELDS.len()), "{hc}");
        assert_eq!(a.details["Config"]["Image"], "sha256:abcd");
        assert_eq!(a.details["RepoDigests"], json!(["img@sha256:ffff"]));
        assert_eq!(a.details["ImageReference"], "img:1");
        assert_eq!(a.details["CgroupVersion"], "1");
    }

    #[test]
    fn applied_reads_quotas_unlimited_swap_and_no_limits() {
        let c = |hc: HostConfig| ContainerInspectResponse { host_config: Some(hc), ..Default::default() };
        let quota = c(HostConfig { cpu_quota: Some(150_000), cpu_period: Some(100_000), ..Default::default() });
        assert_eq!(applied_of(&quota, &[], None).cpu, Some(1.5));
        let default_period = c(HostConfig { cpu_quota: Some(50_000), ..Default::default() });
        assert_eq!(applied_of(&default_period, &[], None).cpu, Some(0.5));
        let unlimited = c(HostConfig { memory: Some(1 << 30), memory_swap: Some(-1), ..Default::default() });
        assert_eq!(applied_of(&unlimited, &[], None).swap, None);
        let twice = c(HostConfig { memory: Some(1 << 30), memory_swap: Some(2 << 30), ..Default::default() });
        assert_eq!(applied_of(&twice, &[], None).swap, Some(1 << 30));
        let none = applied_of(&c(HostConfig { pids_limit: Some(-1), ..Default::default() }), &[], None);
        assert_eq!((none.cpu, none.memory, none.swap, none.pids), (None, None, None, None));
        assert_eq!((none.network.as_deref(), none.timezone, none.locale), (Some("egress"), None, None));
        assert!(!none.details.contains_key("RepoDigests"));
    }

    #[test]
    fn exits_map_to_reasons() {
        let s = spec();
        let state = |code: i64, oom: bool| ContainerState {
            status: Some(ContainerStateStatusEnum::EXITED),
            exit_code: Some(code),
            oom_killed: Some(oom),
            ..Default::default()
        };
        assert_eq!(ended_of(&state(3, false), Some(&s), None).reason, Reason::LeaseExpired);
        assert_eq!(ended_of(&state(137, true), Some(&s), None).reason, Reason::OomKilled);
        let killed = ended_of(&state(137, false), Some(&s), Some("INFO listening".into()));
        assert_eq!(killed.message, "daemon was killed by signal 9 (exit status 137)");
        let failed = ended_of(&state(2, false), None, Some("error: no token".into()));
        assert_eq!(
            (failed.reason, failed.message.as_str()),
            (Reason::ProviderError, "daemon exited with status 2: error: no token")
        );
        let mut oom = spec();
        oom.resources.memory = Some(Quantity::Text("32Mi".into()));
        assert!(oom_killed(Some(&oom)).message.contains("limit of 32Mi"));
        assert_eq!(
            sandman_provider::records::last_paragraph("INFO serving\nerror: cannot listen\n  caused by: in use\n")
                .as_deref(),
            Some("error: cannot listen caused by: in use")
        );
    }
}

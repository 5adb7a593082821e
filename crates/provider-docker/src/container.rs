//! What a sandbox's container is made of, without I/O: its labels (the state of record), the
//! create body (the daemon as entry point, mounts, limits, network), and how a container that
//! stopped is reported.

use std::collections::HashMap;
use std::path::Path;

use bollard::models::{
    ContainerCreateBody, ContainerState, HealthConfig, HostConfig, ImageConfig, Mount, MountType, RestartPolicy,
    RestartPolicyNameEnum,
};
use sandman_provider::{Ended, ProviderError, SandboxSpec};
use sandman_wire::server::{Network, Quantity, Reason};

use crate::hostdir::HostDir;

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

/// Where the daemon binary is mounted (read-only) in every container.
pub const DAEMON_IN_CONTAINER: &str = "/.sandman/sandmand";
/// Where the token file is mounted (read-only).
pub const TOKEN_IN_CONTAINER: &str = "/.sandman/token";
/// Where the sandbox's `run/` directory is mounted; the daemon listens on a socket in it.
pub const RUN_IN_CONTAINER: &str = "/.sandman/run";
/// The daemon's `--listen` inside the container.
pub const LISTEN_IN_CONTAINER: &str = "unix:/.sandman/run/d.sock";

/// The smallest memory limit the engine accepts.
pub const MIN_MEMORY: u64 = 6 << 20;
/// The smallest cpu limit the engine accepts.
pub const MIN_CPU: f64 = 0.01;

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
    Ok(Limits { nano_cpus, memory, pids })
}

/// Everything that goes into creating the container.
#[derive(Debug)]
pub struct Plan<'a> {
    pub spec: &'a SandboxSpec,
    pub image: &'a ImageConfig,
    pub limits: Limits,
    pub owner: &'a str,
    pub daemon_bin: &'a Path,
    pub dir: &'a HostDir,
}

/// The container: the image unmodified, the daemon mounted in as its entry point (the image's own
/// entrypoint and command are not run), running as root so that it can reap, kill, read its
/// token and switch users; the image's `Env` and `WorkingDir` are the defaults of every command.
pub fn body(plan: &Plan<'_>) -> Result<ContainerCreateBody, ProviderError> {
    let spec = plan.spec;
    let workdir = plan.image.working_dir.clone().filter(|w| !w.is_empty()).unwrap_or_else(|| "/".to_string());
    let mut cmd = vec![
        "--listen".to_string(),
        LISTEN_IN_CONTAINER.to_string(),
        "--token-file".to_string(),
        TOKEN_IN_CONTAINER.to_string(),
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
        if !k.starts_with("SANDMAN_") {
            env.push(format!("{k}={v}"));
        }
    }

    let mut labels = HashMap::from([
        (MANAGED_BY.to_string(), MANAGED_BY_VALUE.to_string()),
        (SANDBOX_LABEL.to_string(), spec.id.clone()),
        (OWNER_LABEL.to_string(), plan.owner.to_string()),
        (SPEC_LABEL.to_string(), spec_label(spec)?),
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
            bind(&plan.dir.token(), TOKEN_IN_CONTAINER, true),
            bind(&plan.dir.run(), RUN_IN_CONTAINER, false),
        ]),
        network_mode: (spec.network == Network::None).then(|| "none".to_string()),
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
        image: Some(spec.image.clone()),
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

/// The last unindented line of a log with the indented lines after it (`error: …` then
/// `  caused by: …`), on one line.
pub fn last_paragraph(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.iter().rposition(|l| !l.starts_with(char::is_whitespace)).unwrap_or(0);
    let joined = lines.get(start..)?.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
    if joined.is_empty() {
        return None;
    }
    // A runaway line must not make an event huge.
    Some(joined.chars().take(500).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::ContainerStateStatusEnum;
    use sandman_provider::conformance::spec as conformance_spec;

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
            image: &image,
            limits,
            owner: "/state/docker",
            daemon_bin: Path::new("/bin/d"),
            dir: &dir,
        };
        let b = body(&plan).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.entrypoint, Some(vec![DAEMON_IN_CONTAINER.to_string()]));
        let cmd = b.cmd.clone().unwrap_or_default().join(" ");
        assert_eq!(cmd, "--listen unix:/.sandman/run/d.sock --token-file /.sandman/token --workdir /src --lease 300s");
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
        let hc = b.host_config.unwrap_or_default();
        assert_eq!(hc.network_mode.as_deref(), Some("none"));
        assert_eq!((hc.memory, hc.memory_swap, hc.pids_limit), (Some(64 << 20), Some(64 << 20), Some(100)));
        assert_eq!(hc.init, Some(false));
        let mounts = hc.mounts.unwrap_or_default();
        let targets: Vec<_> = mounts.iter().map(|m| (m.target.clone().unwrap_or_default(), m.read_only)).collect();
        assert_eq!(
            targets,
            [
                (DAEMON_IN_CONTAINER.to_string(), Some(true)),
                (TOKEN_IN_CONTAINER.to_string(), Some(true)),
                (RUN_IN_CONTAINER.to_string(), Some(false)),
            ]
        );
        // Default network and workdir.
        let s = spec();
        let image = ImageConfig::default();
        let plan = Plan { spec: &s, image: &image, limits: Limits::default(), ..plan };
        let b = body(&plan).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.working_dir.as_deref(), Some("/"));
        assert_eq!(b.host_config.and_then(|h| h.network_mode), None);
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
            last_paragraph("INFO serving\nerror: cannot listen\n  caused by: in use\n").as_deref(),
            Some("error: cannot listen caused by: in use")
        );
    }
}

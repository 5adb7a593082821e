//! Checking a create request, every number bounded first, and turning it into the spec of what
//! it makes.

use std::collections::BTreeMap;
use std::time::Duration;

use sandman_provider::{Provider, SandboxSpec, ServerMeta};
use sandman_wire::bounds;
use sandman_wire::server::{CreateSandbox, PoolSpec, Profile};

use super::table::Index;
use super::{DAEMON_LEASE_SLACK_S, Service};
use crate::conditions;
use crate::error::{ServerError, ServerResult};
use crate::sandbox::{Sandbox, now_ms};
use crate::sys::random_hex;

/// A create request, checked and turned into what it makes.
#[derive(Debug)]
pub(super) struct Parsed {
    pub(super) spec: SandboxSpec,
    pub(super) lease: Duration,
    pub(super) idle: Option<Duration>,
    pub(super) ttl: Option<Duration>,
}

impl Service {
    /// Fills in a create that names a pool from the pool's spec, refusing one that asks for
    /// other sandboxes than the pool makes.
    pub(super) fn apply_pool(req: &mut CreateSandbox, name: &str, pool: &PoolSpec) -> ServerResult<()> {
        let differs = |what: &str, theirs: String, ours: String| {
            ServerError::InvalidArgument(format!(
                "the create names pool `{name}`, whose {what} is {ours}, not {theirs}"
            ))
        };
        if req.image.is_empty() {
            req.image = pool.image.clone();
        } else if req.image != pool.image {
            return Err(differs("image", format!("`{}`", req.image), format!("`{}`", pool.image)));
        }
        if req.resources == Default::default() {
            req.resources = pool.resources.clone();
        } else if req.resources != pool.resources {
            return Err(differs("resources", format!("{:?}", req.resources), format!("{:?}", pool.resources)));
        }
        if req.profile == Default::default() {
            req.profile = pool.profile;
        } else if req.profile != pool.profile {
            return Err(differs("profile", format!("{:?}", req.profile), format!("{:?}", pool.profile)));
        }
        if req.network == Default::default() {
            req.network = pool.network;
        } else if req.network != pool.network {
            return Err(differs("network", format!("{:?}", req.network), format!("{:?}", pool.network)));
        }
        Ok(())
    }

    /// Refuses a request naming a provider other than this server's.
    pub(super) fn check_provider(&self, asked: Option<&str>) -> ServerResult<()> {
        match asked {
            Some(p) if p != self.provider.name() => Err(ServerError::InvalidArgument(format!(
                "provider `{p}` is not served here; this server runs the `{}` provider",
                self.provider.name()
            ))),
            _ => Ok(()),
        }
    }

    /// What the create asked, with the provider's defaults where it named none: every sandbox
    /// is bounded, and its info says by what. Eval's memory is what it asks or nothing (eval
    /// refuses a create without it).
    fn with_defaults(
        &self,
        asked: &sandman_wire::server::Resources,
        profile: Profile,
    ) -> sandman_wire::server::Resources {
        let d = self.provider.defaults();
        sandman_wire::server::Resources {
            cpu: asked.cpu.clone(),
            memory: asked.memory.clone().or(d.memory.filter(|_| profile != Profile::Eval)),
            disk: asked.disk.clone().or(d.disk),
            pids: asked.pids.or(d.pids),
        }
    }

    /// Checks a create request and turns it into a spec.
    pub(super) fn parse_create(&self, req: &CreateSandbox) -> ServerResult<Parsed> {
        // Every number first: nothing below may add, multiply or convert one out of range.
        req.check_bounds().map_err(bad_number)?;
        if req.image.trim().is_empty() {
            return Err(ServerError::InvalidArgument("`image` is required (or `pool`)".into()));
        }
        self.check_provider(req.provider.as_deref())?;
        check_resources(&req.resources)?;
        if let Some(user) = &req.user {
            check_user(user)?;
        }
        check_env(&req.env)?;
        if req.profile == Profile::Eval {
            conditions::check_eval_env(&req.env).map_err(ServerError::InvalidArgument)?;
        }
        for k in req.labels.keys() {
            if k.is_empty() || k.len() > 63 || !k.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c)) {
                return Err(ServerError::InvalidArgument(format!("invalid label key `{k}`")));
            }
            if k.starts_with("sandman.dev/") {
                return Err(ServerError::InvalidArgument(format!("label key `{k}` is reserved for the server")));
            }
        }
        check_setup(&req.setup)?;
        if let Some(job) = &req.job
            && (job.is_empty() || job.contains('/'))
        {
            return Err(ServerError::InvalidArgument(format!("invalid job name `{job}`")));
        }
        let job_lease = req.job.as_ref().and_then(|j| self.jobs.lease_s(j));
        let lease_s = req.lease_s.or(job_lease).unwrap_or(self.settings.default_lease.as_secs());
        // A job's lease and the server's default were bounded when they were set.
        let lease_s = bounds::LEASE_S.check(lease_s).map_err(bad_number)?;
        let ttl = match (req.ttl_s, self.settings.max_ttl) {
            (Some(t), Some(max)) if Duration::from_secs(t) > max => {
                return Err(ServerError::InvalidArgument(format!(
                    "`ttl_s` is {t}; it must be between 1 and this server's maximum of {} (--max-ttl-s)",
                    max.as_secs()
                )));
            }
            (Some(t), _) => Some(Duration::from_secs(t)),
            (None, max) => max,
        };
        let idle = req.idle_timeout_s.map(Duration::from_secs);
        let spec = SandboxSpec {
            id: new_id(),
            image: req.image.clone(),
            resources: self.with_defaults(&req.resources, req.profile),
            env: req.env.clone(),
            labels: req.labels.clone(),
            job: req.job.clone(),
            profile: req.profile,
            network: req.network,
            token: random_hex(),
            daemon_lease_s: lease_s.saturating_add(DAEMON_LEASE_SLACK_S),
            created_at_ms: now_ms(),
            server: ServerMeta {
                lease_s,
                idle_timeout_s: req.idle_timeout_s,
                ttl_s: ttl.map(|t| t.as_secs()),
                idempotency_key: req.idempotency_key.clone(),
                user: req.user.clone(),
                weight: req.job.as_ref().and_then(|j| self.jobs.weight(j)),
                auto_resume: req.auto_resume,
            },
        };
        Ok(Parsed { spec, lease: Duration::from_secs(lease_s), idle, ttl })
    }

    /// Refuses a create that would take `job` past its `max_sandboxes`.
    pub(super) fn check_quota(&self, table: &Index, job: Option<&str>) -> ServerResult<()> {
        let Some(job) = job else { return Ok(()) };
        let Some(max) = self.jobs.max_sandboxes(job) else { return Ok(()) };
        let live = table.live_of_job(job);
        if live >= max {
            return Err(ServerError::QuotaExceeded(format!(
                "job `{job}` has {live} live sandboxes, its max_sandboxes quota"
            )));
        }
        Ok(())
    }
}

/// A create's `user`: a name or `uid`, optionally `:group` or `:gid`, as the daemon resolves it.
fn check_user(user: &str) -> ServerResult<()> {
    let ok_part = |p: &str| {
        !p.is_empty() && p.len() <= 64 && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    let ok = match user.split_once(':') {
        Some((u, g)) => ok_part(u) && ok_part(g),
        None => ok_part(user),
    };
    if ok {
        Ok(())
    } else {
        Err(ServerError::InvalidArgument(format!(
            "`user` `{user}` is not a user name or uid, optionally with `:group` or `:gid`"
        )))
    }
}

pub(super) fn check_resources(r: &sandman_wire::server::Resources) -> ServerResult<()> {
    r.check_bounds().map_err(bad_number)
}

/// A caller's number out of its range: `400 invalid_argument` naming the field and the range.
pub(super) fn bad_number(e: bounds::OutOfRange) -> ServerError {
    ServerError::InvalidArgument(e.to_string())
}

pub(super) fn check_env(env: &BTreeMap<String, String>) -> ServerResult<()> {
    for k in env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ServerError::InvalidArgument(format!("invalid environment variable name `{k}`")));
        }
    }
    Ok(())
}

pub(super) fn check_setup(setup: &[String]) -> ServerResult<()> {
    if setup.len() > 64 {
        return Err(ServerError::InvalidArgument("`setup` takes at most 64 commands".into()));
    }
    if setup.iter().any(|c| c.trim().is_empty() || c.contains('\0')) {
        return Err(ServerError::InvalidArgument("every `setup` command must be a non-empty shell string".into()));
    }
    Ok(())
}

pub(super) fn new_id() -> String {
    format!("sb-{}", &random_hex()[..12])
}

/// Refuses a retried create whose idempotency key names a sandbox made from a different request:
/// answering that sandbox would hand the caller something it did not ask for.
pub(super) fn same_request(sb: &Sandbox, req: &CreateSandbox) -> ServerResult<()> {
    let have = sb.to_wire();
    let mut differs = Vec::new();
    if have.image != req.image {
        differs.push("image");
    }
    if have.job != req.job {
        differs.push("job");
    }
    if have.profile != req.profile {
        differs.push("profile");
    }
    if have.network != req.network {
        differs.push("network");
    }
    if have.labels != req.labels {
        differs.push("labels");
    }
    if differs.is_empty() {
        return Ok(());
    }
    Err(ServerError::Conflict(format!(
        "idempotency key `{}` was used for sandbox `{}` with a different {}",
        req.idempotency_key.as_deref().unwrap_or_default(),
        have.id,
        differs.join(", ")
    )))
}

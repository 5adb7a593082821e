//! Prometheus metrics of the server, served as text at `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use sandman_wire::server::{Reason, SandboxState, UsageRecord};
use std::sync::atomic::AtomicU64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabel {
    pub provider: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabel {
    pub job: String,
}

/// A SandboxFusion API call's job (empty for the server's token) and outcome: `success`,
/// `failed` (the program's own failure), `sandbox_error` (the service's), `not_started` (504),
/// `invalid`, `unauthorized`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FusionLabel {
    pub job: String,
    pub outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobStateLabel {
    pub job: String,
    pub state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobReasonLabel {
    pub job: String,
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    pub pool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolStateLabel {
    pub pool: String,
    pub state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ViaLabel {
    /// `immediate` (nothing was queueing) or `queue`.
    pub via: String,
}

type FloatCounter = Counter<f64, AtomicU64>;
type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub created: Family<ProviderLabel, Counter>,
    pub ended: Family<ReasonLabel, Counter>,
    pub sandboxes: Family<StateLabel, Gauge>,
    pub create_to_ready: Histogram,
    pub proxied: Counter,
    pub heartbeats: Counter,
    // ---- admission ----
    pub queue_depth: Gauge,
    pub queue_wait: Histogram,
    pub queue_rejected: Counter,
    pub admitted: Family<ViaLabel, Counter>,
    pub create_rate_allowed: FloatGauge,
    pub create_rate_achieved: FloatGauge,
    // ---- pools ----
    pub claim_latency: Histogram,
    pub pool_claims: Family<PoolLabel, Counter>,
    pub pool_sandboxes: Family<PoolStateLabel, Gauge>,
    // ---- accounting ----
    pub job_sandbox_seconds: Family<JobLabel, FloatCounter>,
    pub job_cpu_seconds: Family<JobLabel, FloatCounter>,
    pub job_ended: Family<JobReasonLabel, Counter>,
    /// Live sandboxes of each job by state, set at each scrape (see [`Metrics::job_states`]).
    pub job_sandboxes: Family<JobStateLabel, Gauge>,
    /// Ready sandboxes a timer should have ended a while ago, set at each scrape: non-zero
    /// means the reaper is behind or stuck.
    pub past_deadline: Gauge,
    // ---- the SandboxFusion API ----
    pub fusion_calls: Family<FusionLabel, Counter>,
    // ---- pause ----
    /// Time a pause took (the provider's freeze), and a resume (its thaw).
    pub pause_latency: Histogram,
    pub resume_latency: Histogram,
    /// Calls that found their sandbox paused and resumed it (`auto_resume`).
    pub auto_resumes: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("sandman");
        let created = Family::<ProviderLabel, Counter>::default();
        let ended = Family::<ReasonLabel, Counter>::default();
        let sandboxes = Family::<StateLabel, Gauge>::default();
        let create_to_ready =
            Histogram::new([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]);
        let proxied = Counter::default();
        let heartbeats = Counter::default();
        registry.register("sandboxes_created", "Sandboxes created, by provider", created.clone());
        registry.register("sandboxes_ended", "Sandboxes ended, by reason", ended.clone());
        registry.register("sandboxes", "Sandboxes known to the server, by state", sandboxes.clone());
        registry.register("create_to_ready_seconds", "Time from create to ready", create_to_ready.clone());
        registry.register("proxied_requests", "Daemon calls proxied to sandboxes", proxied.clone());
        registry.register("job_heartbeats", "Job heartbeats received", heartbeats.clone());
        let queue_depth = Gauge::default();
        let queue_wait =
            Histogram::new([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]);
        let queue_rejected = Counter::default();
        let admitted = Family::<ViaLabel, Counter>::default();
        let create_rate_allowed = FloatGauge::default();
        let create_rate_achieved = FloatGauge::default();
        let claim_latency =
            Histogram::new([0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0]);
        let pool_claims = Family::<PoolLabel, Counter>::default();
        let pool_sandboxes = Family::<PoolStateLabel, Gauge>::default();
        let job_sandbox_seconds = Family::<JobLabel, FloatCounter>::default();
        let job_cpu_seconds = Family::<JobLabel, FloatCounter>::default();
        let job_ended = Family::<JobReasonLabel, Counter>::default();
        registry.register("admission_queue_depth", "Creates waiting in the admission queue", queue_depth.clone());
        registry.register(
            "admission_queue_wait_seconds",
            "Time creates waited in the admission queue",
            queue_wait.clone(),
        );
        registry.register(
            "admission_rejected",
            "Creates refused because the admission queue was full",
            queue_rejected.clone(),
        );
        registry.register("creates_admitted", "Creates admitted, at once or from the queue", admitted.clone());
        registry.register(
            "create_rate_allowed_per_second",
            "The global create rate (0 = unlimited)",
            create_rate_allowed.clone(),
        );
        registry.register(
            "create_rate_achieved_per_second",
            "Creates admitted per second over the last 10 s",
            create_rate_achieved.clone(),
        );
        registry.register(
            "pool_claim_seconds",
            "Time from a create to its claim of a warm sandbox",
            claim_latency.clone(),
        );
        registry.register("pool_claims", "Creates served from a warm pool, by pool", pool_claims.clone());
        registry.register(
            "pool_sandboxes",
            "Sandboxes of each warm pool, by state (ready, creating, claimed)",
            pool_sandboxes.clone(),
        );
        registry.register(
            "job_sandbox_seconds",
            "Wall seconds of ended sandboxes, by job",
            job_sandbox_seconds.clone(),
        );
        registry.register(
            "job_cpu_seconds",
            "CPU seconds of ended sandboxes where reported, by job",
            job_cpu_seconds.clone(),
        );
        registry.register("job_sandboxes_ended", "Ended sandboxes, by job and reason", job_ended.clone());
        let job_sandboxes = Family::<JobStateLabel, Gauge>::default();
        registry.register(
            "job_sandboxes",
            "Live sandboxes of each job, by state (queued, creating, ready, releasing)",
            job_sandboxes.clone(),
        );
        let past_deadline = Gauge::default();
        registry.register(
            "sandboxes_past_deadline",
            "Ready sandboxes whose lease, idle timeout or lifetime passed over a minute ago and that are not reclaimed",
            past_deadline.clone(),
        );
        let fusion_calls = Family::<FusionLabel, Counter>::default();
        registry.register(
            "fusion_calls",
            "SandboxFusion API calls, by job and outcome (sandbox_error and not_started are the service's failures)",
            fusion_calls.clone(),
        );
        let pause_buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0];
        let pause_latency = Histogram::new(pause_buckets);
        let resume_latency = Histogram::new(pause_buckets);
        let auto_resumes = Counter::default();
        registry.register("pause_seconds", "Time a pause took to freeze its sandbox", pause_latency.clone());
        registry.register("resume_seconds", "Time a resume took to thaw its sandbox", resume_latency.clone());
        registry.register(
            "auto_resumes",
            "Calls that found their sandbox paused and resumed it (auto_resume)",
            auto_resumes.clone(),
        );
        // Every state shows, at zero when empty.
        for s in SandboxState::ALL {
            let _ = sandboxes.get_or_create(&StateLabel { state: s.as_str().into() });
        }
        Metrics {
            registry,
            created,
            ended,
            sandboxes,
            create_to_ready,
            proxied,
            heartbeats,
            queue_depth,
            queue_wait,
            queue_rejected,
            admitted,
            create_rate_allowed,
            create_rate_achieved,
            claim_latency,
            pool_claims,
            pool_sandboxes,
            job_sandbox_seconds,
            job_cpu_seconds,
            job_ended,
            job_sandboxes,
            past_deadline,
            fusion_calls,
            pause_latency,
            resume_latency,
            auto_resumes,
        }
    }
}

impl Metrics {
    /// Moves one sandbox between state gauges.
    pub fn moved(&self, from: Option<SandboxState>, to: SandboxState) {
        if let Some(f) = from {
            self.sandboxes.get_or_create(&StateLabel { state: f.as_str().into() }).dec();
        }
        self.sandboxes.get_or_create(&StateLabel { state: to.as_str().into() }).inc();
    }

    /// A sandbox forgotten after its retention.
    pub fn forgotten(&self, state: SandboxState) {
        self.sandboxes.get_or_create(&StateLabel { state: state.as_str().into() }).dec();
    }

    pub fn ended(&self, reason: Reason) {
        self.ended.get_or_create(&ReasonLabel { reason: reason.as_str().into() }).inc();
    }

    /// The counters of one accounting record.
    pub fn accounted(&self, rec: &UsageRecord) {
        let job = rec.job.clone().unwrap_or_default();
        self.job_sandbox_seconds.get_or_create(&JobLabel { job: job.clone() }).inc_by(rec.wall_seconds);
        if let Some(cpu) = rec.cpu_seconds {
            self.job_cpu_seconds.get_or_create(&JobLabel { job: job.clone() }).inc_by(cpu);
        }
        self.job_ended.get_or_create(&JobReasonLabel { job, reason: rec.reason.as_str().into() }).inc();
    }

    /// Sets the gauges of one pool's sizes.
    pub fn pool_sizes(&self, pool: &str, ready: u64, creating: u64, claimed: u64) {
        for (state, n) in [("ready", ready), ("creating", creating), ("claimed", claimed)] {
            self.pool_sandboxes.get_or_create(&PoolStateLabel { pool: pool.into(), state: state.into() }).set(n as i64);
        }
    }

    /// Drops a deleted pool's gauges.
    pub fn pool_removed(&self, pool: &str) {
        for state in ["ready", "creating", "claimed"] {
            self.pool_sandboxes.remove(&PoolStateLabel { pool: pool.into(), state: state.into() });
        }
    }

    /// Sets the per-job gauges from every sandbox's (job, state): only live states count, and a
    /// job with no live sandbox drops out.
    pub fn job_states<'a>(&self, sandboxes: impl Iterator<Item = (&'a str, SandboxState)>) {
        let mut counts: std::collections::BTreeMap<(&str, &str), i64> = Default::default();
        for (job, state) in sandboxes.filter(|(_, s)| !s.is_terminal()) {
            *counts.entry((job, state.as_str())).or_default() += 1;
        }
        self.job_sandboxes.clear();
        for ((job, state), n) in counts {
            self.job_sandboxes.get_or_create(&JobStateLabel { job: job.into(), state: state.into() }).set(n);
        }
    }

    pub fn admitted(&self, via: &str, n: u64) {
        self.admitted.get_or_create(&ViaLabel { via: via.into() }).inc_by(n);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(%e, "cannot encode metrics");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_has_the_families() {
        let m = Metrics::default();
        m.created.get_or_create(&ProviderLabel { provider: "process".into() }).inc();
        m.moved(None, SandboxState::Creating);
        m.moved(Some(SandboxState::Creating), SandboxState::Ready);
        m.ended(Reason::LeaseExpired);
        let text = m.encode();
        assert!(text.contains("sandman_sandboxes_created_total{provider=\"process\"} 1"), "{text}");
        assert!(text.contains("sandman_sandboxes{state=\"ready\"} 1"), "{text}");
        assert!(text.contains("sandman_sandboxes{state=\"creating\"} 0"), "{text}");
        assert!(text.contains("sandman_sandboxes_ended_total{reason=\"lease_expired\"} 1"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }
}

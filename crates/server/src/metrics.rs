//! Prometheus metrics of the server, served as text at `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use sandman_wire::server::{Reason, SandboxState};

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

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub created: Family<ProviderLabel, Counter>,
    pub ended: Family<ReasonLabel, Counter>,
    pub sandboxes: Family<StateLabel, Gauge>,
    pub create_to_ready: Histogram,
    pub proxied: Counter,
    pub heartbeats: Counter,
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
        // Every state shows, at zero when empty.
        for s in SandboxState::ALL {
            let _ = sandboxes.get_or_create(&StateLabel { state: s.as_str().into() });
        }
        Metrics { registry, created, ended, sandboxes, create_to_ready, proxied, heartbeats }
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

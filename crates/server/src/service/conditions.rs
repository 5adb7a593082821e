//! Conditions records: what the provider applied and the daemon observes, signed by the server
//! (taken at readiness for `eval` sandboxes, at the first ask for others), and their
//! verification. The signing and comparing are [`crate::conditions`]'s.

use sandman_provider::{Endpoint, Provider};
use sandman_wire::daemon::Observed;
use sandman_wire::server::{Asked, ConditionsRecord, SandboxState, SignedConditions, Verification};

use super::{Daemons, Service};
use crate::conditions;
use crate::daemon;
use crate::error::{ServerError, ServerResult};
use crate::sandbox::{Sandbox, now_ms};

impl Service {
    /// The sandbox's signed conditions record: taken once (at readiness for `eval` sandboxes,
    /// at the first ask for others) and kept, then written with its accounting record.
    pub async fn conditions(&self, id: &str) -> ServerResult<SignedConditions> {
        let sb = self.get(id)?;
        let (state, endpoint, kept) = {
            let inner = sb.lock();
            (inner.state, inner.endpoint.clone(), inner.conditions.clone())
        };
        if let Some(kept) = kept {
            return Ok(kept);
        }
        let endpoint = match (state, endpoint) {
            (SandboxState::Ready, Some(e)) => e,
            (SandboxState::Queued | SandboxState::Creating, _) => {
                return Err(ServerError::Conflict(format!(
                    "sandbox `{id}` is {}; its conditions are recorded once it is ready",
                    state.as_str()
                )));
            }
            _ => return Err(sb.gone_error()),
        };
        let signed = self.take_conditions(&sb, &endpoint).await.map_err(ServerError::Unavailable)?;
        Ok(sb.lock().conditions.get_or_insert(signed).clone())
    }

    /// Asks the provider what it applied and the daemon what it observes, and signs the record.
    pub(super) async fn take_conditions(&self, sb: &Sandbox, endpoint: &Endpoint) -> Result<SignedConditions, String> {
        let signer = self.signer.as_ref().map_err(Clone::clone)?;
        if self.settings.daemons == Daemons::Absent {
            return Err("this server's sandboxes have no daemon to observe them".into());
        }
        let applied = self
            .provider
            .applied(sb.id())
            .await
            .map_err(|e| format!("the provider could not say what it applied: {e}"))?;
        let observed: Observed = daemon::call_json::<(), _>(
            &self.daemons,
            endpoint,
            &sb.spec.token,
            http::Method::GET,
            "/v1/conditions",
            None,
        )
        .await
        .map_err(|e| format!("the daemon could not report what it observes: {e}"))?;
        let mismatches = conditions::mismatches(&applied, &observed);
        Ok(signer.sign(ConditionsRecord {
            sandbox: sb.id().to_string(),
            job: sb.spec.job.clone(),
            provider: self.provider.name().to_string(),
            isolation: Some(self.provider.isolation()),
            server_version: crate::VERSION.to_string(),
            recorded_ms: now_ms(),
            asked: Asked {
                image: sb.spec.image.clone(),
                resources: sb.spec.resources.clone(),
                profile: sb.spec.profile,
                network: sb.spec.network,
            },
            applied,
            observed,
            mismatches,
        }))
    }

    /// Whether a signed conditions record is intact and signed by this server.
    pub fn verify(&self, signed: &serde_json::Value) -> ServerResult<Verification> {
        let signer = self.signer.as_ref().map_err(|e| ServerError::Unavailable(e.clone()))?;
        Ok(signer.verify(signed))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use sandman_provider::Endpoint;
    use sandman_provider::fake::FakeProvider;
    use sandman_testkit::standin::StandIn;
    use sandman_wire::daemon::Observed;
    use sandman_wire::server::{Applied, Profile};
    use serde_json::Value;

    use crate::provider::AnyProvider;
    use crate::service::{Service, Settings};

    /// The service over the fake provider, whose every sandbox's daemon is a stand-in holding
    /// the sandbox's token: it proves it to the health check and answers `GET /v1/conditions`
    /// with `observed`.
    async fn with_daemon(dir: &Path, applied: Applied, observed: Observed) -> Arc<Service> {
        let sockets = dir.to_path_buf();
        let observed = serde_json::to_value(observed).unwrap_or_else(|e| panic!("{e}"));
        // The stand-ins live as long as the service's provider.
        let standins = std::sync::Mutex::new(Vec::new());
        let fake = FakeProvider::each_at(move |spec| {
            let socket = sockets.join(format!("{}.sock", spec.id));
            let standin = StandIn::unix(&socket, Some(&spec.token));
            standin.answer("/v1/conditions", observed.clone());
            standins.lock().unwrap_or_else(|e| panic!("{e}")).push(standin);
            Endpoint::Unix(socket)
        });
        fake.set_applied(applied);
        std::fs::create_dir_all(dir.join("state")).unwrap_or_else(|e| panic!("{e}"));
        let settings = Settings { create_rate: None, ..Settings::new(dir.join("state")) };
        let service = Service::new(settings, AnyProvider::Fake(fake), "t".into());
        service.start_background();
        service
    }

    fn eval_create(job: &str) -> sandman_wire::server::CreateSandbox {
        sandman_wire::server::CreateSandbox {
            image: "any".into(),
            job: Some(job.into()),
            profile: Profile::Eval,
            wait: true,
            ..Default::default()
        }
    }

    fn strict() -> Applied {
        Applied { pids: Some(64), network: Some("none".into()), timezone: Some("UTC".into()), ..Default::default() }
    }

    #[tokio::test]
    async fn an_eval_sandbox_is_ready_with_its_record_which_verifies_and_outlives_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let observed = Observed {
            daemon_version: "test".into(),
            cgroup_pids_limit: Some(64),
            network_interfaces: vec!["lo".into()],
            timezone: Some("UTC".into()),
            ..Default::default()
        };
        let s = with_daemon(dir.path(), strict(), observed.clone()).await;
        let sb = s.create(eval_create("ev")).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sb.state, sandman_wire::server::SandboxState::Ready);
        let signed = s.conditions(&sb.id).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(signed.record.observed, observed);
        assert_eq!(signed.record.applied, strict());
        assert_eq!((signed.record.asked.profile, signed.record.mismatches.len()), (Profile::Eval, 0));
        let value = serde_json::to_value(&signed).unwrap_or_default();
        assert!(s.verify(&value).map(|v| v.valid).unwrap_or(false));
        let mut tampered = value.clone();
        tampered["record"]["observed"]["cgroup_pids_limit"] = Value::from(4096);
        assert!(!s.verify(&tampered).map(|v| v.valid).unwrap_or(true));
        // The record taken at readiness is the one answered, and the one kept after release.
        let again = s.conditions(&sb.id).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again, signed);
        s.release(&sb.id, sandman_wire::server::Reason::Released).await.unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("state").join(crate::accounting::FILE);
        let mut lines = String::new();
        for _ in 0..500 {
            lines = std::fs::read_to_string(&file).unwrap_or_default();
            if !lines.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let rec: sandman_wire::server::UsageRecord =
            serde_json::from_str(lines.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rec.conditions, Some(signed));
    }

    #[tokio::test]
    async fn an_eval_sandbox_whose_daemon_sees_other_conditions_fails_naming_them() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let observed = Observed {
            cgroup_pids_limit: None,
            network_interfaces: vec!["eth0".into(), "lo".into()],
            timezone: Some("UTC".into()),
            ..Default::default()
        };
        let s = with_daemon(dir.path(), strict(), observed).await;
        let err = s.create(eval_create("ev")).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("conditions_mismatch"), "{err}");
        assert!(err.contains("pids applied 64 but observed none") && err.contains("eth0"), "{err}");
        assert!(!err.contains("timezone"), "{err}");
        // A default sandbox on the same server is not held to it; its record flags the same.
        let default = sandman_wire::server::CreateSandbox { profile: Profile::Default, ..eval_create("d") };
        let sb = s.create(default).await.unwrap_or_else(|e| panic!("{e}"));
        let signed = s.conditions(&sb.id).await.unwrap_or_else(|e| panic!("{e}"));
        let fields: Vec<&str> = signed.record.mismatches.iter().map(|m| m.field.as_str()).collect();
        assert_eq!(fields, ["pids", "network"]);
    }

    #[tokio::test]
    async fn an_eval_create_that_sets_the_fixed_environment_is_refused() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = with_daemon(dir.path(), Applied::default(), Observed::default()).await;
        let mut req = eval_create("ev");
        req.env.insert("TZ".into(), "America/New_York".into());
        let err = s.create(req).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("TZ=America/New_York"), "{err}");
    }

    #[tokio::test]
    async fn a_claimed_eval_sandbox_keeps_the_record_taken_when_its_pool_made_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let observed = Observed {
            cgroup_pids_limit: Some(64),
            network_interfaces: vec!["lo".into()],
            timezone: Some("UTC".into()),
            ..Default::default()
        };
        let s = with_daemon(dir.path(), strict(), observed).await;
        let pool = sandman_wire::server::PoolSpec {
            image: "any".into(),
            profile: Profile::Eval,
            min_ready: 1,
            ..Default::default()
        };
        s.put_pool("ev", pool).unwrap_or_else(|e| panic!("{e}"));
        let mut ready = 0;
        for _ in 0..500 {
            ready = s.pool("ev").map(|p| p.ready).unwrap_or(0);
            if ready > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(ready, 1);
        let req = sandman_wire::server::CreateSandbox { pool: Some("ev".into()), ..eval_create("claimer") };
        let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
        let signed = s.conditions(&sb.id).await.unwrap_or_else(|e| panic!("{e}"));
        // Taken before the claim: no job then, and the same sandbox.
        assert_eq!((signed.record.sandbox.as_str(), signed.record.job.as_deref()), (sb.id.as_str(), None));
        assert!(signed.record.recorded_ms <= sb.created_at_ms, "{} > {}", signed.record.recorded_ms, sb.created_at_ms);
    }
}

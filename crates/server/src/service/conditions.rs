//! Conditions records: what the provider applied and the daemon observes, signed by the server
//! as the sandbox becomes ready (before any command of its own runs), kept in the ready journal
//! and never taken again; and their verification. The signing and comparing are
//! [`crate::conditions`]'s.

use sandman_provider::{Endpoint, Provider};
use sandman_wire::daemon::Observed;
use sandman_wire::server::{Asked, ConditionsRecord, SandboxState, SignedConditions, Verification};

use super::{Daemons, Service};
use crate::conditions;
use crate::daemon::{self, CallError};
use crate::error::{ServerError, ServerResult};
use crate::sandbox::{Recorded, Sandbox, now_ms};

impl Service {
    /// The sandbox's signed conditions record, as it was taken when the sandbox became ready;
    /// kept after it ends, for its accounting record and for as long as the server remembers it.
    pub async fn conditions(&self, id: &str) -> ServerResult<SignedConditions> {
        let sb = self.get(id)?;
        let (state, kept) = {
            let inner = sb.lock();
            (inner.state, inner.conditions.clone())
        };
        match (kept, state) {
            (Recorded::Taken(signed), _) => Ok(*signed),
            (_, SandboxState::Queued | SandboxState::Creating) => Err(ServerError::Conflict(format!(
                "sandbox `{id}` is {}; its conditions are recorded once it is ready",
                state.as_str()
            ))),
            (_, s) if s != SandboxState::Ready => Err(sb.gone_error()),
            (Recorded::Missing(why), _) => Err(ServerError::Conflict(format!(
                "sandbox `{id}` has no conditions record: {why}. A record is taken only as a sandbox becomes ready, \
                 before anything of its own runs in it, never later"
            ))),
            (Recorded::NotYet, _) => Err(ServerError::Unavailable(match &self.signer {
                Err(e) => e.clone(),
                Ok(_) => "this server's sandboxes have no daemon to observe them".into(),
            })),
        }
    }

    /// Asks the provider what it applied and the daemon what it observes, and signs the record.
    /// [`CallError::Unproven`] when a new connection to the daemon failed its proof; any other
    /// failure (the key, the provider, the daemon) said whole.
    pub(super) async fn take_conditions(
        &self,
        sb: &Sandbox,
        endpoint: &Endpoint,
    ) -> Result<SignedConditions, CallError> {
        let signer = self.signer.as_ref().map_err(|e| CallError::Failed(e.clone()))?;
        if self.settings.daemons == Daemons::Absent {
            return Err(CallError::Failed("this server's sandboxes have no daemon to observe them".into()));
        }
        let observed: Observed = daemon::call_json::<(), _>(
            &self.daemons,
            endpoint,
            &sb.spec.token,
            http::Method::GET,
            "/v1/conditions",
            None,
        )
        .await
        .map_err(|e| match e {
            CallError::Unproven(why) => CallError::Unproven(why),
            e => CallError::Failed(format!("the daemon could not report what it observes: {e}")),
        })?;
        let applied = self
            .provider
            .applied(sb.id())
            .await
            .map_err(|e| CallError::Failed(format!("the provider could not say what it applied: {e}")))?;
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

    /// Before, a record was taken at readiness for `eval` sandboxes only, at the first ask for
    /// others, and kept in memory: after a restart it was taken again from whatever answered at
    /// the daemon's address, and a sandbox that had put a daemon of its own there got a forged
    /// record signed, and every later call with the token. Now every sandbox's record is taken
    /// as it becomes ready, kept in the ready journal, and served as it was after a restart; a
    /// daemon put in the real one's place fails its proof on the new connection and the
    /// sandbox ends `daemon_untrusted`, with nothing sent there.
    #[tokio::test]
    async fn a_record_is_taken_once_at_readiness_and_served_the_same_after_a_restart() {
        use sandman_provider::Provider;
        use sandman_wire::server::{Reason, SandboxState};
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let observed = Observed { daemon_version: "real".into(), cpu_model: "Xeon".into(), ..Default::default() };
        let s = with_daemon(dir.path(), Applied::default(), observed.clone()).await;
        let req = sandman_wire::server::CreateSandbox { profile: Profile::Default, ..eval_create("j") };
        let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
        // Taken before the create answered, with nothing asked.
        let kept = s.get(&sb.id).map(|sb| sb.lock().conditions.clone()).unwrap_or_else(|e| panic!("{e}"));
        let signed = kept.taken().cloned().unwrap_or_else(|| panic!("no record at readiness: {kept:?}"));
        assert_eq!(signed.record.observed, observed);
        let AnyProvider::Fake(fake) = &s.provider else { unreachable!() };
        let records = fake.list().await.unwrap_or_else(|e| panic!("{e}"));
        let endpoint = records[0].endpoint.clone();
        s.cancel.cancel();
        drop(s);

        // The sandbox's code moves the daemon's socket aside and serves its own there.
        let Endpoint::Unix(socket) = &endpoint else { unreachable!() };
        std::fs::rename(socket, dir.path().join("moved.sock")).unwrap_or_else(|e| panic!("{e}"));
        let impostor = StandIn::unix(socket, Some("a-token-of-its-own"));
        let forged = Observed { cpu_model: "FORGED CPU".into(), ..observed };
        impostor.answer("/v1/conditions", serde_json::to_value(forged).unwrap_or_default());

        let restarted = FakeProvider::new(endpoint.clone());
        for r in records {
            restarted.restore(r);
        }
        let settings = Settings { create_rate: None, ..Settings::new(dir.path().join("state")) };
        let s = Service::new(settings, AnyProvider::Fake(restarted), "t".into());
        s.start_background();
        s.recover().await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.conditions(&sb.id).await.ok(), Some(signed.clone()), "not the record taken at readiness");
        // The restart renews the daemon's lease at once: on a new connection, which the
        // impostor cannot prove.
        let mut state = None;
        for _ in 0..500 {
            state = s.get(&sb.id).ok().map(|sb| sb.to_wire());
            if state.as_ref().is_some_and(|w| w.state == SandboxState::Failed) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let state = state.unwrap_or_else(|| panic!("forgotten"));
        assert_eq!((state.state, state.reason), (SandboxState::Failed, Some(Reason::DaemonUntrusted)), "{state:?}");
        assert!(
            state.message.as_deref().unwrap_or_default().contains("did not prove the sandbox's token"),
            "{state:?}"
        );
        assert_eq!(impostor.calls_with_a_token(), 0, "the impostor was sent the token");
        assert_eq!(s.conditions(&sb.id).await.ok(), Some(signed), "an ended sandbox keeps its record");
    }
}

//! The hook a server replica sets for the API server refusing its credentials (`401`): the first
//! refused call runs it, naming the call (a deleted replica's pod runs on with a dead token, and
//! must stop rather than fail the creates the next leader would carry out). Its own test binary:
//! the hook is set once per process.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::sync::Mutex;

use common::{NAMESPACE, Reply, mock};
use http::StatusCode;
use sandman_provider::Provider;
use sandman_provider::conformance::spec;
use sandman_provider_kube::{CapacityConfig, IdentityCheck, KubeConfig, KubeProvider};

static REFUSED: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[tokio::test]
async fn the_first_call_the_api_server_refuses_as_unauthorized_runs_the_hook() {
    sandman_provider_kube::shared::on_credentials_refused(|what| REFUSED.lock().unwrap().push(what.to_string()));
    let (client, _mock) = mock(|_| {
        Reply::Json(
            StatusCode::UNAUTHORIZED,
            serde_json::json!({"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401, "message": "Unauthorized"}),
        )
    });
    let config = KubeConfig {
        namespace: NAMESPACE.into(),
        daemon_image: "sandmand:test".into(),
        capacity: CapacityConfig::disabled(),
        ..KubeConfig::default()
    };
    let provider = KubeProvider::new(client, config).unwrap().with_identity_check(IdentityCheck::Trust);
    let err = provider.create(&spec("sb-1", "busybox")).await.unwrap_err();
    assert!(err.to_string().contains("Unauthorized"), "{err}");
    let refused = REFUSED.lock().unwrap().clone();
    assert!(!refused.is_empty(), "the hook did not run");
    assert!(refused[0].contains("sandman-sb-1") || refused[0].contains("secret"), "{refused:?}");
}

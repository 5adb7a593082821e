//! The provider conformance suite against the real Docker engine and the static `sandmand`, its
//! daemon checked over the Unix socket in the sandbox's host directory.
#![allow(clippy::unwrap_used)]

mod common;

use common::{BUSYBOX, MISSING, State, check_daemon, docker, id};
use sandman_provider::conformance::{self, spec};
use sandman_provider::{Endpoint, SandboxSpec};
use sandman_provider_docker::container_name;
use sandman_wire::server::{Profile, Quantity};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_docker_provider_passes_the_suite() {
    let state = State::new();
    let p = state.provider().await;
    conformance::create_list_delete(&p, spec(&id("conf-c1"), BUSYBOX), check_daemon).await;
    conformance::many_at_once(&p, (0..6).map(|i| spec(&id(&format!("conf-m{i}")), BUSYBOX)).collect()).await;
    // Eval is honoured: its spec round-trips through the records; one without resources is refused.
    let mut eval = SandboxSpec { profile: Profile::Eval, ..spec(&id("conf-e1"), BUSYBOX) };
    eval.resources.cpu = Some(Quantity::Text("250m".into()));
    eval.resources.memory = Some(Quantity::Text("32Mi".into()));
    conformance::create_list_delete(&p, eval, check_daemon).await;
    let bare = SandboxSpec { profile: Profile::Eval, ..spec(&id("conf-r1"), BUSYBOX) };
    conformance::refuses_clearly(&p, bare, "resources.cpu and resources.memory").await;
    conformance::refuses_clearly(&p, spec(&id("conf-r2"), MISSING), MISSING).await;
    let second = state.provider().await;
    conformance::found_again_after_restart(&p, &second, spec(&id("conf-f1"), BUSYBOX)).await;
    let dead = id("conf-d1");
    conformance::death_is_reported(&p, spec(&dead, BUSYBOX), |_: Endpoint| async {
        docker(&["kill", &container_name(&dead)]);
    })
    .await;
    assert!(state.containers().is_empty(), "containers left behind: {:?}", state.containers());
    assert!(state.sandbox_dirs().is_empty(), "sandbox directories left behind: {:?}", state.sandbox_dirs());
}

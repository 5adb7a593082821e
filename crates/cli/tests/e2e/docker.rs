//! Docker for the end-to-end tests: the shared harness's fixtures (the engine and the test images
//! checked, the static daemon found, the containers of a state directory removed however a test
//! ends), and the containers of one sandbox.
#![allow(unused_imports)]

pub use sandman_testkit::docker::{Cleanup, containers_with_label, docker, require_docker};
pub use sandman_testkit::static_daemon;

pub fn containers_of(id: &str) -> Vec<String> {
    containers_with_label(&format!("sandman.dev/sandbox={id}"))
}

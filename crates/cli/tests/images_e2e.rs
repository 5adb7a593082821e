//! Task images through the real server on the process provider (isolated, root, as CI runs),
//! pulled from a real registry the test starts on 127.0.0.1: a create of an image runs as the
//! image says (its user, working directory, environment), `prepare` pulls ahead, and the store
//! is listed, pruned and kept from removing what sandboxes run, through the API and the CLI.
#![allow(clippy::unwrap_used)]

mod e2e;

use e2e::{Server, TOKEN, cli, scratch};
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage, busybox_layer, host_arch};
use sandman_testkit::require_root;
use serde_json::json;

fn app_image() -> TestImage {
    let app = LayerBuilder::new().dir("srv").dir("srv/app").file("srv/app/hello.txt", b"hi\n").build(Compression::Gzip);
    let run =
        json!({"Env": ["PATH=/bin:/usr/bin", "GREETING=from the image"], "WorkingDir": "/srv/app", "User": "1000"});
    TestImage::with_config(vec![busybox_layer(), app], host_arch(), run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_runs_as_it_says_and_the_store_keeps_what_sandboxes_run() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    registry.push("test/app", "1", &app_image()).await;
    let reference = registry.reference("test/app", "1");
    let other = LayerBuilder::new().file("other.txt", b"other\n").build(Compression::Gzip);
    registry
        .push("test/other", "1", &TestImage::with_config(vec![busybox_layer(), other], host_arch(), json!({})))
        .await;
    let unused = registry.reference("test/other", "1");
    let server = Server::start_in(&dir.path().join("state"), &[]);
    let http = server.client();

    // Pulled ahead, a line per layer in the events.
    let (code, out, err) = cli(&server, &["prepare", &reference]);
    assert_eq!(code, 0, "{out}{err}");
    let events = http.get("/v1/events").await.json();
    assert!(events.to_string().contains("layer"), "no layer progress among the events: {events}");

    let sb = http.create(json!({"image": reference})).await;
    assert_eq!(sb["state"], "ready", "{sb}");
    assert_eq!(sb["image_config"]["user"], "1000", "{sb}");
    let id = sb["id"].as_str().unwrap().to_string();
    let r = http.exec(&id, json!({"command": "id -u; pwd; echo \"$GREETING\"; cat hello.txt"})).await;
    assert_eq!(r["stdout"], "1000\n/srv/app\nfrom the image\nhi\n", "{r}");

    // Listed with the sandbox that runs it, and not removed while it does.
    let (code, out, err) = cli(&server, &["images"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("127.0.0.1") && out.contains("test/app:1"), "{out}");
    let listed = http.get("/v1/images").await.ok();
    assert_eq!(listed["images"][0]["sandboxes"], 1, "{listed}");
    let refused = http.call("DELETE", &format!("/v1/images?image={reference}"), e2e::Body::Empty).await;
    refused.error(409, "conflict");
    // A prune takes what no sandbox runs (the other image, pulled ahead), never what one does.
    let (code, _, err) = cli(&server, &["prepare", &unused]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(http.get("/v1/images").await.ok()["images"].as_array().unwrap().len(), 2);
    let (code, out, err) = cli(&server, &["images", "prune"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("removed sha256:").count(), 1, "{out}");
    let left = http.get("/v1/images").await.ok();
    assert_eq!(left["images"].as_array().unwrap().len(), 1, "{left}");
    assert!(left.to_string().contains("test/app:1"), "a prune took a running image: {left}");

    // Once released, it goes.
    http.release(&id).await;
    let (code, out, err) = cli(&server, &["images", "rm", &reference]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("removed sha256:"), "{out}");
    let after = http.get("/v1/images").await.ok();
    assert_eq!((after["images"].as_array().unwrap().len(), after["size"].as_u64()), (0, Some(0)), "{after}");
    let (code, _, err) = cli(&server, &["images", "rm", &reference]);
    assert_eq!(code, 1, "removing what is not there is a clean no: {err}");
}

/// A create of an image no registry has fails `image_pull_failed`, in the registry's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_fails_its_create_in_the_registrys_words() {
    require_root();
    let dir = tempfile::tempdir_in(scratch()).unwrap();
    let registry = Registry::start(Auth::Anonymous, dir.path());
    let server = Server::start_in(&dir.path().join("state"), &[]);
    let http = server.client();
    let missing = registry.reference("test/none", "1");
    let resp = http.post("/v1/sandboxes", json!({"image": missing})).await;
    let body = resp.json();
    assert_eq!(body["error"]["reason"], "image_pull_failed", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("test/none"), "{body}");
    let _ = TOKEN;
}

//! Task images on the process provider, against a real registry (the CNCF distribution server,
//! started by the test on 127.0.0.1) and real daemons, isolated (root, as CI runs): a sandbox's
//! root is the image's layers, unpacked once into the store and mounted idmapped, with the
//! image's configuration; pulls are shared; failures say what the registry said.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use common::{call, out, provider, ready, require_root, sh, socket_of, state_dir};
use sandman_provider::conformance::spec;
use sandman_provider::{Provider, ProviderError, SandboxSpec};
use sandman_provider_process::{Isolation, ProcessProvider};
use sandman_testkit::LoggedDir;
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage, busybox_layer, host_arch};
use sandman_wire::server::{Network, Reason};
use serde_json::json;

/// A runnable image: busybox, then a layer with the app's files that also deletes `/etc/group`.
fn app_image() -> TestImage {
    let app = LayerBuilder::new()
        .dir("srv")
        .dir("srv/app")
        .file("srv/app/hello.txt", b"hello from the image's layer\n")
        .whiteout("etc/group")
        .build(Compression::Zstd);
    let run = json!({
        "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "FROM_IMAGE=app"],
        "WorkingDir": "/srv/app",
        "User": "1000",
        "Cmd": ["sh"],
    });
    TestImage::with_config(vec![busybox_layer(), app], host_arch(), run)
}

/// The app image in a registry of a fresh state directory, and an isolated provider of that
/// directory (root, as CI runs): what most tests here start from.
struct WithApp {
    p: ProcessProvider,
    reference: String,
    _registry: Registry,
    state: LoggedDir,
}

async fn with_app() -> WithApp {
    require_root();
    let state = state_dir();
    let registry = Registry::start(Auth::Anonymous, state.path());
    registry.push("test/app", "1", &app_image()).await;
    let p = provider(state.path(), Isolation::Full);
    WithApp { p, reference: registry.reference("test/app", "1"), _registry: registry, state }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_of_an_image_has_its_layers_as_root_and_its_config() {
    let WithApp { p, reference, .. } = &with_app().await;
    let s = spec("img1", reference);
    let ep = ready(p, &s).await;
    let r = sh(
        &ep,
        &s.token,
        "pwd; echo \"$FROM_IMAGE\"; cat hello.txt; test -e /etc/group; echo group=$?; id -u; \
         stat -c '%u %a' /bin/busybox /home/user/.profile; test -e /usr/lib/os-release; echo host=$?; \
         echo mine > /srv/app/written && cat /srv/app/written",
    )
    .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    let text = out(&r);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        ["/srv/app", "app", "hello from the image's layer", "group=1", "0", "0 755", "1000 644", "host=1", "mine"],
        "{r}"
    );
    // The provider knows the image's configuration (the server takes its user as the default).
    let config = p.image_config(&s.id).await.unwrap().unwrap();
    assert_eq!((config.user.as_deref(), config.workdir.as_deref()), (Some("1000"), Some("/srv/app")));
    let applied = p.applied(&s.id).await.unwrap();
    assert!(applied.image.as_deref().unwrap().contains("test/app:1@sha256:"), "{applied:?}");
    p.delete(&s.id).await.unwrap();
}

/// One unpacked copy of each layer serves every sandbox, whatever its id range; what one sandbox
/// writes, no other sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_share_one_unpacked_copy_and_write_only_their_own_layer() {
    let WithApp { p, reference, state, .. } = &with_app().await;
    let (a, b) = (spec("share-a", reference), spec("share-b", reference));
    let (ea, eb) = (ready(p, &a).await, ready(p, &b).await);
    let wa = sh(&ea, &a.token, "echo a > /srv/app/hello.txt; cat /srv/app/hello.txt; cat /proc/self/uid_map").await;
    let wb = sh(&eb, &b.token, "cat /srv/app/hello.txt; cat /proc/self/uid_map").await;
    assert!(out(&wa).starts_with("a\n"), "{wa}");
    assert!(out(&wb).starts_with("hello from the image's layer\n"), "a write reached another sandbox: {wb}");
    let first_id =
        |v: &serde_json::Value| out(v).lines().last().unwrap().split_whitespace().nth(1).unwrap().to_string();
    assert_ne!(first_id(&wa), first_id(&wb), "two sandboxes share host ids");
    // Two layers in the store, each once.
    let layers = std::fs::read_dir(state.path().join("images/layers")).unwrap().count();
    assert_eq!(layers, 2);
    p.delete(&a.id).await.unwrap();
    p.delete(&b.id).await.unwrap();
}

/// Regression (issue 30): creates of one uncached image each pulled it; they share one pull now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_of_one_uncached_image_pull_it_once() {
    require_root();
    let state = state_dir();
    let registry = Registry::start(Auth::Anonymous, state.path());
    let image = app_image();
    registry.push("test/app", "1", &image).await;
    let p = provider(state.path(), Isolation::Full);
    let reference = registry.reference("test/app", "1");
    let specs: Vec<_> = (0..8).map(|i| spec(&format!("burst{i}"), &reference)).collect();
    let made = futures_join(specs.iter().map(|s| p.create(s))).await;
    for (m, s) in made.iter().zip(&specs) {
        let ep = m.as_ref().unwrap_or_else(|e| panic!("{}: {e}", s.id));
        common::wait_healthy(&socket_of(ep)).await.unwrap();
    }
    for layer in &image.layers {
        assert_eq!(registry.requests("GET", &layer.digest), 1, "layer {} fetched more than once", layer.digest);
    }
    for s in &specs {
        p.delete(&s.id).await.unwrap();
    }
}

/// A missing image, and one whose registry refuses the pull, fail `image_pull_failed` in the
/// registry's own words; nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_refused_image_fails_with_the_registrys_words() {
    require_root();
    let state = state_dir();
    let registry = Registry::start(Auth::Basic { user: "u".into(), password: "p".into() }, state.path());
    let p = provider(state.path(), Isolation::Full);
    for (id, repo, says) in [("miss", "test/none", "UNAUTHORIZED"), ("miss2", "test/none", "refused")] {
        let err = p.create(&spec(id, &registry.reference(repo, "1"))).await.err().unwrap();
        match err {
            ProviderError::Failed { reason: Reason::ImagePullFailed, message } => {
                assert!(message.contains(repo) && message.contains(says), "{message}");
            }
            other => panic!("not image_pull_failed: {other}"),
        }
    }
    assert!(p.list().await.unwrap().is_empty());
    let anonymous = Registry::start(Auth::Anonymous, state.path());
    let err = p.create(&spec("miss3", &anonymous.reference("test/none", "1"))).await.err().unwrap();
    assert!(err.to_string().contains("MANIFEST_UNKNOWN") || err.to_string().contains("NAME_UNKNOWN"), "{err}");
    assert_eq!(err.reason(), Reason::ImagePullFailed);
}

/// An image with no shell and nothing else runs what it is given by argv; the daemon needs
/// nothing from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_with_no_shell_runs_argv() {
    require_root();
    let state = state_dir();
    let registry = Registry::start(Auth::Anonymous, state.path());
    let busybox =
        std::fs::read(if std::path::Path::new("/bin/busybox").exists() { "/bin/busybox" } else { "/usr/bin/busybox" })
            .unwrap();
    let only = LayerBuilder::new().file_with("busybox", &busybox, 0o755, 0, 0).build(Compression::Gzip);
    registry.push("test/bare", "1", &TestImage::with_config(vec![only], host_arch(), json!({}))).await;
    let p = provider(state.path(), Isolation::Full);
    let s = spec("bare", &registry.reference("test/bare", "1"));
    let ep = ready(&p, &s).await;
    let r = call(
        &socket_of(&ep),
        "POST",
        "/v1/exec",
        Some(&s.token),
        Some(json!({"argv": ["/busybox", "echo", "no shell needed"]})),
    )
    .await
    .unwrap()
    .json();
    assert_eq!((r["exit_code"].as_i64(), r["stdout"].as_str()), (Some(0), Some("no shell needed\n")), "{r}");
    let r = call(&socket_of(&ep), "POST", "/v1/exec", Some(&s.token), Some(json!({"argv": ["/busybox", "ls", "/"]})))
        .await
        .unwrap()
        .json();
    let listed: Vec<&str> = r["stdout"].as_str().unwrap().lines().collect();
    assert!(listed.contains(&"busybox") && !listed.contains(&"usr"), "the host's root shows: {r}");
    p.delete(&s.id).await.unwrap();
}

/// Regression: the daemon, still the host's root in the host's tree while it assembled an image
/// sandbox's root, wrote its `/etc/resolv.conf` and made its working directory through the
/// image's symbolic links, so an image whose `etc` climbed out of its root (`../` enough times,
/// then the host's tree as the daemon sees it) wrote files in any host directory, `/etc` itself
/// included. The links resolve inside the sandbox's root now, as the sandbox resolves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_images_links_out_of_its_root_lead_nowhere_on_the_host() {
    require_root();
    let state = state_dir();
    let bait = tempfile::tempdir_in(common::scratch()).unwrap();
    let host_dir = bait.path().to_str().unwrap().trim_start_matches('/').to_string();
    // The host's tree is at /host in the provider's template namespace, and at / without one.
    let climb = |under: &str| format!("{}{under}{host_dir}", "../".repeat(40));
    let escape = LayerBuilder::new()
        .symlink("etc", &climb("host/"))
        .symlink("abs", &format!("/host/{host_dir}"))
        .build(Compression::Gzip);
    let run = json!({"Env": ["PATH=/bin"], "WorkingDir": "/abs/work"});
    let registry = Registry::start(Auth::Anonymous, state.path());
    registry.push("test/escape", "1", &TestImage::with_config(vec![busybox_layer(), escape], host_arch(), run)).await;
    let p = provider(state.path(), Isolation::Full);
    let s = spec("escape", &registry.reference("test/escape", "1"));
    let ep = ready(&p, &s).await;
    let r = sh(&ep, &s.token, "pwd -P; grep -c nameserver /etc/resolv.conf; readlink /etc").await;
    assert_eq!(r["exit_code"], 0, "{r}");
    let inside = format!("/host/{host_dir}");
    assert_eq!(out(&r), format!("{inside}/work\n1\n{}\n", climb("host/")), "{r}");
    let written: Vec<_> = std::fs::read_dir(bait.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(written.is_empty(), "the sandbox's files were written on the host: {written:?}");
    p.delete(&s.id).await.unwrap();
}

/// Regression: a sandbox of an image had the host's hostname, which leaked the machine's name
/// and which nothing in the image resolved (`hostname -i` failed, where a container's name is
/// its address). Its name is its id now, in /etc/hostname, and /etc/hosts names its address by
/// it; without a network it has the name and no address, as a container has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_sandbox_is_named_by_its_id_and_its_name_resolves() {
    let WithApp { p, reference, .. } = &with_app().await;
    let s = spec("named_1", reference);
    let ep = ready(p, &s).await;
    let r = sh(&ep, &s.token, "hostname; cat /etc/hostname; hostname -i; ip -4 -o addr show eth0").await;
    assert_eq!(r["exit_code"], 0, "{r}");
    let text = out(&r);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[..2], ["named-1", "named-1"], "{r}");
    assert!(lines[3].contains(&format!("inet {}/", lines[2])), "the name is not the address of eth0: {r}");
    let offline = SandboxSpec { network: Network::None, ..spec("named-2", reference) };
    let ep = ready(p, &offline).await;
    let r = sh(&ep, &offline.token, "hostname; hostname -i; echo $?").await;
    assert_eq!(out(&r).lines().next(), Some("named-2"), "{r}");
    assert!(out(&r).ends_with("1\n"), "the name resolved with no network: {r}");
    p.delete(&s.id).await.unwrap();
    p.delete(&offline.id).await.unwrap();
}

/// Runs futures concurrently on the current task.
async fn futures_join<F: Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out = Vec::new();
    let mut pending: Vec<_> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut left = false;
        for (i, f) in pending.iter_mut().enumerate() {
            if let Some(fut) = f {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        results[i] = Some(v);
                        *f = None;
                    }
                    std::task::Poll::Pending => left = true,
                }
            }
        }
        if left { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.extend(results.into_iter().map(|r| r.unwrap()));
    out
}

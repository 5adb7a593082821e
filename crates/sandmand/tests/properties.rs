//! Property tests of the daemon's router, in-process (no socket): arbitrary JSON bodies, numbers
//! and query strings on every call never panic the daemon and never answer 5xx. Commands are
//! held to `/bin/true` and paths to a scratch directory, so that arbitrary input does no harm.
//! A test binary of its own: the daemon's child reaper owns every `wait4` of the process.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use proptest::prelude::*;
use sandmand::children::{self, Children};
use sandmand::spawn::Defaults;
use sandmand::state::{Config, Daemon};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Field names of the daemon's requests and query strings.
const FIELDS: &[&str] = &[
    "argv",
    "command",
    "env",
    "cwd",
    "user",
    "stdin",
    "timeout_ms",
    "max_output_bytes",
    "tag",
    "retain_bytes",
    "data",
    "close",
    "signal",
    "shell",
    "from",
    "to",
    "overwrite",
    "path",
    "offset",
    "length",
    "mode",
    "depth",
    "recursive",
    "stream",
    "follow",
    "max_bytes",
];

struct World {
    rt: tokio::runtime::Runtime,
    app: Router,
    daemon: Arc<Daemon>,
    scratch: tempfile::TempDir,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let (app, daemon) = rt.block_on(async {
        let children = Children::new();
        // Leaked on purpose: the reaper serves the whole test binary.
        std::mem::forget(children::install_reaper(children.clone(), CancellationToken::new()).unwrap());
        let config = Config {
            token: "t".into(),
            max_upload_bytes: 1 << 20,
            limits: sandmand::Limits { disk_bytes: 1 << 20, ..sandmand::Limits::default() },
            shutdown_grace: Duration::from_secs(1),
            listen: "test".into(),
            workdir: Some(scratch.path().to_path_buf()),
        };
        let defaults = Defaults::from_process("/bin/sh".into(), Some(scratch.path().to_path_buf()));
        let daemon = Daemon::new(config, defaults, children, None);
        (sandmand::api::router(daemon.clone()), daemon)
    });
    World { rt, app, daemon, scratch }
});

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..100_000).prop_map(Value::from),
        Just(Value::from(u64::MAX)),
        any::<f64>().prop_filter("JSON has no NaN or infinity", |f| f.is_finite()).prop_map(Value::from),
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        number(),
        "[a-zA-Z0-9:/._-]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![prop::sample::select(FIELDS).prop_map(str::to_string), "[a-z_]{1,8}"],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Holds what arbitrary input could do to the machine: every command is `/bin/true` (or `true`
/// for a shell), every path lies in the scratch directory.
fn defang(v: &mut Value, scratch: &str) {
    match v {
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                match k.as_str() {
                    "argv" => *v = serde_json::json!(["/bin/true"]),
                    "command" => *v = Value::from("true"),
                    "shell" => *v = Value::from("/bin/sh"),
                    "cwd" | "path" | "from" | "to" => {
                        *v = Value::from(format!("{scratch}/{}", v.as_str().unwrap_or("x")))
                    }
                    _ => defang(v, scratch),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| defang(v, scratch)),
        _ => {}
    }
}

fn query() -> impl Strategy<Value = String> {
    prop::collection::vec((prop::sample::select(FIELDS), "[a-zA-Z0-9%._-]{0,24}"), 0..4)
        .prop_map(|pairs| pairs.into_iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_calls_never_panic_nor_answer_5xx(
        route in prop::sample::select(sandmand::api::ROUTES),
        id in prop_oneof![Just("p-1".to_string()), "[a-z0-9-]{1,6}"],
        q in query(),
        mut body in json(),
        raw in any::<bool>(),
    ) {
        let world = &*WORLD;
        let scratch = world.scratch.path().to_string_lossy().into_owned();
        defang(&mut body, &scratch);
        let (method, path) = route;
        let path = path.replace("{id}", &id);
        // Any `path` in the query is moved into the scratch directory too.
        let q: String = q
            .split('&')
            .map(|kv| match kv.strip_prefix("path=") {
                Some(p) => format!("path={scratch}/{p}"),
                None => kv.to_string(),
            })
            .collect::<Vec<_>>()
            .join("&");
        let text = if raw { body.to_string().replace('"', "") } else { body.to_string() };
        let req = axum::http::Request::builder()
            .method(method)
            .uri(format!("{path}?{q}"))
            .header("authorization", "Bearer t")
            .header("content-type", "application/json")
            .body(Body::from(text))
            .unwrap();
        let app = world.app.clone();
        let status = world.rt.block_on(async move {
            match tokio::time::timeout(Duration::from_secs(20), app.oneshot(req)).await {
                Ok(resp) => Some(resp.unwrap_or_else(|e| match e {}).status().as_u16()),
                Err(_) => None,
            }
        });
        // Sessions outlive their call: end them, and anything else still running, each time.
        world.daemon.kill_everything();
        match status {
            Some(s) => prop_assert!(s < 500, "{method} {path}?{q} {body}: {s}"),
            // Only a wait may wait that long (a process it waits for still running).
            None => prop_assert!(path.ends_with("/wait"), "{method} {path}?{q} {body}: no answer in 20 s"),
        }
    }
}

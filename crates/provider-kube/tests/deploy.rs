//! `deploy/base` as the replicas need it, read from the manifests themselves (the local cluster
//! runs them for real in `scripts/e2e-deploy`): three replicas rolled one at a time, a
//! PodDisruptionBudget, no volume that only one pod may mount, the replicas' flag and the
//! downward API values it reads, and RBAC for exactly the shared objects.
#![allow(clippy::unwrap_used, clippy::panic)]

use serde_json::Value;

fn manifests(file: &str) -> Vec<Value> {
    let path = format!("{}/../../deploy/base/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn the_server_runs_as_three_replicas_rolled_one_at_a_time_with_no_volume_to_reattach() {
    let docs = manifests("server.yaml");
    assert!(of_kind(&docs, "PersistentVolumeClaim").is_empty(), "a ReadWriteOnce claim ties the server to one pod");
    let deployment = of_kind(&docs, "Deployment")[0];
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"], 3);
    assert_eq!(spec["strategy"]["type"], "RollingUpdate");
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let pod = &spec["template"]["spec"];
    assert!(
        pod["volumes"].as_array().unwrap().iter().all(|v| v.get("persistentVolumeClaim").is_none()),
        "{}",
        pod["volumes"]
    );
    let container = &pod["containers"][0];
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(args.contains(&"--leader-election"), "{args:?}");
    let env: Vec<(&str, &str)> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?, e["valueFrom"]["fieldRef"]["fieldPath"].as_str()?)))
        .collect();
    assert!(env.contains(&("POD_NAMESPACE", "metadata.namespace")), "{env:?}");
    assert!(env.contains(&("POD_IP", "status.podIP")), "{env:?}");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    let pdb = of_kind(&docs, "PodDisruptionBudget")[0];
    assert_eq!(pdb["spec"]["minAvailable"], 2);
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], spec["selector"]["matchLabels"]);
}

#[test]
fn the_replicas_may_touch_only_their_lease_configmap_and_key_secret_in_their_namespace() {
    let docs = manifests("rbac.yaml");
    let role = of_kind(&docs, "Role").into_iter().find(|r| r["metadata"]["namespace"] == "sandman-system").unwrap();
    let named: Vec<(String, String, Vec<String>)> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r.get("resourceNames").is_some())
        .map(|r| {
            let strings = |v: &Value| -> Vec<String> {
                v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
            };
            (strings(&r["resources"]).join(","), strings(&r["resourceNames"]).join(","), strings(&r["verbs"]))
        })
        .collect();
    let verbs = |res: &str, name: &str| -> Vec<String> {
        named.iter().find(|(r, n, _)| r == res && n == name).map(|(_, _, v)| v.clone()).unwrap_or_default()
    };
    use sandman_provider_kube::shared::{DOCUMENTS, KEY_SECRET, LEASE};
    for verb in ["get", "watch", "update"] {
        assert!(verbs("leases", LEASE).iter().any(|v| v == verb), "leases/{LEASE}: {verb}");
    }
    assert!(verbs("configmaps", DOCUMENTS).iter().any(|v| v == "update"), "configmaps/{DOCUMENTS}");
    assert_eq!(verbs("secrets", KEY_SECRET), ["get"], "the key Secret is only read once made");
    // Unnamed rules only create (an object being made has no name to match yet).
    for rule in role["rules"].as_array().unwrap().iter().filter(|r| r.get("resourceNames").is_none()) {
        assert_eq!(rule["verbs"], serde_json::json!(["create"]), "{rule}");
    }
}

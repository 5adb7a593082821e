//! Registry credentials as Docker and podman keep them: `$REGISTRY_AUTH_FILE`, else
//! `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json` (`auths` with `auth` in base64 or
//! `username`/`password`; `credHelpers` and `credsStore` through a `docker-credential-<name>`
//! helper's `get`). Start at [`credentials`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use crate::ImageError;
use crate::reference::DOCKER_HUB;

/// The key Docker files Docker Hub's credentials under.
const DOCKER_HUB_KEY: &str = "https://index.docker.io/v1/";

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuthFile {
    #[serde(default)]
    auths: HashMap<String, Entry>,
    #[serde(default)]
    cred_helpers: HashMap<String, String>,
    #[serde(default)]
    creds_store: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Entry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// The file credentials are read from: `explicit` (the store's config), else
/// `$REGISTRY_AUTH_FILE`, else `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`.
pub(crate) fn auth_file(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return Some(path.to_path_buf());
    }
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("REGISTRY_AUTH_FILE")
        .or_else(|| var("DOCKER_CONFIG").map(|d| d.join("config.json")))
        .or_else(|| var("HOME").map(|h| h.join(".docker/config.json")))
}

/// The credentials for `registry` (`host[:port]`, `docker.io`) and `repository` from `file`:
/// anonymous when it has none (or there is no file).
pub(crate) async fn credentials(
    file: Option<&Path>,
    registry: &str,
    repository: &str,
    stall: Duration,
) -> Result<RegistryAuth, ImageError> {
    let Some(file) = file else { return Ok(RegistryAuth::Anonymous) };
    let bytes = match std::fs::read(file) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(RegistryAuth::Anonymous),
        Err(e) => return Err(ImageError::io(format!("cannot read the credentials in {}", file.display()), e)),
    };
    let what = || format!("the credentials file {}", file.display());
    let parsed: AuthFile = serde_json::from_slice(&bytes).map_err(|e| ImageError::malformed(what(), e))?;
    let keys = keys_for(registry, repository);
    if let Some(helper) = keys.iter().find_map(|k| parsed.cred_helpers.get(k)) {
        return helper_get(&helper_program(helper), &server_url(registry), stall).await;
    }
    let found = parsed
        .auths
        .iter()
        .filter_map(|(key, entry)| {
            let key = normalise_key(key);
            keys.iter().position(|k| *k == key).map(|rank| (rank, entry))
        })
        .min_by_key(|(rank, _)| *rank)
        .map(|(_, entry)| entry);
    if let Some(entry) = found {
        if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .map_err(|e| ImageError::malformed(what(), format!("the `auth` of {registry}: {e}")))?;
            let text = String::from_utf8(decoded)
                .map_err(|_| ImageError::malformed(what(), format!("the `auth` of {registry} is not UTF-8")))?;
            let (user, password) = text.split_once(':').ok_or_else(|| {
                ImageError::malformed(what(), format!("the `auth` of {registry} is not `user:password`"))
            })?;
            return Ok(RegistryAuth::Basic(user.to_string(), password.to_string()));
        }
        if let (Some(user), Some(password)) = (&entry.username, &entry.password) {
            return Ok(RegistryAuth::Basic(user.clone(), password.clone()));
        }
        if entry.identitytoken.is_some() {
            return Err(identity_token(registry));
        }
    }
    if let Some(store) = &parsed.creds_store {
        return helper_get(&helper_program(store), &server_url(registry), stall).await;
    }
    Ok(RegistryAuth::Anonymous)
}

fn identity_token(registry: &str) -> ImageError {
    ImageError::Unsupported {
        what: format!("the credentials for {registry}"),
        why: "an identity (OAuth refresh) token; log in with a username and password or access token".into(),
    }
}

/// The keys that may hold credentials for `registry/repository`, most specific first
/// (`host/org/repo`, `host/org`, `host`), with Docker Hub's other names.
fn keys_for(registry: &str, repository: &str) -> Vec<String> {
    let hosts: Vec<&str> = if registry == DOCKER_HUB {
        vec!["index.docker.io", "docker.io", "registry-1.docker.io"]
    } else {
        vec![registry]
    };
    let mut keys = Vec::new();
    let parts: Vec<&str> = repository.split('/').collect();
    for host in &hosts {
        for n in (1..=parts.len()).rev() {
            keys.push(format!("{host}/{}", parts[..n].join("/")));
        }
    }
    keys.extend(hosts.iter().map(|h| h.to_string()));
    keys
}

/// A key of `auths` as a host (and path): without scheme, `/v1/` or `/v2/`, or trailing `/`.
fn normalise_key(key: &str) -> String {
    let key = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    let key = key.trim_end_matches('/');
    let key = key.strip_suffix("/v1").or_else(|| key.strip_suffix("/v2")).unwrap_or(key);
    key.to_string()
}

/// What a credential helper is asked for: Docker Hub's legacy URL, else the host.
fn server_url(registry: &str) -> String {
    if registry == DOCKER_HUB { DOCKER_HUB_KEY.to_string() } else { registry.to_string() }
}

fn helper_program(name: &str) -> PathBuf {
    PathBuf::from(format!("docker-credential-{name}"))
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HelperAnswer {
    username: String,
    secret: String,
}

/// Runs `<program> get` with `server` on its stdin, as Docker does; anonymous when the helper
/// has no credentials for it.
pub(crate) async fn helper_get(program: &Path, server: &str, stall: Duration) -> Result<RegistryAuth, ImageError> {
    let name = program.display().to_string();
    let mut child = tokio::process::Command::new(program)
        .arg("get")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ImageError::io(format!("cannot run the credential helper `{name}`"), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(server.as_bytes())
            .await
            .map_err(|e| ImageError::io(format!("cannot write to the credential helper `{name}`"), e))?;
    }
    let out = tokio::time::timeout(stall, child.wait_with_output())
        .await
        .map_err(|_| ImageError::Stalled { what: format!("the credential helper `{name}`"), after: stall })?
        .map_err(|e| ImageError::io(format!("cannot run the credential helper `{name}`"), e))?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        // The helpers' own words for "none stored".
        if said.contains("credentials not found") {
            return Ok(RegistryAuth::Anonymous);
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(ImageError::Unauthorized {
            reference: server.to_string(),
            registry: format!("the credential helper `{name}`"),
            said: format!("{} ({said}{stderr})", out.status),
        });
    }
    let answer: HelperAnswer = serde_json::from_slice(&out.stdout)
        .map_err(|e| ImageError::malformed(format!("the answer of the credential helper `{name}`"), e))?;
    if answer.username == "<token>" {
        return Err(identity_token(server));
    }
    Ok(RegistryAuth::Basic(answer.username, answer.secret))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const STALL: Duration = Duration::from_secs(30);

    fn basic(auth: RegistryAuth) -> Option<(String, String)> {
        match auth {
            RegistryAuth::Basic(u, p) => Some((u, p)),
            _ => None,
        }
    }

    #[tokio::test]
    async fn auths_entries_are_found_by_host_and_docker_hubs_legacy_key() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("config.json");
        let encoded = base64::engine::general_purpose::STANDARD.encode("hub:secret");
        let json = format!(
            r#"{{"auths":{{
                "{DOCKER_HUB_KEY}":{{"auth":"{encoded}"}},
                "127.0.0.1:5000":{{"username":"u","password":"p"}},
                "https://ghcr.io/v2/":{{"username":"g","password":"h"}},
                "ghcr.io/org/special":{{"username":"s","password":"t"}}}}}}"#
        );
        std::fs::write(&file, json).unwrap_or_else(|e| panic!("{e}"));
        let get = |registry: &'static str, repository: &'static str| {
            let file = file.clone();
            async move { credentials(Some(&file), registry, repository, STALL).await.unwrap_or_else(|e| panic!("{e}")) }
        };
        assert_eq!(basic(get("docker.io", "library/python").await), Some(("hub".into(), "secret".into())));
        assert_eq!(basic(get("127.0.0.1:5000", "a").await), Some(("u".into(), "p".into())));
        assert_eq!(basic(get("ghcr.io", "org/tool").await), Some(("g".into(), "h".into())));
        assert_eq!(basic(get("ghcr.io", "org/special").await), Some(("s".into(), "t".into())), "most specific");
        assert!(matches!(get("quay.io", "x").await, RegistryAuth::Anonymous));
        let none = credentials(Some(&dir.path().join("absent.json")), "quay.io", "x", STALL).await;
        assert!(matches!(none, Ok(RegistryAuth::Anonymous)));
    }

    #[tokio::test]
    async fn credential_helpers_speak_dockers_get_protocol() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let helper = dir.path().join("docker-credential-test");
        // Answers for the server it is asked about, as the real helpers do.
        std::fs::write(
            &helper,
            "#!/bin/sh\nread server\nif [ \"$server\" = reg.example:5000 ]; then\n\
             printf '{\"ServerURL\":\"%s\",\"Username\":\"helper\",\"Secret\":\"s3\"}' \"$server\"\n\
             else echo 'credentials not found in native keychain'; exit 1; fi\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap_or_else(|e| panic!("{e}"));
        let found = helper_get(&helper, "reg.example:5000", STALL).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(basic(found), Some(("helper".into(), "s3".into())));
        let none = helper_get(&helper, "other.example", STALL).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(none, RegistryAuth::Anonymous));
    }

    #[test]
    fn keys_are_normalised() {
        assert_eq!(normalise_key("https://index.docker.io/v1/"), "index.docker.io");
        assert_eq!(normalise_key("http://h:5000/v2/"), "h:5000");
        assert_eq!(normalise_key("h:5000"), "h:5000");
        assert_eq!(keys_for("h", "a/b"), ["h/a/b", "h/a", "h"]);
    }
}

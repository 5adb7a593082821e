//! A real CNCF registry for tests: Debian's `docker-registry` (distribution 2.8) started on
//! 127.0.0.1 at a free port with its storage in a temporary directory, anonymous, with basic
//! auth (an htpasswd made here with bcrypt) or with token auth (a self-signed certificate made
//! here, and a token server in this process that signs JWTs with its key); and images built in
//! Rust ([`LayerBuilder`], [`TestImage`]) pushed to it or written as OCI layouts, so no other
//! tool is needed. Start at [`Registry::start`].

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;

use crate::Spawned;

/// The registry binary (`apt-get install docker-registry`).
pub const REGISTRY_BINARY: &str = "/usr/bin/docker-registry";
/// The service name a token registry and its token server agree on.
const SERVICE: &str = "sandman-test-registry";
const ISSUER: &str = "sandman-test-token-server";

/// How clients authenticate to a test registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    Anonymous,
    /// htpasswd: the registry checks `user:password` itself.
    Basic {
        user: String,
        password: String,
    },
    /// Bearer tokens from this fixture's token server, which checks `user:password`.
    Token {
        user: String,
        password: String,
    },
}

/// A running registry, killed (and its storage removed) when dropped.
#[derive(Debug)]
pub struct Registry {
    /// `127.0.0.1:<port>`.
    addr: String,
    auth: Auth,
    dir: tempfile::TempDir,
    process: Spawned,
    token: Option<TokenServer>,
}

impl Registry {
    /// Starts a registry with `auth`; its log goes to a file in `logs` (printed when a test
    /// fails). Fails the test when the binary is missing or it does not come up.
    pub fn start(auth: Auth, logs: &Path) -> Registry {
        assert!(
            Path::new(REGISTRY_BINARY).is_file(),
            "no {REGISTRY_BINARY}: these tests need a real registry (apt-get install docker-registry)"
        );
        let dir = tempfile::Builder::new()
            .prefix("registry-")
            .tempdir_in(logs)
            .unwrap_or_else(|e| panic!("cannot make a directory in {}: {e}", logs.display()));
        let storage = dir.path().join("storage");
        std::fs::create_dir(&storage).unwrap_or_else(|e| panic!("{e}"));
        let token = match &auth {
            Auth::Token { user, password } => Some(TokenServer::start(user, password, dir.path())),
            _ => None,
        };
        let auth_yaml = match &auth {
            Auth::Anonymous => String::new(),
            Auth::Basic { user, password } => {
                let hash = bcrypt::hash(password, 4).unwrap_or_else(|e| panic!("bcrypt: {e}"));
                let htpasswd = dir.path().join("htpasswd");
                std::fs::write(&htpasswd, format!("{user}:{hash}\n")).unwrap_or_else(|e| panic!("{e}"));
                format!("auth:\n  htpasswd:\n    realm: sandman-test\n    path: {}\n", htpasswd.display())
            }
            Auth::Token { .. } => {
                let server = token.as_ref().unwrap_or_else(|| panic!("no token server"));
                format!(
                    "auth:\n  token:\n    realm: http://{}/token\n    service: {SERVICE}\n    issuer: {ISSUER}\n    \
                     rootcertbundle: {}\n",
                    server.addr,
                    server.cert.display()
                )
            }
        };
        // A port taken between the probe and the registry's bind makes it exit: try another.
        for _ in 0..5 {
            let port = free_port();
            let addr = format!("127.0.0.1:{port}");
            let config = dir.path().join("config.yml");
            let yaml = format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    \
                 rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n{auth_yaml}",
                storage.display()
            );
            std::fs::write(&config, yaml).unwrap_or_else(|e| panic!("{e}"));
            // The access log goes to stdout, the rest to stderr: both into the one log.
            let mut cmd = Command::new("/bin/sh");
            cmd.args(["-c", "exec \"$0\" serve \"$1\" 1>&2", REGISTRY_BINARY]).arg(&config);
            let mut process = Spawned::spawn("docker-registry", &mut cmd, logs);
            if wait_answers(&addr, &mut process) {
                return Registry { addr, auth, dir, process, token };
            }
        }
        panic!("the registry did not come up on a free port");
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The reference of `repository:tag` in this registry.
    pub fn reference(&self, repository: &str, tag: &str) -> String {
        format!("{}/{repository}:{tag}", self.addr)
    }

    /// The registry's log so far (its access log included: one line per request).
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// How many `method` requests it answered whose path contains `needle`, from its access log.
    pub fn requests(&self, method: &str, needle: &str) -> usize {
        let prefix = format!("\"{method} ");
        self.log()
            .lines()
            .filter(|l| {
                l.split_once(&prefix)
                    .is_some_and(|(_, rest)| rest.split(' ').next().is_some_and(|p| p.contains(needle)))
            })
            .count()
    }

    /// Where the registry keeps a blob's bytes (to corrupt one).
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.dir.path().join(format!("storage/docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]))
    }

    /// Writes a Docker `config.json` with this registry's credentials into `dir`; its path.
    pub fn write_auth_file(&self, dir: &Path) -> PathBuf {
        let (user, password) = match &self.auth {
            Auth::Basic { user, password } | Auth::Token { user, password } => (user.clone(), password.clone()),
            Auth::Anonymous => panic!("an anonymous registry has no credentials"),
        };
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let path = dir.join("config.json");
        let json = json!({"auths": {self.addr.clone(): {"auth": auth}}});
        std::fs::write(&path, json.to_string()).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    /// The `Authorization` header a push needs, if any.
    fn push_authorization(&self, repository: &str) -> Option<String> {
        match &self.auth {
            Auth::Anonymous => None,
            Auth::Basic { user, password } => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
            )),
            Auth::Token { user, .. } => {
                let server = self.token.as_ref().unwrap_or_else(|| panic!("no token server"));
                Some(format!("Bearer {}", server.keys.sign(user, &[format!("repository:{repository}:pull,push")])))
            }
        }
    }

    /// Pushes `image`'s blobs and manifest as `repository:tag`.
    pub async fn push(&self, repository: &str, tag: &str, image: &TestImage) {
        for layer in &image.layers {
            self.push_blob(repository, &layer.digest, layer.bytes.clone()).await;
        }
        self.push_blob(repository, &image.config_digest, image.config.clone()).await;
        self.push_manifest(repository, tag, image.manifest_media_type(), image.manifest.clone()).await;
    }

    /// Pushes each image and an OCI index of them as `repository:tag`; the index's digest.
    pub async fn push_index(&self, repository: &str, tag: &str, images: &[&TestImage]) -> String {
        let mut manifests = Vec::new();
        for image in images {
            self.push(repository, &format!("{tag}-{}", image.architecture), image).await;
            manifests.push(json!({
                "mediaType": OCI_MANIFEST,
                "digest": image.manifest_digest,
                "size": image.manifest.len(),
                "platform": {"os": "linux", "architecture": image.architecture},
            }));
        }
        let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
        let bytes = serde_json::to_vec(&index).unwrap_or_else(|e| panic!("{e}"));
        let digest = sha256(&bytes);
        self.push_manifest(repository, tag, OCI_INDEX, bytes).await;
        digest
    }

    async fn push_blob(&self, repository: &str, digest: &str, bytes: Vec<u8>) {
        let auth = self.push_authorization(repository);
        let head = self.send("HEAD", &format!("/v2/{repository}/blobs/{digest}"), auth.as_deref(), None, None).await;
        if head.0 == StatusCode::OK {
            return;
        }
        let (status, headers, body) =
            self.send("POST", &format!("/v2/{repository}/blobs/uploads/"), auth.as_deref(), None, None).await;
        assert_eq!(status, StatusCode::ACCEPTED, "start an upload: {}", String::from_utf8_lossy(&body));
        let location = headers.get("location").and_then(|v| v.to_str().ok()).unwrap_or_else(|| panic!("no Location"));
        let path = location.split_once(&self.addr).map_or(location, |(_, p)| p);
        let separator = if path.contains('?') { '&' } else { '?' };
        let put = format!("{path}{separator}digest={digest}");
        let (status, _, body) =
            self.send("PUT", &put, auth.as_deref(), Some("application/octet-stream"), Some(bytes)).await;
        assert_eq!(status, StatusCode::CREATED, "upload {digest}: {}", String::from_utf8_lossy(&body));
    }

    async fn push_manifest(&self, repository: &str, tag: &str, media_type: &str, bytes: Vec<u8>) {
        let auth = self.push_authorization(repository);
        let path = format!("/v2/{repository}/manifests/{tag}");
        let (status, _, body) = self.send("PUT", &path, auth.as_deref(), Some(media_type), Some(bytes)).await;
        assert_eq!(status, StatusCode::CREATED, "push {repository}:{tag}: {}", String::from_utf8_lossy(&body));
    }

    /// One request on a fresh connection.
    async fn send(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        content_type: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> (StatusCode, hyper::HeaderMap, Bytes) {
        let stream = tokio::net::TcpStream::connect(&self.addr).await.unwrap_or_else(|e| panic!("connect: {e}"));
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap_or_else(|e| panic!("handshake: {e}"));
        tokio::spawn(conn);
        let mut request = Request::builder().method(method).uri(path).header("host", &self.addr);
        if let Some(a) = authorization {
            request = request.header("authorization", a);
        }
        if let Some(t) = content_type {
            request = request.header("content-type", t);
        }
        let request = request.body(Full::new(Bytes::from(body.unwrap_or_default()))).unwrap_or_else(|e| panic!("{e}"));
        let response = sender.send_request(request).await.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        (status, headers, body)
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    listener.local_addr().unwrap_or_else(|e| panic!("{e}")).port()
}

/// Waits until `GET /v2/` gets an HTTP answer (200, or 401 with auth); false when the process
/// exits first (its port was taken).
fn wait_answers(addr: &str, process: &mut Spawned) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            let _ = s.write_all(format!("GET /v2/ HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes());
            let mut answer = String::new();
            let _ = std::io::Read::read_to_string(&mut s, &mut answer);
            if answer.starts_with("HTTP/1.1 ") {
                return true;
            }
        }
        if process.wait_exit(Duration::from_millis(20)).is_some() {
            return false;
        }
    }
    panic!("the registry on {addr} did not answer within 30s");
}

/// The token server's signing key and certificate.
#[derive(Debug)]
struct Keys {
    key: ring::signature::EcdsaKeyPair,
    cert_der: Vec<u8>,
}

impl Keys {
    /// A JWT granting `user` the `scopes` (`repository:<name>:<actions>`), as distribution's token
    /// auth verifies it: ES256, the certificate in `x5c`.
    fn sign(&self, user: &str, scopes: &[String]) -> String {
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let header = json!({
            "typ": "JWT",
            "alg": "ES256",
            "x5c": [base64::engine::general_purpose::STANDARD.encode(&self.cert_der)],
        });
        let access: Vec<serde_json::Value> = scopes
            .iter()
            .filter_map(|s| {
                let mut parts = s.splitn(3, ':');
                let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
                Some(json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
            })
            .collect();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let claims = json!({
            "iss": ISSUER,
            "sub": user,
            "aud": SERVICE,
            "exp": now + 600,
            "nbf": now - 60,
            "iat": now,
            "jti": format!("{now}-{}", std::process::id()),
            "access": access,
        });
        let signing_input = format!("{}.{}", b64(header.to_string().as_bytes()), b64(claims.to_string().as_bytes()));
        let rng = ring::rand::SystemRandom::new();
        let signature = self.key.sign(&rng, signing_input.as_bytes()).unwrap_or_else(|e| panic!("sign: {e}"));
        format!("{signing_input}.{}", b64(signature.as_ref()))
    }
}

/// The token server of a token-auth registry: `GET /token?service=&scope=` with basic auth
/// answers a JWT; a wrong or missing credential, 401 with a JSON error. Runs on a thread of its
/// own (so it serves whatever runtime the test uses), stopped when dropped.
#[derive(Debug)]
struct TokenServer {
    addr: String,
    cert: PathBuf,
    keys: Arc<Keys>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TokenServer {
    fn start(user: &str, password: &str, dir: &Path) -> TokenServer {
        let key_pair = rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("key: {e}"));
        let params = rcgen::CertificateParams::new(vec!["sandman-token-server".to_string()])
            .unwrap_or_else(|e| panic!("cert params: {e}"));
        let cert = params.self_signed(&key_pair).unwrap_or_else(|e| panic!("cert: {e}"));
        let cert_path = dir.join("token-root.pem");
        std::fs::write(&cert_path, cert.pem()).unwrap_or_else(|e| panic!("{e}"));
        let key = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &key_pair.serialize_der(),
            &ring::rand::SystemRandom::new(),
        )
        .unwrap_or_else(|e| panic!("key: {e}"));
        let keys = Arc::new(Keys { key, cert_der: cert.der().to_vec() });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
        listener.set_nonblocking(true).unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let expected =
            format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")));
        let (k, user) = (keys.clone(), user.to_string());
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let runtime = runtime.unwrap_or_else(|e| panic!("runtime: {e}"));
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap_or_else(|e| panic!("{e}"));
                let serve = async {
                    while let Ok((stream, _)) = listener.accept().await {
                        let (k, user, expected) = (k.clone(), user.clone(), expected.clone());
                        tokio::spawn(async move {
                            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                                let answer = token_answer(&req, &k, &user, &expected);
                                async move { Ok::<_, hyper::Error>(answer) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                };
                tokio::select! {
                    _ = serve => {}
                    _ = stopped => {}
                }
            });
        });
        TokenServer { addr, cert: cert_path, keys, stop: Some(stop), thread: Some(thread) }
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn token_answer(
    req: &Request<hyper::body::Incoming>,
    keys: &Keys,
    user: &str,
    expected: &str,
) -> Response<Full<Bytes>> {
    let authorized = req.headers().get("authorization").and_then(|v| v.to_str().ok()) == Some(expected);
    if !authorized {
        let body =
            json!({"errors": [{"code": "UNAUTHORIZED", "message": "the test token server refuses these credentials"}]});
        return Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let query = req.uri().query().unwrap_or_default();
    let scopes: Vec<String> = form_pairs(query).into_iter().filter(|(k, _)| k == "scope").map(|(_, v)| v).collect();
    let token = keys.sign(user, &scopes);
    let body = json!({"token": token, "access_token": token, "expires_in": 600});
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `a=b&c=d`, percent-decoded.
fn form_pairs(query: &str) -> Vec<(String, String)> {
    let decode = |s: &str| {
        let bytes = s.replace('+', " ").into_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%'
                && i + 2 < bytes.len()
                && let Ok(v) = u8::from_str_radix(&String::from_utf8_lossy(&bytes[i + 1..i + 3]), 16)
            {
                out.push(v);
                i += 3;
                continue;
            }
            out.push(bytes[i]);
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    query.split('&').filter_map(|p| p.split_once('=')).map(|(k, v)| (decode(k), decode(v))).collect()
}

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(ring::digest::digest(&ring::digest::SHA256, bytes)))
}

/// How a built layer is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// A layer blob: its bytes, digest, uncompressed digest and media type.
#[derive(Debug, Clone)]
pub struct Blob {
    pub bytes: Vec<u8>,
    pub digest: String,
    pub diff_id: String,
    pub media_type: &'static str,
}

/// A layer's tar, built entry by entry (root's, 0644 files and 0755 directories, unless said).
pub struct LayerBuilder {
    tar: tar::Builder<Vec<u8>>,
}

impl std::fmt::Debug for LayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LayerBuilder")
    }
}

impl Default for LayerBuilder {
    fn default() -> Self {
        LayerBuilder::new()
    }
}

impl LayerBuilder {
    pub fn new() -> LayerBuilder {
        LayerBuilder { tar: tar::Builder::new(Vec::new()) }
    }

    fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_size(size);
        header.set_mode(mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        header
    }

    pub fn file(self, path: &str, data: &[u8]) -> LayerBuilder {
        self.file_with(path, data, 0o644, 0, 0)
    }

    pub fn file_with(mut self, path: &str, data: &[u8], mode: u32, uid: u64, gid: u64) -> LayerBuilder {
        let mut header = LayerBuilder::header(tar::EntryType::Regular, data.len() as u64, mode);
        header.set_uid(uid);
        header.set_gid(gid);
        self.tar.append_data(&mut header, path, data).unwrap_or_else(|e| panic!("{path}: {e}"));
        self
    }

    pub fn dir(mut self, path: &str) -> LayerBuilder {
        let mut header = LayerBuilder::header(tar::EntryType::Directory, 0, 0o755);
        self.tar.append_data(&mut header, path, &[][..]).unwrap_or_else(|e| panic!("{path}: {e}"));
        self
    }

    pub fn symlink(mut self, path: &str, target: &str) -> LayerBuilder {
        let mut header = LayerBuilder::header(tar::EntryType::Symlink, 0, 0o777);
        self.tar.append_link(&mut header, path, target).unwrap_or_else(|e| panic!("{path}: {e}"));
        self
    }

    /// `.wh.<name>` beside `path`'s name: hides `path` of the layers below.
    pub fn whiteout(self, path: &str) -> LayerBuilder {
        let (dir, name) = path.rsplit_once('/').map_or(("", path), |(d, n)| (d, n));
        let wh = if dir.is_empty() { format!(".wh.{name}") } else { format!("{dir}/.wh.{name}") };
        self.file(&wh, b"")
    }

    /// Hides everything of the layers below in directory `dir`.
    pub fn opaque(self, dir: &str) -> LayerBuilder {
        self.file(&format!("{dir}/.wh..wh..opq"), b"")
    }

    /// The layer blob.
    pub fn build(self, compression: Compression) -> Blob {
        let tar = self.tar.into_inner().unwrap_or_else(|e| panic!("{e}"));
        let diff_id = sha256(&tar);
        let (bytes, media_type) = match compression {
            Compression::None => (tar, "application/vnd.oci.image.layer.v1.tar"),
            Compression::Gzip => {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(&tar).unwrap_or_else(|e| panic!("{e}"));
                (gz.finish().unwrap_or_else(|e| panic!("{e}")), "application/vnd.oci.image.layer.v1.tar+gzip")
            }
            Compression::Zstd => (
                zstd::encode_all(&tar[..], 3).unwrap_or_else(|e| panic!("{e}")),
                "application/vnd.oci.image.layer.v1.tar+zstd",
            ),
        };
        Blob { digest: sha256(&bytes), bytes, diff_id, media_type }
    }
}

/// An image built in Rust: its layers (bottom first), config and OCI manifest.
#[derive(Debug, Clone)]
pub struct TestImage {
    pub layers: Vec<Blob>,
    pub architecture: String,
    pub config: Vec<u8>,
    pub config_digest: String,
    pub manifest: Vec<u8>,
    pub manifest_digest: String,
}

impl TestImage {
    /// An image of `layers` for this machine's architecture, run as `1000:1000` in `/work` with
    /// `LANG=C.UTF-8` and `cmd` `["sh"]`.
    pub fn new(layers: Vec<Blob>) -> TestImage {
        TestImage::for_arch(layers, host_arch())
    }

    pub fn for_arch(layers: Vec<Blob>, architecture: &str) -> TestImage {
        let run = json!({"User": "1000:1000", "WorkingDir": "/work", "Env": ["LANG=C.UTF-8", "PATH=/usr/bin:/bin"], "Cmd": ["sh"]});
        TestImage::with_config(layers, architecture, run)
    }

    /// An image of `layers` whose config's `config` (how to run it: `User`, `Env`,
    /// `WorkingDir`, `Entrypoint`, `Cmd`) is `run`.
    pub fn with_config(layers: Vec<Blob>, architecture: &str, run: serde_json::Value) -> TestImage {
        let diff_ids: Vec<&str> = layers.iter().map(|l| l.diff_id.as_str()).collect();
        let config = json!({
            "architecture": architecture,
            "os": "linux",
            "config": run,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let config = serde_json::to_vec(&config).unwrap_or_else(|e| panic!("{e}"));
        let config_digest = sha256(&config);
        let layer_descriptors: Vec<serde_json::Value> = layers
            .iter()
            .map(|l| json!({"mediaType": l.media_type, "digest": l.digest, "size": l.bytes.len()}))
            .collect();
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config.len()},
            "layers": layer_descriptors,
        });
        let manifest = serde_json::to_vec(&manifest).unwrap_or_else(|e| panic!("{e}"));
        TestImage {
            manifest_digest: sha256(&manifest),
            manifest,
            config_digest,
            config,
            layers,
            architecture: architecture.to_string(),
        }
    }

    fn manifest_media_type(&self) -> &'static str {
        OCI_MANIFEST
    }

    /// Writes it as an OCI image layout in `dir`, named `tag`.
    pub fn write_oci_layout(&self, dir: &Path, tag: &str) {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap_or_else(|e| panic!("{e}"));
        let mut files: BTreeMap<String, &[u8]> = BTreeMap::new();
        for layer in &self.layers {
            files.insert(layer.digest.clone(), &layer.bytes);
        }
        files.insert(self.config_digest.clone(), &self.config);
        files.insert(self.manifest_digest.clone(), &self.manifest);
        for (digest, bytes) in files {
            let hex = digest.strip_prefix("sha256:").unwrap_or(&digest);
            std::fs::write(blobs.join(hex), bytes).unwrap_or_else(|e| panic!("{e}"));
        }
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap_or_else(|e| panic!("{e}"));
        let index = json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": OCI_MANIFEST,
                "digest": self.manifest_digest,
                "size": self.manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }],
        });
        std::fs::write(dir.join("index.json"), index.to_string()).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Writes it as an OCI archive (a tar of the layout) at `file`, named `tag`.
    pub fn write_oci_archive(&self, file: &Path, tag: &str) {
        let layout = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        self.write_oci_layout(layout.path(), tag);
        let out = std::fs::File::create(file).unwrap_or_else(|e| panic!("{e}"));
        let mut tar = tar::Builder::new(out);
        tar.append_dir_all(".", layout.path()).unwrap_or_else(|e| panic!("{e}"));
        tar.into_inner().unwrap_or_else(|e| panic!("{e}"));
    }
}

/// This machine's architecture as OCI names it.
/// A layer holding a root file system of busybox's applets: this machine's `busybox` (which
/// must be static: Debian's busybox-static) at `/bin/busybox`, a link to it for each applet,
/// `/etc/passwd` and `/etc/group` naming root and `user` (1000), and the directories a root
/// has. The bottom of a runnable test image.
pub fn busybox_layer() -> Blob {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .unwrap_or_else(|| panic!("no busybox: apt-get install busybox-static (./scripts/test does)"));
    let bytes = std::fs::read(busybox).unwrap_or_else(|e| panic!("{e}"));
    let listed = Command::new(busybox).arg("--list-full").output().unwrap_or_else(|e| panic!("{e}"));
    let mut layer = LayerBuilder::new();
    for dir in
        ["bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "root", "home", "home/user", "proc", "sys", "dev", "run"]
    {
        layer = layer.dir(dir);
    }
    layer = layer.file_with("tmp/.keep", b"", 0o644, 0, 0).file_with("bin/busybox", &bytes, 0o755, 0, 0);
    for applet in String::from_utf8_lossy(&listed.stdout).lines().filter(|a| *a != "bin/busybox") {
        layer = layer.symlink(applet, "/bin/busybox");
    }
    layer
        .file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n")
        .file("etc/group", b"root:x:0:\nuser:x:1000:\n")
        .file_with("home/user/.profile", b"", 0o644, 1000, 1000)
        .build(Compression::Gzip)
}

pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

//! The provider's own calls to the API server (everything but the shared watch): writes go
//! through the [`Pacer`] and are retried on `429` after `Retry-After` (whose body is plain text,
//! not a Status), reads are paginated. Raw requests through `kube::Client::send`, so that the
//! status line and headers of every answer are seen.

use bytes::Bytes;
use http::StatusCode;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::client::Body;
use kube::core::Request;
use sandman_provider::ProviderError;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::pace::{Pacer, WriteSlot, backoff, retry_after};

/// How often one write is retried after `429` (or a `503` with `Retry-After`) before it fails.
const MAX_THROTTLED_RETRIES: u32 = 8;
/// How often a request is retried after a transport error or a 502/504.
const MAX_TRANSIENT_RETRIES: u32 = 3;
/// Page size of lists.
const PAGE: u32 = 500;
/// Field manager of every write, as the recordings show it.
pub const FIELD_MANAGER: &str = "sandman";

/// Why a call to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The API server answered with an error status (a `Status` body, or plain text).
    #[error("the API server refused to {what}: {message} ({code} {reason})")]
    Refused { what: String, code: u16, reason: String, message: String },
    #[error("the API server kept answering 429 Too Many Requests to `{what}` ({tries} tries)")]
    Throttled { what: String, tries: u32 },
    #[error("cannot {what}: no answer from the API server")]
    Transport {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot build the request to {what}")]
    Request {
        what: String,
        #[source]
        source: kube::core::request::Error,
    },
    #[error("unexpected answer to `{what}`")]
    Decode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
}

impl KubeError {
    /// The HTTP status the API server refused with, if it answered.
    pub fn code(&self) -> Option<u16> {
        match self {
            KubeError::Refused { code, .. } => Some(*code),
            KubeError::Throttled { .. } => Some(429),
            _ => None,
        }
    }
}

impl From<KubeError> for ProviderError {
    fn from(e: KubeError) -> Self {
        match &e {
            // Invalid (422) or bad (400): nothing was made, and it will not be on a retry.
            KubeError::Refused { code: 400 | 422, message, .. } => {
                ProviderError::Unsupported(format!("the API server refused the sandbox's pod: {message}"))
            }
            _ => ProviderError::Backend(chain(&e)),
        }
    }
}

/// An error and its sources, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

/// An object's metadata alone: decoding an answer into it skips the rest without keeping it.
#[derive(Debug, serde::Deserialize)]
struct MetadataOnly {
    #[serde(default)]
    metadata: ObjectMeta,
}

/// `Accept` for an object's metadata only (`PartialObjectMetadata`), which the API server also
/// answers a create with.
const METADATA: &str = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1";

/// `Accept` for a list of metadata only (`PartialObjectMetadataList`), which the API server also
/// answers a `deletecollection` with.
const METADATA_LIST: &str = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";

/// One page of a list, read without buffering it whole first (as a flattened `ObjectList` is):
/// fields of the list or of its items that are not asked for are skipped as they are read.
#[derive(Debug, serde::Deserialize)]
struct Page<T> {
    #[serde(default)]
    metadata: kube::core::ListMeta,
    items: Option<Vec<T>>,
}

/// What a release-all reads of each pod: the labels that name its sandbox, and whether it is
/// being deleted already; not its managed fields or anything else.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMeta {
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    pub deletion_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

/// An item of a metadata list.
#[derive(Debug, Clone, serde::Deserialize)]
struct Named {
    #[serde(default)]
    metadata: PodMeta,
}

/// An answer, read whole.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    body: Bytes,
}

/// The API calls of one provider, in its namespace.
pub struct KubeApi {
    client: kube::Client,
    pacer: Pacer,
    /// Calls in flight at once (`api_concurrency`): each holds one of the client's pooled
    /// connections, so this also bounds how many the pool opens. Taken before the pacer's slot,
    /// so that a write goes at its slot rather than bunched up behind a full pool.
    in_flight: tokio::sync::Semaphore,
    pods: Request,
    secrets: Request,
    policies: Request,
    /// Cluster-scoped: read by `prepare` to find the nodes that may run sandboxes.
    nodes: Request,
}

impl std::fmt::Debug for KubeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApi").field("pacer", &self.pacer).field("pods", &self.pods.url_path).finish_non_exhaustive()
    }
}

impl KubeApi {
    pub fn new(client: kube::Client, namespace: &str, pacer: Pacer, concurrency: u32) -> Self {
        KubeApi {
            client,
            pacer,
            in_flight: tokio::sync::Semaphore::new(concurrency.max(1) as usize),
            pods: Request::new(Pod::url_path(&(), Some(namespace))),
            secrets: Request::new(Secret::url_path(&(), Some(namespace))),
            policies: Request::new(NetworkPolicy::url_path(&(), Some(namespace))),
            nodes: Request::new(Node::url_path(&(), None)),
        }
    }

    /// Creates a pod; answers the uid the API server gave it. The request is made before the
    /// future is, so that the pod is not kept while the write waits for its slot (a parsed pod
    /// is kilobytes, and in a burst thousands of writes wait), and the answer is asked for as
    /// metadata only, of which the uid is read.
    pub fn create_pod(&self, pod: &Pod) -> impl Future<Output = Result<String, KubeError>> + Send + '_ {
        let what = format!("create pod `{}`", pod.metadata.name.as_deref().unwrap_or_default());
        let req =
            to_json(&what, pod).and_then(|body| build(&what, self.pods.create(&post_params(), body))).map(|mut req| {
                // The answer as metadata only: the API server encodes the pod's metadata, not the
                // pod (a burst's every create), and an error is a Status as ever.
                req.headers_mut().insert(http::header::ACCEPT, http::HeaderValue::from_static(METADATA));
                req
            });
        async move {
            let created: MetadataOnly = decode(&what, self.call(&what, req?, true).await?)?;
            Ok(created.metadata.uid.unwrap_or_default())
        }
    }

    pub async fn create_secret(&self, secret: &Secret) -> Result<(), KubeError> {
        let what = format!("create secret `{}`", secret.metadata.name.as_deref().unwrap_or_default());
        let req = build(&what, self.secrets.create(&post_params(), to_json(&what, secret)?))?;
        decode::<serde_json::Value>(&what, self.call(&what, req, true).await?).map(drop)
    }

    pub async fn get_pod(&self, name: &str) -> Result<Option<Pod>, KubeError> {
        let what = format!("read pod `{name}`");
        let req = build(&what, self.pods.get(name, &Default::default()))?;
        optional(decode(&what, self.call(&what, req, false).await?))
    }

    pub async fn get_secret(&self, name: &str) -> Result<Option<Secret>, KubeError> {
        let what = format!("read secret `{name}`");
        let req = build(&what, self.secrets.get(name, &Default::default()))?;
        optional(decode(&what, self.call(&what, req, false).await?))
    }

    /// Changes one Secret's metadata with a JSON merge patch (a shared token Secret's owners).
    pub async fn merge_patch_secret(&self, name: &str, patch: &serde_json::Value) -> Result<(), KubeError> {
        let what = format!("patch secret `{name}`");
        let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
        let req = build(&what, self.secrets.patch(name, &params, &Patch::Merge(patch)))?;
        decode::<serde_json::Value>(&what, self.call(&what, req, true).await?).map(drop)
    }

    /// Deletes one Secret; false when there was none.
    pub async fn delete_secret(&self, name: &str) -> Result<bool, KubeError> {
        let what = format!("delete secret `{name}`");
        let req = build(&what, self.secrets.delete(name, &DeleteParams::default()))?;
        let found = optional(decode::<serde_json::Value>(&what, self.call(&what, req, true).await?))?;
        Ok(found.is_some())
    }

    /// Deletes one pod (its Secret goes with it, by owner reference); false when there was none.
    pub async fn delete_pod(&self, name: &str, grace_s: u32) -> Result<bool, KubeError> {
        let what = format!("delete pod `{name}`");
        let req = build(&what, self.pods.delete(name, &delete_params(grace_s)))?;
        let found = optional(decode::<serde_json::Value>(&what, self.call(&what, req, true).await?))?;
        Ok(found.is_some())
    }

    /// Deletes every pod matching `selector` in one call; answers the metadata of the pods
    /// deleted ([`PodMeta`]). The answer is asked for as metadata only (the API server encodes
    /// each pod's metadata, not the pod: a release-all of thousands answers megabytes, not
    /// hundreds), and read so. A call that outlasts the API server's request timeout (60 s by
    /// default: about 2,000 pods on a busy 2-core machine) is `504`, having deleted only the pods
    /// it reached, and names none.
    pub async fn delete_pods(&self, selector: &str, grace_s: u32) -> Result<Vec<PodMeta>, KubeError> {
        let what = format!("delete the pods `{selector}`");
        let mut req = build(
            &what,
            self.pods.delete_collection(&delete_params(grace_s), &ListParams::default().labels(selector)),
        )?;
        req.headers_mut().insert(http::header::ACCEPT, http::HeaderValue::from_static(METADATA_LIST));
        let list: Page<Named> = decode(&what, self.call(&what, req, true).await?)?;
        Ok(list.items.unwrap_or_default().into_iter().map(|n| n.metadata).collect())
    }

    pub async fn list_pods(&self, selector: &str) -> Result<Vec<Pod>, KubeError> {
        self.list("pods", selector, |p| self.pods.list(p)).await
    }

    /// The metadata of the pods matching `selector` ([`PodMeta`]): a fraction of the pods'
    /// bytes, on both sides, when a release-all of thousands needs only their names.
    pub async fn list_pod_metadata(&self, selector: &str) -> Result<Vec<PodMeta>, KubeError> {
        let named: Vec<Named> = self.list("pods", selector, |p| self.pods.list_metadata(p)).await?;
        Ok(named.into_iter().map(|n| n.metadata).collect())
    }

    /// The nodes matching `selector` (every node when it is empty).
    pub async fn list_nodes(&self, selector: &str) -> Result<Vec<Node>, KubeError> {
        self.list("nodes", selector, |p| self.nodes.list(p)).await
    }

    pub async fn list_secrets(&self, selector: &str) -> Result<Vec<Secret>, KubeError> {
        self.list("secrets", selector, |p| self.secrets.list(p)).await
    }

    /// Changes one pod with a JSON merge patch; a `metadata.resourceVersion` in it makes the
    /// change conditional: the API server refuses it (409 Conflict) when the pod has changed
    /// since that version. Answers the pod as changed.
    pub async fn merge_patch_pod(&self, name: &str, patch: &serde_json::Value) -> Result<Pod, KubeError> {
        let what = format!("patch pod `{name}`");
        let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
        let req = build(&what, self.pods.patch(name, &params, &Patch::Merge(patch)))?;
        decode(&what, self.call(&what, req, true).await?)
    }

    /// Creates or updates a NetworkPolicy (server-side apply).
    pub async fn apply_policy(&self, policy: &NetworkPolicy) -> Result<(), KubeError> {
        let name = policy.metadata.name.clone().unwrap_or_default();
        let what = format!("apply networkpolicy `{name}`");
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let req = build(&what, self.policies.patch(&name, &params, &Patch::Apply(policy)))?;
        decode::<serde_json::Value>(&what, self.call(&what, req, true).await?).map(drop)
    }

    /// Every object matching `selector`, page by page; started over when a page's continue
    /// token has expired (410). `page` makes the request of one page (a list, or a list of
    /// metadata only).
    async fn list<T: Clone + DeserializeOwned>(
        &self,
        kind: &str,
        selector: &str,
        page: impl Fn(&ListParams) -> Result<http::Request<Vec<u8>>, kube::core::request::Error>,
    ) -> Result<Vec<T>, KubeError> {
        let what = format!("list {kind} `{selector}`");
        let mut restarts = 0;
        'again: loop {
            let mut items = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let mut params = ListParams::default().labels(selector).limit(PAGE);
                if let Some(t) = &token {
                    params = params.continue_token(t);
                }
                let req = build(&what, page(&params))?;
                let page: Page<T> = match decode(&what, self.call(&what, req, false).await?) {
                    Err(KubeError::Refused { code: 410, .. }) if token.is_some() && restarts < 3 => {
                        restarts += 1;
                        continue 'again;
                    }
                    other => other?,
                };
                items.extend(page.items.unwrap_or_default());
                token = page.metadata.continue_.filter(|t| !t.is_empty());
                if token.is_none() {
                    return Ok(items);
                }
            }
        }
    }

    /// Sends one request, retrying throttled and transient failures; writes (`paced`) take a
    /// slot of the pacer for every try, and a `Retry-After` holds every write.
    async fn call(&self, what: &str, req: http::Request<Vec<u8>>, paced: bool) -> Result<Answer, KubeError> {
        let (parts, body) = req.into_parts();
        // Never closed, so never an error; held until the answer is read whole.
        let _permit = self.in_flight.acquire().await.ok();
        let mut throttled = 0;
        let mut transient = 0;
        loop {
            let slot = if paced { Some(WriteSlot(self.pacer.acquire().await)) } else { None };
            let mut attempt = http::Request::builder().method(parts.method.clone()).uri(parts.uri.clone());
            if let Some(slot) = slot {
                attempt = attempt.extension(slot);
            }
            for (k, v) in &parts.headers {
                attempt = attempt.header(k, v);
            }
            let attempt = attempt.body(Body::from(body.clone())).map_err(|e| KubeError::Request {
                what: what.to_string(),
                source: kube::core::request::Error::BuildRequest(e),
            })?;
            let resp = match self.client.send(attempt).await {
                Ok(resp) => resp,
                Err(source) if transient >= MAX_TRANSIENT_RETRIES => {
                    return Err(KubeError::Transport { what: what.to_string(), source });
                }
                Err(err) => {
                    tracing::debug!(what, err = %chain(&err), "API call failed; retrying");
                    tokio::time::sleep(backoff(transient)).await;
                    transient += 1;
                    continue;
                }
            };
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED {
                crate::shared::credentials_refused(what);
            }
            let asked_wait = retry_after(resp.headers());
            let throttle = status == StatusCode::TOO_MANY_REQUESTS
                || (status == StatusCode::SERVICE_UNAVAILABLE && asked_wait.is_some());
            if throttle && throttled < MAX_THROTTLED_RETRIES {
                let wait = asked_wait.unwrap_or_default().max(backoff(throttled));
                tracing::debug!(what, %status, wait_ms = wait.as_millis() as u64, "the API server asks to slow down");
                throttled += 1;
                if paced {
                    // Every write waits, not only this one: the server is overloaded.
                    self.pacer.hold(tokio::time::Instant::now() + wait);
                } else {
                    tokio::time::sleep(wait).await;
                }
                continue;
            }
            if throttle {
                return Err(KubeError::Throttled { what: what.to_string(), tries: throttled + 1 });
            }
            if matches!(status, StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT)
                && transient < MAX_TRANSIENT_RETRIES
            {
                tokio::time::sleep(backoff(transient)).await;
                transient += 1;
                continue;
            }
            let body = resp
                .into_body()
                .collect_bytes()
                .await
                .map_err(|source| KubeError::Transport { what: what.to_string(), source })?;
            return Ok(Answer { status, body });
        }
    }
}

fn post_params() -> PostParams {
    PostParams { dry_run: false, field_manager: Some(FIELD_MANAGER.into()) }
}

fn delete_params(grace_s: u32) -> DeleteParams {
    DeleteParams {
        grace_period_seconds: Some(grace_s),
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    }
}

fn build(
    what: &str,
    req: Result<http::Request<Vec<u8>>, kube::core::request::Error>,
) -> Result<http::Request<Vec<u8>>, KubeError> {
    req.map_err(|source| KubeError::Request { what: what.to_string(), source })
}

fn to_json<T: Serialize>(what: &str, obj: &T) -> Result<Vec<u8>, KubeError> {
    serde_json::to_vec(obj).map_err(|source| KubeError::Decode { what: what.to_string(), source })
}

/// A success decoded as `T`; an error status as [`KubeError::Refused`].
fn decode<T: DeserializeOwned>(what: &str, answer: Answer) -> Result<T, KubeError> {
    if answer.status.is_success() {
        return serde_json::from_slice(&answer.body)
            .map_err(|source| KubeError::Decode { what: what.to_string(), source });
    }
    let (reason, message) = match serde_json::from_slice::<kube::core::Status>(&answer.body) {
        Ok(s) if !s.message.is_empty() => (s.reason, s.message),
        _ => {
            let text = String::from_utf8_lossy(&answer.body);
            let text: String = text.trim().chars().take(300).collect();
            (answer.status.canonical_reason().unwrap_or("").to_string(), text)
        }
    };
    Err(KubeError::Refused { what: what.to_string(), code: answer.status.as_u16(), reason, message })
}

/// A 404 as `None`.
fn optional<T>(r: Result<T, KubeError>) -> Result<Option<T>, KubeError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(KubeError::Refused { code: 404, .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

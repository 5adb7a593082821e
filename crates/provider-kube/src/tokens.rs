//! Token Secrets shared by the sandboxes created together (`token: shared_secret`): a create
//! deposits its token and is answered the Secret that holds it; the tokens deposited while one
//! Secret is being written go together into the next (a group commit), so a burst of N creates
//! costs a handful of Secret writes instead of N, and a lone create waits for no one. Each pod
//! mounts only its own key of its Secret (`items`). Once every pod of a Secret has been created
//! (or has failed), the Secret is made owned by those pods, so that the garbage collector
//! deletes it with the last of them; a Secret none of whose pods was made is deleted at once.
//! Start at [`Tokens::deposit`]; `docs/kubernetes.md` says why the sharing exposes no token.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use ring::rand::{SecureRandom, SystemRandom};
use sandman_provider::ProviderError;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::api::{KubeApi, chain};
use crate::pod::{LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY, label_value};

/// The label of shared token Secrets.
pub const LABEL_TOKENS: &str = "sandman.dev/tokens";
/// Most tokens in one Secret (about 100 bytes each, and an owner reference of about 150 once
/// its pods exist: far below the 1 MiB a Secret may hold).
pub const MAX_TOKENS: usize = 500;
/// Deposits waiting for a Secret: a create waits to send its deposit when this many do.
const DEPOSITS: usize = 4096;
/// Secrets written at once. While they are, deposits gather for the next ones.
const WRITES_IN_FLIGHT: usize = 2;

/// The label selector of this instance's shared token Secrets.
pub fn selector(instance: &str) -> String {
    format!("{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_INSTANCE}={},{LABEL_TOKENS}", label_value(instance))
}

/// One create's token, waiting for its Secret.
struct Deposit {
    id: String,
    token: String,
    answer: oneshot::Sender<Result<String, String>>,
}

/// What a written Secret waits for before its owners are recorded.
#[derive(Default)]
struct Pending {
    /// Creates that have not yet said whether their pod was made.
    waiting: usize,
    owners: Vec<OwnerReference>,
}

/// The shared token Secrets of one provider.
pub struct Tokens {
    deposits: mpsc::Sender<Deposit>,
    /// Secrets written whose pods are not all made yet, by name. Locked briefly, never across
    /// an await.
    pending: Mutex<HashMap<String, Pending>>,
    api: Arc<KubeApi>,
    tasks: TaskTracker,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens").finish_non_exhaustive()
    }
}

/// A token deposited in a Secret, until its create says whether its pod was made: dropped
/// without [`Held::made`] (a failed or cancelled create), the pod counts as not made.
#[derive(Debug)]
pub struct Held {
    tokens: Arc<Tokens>,
    /// The Secret that holds the token.
    pub secret: String,
    told: bool,
}

impl Held {
    /// The pod `name` (uid `uid`) that mounts the token was made: it becomes an owner of the
    /// Secret.
    pub fn made(mut self, name: &str, uid: &str) {
        self.told = true;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: name.to_string(),
            uid: uid.to_string(),
            controller: None,
            block_owner_deletion: None,
        };
        self.tokens.settle(&self.secret, Some(owner));
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.told {
            self.tokens.settle(&self.secret, None);
        }
    }
}

impl Tokens {
    /// Starts the writer of shared token Secrets on `tasks`; it stops with `cancel`.
    pub fn start(
        api: Arc<KubeApi>,
        namespace: &str,
        instance: &str,
        tasks: &TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Tokens> {
        let (tx, rx) = mpsc::channel(DEPOSITS);
        let tokens = Arc::new(Tokens { deposits: tx, pending: Mutex::default(), api, tasks: tasks.clone() });
        let meta = ObjectMeta {
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([
                (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
                (LABEL_INSTANCE.to_string(), label_value(instance)),
                (LABEL_TOKENS.to_string(), "shared".to_string()),
            ])),
            ..ObjectMeta::default()
        };
        tasks.spawn(tokens.clone().write(rx, meta, cancel));
        tokens
    }

    /// Puts `token` (sandbox `id`'s) into a shared Secret; answers it once the Secret exists.
    pub async fn deposit(self: &Arc<Self>, id: &str, token: &str) -> Result<Held, ProviderError> {
        let (answer, rx) = oneshot::channel();
        let deposit = Deposit { id: id.to_string(), token: token.to_string(), answer };
        let stopped = || ProviderError::Backend("the token Secret writer has stopped".into());
        self.deposits.send(deposit).await.map_err(|_| stopped())?;
        let secret = rx.await.map_err(|_| stopped())?.map_err(ProviderError::Backend)?;
        Ok(Held { tokens: self.clone(), secret, told: false })
    }

    /// Takes the deposits waiting (up to [`MAX_TOKENS`]) whenever a write may start, and writes
    /// them as one Secret.
    async fn write(self: Arc<Self>, mut rx: mpsc::Receiver<Deposit>, meta: ObjectMeta, cancel: CancellationToken) {
        let writes = Arc::new(Semaphore::new(WRITES_IN_FLIGHT));
        loop {
            let Ok(permit) = writes.clone().acquire_owned().await else { return };
            let first = tokio::select! {
                _ = cancel.cancelled() => return,
                first = rx.recv() => first,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            while batch.len() < MAX_TOKENS {
                match rx.try_recv() {
                    Ok(d) => batch.push(d),
                    Err(_) => break,
                }
            }
            let me = self.clone();
            let meta = meta.clone();
            self.tasks.spawn(async move {
                me.write_one(batch, meta).await;
                drop(permit);
            });
        }
    }

    /// Writes one Secret holding `batch`'s tokens (each under its sandbox's id) and answers
    /// each deposit.
    async fn write_one(&self, batch: Vec<Deposit>, mut meta: ObjectMeta) {
        let name = match secret_name() {
            Some(name) => name,
            None => {
                for d in batch {
                    let _ = d.answer.send(Err("cannot draw a random name for a token Secret".into()));
                }
                return;
            }
        };
        meta.name = Some(name.clone());
        let data: BTreeMap<String, String> = batch.iter().map(|d| (d.id.clone(), d.token.clone())).collect();
        let secret = Secret {
            metadata: meta,
            type_: Some("Opaque".into()),
            immutable: Some(true),
            string_data: Some(data),
            ..Secret::default()
        };
        // Registered before the write: a create answered may report its pod at once.
        self.lock().insert(name.clone(), Pending { waiting: batch.len(), owners: Vec::new() });
        let result = self.api.create_secret(&secret).await.map_err(|e| chain(&e));
        if let Err(e) = &result {
            tracing::warn!(secret = %name, tokens = batch.len(), err = %e, "cannot write a token Secret");
            self.lock().remove(&name);
        } else {
            tracing::debug!(secret = %name, tokens = batch.len(), "token Secret written");
        }
        for d in batch {
            let _ = d.answer.send(result.clone().map(|()| name.clone()));
        }
    }

    /// Secrets written whose creates have not all said yet whether their pods were made.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One create of `secret` has said whether its pod was made; after the last, the Secret is
    /// given its owners (or deleted, when no pod was made).
    fn settle(&self, secret: &str, owner: Option<OwnerReference>) {
        let done = {
            let mut pending = self.lock();
            let Some(p) = pending.get_mut(secret) else { return };
            p.waiting = p.waiting.saturating_sub(1);
            p.owners.extend(owner);
            if p.waiting > 0 {
                return;
            }
            pending.remove(secret)
        };
        let Some(done) = done else { return };
        let api = self.api.clone();
        let secret = secret.to_string();
        self.tasks.spawn(async move { own(&api, &secret, done.owners).await });
    }
}

/// Records `owners` on the Secret, or deletes it when there are none.
async fn own(api: &KubeApi, secret: &str, owners: Vec<OwnerReference>) {
    let result = if owners.is_empty() {
        api.delete_secret(secret).await.map(drop)
    } else {
        let patch = serde_json::json!({"metadata": {"ownerReferences": owners}});
        api.merge_patch_secret(secret, &patch).await
    };
    if let Err(e) = result {
        tracing::warn!(secret, err = %chain(&e), "cannot record the owners of a token Secret");
    }
}

/// `sandman-tokens-` and 16 random hex digits.
fn secret_name() -> Option<String> {
    let mut bytes = [0u8; 8];
    SystemRandom::new().fill(&mut bytes).ok()?;
    Some(format!("sandman-tokens-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

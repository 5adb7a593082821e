//! Where the server keeps its small documents of record (jobs, pools, snapshots) and the key
//! that signs conditions records: files in its state directory, or, when several replicas run
//! on Kubernetes, a ConfigMap and a Secret that every replica reads (see
//! [`sandman_provider_kube::shared`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sandman_provider_kube::shared::Documents;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::conditions::Signer;
use crate::error::{ServerError, ServerResult};

/// The documents' names: a file in the state directory, a key of the ConfigMap.
pub const JOBS: &str = "jobs.json";
pub const POOLS: &str = "pools.json";
pub const SNAPSHOTS: &str = "snapshots.json";
/// Replicas only: each job's accounting sums (one server rebuilds them from its records' file).
pub const ACCOUNTING: &str = "accounting.json";

#[derive(Clone)]
pub enum Store {
    /// Files in the state directory, written atomically (a temporary file renamed over).
    Dir(PathBuf),
    /// The replicas' ConfigMap, and the conditions key read from their Secret.
    Shared { documents: Arc<Documents>, key: Arc<[u8]> },
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Store::Dir(dir) => f.debug_tuple("Dir").field(dir).finish(),
            Store::Shared { .. } => f.write_str("Shared"),
        }
    }
}

impl Store {
    /// Document `name`, decoded; empty when missing or unreadable (logged).
    pub fn load<T: DeserializeOwned + Default>(&self, name: &str) -> T {
        let text = match self {
            Store::Dir(dir) => match std::fs::read(dir.join(name)) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return T::default(),
                Err(e) => {
                    tracing::error!(path = %dir.join(name).display(), error = %e, "cannot read; starting empty");
                    return T::default();
                }
            },
            Store::Shared { documents, .. } => match documents.get(name) {
                Some(text) => text.into_bytes(),
                None => return T::default(),
            },
        };
        serde_json::from_slice(&text).unwrap_or_else(|e| {
            tracing::error!(document = name, error = %e, "cannot decode; starting empty");
            T::default()
        })
    }

    /// Keeps document `name`: at once in a file, or handed to the writer of the ConfigMap
    /// (see [`Store::saved`]).
    pub fn save(&self, name: &str, value: &impl Serialize) {
        let text = match serde_json::to_string_pretty(value) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(document = name, error = %e, "cannot encode");
                return;
            }
        };
        match self {
            Store::Dir(dir) => {
                let path = dir.join(name);
                if let Err(e) = write_atomically(&path, text.as_bytes()) {
                    tracing::error!(path = %path.display(), error = %e, "cannot save");
                }
            }
            Store::Shared { documents, .. } => {
                documents.set(name, text);
            }
        }
    }

    /// Waits until what was saved so far is where every replica reads it: a call that changed a
    /// document answers only after this, so that a replica taking over has it.
    pub async fn saved(&self) -> ServerResult<()> {
        match self {
            Store::Dir(_) => Ok(()),
            Store::Shared { documents, .. } => documents
                .written(documents.version())
                .await
                .map_err(|why| ServerError::Unavailable(format!("the change could not be kept in the cluster: {why}"))),
        }
    }

    /// The key that signs conditions records: the state directory's (made at the first start),
    /// or the replicas' Secret's.
    pub fn signer(&self) -> Result<Signer, String> {
        match self {
            Store::Dir(dir) => Signer::open(dir).map_err(|e| {
                format!("cannot read or make the signing key {}: {e}", dir.join(crate::conditions::KEY_FILE).display())
            }),
            Store::Shared { key, .. } => Ok(Signer::new(key)),
        }
    }

    /// Whether several replicas share it (and so the provider keeps what the state directory
    /// would: which sandboxes became ready).
    pub fn is_shared(&self) -> bool {
        matches!(self, Store::Shared { .. })
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::Store;

    #[test]
    fn a_document_saved_in_a_directory_is_loaded_back_and_a_missing_one_is_empty() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = Store::Dir(dir.path().to_path_buf());
        let empty: BTreeMap<String, u32> = store.load(super::JOBS);
        assert!(empty.is_empty());
        store.save(super::JOBS, &BTreeMap::from([("a".to_string(), 1u32)]));
        let back: BTreeMap<String, u32> = store.load(super::JOBS);
        assert_eq!(back, BTreeMap::from([("a".to_string(), 1u32)]));
        std::fs::write(dir.path().join(super::POOLS), b"{not json").unwrap_or_else(|e| panic!("{e}"));
        let bad: BTreeMap<String, u32> = store.load(super::POOLS);
        assert!(bad.is_empty(), "an unreadable document starts empty");
    }
}

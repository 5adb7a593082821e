//! [`ImageError`]: every way a resolve, an import or the store's upkeep fails, each variant
//! naming the step.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Why the image store could not do what it was asked. Cloneable because a pull is shared by
/// every caller that asked for the same image at once: all of them get the one pull's error.
/// Sources are kept (`#[source]`, behind an `Arc` for the clone) for callers that walk them; the
/// messages already say what a user must read (a registry's own words included).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ImageError {
    /// The reference cannot be parsed.
    #[error("cannot parse the image reference `{reference}`: {why}")]
    Parse { reference: String, why: String },
    /// The registry, engine or archive has no such image or tag (a registry's 404,
    /// `MANIFEST_UNKNOWN`, `NAME_UNKNOWN`).
    #[error("image `{reference}` not found in {source_name}: {said}")]
    NotFound { reference: String, source_name: String, said: String },
    /// The registry refused the credentials it was given, or wanted some and got none (401, 403,
    /// a token server's refusal).
    #[error("{registry} refused access to `{reference}`: {said}")]
    Unauthorized { reference: String, registry: String, said: String },
    /// Any other failure talking to a registry: its answer, or the connection.
    #[error("{registry} failed while {step} for `{reference}`: {said}")]
    Registry {
        reference: String,
        registry: String,
        step: String,
        said: String,
        #[source]
        source: Option<Arc<oci_client::errors::OciDistributionError>>,
    },
    /// Content whose digest (or length) is not what its descriptor says.
    #[error("{what}: expected {expected}, got {actual}")]
    Digest { what: String, expected: String, actual: String },
    /// A layer entry that could escape the layer, steer overlayfs, or is otherwise refused.
    #[error("layer {layer}: refused entry `{entry}`: {why}")]
    HostileLayer { layer: String, entry: String, why: String },
    /// Past one of the store's bounds.
    #[error("{what} is over its limit of {limit} {unit}")]
    TooLarge { what: String, limit: u64, unit: &'static str },
    /// A kind of image, manifest or credential this store does not take.
    #[error("{what} is not supported: {why}")]
    Unsupported { what: String, why: String },
    /// A manifest, index, config or archive that is not what its format says.
    #[error("{what} is malformed: {why}")]
    Malformed { what: String, why: String },
    /// A file system operation of the store or of an unpack.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The local Docker engine failed (it answered, so this is not "no engine").
    #[error("the local Docker engine failed while {step}: {said}")]
    Engine {
        step: String,
        said: String,
        #[source]
        source: Option<Arc<bollard::errors::Error>>,
    },
    /// A pull, an export or a credential helper that made no progress for the stall time.
    #[error("{what} made no progress for {}s", after.as_secs_f64())]
    Stalled { what: String, after: Duration },
    /// An image that sandboxes use, which `remove` will not take away.
    #[error("image {image} is in use by {sandboxes} sandbox(es)")]
    InUse { image: String, sandboxes: usize },
    /// `remove` of something the store does not hold.
    #[error("no image `{0}` in the store")]
    NotInStore(String),
    /// Another process holds the store.
    #[error("the image store {} is in use by another process", root.display())]
    Locked { root: PathBuf },
}

impl ImageError {
    /// An [`ImageError::Io`] saying what was being done.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> ImageError {
        ImageError::Io { what: what.into(), source: Arc::new(source) }
    }

    pub(crate) fn hostile(layer: &str, entry: &[u8], why: impl Into<String>) -> ImageError {
        ImageError::HostileLayer {
            layer: layer.to_string(),
            entry: String::from_utf8_lossy(entry).into_owned(),
            why: why.into(),
        }
    }

    pub(crate) fn malformed(what: impl Into<String>, why: impl ToString) -> ImageError {
        ImageError::Malformed { what: what.into(), why: why.to_string() }
    }
}

/// The `io::Error` an unpack's reader returns to carry an [`ImageError`] through the
/// decompressor and the tar reader, which only speak `io::Error`; [`from_io`] takes it back out.
#[derive(Debug)]
pub(crate) struct Carried(pub(crate) ImageError);

impl std::fmt::Display for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Carried {}

/// An `io::Error` carrying `e`.
pub(crate) fn carry(e: ImageError) -> std::io::Error {
    std::io::Error::other(Carried(e))
}

/// The [`ImageError`] an `io::Error` carries, or an [`ImageError::Io`] saying `what`.
pub(crate) fn from_io(e: std::io::Error, what: impl FnOnce() -> String) -> ImageError {
    match e.downcast::<Carried>() {
        Ok(carried) => carried.0,
        Err(e) => ImageError::io(what(), e),
    }
}

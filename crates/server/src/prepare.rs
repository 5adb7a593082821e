//! The gates that hold a job's creates of an image until enough nodes have it (see
//! `Service::prepare`, which closes and opens them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

/// Closed gates holding a job's creates of an image, by (job, image). A gate opens (its sender
/// sends `true` and is dropped) when enough nodes have the image or its preparation ends, the
/// latter however it ends: the request dropped included.
#[derive(Debug, Default)]
pub struct Gates {
    held: Mutex<Held>,
}

/// Gate senders by (job, image).
type Held = HashMap<(String, String), Arc<watch::Sender<bool>>>;

impl Gates {
    /// Closes the gate of (job, image) until the returned guard opens it or is dropped.
    pub fn close(&self, job: &str, image: &str) -> Gate<'_> {
        let key = (job.to_string(), image.to_string());
        let tx = self.lock().entry(key.clone()).or_insert_with(|| Arc::new(watch::channel(false).0)).clone();
        Gate { gates: self, key, tx }
    }

    /// The gate a create of `image` for `job` must pass, when one is closed.
    pub fn waiter(&self, job: Option<&str>, image: &str) -> Option<watch::Receiver<bool>> {
        let key = (job?.to_string(), image.to_string());
        self.lock().get(&key).map(|tx| tx.subscribe())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A closed gate: open it with [`Gate::open`], or by dropping it.
#[derive(Debug)]
pub struct Gate<'a> {
    gates: &'a Gates,
    key: (String, String),
    tx: Arc<watch::Sender<bool>>,
}

impl Gate<'_> {
    pub fn open(&self) {
        let mut held = self.gates.lock();
        if held.get(&self.key).is_some_and(|tx| Arc::ptr_eq(tx, &self.tx)) {
            held.remove(&self.key);
        }
        self.tx.send_replace(true);
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        self.open();
    }
}

/// How a create may wait at a gate: until it opens or its sender is gone.
pub async fn pass(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|open| *open).await;
}

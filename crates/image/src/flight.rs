//! Single flight: the callers that ask for the same work (one image, one layer) at once share
//! one run of it and all get its result. The work is driven by its callers (no task is spawned):
//! when every caller has gone, it is dropped with them, and the next caller starts it anew.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared, WeakShared};

use crate::ImageError;

type Work<T> = Shared<BoxFuture<'static, Result<T, ImageError>>>;
type WeakWork<T> = WeakShared<BoxFuture<'static, Result<T, ImageError>>>;

/// The work under way, by key.
pub(crate) struct Flights<T> {
    /// Weak, so that work whose callers have all gone is not kept alive by the map. A std mutex:
    /// held only to look up or insert, never across an await.
    running: Mutex<HashMap<String, WeakWork<T>>>,
}

impl<T> Default for Flights<T> {
    fn default() -> Self {
        Flights { running: Mutex::new(HashMap::new()) }
    }
}

impl<T: Clone + Send + Sync + 'static> Flights<T> {
    /// Joins the work under way for `key`, or starts `start()` as it.
    pub(crate) async fn run<F>(&self, key: &str, start: impl FnOnce() -> F) -> Result<T, ImageError>
    where
        F: Future<Output = Result<T, ImageError>> + Send + 'static,
    {
        let work: Work<T> = {
            let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            match running.get(key).and_then(WeakShared::upgrade) {
                Some(work) => work,
                None => {
                    let work = start().boxed().shared();
                    if let Some(weak) = work.downgrade() {
                        running.insert(key.to_string(), weak);
                    }
                    work
                }
            }
        };
        let result = work.clone().await;
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let finished = running.get(key).and_then(WeakShared::upgrade).is_none_or(|w| Shared::ptr_eq(&w, &work));
        if finished {
            running.remove(key);
        }
        result
    }

    /// How many keys have work under way (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn callers_at_once_share_one_run_and_its_error() {
        let flights: Arc<Flights<u32>> = Arc::default();
        let runs = Arc::new(AtomicUsize::new(0));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let wait = wait.shared();
        let mut callers = Vec::new();
        for _ in 0..8 {
            let (flights, runs, wait) = (flights.clone(), runs.clone(), wait.clone());
            callers.push(tokio::spawn(async move {
                flights
                    .run("k", move || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        let _ = wait.await;
                        Err::<u32, _>(ImageError::NotInStore("x".into()))
                    })
                    .await
            }));
        }
        tokio::task::yield_now().await;
        let _ = go.send(());
        for caller in callers {
            let result = caller.await.unwrap_or_else(|e| panic!("{e}"));
            assert!(matches!(result, Err(ImageError::NotInStore(_))));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(flights.len(), 0, "finished work is forgotten");
        // The next caller starts anew.
        let again = flights.run("k", || async { Ok(7) }).await;
        assert_eq!(again.ok(), Some(7));
    }

    #[tokio::test]
    async fn work_whose_callers_all_left_is_dropped_and_started_again() {
        let flights: Flights<u32> = Flights::default();
        let mut abandoned = Box::pin(flights.run("k", std::future::pending));
        assert!((&mut abandoned).now_or_never().is_none());
        drop(abandoned);
        let result = flights.run("k", || async { Ok(1) }).await;
        assert_eq!(result.ok(), Some(1));
    }
}

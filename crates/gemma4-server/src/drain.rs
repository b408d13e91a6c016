//! Graceful shutdown. On SIGTERM/SIGINT the server stops admitting requests
//! (503, `/health` says draining), lets running requests finish — a
//! streaming request counts until its last byte is handed to the connection —
//! for up to the drain timeout, then closes the listener and returns.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify};

use crate::error::ServerError;
use crate::server::Server;

/// How long the HTTP side may take to close connections once no request is running.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Counts requests being handled (including response bodies still streaming).
#[derive(Debug, Default)]
pub struct Active {
    count: AtomicUsize,
    idle: Notify,
}

impl Active {
    pub fn enter(self: &Arc<Self>) -> ActiveGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        ActiveGuard(self.clone())
    }

    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Waits until no request is active, or `limit` passes; true when idle.
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.idle.notified();
                if self.count() == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }
}

/// Held while a request is being handled.
#[derive(Debug)]
pub struct ActiveGuard(Arc<Active>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Serves `server` on `listener` until `shutdown` completes, then drains:
/// no new requests, running ones finish within the drain timeout.
pub async fn serve(
    listener: TcpListener,
    server: Server,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let address = listener.local_addr()?;
    let app = server.router();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let mut http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.await;
            })
            .await
    });
    tracing::info!("listening on http://{address}");
    tokio::select! {
        () = shutdown => {}
        done = &mut http => {
            return match done {
                Ok(r) => r.map_err(ServerError::from),
                Err(e) => Err(ServerError::Task(e.to_string())),
            };
        }
    }
    let limit = server.config().drain_timeout;
    tracing::info!(
        running = server.active_requests(),
        "shutting down: refusing new requests, draining for up to {limit:?}"
    );
    server.begin_drain();
    if server.wait_idle(limit).await {
        tracing::info!("all requests finished");
    } else {
        tracing::warn!(
            running = server.active_requests(),
            "drain timeout ({limit:?}) passed with requests still running; closing them"
        );
    }
    let _ = stop_tx.send(());
    match tokio::time::timeout(CLOSE_GRACE, &mut http).await {
        Ok(Ok(r)) => r?,
        Ok(Err(e)) => return Err(ServerError::Task(e.to_string())),
        Err(_) => http.abort(),
    }
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wait_idle_returns_when_the_last_guard_drops() {
        let active = Arc::new(Active::default());
        let guard = active.enter();
        assert!(!active.wait_idle(Duration::from_millis(20)).await);
        let a = active.clone();
        let waiter = tokio::spawn(async move { a.wait_idle(Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(guard);
        assert!(matches!(waiter.await, Ok(true)));
        assert_eq!(active.count(), 0);
    }
}

//! Graceful shutdown. On SIGTERM/SIGINT the server stops admitting requests
//! (503, and `/ready` answers 503 "draining"), lets running requests finish — a
//! streaming request counts until its last byte is handed to the connection —
//! for up to the drain timeout, then closes the listener and returns. An
//! engine that fails beyond recovery ends the server the same way, with an error.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::connections::{accept_loop, ConnectionLimits};
use crate::error::ServerError;
use crate::server::Server;

/// How long the HTTP side may take to close connections once no request is running.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long `/health` and `/ready` report a failed engine before the server exits.
const FAILURE_REPORT: Duration = Duration::from_secs(1);

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
/// no new requests, running ones finish within the drain timeout. Requests
/// whose bodies are still arriving are not running yet and do not hold the
/// drain up; their connections are closed with the rest.
pub async fn serve(
    listener: TcpListener,
    server: Server,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let address = listener.local_addr()?;
    let app = server.router();
    let limits = ConnectionLimits {
        header_read_timeout: server.config().header_read_timeout,
        max_connections: server.config().max_connections,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut http = tokio::spawn(accept_loop(
        listener,
        app,
        limits,
        server.state(),
        stop_rx,
        CLOSE_GRACE,
    ));
    tracing::info!("listening on http://{address}");
    let mut failure = None;
    tokio::select! {
        () = shutdown => {}
        reason = server.engine_failed() => {
            tracing::error!("{reason}; exiting so that the server can be restarted");
            // Health checks see the reason before the listener closes.
            tokio::time::sleep(FAILURE_REPORT).await;
            failure = Some(reason);
        }
        done = &mut http => {
            return match done {
                Ok(r) => r,
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
            "drain timeout ({limit:?}) passed with requests still running; cancelling them"
        );
        // Cancelled requests end their responses properly: an error event and `[DONE]`.
        server.cancel_running();
        if !server.wait_idle(CLOSE_GRACE).await {
            tracing::warn!(
                running = server.active_requests(),
                "responses still open after cancelling; closing their connections"
            );
        }
    }
    server.close_streams();
    let _ = stop_tx.send(true);
    match http.await {
        Ok(r) => r?,
        Err(e) => return Err(ServerError::Task(e.to_string())),
    }
    if let Some(reason) = failure {
        return Err(ServerError::EngineFailed(reason));
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

//! The accept loop. Each socket is one HTTP/1.1 connection served by hyper,
//! with a deadline for its request headers (a connection that sends nothing,
//! or dribbles its headers, is closed when it passes; the same deadline
//! bounds an idle kept-alive connection) and a cap on how many connections
//! are open at once: past it, a socket gets a 503 and is closed at once.
//! Body deadlines are the handlers' (see [`crate::admission::read_body`]).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::error::ServerError;
use crate::server::AppState;

/// How long a refused socket may take to receive its 503.
const REFUSAL_WRITE_LIMIT: Duration = Duration::from_secs(1);

/// What a socket over the connection cap is told before it is closed.
const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: 175\r\n\r\n{\"error\":{\"message\":\"the server has too many open connections (--max-connections); retry later\",\"type\":\"service_unavailable_error\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Limits of the HTTP side.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
}

/// Accepts connections until `stop` turns true, then asks every open
/// connection to close after its current response and waits for them up
/// to `grace` before dropping the rest.
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    state: Arc<AppState>,
    mut stop: watch::Receiver<bool>,
    grace: Duration,
) -> Result<(), ServerError> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopped(&mut stop) => break,
            // Reap finished connection tasks so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of file descriptors and the like: wait briefly instead of spinning.
            Err(e) => {
                tracing::warn!("cannot accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            state.metrics.record_refused_connection();
            connections.spawn(refuse(stream));
            continue;
        };
        let app = app.clone();
        let stop = stop.clone();
        let state = state.clone();
        connections.spawn(async move {
            state.metrics.connection_opened();
            serve_connection(stream, app, limits, stop).await;
            state.metrics.connection_closed();
            drop(slot);
        });
    }
    drop(listener);
    let close_all = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, close_all).await.is_err() {
        tracing::warn!(
            open = connections.len(),
            "connections still open after {grace:?}; closing them"
        );
        connections.shutdown().await;
    }
    Ok(())
}

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = stopped(&mut stop) => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = result {
        // Header timeouts, resets and half-sent requests are the client's business.
        tracing::debug!("connection ended: {e}");
    }
}

/// Resolves once the server stops (or its stop signal is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(REFUSAL_WRITE_LIMIT, stream.write_all(REFUSAL)).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_well_formed() {
        let text = std::str::from_utf8(REFUSAL).expect("ascii");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .and_then(|v| v.parse().ok())
            .expect("content length");
        assert_eq!(length, body.len());
        let json: serde_json::Value = serde_json::from_str(body).expect("json");
        assert!(json["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-connections")));
    }
}

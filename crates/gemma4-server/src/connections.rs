//! The accept loop. Each socket is one HTTP/1.1 connection served by hyper,
//! with a deadline for its request headers (a connection that sends nothing,
//! or dribbles its headers, is closed when it passes; the same deadline
//! bounds an idle kept-alive connection) and a cap on how many connections
//! are open at once. Past the cap a few more connections are kept for the
//! probes (`/health`, `/ready`, `/metrics`), one request each, so a
//! saturated server still answers its liveness probe instead of being
//! restarted; every other request on them, and every socket past that
//! reserve, gets a 503 and is closed at once. Body deadlines are the
//! handlers' (see [`crate::admission::read_body`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, Response, StatusCode};
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::{service_fn, Service};
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

/// What a request over the connection cap is told before it is closed.
const REFUSAL_BODY: &str = "{\"error\":{\"message\":\"the server has too many open connections (--max-connections); retry later\",\"type\":\"service_unavailable_error\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Connections kept past the cap for the probes.
pub const PROBE_RESERVE: usize = 4;

/// The paths a connection from the probe reserve may ask for.
const PROBES: [&str; 3] = ["/health", "/ready", "/metrics"];

/// The refusal as raw bytes, for a socket past the probe reserve.
fn refusal_bytes() -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{REFUSAL_BODY}",
        REFUSAL_BODY.len()
    )
    .into_bytes()
}

/// The refusal as a response, for a request on a probe connection.
fn refusal_response() -> Response<Body> {
    let mut response = Response::new(Body::from(REFUSAL_BODY));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        "application/json".parse().expect("static"),
    );
    headers.insert(header::RETRY_AFTER, "1".parse().expect("static"));
    response
}
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
    let probe_slots = Arc::new(Semaphore::new(PROBE_RESERVE));
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
        let (slot, probes_only) = match slots.clone().try_acquire_owned() {
            Ok(slot) => (slot, false),
            Err(_) => match probe_slots.clone().try_acquire_owned() {
                Ok(slot) => (slot, true),
                Err(_) => {
                    state.metrics.record_refused_connection();
                    connections.spawn(refuse(stream));
                    continue;
                }
            },
        };
        let app = app.clone();
        let stop = stop.clone();
        let state = state.clone();
        connections.spawn(async move {
            state.metrics.connection_opened();
            serve_connection(stream, app, limits, stop, &state, probes_only).await;
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
    state: &Arc<AppState>,
    // A connection from the probe reserve serves only the probes.
    probes_only: bool,
) {
    let _ = stream.set_nodelay(true);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // A probe connection serves one request and closes, freeing its place.
        .keep_alive(!probes_only);
    let app = TowerToHyperService::new(app);
    let state = state.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let refused = probes_only && !PROBES.contains(&request.uri().path());
        if refused {
            state.metrics.record_refused_connection();
        }
        let answer = (!refused).then(|| app.call(request));
        async move {
            match answer {
                Some(answer) => answer.await,
                None => Ok::<_, Infallible>(refusal_response()),
            }
        }
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
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
    let refusal = refusal_bytes();
    let _ = tokio::time::timeout(REFUSAL_WRITE_LIMIT, stream.write_all(&refusal)).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_well_formed() {
        let refusal = refusal_bytes();
        let text = std::str::from_utf8(&refusal).expect("ascii");
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

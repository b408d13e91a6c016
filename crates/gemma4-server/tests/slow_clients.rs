//! Slow and greedy clients over real sockets: headers dribbled a byte at a
//! time, bodies shorter than their `Content-Length`, more connections than
//! the cap, and a drain with slow bodies in flight. No model is needed: the
//! limits apply before a request reaches one.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use gemma4_server::{Server, ServerConfig};

const HEADER_TIMEOUT: Duration = Duration::from_millis(400);
const BODY_TIMEOUT: Duration = Duration::from_millis(400);

struct Running {
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: tokio::task::JoinHandle<Result<(), gemma4_server::ServerError>>,
}

async fn start(config: ServerConfig) -> Running {
    let server = Server::new(config).expect("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(gemma4_server::serve(listener, server, async move {
        let _ = stop_rx.await;
    }));
    Running {
        port,
        stop: Some(stop),
        serving,
    }
}

fn config() -> ServerConfig {
    ServerConfig {
        header_read_timeout: HEADER_TIMEOUT,
        body_read_timeout: BODY_TIMEOUT,
        ..Default::default()
    }
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("read timeout");
    s
}

/// Whether the server has closed `s` (EOF or reset), reading and discarding what it sent.
fn closed_by_server(s: &mut TcpStream, sent: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => sent.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// Status code of the first response in `raw`, if any.
fn status(raw: &[u8]) -> Option<u16> {
    let text = String::from_utf8_lossy(raw);
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dribbled_headers_are_cut_off_at_the_header_deadline() {
    let running = start(config()).await;
    let port = running.port;
    let outcome = tokio::task::spawn_blocking(move || {
        // Each connection's clock starts before its connect: the server's
        // deadline runs from its accept, which cannot come earlier.
        let mut conns: Vec<(Instant, TcpStream, Option<Instant>)> = (0..20)
            .map(|_| (Instant::now(), connect(port), None))
            .collect();
        let request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaa\r\n";
        let started = Instant::now();
        let mut i = 0;
        // One byte per connection every 50 ms: well past the deadline for the whole head.
        while started.elapsed() < Duration::from_secs(3) {
            for (_, conn, closed) in conns.iter_mut() {
                if closed.is_some() {
                    continue;
                }
                let byte = *request.get(i).unwrap_or(&b'a');
                let mut sink = Vec::new();
                if conn.write_all(&[byte]).is_err() || closed_by_server(conn, &mut sink) {
                    *closed = Some(Instant::now());
                }
            }
            i += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        conns
            .iter()
            .map(|(opened, _, closed)| closed.map(|t| t - *opened))
            .collect::<Vec<_>>()
    })
    .await
    .expect("join");
    for (n, closed) in outcome.iter().enumerate() {
        let Some(after) = closed else {
            panic!("connection {n} still open after 3 s with a {HEADER_TIMEOUT:?} header deadline");
        };
        assert!(
            *after >= HEADER_TIMEOUT,
            "connection {n} closed after {after:?}, before the deadline"
        );
    }
    stop(running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_body_gets_408_at_the_body_deadline() {
    let running = start(config()).await;
    let port = running.port;
    let (status_code, took) = tokio::task::spawn_blocking(move || {
        let mut s = connect(port);
        let started = Instant::now();
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
        )
        .expect("write");
        let mut raw = Vec::new();
        while !closed_by_server(&mut s, &mut raw) {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "a short body held its connection for 5 s"
            );
        }
        (status(&raw), started.elapsed())
    })
    .await
    .expect("join");
    assert_eq!(status_code, Some(408));
    assert!(took >= BODY_TIMEOUT, "answered after {took:?}");
    stop(running).await;
}

/// Sends `request` until the server refuses it for the connection cap: the
/// connections opened before it are refused only once the server has
/// accepted them, which a loaded machine may take a while to do. An answer
/// before that is served (a probe on the reserve, or a request on a slot not
/// yet taken) and closes its connection, so it counts as no refusal.
fn refused_once_full(port: u16, request: &str) -> String {
    let started = Instant::now();
    loop {
        let reply = exchange(port, request);
        if reply.contains("--max-connections") || started.elapsed() > Duration::from_secs(3) {
            return reply;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `request` until the server serves it instead of refusing it for
/// the connection cap, giving up after 10 s; also returns how many times it
/// was refused first.
fn served_once_free(port: u16, request: &str) -> (String, usize) {
    let started = Instant::now();
    let mut refused = 0;
    loop {
        let reply = exchange(port, request);
        if !reply.contains("--max-connections") || started.elapsed() > Duration::from_secs(10) {
            return (reply, refused);
        }
        refused += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `request` on a new connection and reads until the server closes it.
fn exchange(port: u16, request: &str) -> String {
    let mut s = connect(port);
    s.write_all(request.as_bytes()).expect("write");
    let mut raw = Vec::new();
    let started = Instant::now();
    while !closed_by_server(&mut s, &mut raw) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no answer to {request:?}"
        );
    }
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_get_503_and_the_cap_frees_up() {
    let running = start(ServerConfig {
        max_connections: 3,
        ..config()
    })
    .await;
    let port = running.port;
    tokio::task::spawn_blocking(move || {
        let idle: Vec<TcpStream> = (0..3).map(|_| connect(port)).collect();
        // Let the server accept them before the next one knocks.
        std::thread::sleep(Duration::from_millis(100));
        // Past the cap, a probe is still answered by its handler (loading:
        // 503 "loading"), on a connection that closes after it...
        let probe = exchange(port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(probe.contains("\"loading\""), "{probe}");
        assert!(!probe.contains("--max-connections"), "{probe}");
        let metrics = exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status(metrics.as_bytes()), Some(200), "{metrics}");
        // ...and any other request is refused.
        let other = refused_once_full(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status(other.as_bytes()), Some(503), "{other}");
        assert!(other.contains("--max-connections"), "{other}");
        // With the probes' reserve held too, a socket is refused at once.
        let reserve: Vec<TcpStream> = (0..gemma4_server::connections::PROBE_RESERVE)
            .map(|_| connect(port))
            .collect();
        let refused = refused_once_full(port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status(refused.as_bytes()), Some(503), "{refused}");
        assert!(refused.contains("--max-connections"), "{refused}");
        // Idle connections pass their header deadline and make room: asked
        // again until they have (a loaded machine may close them late).
        std::thread::sleep(HEADER_TIMEOUT);
        let (later, refused_meanwhile) = served_once_free(
            port,
            "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert!(!later.contains("--max-connections"), "{later}");
        // Refused: the request off the probes' list, the socket past the
        // reserve and any knock before the idle ones were closed; the probes
        // served on the reserve are not counted.
        let metrics = exchange(
            port,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        let want = format!(
            "\ngemma4_refused_connections_total {}\n",
            2 + refused_meanwhile
        );
        assert!(metrics.contains(&want), "{want:?} in {metrics}");
        drop((idle, reserve));
    })
    .await
    .expect("join");
    stop(running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_do_not_hold_up_a_drain() {
    let mut running = start(ServerConfig {
        drain_timeout: Duration::from_secs(30),
        body_read_timeout: Duration::from_secs(60),
        ..config()
    })
    .await;
    let port = running.port;
    let slow: Vec<TcpStream> = tokio::task::spawn_blocking(move || {
        (0..5)
            .map(|_| {
                let mut s = connect(port);
                s.write_all(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                )
                .expect("write");
                s
            })
            .collect()
    })
    .await
    .expect("join");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    if let Some(stop) = running.stop.take() {
        let _ = stop.send(());
    }
    let done = tokio::time::timeout(Duration::from_secs(10), &mut running.serving)
        .await
        .expect("the drain waited on bodies still arriving");
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        started.elapsed()
    );
    drop(slow);
}

async fn stop(mut running: Running) {
    if let Some(stop) = running.stop.take() {
        let _ = stop.send(());
    }
    let done = tokio::time::timeout(Duration::from_secs(10), running.serving)
        .await
        .expect("serve returns");
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
}

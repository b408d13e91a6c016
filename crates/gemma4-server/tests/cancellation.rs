//! Requests that end before their last token: streams cut by the drain
//! timeout end with an error event and `[DONE]`, and cancelled requests
//! (cut, or abandoned by their client) are counted with their tokens.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gemma4_engine::EngineConfig;
use gemma4_server::{ModelContext, Server, ServerConfig};
use gemma4_text::{ChatTemplate, Tokenizer};

struct Running {
    server: Server,
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: tokio::task::JoinHandle<Result<(), gemma4_server::ServerError>>,
}

async fn start(config: ServerConfig) -> Running {
    let server = Server::new(config).expect("server");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/e-style");
    let model = gemma4_model::load_hf_dir(&dir).expect("load fixture");
    let eos = model.config().eos_token_ids.clone();
    let tokenizer = Tokenizer::from_dir(&dir).expect("tokenizer");
    let template = ChatTemplate::for_tokenizer(&tokenizer, None);
    let engine =
        gemma4_engine::start(model, Arc::new(tokenizer), EngineConfig::default()).expect("engine");
    server.set_ready(ModelContext::new(engine, template, &eos));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(gemma4_server::serve(listener, server.clone(), async move {
        let _ = stop_rx.await;
    }));
    Running {
        server,
        port,
        stop: Some(stop),
        serving,
    }
}

/// A long greedy stream (`ignore_eos`, so only the drain or the client ends it).
const LONG_STREAM: &str = r#"{"prompt": [2, 379, 399, 473], "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true}"#;

/// Opens a streaming request and waits until its first bytes of body arrive.
fn open_stream(port: u16) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{LONG_STREAM}",
        LONG_STREAM.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("\"text\"") {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buf[..n]);
    }
    (s, raw)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_ends_each_stream_with_an_error_and_done() {
    let mut running = start(ServerConfig {
        drain_timeout: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let port = running.port;
    let readers: Vec<_> = (0..3)
        .map(|_| {
            std::thread::spawn(move || {
                let (mut s, mut raw) = open_stream(port);
                let _ = s.read_to_end(&mut raw);
                String::from_utf8_lossy(&raw).into_owned()
            })
        })
        .collect();
    // Every stream is running before the signal.
    let until = Instant::now() + Duration::from_secs(30);
    while running.server.active_requests() < 3 {
        assert!(Instant::now() < until, "streams did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Some(stop) = running.stop.take() {
        let _ = stop.send(());
    }
    let done = tokio::time::timeout(Duration::from_secs(10), &mut running.serving)
        .await
        .expect("serve returns");
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
    for reader in readers {
        let body = tokio::task::spawn_blocking(move || reader.join().expect("reader"))
            .await
            .expect("join");
        let events: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
        let error = events[events.len() - 2];
        let json: serde_json::Value = serde_json::from_str(error).expect("error event");
        assert_eq!(json["error"]["code"], "cancelled", "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_is_counted_as_cancelled_with_its_tokens() {
    let running = start(ServerConfig::default()).await;
    let port = running.port;
    let before = tokio::task::spawn_blocking(move || scrape(port))
        .await
        .expect("join");
    tokio::task::spawn_blocking(move || {
        let (s, _) = open_stream(port);
        drop(s);
    })
    .await
    .expect("join");
    let cancelled = "gemma4_requests_finished_total{reason=\"cancelled\"}";
    let until = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let text = tokio::task::spawn_blocking(move || scrape(port))
            .await
            .expect("join");
        if metric(&text, cancelled) == 1.0 {
            break text;
        }
        assert!(Instant::now() < until, "not counted:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        metric(&after, "gemma4_prompt_tokens_total")
            - metric(&before, "gemma4_prompt_tokens_total"),
        4.0
    );
    assert!(metric(&after, "gemma4_generation_tokens_total") >= 1.0);
    if let Some(stop) = running.stop {
        let _ = stop.send(());
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), running.serving).await;
}

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read");
    raw
}

//! The server's life in one process: 503 "loading" before the model is
//! installed, ready after, and a clean return from `serve` once the
//! shutdown future completes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gemma4_engine::EngineConfig;
use gemma4_server::{ModelContext, Phase, Server, ServerConfig};
use gemma4_text::{ChatTemplate, Tokenizer};
use serde_json::Value;

/// One HTTP/1.1 request with `Connection: close`; returns the status and the body.
fn call(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read");
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

async fn call_async(
    port: u16,
    method: &'static str,
    path: &'static str,
    body: &'static str,
) -> (u16, Value) {
    let (status, body) = tokio::task::spawn_blocking(move || call(port, method, path, body))
        .await
        .expect("join");
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loading_then_ready_then_shutdown() {
    let server = Server::new(ServerConfig {
        served_model_name: "tiny".into(),
        ..Default::default()
    })
    .expect("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(gemma4_server::serve(listener, server.clone(), async move {
        let _ = stop_rx.await;
    }));

    // Alive while loading, not ready.
    let (status, body) = call_async(port, "GET", "/health", "").await;
    assert_eq!((status, body["status"].as_str()), (200, Some("loading")));
    let (status, body) = call_async(port, "GET", "/ready", "").await;
    assert_eq!((status, body["status"].as_str()), (503, Some("loading")));
    let (status, body) = call_async(port, "POST", "/v1/completions", r#"{"prompt": "hi"}"#).await;
    assert_eq!(status, 503);
    assert_eq!(body["error"]["code"], "model_loading");

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/e-style");
    let model =
        gemma4_model::load(&dir, gemma4_model::LoadPolicy::default()).expect("load fixture");
    let eos = model.config().eos_token_ids.clone();
    let tokenizer = Tokenizer::from_dir(&dir).expect("tokenizer");
    let template = ChatTemplate::for_tokenizer(&tokenizer, None);
    let engine = gemma4_engine::start(
        model,
        Arc::new(tokenizer),
        EngineConfig {
            max_num_seqs: 2,
            ..Default::default()
        },
    )
    .expect("engine");
    server.set_ready(ModelContext::new(engine, template, &eos));
    assert_eq!(server.phase(), Phase::Ready);

    for probe in ["/health", "/ready"] {
        let (status, body) = call_async(port, "GET", probe, "").await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("ready")),
            "{probe}"
        );
    }
    let (status, body) = call_async(
        port,
        "POST",
        "/generate",
        r#"{"prompt": [2, 379, 399, 473, 409, 424, 462, 467], "max_tokens": 3, "temperature": 0}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // The oracle's greedy continuation of this prompt starts 49, 305, 345.
    assert_eq!(body["token_ids"], serde_json::json!([49, 305, 345]));

    let _ = stop_tx.send(());
    let done = tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("serve returns");
    assert!(matches!(done, Ok(Ok(()))));
    assert_eq!(server.phase(), Phase::Draining);
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the listener is closed"
    );
}

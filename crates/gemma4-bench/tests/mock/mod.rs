//! A small OpenAI-compatible HTTP server for tests: streams completion chunks,
//! tokenizes with a made-up rule, and can fail on purpose.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the mock behaves.
#[derive(Clone)]
pub struct Behaviour {
    /// Pause before each token chunk.
    pub token_delay: Duration,
    /// Answer every n-th completion request with HTTP 500.
    pub fail_every: Option<usize>,
    /// Send a usage chunk when asked with stream_options.include_usage.
    pub usage: bool,
    /// Offer POST /tokenize.
    pub tokenize: bool,
    /// Turn this flag on when the n-th completion request arrives.
    pub stop_at: Option<(usize, Arc<tokio::sync::watch::Sender<bool>>)>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            token_delay: Duration::from_millis(2),
            fail_every: None,
            usage: true,
            tokenize: true,
            stop_at: None,
        }
    }
}

/// The mock's token count: one per word, plus one more for every 8 letters,
/// so that long words take two tokens and prompt building has to adjust.
pub fn mock_tokens(text: &str) -> usize {
    text.split_whitespace().map(|w| 1 + w.len() / 8).sum()
}

/// Starts the mock on a free loopback port; it serves until the test ends.
pub async fn start(behaviour: Behaviour) -> SocketAddr {
    let listener = match TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => panic!("binding the mock server: {e}"),
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => panic!("mock address: {e}"),
    };
    let completions = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let behaviour = behaviour.clone();
            let completions = Arc::clone(&completions);
            tokio::spawn(async move {
                let _ = handle(stream, &behaviour, &completions).await;
            });
        }
    });
    addr
}

async fn read_request(stream: &mut TcpStream) -> std::io::Result<(String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.lines();
    let request_line = lines.next().unwrap_or("");
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or("").to_owned();
    let path = parts.next().unwrap_or("").to_owned();
    let length = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok((method, path, body))
}

async fn send_json(stream: &mut TcpStream, status: &str, value: &Value) -> std::io::Result<()> {
    let body = value.to_string();
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.flush().await
}

async fn send_chunk(stream: &mut TcpStream, data: &str) -> std::io::Result<()> {
    let event = format!("data: {data}\n\n");
    stream
        .write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes())
        .await?;
    stream.flush().await
}

async fn handle(
    mut stream: TcpStream,
    b: &Behaviour,
    completions: &AtomicUsize,
) -> std::io::Result<()> {
    let (method, path, body) = read_request(&mut stream).await?;
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    match (method.as_str(), path.as_str()) {
        ("GET", "/v1/models") => {
            let models = json!({"object": "list", "data": [{"id": "mock-model", "object": "model", "owned_by": "mock", "max_model_len": 4096}]});
            send_json(&mut stream, "200 OK", &models).await
        }
        ("GET", "/metrics") => {
            let text = "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 104857600\n";
            let head = format!("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", text.len());
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(text.as_bytes()).await?;
            stream.flush().await
        }
        ("POST", "/tokenize") if b.tokenize => {
            let Some(text) = request.get("content").and_then(Value::as_str) else {
                return send_json(
                    &mut stream,
                    "400 Bad Request",
                    &json!({"error": {"message": "content is required"}}),
                )
                .await;
            };
            let tokens: Vec<u32> = (0..mock_tokens(text) as u32).collect();
            send_json(&mut stream, "200 OK", &json!({"tokens": tokens})).await
        }
        ("POST", "/v1/completions") => {
            let n = completions.fetch_add(1, Ordering::SeqCst) + 1;
            if let Some((at, flag)) = &b.stop_at {
                if n == *at {
                    let _ = flag.send(true);
                }
            }
            if b.fail_every.is_some_and(|k| n.is_multiple_of(k)) {
                return send_json(
                    &mut stream,
                    "500 Internal Server Error",
                    &json!({"error": {"message": "engine exploded", "type": "server_error"}}),
                )
                .await;
            }
            let max_tokens = request
                .get("max_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(16);
            let prompt = request.get("prompt").and_then(Value::as_str).unwrap_or("");
            let include_usage = request
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
                .await?;
            tokio::time::sleep(b.token_delay * 2).await;
            for i in 0..max_tokens {
                let chunk = json!({"id": "cmpl-1", "object": "text_completion", "model": "mock-model",
                    "choices": [{"index": 0, "text": format!(" t{i}"), "finish_reason": if i + 1 == max_tokens { json!("length") } else { Value::Null }}]});
                send_chunk(&mut stream, &chunk.to_string()).await?;
                tokio::time::sleep(b.token_delay).await;
            }
            if include_usage && b.usage {
                let usage = json!({"id": "cmpl-1", "object": "text_completion", "choices": [],
                    "usage": {"prompt_tokens": mock_tokens(prompt), "completion_tokens": max_tokens, "total_tokens": mock_tokens(prompt) as u64 + max_tokens}});
                send_chunk(&mut stream, &usage.to_string()).await?;
            }
            send_chunk(&mut stream, "[DONE]").await?;
            stream.write_all(b"0\r\n\r\n").await?;
            stream.flush().await
        }
        _ => {
            let message = format!("there is no route {method} {path}");
            send_json(
                &mut stream,
                "404 Not Found",
                &json!({"error": {"message": message, "type": "not_found"}}),
            )
            .await
        }
    }
}

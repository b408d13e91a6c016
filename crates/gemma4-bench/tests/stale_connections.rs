//! A kept-alive connection that the server closes as the next request goes
//! out: the load generator sends that request once more on a fresh
//! connection and marks it retried; an answer cut once its head has arrived
//! is the server's error and is not retried.

use std::time::Duration;

use gemma4_bench::client::Endpoint;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SSE: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n";

/// What the server does with the second request on a connection.
#[derive(Clone, Copy)]
enum Second {
    /// Closes without a byte of answer (an idle-close race).
    CloseSilently,
    /// Sends the head and part of the body, then closes.
    CloseMidAnswer,
}

/// Reads one request (head and `Content-Length` body); false at EOF.
async fn read_request(s: &mut TcpStream) -> bool {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte).await {
            Ok(1) => buf.push(byte[0]),
            _ => return false,
        }
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).await.is_ok()
}

async fn answer(s: &mut TcpStream) {
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\n\r\n{SSE}",
        SSE.len()
    );
    let _ = s.write_all(response.as_bytes()).await;
}

async fn server(second: Second) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                if !read_request(&mut s).await {
                    return;
                }
                answer(&mut s).await;
                if !read_request(&mut s).await {
                    return;
                }
                if let Second::CloseMidAnswer = second {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 500\r\n\r\ndata: {\"choices\":[{\"index\":0,\"text\":\"h")
                        .await;
                }
                // Dropping the socket closes it.
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_closed_pooled_connection_is_retried_once_and_marked() {
    let url = server(Second::CloseSilently).await;
    let endpoint = Endpoint::new(&url, None, Duration::from_secs(10)).expect("endpoint");
    let body = json!({"prompt": "x", "stream": true});
    let first = endpoint.stream("v1/completions", &body).await;
    assert!(first.error.is_none(), "{:?}", first.error);
    assert!(!first.retried);
    // Same pooled connection: the server closes it without answering.
    let second = endpoint.stream("v1/completions", &body).await;
    assert!(second.error.is_none(), "{:?}", second.error);
    assert!(second.retried, "the request was not retried");
    assert!(second.saw_done);
}

#[tokio::test]
async fn an_answer_cut_after_its_head_is_an_error_not_retried() {
    let url = server(Second::CloseMidAnswer).await;
    let endpoint = Endpoint::new(&url, None, Duration::from_secs(10)).expect("endpoint");
    let body = json!({"prompt": "x", "stream": true});
    let first = endpoint.stream("v1/completions", &body).await;
    assert!(first.error.is_none(), "{:?}", first.error);
    let second = endpoint.stream("v1/completions", &body).await;
    assert!(second.error.is_some(), "a cut answer passed as a success");
    assert!(
        !second.retried,
        "a request with an answer under way was sent again"
    );
}

//! CORS is off unless origins are configured; with them, browsers'
//! preflight requests are answered (without an API key) and responses
//! carry the allow-origin header for those origins only.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use gemma4_server::{Server, ServerConfig};

async fn serve(config: ServerConfig) -> u16 {
    let server = Server::new(config).expect("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(gemma4_server::serve(
        listener,
        server,
        std::future::pending(),
    ));
    port
}

/// The response head (status line and headers, lower-cased).
async fn head(port: u16, request: String) -> String {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(request.as_bytes()).expect("write");
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        raw.split("\r\n\r\n")
            .next()
            .unwrap_or("")
            .to_ascii_lowercase()
    })
    .await
    .expect("join")
}

fn preflight(origin: &str) -> String {
    format!(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: {origin}\r\n\
         Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\r\n"
    )
}

fn get_health(origin: &str) -> String {
    format!("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: {origin}\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cors_headers_by_default() {
    let port = serve(ServerConfig::default()).await;
    let h = head(port, get_health("http://ui.example")).await;
    assert!(!h.contains("access-control-allow-origin"), "{h}");
    let h = head(port, preflight("http://ui.example")).await;
    assert!(!h.contains("access-control-allow-origin"), "{h}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_origins_are_allowed_and_preflights_need_no_key() {
    let port = serve(ServerConfig {
        cors_allow_origins: vec!["http://ui.example".into()],
        api_key: Some("secret".into()),
        ..Default::default()
    })
    .await;
    let h = head(port, preflight("http://ui.example")).await;
    assert!(h.starts_with("http/1.1 200"), "{h}");
    assert!(
        h.contains("access-control-allow-origin: http://ui.example"),
        "{h}"
    );
    assert!(h.contains("access-control-allow-methods"), "{h}");
    assert!(h.contains("authorization"), "{h}");
    let h = head(port, get_health("http://ui.example")).await;
    assert!(
        h.contains("access-control-allow-origin: http://ui.example"),
        "{h}"
    );
    let h = head(port, get_health("http://evil.example")).await;
    assert!(!h.contains("access-control-allow-origin"), "{h}");

    let any = serve(ServerConfig {
        cors_allow_origins: vec!["*".into()],
        ..Default::default()
    })
    .await;
    let h = head(any, get_health("http://anything.example")).await;
    assert!(h.contains("access-control-allow-origin: *"), "{h}");
}

//! MCP through the official Python SDK (`mcp`, tests/python/mcp_client.py)
//! on the demo model's real weights: `gemma4 mcp` over stdio, and
//! `serve --mcp` at /mcp behind an API key, each at both protocol
//! revisions (the initialize handshake of 2025-11-25, and 2026-07-28's
//! requests that carry their own version). The script lists the tools,
//! calls `chat` with a progress token (the progress messages spell the
//! reply), `complete` (Paris), a malformed argument (an `isError` result),
//! `count_tokens`, and cancels a long call (nothing runs afterwards).

use std::io::{Read, Write};
use std::net::TcpStream;

use serde_json::Value;

use crate::harness::{demo_gguf, python_script, request, root, ServerProc};

/// The Gemma 3 chat template (the demo GGUF carries none).
fn template() -> String {
    let path = root().join("tests/fixtures/text/templates/gemma3.jinja");
    path.to_str().expect("utf-8 path").to_owned()
}

/// What every run must have seen, beyond the script's own checks.
fn check_report(out: &Value, version: &str) {
    assert_eq!(out["protocol_version"], version, "{out}");
    assert!(
        out["completion"]
            .as_str()
            .is_some_and(|t| t.contains("Paris")),
        "{out}"
    );
    assert!(
        out["progress_messages"].as_u64().is_some_and(|n| n >= 1),
        "{out}"
    );
    assert!(
        out["cancelled_in_s"].as_f64().is_some_and(|s| s < 10.0),
        "{out}"
    );
}

const REVISIONS: [(&str, &str); 2] = [("legacy", "2025-11-25"), ("2026-07-28", "2026-07-28")];

#[test]
fn mcp_over_stdio_through_the_python_sdk() {
    if demo_gguf("mcp_over_stdio").is_none() {
        return;
    }
    let (bin, template) = (env!("CARGO_BIN_EXE_gemma4"), template());
    for (mode, version) in REVISIONS {
        let args = ["stdio", bin, mode, template.as_str()];
        let Some(out) = python_script("mcp_client.py", &["mcp"], &args) else {
            return;
        };
        check_report(&out, version);
    }
}

#[test]
fn mcp_over_http_behind_the_api_key() {
    let Some(gguf) = demo_gguf("mcp_over_http") else {
        return;
    };
    let key = "k-mcp";
    let server = ServerProc::start(
        &gguf,
        &["--mcp", "--api-key", key, "--chat-template", &template()],
        &[],
    );
    let url = format!("{}/mcp", server.url());
    for (mode, version) in REVISIONS {
        let args = ["http", url.as_str(), mode, key];
        let Some(out) = python_script("mcp_client.py", &["mcp"], &args) else {
            return;
        };
        check_report(&out, version);
    }
    // Bad input is a 4xx in JSON-RPC's shape, never a 5xx.
    let auth = format!("Bearer {key}");
    let headers = [
        ("Authorization", auth.as_str()),
        ("Accept", "application/json, text/event-stream"),
    ];
    let reply = request(server.port, "POST", "/mcp", &headers, Some(b"{not json"));
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert_eq!(reply.json()["error"]["code"], -32700, "{}", reply.body);
    let reply = request(server.port, "POST", "/mcp", &headers, Some(b"[]"));
    assert!(
        (400..500).contains(&reply.status),
        "{} {}",
        reply.status,
        reply.body
    );
    // DNS rebinding: a page on another name that resolves here is refused.
    assert!(status_with_host(server.port, &auth, "evil.example").starts_with("HTTP/1.1 403"));
    assert!(status_with_host(server.port, &auth, "localhost").starts_with("HTTP/1.1 400"));
}

/// The status line of a bare POST to /mcp with this `Host` header.
fn status_with_host(port: u16, auth: &str, host: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    stream.write_all(head.as_bytes()).expect("send");
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply.lines().next().unwrap_or_default().to_owned()
}

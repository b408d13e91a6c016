//! The server over an engine with injected faults: a failing model step
//! costs only its own request a 500 and `/health` stays 200; a failure the
//! engine cannot recover from turns `/health` into a 503 with the reason
//! and ends `serve` with an error (the process exits non-zero).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gemma4_engine::fault::{Fault, FaultPlan};
use gemma4_engine::EngineConfig;
use gemma4_server::{ModelContext, Server, ServerConfig, ServerError};
use gemma4_text::{ChatTemplate, Tokenizer};
use serde_json::Value;

const TRIGGER: u32 = 511;
const GOOD: &str =
    r#"{"prompt": [2, 379, 399, 473, 409, 424, 462, 467], "max_tokens": 3, "temperature": 0}"#;
const BAD: &str = r#"{"prompt": [2, 379, 511, 473], "max_tokens": 3, "temperature": 0}"#;

async fn start(fault: Fault) -> (u16, tokio::task::JoinHandle<Result<(), ServerError>>) {
    let server = Server::new(ServerConfig::default()).expect("server");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/e-style");
    let model = gemma4_model::load_hf_dir(&dir).expect("load fixture");
    let eos = model.config().eos_token_ids.clone();
    let tokenizer = Tokenizer::from_dir(&dir).expect("tokenizer");
    let template = ChatTemplate::for_tokenizer(&tokenizer, None);
    let plan = FaultPlan {
        trigger_token: TRIGGER,
        fault,
    };
    let engine =
        gemma4_engine::start_with_fault(model, Arc::new(tokenizer), EngineConfig::default(), plan)
            .expect("engine");
    server.set_ready(ModelContext::new(engine, template, &eos));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let serving = tokio::spawn(gemma4_server::serve(
        listener,
        server,
        std::future::pending(),
    ));
    (port, serving)
}

async fn call(
    port: u16,
    method: &'static str,
    path: &'static str,
    body: &'static str,
) -> (u16, Value) {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).expect("write");
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("read");
        let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status");
        let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    })
    .await
    .expect("join")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_fails_its_request_alone() {
    for fault in [Fault::ModelPanics, Fault::ModelFails] {
        let (port, serving) = start(fault).await;
        let (status, body) = call(port, "POST", "/generate", BAD).await;
        assert_eq!(status, 500, "{fault:?}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("injected fault")),
            "{body}"
        );
        let (status, body) = call(port, "GET", "/health", "").await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("ready")),
            "{fault:?}"
        );
        let (status, body) = call(port, "POST", "/generate", GOOD).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["token_ids"], serde_json::json!([49, 305, 345]));
        serving.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrecoverable_failure_is_reported_and_ends_the_server() {
    let (port, serving) = start(Fault::BookkeepingPanics).await;
    let (status, _) = call(port, "POST", "/generate", BAD).await;
    assert_eq!(status, 500);
    let (status, body) = call(port, "GET", "/ready", "").await;
    assert_eq!((status, body["status"].as_str()), (503, Some("failed")));
    let (status, body) = call(port, "GET", "/health", "").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "failed");
    assert!(
        body["reason"]
            .as_str()
            .is_some_and(|r| r.contains("injected fault")),
        "{body}"
    );
    let (status, body) = call(port, "POST", "/generate", GOOD).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("engine_failed"))
    );
    let ended = tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("serve ends after an engine failure");
    match ended {
        Ok(Err(ServerError::EngineFailed(reason))) => assert!(reason.contains("injected fault")),
        other => panic!("serve ended with {other:?}"),
    }
}

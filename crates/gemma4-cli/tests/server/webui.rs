//! The chat page at `/`: in Debian's chromium driven by Playwright
//! (tests/python/webui_check.py) on the demo model's real weights (the key
//! asked for, a reply streamed, Stop cancelling on the server, the model's
//! markup inert), and its routes over plain HTTP: the error shapes, the
//! key on `/webui/info`, and `--no-webui`.

use serde_json::json;

use crate::harness::{demo_gguf, fixture, python_script, request, root, ServerProc};
use crate::images::fixture_of;

/// Debian's chromium (`$GEMMA4_CHROMIUM` names another); `None` outside CI
/// when it is missing.
fn chromium() -> Option<String> {
    let path = std::env::var("GEMMA4_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if std::path::Path::new(&path).exists() {
        return Some(path);
    }
    let msg = format!("no chromium at {path} (apt-get install chromium, or set GEMMA4_CHROMIUM)");
    assert!(std::env::var_os("CI").is_none(), "{msg}");
    eprintln!("SKIPPED the chat page in a browser: {msg}");
    None
}

#[test]
fn the_chat_page_in_chromium() {
    let (Some(gguf), Some(browser)) = (demo_gguf("the_chat_page_in_chromium"), chromium()) else {
        return;
    };
    let template = root().join("tests/fixtures/text/templates/gemma3.jinja");
    let key = "k-page";
    let server = ServerProc::start(
        &gguf,
        &[
            "--api-key",
            key,
            "--chat-template",
            template.to_str().expect("utf-8 path"),
            // Long enough a reply to stop.
            "--default-max-tokens",
            "400",
            "--served-model-name",
            "demo",
        ],
        &[],
    );
    let url = server.url();
    let args = [url.as_str(), key, browser.as_str()];
    let Some(out) = python_script("webui_check.py", &["playwright"], &args) else {
        return;
    };
    assert_eq!(out["model"], "demo", "{out}");
    assert!(
        out["streamed_steps"].as_u64().is_some_and(|n| n >= 2),
        "{out}"
    );
}

#[test]
fn the_page_sends_image_and_audio_attachments() {
    let Some(browser) = chromium() else {
        return;
    };
    let server = ServerProc::start(&fixture_of("e-audio"), &["--max-num-seqs", "2"], &[]);
    let url = server.url();
    let image = fixture_of("images").join("0.png");
    let audio = fixture_of("audio").join("0.wav");
    let args = [
        "attach",
        url.as_str(),
        browser.as_str(),
        image.to_str().expect("utf-8 path"),
        audio.to_str().expect("utf-8 path"),
    ];
    let Some(out) = python_script("webui_check.py", &["playwright"], &args) else {
        return;
    };
    assert_eq!(
        out["parts"],
        json!(["text", "image_url", "input_audio"]),
        "{out}"
    );
}

#[test]
fn the_page_routes_answer_in_the_error_shape() {
    // A checkpoint with both towers: the page offers image and audio attachments.
    let server = ServerProc::start(&fixture_of("e-audio"), &["--api-key", "k"], &[]);
    let page = request(server.port, "GET", "/", &[], None);
    assert_eq!(page.status, 200);
    assert!(page.body.contains("id=\"prompt\""), "{}", page.body);
    let script = request(server.port, "GET", "/webui/app.js", &[], None);
    assert_eq!(script.status, 200);
    assert!(!script.body.contains("innerHTML"), "the page writes HTML");
    let info = request(server.port, "GET", "/webui/info", &[], None);
    assert_eq!(info.status, 401, "{}", info.body);
    let auth = [("Authorization", "Bearer k")];
    let info = request(server.port, "GET", "/webui/info", &auth, None).json();
    assert_eq!(info["model"], "e-audio", "{info}");
    assert_eq!(
        (&info["images"], &info["audio"]),
        (&json!(true), &json!(true)),
        "{info}"
    );
    for (method, path, status) in [("POST", "/", 405), ("GET", "/webui/nope.js", 404)] {
        let reply = request(server.port, method, path, &auth, Some(b"{}"));
        assert_eq!(reply.status, status, "{method} {path}: {}", reply.body);
        assert!(
            reply.json()["error"]["message"].is_string(),
            "{}",
            reply.body
        );
    }
    drop(server);
    let server = ServerProc::start(&fixture("e-style"), &["--no-webui"], &[]);
    assert_eq!(request(server.port, "GET", "/", &[], None).status, 404);
    let info = request(server.port, "GET", "/webui/info", &[], None);
    assert_eq!(info.status, 404, "{}", info.body);
}

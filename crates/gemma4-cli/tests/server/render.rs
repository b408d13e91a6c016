//! vLLM's render routes: the token ids a request would run, from the same
//! request front, without running it; checked against the reference's own
//! prompt ids (text chats, and a chat with two images, whose placeholders
//! and media digests are reported).

use base64::Engine;
use serde_json::{json, Value};

use crate::harness::{fixture, golden, root, ServerProc};
use crate::{ids, prompt_named};

#[test]
fn chat_render_gives_the_reference_prompt_ids() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let g = golden("e-style");
    let chat = prompt_named(&g, "chat");
    let r = server.post(
        "/v1/chat/completions/render",
        &json!({"messages": chat["messages"], "max_tokens": 7, "temperature": 0.5}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(ids(&v["token_ids"]), ids(&chat["input_ids"]));
    assert_eq!(v["features"], Value::Null);
    assert_eq!(v["sampling_params"]["max_tokens"], 7);
    assert_eq!(v["sampling_params"]["temperature"], 0.5);
    assert!(v["request_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    // Nothing ran: no request was counted as finished.
    let metrics = server.get("/metrics").body;
    assert!(
        !metrics.contains("gemma4_requests_finished_total{"),
        "render ran the request: {metrics}"
    );
    // A request the server would refuse is refused here too, by name.
    let r = server.post(
        "/v1/chat/completions/render",
        &json!({"messages": chat["messages"], "max_tokens": 100000}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "max_tokens");
}

#[test]
fn completions_render_gives_one_prompt_each() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let tokenized = server
        .post("/tokenize", &json!({"prompt": "Hello world"}))
        .json();
    let r = server.post(
        "/v1/completions/render",
        &json!({"prompt": ["Hello world", [2, 5, 7]], "n": 2, "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let rendered = v.as_array().expect("a list");
    assert_eq!(rendered.len(), 2, "{v}");
    assert_eq!(rendered[0]["token_ids"], tokenized["tokens"]);
    assert_eq!(rendered[1]["token_ids"], json!([2, 5, 7]));
    assert_eq!(rendered[1]["sampling_params"]["n"], 2);
}

#[test]
fn a_chat_with_images_renders_its_placeholders_and_digests() {
    let dir = root().join("tests/fixtures/vision/e-style");
    // The budget the reference's golden was made with.
    let server = ServerProc::start(&dir, &["--max-soft-tokens", "70"], &[]);
    let text = std::fs::read_to_string(dir.join("golden.json")).expect("golden.json");
    let chat = serde_json::from_str::<Value>(&text).expect("json")["chat"].clone();
    let mut content = vec![json!({"type": "text", "text": chat["messages_text"]})];
    for i in chat["images"].as_array().expect("images") {
        let bytes = std::fs::read(dir.join(format!("../images/{i}.png"))).expect("image");
        let uri = format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        );
        content.push(json!({"type": "image_url", "image_url": {"url": uri}}));
    }
    let r = server.post(
        "/v1/chat/completions/render",
        &json!({"messages": [{"role": "user", "content": content}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let tokens = ids(&v["token_ids"]);
    assert_eq!(tokens, ids(&chat["ids"]));
    let places = v["features"]["mm_placeholders"]["image"]
        .as_array()
        .expect("image placeholders");
    let hashes = v["features"]["mm_hashes"]["image"]
        .as_array()
        .expect("image digests");
    assert_eq!((places.len(), hashes.len()), (2, 2), "{v}");
    for p in places {
        let (offset, length) = (
            p["offset"].as_u64().expect("offset") as usize,
            p["length"].as_u64().expect("length") as usize,
        );
        // As vLLM counts a placeholder: the item's whole stretch, its begin
        // and end markers around the run of soft tokens.
        let run = &tokens[offset..offset + length];
        let soft = &run[1..length - 1];
        assert!(soft.iter().all(|&t| t == soft[0]), "{p}");
        assert!(run[0] != soft[0] && run[length - 1] != soft[0], "{p}");
    }
    assert!(hashes
        .iter()
        .all(|h| h.as_str().is_some_and(|h| h.len() == 64)));
    assert_ne!(hashes[0], hashes[1], "two different images");
}

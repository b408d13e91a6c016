//! Images, video and audio through `gemma4 serve` with the official `openai`
//! client, on the vision fixtures (`tests/fixtures/vision/*`): a chat turn
//! with two images (and, on the 12B and the E-style checkpoint with both
//! towers, an audio clip), and turns with a video, keep the reference's
//! prompt length and greedy tokens, whole and streamed; bad media gets a 400
//! that names the problem.

use base64::Engine as _;
use serde_json::{json, Value};

use crate::harness::{openai_client, openai_error, root, ServerProc};

fn vision_fixture() -> std::path::PathBuf {
    fixture_of("e-style")
}

pub(crate) fn fixture_of(variant: &str) -> std::path::PathBuf {
    root().join("tests/fixtures/vision").join(variant)
}

pub(crate) fn chat_golden_of(variant: &str) -> Value {
    let text =
        std::fs::read_to_string(fixture_of(variant).join("golden.json")).expect("golden.json");
    serde_json::from_str::<Value>(&text).expect("json")["chat"].clone()
}

fn data_uri(bytes: &[u8]) -> String {
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn image_chat(urls: &[String], extra: Value) -> Value {
    let mut content = vec![json!({"type": "text", "text": "x"})];
    content.extend(
        urls.iter()
            .map(|u| json!({"type": "image_url", "image_url": {"url": u}})),
    );
    let mut body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[test]
fn a_chat_with_two_images_keeps_the_reference_tokens_through_the_openai_client() {
    let out = chat_through_the_client("e-style", "wav");
    let Some(out) = out else { return };
    check_bad_media(&out);
}

/// A JPEG reads as the pixels the reference decodes from it: the same chat
/// with the JPEG and with a PNG of the reference's decoded pixels gives the
/// same prompt, tokens and log-probabilities, for 4:2:0 and 4:2:2 files,
/// progressive, CMYK and EXIF-rotated ones.
#[test]
fn a_jpeg_reads_as_the_pixels_the_reference_decodes() {
    // Equal pixels share a media digest, so the second chat would reuse the
    // first one's KV and compute its logits in other chunks: off, each
    // request is computed the same way.
    let server = ServerProc::start(&vision_fixture(), &["--no-prefix-caching"], &[]);
    let corpus = fixture_of("jpeg");
    let extra = json!({"max_tokens": 6, "temperature": 0, "ignore_eos": true,
                       "logprobs": true, "top_logprobs": 2});
    for name in [
        "pil-q75-420-progressive-250x170",
        "cjpeg-q90-422-arithmetic-progressive-128x128",
        "pil-cmyk-q90-97x61",
        "pil-q85-420-exif6-97x61",
    ] {
        let read = |file: String| std::fs::read(corpus.join(&file)).expect("corpus file");
        let replies: Vec<Value> = [format!("{name}.jpg"), format!("{name}.rgb.png")]
            .into_iter()
            .map(|file| {
                let r = server.post(
                    "/v1/chat/completions",
                    &image_chat(&[data_uri(&read(file))], extra.clone()),
                );
                assert_eq!(r.status, 200, "{name}: {}", r.body);
                let reply = r.json();
                json!([
                    reply["usage"]["prompt_tokens"],
                    reply["choices"][0]["logprobs"]
                ])
            })
            .collect();
        assert_eq!(replies[0], replies[1], "{name}");
    }
    // 33×300 at this budget is 15×150 patches, past the tiny checkpoint's
    // 128-entry position table: the client's image, refused by name.
    let thin = std::fs::read(corpus.join("cjpeg-q80-422-33x300.jpg")).expect("jpeg");
    let r = server.post(
        "/v1/chat/completions",
        &image_chat(&[data_uri(&thin)], json!({})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let e = openai_error(&r);
    assert!(
        e["message"]
            .as_str()
            .unwrap_or_default()
            .contains("position table"),
        "{e}"
    );
    assert_eq!(e["param"], "messages[0].content[1].image_url.url");
}

#[test]
fn a_chat_with_two_images_on_a_checkpoint_pooling_2x2_keeps_the_reference_tokens() {
    // Images resized on 32-pixel blocks, as its processor_config.json says.
    chat_through_the_client("e-style-pool2", "wav");
}

#[test]
fn a_chat_with_two_images_and_an_audio_clip_on_the_12b_keeps_the_reference_tokens() {
    // Its reply ends in byte tokens that are not UTF-8 together: the stream
    // holds the run and shows it as the whole decode does.
    chat_through_the_client("unified", "wav");
}

#[test]
fn a_chat_with_two_images_and_an_audio_clip_on_the_e_style_towers_keeps_the_reference_tokens() {
    // The conformer audio tower and the vision tower of one checkpoint; the
    // clip as WAV and as FLAC (lossless: the same samples, the same reply).
    if chat_through_the_client("e-audio", "wav").is_none() {
        return;
    }
    chat_through_the_client("e-audio", "flac");
    // The towers from a multimodal projector file instead (llama.cpp's layout).
    let mmproj = fixture_of("e-audio-mmproj.gguf");
    chat_through_the_client_with(
        "e-audio",
        "wav",
        &["--mmproj", &mmproj.display().to_string()],
    );
    // A clip too short for one log-mel window is refused by name.
    let server = ServerProc::start(&fixture_of("e-audio"), &[], &[]);
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "input_audio", "input_audio": {"data": b64(&wav(&[100; 100])), "format": "wav"}}]}],
        "max_tokens": 1});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    let e = openai_error(&r);
    let message = e["message"].as_str().unwrap_or_default();
    assert!(message.contains("100 samples long"), "{e}");
    assert_eq!(e["param"], "messages[0].content[1].input_audio.data");
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": b64(&wav(&[100; 1600])), "format": "wav"}}]}],
            "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // 1,600 samples: 9 mel frames, 3 soft tokens, between <|audio> and <audio|>.
    let with_clip = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": ""}], "max_tokens": 1}),
    );
    let without = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(with_clip, without + 5, "{with_clip} vs {without}");
    // The test clip as MP3 (lossy, same length): its 33 soft tokens.
    for ext in ["wav", "mp3"] {
        let bytes = std::fs::read(fixture_of("audio").join(format!("0.{ext}"))).expect("clip");
        let r = server.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": b64(&bytes), "format": ext}}]}],
                "max_tokens": 1}),
        );
        assert_eq!(r.status, 200, "{ext}: {}", r.body);
        let tokens = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(tokens, without + 35, "{ext}");
    }
    // The Responses API takes `input_audio` parts the same way.
    let wav_bytes = std::fs::read(fixture_of("audio").join("0.wav")).expect("clip");
    let responses = |content: Value| responses_input_tokens(&server, content);
    let (text_only, no_media) = responses(json!(""));
    assert_eq!(no_media, Value::Null);
    let (with_clip, details) = responses(json!([{"type": "input_audio",
        "input_audio": {"data": b64(&wav_bytes), "format": "wav"}}]));
    assert_eq!(with_clip, text_only + 35);
    // <|audio>, 33 soft tokens, <audio|>; counted as chat counts them.
    assert_eq!(
        details,
        json!({"image_tokens": 0, "audio_tokens": 33, "video_tokens": 0,
               "media": [{"type": "audio", "soft_tokens": 33}]})
    );
}

/// A plain HTTP server on a local port for the remote-media test: `/img.png`
/// (the image), `/big.png` (declares 10 MB), `/stream.png` (chunked, without
/// end), `/slowish.png` (the image after 1.4 s), `/slow.png` (answers after 3 s), `/loop` (redirects to itself),
/// `/hop` (redirects to `/img.png` at 127.0.0.1) and anything else 404;
/// with the number of requests it has taken.
fn media_host(
    png: Vec<u8>,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let png = png.clone();
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let _ = match path.as_str() {
                    "/img.png" => conn
                        .write_all(
                            format!("HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", png.len())
                                .as_bytes(),
                        )
                        .and_then(|_| conn.write_all(&png)),
                    "/big.png" => conn.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\nConnection: close\r\n\r\n\x89PNG",
                    ),
                    "/stream.png" => (|| {
                        conn.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")?;
                        let chunk = vec![7u8; 65_536];
                        for _ in 0..64 {
                            conn.write_all(b"10000\r\n")?;
                            conn.write_all(&chunk)?;
                            conn.write_all(b"\r\n")?;
                        }
                        conn.write_all(b"0\r\n\r\n")
                    })(),
                    "/slowish.png" => {
                        std::thread::sleep(std::time::Duration::from_millis(1400));
                        conn.write_all(
                            format!("HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", png.len())
                                .as_bytes(),
                        )
                        .and_then(|_| conn.write_all(&png))
                    }
                    "/slow.png" => {
                        std::thread::sleep(std::time::Duration::from_secs(3));
                        conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    }
                    "/loop" => conn.write_all(
                        b"HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    ),
                    "/hop" => conn.write_all(
                        format!("HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{}/img.png\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", addr.port())
                            .as_bytes(),
                    ),
                    _ => conn.write_all(
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    ),
                };
            });
        }
    });
    (addr, hits)
}

#[test]
fn images_by_url_are_fetched_only_when_allowed_and_within_bounds() {
    let dir = vision_fixture();
    let png = std::fs::read(dir.join("../images/0.png")).expect("png");
    let (host, hits) = media_host(png.clone());
    let server = ServerProc::start(
        &dir,
        &[
            "--allow-remote-media",
            "--allow-private-media-hosts",
            "--media-fetch-timeout",
            "2",
            "--max-media-bytes",
            "1000000",
            "--limit-mm-per-prompt",
            "image=2",
        ],
        &[],
    );
    let tokens = |r: &crate::harness::Reply| r.json()["usage"]["prompt_tokens"].as_u64();
    let sent = server.post(
        "/v1/chat/completions",
        &image_chat(&[data_uri(&png)], json!({})),
    );
    assert_eq!(sent.status, 200, "{}", sent.body);
    let fetched = server.post(
        "/v1/chat/completions",
        &image_chat(&[format!("http://{host}/img.png")], json!({})),
    );
    assert_eq!(fetched.status, 200, "{}", fetched.body);
    assert_eq!(tokens(&fetched), tokens(&sent));
    for (path, words) in [
        ("/big.png", "at most 1000000 are fetched"),
        ("/stream.png", "at most 1000000 are fetched"),
        ("/slow.png", "did not arrive within 2 s"),
        ("/loop", "more than 3 redirects"),
        ("/missing.png", "HTTP 404"),
    ] {
        let r = server.post(
            "/v1/chat/completions",
            &image_chat(&[format!("http://{host}{path}")], json!({})),
        );
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let e = openai_error(&r);
        assert!(
            e["message"].as_str().unwrap_or_default().contains(words),
            "{path}: {e}"
        );
        assert_eq!(e["param"], "messages[0].content[1].image_url.url", "{path}");
    }
    // The request's budgets: each image is within its own bounds, the two
    // together are not; the second is named.
    let per_request = (png.len() * 3 / 2).to_string();
    let budgeted = ServerProc::start(
        &dir,
        &[
            "--allow-remote-media",
            "--allow-private-media-hosts",
            "--media-fetch-timeout",
            "2",
            "--media-request-timeout",
            "2.5",
            "--max-media-bytes-per-request",
            &per_request,
        ],
        &[],
    );
    for (path, words) in [
        ("/img.png", "--max-media-bytes-per-request"),
        (
            "/slowish.png",
            "did not all arrive within 2.5 s (--media-request-timeout)",
        ),
    ] {
        let url = format!("http://{host}{path}");
        let one = budgeted.post(
            "/v1/chat/completions",
            &image_chat(std::slice::from_ref(&url), json!({})),
        );
        assert_eq!(one.status, 200, "{path}: {}", one.body);
        let r = budgeted.post(
            "/v1/chat/completions",
            &image_chat(&[url.clone(), url], json!({})),
        );
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let e = openai_error(&r);
        assert!(
            e["message"].as_str().unwrap_or_default().contains(words),
            "{path}: {e}"
        );
        assert_eq!(e["param"], "messages[0].content[2].image_url.url", "{path}");
    }
    // More images than the server takes are refused before any is fetched.
    let before = hits.load(std::sync::atomic::Ordering::SeqCst);
    let url = format!("http://{host}/img.png");
    let r = server.post(
        "/v1/chat/completions",
        &image_chat(&[url.clone(), url.clone(), url], json!({})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("at most 2 per prompt"), "{}", r.body);
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), before);
    // Without the flag, the same URL is refused unfetched.
    let off = ServerProc::start(&dir, &[], &[]);
    let r = off.post(
        "/v1/chat/completions",
        &image_chat(&[format!("http://{host}/img.png")], json!({})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("--allow-remote-media"), "{}", r.body);
}

/// Media URLs may not reach what only the server reaches: loopback, private
/// and link-local addresses are refused however they are written, by name
/// after resolution, and as the target of a redirect; a host on
/// --allowed-media-domains is fetched wherever it is.
#[test]
fn media_urls_reach_only_public_or_listed_hosts() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = vision_fixture();
    let png = std::fs::read(dir.join("../images/0.png")).expect("png");
    let (host, hits) = media_host(png);
    let port = host.port();
    let refused_with = |server: &ServerProc, url: &str, words: &str| {
        let r = server.post(
            "/v1/chat/completions",
            &image_chat(&[url.to_owned()], json!({})),
        );
        assert_eq!(r.status, 400, "{url}: {}", r.body);
        let e = openai_error(&r);
        let message = e["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains(words), "{url}: {message}");
        assert_eq!(e["param"], "messages[0].content[1].image_url.url", "{url}");
    };
    let open = ServerProc::start(&dir, &["--allow-remote-media"], &[]);
    // Addresses written in the URL are refused before any connection.
    for (url, words) in [
        (
            format!("http://127.0.0.1:{port}/img.png"),
            "127.0.0.1, a loopback address",
        ),
        (
            format!("http://2130706433:{port}/img.png"),
            "127.0.0.1, a loopback address",
        ),
        (
            format!("http://[::1]:{port}/img.png"),
            "::1, a loopback address",
        ),
        (
            "http://169.254.169.254/latest/meta-data/".to_owned(),
            "a link-local address",
        ),
        (
            "http://10.0.0.1/img.png".to_owned(),
            "a private (10.0.0.0/8) address",
        ),
    ] {
        refused_with(&open, &url, words);
    }
    assert_eq!(hits.load(SeqCst), 0, "a refused address was connected to");
    // A name is refused once it resolves to a loopback address.
    refused_with(
        &open,
        &format!("http://localhost:{port}/img.png"),
        "a loopback address",
    );
    assert_eq!(hits.load(SeqCst), 0, "a refused name was connected to");

    // A listed host is fetched; a redirect off the list is refused.
    let listed = ServerProc::start(
        &dir,
        &[
            "--allow-remote-media",
            "--allowed-media-domains",
            "localhost",
        ],
        &[],
    );
    let r = listed.post(
        "/v1/chat/completions",
        &image_chat(&[format!("http://localhost:{port}/img.png")], json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    refused_with(
        &listed,
        &format!("http://localhost:{port}/hop"),
        "a redirect was refused: the host `127.0.0.1` is not one of --allowed-media-domains",
    );
    refused_with(
        &listed,
        &format!("http://127.0.0.1:{port}/img.png"),
        "not one of --allowed-media-domains",
    );

    // The test flag reaches the local server, redirect included.
    let private = ServerProc::start(
        &dir,
        &["--allow-remote-media", "--allow-private-media-hosts"],
        &[],
    );
    for url in [
        format!("http://localhost:{port}/hop"),
        format!("http://2130706433:{port}/img.png"),
    ] {
        let r = private.post(
            "/v1/chat/completions",
            &image_chat(std::slice::from_ref(&url), json!({})),
        );
        assert_eq!(r.status, 200, "{url}: {}", r.body);
    }
}

/// `usage.input_tokens` of a one-token `/v1/responses` reply to a user turn
/// with this content.
/// `/v1/responses` with one user message of this content: its input
/// tokens, and the media counts of `usage.input_tokens_details` (null
/// without media).
fn responses_input_tokens(server: &ServerProc, content: Value) -> (u64, Value) {
    let r = server.post(
        "/v1/responses",
        &json!({"input": [{"role": "user", "content": content}], "max_output_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let usage = &r.json()["usage"];
    let tokens = usage["input_tokens"].as_u64().expect("input_tokens");
    (tokens, media_details(&usage["input_tokens_details"]))
}

/// `input_tokens_details` without its prefix-cache counts (which depend on
/// what ran before), or null when only those are there.
fn media_details(details: &Value) -> Value {
    let mut media = details.clone();
    for key in ["cached_tokens", "cache_write_tokens"] {
        let count = media.as_object_mut().and_then(|d| d.remove(key));
        assert!(count.is_some_and(|c| c.is_u64()), "no {key} in {details}");
    }
    if media.as_object().is_some_and(|d| d.is_empty()) {
        Value::Null
    } else {
        media
    }
}

/// A 16 kHz mono 16-bit WAV file of these samples.
fn wav(samples: &[i16]) -> Vec<u8> {
    let data: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
    let mut out = Vec::new();
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    for field in [16u32, 0x0001_0001, 16_000, 32_000, 0x0010_0002] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.extend_from_slice(b"data");
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&data);
    out
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The chat turn of the fixture's golden (its images and audio as data, the
/// clip from the file with this extension) through the openai client, whole
/// and streamed; the client's report.
fn chat_through_the_client(variant: &str, audio_ext: &str) -> Option<Value> {
    chat_through_the_client_with(variant, audio_ext, &[])
}

/// [`chat_through_the_client`] with more `serve` arguments.
fn chat_through_the_client_with(
    variant: &str,
    audio_ext: &str,
    serve_args: &[&str],
) -> Option<Value> {
    let dir = fixture_of(variant);
    let golden = chat_golden_of(variant);
    let index_paths = |key: &str, path: &dyn Fn(&Value) -> String| -> Vec<String> {
        golden[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| dir.join(path(i)).display().to_string())
            .collect()
    };
    let case = ChatCase {
        text: golden["messages_text"].as_str().unwrap().into(),
        images: index_paths("images", &|i| format!("../images/{i}.png")),
        videos: Vec::new(),
        audios: index_paths("audios", &|i| format!("../audio/{i}.{audio_ext}")),
        ids: golden["ids"].clone(),
        greedy: golden["greedy"].clone(),
    };
    chat_case_through_the_client(variant, &case, serve_args)
}

/// A chat turn of a golden file: its text, its media files in the order
/// the client sends them (text, images, videos, audio), and the reference's
/// prompt ids and greedy tokens.
struct ChatCase {
    text: String,
    images: Vec<String>,
    videos: Vec<String>,
    audios: Vec<String>,
    ids: Value,
    greedy: Value,
}

/// A chat turn through the openai client, whole and streamed: the reply is
/// the reference's greedy tokens as text, `usage` counts the reference's
/// prompt and each item's soft tokens; the client's report.
fn chat_case_through_the_client(
    variant: &str,
    case: &ChatCase,
    serve_args: &[&str],
) -> Option<Value> {
    let dir = fixture_of(variant);
    let mut args = vec!["--max-soft-tokens", "70"];
    args.extend_from_slice(serve_args);
    let server = ServerProc::start(&dir, &args, &[]);
    // Chat content never holds the thought-channel or tool-declaration
    // markers (the output processor reads them out); the rest is the
    // reference's tokens as text.
    let marker = |m: &str| {
        server
            .post(
                "/tokenize",
                &json!({"prompt": m, "add_special_tokens": false}),
            )
            .json()["tokens"][0]
            .clone()
    };
    let markers = ["<channel|>", "<|channel>", "<|tool>", "<tool|>"].map(marker);
    let content_ids: Vec<&Value> = case
        .greedy
        .as_array()
        .unwrap()
        .iter()
        .filter(|id| !markers.contains(id))
        .collect();
    let expected = server.post("/detokenize", &json!({"tokens": content_ids}));
    assert_eq!(expected.status, 200, "{}", expected.body);
    let expected = expected.json()["prompt"].as_str().expect("text").to_owned();
    assert!(!expected.is_empty());
    let mut args = vec![
        "--scenario".to_string(),
        "images".into(),
        "--prompt".into(),
        case.text.clone(),
        "--max-tokens".into(),
        "12".into(),
    ];
    for (flag, paths) in [
        ("--image", &case.images),
        ("--video", &case.videos),
        ("--audio", &case.audios),
    ] {
        for path in paths {
            args.extend([flag.to_string(), path.clone()]);
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = openai_client(&server.url(), &args)?;
    let prompt_tokens = case.ids.as_array().unwrap().len() as u64;
    assert_eq!(
        out["usage"]["prompt_tokens"], prompt_tokens,
        "{variant}: {out}"
    );
    assert_eq!(out["usage"]["completion_tokens"], 12);
    assert_eq!(out["text"], expected.as_str(), "{variant}: whole reply");
    assert_eq!(
        out["streamed"],
        expected.as_str(),
        "{variant}: streamed reply"
    );
    assert_eq!(out["stream_usage"]["prompt_tokens"], prompt_tokens);
    // Each item's soft tokens, in order, as the reference laid them out: the
    // runs of placeholder ids in its prompt (a video's frames, one run each,
    // are one item).
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config"))
            .expect("json");
    let mut runs: Vec<(&str, u64)> = Vec::new();
    let mut previous = None;
    for id in case.ids.as_array().unwrap() {
        let kind = if *id == config["image_token_id"] {
            Some("image")
        } else if *id == config["audio_token_id"] {
            Some("audio")
        } else if *id == config["video_token_id"] {
            Some("video")
        } else {
            None
        };
        let last_kind = runs.last().map(|r| r.0);
        match (kind, previous) {
            (Some(k), Some(p)) if k == p => runs.last_mut().expect("a run").1 += 1,
            (Some("video"), _) if last_kind == Some("video") => {
                runs.last_mut().expect("a run").1 += 1
            }
            (Some(k), _) => runs.push((k, 1)),
            _ => {}
        }
        previous = kind;
    }
    let media: Vec<Value> = runs
        .iter()
        .map(|(k, n)| json!({"type": k, "soft_tokens": n}))
        .collect();
    let total = |kind: &str| -> u64 { runs.iter().filter(|r| r.0 == kind).map(|r| r.1).sum() };
    let details = json!({
        "image_tokens": total("image"),
        "audio_tokens": total("audio"),
        "video_tokens": total("video"),
        "media": media,
    });
    for usage in [&out["usage"], &out["stream_usage"]] {
        // The client's own model adds its other fields (as nulls).
        for key in ["image_tokens", "audio_tokens", "video_tokens", "media"] {
            assert_eq!(
                usage["prompt_tokens_details"][key], details[key],
                "{variant}: {key}"
            );
        }
    }
    Some(out)
}

#[test]
fn chats_with_a_video_keep_the_reference_tokens_through_the_openai_client() {
    // The E-style fixture (causal), the dense one (each frame's soft tokens
    // see each other) and the 12B with its embedders from an mmproj file:
    // the video alone, then after an image.
    let unified_mmproj = fixture_of("unified-mmproj.gguf").display().to_string();
    for (variant, serve_args) in [
        ("e-style", vec![]),
        ("dense", vec![]),
        // The 12B's encoder-free embedders from a projector file.
        ("unified", vec!["--mmproj", unified_mmproj.as_str()]),
    ] {
        let dir = fixture_of(variant);
        let text = std::fs::read_to_string(dir.join("video_golden.json")).expect("golden");
        let golden: Value = serde_json::from_str(&text).expect("json");
        let video = dir
            .join(golden["video"].as_str().unwrap())
            .display()
            .to_string();
        let image = dir
            .join(golden["image"].as_str().unwrap())
            .display()
            .to_string();
        for chat in golden["chats"].as_array().unwrap() {
            let media: Vec<&str> = chat["media"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_str().unwrap())
                .collect();
            if !media.contains(&"video") {
                continue;
            }
            let case = ChatCase {
                text: chat["text"].as_str().unwrap().into(),
                images: media
                    .iter()
                    .filter(|m| **m == "image")
                    .map(|_| image.clone())
                    .collect(),
                videos: vec![video.clone()],
                audios: Vec::new(),
                ids: chat["ids"].clone(),
                greedy: chat["greedy"].clone(),
            };
            if chat_case_through_the_client(variant, &case, &serve_args).is_none() {
                return;
            }
        }
    }
}

/// Every bad-media case of the client's report got its 400.
fn check_bad_media(out: &Value) {
    let bad = &out["bad"];
    for (case, words) in [
        ("corrupt", "could not be decoded"),
        ("not_base64", "not valid base64"),
        ("not_an_image", "format is not supported"),
        ("remote", "data: URI"),
    ] {
        assert_eq!(bad[case]["status"], 400, "{case}: {}", bad[case]);
        let message = bad[case]["message"].as_str().unwrap_or_default();
        assert!(message.contains(words), "{case}: {message}");
        assert!(
            message.contains("messages[0].content[1].image_url.url"),
            "{case}: {message}"
        );
    }
}

/// The PNG chunk checksum (CRC-32, polynomial 0xEDB88320), to keep an
/// edited header valid.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn bad_media_and_limits_get_a_400_naming_the_problem() {
    let dir = vision_fixture();
    let server = ServerProc::start(&dir, &["--limit-mm-per-prompt", "image=1,video=1"], &[]);
    let png = std::fs::read(dir.join("../images/0.png")).expect("png");
    let gif = std::fs::read(dir.join("../video/0.gif")).expect("gif");
    // A PNG whose header claims 20000×20000: refused before decoding.
    let mut bomb = png.clone();
    bomb[16..20].copy_from_slice(&20_000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&20_000u32.to_be_bytes());
    let crc = crc32(&bomb[12..29]);
    bomb[29..33].copy_from_slice(&crc.to_be_bytes());
    let cases = [
        (
            image_chat(&[data_uri(&png), data_uri(&png)], json!({})),
            "at most 1 per prompt",
        ),
        (image_chat(&[data_uri(&bomb)], json!({})), "20000×20000"),
        (
            image_chat(
                &[data_uri(&png)],
                json!({"mm_processor_kwargs": {"max_soft_tokens": 100}}),
            ),
            "max_soft_tokens must be one of",
        ),
        (
            json!({"messages": [{"role": "user", "content": "look: <|image|>"}], "max_tokens": 1}),
            "",
        ),
    ];
    for (body, words) in &cases[..3] {
        refused(&server, body, words);
    }
    // Bad videos: a second one past the limit, an MP4 (not decoded here), a
    // cut GIF, a still PNG whose header claims a huge canvas.
    let video_chat = |uris: &[String]| {
        let mut content = vec![json!({"type": "text", "text": "x"})];
        content.extend(
            uris.iter()
                .map(|u| json!({"type": "video_url", "video_url": {"url": u}})),
        );
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    };
    let gif_uri = |bytes: &[u8]| {
        format!(
            "data:image/gif;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    };
    let mp4 = b"\0\0\0\x18ftypmp42\0\0\0\0mp42isom\0\0\0\x08free";
    for (body, words) in [
        (
            video_chat(&[gif_uri(&gif), gif_uri(&gif)]),
            "at most 1 per prompt",
        ),
        (video_chat(&[gif_uri(mp4)]), "MP4"),
        (video_chat(&[gif_uri(&gif[..gif.len() / 2])]), "video"),
        (video_chat(&[gif_uri(&bomb)]), "20000×20000"),
        (
            video_chat(&["https://example.com/clip.gif".into()]),
            "--allow-remote-media",
        ),
    ] {
        let e = refused(&server, &body, words);
        if words != "at most 1 per prompt" {
            assert_eq!(e["param"], "messages[0].content[1].video_url.url", "{e}");
        }
    }
    // Audio on a checkpoint without an audio path is refused by name.
    let audio = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}],
        "max_tokens": 1});
    let e = refused(&server, &audio, "no audio encoder");
    assert_eq!(e["param"], "messages[0].content[1].input_audio.data");
    // The placeholder typed as text, without an image, is just text.
    let r = server.post("/v1/chat/completions", &cases[3].0);
    assert_eq!(r.status, 200, "{}", r.body);
    // One good image still answers after the refusals.
    let r = server.post(
        "/v1/chat/completions",
        &image_chat(&[data_uri(&png)], json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // The Responses API takes `input_image` parts the same way.
    let responses = |content: Value| responses_input_tokens(&server, content);
    let (text_only, _) = responses(json!([{"type": "input_text", "text": "x"}]));
    let (with_image, details) = responses(json!([{"type": "input_text", "text": "x"},
                                      {"type": "input_image", "image_url": data_uri(&png)}]));
    // <|image>, the soft tokens, <image|> in place of the placeholder.
    assert!(with_image > text_only + 60, "{text_only} vs {with_image}");
    let soft = details["image_tokens"].as_u64().expect("image_tokens");
    assert_eq!(with_image, text_only + soft + 2, "{details}");
    assert_eq!(
        details["media"],
        json!([{"type": "image", "soft_tokens": soft}])
    );

    // A model without a vision tower says so.
    let text_only = ServerProc::start(&root().join("tests/fixtures/oracle/e-style"), &[], &[]);
    refused(
        &text_only,
        &image_chat(&[data_uri(&png)], json!({})),
        "no vision tower",
    );
    refused(
        &text_only,
        &video_chat(&[gif_uri(&gif)]),
        "cannot read video_url parts",
    );
}

/// Posts a chat request that must be refused with a 400 whose message
/// holds `words`; returns the error object.
fn refused(server: &ServerProc, body: &Value, words: &str) -> Value {
    let r = server.post("/v1/chat/completions", body);
    assert_eq!(r.status, 400, "{words}: {}", r.body);
    let e = openai_error(&r);
    assert!(
        e["message"].as_str().unwrap_or_default().contains(words),
        "{words}: {e}"
    );
    e
}

//! The `gemma4` binary end to end: verify, doctor, plan and generate, on
//! the oracle fixtures and on damaged copies of them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gemma4"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(v: &str) -> PathBuf {
    root().join("tests/fixtures/oracle").join(v)
}

fn run(cmd: &mut Command) -> (Output, String) {
    let out = cmd.output().expect("run gemma4");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

fn copy_dir(src: &Path, name: &str, skip: &[&str]) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("gemma4-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    copy_files(src, &dst, skip)
}

/// Copies the files of `src` but those named in `skip` into the folder
/// `dst`, made if needed; returns `dst`.
fn copy_files(src: &Path, dst: &Path, skip: &[&str]) -> PathBuf {
    std::fs::create_dir_all(dst).expect("mkdir");
    for e in std::fs::read_dir(src).expect("read_dir") {
        let e = e.expect("entry");
        let n = e.file_name().to_string_lossy().to_string();
        if !skip.contains(&n.as_str()) {
            std::fs::copy(e.path(), dst.join(&n)).expect("copy");
        }
    }
    dst.to_path_buf()
}

/// `gemma4 verify` of a checkpoint directory against its own `golden.json`.
fn verify_dir(dir: &Path) -> (std::process::Output, String) {
    run(bin()
        .args(["verify", "--model"])
        .arg(dir)
        .arg("--golden")
        .arg(dir.join("golden.json")))
}

#[test]
fn verify_passes_on_every_fixture() {
    for v in ["e-style", "dense-k-eq-v", "moe", "unified"] {
        let dir = fixture(v);
        let (out, text) = verify_dir(&dir);
        assert!(out.status.success(), "{v}: {text}");
        let last = text
            .lines()
            .rev()
            .find(|l| l.starts_with("SEQ_MATCH"))
            .expect("SEQ_MATCH line");
        assert!(
            last.starts_with("SEQ_MATCH true max_abs_logit_diff="),
            "{v}: {last}"
        );
        assert_eq!(
            text.lines().filter(|l| l.starts_with("MATCH")).count(),
            3,
            "{text}"
        );
    }
}

#[test]
fn verify_checks_images_stage_by_stage() {
    let vision = root().join("tests/fixtures/vision");
    for v in [
        "e-style",
        "e-style-pool2",
        "dense",
        "moe",
        "unified",
        "e-audio",
    ] {
        let dir = vision.join(v);
        let (out, text) = verify_dir(&dir);
        assert!(out.status.success(), "{v}: {text}");
        assert!(text.lines().any(|l| l == "SEQ_MATCH true"), "{v}: {text}");
        // Four images and three prompts; the 12B's also an audio clip and a
        // prompt holding it; the conformer tower's also the clip's log-mel
        // features and a prompt with the clip alone.
        let expected = match v {
            "unified" => 9,
            "e-audio" => 11,
            _ => 7,
        };
        assert_eq!(
            text.lines().filter(|l| l.starts_with("MATCH")).count(),
            expected,
            "{v}: {text}"
        );
    }
    // The same towers from a multimodal projector file (llama.cpp's layout).
    let dir = vision.join("e-audio");
    let (out, text) = run(bin()
        .args(["verify", "--model"])
        .arg(&dir)
        .arg("--mmproj")
        .arg(vision.join("e-audio-mmproj.gguf"))
        .arg("--golden")
        .arg(dir.join("golden.json")));
    assert!(out.status.success(), "mmproj: {text}");
    assert_eq!(
        text.lines().filter(|l| l.starts_with("MATCH")).count(),
        11,
        "mmproj: {text}"
    );
    let (out, text) = run(bin()
        .args(["verify", "--model"])
        .arg(&dir)
        .arg("--mmproj")
        .arg(root().join("tests/fixtures/text/ggml-vocab-gemma-4.gguf"))
        .arg("--golden")
        .arg(dir.join("golden.json")));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("not a multimodal projector"), "{text}");
    // The 12B's encoder-free embedders from a projector file, for its image
    // and audio golden and its video golden (the video id from config.json).
    let dir = vision.join("unified");
    for (golden, matches) in [("golden.json", 9), ("video_golden.json", 5)] {
        let (out, text) = run(bin()
            .args(["verify", "--model"])
            .arg(&dir)
            .arg("--mmproj")
            .arg(vision.join("unified-mmproj.gguf"))
            .arg("--golden")
            .arg(dir.join(golden)));
        assert!(out.status.success(), "unified mmproj {golden}: {text}");
        assert_eq!(
            text.lines().filter(|l| l.starts_with("MATCH")).count(),
            matches,
            "unified mmproj {golden}: {text}"
        );
    }
    // Images 0 and 2 become the same number of soft tokens: swapped, the
    // first stage to depart is the processor's output.
    let tmp = std::env::temp_dir().join(format!("gemma4-cli-{}-vision", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let copy = copy_files(&vision.join("e-style"), &tmp.join("e-style"), &[]);
    std::fs::create_dir_all(tmp.join("images")).expect("mkdir");
    for (from, to) in [(0, 2), (1, 1), (2, 0), (3, 3)] {
        std::fs::copy(
            vision.join(format!("images/{from}.png")),
            tmp.join(format!("images/{to}.png")),
        )
        .expect("copy image");
    }
    let (out, text) = verify_dir(&copy);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("DIFF  image=0 stage=processor output"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("SEQ_MATCH false")),
        "{text}"
    );
    // The clip at half its loudness: its log-mel features depart first.
    let copy = copy_files(&vision.join("e-audio"), &tmp.join("e-audio"), &[]);
    std::fs::create_dir_all(tmp.join("audio")).expect("mkdir");
    for i in 0..4 {
        std::fs::copy(
            vision.join(format!("images/{i}.png")),
            tmp.join(format!("images/{i}.png")),
        )
        .expect("copy image");
    }
    let mut wav = std::fs::read(vision.join("audio/0.wav")).expect("wav");
    // 16-bit PCM after a 44-byte header.
    for s in wav[44..].chunks_exact_mut(2) {
        let v = i16::from_le_bytes([s[0], s[1]]) / 2;
        s.copy_from_slice(&v.to_le_bytes());
    }
    std::fs::write(tmp.join("audio/0.wav"), wav).expect("write wav");
    let (out, text) = verify_dir(&copy);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("stage=processor output"), "{text}");
    assert!(text.contains("DIFF  audio=0 mel_frames=129"), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("SEQ_MATCH false")),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The image processor's geometry comes from the checkpoint's processor
/// files, as the reference's does; one that disagrees with the encoder's
/// pooling kernel (the reference then fails on every image) is refused at
/// load, naming both fields.
#[test]
fn a_processor_that_cannot_feed_the_encoder_is_refused_at_load() {
    let vision = root().join("tests/fixtures/vision");
    let tmp = std::env::temp_dir().join(format!("gemma4-cli-{}-pooling", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let pooled = copy_files(&vision.join("e-style-pool2"), &tmp.join("pool3"), &[]);
    let config = pooled.join("processor_config.json");
    let text = std::fs::read_to_string(&config).expect("processor_config.json");
    let three = text.replace("\"pooling_kernel_size\": 2", "\"pooling_kernel_size\": 3");
    assert_ne!(text, three);
    std::fs::write(&config, three).expect("write");
    let (out, text) = verify_dir(&pooled);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("image_processor.pooling_kernel_size")
            || text
                .contains("sets pooling_kernel_size 3, but vision_config.pooling_kernel_size is 2"),
        "{text}"
    );
    // Without processor files the reference takes its defaults (3×3).
    let bare = copy_files(
        &vision.join("e-style-pool2"),
        &tmp.join("bare"),
        &["processor_config.json"],
    );
    let (out, text) = verify_dir(&bare);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("with no processor_config.json"), "{text}");
    assert!(
        text.contains("vision_config.pooling_kernel_size is 2"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn verify_checks_video_stage_by_stage() {
    let vision = root().join("tests/fixtures/vision");
    let video_golden = |dir: &Path| {
        run(bin()
            .args(["verify", "--model"])
            .arg(dir)
            .arg("--golden")
            .arg(dir.join("video_golden.json")))
    };
    for v in ["e-style", "dense", "moe", "unified", "e-audio"] {
        let (out, text) = video_golden(&vision.join(v));
        assert!(out.status.success(), "{v}: {text}");
        // The frames, their soft tokens, and three chat turns.
        assert_eq!(
            text.lines().filter(|l| l.starts_with("MATCH")).count(),
            5,
            "{v}: {text}"
        );
    }
    // The video with its frames in reverse order: the decoded frames depart
    // first, and no prompt runs.
    let tmp = std::env::temp_dir().join(format!("gemma4-cli-{}-video", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let copy = copy_files(&vision.join("e-style"), &tmp.join("e-style"), &[]);
    std::fs::create_dir_all(tmp.join("video")).expect("mkdir");
    std::fs::copy(vision.join("images/1.png"), {
        std::fs::create_dir_all(tmp.join("images")).expect("mkdir");
        tmp.join("images/1.png")
    })
    .expect("copy image");
    let gif = std::fs::read(vision.join("video/0.gif")).expect("gif");
    let frames = image::AnimationDecoder::into_frames(
        image::codecs::gif::GifDecoder::new(std::io::Cursor::new(&gif)).expect("gif"),
    )
    .collect_frames()
    .expect("frames");
    let mut reversed = Vec::new();
    {
        let mut enc = image::codecs::gif::GifEncoder::new(&mut reversed);
        enc.encode_frames(frames.into_iter().rev()).expect("encode");
    }
    std::fs::write(tmp.join("video/0.gif"), reversed).expect("write gif");
    let (out, text) = video_golden(&copy);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("DIFF  video frames=32 of 40"), "{text}");
    assert!(text.contains("stage=decoded frame 0"), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("SEQ_MATCH false")),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn verify_fails_and_names_the_first_departing_layer() {
    // Another variant's golden file: same format, different model.
    let dir = copy_dir(&fixture("e-style"), "wrong-golden", &[]);
    let mut golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).expect("read"))
            .expect("json");
    // Perturb layer 2's layer_scalar in the weights instead: rewrite the checkpoint.
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let scalar = half::bf16::from_f32(2.0).to_le_bytes();
    let mut tensors: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let data = if n == "model.language_model.layers.2.layer_scalar" {
                scalar.to_vec()
            } else {
                t.data().to_vec()
            };
            (n, data, t.dtype(), t.shape().to_vec())
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, dt, s)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, s.clone(), d).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write");
    golden["prompts"]
        .as_array_mut()
        .expect("prompts")
        .truncate(1);
    std::fs::write(dir.join("golden.json"), golden.to_string()).expect("write golden");
    let (out, text) = verify_dir(&dir);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("SEQ_MATCH false"), "{text}");
    assert!(
        text.contains("first departure at decoder layer 2 output"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn doctor_passes_on_fixtures_and_fails_clearly_on_broken_copies() {
    for v in ["e-style", "dense-k-eq-v", "moe", "unified"] {
        let (out, text) = run(bin().args(["doctor", "--model"]).arg(fixture(v)));
        assert!(out.status.success(), "{v}: {text}");
        assert!(!text.contains("FAIL"), "{text}");
    }
    let no_tok = copy_dir(&fixture("e-style"), "no-tokenizer", &["tokenizer.json"]);
    let (out, text) = run(bin().args(["doctor", "--model"]).arg(&no_tok));
    assert!(!out.status.success());
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAIL tokenizer") && l.contains("tokenizer.json")),
        "{text}"
    );

    let no_template = copy_dir(&fixture("e-style"), "no-template", &["chat_template.jinja"]);
    let (out, text) = run(bin().args(["doctor", "--model"]).arg(&no_template));
    assert!(!out.status.success());
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAIL chat template") && l.contains("--chat-template")),
        "{text}"
    );

    let bad_config = copy_dir(&fixture("dense-k-eq-v"), "bad-config", &[]);
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(bad_config.join("config.json")).expect("read"),
    )
    .expect("json");
    cfg["text_config"]["num_key_value_heads"] = 4.into();
    std::fs::write(bad_config.join("config.json"), cfg.to_string()).expect("write");
    let (out, text) = run(bin().args(["doctor", "--model"]).arg(&bad_config));
    assert!(!out.status.success());
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAIL weights") && l.contains("k_proj.weight")),
        "{text}"
    );
    for d in [no_tok, no_template, bad_config] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn bad_paths_and_files_give_one_line_errors() {
    let (out, text) = run(bin().args([
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt-ids",
        "2,3",
    ]));
    assert!(!out.status.success());
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(text.contains("/nonexistent/model"), "{text}");

    let truncated = copy_dir(&fixture("moe"), "truncated", &[]);
    let bytes = std::fs::read(truncated.join("model.safetensors")).expect("read");
    std::fs::write(
        truncated.join("model.safetensors"),
        &bytes[..bytes.len() / 3],
    )
    .expect("write");
    let (out, text) = run(bin()
        .args(["generate", "--model"])
        .arg(&truncated)
        .args(["--prompt-ids", "2,3"]));
    assert!(!out.status.success());
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(text.contains("truncated"), "{text}");

    // Damaged GGUF files: one line, no backtrace even when backtraces are on.
    let vocab =
        std::fs::read(root().join("tests/fixtures/text/ggml-vocab-gemma-4.gguf")).expect("read");
    for (name, bytes) in [
        ("garbage.gguf", b"hello".to_vec()),
        ("short.gguf", vocab[..1_000_000].to_vec()),
    ] {
        let path = truncated.join(name);
        std::fs::write(&path, bytes).expect("write");
        let (out, text) = run(bin()
            .env("RUST_BACKTRACE", "1")
            .args(["generate", "--model"])
            .arg(&path)
            .args(["--prompt-ids", "2"]));
        assert!(!out.status.success());
        assert_eq!(text.trim().lines().count(), 1, "{text}");
        assert!(text.contains("not a readable GGUF file"), "{text}");
        std::fs::remove_file(path).expect("remove");
    }

    std::fs::write(truncated.join("config.json"), "{not json").expect("write");
    let (out, text) = run(bin()
        .args(["generate", "--model"])
        .arg(&truncated)
        .args(["--prompt-ids", "2,3"]));
    assert!(!out.status.success());
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(text.contains("config.json"), "{text}");
    let _ = std::fs::remove_dir_all(truncated);
}

#[test]
fn generate_matches_the_reference_continuation() {
    let dir = fixture("unified");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).expect("read"))
            .expect("json");
    let p = &golden["prompts"][2];
    let ids: Vec<String> = p["input_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.to_string())
        .collect();
    let (out, text) = run(bin()
        .args(["generate", "--ignore-eos", "--max-tokens", "24", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", &ids.join(",")]));
    assert!(out.status.success(), "{text}");
    let want: Vec<String> = p["greedy"]["generated_ids"]
        .as_array()
        .expect("gen")
        .iter()
        .map(|v| v.to_string())
        .collect();
    assert!(text.contains(&format!("ids: {}", want.join(","))), "{text}");
    assert!(
        text.contains(&format!("timing: prompt {} tokens", ids.len()))
            && text.contains("23 more in"),
        "{text}"
    );
}

#[test]
fn plan_prints_the_published_kv_sizes() {
    for (name, kib) in [
        ("gemma-4-E2B-it", "18.00"),
        ("gemma-4-E4B-it", "56.00"),
        ("gemma-4-12B-it", "336.00"),
        ("gemma-4-31B-it", "880.00"),
        ("gemma-4-26B-A4B-it", "220.00"),
    ] {
        let (out, text) = run(bin()
            .args(["plan", "--model"])
            .arg(root().join("tests/fixtures/configs").join(name)));
        assert!(out.status.success(), "{text}");
        assert!(
            text.contains(&format!("per token, all groups: {kib} KiB")),
            "{name}: {text}"
        );
    }
    // int8: E2B's 15 KV-owning layers (12 sliding of head_dim 256, 3 full of
    // 512, one KV head each) hold 9,216 one-byte elements per token and a
    // four-byte scale per 32 of them in K and V: 2 · (12 · 8 + 3 · 16) = 288
    // scales, 10,368 bytes.
    let (out, text) = run(bin()
        .args(["plan", "--kv-dtype", "int8", "--model"])
        .arg(root().join("tests/fixtures/configs/gemma-4-E2B-it")));
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("KV cache (int8)") && text.contains("per token, all groups: 10.12 KiB"),
        "{text}"
    );
}

#[test]
fn plan_counts_the_towers_of_the_checkpoint_or_of_an_mmproj_file() {
    let media_bytes = |args: &[&str]| -> u64 {
        let (out, text) = run(bin().args(["plan", "--json"]).args(args));
        assert!(out.status.success(), "{text}");
        let json: serde_json::Value = serde_json::from_str(text.trim()).expect("json");
        json["media_encoders_bytes"]
            .as_u64()
            .expect("media_encoders_bytes")
    };
    let fixtures = root().join("tests/fixtures");
    let text_only = fixtures.join("oracle/e-style").display().to_string();
    let with_towers = fixtures.join("vision/e-audio").display().to_string();
    let mmproj = fixtures
        .join("vision/e-audio-mmproj.gguf")
        .display()
        .to_string();
    assert_eq!(media_bytes(&["--model", &text_only]), 0);
    let stored = media_bytes(&["--model", &with_towers]);
    assert!(stored > 0);
    // The same towers from the projector file (f16 matrices where the
    // checkpoint has bf16, and f32 norms): about the same bytes.
    let projected = media_bytes(&["--model", &text_only, "--mmproj", &mmproj]);
    assert!(
        projected >= stored && projected < stored * 3 / 2,
        "{projected} vs {stored}"
    );
    // A file that is not a projector is refused by name.
    let (out, text) = run(bin()
        .args(["plan", "--json", "--model", &text_only, "--mmproj"])
        .arg(fixtures.join("vision/e-audio/config.json")));
    assert!(!out.status.success(), "{text}");
}

/// Real weights: the demo model answers with Paris (needs GEMMA4_DEMO_GGUF; required under CI).
#[test]
fn demo_model_answers_paris() {
    let Some(gguf) = std::env::var_os("GEMMA4_DEMO_GGUF") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must set GEMMA4_DEMO_GGUF"
        );
        eprintln!("skipped: set GEMMA4_DEMO_GGUF");
        return;
    };
    let (out, text) = run(bin()
        .args(["generate", "--max-tokens", "24", "--model"])
        .arg(&gguf)
        .args(["--prompt", "Q: What is the capital of France?\nA:"]));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Paris"), "{text}");
    // The first 8 tokens of the reference continuation (" The capital of
    // France is Paris."), which exact mode holds to. The default mode
    // rounds activations to 8 bits and may start with " Paris" instead: the
    // reference's first step is a near tie (" The" −1.59 against " Paris"
    // −1.66 in log-probability), where the model tests accept a departure.
    let (out, text) = run(bin()
        .args(["generate", "--exact", "--max-tokens", "8", "--model"])
        .arg(&gguf)
        .args(["--prompt", "Q: What is the capital of France?\nA:"]));
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("ids: 669,5279,529,7001,563,9079,236761,107"),
        "{text}"
    );
    // Other factual prompts of the same kind: exact arithmetic (the reference's) and the
    // quantized kernels both answer correctly where the f32 reference does.
    for (country, capital, quantized_too) in [
        ("Japan", "Tokyo", true),
        ("England", "London", true),
        ("Egypt", "Cairo", false),
    ] {
        let prompt = format!("Q: What is the capital of {country}?\nA:");
        let mut modes = vec![vec!["--exact"]];
        if quantized_too {
            modes.push(vec![]);
        }
        for flags in modes {
            let (out, text) = run(bin()
                .args(["generate", "--max-tokens", "10"])
                .args(&flags)
                .arg("--model")
                .arg(&gguf)
                .args(["--prompt", &prompt]));
            assert!(out.status.success(), "{text}");
            assert!(text.contains(capital), "{country} {flags:?}: {text}");
        }
    }
    let (out, text) = run(bin().args(["chat", "--model"]).arg(&gguf));
    assert!(!out.status.success());
    assert!(
        text.contains("no chat template") && text.contains("generate"),
        "{text}"
    );
}

fn assistant_fixture(name: &str) -> PathBuf {
    fixture("assistant").join(name)
}

/// `gemma4 verify --draft-model` on an assistant record: every round and
/// every engine run match; a record with one draft changed fails, naming
/// the round.
#[test]
fn verify_checks_an_assistant_round_by_round() {
    for name in ["e-style-centroid", "dense-k-eq-v-tied"] {
        let dir = assistant_fixture(name);
        let verify = |golden: &Path| {
            run(bin()
                .args(["verify", "--model"])
                .arg(dir.join("target"))
                .arg("--draft-model")
                .arg(dir.join("assistant"))
                .arg("--golden")
                .arg(golden))
        };
        let (out, text) = verify(&dir.join("golden.json"));
        assert!(out.status.success(), "{name}: {text}");
        assert!(text.contains("SEQ_MATCH true"), "{name}: {text}");
        assert_eq!(text.matches("MATCH prompt=").count(), 8, "{name}: {text}");
        assert!(text.contains("drafts=exact"), "{name}: {text}");

        let copy = copy_dir(&dir, &format!("assistant-{name}"), &["target", "assistant"]);
        let golden_path = copy.join("golden.json");
        let mut golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&golden_path).expect("read"))
                .expect("json");
        let draft = &mut golden["prompts"][0]["clean_kv"]["rounds"][1]["draft_ids"][0];
        *draft = serde_json::json!(draft.as_u64().expect("id") ^ 1);
        std::fs::write(&golden_path, golden.to_string()).expect("write");
        let (out, text) = verify(&golden_path);
        assert!(!out.status.success(), "{name}: {text}");
        assert!(text.contains("first departing round 2"), "{name}: {text}");
        assert!(text.contains("SEQ_MATCH false"), "{name}: {text}");
        let _ = std::fs::remove_dir_all(copy);
    }
}

/// `generate --speculative assistant` gives the tokens plain decoding
/// gives and reports its drafts; an assistant for another model, or none,
/// is refused with what is wrong named.
#[test]
fn generate_drafts_with_an_assistant() {
    let dir = assistant_fixture("e-style-centroid");
    let generate = |extra: &[&str]| {
        run(bin()
            .args(["generate", "--model"])
            .arg(dir.join("target"))
            .args(["--prompt-ids", "2,9,17,31,9,17,31", "--max-tokens", "16"])
            .arg("--ignore-eos")
            .args(extra))
    };
    let ids = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("ids: "))
            .map(str::to_string)
    };
    let (out, plain) = generate(&[]);
    assert!(out.status.success(), "{plain}");
    let assistant = dir.join("assistant");
    let assistant = assistant.to_str().expect("path");
    let (out, drafted) = generate(&["--speculative", "assistant", "--draft-model", assistant]);
    assert!(out.status.success(), "{drafted}");
    assert_eq!(ids(&drafted), ids(&plain), "{drafted}");
    assert!(
        ids(&plain).is_some_and(|ids| ids.split(',').count() == 16),
        "{plain}"
    );
    assert!(drafted.contains("drafted "), "{drafted}");

    let (out, text) = generate(&["--speculative", "assistant"]);
    assert!(!out.status.success());
    assert!(text.contains("needs --draft-model"), "{text}");
    let other = assistant_fixture("dense-k-eq-v-tied").join("assistant");
    let other = other.to_str().expect("path");
    let (out, text) = generate(&["--speculative", "assistant", "--draft-model", other]);
    assert!(!out.status.success());
    assert!(text.contains("backbone_hidden_size 128"), "{text}");
}

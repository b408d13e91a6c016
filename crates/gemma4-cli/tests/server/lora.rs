//! A server with LoRA adapters (`serve --lora NAME=PATH`): requests choose
//! an adapter by `model` on every front, each adapter's tokens are PEFT's
//! reference greedy ids, `/v1/models` and `/api/tags` list the adapters
//! under the served model, an unknown name is a 404 in each API's shape,
//! and an adapter that does not fit the model is refused at load,
//! naming the module.

use std::process::Command;

use serde_json::{json, Value};

use crate::harness::{python_script, root, ServerProc};
use crate::ids;

fn lora_fixture(target: &str) -> std::path::PathBuf {
    root().join("tests/fixtures/lora").join(target)
}

fn golden(target: &str) -> Value {
    let text = std::fs::read_to_string(lora_fixture(target).join("golden.json")).expect("golden");
    serde_json::from_str(&text).expect("json")
}

fn start(target: &str) -> ServerProc {
    let dir = lora_fixture(target);
    let a = format!("adapter-a={}", dir.join("adapter-a").display());
    let b = format!("adapter-b={}", dir.join("adapter-b-f32").display());
    ServerProc::start(
        &dir.join("target"),
        &["--served-model-name", "base", "--lora", &a, "--lora", &b],
        &[],
    )
}

#[test]
fn each_adapter_answers_with_its_reference_tokens_on_every_front() {
    let target = "e-style";
    let server = start(target);
    let g = golden(target);
    let runs: Vec<(&str, &Value)> = std::iter::once(("base", &g["base"]["prompts"]))
        .chain(
            g["adapters"]
                .as_array()
                .expect("adapters")
                .iter()
                .map(|a| (a["name"].as_str().expect("name"), &a["prompts"])),
        )
        .collect();
    let mut texts = Vec::new();
    for (model, prompts) in &runs {
        for p in prompts.as_array().expect("prompts") {
            let want = ids(&p["greedy_ids"]);
            let r = server.post(
                "/generate",
                &json!({"model": model, "prompt": p["input_ids"], "max_tokens": want.len(),
                        "temperature": 0, "ignore_eos": true}),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            let out = r.json();
            assert_eq!(ids(&out["token_ids"]), want, "{model}/{}", p["name"]);
        }
        let first = &prompts[0];
        let r = server.post(
            "/generate",
            &json!({"model": model, "prompt": first["input_ids"], "max_tokens": 8,
                    "temperature": 0, "ignore_eos": true}),
        );
        texts.push(r.json()["response"].as_str().expect("text").to_string());
    }
    // Four requests each, counted per adapter; nothing runs or waits now.
    let metrics = server.get("/metrics").body;
    for needle in [
        "gemma4_lora_requests_total{adapter=\"adapter-a\"} 4",
        "gemma4_lora_requests_total{adapter=\"adapter-b\"} 4",
        "vllm:lora_requests_info{max_lora=\"2\",model_name=\"base\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}",
    ] {
        assert!(metrics.contains(needle), "no {needle} in\n{metrics}");
    }
    // The official clients, each naming the adapter as its model.
    let url = server.url();
    let prompt_ids = g["base"]["prompts"][0]["input_ids"].to_string();
    let mut args = vec!["--url", url.as_str(), "--prompt-ids", prompt_ids.as_str()];
    for (model, _) in &runs {
        args.extend(["--model", model]);
    }
    let Some(out) = python_script("lora_clients.py", &["openai", "anthropic", "ollama"], &args)
    else {
        return;
    };
    let models: Vec<(String, Value)> = out["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap_or_default().to_string(),
                m["parent"].clone(),
            )
        })
        .collect();
    assert_eq!(
        models,
        vec![
            ("base".to_string(), Value::Null),
            ("adapter-a".to_string(), json!("base")),
            ("adapter-b".to_string(), json!("base")),
        ]
    );
    let tags = out["tags"].as_array().expect("tags");
    assert_eq!(tags.len(), 3, "{tags:?}");
    assert_eq!(tags[1], json!({"name": "adapter-a", "parent": "base"}));
    for ((model, _), text) in runs.iter().zip(&texts) {
        let run = &out["runs"][model];
        // The client's completion holds the same tokens as /generate's.
        assert_eq!(run["completion"], json!(text), "{model}");
        assert_eq!(run["completion_model"], json!(model));
        assert_eq!(run["anthropic_model"], json!(model));
        // One chat turn, the same greedy reply through all three fronts.
        assert_eq!(run["chat"], run["anthropic"], "{model}");
        assert_eq!(run["chat"], run["ollama"], "{model}");
    }
    assert_ne!(
        out["runs"]["base"]["chat"],
        out["runs"]["adapter-a"]["chat"]
    );
    assert_ne!(texts[0], texts[1]);
    let unknown = &out["unknown"];
    assert_eq!(unknown["status"], 404, "{unknown}");
    assert_eq!(unknown["body"]["code"], "model_not_found", "{unknown}");
    assert!(
        unknown["body"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("adapter-a")),
        "{unknown}"
    );
}

#[test]
fn an_adapter_for_another_model_is_refused_at_load_naming_the_module() {
    let out = Command::new(env!("CARGO_BIN_EXE_gemma4"))
        .arg("generate")
        .arg("--model")
        .arg(lora_fixture("e-style").join("target"))
        .arg("--lora")
        .arg(lora_fixture("dense-k-eq-v").join("adapter-a"))
        .args(["--prompt-ids", "2,10,20", "--max-tokens", "2"])
        .output()
        .expect("run gemma4 generate");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("adapter-a") && stderr.contains("model.language_model.layers."),
        "{stderr}"
    );
}

#[test]
fn adapters_load_and_unload_through_vllms_routes() {
    let dir = lora_fixture("e-style");
    let g = golden("e-style");
    let b = &g["adapters"][1];
    let prompt = &b["prompts"][0];
    // Off unless the server is started with the flag.
    let off = ServerProc::start(&dir.join("target"), &[], &[]);
    let r = off.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "b", "lora_path": dir.join("adapter-b")}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("--allow-runtime-lora"), "{}", r.body);
    drop(off);
    let server = ServerProc::start(
        &dir.join("target"),
        &[
            "--served-model-name",
            "base",
            "--allow-runtime-lora",
            "--max-loras",
            "1",
        ],
        &[],
    );
    let generate = |model: &str| {
        server.post(
            "/generate",
            &json!({"model": model, "prompt": prompt["input_ids"], "max_tokens": 16,
                    "temperature": 0, "ignore_eos": true}),
        )
    };
    assert_eq!(generate("b").status, 404);
    let r = server.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "b", "lora_path": dir.join("adapter-b")}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body, "Success: LoRA adapter 'b' added successfully.");
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][1]["id"], "b");
    assert_eq!(models["data"][1]["parent"], "base");
    let r = generate("b");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(ids(&r.json()["token_ids"]), ids(&prompt["greedy_ids"]));
    // Refusals: a second adapter past --max-loras, a folder without one.
    let r = server.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "a", "lora_path": dir.join("adapter-a")}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("--max-loras"), "{}", r.body);
    let r = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "nope"}));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "b"}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(generate("b").status, 404);
    // A GGUF that is not a LoRA adapter is a 400 naming the file; llama.cpp's
    // GGUF LoRA file of adapter a loads and gives a's reference tokens.
    let mmproj = dir.join("../../vision/e-audio-mmproj.gguf");
    let r = server.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "m", "lora_path": mmproj}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("e-audio-mmproj.gguf") && r.body.contains("not a LoRA adapter"),
        "{}",
        r.body
    );
    let r = server.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "a", "lora_path": dir.join("gguf/adapter-a.gguf")}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let a = &g["adapters"][0]["prompts"][0];
    let r = server.post(
        "/generate",
        &json!({"model": "a", "prompt": a["input_ids"], "max_tokens": 16,
                "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(ids(&r.json()["token_ids"]), ids(&a["greedy_ids"]));
    let r = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "a"}));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = server.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "t", "lora_path": dir.join("target")}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("adapter_config.json"), "{}", r.body);
    let r = server.post("/v1/load_lora_adapter", &json!({"lora_name": "x"}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("lora_path"), "{}", r.body);
}

//! Scoring a prompt through `/v1/completions` as evaluation harnesses do
//! (token-id prompt, `echo: true`, `logprobs`, `max_tokens` 0 or 1), with
//! the official openai client: the prompt's log-probabilities equal the
//! reference's log-softmax, the stream adds up to the whole reply, and
//! vLLM's `prompt_logprobs` lists the same values.

use serde_json::{json, Value};

use crate::harness::{fixture, golden, openai_client, ServerProc};
use crate::{generate_ids, golden_ids, ids, prompt_named};

/// The oracle's logit tolerance, twice: a log-probability is a logit minus
/// its row's log-sum-exp.
const TOLERANCE: f64 = 2e-3;

/// The reference's log-softmax of prompt `name`'s logits at every position.
fn reference_logprobs(variant: &str, index: usize, n: usize) -> Vec<Vec<f64>> {
    let bytes =
        std::fs::read(fixture(variant).join("golden_tensors.safetensors")).expect("golden tensors");
    let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let logits = tensors
        .tensor(&format!("prompt{index}.logits"))
        .expect("prompt logits");
    let values: Vec<f64> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        .collect();
    values
        .chunks(values.len() / n)
        .map(|row| {
            let max = row.iter().copied().fold(f64::MIN, f64::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            row.iter().map(|v| v - lse).collect()
        })
        .collect()
}

fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn prompt_logprobs_score_the_prompt_as_the_reference_does() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let g = golden("e-style");
    let (index, long) = (2, prompt_named(&g, "long"));
    let prompt = ids(&long["input_ids"]);
    let n = prompt.len();
    let reference = reference_logprobs("e-style", index, n);
    // The reference's text, which its tokenizer turns into these ids (with `<bos>`).
    let text = long["text"].as_str().expect("text").to_owned();
    let generated = generate_ids(&server, &long["input_ids"], 3);
    let Some(out) = openai_client(
        &server.url(),
        &[
            "--scenario",
            "scoring",
            "--prompt",
            &json!(prompt).to_string(),
            "--max-tokens",
            "3",
        ],
    ) else {
        return;
    };

    // Nothing generated: the prompt alone, scored.
    let only = &out["prompt_only"]["choices"][0];
    assert_eq!(only["text"], text.as_str());
    assert_eq!(only["finish_reason"], "length");
    assert_eq!(out["prompt_only"]["usage"]["completion_tokens"], 0);
    let lp = &only["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n));
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    for p in 1..n {
        let want = reference[p - 1][prompt[p] as usize];
        let got = number(&lp["token_logprobs"][p]);
        assert!(
            (got - want).abs() <= TOLERANCE,
            "position {p}: {got} vs the reference's {want}"
        );
        let top = lp["top_logprobs"][p].as_object().expect("top map");
        let best = reference[p - 1].iter().copied().fold(f64::MIN, f64::max);
        let top_best = top.values().map(number).fold(f64::MIN, f64::max);
        assert!(
            (top_best - best).abs() <= TOLERANCE,
            "position {p}: {top_best} vs {best}"
        );
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .map(|o| o.as_u64().expect("offset"))
        .collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");

    // The stream adds up to the whole reply.
    for (whole, streamed) in [
        ("prompt_only", "prompt_only_stream"),
        ("with_tokens", "with_tokens_stream"),
    ] {
        let choice = &out[whole]["choices"][0];
        let s = &out[streamed];
        assert_eq!(s["text"], choice["text"], "{streamed}");
        assert_eq!(s["finish_reason"], choice["finish_reason"], "{streamed}");
        assert_eq!(s["logprobs"], choice["logprobs"], "{streamed}");
    }

    // Three tokens generated: the prompt's entries, then the greedy tokens'.
    let with = &out["with_tokens"]["choices"][0];
    let suffix = generated["response"].as_str().expect("generated text");
    assert_eq!(with["text"], format!("{text}{suffix}"));
    let lp = &with["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n + 3));
    for p in 1..n {
        assert_eq!(
            lp["token_logprobs"][p],
            only["logprobs"]["token_logprobs"][p]
        );
    }
    assert_eq!(ids(&generated["token_ids"]), golden_ids(long)[..3]);

    // vLLM's prompt_logprobs: the same values, keyed by token id.
    let listed = &out["vllm"]["choices"][0]["prompt_logprobs"];
    assert_eq!(listed.as_array().map(Vec::len), Some(n));
    assert_eq!(listed[0], Value::Null);
    for p in 1..n {
        let entry = &listed[p][prompt[p].to_string()];
        assert_eq!(entry["logprob"], only["logprobs"]["token_logprobs"][p]);
        assert!(entry["rank"].as_u64().is_some_and(|r| r >= 1), "{entry}");
    }
}

#[test]
fn prompt_logprobs_are_refused_where_they_are_not_served() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "prompt_logprobs");
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "hi", "prompt_logprobs": 99}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "prompt_logprobs");
}

/// lm-evaluation-harness's `local-completions` scores the committed
/// multiple-choice task (tests/lm_eval) through the server, tokenizing
/// through it too; the real demo weights pick the right capital. Each
/// choice's log-likelihood is the one the server gives the same tokens, and
/// the one the same harness's `hf` model gives on transformers' float32 run
/// over the same weights (`tests/lm_eval/capitals_reference.json`), within
/// the oracle's tolerance: the server runs `--exact`.
#[test]
fn lm_evaluation_harness_scores_a_task_through_the_server() {
    let Some(gguf) = crate::harness::demo_gguf("the lm-evaluation-harness run") else {
        return;
    };
    let server = ServerProc::start(&gguf, &["--max-num-seqs", "2", "--exact"], &[]);
    let model = server.get("/v1/models").json()["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_string();
    let root = crate::harness::root();
    let Some(report) = crate::harness::python_script(
        "lm_eval_task.py",
        &["lm_eval"],
        &[
            "--base-url",
            &server.url(),
            "--model",
            &model,
            "--root",
            root.to_str().expect("root path"),
        ],
    ) else {
        return;
    };
    let docs = report["docs"].as_array().expect("docs");
    assert_eq!(docs.len(), 8, "{report}");
    for doc in docs {
        let scores: Vec<f64> = doc["loglikelihoods"]
            .as_array()
            .expect("scores")
            .iter()
            .map(number)
            .collect();
        assert_eq!(scores.len(), 4, "{doc}");
        assert!(scores.iter().all(|s| s.is_finite() && *s < 0.0), "{doc}");
    }
    // The reference's scores, document by document (5.9e-5 apart at most,
    // measured; the oracle's logit tolerance is 1e-3), and so its accuracy.
    let path = crate::harness::root().join("tests/lm_eval/capitals_reference.json");
    let text = std::fs::read_to_string(&path).expect("the hf reference");
    let reference: Value = serde_json::from_str(&text).expect("reference JSON");
    let want = reference["docs"].as_array().expect("reference docs");
    assert_eq!(want.len(), docs.len());
    for (doc, want) in docs.iter().zip(want) {
        assert_eq!(doc["question"], want["question"]);
        for (ours, theirs) in doc["loglikelihoods"]
            .as_array()
            .expect("scores")
            .iter()
            .zip(want["loglikelihoods"].as_array().expect("reference scores"))
        {
            let (ours, theirs) = (number(ours), number(theirs));
            assert!(
                (ours - theirs).abs() <= 1e-3,
                "{}: {ours} against the reference's {theirs}",
                doc["question"]
            );
        }
    }
    assert_eq!(
        number(&report["acc"]),
        number(&reference["acc"]),
        "{report}"
    );

    // The harness's score of the first document's answer is the server's
    // own: the sum of the answer's token log-probabilities after the question.
    let first = &docs[0];
    let tokenize = |text: &str| -> Vec<u32> {
        let r = server.post(
            "/tokenize",
            &json!({"prompt": text, "add_special_tokens": false}),
        );
        serde_json::from_value(r.json()["tokens"].clone()).expect("token ids")
    };
    let context = tokenize(&format!(
        "<bos>Question: {}\nAnswer:",
        first["question"].as_str().expect("question")
    ));
    let answer = tokenize(" Paris");
    let prompt: Vec<u32> = context.iter().chain(&answer).copied().collect();
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 1, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let logprobs = &r.json()["choices"][0]["logprobs"]["token_logprobs"];
    let ours: f64 = (context.len()..prompt.len())
        .map(|i| number(&logprobs[i]))
        .sum();
    let theirs =
        number(&first["loglikelihoods"][first["target"].as_u64().expect("target") as usize]);
    assert!(
        (ours - theirs).abs() < 1e-4,
        "server {ours}, harness {theirs}"
    );
}

/// The first generated token's log-probability, and those listed beside
/// it, are the reference's log-softmax at the prompt's last position, on
/// every variant and golden prompt (`/v1/completions` on the prompt's ids).
#[test]
fn generated_logprobs_are_the_references_log_softmax() {
    for variant in crate::VARIANTS {
        let server = ServerProc::start(&fixture(variant), &[], &[]);
        let g = golden(variant);
        for (index, prompt) in g["prompts"].as_array().expect("prompts").iter().enumerate() {
            let n = ids(&prompt["input_ids"]).len();
            let reference = &reference_logprobs(variant, index, n)[n - 1];
            let body = json!({"prompt": prompt["input_ids"], "max_tokens": 1, "temperature": 0,
                "logprobs": 5, "ignore_eos": true});
            let reply = server.post("/v1/completions", &body);
            assert_eq!(reply.status, 200, "{}", reply.body);
            let lp = reply.json()["choices"][0]["logprobs"].clone();
            let token = golden_ids(prompt)[0] as usize;
            let at = format!("{variant} {}", prompt["name"]);
            let chosen = number(&lp["token_logprobs"][0]);
            assert!(
                (chosen - reference[token]).abs() < TOLERANCE,
                "{at}: {chosen} vs {}",
                reference[token]
            );
            // Keyed by text, so tokens that decode alike (`�`) share an entry.
            let listed = lp["top_logprobs"][0]
                .as_object()
                .expect("top_logprobs")
                .clone();
            let mut best: Vec<f64> = reference.clone();
            best.sort_by(|a, b| b.total_cmp(a));
            let top = &best[..5];
            assert!(!listed.is_empty(), "{at}: nothing listed");
            for v in listed.values().map(number) {
                let near = top.iter().any(|r| (v - r).abs() < TOLERANCE);
                assert!(
                    near,
                    "{at}: {v} is none of the reference's top five {top:?}"
                );
            }
            let first = listed.values().map(number).fold(f64::MIN, f64::max);
            assert!(
                (first - top[0]).abs() < TOLERANCE,
                "{at}: {listed:?} vs {top:?}"
            );
        }
    }
}

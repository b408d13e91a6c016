//! The assistant (MTP drafter) against transformers' record of each
//! prompt's first drafting round: the target's store-layer K/V and hidden
//! row as this crate computes them, each draft step's logits from the
//! reference's own inputs, and the drafted ids from ours.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use gemma4_model::safetensors_store::SafetensorsStore;
use gemma4_model::{
    load_hf_dir, Assistant, BatchSeq, Gemma4, KvCache, KvRows, KvStore, LoadPolicy, LogitsFor,
    StoreLayers, TargetKv,
};
use serde_json::Value;

/// The README's bounds for an f32 engine on these bf16 weights.
const LOGIT_TOL: f32 = 1e-3;
const REL_TOL: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/assistant")
        .join(name)
}

struct Case {
    golden: Value,
    tensors: SafetensorsStore,
    target: Gemma4,
    assistant: Assistant,
}

impl Case {
    fn load(name: &str) -> Case {
        let dir = fixture(name);
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("golden.json")).expect("golden.json"),
        )
        .expect("golden json");
        Case {
            golden,
            tensors: SafetensorsStore::open_files(&[dir.join("golden_tensors.safetensors")])
                .expect("golden tensors"),
            target: load_hf_dir(&dir.join("target")).expect("target"),
            assistant: Assistant::load(&dir.join("assistant"), LoadPolicy::default())
                .expect("assistant"),
        }
    }

    fn tensor(&self, name: &str) -> Tensor {
        let shape = self.tensors.shape(name).expect(name).to_vec();
        self.tensors.get(name, &shape).expect(name)
    }

    fn window(&self) -> usize {
        self.golden["assistant"]["sliding_window"]
            .as_u64()
            .expect("window") as usize
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("f32")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `‖a − b‖ / ‖b‖`.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f32 = b.iter().map(|y| y * y).sum();
    (diff / norm.max(f32::MIN_POSITIVE)).sqrt()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// The last `reach` of a store layer's `[kv_heads, rows, head_dim]` rows.
fn last_rows(k: &Tensor, v: &Tensor, reach: usize) -> KvRows {
    let rows = k.dim(1).expect("rows");
    let from = rows.saturating_sub(reach);
    KvRows {
        k: k.narrow(1, from, rows - from)
            .expect("k")
            .contiguous()
            .expect("k"),
        v: v.narrow(1, from, rows - from)
            .expect("v")
            .contiguous()
            .expect("v"),
    }
}

/// The prompt run through the target: its store layers' K/V and the
/// final-norm row of its last position.
fn prefill(target: &Gemma4, prompt: &[u32]) -> (KvCache, Tensor) {
    let mut cache = target.new_cache();
    let seq = BatchSeq {
        ids: prompt,
        start: 0,
        logits: Some(LogitsFor::Last),
        soft: None,
        lora: None,
    };
    let rows = target
        .forward_batch_rows(&[seq], &mut cache, None)
        .expect("prefill")
        .pop()
        .flatten()
        .expect("rows");
    (cache, rows.hidden.squeeze(0).expect("row"))
}

fn check_first_rounds(name: &str) {
    let case = Case::load(name);
    let store = case
        .assistant
        .check_target(case.target.config())
        .expect("the assistant fits its target");
    let expected = &case.golden["target"]["kv_store_layers"];
    assert_eq!(
        store,
        StoreLayers {
            sliding: expected["sliding_attention"].as_u64().expect("s") as usize,
            full: expected["full_attention"].as_u64().expect("f") as usize,
        }
    );
    let reach = case.window() + 1;
    assert_eq!(case.assistant.sliding_reach(), reach);
    let prompts = case.golden["prompts"].as_array().expect("prompts");
    for (i, p) in prompts.iter().enumerate() {
        let name = p["name"].as_str().expect("name");
        let round = &p["rounds"][0];
        let prompt = ids(&p["input_ids"]);
        let at = |field: &str| format!("prompt{i}.round1.{field}");

        // Our target's K/V and hidden row, against the reference's.
        let (cache, hidden) = prefill(&case.target, &prompt);
        let (sk, sv, s_first) = cache.read(store.sliding, 0).expect("sliding");
        let (fk, fv, f_first) = cache.read(store.full, 0).expect("full");
        assert_eq!((s_first, f_first), (0, 0));
        for (ours, theirs) in [
            (&sk, "kv_sliding_k"),
            (&sv, "kv_sliding_v"),
            (&fk, "kv_full_k"),
            (&fv, "kv_full_v"),
            (&hidden, "target_hidden"),
        ] {
            let err = relative_error(&values(ours), &values(&case.tensor(&at(theirs))));
            assert!(err <= REL_TOL, "{name}: {theirs} relative error {err}");
        }

        // Each step from the reference's inputs and K/V rows.
        let reference_kv = TargetKv {
            sliding: last_rows(
                &case.tensor(&at("kv_sliding_k")),
                &case.tensor(&at("kv_sliding_v")),
                reach,
            ),
            full: last_rows(
                &case.tensor(&at("kv_full_k")),
                &case.tensor(&at("kv_full_v")),
                usize::MAX,
            ),
        };
        let position = round["position"].as_u64().expect("position") as usize;
        let drafts = ids(&round["draft_ids"]);
        let inputs = case.tensor(&at("assistant_inputs_embeds"));
        let logits = case.tensor(&at("draft_logits"));
        let projected = case.tensor(&at("draft_projected_hidden"));
        for (j, &draft) in drafts.iter().enumerate() {
            let input = inputs.narrow(0, j, 1).expect("input");
            let step = case
                .assistant
                .step_from_input(&input, position, &reference_kv)
                .expect("step");
            let want = values(&logits.narrow(0, j, 1).expect("row"));
            let diff = max_abs_diff(&step.logits, &want);
            assert!(
                diff <= LOGIT_TOL,
                "{name} step {j}: logits differ by {diff}"
            );
            assert_eq!(step.token, draft, "{name} step {j}");
            let want = values(&projected.narrow(0, j, 1).expect("row"));
            let err = relative_error(&values(&step.projected), &want);
            assert!(
                err <= REL_TOL,
                "{name} step {j}: projected hidden error {err}"
            );
        }

        // The whole round from our own target.
        let ours_kv = TargetKv {
            sliding: last_rows(&sk, &sv, reach),
            full: last_rows(&fk, &fv, usize::MAX),
        };
        let last = round["last_token"].as_u64().expect("last") as u32;
        let ours = case
            .assistant
            .draft(
                &case.target,
                last,
                &hidden,
                position,
                &ours_kv,
                drafts.len(),
            )
            .expect("draft");
        assert_eq!(ours, drafts, "{name}: drafted ids");
    }
}

/// Every `clean_kv` round (the drafter seeing accepted tokens only), from
/// the target's state computed from scratch: the drafted ids and every
/// step's logits.
fn check_clean_rounds(name: &str) {
    let case = Case::load(name);
    for (i, p) in case.golden["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .enumerate()
    {
        let clean = &p["clean_kv"];
        let sequence = [ids(&p["input_ids"]), ids(&clean["generated_ids"])].concat();
        let mut checked = 0;
        for round in clean["rounds"].as_array().expect("rounds") {
            let k = round["num_draft"].as_u64().expect("k") as usize;
            if k == 0 {
                continue;
            }
            let r = round["round"].as_u64().expect("round");
            let len = round["seq_len"].as_u64().expect("len") as usize;
            let steps = case
                .assistant
                .draft_from_scratch(&case.target, &sequence[..len], k)
                .expect("draft");
            let drafted: Vec<u32> = steps.iter().map(|s| s.token).collect();
            assert_eq!(
                drafted,
                ids(&round["draft_ids"]),
                "{name} prompt {i} round {r}"
            );
            let logits = case.tensor(&format!("prompt{i}.clean.round{r}.draft_logits"));
            for (j, step) in steps.iter().enumerate() {
                let want = values(&logits.narrow(0, j, 1).expect("row"));
                let diff = max_abs_diff(&step.logits, &want);
                assert!(
                    diff <= LOGIT_TOL,
                    "{name} prompt {i} round {r} step {j}: {diff}"
                );
            }
            checked += 1;
        }
        assert!(checked > 1, "{name} prompt {i}: {checked} rounds");
    }
}

#[test]
fn a_centroid_head_assistant_drafts_the_reference_round() {
    check_first_rounds("e-style-centroid");
}

#[test]
fn a_dense_tied_head_assistant_drafts_the_reference_round() {
    check_first_rounds("dense-k-eq-v-tied");
}

#[test]
fn every_rolled_back_round_drafts_as_the_reference() {
    check_clean_rounds("e-style-centroid");
    check_clean_rounds("dense-k-eq-v-tied");
}

/// A checkpoint that is not an assistant, or one for another target, is
/// refused with the reason.
#[test]
fn mismatches_are_refused_by_name() {
    let target_dir = fixture("e-style-centroid").join("target");
    let err = Assistant::load(&target_dir, LoadPolicy::default()).expect_err("not an assistant");
    assert!(err.to_string().contains("gemma4_assistant"), "{err}");
    let dense = Assistant::load(
        &fixture("dense-k-eq-v-tied").join("assistant"),
        LoadPolicy::default(),
    )
    .expect("assistant");
    let other = load_hf_dir(&target_dir).expect("target");
    let err = dense
        .check_target(other.config())
        .expect_err("other target");
    assert!(
        err.to_string()
            .contains("backbone_hidden_size 128 is not the model's hidden_size 64"),
        "{err}"
    );
    let missing = Assistant::load(Path::new("/nonexistent/assistant"), LoadPolicy::default())
        .expect_err("missing");
    assert!(missing.to_string().contains("does not exist"), "{missing}");
}

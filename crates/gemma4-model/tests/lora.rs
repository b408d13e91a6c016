//! LoRA adapters against PEFT's float32 reference (`tests/fixtures/lora`):
//! every adapter of both targets, bf16 and f32 files, whole and chunked
//! prompts, several sequences with different adapters in one batch, the
//! adapters merged into the weights, and adapters that do not fit the
//! model refused with the module named.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use gemma4_model::golden::{argmax, DEFAULT_TOLERANCE};
use gemma4_model::lora_golden::{verify_lora_prompt, LoraGolden, ReferenceLogits};
use gemma4_model::{load_hf_dir, BatchSeq, KvCache, KvStore, LogitsFor, LoraAdapter, Projection};

const TARGETS: &[&str] = &["e-style", "dense-k-eq-v"];

fn fixture(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/lora")
        .join(target)
}

fn golden(target: &str) -> (LoraGolden, ReferenceLogits) {
    let dir = fixture(target);
    (
        LoraGolden::read(&dir.join("golden.json")).expect("golden"),
        ReferenceLogits::open(&dir.join("golden_tensors.safetensors")).expect("tensors"),
    )
}

/// Every prompt of `run` with `adapter` (none: the model as it is), whole
/// and in the `chunks` given: PEFT's greedy tokens, logits within the
/// tolerance.
fn check_prompts(
    model: &gemma4_model::Gemma4,
    adapter: Option<&LoraAdapter>,
    reference: &ReferenceLogits,
    (run, prompts): (&str, &[gemma4_model::lora_golden::LoraGoldenPrompt]),
    chunks: &[Option<usize>],
    what: &str,
) {
    for (i, p) in prompts.iter().enumerate() {
        let rows = reference.rows(run, i, "logits").expect("logits");
        let steps = reference.rows(run, i, "greedy_step_logits").expect("steps");
        for &chunk in chunks {
            let r =
                verify_lora_prompt(model, adapter, p, (&rows, &steps), chunk, DEFAULT_TOLERANCE)
                    .expect("verify");
            println!(
                "{what}/{}/{} chunk {chunk:?}: max diff {:.2e}, match {}",
                run, p.name, r.max_abs_logit_diff, r.seq_match
            );
            assert_eq!(r.generated_ids, p.greedy_ids, "{what}/{run}/{}", p.name);
            assert!(
                r.max_abs_logit_diff <= DEFAULT_TOLERANCE,
                "{what}/{run}/{}: logits off by {}",
                p.name,
                r.max_abs_logit_diff
            );
        }
    }
}

#[test]
fn every_adapter_matches_peft_whole_and_chunked() {
    for target in TARGETS {
        let dir = fixture(target);
        let model = load_hf_dir(&dir.join("target")).expect("target");
        let (golden, reference) = golden(target);
        let mut runs: Vec<(String, Option<LoraAdapter>, &Vec<_>)> =
            vec![("base".into(), None, &golden.base.prompts)];
        for a in &golden.adapters {
            for folder in [&a.folder, &a.folder_f32] {
                let adapter = LoraAdapter::load(&a.name, &dir.join(folder), model.config())
                    .unwrap_or_else(|e| panic!("{target}/{folder}: {e}"));
                runs.push((a.name.clone(), Some(adapter), &a.prompts));
            }
        }
        for (run, adapter, prompts) in &runs {
            let chunks = [None, Some(3)];
            check_prompts(
                &model,
                adapter.as_ref(),
                &reference,
                (run.as_str(), prompts.as_slice()),
                &chunks,
                target,
            );
        }
    }
}

/// The adapter's scaling of every module is PEFT's (rank and alpha
/// patterns, rsLoRA), and it adapts exactly the tensors the file holds.
#[test]
fn scalings_are_the_ones_peft_used() {
    for target in TARGETS {
        let dir = fixture(target);
        let model = load_hf_dir(&dir.join("target")).expect("target");
        let (golden, _) = golden(target);
        for a in &golden.adapters {
            let adapter =
                LoraAdapter::load(&a.name, &dir.join(&a.folder), model.config()).expect("adapter");
            let mut modules = 0;
            for (layer, proj, m) in adapter.modules() {
                let want = a.scaling_per_module[proj.name()];
                assert_eq!(m.rank(), want.r, "{target}/{}: {layer} {proj:?}", a.name);
                assert!(
                    (m.scale() - want.scaling).abs() < 1e-12,
                    "{target}/{}: layer {layer} {proj:?} scale {} against {}",
                    a.name,
                    m.scale(),
                    want.scaling
                );
                modules += 1;
            }
            let file =
                std::fs::read(dir.join(&a.folder).join("adapter_model.safetensors")).expect("file");
            let st = safetensors::SafeTensors::deserialize(&file).expect("safetensors");
            assert_eq!(2 * modules, st.len(), "{target}/{}", a.name);
            // Held as stored: the bytes `plan` counts are the file's factors.
            let stored: usize = st.tensors().iter().map(|(_, v)| v.data().len()).sum();
            assert_eq!(adapter.bytes(), stored, "{target}/{}", a.name);
        }
    }
}

/// llama.cpp's GGUF LoRA files, written by its `convert_lora_to_gguf.py`
/// from the PEFT folders: where the file keeps PEFT's scaling (`alpha / r`
/// without rsLoRA or patterns) they give PEFT's tokens and logits, in bf16
/// and f32; otherwise the scaling is llama.cpp's, `alpha / r` per module.
#[test]
fn gguf_adapters_match_peft_where_they_keep_its_scaling() {
    for (target, file) in [
        ("e-style", "adapter-a.gguf"),
        ("dense-k-eq-v", "adapter-a-f32.gguf"),
    ] {
        let dir = fixture(target);
        let model = load_hf_dir(&dir.join("target")).expect("target");
        let (golden, reference) = golden(target);
        let a = &golden.adapters[0];
        let path = dir.join("gguf").join(file);
        let adapter = LoraAdapter::load(&a.name, &path, model.config()).expect("gguf adapter");
        let peft = LoraAdapter::load(&a.name, &dir.join(&a.folder), model.config()).unwrap();
        assert_eq!(
            adapter.modules().count(),
            peft.modules().count(),
            "{target}"
        );
        for (layer, proj, m) in adapter.modules() {
            let p = peft.module(layer, proj).expect("the same modules");
            assert_eq!(
                (m.rank(), m.scale()),
                (p.rank(), p.scale()),
                "{layer} {proj:?}"
            );
        }
        let what = format!("{target}/{file}");
        let chunks = [None, Some(3)];
        let run = (a.name.as_str(), a.prompts.as_slice());
        check_prompts(&model, Some(&adapter), &reference, run, &chunks, &what);
    }
    // rsLoRA and the alpha pattern are not in the file: llama.cpp scales
    // every module by `adapter.lora.alpha` (8) over its own rank.
    for target in TARGETS {
        let dir = fixture(target);
        let model = load_hf_dir(&dir.join("target")).expect("target");
        let path = dir.join("gguf/adapter-b.gguf");
        let adapter = LoraAdapter::load("b", &path, model.config()).expect("gguf adapter");
        assert!(adapter.modules().count() > 0);
        for (layer, proj, m) in adapter.modules() {
            assert_eq!(
                m.scale(),
                8.0 / m.rank() as f64,
                "{target}: {layer} {proj:?}"
            );
        }
    }
    // The converter's q8_0: lora_a in Q8_0 blocks (widened to f32 at
    // load), lora_b (8 columns, less than a block) in f16.
    let dir = fixture("e-style");
    let model = load_hf_dir(&dir.join("target")).expect("target");
    let q8 = LoraAdapter::load("q8", &dir.join("gguf/adapter-a-q8_0.gguf"), model.config())
        .expect("q8_0 adapter");
    let bf16 = LoraAdapter::load("a", &dir.join("gguf/adapter-a.gguf"), model.config()).unwrap();
    assert_eq!(q8.modules().count(), bf16.modules().count());
    assert!(q8.bytes() > bf16.bytes(), "A held as f32");
}

/// What is not a GGUF LoRA file for this model is refused, naming why.
#[test]
fn gguf_files_that_are_not_adapters_for_the_model_are_refused() {
    let dir = fixture("e-style");
    let model = load_hf_dir(&dir.join("target")).expect("target");
    let refuse = |path: &Path| -> String {
        LoraAdapter::load("x", path, model.config())
            .map(|_| ())
            .expect_err("must be refused")
            .to_string()
    };
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mmproj = refuse(&fixtures.join("vision/e-audio-mmproj.gguf"));
    assert!(mmproj.contains("not a LoRA adapter"), "{mmproj}");
    let other = refuse(&fixture("dense-k-eq-v").join("gguf/adapter-a-f32.gguf"));
    assert!(
        other.contains("adapter-a-f32.gguf")
            && other.contains("model.language_model.layers.")
            && other.contains("another model"),
        "{other}"
    );
    let truncated =
        std::env::temp_dir().join(format!("gemma4-lora-cut-{}.gguf", std::process::id()));
    let bytes = std::fs::read(dir.join("gguf/adapter-a.gguf")).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let cut = refuse(&truncated);
    std::fs::remove_file(&truncated).ok();
    assert!(cut.contains("gemma4-lora-cut-"), "{cut}");
}

/// Several sequences in one step, each with its own adapter or none: each
/// gets its own run's logits, the base product shared and each adapter's
/// term added to its rows only.
#[test]
fn sequences_with_different_adapters_share_a_batch() {
    for target in TARGETS {
        let dir = fixture(target);
        let model = load_hf_dir(&dir.join("target")).expect("target");
        let (golden, reference) = golden(target);
        let adapters: Vec<LoraAdapter> = golden
            .adapters
            .iter()
            .map(|a| LoraAdapter::load(&a.name, &dir.join(&a.folder), model.config()).unwrap())
            .collect();
        // (run, adapter, prompt index): base, a and b interleaved, one
        // adapter twice on different prompts.
        let cases: Vec<(&str, Option<&LoraAdapter>, usize)> = vec![
            (&golden.adapters[0].name, Some(&adapters[0]), 0),
            ("base", None, 1),
            (&golden.adapters[1].name, Some(&adapters[1]), 2),
            (&golden.adapters[0].name, Some(&adapters[0]), 1),
        ];
        let prompts: Vec<&[u32]> = cases
            .iter()
            .map(|&(run, _, i)| {
                let list = if run == "base" {
                    &golden.base.prompts
                } else {
                    &golden
                        .adapters
                        .iter()
                        .find(|a| a.name == run)
                        .unwrap()
                        .prompts
                };
                list[i].input_ids.as_slice()
            })
            .collect();
        let mut store = Caches(vec![KvCache::new(model.config().num_layers()); cases.len()]);
        let batch: Vec<BatchSeq<'_>> = cases
            .iter()
            .zip(&prompts)
            .map(|(&(_, lora, _), ids)| BatchSeq {
                ids,
                start: 0,
                logits: Some(LogitsFor::All),
                soft: None,
                lora,
            })
            .collect();
        let out = model
            .forward_batch(&batch, &mut store, None)
            .expect("batch");
        let mut next = Vec::new();
        for ((run, _, i), logits) in cases.iter().zip(out) {
            let ours = logits.expect("logits").to_vec2::<f32>().unwrap();
            let gold = reference.rows(run, *i, "logits").unwrap();
            assert_within(&ours, &gold, &format!("{target}/{run}/prompt{i} prefill"));
            next.push(argmax(ours.last().unwrap()).0);
        }
        // One decode step for all four at once.
        let steps: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch: Vec<BatchSeq<'_>> = cases
            .iter()
            .zip(&prompts)
            .zip(&steps)
            .map(|((&(_, lora, _), ids), step)| BatchSeq {
                ids: step,
                start: ids.len(),
                logits: Some(LogitsFor::Last),
                soft: None,
                lora,
            })
            .collect();
        let out = model
            .forward_batch(&batch, &mut store, None)
            .expect("decode");
        for ((run, _, i), logits) in cases.iter().zip(out) {
            let ours = logits.expect("logits").to_vec2::<f32>().unwrap();
            let gold = reference.rows(run, *i, "greedy_step_logits").unwrap();
            assert_within(
                &ours,
                &gold[1..2],
                &format!("{target}/{run}/prompt{i} step 1"),
            );
        }
    }
}

/// An adapter merged into the weights (`W + s·B·A` in f32, as PEFT's
/// `merge_and_unload` merges it) gives PEFT's adapted tokens and logits,
/// the same as applying it unmerged.
#[test]
fn a_merged_adapter_gives_the_same_tokens() {
    for target in TARGETS {
        let dir = fixture(target);
        let (golden, reference) = golden(target);
        let base = load_hf_dir(&dir.join("target")).expect("target");
        for a in &golden.adapters {
            let folder = dir.join(&a.folder);
            let adapter = LoraAdapter::load(&a.name, &folder, base.config()).expect("adapter");
            let tag = format!("{target}-{}", a.name);
            let merged_dir = merged_checkpoint(&dir.join("target"), &folder, &adapter, &tag);
            let merged = load_hf_dir(&merged_dir).expect("merged checkpoint");
            let run = (a.name.as_str(), a.prompts.as_slice());
            let what = format!("{target} merged");
            check_prompts(&merged, None, &reference, run, &[None], &what);
            std::fs::remove_dir_all(&merged_dir).ok();
        }
    }
}

/// A copy of the checkpoint `target` whose adapted projections are
/// `W + s·B·A` in f32 (`s` the adapter's scaling of that module), every
/// other tensor as stored.
fn merged_checkpoint(target: &Path, folder: &Path, adapter: &LoraAdapter, tag: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("gemma4-merged-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(target).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
        }
    }
    let factors_bytes = std::fs::read(folder.join("adapter_model.safetensors")).unwrap();
    let factors = safetensors::SafeTensors::deserialize(&factors_bytes).unwrap();
    let weights_bytes = std::fs::read(target.join("model.safetensors")).unwrap();
    let weights = safetensors::SafeTensors::deserialize(&weights_bytes).unwrap();
    let mut merged: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut kept = Vec::new();
    for (name, view) in weights.tensors() {
        let module = adapted_module(&name).and_then(|(l, p)| adapter.module(l, p));
        let (Some(module), Some(stem)) = (module, name.strip_suffix(".weight")) else {
            kept.push((name, view));
            continue;
        };
        let a = f32_values(
            &factors
                .tensor(&format!("base_model.model.{stem}.lora_A.weight"))
                .unwrap(),
        );
        let b = f32_values(
            &factors
                .tensor(&format!("base_model.model.{stem}.lora_B.weight"))
                .unwrap(),
        );
        let (out_dim, in_dim) = (view.shape()[0], view.shape()[1]);
        let (rank, s) = (module.rank(), module.scale() as f32);
        let w = f32_values(&view);
        let values: Vec<u8> = (0..out_dim * in_dim)
            .flat_map(|idx| {
                let (o, i) = (idx / in_dim, idx % in_dim);
                let ba: f32 = (0..rank).map(|k| b[o * rank + k] * a[k * in_dim + i]).sum();
                (w[idx] + s * ba).to_le_bytes()
            })
            .collect();
        merged.push((name, vec![out_dim, in_dim], values));
    }
    assert_eq!(
        merged.len(),
        adapter.modules().count(),
        "{tag}: every adapted module merged"
    );
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept;
    for (name, shape, bytes) in &merged {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .unwrap();
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    out
}

/// `(layer, projection)` of a checkpoint's projection weight.
fn adapted_module(name: &str) -> Option<(usize, Projection)> {
    let rest = name.strip_prefix("model.language_model.layers.")?;
    let (layer, module) = rest.split_once('.')?;
    let proj = Projection::ALL
        .into_iter()
        .find(|p| module.ends_with(&format!("{}.weight", p.name())))?;
    Some((layer.parse().ok()?, proj))
}

fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    match view.dtype() {
        safetensors::Dtype::BF16 => view
            .data()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => panic!("unexpected {other:?}"),
    }
}

fn assert_within(ours: &[Vec<f32>], gold: &[Vec<f32>], what: &str) {
    assert_eq!(ours.len(), gold.len(), "{what}");
    let diff = ours
        .iter()
        .zip(gold)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max);
    assert!(diff <= DEFAULT_TOLERANCE, "{what}: logits off by {diff}");
}

/// Several sequences, each in a whole-sequence cache of its own.
struct Caches(Vec<KvCache>);

impl KvStore for Caches {
    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> gemma4_model::Result<()> {
        self.0[seq].write(layer, 0, start, k, v)
    }

    fn read(&self, layer: usize, seq: usize) -> gemma4_model::Result<(Tensor, Tensor, usize)> {
        self.0[seq].read(layer, 0)
    }
}

/// Copies adapter folder `from` into a fresh folder, with `edit` applied
/// to its config text and `rename` to its tensor names.
fn edited_adapter(
    from: &Path,
    tag: &str,
    edit: impl Fn(&str) -> String,
    rename: impl Fn(&str) -> String,
) -> PathBuf {
    let out = std::env::temp_dir().join(format!("gemma4-lora-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let config = std::fs::read_to_string(from.join("adapter_config.json")).unwrap();
    std::fs::write(out.join("adapter_config.json"), edit(&config)).unwrap();
    let bytes = std::fs::read(from.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (rename(&n), v))
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("adapter_model.safetensors")).unwrap();
    out
}

#[test]
fn adapters_that_do_not_fit_are_refused_naming_the_module() {
    let dir = fixture("e-style");
    let model = load_hf_dir(&dir.join("target")).expect("target");
    let cfg = model.config();
    let a = dir.join("adapter-a");
    let refuse = |path: &Path| -> String {
        LoraAdapter::load("x", path, cfg)
            .map(|_| ())
            .expect_err("must be refused")
            .to_string()
    };
    // The other target's adapter: its shapes are not this model's.
    let other = refuse(&fixture("dense-k-eq-v").join("adapter-a"));
    assert!(
        other.contains("model.language_model.layers.") && other.contains("another model"),
        "{other}"
    );
    // A KV-shared layer (5) has no k_proj.
    let shared = edited_adapter(
        &a,
        "shared",
        |c| c.to_string(),
        |n| n.replace("layers.4.self_attn.k_proj", "layers.5.self_attn.k_proj"),
    );
    let msg = refuse(&shared);
    assert!(
        msg.contains("layers.5.self_attn.k_proj") && msg.contains("KV sharing"),
        "{msg}"
    );
    // A module outside the attention and MLP projections.
    let head = edited_adapter(
        &a,
        "head",
        |c| c.to_string(),
        |n| n.replace("layers.0.mlp.up_proj", "per_layer_model_projection"),
    );
    let msg = refuse(&head);
    assert!(
        msg.contains("per_layer_model_projection") && msg.contains("cannot be adapted"),
        "{msg}"
    );
    // DoRA, and a rank that the config and the file disagree on.
    let dora = edited_adapter(
        &a,
        "dora",
        |c| c.replace("\"use_dora\": false", "\"use_dora\": true"),
        str::to_string,
    );
    assert!(refuse(&dora).contains("use_dora"));
    let rank = edited_adapter(
        &a,
        "rank",
        |c| c.replace("\"r\": 8", "\"r\": 4"),
        str::to_string,
    );
    assert!(refuse(&rank).contains("rank 4"), "{}", refuse(&rank));
    // A truncated weights file names the file.
    let cut = edited_adapter(&a, "cut", |c| c.to_string(), str::to_string);
    let w = cut.join("adapter_model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
    assert!(refuse(&cut).contains("adapter_model.safetensors"));
    // A folder without an adapter.
    assert!(refuse(&dir.join("target")).contains("adapter_config.json"));
    for d in [shared, head, dora, rank, cut] {
        let _ = std::fs::remove_dir_all(d);
    }
    // The adapter that fits loads, with its modules where the file puts them.
    let ok = LoraAdapter::load("a", &a, cfg).expect("adapter-a");
    assert!(ok.module(0, Projection::Q).is_some());
    assert!(ok.module(5, Projection::K).is_none());
    assert_eq!(ok.max_rank(), 8);
}

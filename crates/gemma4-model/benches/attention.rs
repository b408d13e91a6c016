//! Decode attention over the paged cache: read in place from the pool
//! blocks against gathering the context and multiplying matrices (the
//! prefill path), in the same run. Gemma 3 270M's attention shape (4 query
//! heads, 1 KV head, head_dim 256) on one full-attention layer; one query.
//! Prints microseconds per call and the ratio, per context length and pool type.
//! Then four sequences' queries in one batch call against one call each.

use std::time::Instant;

use candle_core::{Device, Tensor};
use gemma4_model::cache::{attend_gathered, KvStore, Queries, Visibility};
use gemma4_model::config::TextConfig;
use gemma4_model::paged::{kv_groups, GroupBlocks, KvDtype, PagedKvPool, SeqBlocks};

fn config() -> TextConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/e-style/config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("config")).expect("json");
    let t = &mut json["text_config"];
    t["num_attention_heads"] = 4.into();
    t["num_key_value_heads"] = 1.into();
    t["head_dim"] = 256.into();
    t["global_head_dim"] = 256.into();
    t["num_global_key_value_heads"] = 1.into();
    TextConfig::from_hf_json(&json).expect("config")
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Microseconds per call of `a` and of `b`: medians of five rounds of
/// `reps` calls each, the two alternating.
fn alternating_us(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let per_call = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        t.elapsed().as_secs_f64() * 1e6 / reps as f64
    };
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        ta.push(per_call(&mut a));
        tb.push(per_call(&mut b));
    }
    (median(ta), median(tb))
}

fn main() {
    let cfg = config();
    let groups = kv_groups(&cfg);
    let layer = groups
        .iter()
        .find_map(|group| {
            let l = *group.layers.first()?;
            (cfg.layers[l].kind == gemma4_model::config::AttentionKind::Full).then_some(l)
        })
        .expect("a full-attention producer");
    let spec = &cfg.layers[layer];
    let (kvh, hd, heads) = (spec.num_kv_heads, spec.head_dim, 4);
    println!(
        "decode attention, {heads} query heads, {kvh} KV head, head_dim {hd}: in place vs gathered"
    );
    let bs = 16;
    for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Int8] {
        for ctx in [128usize, 512, 2048] {
            let blocks = ctx.div_ceil(bs);
            let mut pool = PagedKvPool::new(
                &cfg,
                bs,
                &vec![blocks + 1; groups.len()],
                dtype,
                &Device::Cpu,
            )
            .expect("pool");
            // Blocks in reverse order, as a long-running cache hands them out.
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let batch = vec![SeqBlocks {
                groups: (0..groups.len())
                    .map(|_| GroupBlocks {
                        first_block: 0,
                        blocks: table.clone(),
                    })
                    .collect(),
                len_after_step: ctx,
            }];
            let mut view = pool.view(&batch);
            let kv = Tensor::randn(0f32, 1.0, (ctx, kvh, hd), &Device::Cpu).expect("kv");
            view.write(layer, 0, 0, &kv, &kv).expect("write");
            let q = Tensor::randn(0f32, 1.0, (1, heads, hd), &Device::Cpu).expect("q");
            let queries = Queries {
                q: &q,
                start: ctx - 1,
                scale: 0.0625,
                visibility: Visibility::causal(None),
            };
            let (a, b) = alternating_us(
                200,
                || {
                    view.attend(layer, 0, queries).expect("attend");
                },
                || {
                    let (k, v, first) = view.read(layer, 0).expect("read");
                    attend_gathered(&k, &v, first, queries).expect("gathered");
                },
            );
            println!(
                "  {:>4} ctx {ctx:>5}: in place {a:>8.1} us, gathered {b:>8.1} us ({:.2}x faster)",
                dtype.name(),
                b / a
            );
        }
    }
    batched(&cfg, layer, heads, bs);
}

/// Four sequences' decode queries in one `attend_batch` call against one
/// `attend` call per sequence: the batch reads each context once per
/// thread for all the query heads, one pool dispatch for the four.
fn batched(cfg: &TextConfig, layer: usize, heads: usize, bs: usize) {
    let groups = kv_groups(cfg);
    let spec = &cfg.layers[layer];
    let (kvh, hd, seqs) = (spec.num_kv_heads, spec.head_dim, 4);
    println!("{seqs} sequences, one query each: one batch call vs one call per sequence");
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        for ctx in [512usize, 2048] {
            let blocks = ctx.div_ceil(bs);
            let mut pool = PagedKvPool::new(
                cfg,
                bs,
                &vec![seqs * blocks + 1; groups.len()],
                dtype,
                &Device::Cpu,
            )
            .expect("pool");
            let batch: Vec<SeqBlocks> = (0..seqs)
                .map(|s| SeqBlocks {
                    groups: (0..groups.len())
                        .map(|_| GroupBlocks {
                            first_block: 0,
                            blocks: ((s * blocks) as u32..((s + 1) * blocks) as u32)
                                .rev()
                                .collect(),
                        })
                        .collect(),
                    len_after_step: ctx,
                })
                .collect();
            let mut view = pool.view(&batch);
            for s in 0..seqs {
                let kv = Tensor::randn(0f32, 1.0, (ctx, kvh, hd), &Device::Cpu).expect("kv");
                view.write(layer, s, 0, &kv, &kv).expect("write");
            }
            let qs: Vec<Tensor> = (0..seqs)
                .map(|_| Tensor::randn(0f32, 1.0, (1, heads, hd), &Device::Cpu).expect("q"))
                .collect();
            let queries = |s: usize| Queries {
                q: &qs[s],
                start: ctx - 1,
                scale: 0.0625,
                visibility: Visibility::causal(None),
            };
            let (a, b) = alternating_us(
                100,
                || {
                    let all = (0..seqs).map(|s| (s, queries(s))).collect();
                    view.attend_batch(layer, all).expect("attend_batch");
                },
                || {
                    for s in 0..seqs {
                        view.attend(layer, s, queries(s)).expect("attend");
                    }
                },
            );
            println!(
                "  {:>4} ctx {ctx:>5}: one batch {a:>8.1} us, per sequence {b:>8.1} us ({:.2}x faster)",
                dtype.name(),
                b / a
            );
        }
    }
}

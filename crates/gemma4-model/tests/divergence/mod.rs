//! What the accuracy tests measure against a reference: log-softmax, KL
//! divergence, and our logits along the reference's own continuation.
//! Each test binary uses part of it.
#![allow(dead_code)]

use gemma4_model::{Gemma4, LogitsFor};

/// The log-softmax of a row of logits, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// KL(reference ‖ ours) of one row of logits, in nats.
pub fn kl(reference: &[f32], ours: &[f32]) -> f64 {
    let (p, q) = (log_softmax(reference), log_softmax(ours));
    p.iter().zip(&q).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// Our logits at the last position of `prompt` and after each of `ids`
/// but the last, fed back one at a time (teacher forcing): every step is
/// compared with the reference's own however an earlier one went.
pub fn forced_rows(model: &Gemma4, prompt: &[u32], ids: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let row = |t: candle_core::Tensor| t.squeeze(0).and_then(|r| r.to_vec1::<f32>()).expect("row");
    let first = model.forward(prompt, &mut cache, LogitsFor::Last, None);
    let mut rows = vec![row(first.expect("prompt"))];
    for &id in &ids[..ids.len().saturating_sub(1)] {
        let step = model.forward(&[id], &mut cache, LogitsFor::Last, None);
        rows.push(row(step.expect("step")));
    }
    rows
}

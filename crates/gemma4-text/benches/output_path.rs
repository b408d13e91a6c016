//! The output path's cost per token: 4 streams of a chat turn (thinking, a
//! tool call with string arguments, a French answer) interleaved as the
//! output thread sees them, through a request's whole `RequestOutput` (one
//! stop string, the turn parsed into events), against the floor of the same
//! ids through a bare `IncrementalDecoder`, in the same run; median of 5
//! alternating rounds.
//!
//! ```sh
//! cargo bench -p gemma4-text --bench output_path [-- TOKENIZER_DIR]
//! ```
//! The tokenizer is `TOKENIZER_DIR`, else the real-vocabulary checkpoint the
//! server tests build (`target/tmp/real-vocab`), else the e-style fixture.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use gemma4_text::{IncrementalDecoder, ProtocolTokens, Reading, RequestOutput, Tokenizer};

const TURN: &str = "<|channel>thought\nThe user wants the weather in Paris. I should call the tool with the city and the unit, then answer briefly in French, keeping the numbers exact: 21.5 degrees, 63% humidity.<channel|><|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,unit:<|\"|>celsius<|\"|>,days:3}<tool_call|>Il fait beau à Paris aujourd'hui : 21,5 °C, 63 % d'humidité, un léger vent d'ouest et quelques nuages l'après-midi. Demain la température montera à 24 °C. ";
const STREAMS: usize = 4;
const ROUNDS: usize = 5;

fn tokenizer_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if let Some(dir) = std::env::args().skip(1).find(|a| !a.starts_with('-')) {
        return PathBuf::from(dir);
    }
    let built = root.join("target/tmp/real-vocab");
    if built.join("tokenizer.json").exists() {
        return built;
    }
    root.join("tests/fixtures/oracle/e-style")
}

/// Nanoseconds per token of `step` over `STREAMS` interleaved streams.
fn round<S>(ids: &[u32], make: impl Fn() -> S, step: impl Fn(&mut S, u32) -> usize) -> f64 {
    let mut states: Vec<S> = (0..STREAMS).map(|_| make()).collect();
    let mut sink = 0;
    let start = Instant::now();
    for &id in ids {
        for s in states.iter_mut() {
            sink += step(s, id);
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / (ids.len() * STREAMS) as f64;
    std::hint::black_box(sink);
    ns
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let dir = tokenizer_dir();
    let tok = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    let ids = tok.encode(&TURN.repeat(20), false).expect("ids");
    let protocol = ProtocolTokens::new(&tok);
    let reading = Reading::Chat {
        call_id_prefix: "call_".into(),
    };
    let stops = vec!["<end>".to_string()];
    let (mut floor, mut path) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        floor.push(round(
            &ids,
            || IncrementalDecoder::new(tok.clone()),
            |d, id| d.push(id).ok().flatten().map_or(0, |t| t.len()),
        ));
        path.push(round(
            &ids,
            || RequestOutput::new(tok.clone(), protocol.clone(), &[], &stops, &reading),
            |o, id| o.push(id).map_or(0, |s| s.text.len() + s.events.len()),
        ));
    }
    let (floor, path) = (median(floor), median(path));
    println!("tokenizer: {}", dir.display());
    println!("{STREAMS} streams of {} tokens each", ids.len());
    println!("bare IncrementalDecoder: {floor:.0} ns/token");
    println!("RequestOutput (stops, parsed chat turn): {path:.0} ns/token");
    println!("ratio RequestOutput / decoder: {:.2}", path / floor);
}

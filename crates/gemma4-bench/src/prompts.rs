//! Prompts for the sweep: random word prompts of an exact token length, or
//! prompts read from a JSONL file.
//!
//! Random prompts are measured with the served tokenizer where the server has a
//! `/tokenize` endpoint (llama.cpp's `{"content"}` or vLLM's `{"prompt"}`
//! shape), else with a local tokenizer, else counted as one token per word and
//! marked approximate. Each prompt opens with words derived from a per-run
//! nonce and its own index, so no two prompts share a prefix, within a run or
//! across runs, and a server's prefix cache cannot serve them by accident.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::client::Endpoint;
use crate::error::{BenchError, Result};

/// Common English words; with a leading space each is one token in Gemma's
/// vocabulary and in most others.
const WORDS: &[&str] = &[
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "foot",
    "boy",
    "age",
    "policy",
    "music",
    "market",
    "sense",
    "nation",
    "plan",
    "college",
    "interest",
    "death",
    "experience",
    "effect",
    "class",
    "control",
    "care",
    "field",
    "development",
    "role",
    "effort",
    "rate",
    "heart",
    "drug",
    "show",
    "leader",
    "light",
    "voice",
    "wife",
    "police",
    "mind",
    "price",
    "report",
    "decision",
    "son",
    "view",
    "relationship",
    "town",
    "road",
    "arm",
    "difference",
    "value",
    "building",
    "action",
    "model",
    "season",
    "society",
    "tax",
    "director",
    "position",
    "player",
    "record",
    "paper",
    "space",
    "ground",
    "form",
    "event",
    "official",
    "matter",
    "center",
    "couple",
    "site",
    "project",
    "activity",
    "star",
    "table",
    "need",
    "court",
    "oil",
    "situation",
    "cost",
    "industry",
    "figure",
    "street",
    "image",
    "phone",
    "data",
    "picture",
    "practice",
    "piece",
    "land",
    "product",
    "doctor",
    "wall",
    "patient",
    "worker",
    "news",
    "test",
    "movie",
    "north",
    "love",
    "support",
    "technology",
    "step",
    "baby",
    "computer",
    "type",
    "attention",
    "film",
    "tree",
    "source",
    "organization",
    "hair",
    "window",
    "evidence",
    "population",
    "river",
    "garden",
];

/// How many leading words identify a prompt (run nonce and index).
const ID_WORDS: usize = 4;
/// Rounds of whole-word adjustment.
const MAX_ADJUST_ROUNDS: usize = 12;
/// Filler pieces appended at most, once whole words are within one word of the target.
const MAX_FILL_STEPS: usize = 64;
/// Short pieces that are one token in most vocabularies.
const FILLERS: &[&str] = &[" a", " I", " x", " o", " 1", " 7", ".", ",", "!", "?"];

/// How prompt token counts are measured.
#[derive(Clone)]
pub enum TokenCounter {
    /// The server's `/tokenize` endpoint.
    Server {
        endpoint: Endpoint,
        style: TokenizeStyle,
        model: String,
    },
    /// A tokenizer loaded from disk.
    Local(Arc<gemma4_text::Tokenizer>),
    /// No tokenizer: one token per word is assumed.
    Approximate,
}

/// The request shape a server's `/tokenize` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizeStyle {
    /// `{"content", "add_special": false}` (llama.cpp).
    Content,
    /// `{"model", "prompt", "add_special_tokens": false}` (vLLM).
    Prompt,
}

impl TokenCounter {
    /// The report's name for this source.
    pub fn source(&self) -> &'static str {
        match self {
            TokenCounter::Server { .. } => "server-tokenize",
            TokenCounter::Local(_) => "local-tokenizer",
            TokenCounter::Approximate => "approximate",
        }
    }

    /// Whether counts are real token counts.
    pub fn is_exact(&self) -> bool {
        !matches!(self, TokenCounter::Approximate)
    }

    /// Picks the best available counter: the server's `/tokenize` (probed with
    /// both request shapes), else `local`, else approximate.
    pub async fn detect(
        endpoint: &Endpoint,
        model: &str,
        local: Option<gemma4_text::Tokenizer>,
    ) -> Self {
        for style in [TokenizeStyle::Content, TokenizeStyle::Prompt] {
            let counter = TokenCounter::Server {
                endpoint: endpoint.clone(),
                style,
                model: model.to_owned(),
            };
            if matches!(counter.count("hello world").await, Ok(n) if n > 0) {
                return counter;
            }
        }
        match local {
            Some(tokenizer) => TokenCounter::Local(Arc::new(tokenizer)),
            None => TokenCounter::Approximate,
        }
    }

    /// Number of tokens of `text`, without special tokens such as BOS.
    pub async fn count(&self, text: &str) -> Result<usize> {
        match self {
            TokenCounter::Server {
                endpoint,
                style,
                model,
            } => {
                let body = match style {
                    TokenizeStyle::Content => json!({"content": text, "add_special": false}),
                    TokenizeStyle::Prompt => {
                        json!({"model": model, "prompt": text, "add_special_tokens": false})
                    }
                };
                let answer = endpoint
                    .post_json("tokenize", &body, Some(Duration::from_secs(30)))
                    .await
                    .map_err(|e| BenchError::Tokenizer(format!("server /tokenize: {e}")))?;
                answer
                    .get("tokens")
                    .and_then(Value::as_array)
                    .map(Vec::len)
                    .ok_or_else(|| {
                        BenchError::Tokenizer(
                            "server /tokenize answered without a 'tokens' list".to_owned(),
                        )
                    })
            }
            TokenCounter::Local(tokenizer) => tokenizer
                .encode(text, false)
                .map(|ids| ids.len())
                .map_err(|e| BenchError::Tokenizer(e.to_string())),
            TokenCounter::Approximate => Ok(text.split_whitespace().count()),
        }
    }
}

/// One prepared prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    /// Token count as measured (exact unless the counter is approximate).
    pub tokens: Option<u32>,
    /// Requested output length.
    pub output_len: u32,
}

/// Builds random-word prompts of exactly `input_len` tokens where the counter
/// allows; `first_index` numbers them so that every prompt of a run is distinct.
pub struct RandomPrompts {
    rng: StdRng,
    nonce: u64,
    input_len: usize,
    output_len: u32,
}

impl RandomPrompts {
    /// `seed` fixes the prompt bodies; `nonce` (different for every run) fixes
    /// the identifying first words.
    pub fn new(seed: u64, nonce: u64, input_len: u32, output_len: u32) -> Self {
        RandomPrompts {
            rng: StdRng::seed_from_u64(seed),
            nonce,
            input_len: input_len as usize,
            output_len,
        }
    }

    /// The words that open prompt `index`: each is the index's base-N digit
    /// shifted by the nonce's digit, so distinct indices (below N^4) give
    /// distinct openings and another nonce gives other words.
    fn id_words(&self, index: u64) -> Vec<&'static str> {
        let base = WORDS.len() as u64;
        let (mut n, mut m) = (index, self.nonce);
        let mut words = Vec::with_capacity(ID_WORDS);
        for _ in 0..ID_WORDS {
            let digit = (n % base + m % base) % base;
            words.push(WORDS.get(digit as usize).copied().unwrap_or("word"));
            n /= base;
            m /= base;
        }
        words
    }

    fn random_word(&mut self) -> &'static str {
        WORDS
            .get(self.rng.random_range(0..WORDS.len()))
            .copied()
            .unwrap_or("word")
    }

    /// Builds prompt `index`; returns it and whether its length is exact.
    ///
    /// Whole words are added or removed (scaled by the tokens per word seen so
    /// far) until the prompt is at most one word short, then short pieces that
    /// add exactly one token each fill the rest.
    pub async fn build(&mut self, index: u64, counter: &TokenCounter) -> Result<(Prompt, bool)> {
        let target = self.input_len.max(1);
        let mut words: Vec<&'static str> = self.id_words(index);
        words.truncate(target);
        while words.len() < target {
            let w = self.random_word();
            words.push(w);
        }
        let mut count = counter.count(&words.join(" ")).await?;
        for _ in 0..MAX_ADJUST_ROUNDS {
            if count == target {
                break;
            }
            let per_word = (count as f64 / words.len().max(1) as f64).max(1.0);
            if count > target {
                if words.len() <= 1 {
                    break;
                }
                let remove = ((count - target) as f64 / per_word).ceil() as usize;
                words.truncate(words.len() - remove.clamp(1, words.len() - 1));
            } else {
                let add = ((target - count) as f64 / per_word).floor() as usize;
                if add == 0 {
                    break;
                }
                for _ in 0..add {
                    let w = self.random_word();
                    words.push(w);
                }
            }
            count = counter.count(&words.join(" ")).await?;
        }
        while count > target && words.len() > 1 {
            words.pop();
            count = counter.count(&words.join(" ")).await?;
        }
        let mut text = words.join(" ");
        if count > target {
            // Even one word is too long: start from nothing and fill.
            text.clear();
            count = 0;
        }
        for _ in 0..MAX_FILL_STEPS {
            if count >= target {
                break;
            }
            match fill_one(&text, count, target, counter).await? {
                Some((longer, n)) => {
                    text = longer;
                    count = n;
                }
                None => break,
            }
        }
        let exact = count == target && counter.is_exact();
        Ok((
            Prompt {
                text,
                tokens: u32::try_from(count).ok(),
                output_len: self.output_len,
            },
            exact,
        ))
    }
}

/// Appends the first filler piece that adds exactly one token, else the one that
/// adds the fewest without passing `target`; `None` when none fits.
async fn fill_one(
    text: &str,
    count: usize,
    target: usize,
    counter: &TokenCounter,
) -> Result<Option<(String, usize)>> {
    let mut best: Option<(String, usize)> = None;
    for piece in FILLERS {
        let candidate = if text.is_empty() {
            piece.trim_start().to_owned()
        } else {
            format!("{text}{piece}")
        };
        let n = counter.count(&candidate).await?;
        if n == count + 1 {
            return Ok(Some((candidate, n)));
        }
        if n > count && n <= target && best.as_ref().is_none_or(|(_, b)| n < *b) {
            best = Some((candidate, n));
        }
    }
    Ok(best)
}

/// Reads a JSONL dataset: one object per line with `prompt` (a string) and an
/// optional `output_len` (or `max_tokens`); blank lines are skipped.
pub fn read_jsonl(path: &Path, default_output_len: u32) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| BenchError::Dataset {
            path: PathBuf::from(path),
            line: i + 1,
            message,
        };
        let value: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let prompt = value
            .get("prompt")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("expected an object with a string 'prompt'".to_owned()))?;
        let output_len = match value.get("output_len").or_else(|| value.get("max_tokens")) {
            None | Some(Value::Null) => default_output_len,
            Some(v) => v
                .as_u64()
                .filter(|n| *n > 0)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad("'output_len' must be a positive integer".to_owned()))?,
        };
        prompts.push(Prompt {
            text: prompt.to_owned(),
            tokens: None,
            output_len,
        });
    }
    if prompts.is_empty() {
        return Err(BenchError::Dataset {
            path: path.to_path_buf(),
            line: 0,
            message: "no prompts in the file".to_owned(),
        });
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block<F: std::future::Future>(f: F) -> F::Output {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(f),
            Err(e) => panic!("runtime: {e}"),
        }
    }

    #[test]
    fn approximate_prompts_have_the_word_count_and_distinct_openings() {
        let mut gen = RandomPrompts::new(7, 99, 32, 8);
        let counter = TokenCounter::Approximate;
        let mut openings = std::collections::HashSet::new();
        for i in 0..200 {
            let built = block(gen.build(i, &counter));
            let (p, exact) = match built {
                Ok(b) => b,
                Err(e) => panic!("{e}"),
            };
            assert!(!exact, "approximate counts are never exact");
            assert_eq!(p.text.split_whitespace().count(), 32);
            assert_eq!(p.tokens, Some(32));
            let opening: Vec<&str> = p.text.split_whitespace().take(ID_WORDS).collect();
            assert!(
                openings.insert(opening.join(" ")),
                "prompt {i} repeats an opening"
            );
        }
    }

    fn exact_lengths_with(tokenizer: gemma4_text::Tokenizer, name: &str) {
        let counter = TokenCounter::Local(Arc::new(tokenizer));
        for len in [1u32, 2, 5, 16, 100, 1024] {
            let mut gen = RandomPrompts::new(3, 11, len, 8);
            for i in 0..4 {
                let built = block(gen.build(i, &counter));
                let (p, exact) = match built {
                    Ok(b) => b,
                    Err(e) => panic!("{name}: {e}"),
                };
                let measured = block(counter.count(&p.text)).ok();
                assert_eq!(
                    measured,
                    Some(len as usize),
                    "{name}, len {len}: {:?}",
                    p.text
                );
                assert!(exact, "{name}, len {len}");
                assert_eq!(p.tokens, Some(len));
            }
        }
    }

    fn fixture(path: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(path)
    }

    #[test]
    fn exact_lengths_with_the_gemma4_vocabulary() {
        let tok = gemma4_text::Tokenizer::from_gguf(&fixture(
            "tests/fixtures/text/ggml-vocab-gemma-4.gguf",
        ));
        match tok {
            Ok(t) => exact_lengths_with(t, "gemma-4 vocab"),
            Err(e) => panic!("loading the Gemma 4 vocabulary: {e}"),
        }
    }

    #[test]
    fn exact_lengths_with_a_tiny_vocabulary() {
        // 512 pieces: most words take several tokens, so fillers are needed.
        match gemma4_text::Tokenizer::from_dir(&fixture("tests/fixtures/oracle/e-style")) {
            Ok(t) => exact_lengths_with(t, "e-style vocab"),
            Err(e) => panic!("loading the e-style tokenizer: {e}"),
        }
    }

    #[test]
    fn the_word_list_has_no_duplicates() {
        let unique: std::collections::HashSet<&str> = WORDS.iter().copied().collect();
        assert_eq!(unique.len(), WORDS.len());
    }

    #[test]
    fn runs_with_another_nonce_open_differently() {
        let a = RandomPrompts::new(1, 1, 8, 8).id_words(0);
        let b = RandomPrompts::new(1, 2, 8, 8).id_words(0);
        assert_ne!(a, b);
    }

    #[test]
    fn tiny_prompts() {
        let mut gen = RandomPrompts::new(0, 0, 1, 4);
        let built = block(gen.build(3, &TokenCounter::Approximate));
        assert_eq!(
            built.map(|(p, _)| p.text.split_whitespace().count()).ok(),
            Some(1)
        );
    }

    #[test]
    fn jsonl_datasets() {
        let dir = std::env::temp_dir().join(format!("gemma4-bench-jsonl-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let good = dir.join("good.jsonl");
        let _ = std::fs::write(
            &good,
            "{\"prompt\": \"a b\"}\n\n{\"prompt\": \"c\", \"output_len\": 5}\n",
        );
        let prompts = read_jsonl(&good, 9).map_err(|e| e.to_string());
        assert_eq!(
            prompts.map(|p| p
                .iter()
                .map(|x| (x.text.clone(), x.output_len))
                .collect::<Vec<_>>()),
            Ok(vec![("a b".to_owned(), 9), ("c".to_owned(), 5)])
        );
        let bad = dir.join("bad.jsonl");
        let _ = std::fs::write(&bad, "{\"prompt\": \"a\"}\n{\"text\": 1}\n");
        let err = read_jsonl(&bad, 9).map(|_| ()).map_err(|e| e.to_string());
        assert!(matches!(&err, Err(m) if m.contains("line 2")), "{err:?}");
        assert!(read_jsonl(&dir.join("missing.jsonl"), 9).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Enforced structured output: JSON schemas, regular expressions, choices and
//! Lark grammars compiled by llguidance into a mask over the vocabulary for
//! every next token. The mask is applied in the engine's sampler, so every
//! sampling mode (greedy included) can only produce text the grammar accepts.
//!
//! With thinking on, the reasoning is free text: enforcement starts right after
//! the thought channel closes (the thinking budget bounds it). The model may
//! also skip thinking: then the grammar applies from the first token.

use std::sync::{Arc, Mutex};

use gemma4_engine::{ConstraintFactory, TokenConstraint};
use gemma4_text::{ChannelState, Marker, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::error::ApiError;

mod numbers;
mod schema;
mod tool_calls;
use numbers::{NumberLimit, NumberTokens, Quoting};
pub use tool_calls::{tool_call_grammar, CallMarkers};

/// What the output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    JsonSchema(Value),
    Regex(String),
    Choice(Vec<String>),
    Lark(String),
    /// Gemma 4 tool calls (from [`tool_call_grammar`]) whose strings sit
    /// between two `quote` tokens.
    ToolCalls {
        lark: String,
        quote: u32,
    },
}

impl GrammarSpec {
    /// How the output quotes its strings, where its numbers are JSON's and
    /// must end; `None` for grammars whose digits are the user's to bound.
    fn numbers(&self) -> Option<Quoting> {
        match self {
            GrammarSpec::JsonSchema(_) => Some(Quoting::Json),
            GrammarSpec::ToolCalls { quote, .. } => Some(Quoting::Delimiter(*quote)),
            _ => None,
        }
    }
}

/// A compiled grammar, ready to make constraints from.
pub struct Compiled {
    matcher: Matcher,
    numbers: Option<Quoting>,
}

/// The vocabulary as llguidance sees it: each token's bytes.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Compiles grammars for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    numbers: Arc<NumberTokens>,
    eos: u32,
}

impl Grammars {
    /// Builds the token trie of a vocabulary (once per model; it takes a moment).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, String> {
        let json: Value = tokenizer
            .inner()
            .to_string(false)
            .map_err(|e| e.to_string())
            .and_then(|text| serde_json::from_str(&text).map_err(|e| e.to_string()))?;
        let words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
        let eos = tokenizer
            .eos_id()
            .ok_or("the tokenizer has no end-of-sequence token")?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        let numbers = Arc::new(NumberTokens::new(env));
        Ok(Self {
            factory,
            numbers,
            eos,
        })
    }

    /// Compiles a grammar; one the engine cannot compile (an unsupported
    /// schema keyword, a bad regex) is a 400 that says why.
    pub fn compile(&self, spec: &GrammarSpec, param: &str) -> Result<Compiled, ApiError> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(enforced_schema(schema))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) | GrammarSpec::ToolCalls { lark, .. } => {
                TopLevelGrammar::from_lark(lark.clone())
            }
            GrammarSpec::Choice(options) => {
                let alternatives: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            ApiError::bad_request(format!("`{param}` cannot be enforced: {e}")).with_param(param)
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(
                ApiError::bad_request(format!("`{param}` cannot be enforced: {e}"))
                    .with_param(param),
            );
        }
        Ok(Compiled {
            matcher,
            numbers: spec.numbers(),
        })
    }

    /// A constraint factory: each sequence gets its own copy of the compiled
    /// grammar. `thinking` is given when the turn may think first.
    pub fn constraint(
        &self,
        compiled: Compiled,
        thinking: Option<ThinkingGate>,
    ) -> ConstraintFactory {
        let prototype = Arc::new(Mutex::new(compiled.matcher));
        let (eos, quoting) = (self.eos, compiled.numbers);
        let number_tokens = Arc::clone(&self.numbers);
        ConstraintFactory(Arc::new(move || {
            let matcher = prototype
                .lock()
                .map(|m| m.deep_clone())
                .unwrap_or_else(|p| p.into_inner().deep_clone());
            let gate = match thinking.clone() {
                None => Gate::Enforcing,
                Some(t) if t.channel.in_thought() => Gate::Thinking(t.channel),
                Some(t) => Gate::MayThink(t.channel),
            };
            Box::new(GrammarConstraint {
                matcher,
                numbers: quoting.map(|q| (NumberLimit::new(q), Arc::clone(&number_tokens))),
                gate,
                mask: Vec::new(),
                ready: false,
                eos,
            }) as Box<dyn TokenConstraint>
        }))
    }
}

/// The bound given to an unbounded `integer`: 2^53 − 1, the largest integer
/// every JSON reader holds exactly (16 digits; llama.cpp's JSON grammars
/// allow 16 digits too). The grammar engine holds bounds as `f64`, so the
/// bound must be exact there: 9,999,999,999,999,999 would round up to 10^16.
const INTEGER_LIMIT: i64 = 9_007_199_254_740_991;

/// The schema as it is enforced. JSON is written in `json.dumps` layout
/// (`", "` and `": "`, no other white space), and an `integer` without bounds
/// stays within 16 digits: a model can pad its output neither with endless
/// white space nor with endless digits.
fn enforced_schema(schema: &Value) -> Value {
    let mut schema = schema.clone();
    bound_integers(&mut schema);
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": "
            })
        });
    }
    schema
}

/// Adds the default bounds to every `integer` subschema that lacks them.
/// Literal values (`enum`, `const`, `default`, `examples`) are left alone.
fn bound_integers(schema: &mut Value) {
    match schema {
        Value::Object(obj) => {
            let integer = match obj.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
                _ => false,
            };
            if integer {
                if !obj.contains_key("maximum") && !obj.contains_key("exclusiveMaximum") {
                    obj.insert("maximum".into(), INTEGER_LIMIT.into());
                }
                if !obj.contains_key("minimum") && !obj.contains_key("exclusiveMinimum") {
                    obj.insert("minimum".into(), (-INTEGER_LIMIT).into());
                }
            }
            for (key, value) in obj.iter_mut() {
                if !matches!(key.as_str(), "enum" | "const" | "default" | "examples") {
                    bound_integers(value);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound_integers),
        _ => {}
    }
}

/// A turn that may think before the answer: where it stands at the
/// prompt's end (the prompt may have opened the channel already).
#[derive(Debug, Clone)]
pub struct ThinkingGate {
    pub channel: ChannelState,
}

#[derive(Debug)]
enum Gate {
    /// The turn may open a thought channel or start the answer.
    MayThink(ChannelState),
    /// Inside the channel: free text until the turn leaves it.
    Thinking(ChannelState),
    Enforcing,
}

struct GrammarConstraint {
    matcher: Matcher,
    /// JSON's numbers held to what a double holds, over the grammar's mask.
    numbers: Option<(NumberLimit, Arc<NumberTokens>)>,
    gate: Gate,
    mask: Vec<u32>,
    /// `mask` is the set for the next token (prepared since the last accept).
    ready: bool,
    eos: u32,
}

fn set_bit(mask: &mut Vec<u32>, token: u32) {
    let word = token as usize / 32;
    if mask.len() <= word {
        mask.resize(word + 1, 0);
    }
    mask[word] |= 1 << (token % 32);
}

impl TokenConstraint for GrammarConstraint {
    fn prepare(&mut self) {
        if matches!(self.gate, Gate::Thinking(_)) || self.ready {
            return;
        }
        self.mask = match self.matcher.compute_mask() {
            Ok(vob) => vob.as_slice().to_vec(),
            // The grammar is complete (or broken): only the end may follow.
            Err(_) => Vec::new(),
        };
        if self.matcher.is_stopped() || self.mask.iter().all(|&w| w == 0) {
            self.mask.clear();
            set_bit(&mut self.mask, self.eos);
        } else if let Some((limit, tokens)) = &self.numbers {
            limit.restrict(tokens, &mut self.mask);
        }
        if let Gate::MayThink(channel) = &self.gate {
            if let Some(open) = channel.tokens().id(Marker::ChannelOpen) {
                set_bit(&mut self.mask, open);
            }
        }
        self.ready = true;
    }

    fn allowed(&mut self) -> Option<&[u32]> {
        if let Gate::Thinking(_) = self.gate {
            return None;
        }
        self.prepare();
        Some(&self.mask)
    }

    fn accept(&mut self, token: u32) {
        self.ready = false;
        let gate = std::mem::replace(&mut self.gate, Gate::Enforcing);
        let consumed = match gate {
            Gate::MayThink(mut channel) | Gate::Thinking(mut channel) => {
                let marker = channel.accept(token);
                if channel.in_thought() {
                    self.gate = Gate::Thinking(channel);
                    return;
                }
                // The channel's own close is not part of the answer; any other
                // token that leaves (or never opens) the thought starts it.
                marker != Some(Marker::ChannelClose)
            }
            Gate::Enforcing => true,
        };
        if consumed && !self.matcher.is_stopped() {
            if let Err(e) = self.matcher.consume_token(token) {
                tracing::warn!("the grammar refused a masked token {token}: {e}");
            }
            if let Some((limit, tokens)) = &mut self.numbers {
                limit.accept(tokens, token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/oracle/e-style");
        Arc::new(Tokenizer::from_dir(&dir).expect("fixture tokenizer"))
    }

    /// Greedy decoding of a "model" that always prefers the same wrong tokens,
    /// under a grammar: the output must still match.
    fn run(spec: &GrammarSpec, steps: usize) -> String {
        run_preferring(spec, steps, &|_, _| false)
    }

    /// As [`run`], but tokens for which `first(text so far, token)` holds are
    /// preferred to all others.
    fn run_preferring(
        spec: &GrammarSpec,
        steps: usize,
        first: &dyn Fn(&str, u32) -> bool,
    ) -> String {
        let tok = tokenizer();
        let grammars = Grammars::new(tok.clone()).expect("trie");
        let matcher = grammars.compile(spec, "response_format").expect("compiles");
        let factory = grammars.constraint(matcher, None);
        let mut constraint = (factory.0)();
        let vocab = tok.vocab_size();
        let mut ids = Vec::new();
        for step in 0..steps {
            let allowed = constraint.allowed().expect("enforcing").to_vec();
            // A fixed, arbitrary preference order that changes each step.
            let order =
                (0..vocab as u32).map(|i| (i * 7919 + step as u32 * 104_729) % vocab as u32);
            let is_allowed = |t: &u32| {
                allowed
                    .get(*t as usize / 32)
                    .is_some_and(|w| w & (1 << (t % 32)) != 0)
            };
            let text = tok.decode(&ids, false).expect("decodes");
            let pick = order
                .clone()
                .filter(|&t| first(&text, t))
                .find(is_allowed)
                .or_else(|| order.clone().find(is_allowed))
                .expect("something is allowed");
            if Some(pick) == tok.eos_id() {
                break;
            }
            constraint.accept(pick);
            ids.push(pick);
        }
        tok.decode(&ids, false).expect("decodes")
    }

    #[test]
    fn json_schema_output_is_valid() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["city", "n"],
            "additionalProperties": false
        });
        let text = run(&GrammarSpec::JsonSchema(schema), 200);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v["city"].as_str().is_some_and(|c| c.chars().count() <= 8),
            "{text}"
        );
        assert!(
            v["n"].as_i64().is_some_and(|n| (0..=999).contains(&n)),
            "{text}"
        );
        assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{text}");
    }

    #[test]
    fn an_unbounded_integer_ends_within_sixteen_digits() {
        let tok = tokenizer();
        let id = |digit: &str| {
            (0..tok.vocab_size() as u32)
                .find(|&t| tok.decode(&[t], false).is_ok_and(|s| s == digit))
                .expect("a token for the digit")
        };
        let (one, zero) = (id("1"), id("0"));
        // A model that would write 1 and then zeros for ever (the largest
        // numbers for their length, so a bound that rounds up lets one more digit in).
        let digits = |text: &str, t: u32| {
            let in_number = text.ends_with(|c: char| c.is_ascii_digit());
            t == if in_number { zero } else { one }
        };
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"h": {"type": "integer"}, "xs": {"type": "array", "items": {"type": ["integer", "null"]}, "maxItems": 2}},
            "required": ["h", "xs"],
            "additionalProperties": false
        });
        let text = run_preferring(&GrammarSpec::JsonSchema(schema), 300, &digits);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let limit = INTEGER_LIMIT;
        assert!(v["h"].as_i64().is_some_and(|h| h.abs() <= limit), "{text}");
        assert!(
            v["h"].as_i64().is_some_and(|h| h.abs() > 999),
            "digits were preferred: {text}"
        );
        for x in v["xs"].as_array().expect("xs") {
            assert!(
                x.is_null() || x.as_i64().is_some_and(|x| x.abs() <= limit),
                "{text}"
            );
        }

        // Given bounds and literal values stay as they are.
        let mut given = serde_json::json!({"type": "integer", "maximum": 5,
            "const": {"type": "integer"}, "enum": [{"type": "integer"}]});
        bound_integers(&mut given);
        assert_eq!(given["maximum"], 5);
        assert_eq!(given["minimum"], -INTEGER_LIMIT);
        assert_eq!(given["const"], serde_json::json!({"type": "integer"}));
        assert_eq!(given["enum"][0], serde_json::json!({"type": "integer"}));
    }

    /// The mantissa digits of a number as JSON writes it.
    fn mantissa_digits(number: &str) -> usize {
        let mantissa = number.split(['e', 'E']).next().unwrap_or_default();
        mantissa.bytes().filter(u8::is_ascii_digit).count()
    }

    #[test]
    fn every_number_ends_within_a_doubles_digits() {
        let tok = tokenizer();
        let id = |digit: &str| {
            (0..tok.vocab_size() as u32)
                .find(|&t| tok.decode(&[t], false).is_ok_and(|s| s == digit))
                .expect("a token for the digit")
        };
        let (three, dot) = (id("3"), id("."));
        // A model that writes threes for ever, and a point as soon as it may.
        let threes = |_: &str, t: u32| t == dot || t == three;
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "hours": {"type": "number", "maximum": 8},
                "x": {"type": "number"},
                "step": {"type": "number", "minimum": 0, "multipleOf": 0.125}},
            "required": ["hours", "x", "step"],
            "additionalProperties": false
        });
        let text = run_preferring(&GrammarSpec::JsonSchema(schema.clone()), 400, &threes);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["hours"].as_f64().is_some_and(|h| h <= 8.0), "{text}");
        assert!(v["step"].as_f64().is_some_and(|s| s >= 0.0), "{text}");
        let raw: Vec<&str> = text
            .split(|c: char| !(c.is_ascii_digit() || "-+.eE".contains(c)))
            .filter(|s| s.starts_with(|c: char| c.is_ascii_digit() || c == '-'))
            .collect();
        assert_eq!(raw.len(), 3, "{text}");
        for number in &raw {
            assert!(mantissa_digits(number) <= 17, "{number} in {text}");
        }
        assert!(
            raw.iter().any(|n| mantissa_digits(n) >= 10),
            "threes were preferred: {text}"
        );

        // A user's regex keeps its own digits.
        let long = run_preferring(&GrammarSpec::Regex("[0-9]{30}".into()), 60, &threes);
        assert_eq!(long.len(), 30, "{long}");
    }

    #[test]
    fn choice_and_regex() {
        let text = run(&GrammarSpec::Choice(vec!["yes".into(), "no".into()]), 50);
        assert!(text == "yes" || text == "no", "{text:?}");
        let text = run(&GrammarSpec::Regex("[0-9]{3}-[a-c]+".into()), 50);
        let ok = text.len() >= 5
            && text[..3].bytes().all(|b| b.is_ascii_digit())
            && &text[3..4] == "-"
            && text[4..].bytes().all(|b| (b'a'..=b'c').contains(&b));
        assert!(ok, "{text:?}");
    }

    #[test]
    fn uncompilable_schema_is_a_400_naming_the_problem() {
        let grammars = Grammars::new(tokenizer()).expect("trie");
        let Err(e) = grammars.compile(
            &GrammarSpec::JsonSchema(
                serde_json::json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true}),
            ),
            "response_format",
        ) else {
            panic!("uniqueItems cannot be enforced");
        };
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(e.message.contains("uniqueItems"), "{}", e.message);
        let Err(e) = grammars.compile(&GrammarSpec::Regex("(".into()), "guided_regex") else {
            panic!("a bad regex is refused");
        };
        assert_eq!(e.param.as_deref(), Some("guided_regex"));
    }
}

//! The grammar of a forced Gemma 4 tool call, written in llguidance's Lark
//! dialect from each tool's `parameters` schema.
//!
//! Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,…}<tool_call|>`:
//! bare keys in sorted order (as the chat template writes them), strings
//! between `<|"|>` delimiters taken verbatim, bare numbers, `true`, `false`,
//! `null`, `[…]` and `{…}`. That is JSON with other quoting, so llguidance's
//! JSON compiler cannot write it; this module translates the schema instead,
//! keyword by keyword, and leans on llguidance where the text is JSON's own:
//! numbers are `%json` sub-grammars (any range, exclusive bounds,
//! `multipleOf`), string constraints are regular-expression terminals
//! intersected with `&`. A keyword it cannot enforce is refused, never
//! dropped.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use super::bound_integers;
use super::schema::{self, SchemaError};
use crate::error::ApiError;

/// The token ids of Gemma 4's tool-call markup.
#[derive(Debug, Clone, Copy)]
pub struct CallMarkers {
    pub open: u32,
    pub close: u32,
    pub quote: u32,
    /// `<|tool_response>`: the model ends its calls with it (a stop token).
    pub end: u32,
}

/// Formats a string's `format` may name, with the text each allows: for
/// `ipv6`, `uri` and `duration` a plain subset of what the format allows.
const FORMATS: &[(&str, &str)] = &[
    ("date", DATE),
    ("time", TIME),
    ("date-time", DATE_TIME),
    ("uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    ("ipv4", "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"),
    ("hostname", HOSTNAME),
    ("email", EMAIL),
    ("ipv6", "([0-9a-f]{1,4}:){7}[0-9a-f]{1,4}"),
    ("uri", URI),
    ("duration", DURATION),
];

/// Calendar dates; February stops at the 28th, which every year has.
const DATE: &str = "[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))";
const TIME: &str = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
const DATE_TIME: &str = "[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
/// Host names of at most four labels of at most 40 characters (RFC 1123
/// allows 63 a label and 253 in all).
const HOSTNAME: &str = "[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?){0,3}";
/// Addresses whose local part (at most 50 characters; RFC 5321 allows 64) is
/// dot-separated atoms, at a host name of two to four labels.
const EMAIL: &str = "[A-Za-z0-9_+-]{1,16}(\\.[A-Za-z0-9_+-]{1,16}){0,2}@[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?){1,3}";

/// `scheme://host/path?query#fragment` with unreserved and sub-delimiter
/// characters only (no percent escapes).
const URI: &str = "[a-z][a-z0-9+.-]{0,15}://[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?){0,3}(/[A-Za-z0-9._~!$&'()*+,;=:@-]*){0,8}(\\?[A-Za-z0-9._~!$&'()*+,;=:@/?-]*)?(#[A-Za-z0-9._~!$&'()*+,;=:@/?-]*)?";
/// ISO 8601 durations of weeks, days, or a time part (with days before it).
const DURATION: &str = "P([0-9]{1,4}W|[0-9]{1,4}D|([0-9]{1,4}D)?T([0-9]{1,4}H([0-9]{1,4}M([0-9]{1,4}S)?)?|[0-9]{1,4}M([0-9]{1,4}S)?|[0-9]{1,4}S))";

/// Every `type` a JSON value can have (`integer` is a kind of `number`).
const TYPES: &[&str] = &["string", "number", "boolean", "null", "array", "object"];

/// How deep `$ref`s and `allOf`s may be merged into one another.
const MAX_MERGE_DEPTH: usize = 32;

/// The budget of one request's call grammar. A `$ref` alone is one named
/// rule however often it is used, but one merged into an `allOf` part or
/// beside other keywords is written out again each time, so schemas that
/// nest such merges can multiply; past these limits the request is refused
/// by name rather than let it hold a thread and memory.
/// Subschemas translated, over all tools.
pub const MAX_SUBSCHEMAS: usize = 10_000;
/// Grammar text written, counting each subschema's text once.
pub const MAX_GRAMMAR_BYTES: usize = 4 << 20;
/// Time spent translating.
pub const MAX_TRANSLATION_TIME: Duration = Duration::from_secs(2);

/// A Lark grammar for Gemma 4 tool calls whose arguments follow each tool's
/// `parameters` schema, then `<|tool_response>` after the last call. `only`
/// restricts it to one named tool and one call; otherwise one call up to
/// `max_calls`, the turn free to end after any of them.
pub fn tool_call_grammar(
    tools: &[Value],
    only: Option<&str>,
    max_calls: usize,
    markers: CallMarkers,
) -> Result<String, ApiError> {
    let mut lark = LarkWriter::new(markers.quote);
    let mut calls = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function").unwrap_or(tool);
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            return Err(ApiError::bad_request(format!(
                "`tools[{i}].function.name` must be a string"
            ))
            .with_param(format!("tools[{i}]")));
        };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let param = format!("tools[{i}].function.parameters");
        // A function without `parameters` takes none.
        let none = serde_json::json!({"type": "object", "additionalProperties": false});
        let params = function.get("parameters").unwrap_or(&none);
        let body = lark.arguments(params).map_err(|e| {
            let at = if e.at.is_empty() {
                String::new()
            } else {
                format!(" at `{}`", e.at)
            };
            ApiError::bad_request(format!("`{param}` of tool {name:?}{at}: {}", e.message))
                .with_param(param.clone())
        })?;
        calls.push(format!("{} {body}", literal(&format!("call:{name}"))));
    }
    if calls.is_empty() {
        return Err(ApiError::bad_request(match only {
            Some(name) => format!("`tool_choice` names {name:?}, which is not in `tools`"),
            None => "`tool_choice` \"required\" needs `tools`".into(),
        })
        .with_param("tool_choice"));
    }
    let call = format!(
        "<[{}]> ({}) <[{}]>",
        markers.open,
        calls.join(" | "),
        markers.close
    );
    let start = if only.is_some() || max_calls <= 1 {
        format!("start: {call} <[{}]>", markers.end)
    } else {
        format!("start: ({call}){{1,{max_calls}}} <[{}]>", markers.end)
    };
    let mut out = vec![start];
    // A reference whose target failed leaves its slot empty.
    out.extend(lark.rules.into_iter().filter(|r| !r.is_empty()));
    Ok(out.join("\n"))
}

/// A Lark string literal.
fn literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// A regular expression as a Lark terminal body (`/…/`).
fn slashed(rx: &str) -> String {
    format!("/{}/", rx.replace('/', "\\/"))
}

/// Text that never holds the string delimiter (spelled out by ordinary tokens,
/// it would end the string early for every parser of the call).
const NO_DELIMITER: &str = "~/(?s:.*)<\\|\"\\|>(?s:.*)/";

/// Writes schema fragments as Lark expressions; terminals and named rules
/// accumulate in `rules`.
struct LarkWriter {
    quote: u32,
    rules: Vec<String>,
    /// Rules and terminals already written, by body: each is written once.
    written: HashMap<String, String>,
    /// The schema of the tool being written, for `$ref`.
    root: Value,
    /// The rule of each `$ref` target of the current tool, by pointer, or
    /// why the target cannot be written.
    refs: HashMap<String, Result<String, SchemaError>>,
    /// Subschemas translated so far, against [`MAX_SUBSCHEMAS`].
    subschemas: usize,
    /// Text written so far, against [`MAX_GRAMMAR_BYTES`].
    bytes: usize,
    /// When the translation must have finished.
    deadline: Instant,
}

fn types_of(schema: &Map<String, Value>, at: &str) -> Result<Vec<String>, SchemaError> {
    let mut types: Vec<String> = match schema.get("type") {
        None => TYPES.iter().map(|t| t.to_string()).collect(),
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts
            .iter()
            .map(|t| t.as_str().map(String::from))
            .collect::<Option<_>>()
            .ok_or_else(|| SchemaError::new(at, "`type` must be a string or a list of strings"))?,
        Some(_) => {
            return Err(SchemaError::new(
                at,
                "`type` must be a string or a list of strings",
            ))
        }
    };
    for t in &types {
        if t != "integer" && !TYPES.contains(&t.as_str()) {
            return Err(SchemaError::new(
                at,
                format!("`type` {t:?} is not a JSON type"),
            ));
        }
    }
    if schema.get("nullable") == Some(&Value::Bool(true)) && !types.iter().any(|t| t == "null") {
        types.push("null".into());
    }
    // An integer is a number: `number` alone covers both.
    if types.iter().any(|t| t == "number") {
        types.retain(|t| t != "integer");
    }
    Ok(types)
}

/// Whether a constant has one of the types.
fn has_type(v: &Value, types: &[String]) -> bool {
    let t = match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    types
        .iter()
        .any(|u| u == t || (u == "number" && t == "integer"))
        || (t == "number"
            && types.iter().any(|u| u == "integer")
            && v.as_f64().is_some_and(|f| f.fract() == 0.0))
}

fn usize_of(
    schema: &Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<usize>, SchemaError> {
    match schema.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .or_else(|| {
                v.as_f64()
                    .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                    .map(|f| f as u64)
            })
            .map(|n| Some(n.min(u32::MAX as u64) as usize))
            .ok_or_else(|| SchemaError::new(at, format!("`{key}` must be a non-negative integer"))),
    }
}

impl LarkWriter {
    fn new(quote: u32) -> Self {
        Self {
            quote,
            rules: Vec::new(),
            written: HashMap::new(),
            root: Value::Null,
            refs: HashMap::new(),
            subschemas: 0,
            bytes: 0,
            deadline: Instant::now() + MAX_TRANSLATION_TIME,
        }
    }

    /// Counts one more subschema against the budget.
    fn spend(&mut self, at: &str) -> Result<(), SchemaError> {
        self.subschemas += 1;
        let over = if self.subschemas > MAX_SUBSCHEMAS {
            format!("more than {MAX_SUBSCHEMAS} subschemas")
        } else if self.bytes > MAX_GRAMMAR_BYTES {
            format!("more than {} MiB of grammar", MAX_GRAMMAR_BYTES >> 20)
        } else if Instant::now() > self.deadline {
            format!("more than {} s", MAX_TRANSLATION_TIME.as_secs())
        } else {
            return Ok(());
        };
        Err(SchemaError::new(
            at,
            format!(
                "the tools' schemas take {over} to enforce (the limit); each `$ref` merged into \
                 an `allOf` part or beside other keywords is written out again, so nesting them \
                 multiplies: give shared parts their own `$defs` entry referenced alone"
            ),
        ))
    }

    /// A named rule (lower case) or terminal (upper case) for `body`, written once.
    fn define(&mut self, terminal: bool, body: String) -> String {
        let key = format!("{terminal}{body}");
        if let Some(name) = self.written.get(&key) {
            return name.clone();
        }
        let name = if terminal {
            format!("T{}", self.rules.len())
        } else {
            format!("r{}", self.rules.len())
        };
        self.rules.push(format!("{name}: {body}"));
        self.written.insert(key, name.clone());
        name
    }

    /// The arguments of one tool: its `parameters`, which must describe an object.
    fn arguments(&mut self, params: &Value) -> Result<String, SchemaError> {
        self.root = params.clone();
        self.refs.clear();
        // A `type` that names no JSON type is reported as such, not as "not an object".
        if let Some(obj) = params.as_object() {
            types_of(obj, "")?;
        }
        let object = schema::merge(params, &serde_json::json!({"type": "object"}), "")?;
        self.value(&object, "", 0)
    }

    fn value(&mut self, schema: &Value, at: &str, depth: usize) -> Result<String, SchemaError> {
        self.spend(at)?;
        let text = self.subschema(schema, at, depth)?;
        self.bytes += text.len();
        Ok(text)
    }

    fn subschema(&mut self, schema: &Value, at: &str, depth: usize) -> Result<String, SchemaError> {
        if depth > MAX_MERGE_DEPTH {
            return Err(SchemaError::new(at, "`$ref`s and `allOf`s nest too deep"));
        }
        let obj = match schema {
            Value::Bool(true) => return Ok(self.any()),
            Value::Bool(false) => {
                return Err(SchemaError::unsatisfiable(
                    at,
                    "no value satisfies this schema",
                ))
            }
            Value::Object(o) => o,
            _ => {
                return Err(SchemaError::new(
                    at,
                    "a schema must be an object or a boolean",
                ))
            }
        };
        schema::check_keywords(obj, at)?;
        if let Some(reference) = obj.get("$ref") {
            return self.reference(obj, reference, at, depth);
        }
        if let Some(parts) = obj.get("allOf") {
            let mut rest = obj.clone();
            rest.remove("allOf");
            let Some(parts) = parts.as_array() else {
                return Err(SchemaError::new(at, "`allOf` must be a list of schemas"));
            };
            let mut merged = Value::Object(rest);
            for (i, part) in parts.iter().enumerate() {
                let part = self.inline(part, &format!("{at}/allOf/{i}"), depth)?;
                merged = schema::merge(&merged, &part, at)?;
            }
            return self.value(&merged, at, depth + 1);
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(options) = obj.get(key) {
                return self.alternatives(obj, key, options, at, depth);
            }
        }
        self.typed(obj, at, depth)
    }

    /// A `$ref`: alone, a named rule (so recursive schemas stay finite);
    /// beside other keywords, the target merged with them.
    fn reference(
        &mut self,
        obj: &Map<String, Value>,
        reference: &Value,
        at: &str,
        depth: usize,
    ) -> Result<String, SchemaError> {
        let root = self.root.clone();
        let target = schema::resolve(&root, reference, at)?.clone();
        let constraining = obj
            .keys()
            .any(|k| k != "$ref" && !schema::ANNOTATIONS.contains(&k.as_str()));
        if constraining {
            let mut rest = obj.clone();
            rest.remove("$ref");
            let merged = schema::merge(&target, &Value::Object(rest), at)?;
            return self.value(&merged, at, depth + 1);
        }
        let key = reference.as_str().unwrap_or_default().to_string();
        if let Some(rule) = self.refs.get(&key) {
            return rule.clone();
        }
        let name = format!("ref{}", self.rules.len());
        self.refs.insert(key.clone(), Ok(name.clone()));
        // Reserve the rule's place; its body may refer to it.
        let slot = self.rules.len();
        self.rules.push(String::new());
        // A named rule ends any chain of merges: recursion through it stops
        // at the name, so its body starts a fresh count.
        match self.value(&target, &key, 0) {
            Ok(body) => {
                self.rules[slot] = format!("{name}: {body}");
                Ok(name)
            }
            Err(e) => {
                self.refs.insert(key, Err(e.clone()));
                Err(e)
            }
        }
    }

    /// A schema with any `$ref` at its top replaced by its target (for merging).
    fn inline(&mut self, part: &Value, at: &str, depth: usize) -> Result<Value, SchemaError> {
        let Some(reference) = part.get("$ref") else {
            return Ok(part.clone());
        };
        if depth > MAX_MERGE_DEPTH {
            return Err(SchemaError::new(at, "`$ref`s and `allOf`s nest too deep"));
        }
        let target = schema::resolve(&self.root, reference, at)?.clone();
        let mut rest = part.as_object().cloned().unwrap_or_default();
        rest.remove("$ref");
        let target = self.inline(&target, at, depth + 1)?;
        schema::merge(&target, &Value::Object(rest), at)
    }

    /// `anyOf`/`oneOf`: each option with the keywords beside it, or as it
    /// is when nothing beside it constrains (so a `$ref` option stays one
    /// named rule). A grammar cannot forbid a value two options match, so a
    /// `oneOf` is taken only when no two of its options can (see
    /// [`disjoint`]), where it means what `anyOf` means.
    fn alternatives(
        &mut self,
        obj: &Map<String, Value>,
        key: &str,
        options: &Value,
        at: &str,
        depth: usize,
    ) -> Result<String, SchemaError> {
        let Some(options) = options.as_array().filter(|o| !o.is_empty()) else {
            return Err(SchemaError::new(
                at,
                format!("`{key}` must be a non-empty list of schemas"),
            ));
        };
        if key == "oneOf" {
            self.check_exclusive(options, at, depth)?;
        }
        let mut rest = obj.clone();
        rest.remove(key);
        let constraining = rest
            .keys()
            .any(|k| !schema::ANNOTATIONS.contains(&k.as_str()));
        let rest = Value::Object(rest);
        let mut alts = Vec::new();
        let mut refused = None;
        for (i, option) in options.iter().enumerate() {
            let here = format!("{at}/{key}/{i}");
            let written = if constraining {
                let option = self.inline(option, &here, depth)?;
                let merged = schema::merge(&rest, &option, &here)?;
                self.value(&merged, &here, depth + 1)
            } else {
                self.value(option, &here, depth + 1)
            };
            // An option the other keywords rule out is skipped, not an error.
            match written {
                Ok(alt) => alts.push(alt),
                Err(e) if e.unsatisfiable => refused = Some(e),
                Err(e) => return Err(e),
            }
        }
        if alts.is_empty() {
            return Err(refused.unwrap_or_else(|| {
                SchemaError::unsatisfiable(at, format!("no option of `{key}` can be met"))
            }));
        }
        Ok(format!("({})", alts.join(" | ")))
    }

    /// Refuses a `oneOf` two of whose options might both match a value.
    fn check_exclusive(
        &mut self,
        options: &[Value],
        at: &str,
        depth: usize,
    ) -> Result<(), SchemaError> {
        let mut seen: Vec<Value> = Vec::with_capacity(options.len());
        for (j, option) in options.iter().enumerate() {
            let option = self.inline(option, &format!("{at}/oneOf/{j}"), depth)?;
            if let Some(i) = seen.iter().position(|earlier| !disjoint(earlier, &option)) {
                return Err(SchemaError::new(
                    at,
                    format!(
                        "`oneOf` options {i} and {j} may both match a value, which a grammar cannot \
                         forbid; it is enforced only when its options differ in `type`, in \
                         `const`/`enum`, or in a required property's `const`/`enum` (a \
                         discriminator): use `anyOf` if either may match"
                    ),
                ));
            }
            seen.push(option);
        }
        Ok(())
    }

    /// A schema without combinators: constants, or one alternative per type.
    fn typed(
        &mut self,
        obj: &Map<String, Value>,
        at: &str,
        depth: usize,
    ) -> Result<String, SchemaError> {
        let types = types_of(obj, at)?;
        let constants =
            listed_values(obj).map_err(|()| SchemaError::new(at, "`enum` must be a list"))?;
        if let Some(values) = constants {
            let check = self.sibling_check(obj, at)?;
            let alts: Vec<String> = values
                .iter()
                .filter(|v| has_type(v, &types) && check.as_ref().is_none_or(|c| c.is_valid(v)))
                .map(|v| self.constant(v))
                .collect();
            if alts.is_empty() {
                return Err(SchemaError::unsatisfiable(
                    at,
                    "no value of `enum`/`const` meets the keywords beside it",
                ));
            }
            return Ok(format!("({})", alts.join(" | ")));
        }
        let mut alts = Vec::new();
        for t in &types {
            alts.push(match t.as_str() {
                "string" => self.string(obj, at)?,
                "integer" => self.number(obj, true, at)?,
                "number" => self.number(obj, false, at)?,
                "boolean" => "(\"true\" | \"false\")".into(),
                "null" => "\"null\"".into(),
                "array" => self.array(obj, at, depth)?,
                _ => self.object(obj, at, depth)?,
            });
        }
        if alts.is_empty() {
            return Err(SchemaError::unsatisfiable(
                at,
                if at.is_empty() {
                    "`parameters` must describe an object: Gemma 4 writes a call's arguments as one"
                } else {
                    "`type` allows no value"
                },
            ));
        }
        Ok(format!("({})", alts.join(" | ")))
    }

    /// A validator of the keywords beside `enum`/`const`, which every listed
    /// value must meet too; none when only `type` and annotations are there.
    fn sibling_check(
        &self,
        obj: &Map<String, Value>,
        at: &str,
    ) -> Result<Option<jsonschema::Validator>, SchemaError> {
        let mut siblings: Map<String, Value> = obj
            .iter()
            .filter(|(k, _)| {
                !matches!(k.as_str(), "enum" | "const" | "type" | "nullable")
                    && !schema::ANNOTATIONS.contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if siblings.is_empty() {
            return Ok(None);
        }
        // Merged patterns are a list; each must match.
        if let Some(patterns) = siblings.remove("pattern") {
            let all: Vec<Value> = schema::patterns(&patterns)
                .into_iter()
                .map(|p| serde_json::json!({ "pattern": p }))
                .collect();
            siblings.insert("allOf".into(), Value::Array(all));
        }
        // Local `$ref`s inside the siblings point into the tool's schema.
        for defs in ["$defs", "definitions"] {
            if let Some(d) = self.root.get(defs) {
                siblings.insert(defs.into(), d.clone());
            }
        }
        jsonschema::options()
            .should_validate_formats(true)
            .build(&Value::Object(siblings))
            .map(Some)
            .map_err(|e| {
                SchemaError::new(
                    at,
                    format!("the keywords beside `enum`/`const` cannot be checked: {e}"),
                )
            })
    }

    /// A value written exactly, in the call syntax.
    fn constant(&mut self, v: &Value) -> String {
        match v {
            Value::String(s) => format!("<[{q}]> {} <[{q}]>", literal(s), q = self.quote),
            Value::Array(items) => {
                let inner: Vec<String> = items.iter().map(|i| self.constant(i)).collect();
                format!("\"[\" {} \"]\"", inner.join(" \",\" "))
            }
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort_by(|a, b| template_order(a, b));
                let inner: Vec<String> = keys
                    .into_iter()
                    .map(|k| format!("{} \":\" {}", self.key(k), self.constant(&map[k])))
                    .collect();
                format!("\"{{\" {} \"}}\"", inner.join(" \",\" "))
            }
            other => literal(&other.to_string()),
        }
    }

    /// An object key: bare when the parser reads it back unchanged, else delimited.
    fn key(&self, k: &str) -> String {
        let bare = !k.is_empty()
            && k.chars()
                .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '$' | '@'));
        if bare {
            literal(k)
        } else {
            format!("<[{q}]> {} <[{q}]>", literal(k), q = self.quote)
        }
    }

    /// A string between delimiters, its text held to the length, patterns and format.
    fn string(&mut self, obj: &Map<String, Value>, at: &str) -> Result<String, SchemaError> {
        let min = usize_of(obj, "minLength", at)?.unwrap_or(0);
        let max = usize_of(obj, "maxLength", at)?;
        if max.is_some_and(|m| m < min) {
            return Err(SchemaError::unsatisfiable(
                at,
                "`maxLength` is below `minLength`",
            ));
        }
        let mut parts = vec![match max {
            Some(m) => slashed(&format!("(?s:.{{{},{m}}})", min.max(1))),
            None => slashed(&format!("(?s:.{{{},}})", min.max(1))),
        }];
        let mut empty_ok = min == 0;
        for p in obj.get("pattern").map(schema::patterns).unwrap_or_default() {
            let (rx, matches_empty) = search_regex(&p).map_err(|e| {
                SchemaError::new(at, format!("`pattern` {p:?} cannot be enforced: {e}"))
            })?;
            empty_ok &= matches_empty;
            parts.push(slashed(&rx));
        }
        // A format not listed is an annotation, as JSON Schema has it unless
        // a vocabulary asserts it (Pydantic writes `password`, `binary`, …).
        let format = obj.get("format").and_then(Value::as_str);
        if let Some((_, rx)) = FORMATS.iter().find(|(n, _)| Some(*n) == format) {
            empty_ok = false;
            parts.push(slashed(rx));
        }
        parts.push(NO_DELIMITER.into());
        let text = self.define(true, parts.join(" & "));
        let body = if empty_ok { format!("{text}?") } else { text };
        Ok(format!("<[{q}]> {body} <[{q}]>", q = self.quote))
    }

    /// A number without any bound keyword: JSON's number syntax held to 17
    /// significant digits (what a double holds) and a two-digit exponent, so
    /// a model that keeps writing digits must end it.
    fn bounded_number(&mut self) -> String {
        let mantissa = self.define(
            true,
            r"/0|[1-9][0-9]{0,16}/ | /(0|[1-9][0-9]*)\.[0-9]+/ & /[0-9.]{3,18}/".into(),
        );
        self.define(
            true,
            format!(r#""-"? {mantissa} /([eE][+-]?[0-9]{{1,2}})?/"#),
        )
    }

    /// A number or integer: llguidance's JSON number grammar for the bounds
    /// (the text of a number is the same in both syntaxes). An unbounded
    /// integer stays within ±(2^53 − 1), an unbounded number within 17
    /// significant digits.
    fn number(
        &mut self,
        obj: &Map<String, Value>,
        integer: bool,
        at: &str,
    ) -> Result<String, SchemaError> {
        const BOUNDS: [&str; 5] = [
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
            "multipleOf",
        ];
        if !integer && !BOUNDS.iter().any(|k| obj.contains_key(*k)) {
            return Ok(self.bounded_number());
        }
        let mut s = Map::new();
        s.insert(
            "type".into(),
            (if integer { "integer" } else { "number" }).into(),
        );
        for key in [
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
            "multipleOf",
        ] {
            if let Some(v) = obj.get(key) {
                if !v.is_number() {
                    return Err(SchemaError::new(at, format!("`{key}` must be a number")));
                }
                s.insert(key.into(), v.clone());
            }
        }
        let lo = ["minimum", "exclusiveMinimum"]
            .iter()
            .filter_map(|k| s.get(*k)?.as_f64())
            .fold(f64::MIN, f64::max);
        let hi = ["maximum", "exclusiveMaximum"]
            .iter()
            .filter_map(|k| s.get(*k)?.as_f64())
            .fold(f64::MAX, f64::min);
        if lo > hi {
            return Err(SchemaError::unsatisfiable(
                at,
                "the lower bound is above the upper bound",
            ));
        }
        s.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false}),
        );
        let mut s = Value::Object(s);
        bound_integers(&mut s);
        Ok(self.define(false, format!("%json {s}")))
    }

    /// `[…]`: `prefixItems` in place, then `items`, counted by `minItems`/`maxItems`.
    fn array(
        &mut self,
        obj: &Map<String, Value>,
        at: &str,
        depth: usize,
    ) -> Result<String, SchemaError> {
        let min = usize_of(obj, "minItems", at)?.unwrap_or(0);
        let max = usize_of(obj, "maxItems", at)?;
        if max.is_some_and(|m| m < min) {
            return Err(SchemaError::unsatisfiable(
                at,
                "`maxItems` is below `minItems`",
            ));
        }
        // Draft 4 spells tuples as `items: [...]` with `additionalItems`.
        let (prefix, rest) = match (obj.get("prefixItems"), obj.get("items")) {
            (Some(_), Some(Value::Array(_))) => return Err(SchemaError::new(
                at,
                "`prefixItems` beside a list in `items` mixes two drafts' tuples; give one of them",
            )),
            (_, Some(Value::Array(tuple))) => (tuple.clone(), obj.get("additionalItems").cloned()),
            (Some(Value::Array(p)), items) => (p.clone(), items.cloned()),
            (Some(_), _) => return Err(SchemaError::new(at, "`prefixItems` must be a list")),
            (None, items) => (Vec::new(), items.cloned()),
        };
        let rest = match rest {
            None | Some(Value::Bool(true)) => Some(self.any()),
            Some(Value::Bool(false)) => None,
            // Items no value meets: none past the prefix.
            Some(s) => match self.value(&s, &format!("{at}/items"), depth + 1) {
                Ok(item) => Some(item),
                Err(e) if e.unsatisfiable => None,
                Err(e) => return Err(e),
            },
        };
        let keep = max.map_or(prefix.len(), |m| m.min(prefix.len()));
        let mut elements = Vec::new();
        for (i, p) in prefix.iter().take(keep).enumerate() {
            elements.push(self.value(p, &format!("{at}/prefixItems/{i}"), depth + 1)?);
        }
        if rest.is_none() && min > elements.len() {
            return Err(SchemaError::unsatisfiable(
                at,
                "`minItems` asks for more items than the schema allows",
            ));
        }
        Ok(format!(
            "\"[\" {} \"]\"",
            sequence(&elements, rest.as_deref(), min, max)
        ))
    }

    /// `{…}`: declared properties in sorted order (required ones present),
    /// then any others `patternProperties` or `additionalProperties` allow,
    /// with delimited keys; their number held to `minProperties` and
    /// `maxProperties`.
    fn object(
        &mut self,
        obj: &Map<String, Value>,
        at: &str,
        depth: usize,
    ) -> Result<String, SchemaError> {
        let mut props: Vec<(String, Value)> = obj
            .get("properties")
            .map(|p| {
                p.as_object()
                    .cloned()
                    .ok_or_else(|| SchemaError::new(at, "`properties` must be an object"))
            })
            .transpose()?
            .unwrap_or_default()
            .into_iter()
            .collect();
        let required: Vec<String> = obj
            .get("required")
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let patterns = pattern_properties(obj, at)?;
        // Without `additionalProperties`, an object that declares properties
        // takes only those; one that declares none takes any.
        let extra = match obj.get("additionalProperties") {
            None if props.is_empty() && patterns.is_empty() => Some(Value::Bool(true)),
            None | Some(Value::Bool(false)) => None,
            Some(s) => Some(s.clone()),
        };
        for name in &required {
            if !props.iter().any(|(k, _)| k == name) {
                // A required name a pattern matches takes the pattern's schema.
                let schema = if patterns.iter().any(|p| p.matches(name)) {
                    Value::Object(Map::new())
                } else {
                    match &extra {
                        Some(s) => s.clone(),
                        None => {
                            return Err(SchemaError::unsatisfiable(
                                at,
                                format!("`required` names {name:?}, which no property allows"),
                            ))
                        }
                    }
                };
                props.push((name.clone(), schema));
            }
        }
        props.sort_by(|a, b| template_order(&a.0, &b.0));
        let mut items = Vec::new();
        for (key, sub) in &props {
            let required = required.contains(key);
            // A declared name a pattern matches meets both schemas.
            let mut schema = sub.clone();
            for p in patterns.iter().filter(|p| p.matches(key)) {
                schema = serde_json::json!({"allOf": [schema, p.schema]});
            }
            let value = match self.value(&schema, &format!("{at}/properties/{key}"), depth + 1) {
                Ok(value) => value,
                // A property no value can meet is left out, unless required.
                Err(e) if e.unsatisfiable && !required => continue,
                Err(e) => return Err(e),
            };
            // A named rule: the alternatives below name each item several
            // times, and a nested object's text would otherwise multiply.
            let item = self.define(false, format!("{} \":\" {value}", self.key(key)));
            items.push((item, required));
        }
        let names: Vec<&str> = props.iter().map(|(k, _)| k.as_str()).collect();
        let extra = self.undeclared_entry(&names, &patterns, extra, at, depth)?;
        let count = Count {
            min: usize_of(obj, "minProperties", at)?.unwrap_or(0),
            max: usize_of(obj, "maxProperties", at)?,
        };
        let body = self.counted_properties(&items, extra.as_deref(), count, at)?;
        Ok(format!("\"{{\" {body} \"}}\""))
    }

    /// One property an object does not declare: a key a pattern matches
    /// with that pattern's value (a key two patterns match is left out, as
    /// is a declared name), or any other key with `additionalProperties`'
    /// value. `None` when no such property can be written.
    fn undeclared_entry(
        &mut self,
        declared: &[&str],
        patterns: &[PatternProperty],
        additional: Option<Value>,
        at: &str,
        depth: usize,
    ) -> Result<Option<String>, SchemaError> {
        let key_outside = |own: Option<usize>| {
            let mut key = format!("/(?s:.+)/ & {NO_DELIMITER}");
            if let Some(i) = own {
                key.push_str(&format!(" & {}", slashed(&patterns[i].regex)));
            }
            let mut excluded: Vec<String> =
                declared.iter().map(|k| regex_syntax::escape(k)).collect();
            excluded.extend(
                (0..patterns.len())
                    .filter(|&j| Some(j) != own)
                    .map(|j| format!("(?:{})", patterns[j].regex)),
            );
            if !excluded.is_empty() {
                key.push_str(&format!(
                    " & ~{}",
                    slashed(&format!("({})", excluded.join("|")))
                ));
            }
            key
        };
        let mut keyed: Vec<(String, Value, String)> = patterns
            .iter()
            .enumerate()
            .map(|(i, p)| (key_outside(Some(i)), p.schema.clone(), p.at.clone()))
            .collect();
        if let Some(schema) = additional {
            keyed.push((
                key_outside(None),
                schema,
                format!("{at}/additionalProperties"),
            ));
        }
        let mut alts = Vec::new();
        for (key, schema, here) in keyed {
            let value = match self.value(&schema, &here, depth + 1) {
                Ok(value) => value,
                Err(e) if e.unsatisfiable => continue,
                Err(e) => return Err(e),
            };
            let key = self.define(true, key);
            alts.push(format!(
                "<[{q}]> {key} <[{q}]> \":\" {value}",
                q = self.quote
            ));
        }
        Ok((!alts.is_empty()).then(|| self.define(false, alts.join(" | "))))
    }

    /// The properties between an object's braces: `items` (declared, in
    /// order, each with whether it is required), each present one behind a
    /// comma but the first, then `extra` entries; the number written held to
    /// `count`. A rule per property and number written so far (capped at
    /// `max(min, 1)` when `max` is not given), so the text grows with the
    /// properties times the count, never with their combinations.
    fn counted_properties(
        &mut self,
        items: &[(String, bool)],
        extra: Option<&str>,
        count: Count,
        at: &str,
    ) -> Result<String, SchemaError> {
        let Count { min, max } = count;
        let n = items.len();
        let top = match (max, extra) {
            (Some(m), Some(_)) => m,
            (Some(m), None) => m.min(n),
            (None, _) => min.max(1),
        };
        if (n + 1).saturating_mul(top + 1) > MAX_COUNTED_RULES {
            return Err(SchemaError::new(
                at,
                format!(
                    "`minProperties`/`maxProperties` of {top} over {n} properties take more than \
                     {MAX_COUNTED_RULES} rules to enforce"
                ),
            ));
        }
        // The state after one more property from `c` written.
        let next = |c: usize| {
            if max.is_none() {
                (c + 1).min(top)
            } else {
                c + 1
            }
        };
        let may_write = |c: usize| max.is_none_or(|m| c < m);
        let comma = |c: usize| if c > 0 { "\",\" " } else { "" };
        // `rest[c]`: what may follow with properties `i..` left and `c`
        // written; `None` where the count cannot be met, `""` for nothing.
        let mut rest: Vec<Option<String>> = (0..=top)
            .map(|c| self.undeclared_run(extra, c, min, max, top))
            .collect();
        for (item, required) in items.iter().rev() {
            let mut here = Vec::with_capacity(top + 1);
            for c in 0..=top {
                let after = if may_write(c) {
                    rest[next(c)].as_ref()
                } else {
                    None
                };
                let write = after.map(|a| format!("{}{item} {a}", comma(c)).trim_end().to_string());
                let skip = if *required { None } else { rest[c].clone() };
                here.push(match (write, skip) {
                    (None, None) => None,
                    (Some(w), None) => Some(self.define(false, w)),
                    (None, Some(s)) => Some(s),
                    (Some(w), Some(s)) if s.is_empty() => {
                        Some(self.define(false, format!("({w})?")))
                    }
                    (Some(w), Some(s)) => Some(self.define(false, format!("{w} | {s}"))),
                });
            }
            rest = here;
        }
        rest.swap_remove(0).ok_or_else(|| {
            SchemaError::unsatisfiable(
                at,
                "no set of the properties the schema allows meets `required`, \
                 `minProperties` and `maxProperties`",
            )
        })
    }

    /// The undeclared entries after `c` properties: as many as bring the
    /// count within `min..=max`; `None` when none can.
    fn undeclared_run(
        &mut self,
        extra: Option<&str>,
        c: usize,
        min: usize,
        max: Option<usize>,
        top: usize,
    ) -> Option<String> {
        let Some(e) = extra else {
            return (c >= min).then(String::new);
        };
        // At the cap without a `max`, any number more may follow.
        let lo = if max.is_none() && c == top {
            0
        } else {
            min.saturating_sub(c)
        };
        let hi = max.map(|m| m - c);
        if hi == Some(0) {
            return (lo == 0).then(String::new);
        }
        let text = if c > 0 {
            repeat(&format!("\",\" {e}"), lo, hi)
        } else {
            let more = repeat(
                &format!("\",\" {e}"),
                lo.saturating_sub(1),
                hi.map(|h| h - 1),
            );
            let run = format!("{e} {more}").trim_end().to_string();
            if lo == 0 {
                format!("({run})?")
            } else {
                run
            }
        };
        Some(self.define(false, text))
    }

    /// Any JSON value, in the call syntax.
    fn any(&mut self) -> String {
        if let Some(name) = self.written.get("any") {
            return name.clone();
        }
        let name = "any".to_string();
        self.written.insert("any".into(), name.clone());
        let text = self.define(true, format!("/(?s:.+)/ & {NO_DELIMITER}"));
        let number = self.define(
            false,
            "%json {\"type\": \"number\", \"x-guidance\": {\"whitespace_flexible\": false}}".into(),
        );
        let q = self.quote;
        let string = format!("<[{q}]> {text}? <[{q}]>");
        let entry = format!("{string} \":\" any");
        self.rules.push(format!(
            "any: {string} | {number} | \"true\" | \"false\" | \"null\" | \"[\" (any (\",\" any)*)? \"]\" | \"{{\" ({entry} (\",\" {entry})*)? \"}}\""
        ));
        name
    }
}

/// Bounds on how many properties an object has.
#[derive(Debug, Clone, Copy)]
struct Count {
    min: usize,
    max: Option<usize>,
}

/// The most rules one object's counted properties may take.
const MAX_COUNTED_RULES: usize = 4096;

/// One `patternProperties` entry.
struct PatternProperty {
    /// The pattern as a regular expression of the whole key (a search).
    regex: String,
    matcher: regex::Regex,
    schema: Value,
    /// Where its schema is, for errors.
    at: String,
}

impl PatternProperty {
    fn matches(&self, key: &str) -> bool {
        self.matcher.is_match(key)
    }
}

/// An object's `patternProperties`, each pattern read as JSON Schema reads
/// it (a search).
fn pattern_properties(
    obj: &Map<String, Value>,
    at: &str,
) -> Result<Vec<PatternProperty>, SchemaError> {
    let Some(given) = obj.get("patternProperties") else {
        return Ok(Vec::new());
    };
    let Some(given) = given.as_object() else {
        return Err(SchemaError::new(
            at,
            "`patternProperties` must be an object",
        ));
    };
    given
        .iter()
        .map(|(pattern, schema)| {
            let here = format!("{at}/patternProperties/{pattern}");
            let (regex, _) = search_regex(pattern).map_err(|e| {
                SchemaError::new(
                    at,
                    format!("`patternProperties` {pattern:?} cannot be enforced: {e}"),
                )
            })?;
            let matcher = regex::Regex::new(&format!("^(?:{regex})$")).map_err(|e| {
                SchemaError::new(
                    at,
                    format!("`patternProperties` {pattern:?} cannot be enforced: {e}"),
                )
            })?;
            Ok(PatternProperty {
                regex,
                matcher,
                schema: schema.clone(),
                at: here,
            })
        })
        .collect()
}

/// The values `const` or `enum` allows, if either is there; `Err` for an
/// `enum` that is not a list.
fn listed_values(obj: &Map<String, Value>) -> Result<Option<Vec<Value>>, ()> {
    match (obj.get("const"), obj.get("enum")) {
        (Some(c), _) => Ok(Some(vec![c.clone()])),
        (None, Some(Value::Array(values))) => Ok(Some(values.clone())),
        (None, Some(_)) => Err(()),
        (None, None) => Ok(None),
    }
}

/// Whether no value can match both schemas, as far as their `type`s, their
/// `const`/`enum` values, one required property's values or their `allOf`
/// parts show.
fn disjoint(a: &Value, b: &Value) -> bool {
    let (Some(oa), Some(ob)) = (a.as_object(), b.as_object()) else {
        return false;
    };
    // A schema is within each of its `allOf` parts: one part apart is enough.
    let parts = |o: &Map<String, Value>| o.get("allOf").and_then(Value::as_array).cloned();
    if parts(oa).is_some_and(|ps| ps.iter().any(|p| disjoint(p, b)))
        || parts(ob).is_some_and(|ps| ps.iter().any(|p| disjoint(a, p)))
    {
        return true;
    }
    let (a, b) = (oa, ob);
    let values = |o: &Map<String, Value>| listed_values(o).ok().flatten();
    let apart = |x: Option<Vec<Value>>, y: Option<Vec<Value>>| match (x, y) {
        (Some(x), Some(y)) => x.iter().all(|v| !y.contains(v)),
        _ => false,
    };
    if let (Ok(ta), Ok(tb)) = (types_of(a, ""), types_of(b, "")) {
        let meet = |t: &String, u: &String| {
            t == u || (t == "integer" && u == "number") || (t == "number" && u == "integer")
        };
        if !ta.iter().any(|t| tb.iter().any(|u| meet(t, u))) {
            return true;
        }
    }
    if apart(values(a), values(b)) {
        return true;
    }
    let required = |o: &Map<String, Value>, name: &str| {
        o.get("required")
            .and_then(Value::as_array)
            .is_some_and(|r| r.iter().any(|n| n == name))
    };
    let properties =
        |o: &Map<String, Value>| o.get("properties").and_then(Value::as_object).cloned();
    let (Some(pa), Some(pb)) = (properties(a), properties(b)) else {
        return false;
    };
    pa.iter().any(|(name, sa)| {
        let both = required(a, name) && required(b, name);
        let sb = pb.get(name).and_then(Value::as_object);
        both && sa
            .as_object()
            .zip(sb)
            .is_some_and(|(x, y)| apart(values(x), values(y)))
    })
}

/// The order the chat template writes an object's keys in: Jinja's
/// `dictsort`, which compares them without case (ties in byte order).
fn template_order(a: &str, b: &str) -> std::cmp::Ordering {
    a.to_lowercase()
        .cmp(&b.to_lowercase())
        .then_with(|| a.cmp(b))
}

/// Comma-separated elements: `prefix` in place, then `rest` repeated, between
/// `min` and `max` elements in all.
fn sequence(prefix: &[String], rest: Option<&str>, min: usize, max: Option<usize>) -> String {
    let k = prefix.len();
    if k == 0 {
        let Some(r) = rest else { return String::new() };
        if max == Some(0) {
            return String::new();
        }
        let more = repeat(
            &format!("\",\" {r}"),
            min.saturating_sub(1),
            max.map(|m| m - 1),
        );
        let items = format!("{r} {more}");
        return if min == 0 {
            format!("({items})?")
        } else {
            items
        };
    }
    let mut tail = match rest {
        Some(r) if max.is_none_or(|m| m > k) => repeat(
            &format!("\",\" {r}"),
            min.saturating_sub(k),
            max.map(|m| m - k),
        ),
        _ => String::new(),
    };
    for i in (0..k).rev() {
        let element = if i == 0 {
            prefix[0].clone()
        } else {
            format!("\",\" {}", prefix[i])
        };
        tail = if i < min {
            format!("{element} {tail}")
        } else {
            format!("({element} {tail})?")
        };
    }
    tail
}

/// `item` repeated between `lo` and `hi` (unbounded: `None`) times.
fn repeat(item: &str, lo: usize, hi: Option<usize>) -> String {
    match hi {
        Some(0) => String::new(),
        Some(h) if lo == 0 => format!("({item}){{0,{h}}}"),
        Some(h) => format!("({item}){{{lo},{h}}}"),
        None if lo == 0 => format!("({item})*"),
        None => format!("({item}){{{lo},}}"),
    }
}

/// A JSON-Schema `pattern` (an unanchored search, ECMA-262 `\d` and `\w`) as a
/// regular expression over the whole text, and whether the empty text matches.
fn search_regex(pattern: &str) -> Result<(String, bool), String> {
    use regex_syntax::hir::{Hir, HirKind, Look};
    let ascii = llguidance::regex_to_lark(pattern, "dw").replace("\\/", "/");
    let hir = regex_syntax::Parser::new()
        .parse(&ascii)
        .map_err(|e| e.to_string())?;
    let branches: Vec<Hir> = match hir.kind() {
        HirKind::Alternation(bs) => bs.clone(),
        _ => vec![hir],
    };
    let mut out = Vec::new();
    let mut empty = false;
    for branch in branches {
        let mut parts: Vec<Hir> = match branch.kind() {
            HirKind::Concat(ps) => ps.clone(),
            _ => vec![branch.clone()],
        };
        let is = |h: Option<&Hir>, looks: &[Look]| {
            h.is_some_and(|h| matches!(h.kind(), HirKind::Look(l) if looks.contains(l)))
        };
        let starts = is(parts.first(), &[Look::Start, Look::StartLF]);
        if starts {
            parts.remove(0);
        }
        let ends = is(parts.last(), &[Look::End, Look::EndLF]);
        if ends {
            parts.pop();
        }
        let core = Hir::concat(parts);
        if !core.properties().look_set().is_empty() {
            return Err("only a leading `^` and a trailing `$` can anchor it".into());
        }
        // Without inner anchors, a part that may be empty matches the empty text.
        empty |= core.properties().minimum_len() == Some(0);
        let core = core.to_string();
        out.push(format!(
            "{}(?:{core}){}",
            if starts { "" } else { "(?s:.*)" },
            if ends { "" } else { "(?s:.*)" }
        ));
    }
    Ok((out.join("|"), empty))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, OnceLock};

    use gemma4_text::{AssistantMessage, ProtocolTokens, Reading, RequestOutput, Tokenizer};
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;
    use serde_json::json;

    use super::*;
    use crate::grammar::{GrammarSpec, Grammars};

    struct Fixture {
        tok: Arc<Tokenizer>,
        grammars: Grammars,
        markers: CallMarkers,
    }

    fn fixture() -> &'static Fixture {
        static FIXTURE: OnceLock<Fixture> = OnceLock::new();
        FIXTURE.get_or_init(|| {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/oracle/e-style");
            let tok = Arc::new(Tokenizer::from_dir(&dir).expect("fixture tokenizer"));
            let id = |t: &str| tok.token_to_id(t).expect("marker in vocabulary");
            let markers = CallMarkers {
                open: id("<|tool_call>"),
                close: id("<tool_call|>"),
                quote: id("<|\"|>"),
                end: id("<|tool_response>"),
            };
            let grammars = Grammars::new(tok.clone()).expect("trie");
            Fixture {
                tok,
                grammars,
                markers,
            }
        })
    }

    fn tool(name: &str, parameters: Value) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": parameters}})
    }

    /// Calls written under the grammar by a "model" that draws each token at
    /// random among those the mask allows, read back by the output parser.
    fn forced_calls(tools: &[Value], only: Option<&str>, seed: u64) -> (String, AssistantMessage) {
        forced_calls_preferring(tools, only, seed, &|_| false)
    }

    /// As [`forced_calls`], by a model that takes a token whose text
    /// `prefer` accepts whenever the mask allows one.
    fn forced_calls_preferring(
        tools: &[Value],
        only: Option<&str>,
        seed: u64,
        prefer: &dyn Fn(&str) -> bool,
    ) -> (String, AssistantMessage) {
        let f = fixture();
        let lark = tool_call_grammar(tools, only, 16, f.markers)
            .unwrap_or_else(|e| panic!("{}", e.message));
        let matcher = f
            .grammars
            .compile(
                &GrammarSpec::ToolCalls {
                    lark: lark.clone(),
                    quote: f.markers.quote,
                },
                "tool_choice",
            )
            .unwrap_or_else(|e| panic!("{lark}: {}", e.message));
        let mut constraint = (f.grammars.constraint(matcher, None).0)();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut ids = Vec::new();
        let mut ended = false;
        for _ in 0..3000 {
            let mask = constraint.allowed().expect("enforcing").to_vec();
            let allowed: Vec<u32> = (0..mask.len() as u32 * 32)
                .filter(|t| mask[*t as usize / 32] & (1 << (t % 32)) != 0)
                .collect();
            assert!(!allowed.is_empty(), "nothing allowed after {ids:?}");
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // A model that closes an open string one time in four, so that
            // unbounded strings (keys of additional properties) end.
            let preferred = allowed
                .iter()
                .copied()
                .find(|&t| prefer(&f.tok.decode(&[t], false).unwrap_or_default()));
            let pick = if let Some(t) = preferred {
                t
            } else if state.is_multiple_of(4) && allowed.contains(&f.markers.quote) {
                f.markers.quote
            } else {
                allowed[(state / 4 % allowed.len() as u64) as usize]
            };
            if Some(pick) == f.tok.eos_id() || pick == f.markers.end {
                ended = true;
                break;
            }
            constraint.accept(pick);
            ids.push(pick);
        }
        let text = f.tok.decode(&ids, false).expect("decodes");
        assert!(ended, "the calls never ended: {text}");
        let reading = Reading::Chat {
            call_id_prefix: "c".into(),
        };
        let protocol = ProtocolTokens::new(&f.tok);
        let mut output = RequestOutput::new(f.tok.clone(), protocol, &[], &[], &reading);
        let mut events = Vec::new();
        for &i in &ids {
            events.extend(output.push(i).expect("push").events);
        }
        events.extend(output.finish().expect("finish").events);
        (text, AssistantMessage::from_events(&events))
    }

    #[test]
    fn a_number_ends_however_long_the_model_writes_digits() {
        let tools = [tool(
            "f",
            json!({"type": "object", "properties": {
                "x": {"type": "number"},
                "h": {"type": "number", "maximum": 8},
                "s": {"type": "number", "minimum": 0, "multipleOf": 0.125}},
                "required": ["x", "h", "s"]}),
        )];
        // Digits, and a point as soon as one may come.
        let digits = |t: &str| t == "." || (!t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()));
        for seed in 0..4 {
            let (text, turn) = forced_calls_preferring(&tools, None, seed, &digits);
            let call = turn
                .tool_calls
                .first()
                .unwrap_or_else(|| panic!("no call: {text}"));
            assert!(call.complete, "{text}");
            let args: Value = serde_json::from_str(&call.arguments).expect("JSON arguments");
            assert!(args["h"].as_f64().is_some_and(|h| h <= 8.0), "{text}");
            // The numbers as written (the parsed values drop trailing zeros).
            let written = text
                .split(|c: char| !(c.is_ascii_digit() || "-+.eE".contains(c)))
                .filter(|s| s.starts_with(|c: char| c.is_ascii_digit() || c == '-'));
            let mut longest = 0;
            for n in written {
                let significant = n
                    .split(['e', 'E'])
                    .next()
                    .unwrap_or_default()
                    .bytes()
                    .filter(u8::is_ascii_digit)
                    .count();
                assert!(significant <= 17, "{n} in {text}");
                longest = longest.max(significant);
            }
            assert!(longest >= 10, "digits were preferred: {text}");
        }
    }

    /// Every call is complete, names a tool, and its arguments validate.
    fn check_calls(tools: &[Value], only: Option<&str>, seed: u64) -> Result<(), String> {
        let (text, turn) = forced_calls(tools, only, seed);
        if turn.tool_calls.is_empty() {
            return Err(format!("no call in {text}"));
        }
        for call in &turn.tool_calls {
            let Some(tool) = tools
                .iter()
                .find(|t| t["function"]["name"] == call.name.as_str())
            else {
                return Err(format!("unknown tool {:?} in {text}", call.name));
            };
            if only.is_some_and(|o| o != call.name) || !call.complete {
                return Err(format!("{call:?} in {text}"));
            }
            let args: Value = serde_json::from_str(&call.arguments)
                .map_err(|e| format!("{}: {e} ({text})", call.arguments))?;
            let schema = &tool["function"]["parameters"];
            let validator = jsonschema::options()
                .should_validate_formats(true)
                .build(schema)
                .map_err(|e| format!("the test's schema {schema}: {e}"))?;
            let first = validator.iter_errors(&args).next().map(|e| e.to_string());
            if let Some(e) = first {
                return Err(format!("{args} breaks {schema}: {e} (from {text})"));
            }
        }
        Ok(())
    }

    #[test]
    fn the_reported_schemas_hold() {
        let tools = [
            tool(
                "set_budget",
                json!({"type": "object", "properties": {
                "amount": {"type": "integer", "minimum": 0, "maximum": 100_000},
                "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.125}},
                "required": ["amount", "ratio"]}),
            ),
            tool(
                "tag",
                json!({"type": "object", "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "kind": {"type": ["string", "null"], "maxLength": 3},
                "when": {"type": "string", "format": "date"}},
                "required": ["tags", "code", "kind", "when"], "additionalProperties": false}),
            ),
        ];
        for seed in 0..12 {
            check_calls(&tools, None, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            check_calls(&tools, Some("tag"), seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
    }

    #[test]
    fn every_format_validates() {
        for (format, _) in FORMATS {
            let tools = [tool(
                "f",
                json!({"type": "object", "properties": {
                "v": {"type": "string", "format": format}}, "required": ["v"]}),
            )];
            for seed in 0..8 {
                check_calls(&tools, None, seed)
                    .unwrap_or_else(|e| panic!("{format}, seed {seed}: {e}"));
            }
        }
    }

    #[test]
    fn references_combinators_and_recursion_hold() {
        let tools = [tool(
            "plan",
            json!({
                "$defs": {
                    "step": {"type": "object", "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 9},
                        "then": {"type": "array", "items": {"$ref": "#/$defs/step"}, "maxItems": 1}},
                        "required": ["id"], "additionalProperties": false},
                    "named": {"properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}
                },
                "allOf": [
                    {"$ref": "#/$defs/named"},
                    {"properties": {"first": {"$ref": "#/$defs/step"},
                                    "mode": {"anyOf": [{"const": "fast"}, {"type": "integer", "minimum": 5, "maximum": 6}]},
                                    "pair": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, "x", null]}], "items": false, "minItems": 2},
                                    "note x": {"type": "string", "maxLength": 3},
                                    "extra": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 3}, "maxProperties": 9}},
                     "required": ["first", "mode", "pair"]}
                ]
            }),
        )];
        for seed in 0..16 {
            check_calls(&tools, Some("plan"), seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
    }

    #[test]
    fn property_counts_and_patterns_hold() {
        let tools = [
            tool(
                "tag",
                json!({"type": "object",
                    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "b": {"type": "boolean"}, "c": {"type": "null"}},
                    "patternProperties": {"^x_": {"type": "integer", "minimum": 0, "maximum": 3},
                                          "_n$": {"type": "null"}},
                    "additionalProperties": {"type": "boolean"},
                    "minProperties": 2, "maxProperties": 3}),
            ),
            tool(
                "pick",
                json!({"type": "object",
                    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "b": {"type": "boolean"}, "x_1": {"type": "integer"}},
                    "patternProperties": {"^x_": {"maximum": 2}},
                    "additionalProperties": false,
                    "required": ["x_1"], "minProperties": 2}),
            ),
            tool(
                "open",
                json!({"type": "object", "patternProperties": {"^[a-z]+$": {"type": "string", "maxLength": 2}},
                       "additionalProperties": false, "minProperties": 1}),
            ),
        ];
        for seed in 0..24 {
            check_calls(&tools, None, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
        // A count the properties cannot meet is refused, not a grammar that never ends.
        let too_few = [tool(
            "t",
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": false, "minProperties": 2}),
        )];
        let e = tool_call_grammar(&too_few, None, 16, fixture().markers).expect_err("unmeetable");
        assert!(e.message.contains("minProperties"), "{}", e.message);
        let too_many = [tool(
            "t",
            json!({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1}),
        )];
        let e = tool_call_grammar(&too_many, None, 16, fixture().markers).expect_err("unmeetable");
        assert!(e.message.contains("maxProperties"), "{}", e.message);
    }

    /// Every keyword that cannot be enforced is a 400 naming the keyword,
    /// the tool and the field.
    /// `$defs` where each level offers `width` alternatives of the one
    /// below, `beside` added at every level (the first stands alone).
    fn chain(depth: usize, width: usize, beside: Value) -> Value {
        let mut defs = Map::new();
        defs.insert(
            "d0".into(),
            json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
        );
        for i in 1..=depth {
            let mut level = beside.as_object().cloned().unwrap_or_default();
            let option = json!({"$ref": format!("#/$defs/d{}", i - 1)});
            level.insert("anyOf".into(), Value::Array(vec![option; width]));
            defs.insert(format!("d{i}"), Value::Object(level));
        }
        json!({"$defs": defs, "type": "object",
            "properties": {"v": {"$ref": format!("#/$defs/d{depth}")}}, "required": ["v"]})
    }

    #[test]
    fn references_offered_as_alternatives_stay_one_rule_each() {
        // Alone, each `$ref` is a rule: 4^30 expansions become 30 rules.
        let started = Instant::now();
        let tools = [tool(
            "deep",
            chain(30, 4, json!({"description": "a level"})),
        )];
        let lark = tool_call_grammar(&tools, None, 16, fixture().markers)
            .unwrap_or_else(|e| panic!("{}", e.message));
        assert!(lark.len() < 20_000, "{} bytes", lark.len());
        assert!(started.elapsed() < Duration::from_secs(1));
        for seed in 0..4 {
            check_calls(&tools, None, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
    }

    #[test]
    fn schemas_over_the_budget_are_refused_by_name() {
        // Beside a constraining keyword each option is merged and written
        // out again: 4^12 subschemas, refused at the limit, in good time.
        let started = Instant::now();
        let tools = [tool("deep", chain(12, 4, json!({"type": "object"})))];
        let e =
            tool_call_grammar(&tools, None, 16, fixture().markers).expect_err("over the budget");
        assert!(
            e.message
                .contains(&format!("more than {MAX_SUBSCHEMAS} subschemas")),
            "{}",
            e.message
        );
        assert!(
            e.message.contains("tools[0].function.parameters"),
            "{}",
            e.message
        );
        assert!(
            started.elapsed() < MAX_TRANSLATION_TIME,
            "{:?}",
            started.elapsed()
        );
        // The same shape a few levels deep is within it, and holds.
        let tools = [tool("shallow", chain(3, 4, json!({"type": "object"})))];
        for seed in 0..4 {
            check_calls(&tools, None, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
    }

    #[test]
    fn many_optional_properties_grow_the_grammar_linearly() {
        let size = |n: usize| {
            let props: Map<String, Value> = (0..n)
                .map(|i| (format!("p{i:03}"), json!({"type": "boolean"})))
                .collect();
            let tools = [tool("wide", json!({"type": "object", "properties": props}))];
            tool_call_grammar(&tools, None, 16, fixture().markers)
                .unwrap_or_else(|e| panic!("{}", e.message))
                .len()
        };
        let (small, large) = (size(100), size(400));
        assert!(
            large < small * 5,
            "100 properties: {small} bytes, 400: {large}"
        );
        let props: Map<String, Value> = (0..12)
            .map(|i| (format!("p{i:02}"), json!({"type": "integer", "minimum": i})))
            .collect();
        let tools = [tool(
            "some",
            json!({"type": "object", "properties": props, "required": ["p05", "p09"]}),
        )];
        for seed in 0..12 {
            check_calls(&tools, None, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
    }

    #[test]
    fn combined_keywords_hold_together() {
        let tools = [
            // A closed `allOf` part keeps another part's property out.
            tool(
                "closed",
                json!({"allOf": [
                    {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "additionalProperties": false},
                    {"properties": {"b": {"type": "boolean"}}}
                ], "required": ["a"]}),
            ),
            // `enum`/`const` values meet the keywords beside them.
            tool(
                "short",
                json!({"type": "object", "properties": {
                    "e": {"enum": ["ab", "abcdefgh", 7], "maxLength": 3},
                    "c": {"const": "2024-02-30", "format": "date"},
                    "d": {"type": "string", "enum": ["2024-02-28", "2024-02-30"], "format": "date"}},
                    "required": ["e", "d"]}),
            ),
            // A discriminated `oneOf`, as Pydantic writes it.
            tool(
                "pet",
                json!({"$defs": {
                    "cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "lives"]},
                    "dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}}, "required": ["kind"]}},
                    "type": "object",
                    "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
                                           "discriminator": {"propertyName": "kind"}},
                                   "n": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 2}, {"type": "null"}]}},
                    "required": ["pet", "n"]}),
            ),
            // Formats not listed are annotations.
            tool(
                "secret",
                json!({"type": "object", "properties": {
                    "password": {"type": "string", "format": "password", "maxLength": 8},
                    "id": {"type": "string", "format": "uuid4"},
                    "blob": {"type": "string", "format": "binary", "maxLength": 4}},
                    "required": ["password", "id"]}),
            ),
        ];
        for seed in 0..16 {
            check_calls(&tools, None, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
        // The `const` that no date can be leaves "c" out; with it required
        // no call can be made.
        let mut never = tools[1].clone();
        never["function"]["parameters"]["required"] = json!(["c"]);
        let e = tool_call_grammar(&[never], None, 16, fixture().markers).expect_err("no call");
        assert!(e.message.contains("beside"), "{}", e.message);
    }

    #[test]
    fn overlapping_one_of_options_are_refused() {
        let tools = [tool(
            "t",
            json!({"type": "object", "properties": {
                "v": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}}}),
        )];
        let e = tool_call_grammar(&tools, None, 16, fixture().markers).expect_err("overlap");
        assert!(
            e.message.contains("`oneOf` options 0 and 1"),
            "{}",
            e.message
        );
        assert!(e.message.contains("/properties/v"), "{}", e.message);
    }

    #[test]
    fn keys_come_in_the_templates_order() {
        let tools = [tool(
            "t",
            json!({"type": "object", "properties": {
                "b": {"const": 1}, "A": {"const": 2}, "C": {"const": 3}, "a": {"const": 4}},
                "required": ["a", "A", "b", "C"]}),
        )];
        // `dictsort`: without case, ties in byte order.
        let (text, _) = forced_calls(&tools, None, 0);
        assert!(text.contains("{A:2,a:4,b:1,C:3}"), "{text}");
    }

    #[test]
    fn required_calls_stop_at_the_limit() {
        let f = fixture();
        let tools = [tool(
            "ping",
            json!({"type": "object", "properties": {}, "additionalProperties": false}),
        )];
        let lark = tool_call_grammar(&tools, None, 3, f.markers).expect("grammar");
        let mut constraint = (f
            .grammars
            .constraint(
                f.grammars
                    .compile(&GrammarSpec::Lark(lark), "tool_choice")
                    .expect("compiles"),
                None,
            )
            .0)();
        let allowed = |c: &mut Box<dyn gemma4_engine::TokenConstraint>, id: u32| {
            let mask = c.allowed().expect("enforcing");
            mask[id as usize / 32] & (1 << (id % 32)) != 0
        };
        // Three calls in a row, each followed by a free choice to end or go on.
        let call = f.tok.encode("call:ping{}", false).expect("tokens");
        for n in 1..=3 {
            assert!(
                allowed(&mut constraint, f.markers.open),
                "call {n} may open"
            );
            constraint.accept(f.markers.open);
            for &id in &call {
                assert!(allowed(&mut constraint, id), "call {n}: token {id}");
                constraint.accept(id);
            }
            assert!(allowed(&mut constraint, f.markers.close));
            constraint.accept(f.markers.close);
            assert!(
                allowed(&mut constraint, f.markers.end),
                "the turn may end after {n}"
            );
        }
        assert!(!allowed(&mut constraint, f.markers.open), "a fourth call");
    }

    #[test]
    fn what_cannot_be_enforced_is_refused_by_name() {
        let cases = [
            (
                json!({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": true}}}),
                "uniqueItems",
            ),
            (
                json!({"type": "object", "properties": {"s": {"type": "string", "pattern": "\\bword"}}}),
                "pattern",
            ),
            (
                json!({"type": "object", "properties": {"t": {"type": "array", "prefixItems": [{}], "items": [{}]}}}),
                "prefixItems",
            ),
            (
                json!({"type": "object", "properties": {"s": {"$ref": "other.json#/x"}}}),
                "$ref",
            ),
            (
                json!({"type": "object", "properties": {"s": {"not": {"type": "string"}}}}),
                "not",
            ),
            (
                json!({"type": "object", "allOf": [{"patternProperties": {"^x": {}}}, {"additionalProperties": false}]}),
                "patternProperties",
            ),
            (
                json!({"type": "object", "patternProperties": {"(?=x)": {}}}),
                "patternProperties",
            ),
            (json!({"type": "string"}), "must describe an object"),
            (json!({"type": "OBJECT"}), "\"OBJECT\" is not a JSON type"),
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}),
                "lower bound",
            ),
        ];
        for (schema, word) in cases {
            let tools = [tool("ok", json!({})), tool("t", schema.clone())];
            let e = tool_call_grammar(&tools, None, 16, fixture().markers)
                .expect_err(&format!("{schema} is refused"));
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.param.as_deref(), Some("tools[1].function.parameters"));
            assert!(
                e.message.contains(word) && e.message.contains("\"t\""),
                "{word}: {}",
                e.message
            );
            // Naming another tool leaves the refused one out.
            assert!(tool_call_grammar(&tools, Some("ok"), 16, fixture().markers).is_ok());
        }
    }

    #[test]
    fn patterns_search_unless_anchored() {
        let whole = |pattern: &str, text: &str| {
            let (rx, _) = search_regex(pattern).expect("compiles");
            regex::Regex::new(&format!("^(?:{rx})$"))
                .expect("a regex")
                .is_match(text)
        };
        assert!(whole("^a\\d$", "a7"));
        assert!(!whole("^a\\d$", "xa7"));
        assert!(!whole("^a\\d$", "a٣"), "\\d is ASCII, as in ECMA-262");
        assert!(whole("^a", "abc") && !whole("^a", "ba"));
        assert!(whole("c$", "abc") && !whole("c$", "cb"));
        assert!(whole("x|^y", "axb") && whole("x|^y", "yb") && !whole("x|^y", "by"));
        assert!(whole("a/b", "-a/b-"));
        assert!(!search_regex("^a+$").expect("compiles").1);
        assert!(search_regex("a*").expect("compiles").1);
        assert!(search_regex("a\\bc").is_err());
        assert!(search_regex("(").is_err());
    }

    const KEYS: &[&str] = &["a", "b", "city", "x y", "n:1", "_id"];

    /// Schemas a random model can finish: strings, arrays and unbounded
    /// numbers kept short.
    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            (0u64..3, 1u64..6).prop_map(|(lo, span)| json!({"type": "string", "minLength": lo, "maxLength": lo + span})),
            prop::sample::select(vec!["^[a-z]{1,4}$", "^[0-9]{2}-[A-F]$", "^(red|green|blue)$", "q"])
                .prop_map(|p| json!({"type": "string", "pattern": p, "maxLength": 6})),
            prop::sample::select(vec!["date", "time", "date-time", "uuid", "ipv4", "email", "hostname", "uri", "duration", "ipv6"])
                .prop_map(|f| json!({"type": "string", "format": f})),
            (-1_000_000i64..1_000_000, 0i64..1_000_000_000)
                .prop_map(|(lo, span)| json!({"type": "integer", "minimum": lo, "maximum": lo + span})),
            (-50i64..50, 1i64..50).prop_map(|(lo, span)| json!({"type": "integer", "exclusiveMinimum": lo, "exclusiveMaximum": lo + span + 1})),
            (-8i64..8, 1i64..16).prop_map(|(lo, span)| json!({"type": "number", "minimum": lo, "maximum": lo + span, "multipleOf": 0.5})),
            Just(json!({"type": "boolean"})),
            Just(json!({"type": "null"})),
            Just(json!({"type": ["string", "null"], "maxLength": 3})),
            Just(json!({"enum": ["x", 2, true, null, [1], {"k": "v"}]})),
            Just(json!({"const": "fixed"})),
        ]
    }

    fn schema() -> BoxedStrategy<Value> {
        leaf().prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                (inner.clone(), 0u64..2, 0u64..3).prop_map(|(items, lo, span)| json!({"type": "array", "items": items, "minItems": lo, "maxItems": lo + span})),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| json!({"type": "array", "prefixItems": [a, b], "items": false})),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| json!({"anyOf": [a, b]})),
                // Every part merged with itself holds what the part holds.
                inner.clone().prop_map(|a| json!({"allOf": [a.clone(), a, {"description": "twice"}]})),
                // Options apart by type, and a discriminated union.
                (0i64..5).prop_map(|hi| json!({"oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": hi}, {"type": "null"}]})),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| json!({"oneOf": [
                    {"type": "object", "properties": {"kind": {"const": "a"}, "x": a}, "required": ["kind"]},
                    {"type": "object", "properties": {"kind": {"const": "b"}, "y": b}, "required": ["kind", "y"]}]})),
                object(inner),
            ]
        })
        .boxed()
    }

    fn object(inner: impl Strategy<Value = Value> + Clone) -> impl Strategy<Value = Value> {
        (
            prop::collection::btree_map(prop::sample::select(KEYS), inner, 0..4),
            any::<u8>(),
            any::<bool>(),
        )
            .prop_map(|(props, required_bits, closed)| {
                let required: Vec<&str> = props
                    .keys()
                    .enumerate()
                    .filter(|(i, _)| required_bits & (1 << i) != 0)
                    .map(|(_, k)| *k)
                    .collect();
                let mut o = json!({"type": "object", "properties": props, "required": required});
                if closed || o["properties"].as_object().is_some_and(|p| p.is_empty()) {
                    o["additionalProperties"] = json!(false);
                } else if required_bits & 0x80 != 0 {
                    o["additionalProperties"] =
                        json!({"type": "integer", "minimum": 0, "maximum": 9});
                }
                o
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 96,
            failure_persistence: None,
            rng_seed: RngSeed::Fixed(39),
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_schemas_give_valid_calls(mut params in object(schema()), shared in schema(), seed in any::<u64>()) {
            // A shared definition, referenced alone, as an option, and merged.
            let here = "#/$defs/shared";
            params["$defs"] = json!({"shared": shared});
            if let Some(props) = params["properties"].as_object_mut() {
                props.insert("r".into(), json!({"$ref": here}));
                props.insert("ro".into(), json!({"anyOf": [{"$ref": here}, {"type": "boolean"}]}));
                props.insert("rm".into(), json!({"allOf": [{"$ref": here}, {"$ref": here}]}));
            }
            let tools = [tool("f", params), tool("g", json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))];
            prop_assert!(check_calls(&tools, Some("f"), seed).is_ok(), "{:?}", check_calls(&tools, Some("f"), seed));
            prop_assert!(check_calls(&tools, None, seed).is_ok(), "{:?}", check_calls(&tools, None, seed));
        }
    }
}

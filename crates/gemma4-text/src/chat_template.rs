//! Rendering a checkpoint's Jinja chat template exactly as transformers does.
//!
//! transformers' `apply_chat_template` renders with Python Jinja2 in a sandbox
//! with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, the
//! globals `raise_exception` and `strftime_now`, and its own `tojson` filter
//! (`json.dumps` with `ensure_ascii=False`). Before rendering it drops message
//! keys whose value is `None` and copies a message's reasoning between the
//! `reasoning_content`, `thinking` and `reasoning` keys. The context holds
//! `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
//! (`bos_token`, `eos_token`) and any extra keyword arguments
//! (`chat_template_kwargs`, e.g. `enable_thinking`).
//!
//! This module reproduces that with MiniJinja, Python-style methods on strings
//! and dicts (`.startswith`, `.strip`, `.split`, `.items()`, `.get`, ...) and
//! Python's way of printing values (`None`, `True`, `1.0`, `['a']`).

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Tuple, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use crate::error::{Result, TextError};
use crate::pyfmt::{self, JsonOptions};
use crate::strftime::CivilTime;
use crate::tokenizer::Tokenizer;

const TEMPLATE_NAME: &str = "chat_template";

/// Context keys that [`ChatTemplate::render`] sets itself and `extra` may not.
const RESERVED_KEYS: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Message keys that carry reasoning, the first being the one templates read.
const REASONING_KEYS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A compiled chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn template_error(err: &Error) -> TextError {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    TextError::Template { message }
}

impl ChatTemplate {
    /// Compiles a template from its Jinja source.
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let source = source.into();
        let env = build_environment(source.clone())?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: None,
            eos_token: None,
        })
    }

    /// Compiles the template stored in a file (for a `--chat-template FILE` option).
    pub fn from_file(path: &Path) -> Result<Self> {
        let source = std::fs::read_to_string(path).map_err(|source| TextError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::new(source)
    }

    /// The template for a tokenizer: `override_source` if given, otherwise the one
    /// the checkpoint ships; BOS and EOS come from the tokenizer. Without either,
    /// [`TextError::NoChatTemplate`].
    pub fn for_tokenizer(tokenizer: &Tokenizer, override_source: Option<&str>) -> Result<Self> {
        let source = override_source
            .or_else(|| tokenizer.chat_template())
            .ok_or(TextError::NoChatTemplate)?;
        Ok(Self::new(source)?.with_special_tokens(
            tokenizer.bos_token().map(str::to_owned),
            tokenizer.eos_token().map(str::to_owned),
        ))
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Sets the `bos_token` and `eos_token` the template sees.
    pub fn with_special_tokens(mut self, bos: Option<String>, eos: Option<String>) -> Self {
        self.bos_token = bos;
        self.eos_token = eos;
        self
    }

    /// Renders a conversation.
    ///
    /// * `messages`: a JSON array of message objects (`role`, `content`, and
    ///   optionally `tool_calls`, `reasoning_content`, ...).
    /// * `tools`: a JSON array of tool declarations, or `None`.
    /// * `add_generation_prompt`: end with the header of a new model turn.
    /// * `extra`: further template variables, e.g. `enable_thinking`; they
    ///   override `bos_token`/`eos_token` but may not replace `messages`, `tools`,
    ///   `documents` or `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String> {
        let messages = normalize_messages(messages)?;
        if let Some(key) = extra.keys().find(|k| RESERVED_KEYS.contains(&k.as_str())) {
            return Err(TextError::TemplateInput(format!(
                "the template variable {key:?} cannot be set through extra arguments"
            )));
        }
        let mut context: Vec<(String, Value)> = Vec::new();
        let mut set = |key: &str, value: Value| {
            if let Some(slot) = context.iter_mut().find(|(k, _)| k == key) {
                slot.1 = value;
            } else {
                context.push((key.to_owned(), value));
            }
        };
        if let Some(bos) = &self.bos_token {
            set("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            set("eos_token", Value::from(eos.as_str()));
        }
        for (key, value) in extra {
            set(key, to_value(value));
        }
        set("messages", to_value(&messages));
        set(
            "tools",
            tools.map(to_value).unwrap_or_else(|| Value::from(())),
        );
        set("documents", Value::from(()));
        set("add_generation_prompt", Value::from(add_generation_prompt));

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(&e))?;
        template
            .render(Value::from_pairs(context))
            .map_err(|e| template_error(&e))
    }
}

/// What transformers does to messages before rendering: drop keys whose value
/// is null, and make reasoning available under both `thinking` and
/// `reasoning_content` (`thinking` first, an existing `thinking` kept).
fn normalize_messages(messages: &Json) -> Result<Json> {
    let list = messages
        .as_array()
        .ok_or_else(|| TextError::TemplateInput("messages must be a JSON array".to_owned()))?;
    if list.is_empty() {
        return Err(TextError::TemplateInput(
            "cannot apply a chat template to an empty conversation".to_owned(),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (index, message) in list.iter().enumerate() {
        let object = message.as_object().ok_or_else(|| {
            TextError::TemplateInput(format!("message {index} is not a JSON object"))
        })?;
        let kept: Map<String, Json> = object
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let reasoning = REASONING_KEYS
            .iter()
            .find_map(|key| kept.get(*key))
            .cloned();
        let normalized = match reasoning {
            None => kept,
            Some(reasoning) => {
                let mut aliased = Map::new();
                aliased.insert("thinking".to_owned(), reasoning.clone());
                for (k, v) in kept {
                    aliased.insert(k, v);
                }
                aliased.insert("reasoning_content".to_owned(), reasoning);
                aliased
            }
        };
        out.push(Json::Object(normalized));
    }
    Ok(Json::Array(out))
}

/// A JSON value as a template value, keeping object key order.
fn to_value(json: &Json) -> Value {
    match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(to_value).collect::<Vec<_>>()),
        Json::Object(map) => Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), to_value(v)))),
    }
}

fn build_environment(source: String) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| template_error(&e))?;
    env.set_syntax(syntax);
    env.set_formatter(|out, _state, value| {
        if !value.is_undefined() {
            out.write_str(&pyfmt::py_str(value))?;
        }
        Ok(())
    });
    env.set_unknown_method_callback(python_methods);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", trim);
    env.add_filter("string", |value: Value| pyfmt::py_str(&value));
    env.add_filter("dictsort", |value: &Value, kwargs: Kwargs| {
        minijinja::filters::dictsort(value, kwargs).and_then(|pairs| as_tuples(&pairs))
    });
    env.add_filter("items", |value: &Value| {
        minijinja::filters::items(value).and_then(|pairs| as_tuples(&pairs))
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: String| {
        CivilTime::now().format(&format)
    });
    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(|e| template_error(&e))?;
    Ok(env)
}

fn raise_exception(message: Value) -> std::result::Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {}", pyfmt::py_str(&message)),
    ))
}

/// Jinja2's `trim(value, chars=None)`: Python's `str.strip`.
fn trim(value: Value, chars: Option<String>) -> String {
    pyfmt::py_strip(&pyfmt::py_str(&value), chars.as_deref(), true, true)
}

/// A sequence of pairs with each pair made a tuple, as Jinja2's `dictsort` and
/// `items` return them (it shows when they are printed: `('a', 1)`).
fn as_tuples(pairs: &Value) -> std::result::Result<Value, Error> {
    let items: Vec<Value> = pairs
        .try_iter()?
        .map(|pair| match pair.try_iter() {
            Ok(parts) if pair.kind() == ValueKind::Seq => {
                Value::from_object(Tuple::from(parts.collect::<Vec<_>>()))
            }
            _ => pair,
        })
        .collect();
    Ok(Value::from(items))
}

/// Python string/dict/list methods: `strip`/`lstrip`/`rstrip` with Python's notion
/// of white space here, everything else from `minijinja_contrib::pycompat`.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [chars] if chars.is_none() => None,
            [chars] => Some(chars.as_str().ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{method} arg must be None or str"),
                )
            })?),
            _ => return Err(Error::from(ErrorKind::TooManyArguments)),
        };
        let (left, right) = match method {
            "lstrip" => (true, false),
            "rstrip" => (false, true),
            _ => (true, true),
        };
        return Ok(Value::from(pyfmt::py_strip(s, chars, left, right)));
    }
    if let (Some(s), "rsplit") = (value.as_str(), method) {
        let (sep, maxsplit): (Option<Value>, Option<i64>) = minijinja::value::from_args(args)?;
        let sep = sep.filter(|v| !v.is_none());
        let sep = match &sep {
            Some(v) => Some(v.as_str().ok_or_else(|| {
                Error::new(ErrorKind::InvalidOperation, "rsplit: sep must be a str")
            })?),
            None => None,
        };
        if sep == Some("") {
            return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
        }
        let parts = pyfmt::py_rsplit(s, sep, maxsplit.unwrap_or(-1));
        return Ok(Value::from(parts));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, which is `json.dumps` with those arguments.
fn tojson(
    value: Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, Error> {
    let pick = |positional: Option<Value>, name: &str| -> std::result::Result<Value, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named.or(positional).unwrap_or_default())
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_true();
    let indent = match pick(indent, "indent")? {
        v if v.is_none() || v.is_undefined() => None,
        v if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        v => {
            let n = v.as_i64().ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a str",
                )
            })?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let separators = match pick(separators, "separators")? {
        v if v.is_none() || v.is_undefined() => None,
        v => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => Some((pyfmt::py_str(item), pyfmt::py_str(key))),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
    };
    let sort_keys = pick(None, "sort_keys")?.is_true();
    kwargs.assert_all_used()?;
    pyfmt::json_dumps(
        &value,
        &JsonOptions {
            ensure_ascii,
            indent,
            separators,
            sort_keys,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: Json, extra: Json) -> Result<String> {
        let extra = extra.as_object().cloned().unwrap_or_default();
        ChatTemplate::new(source)?
            .with_special_tokens(Some("<bos>".to_owned()), Some("<eos>".to_owned()))
            .render(&messages, None, true, &extra)
    }

    #[test]
    fn prints_values_like_python() -> Result<()> {
        let out = render(
            "{{ none }} {{ true }} {{ 1.0 }} {{ [1, 'a', none] }} {{ {'k': false} }} {{ x }}|",
            json!([{"role": "user", "content": ""}]),
            json!({"x": 2.5e-7}),
        )?;
        assert_eq!(out, "None True 1.0 [1, 'a', None] {'k': False} 2.5e-07|");
        Ok(())
    }

    #[test]
    fn tojson_is_json_dumps() -> Result<()> {
        let out = render(
            "{{ messages[0] | tojson }}\n{{ messages[0] | tojson(indent=2) }}",
            json!([{"role": "user", "content": "é\n", "n": [1, 2.0]}]),
            json!({}),
        )?;
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"é\\n\", \"n\": [1, 2.0]}\n{\n  \"role\": \"user\",\n  \"content\": \"é\\n\",\n  \"n\": [\n    1,\n    2.0\n  ]\n}"
        );
        Ok(())
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let err = render(
            "{{ raise_exception('roles must alternate') }}",
            json!([{"role": "user", "content": ""}]),
            json!({}),
        );
        match err {
            Err(TextError::Template { message }) => {
                assert!(message.contains("roles must alternate"), "{message}")
            }
            other => panic!("expected a template error, got {other:?}"),
        }
    }

    #[test]
    fn python_string_methods_work() -> Result<()> {
        let out = render(
            "{{ ' a b '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'xy'.startswith('x') }}|{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}",
            json!([{"role": "user", "content": ""}]),
            json!({}),
        )?;
        assert_eq!(out, "a b|['a', 'b']|True|a=1");
        Ok(())
    }

    #[test]
    fn messages_are_normalized_like_transformers() -> Result<()> {
        let out = render(
            "{% for m in messages %}{{ m | tojson }}{% endfor %}",
            json!([{"role": "assistant", "content": null, "reasoning": "r"}]),
            json!({}),
        )?;
        assert_eq!(
            out,
            r#"{"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}"#
        );
        Ok(())
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert!(matches!(
            render("x", json!({"role": "user"}), json!({})),
            Err(TextError::TemplateInput(_))
        ));
        assert!(matches!(
            render("x", json!([{"role": "user"}]), json!({"messages": []})),
            Err(TextError::TemplateInput(_))
        ));
        assert!(matches!(
            ChatTemplate::new("{% if %}"),
            Err(TextError::Template { .. })
        ));
    }
}

//! JSON-Schema combinators reduced to plain schemas, for the tool-call grammar:
//! local `$ref`s resolved, `allOf` parts merged into one schema. What cannot
//! be merged is a [`SchemaError`] that names the keyword.

use serde_json::{Map, Value};

/// A schema (or part of one) that cannot be enforced, and where it is.
#[derive(Debug, Clone, PartialEq)]
pub struct SchemaError {
    /// A JSON pointer into the tool's `parameters`.
    pub at: String,
    pub message: String,
    /// No value can satisfy the schema (an option of `anyOf` may be skipped
    /// for that), as opposed to a keyword that cannot be enforced.
    pub unsatisfiable: bool,
}

impl SchemaError {
    pub fn new(at: &str, message: impl Into<String>) -> Self {
        Self {
            at: at.to_string(),
            message: message.into(),
            unsatisfiable: false,
        }
    }

    /// A schema no value satisfies.
    pub fn unsatisfiable(at: &str, message: impl Into<String>) -> Self {
        Self {
            unsatisfiable: true,
            ..Self::new(at, message)
        }
    }
}

/// Keywords the tool-call grammar enforces.
pub const ENFORCED: &[&str] = &[
    "type",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "nullable",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "items",
    "prefixItems",
    "additionalItems",
    "minItems",
    "maxItems",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
];

/// Keywords that describe a value without constraining it.
pub const ANNOTATIONS: &[&str] = &[
    "$schema",
    "$id",
    "id",
    "$anchor",
    "$comment",
    "$defs",
    "definitions",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "contentMediaType",
    "contentEncoding",
    // OpenAPI's hint for a `oneOf` (Pydantic writes it); the options hold anyway.
    "discriminator",
];

/// Refuses a keyword that is neither enforced nor an annotation.
pub fn check_keywords(schema: &Map<String, Value>, at: &str) -> Result<(), SchemaError> {
    for key in schema.keys() {
        if !ENFORCED.contains(&key.as_str()) && !ANNOTATIONS.contains(&key.as_str()) {
            return Err(SchemaError::new(
                at,
                format!("`{key}` cannot be enforced in a tool call"),
            ));
        }
    }
    Ok(())
}

/// The schema a local `$ref` (`#`, `#/$defs/…`, any JSON pointer into the
/// tool's `parameters`) points at.
pub fn resolve<'a>(root: &'a Value, reference: &Value, at: &str) -> Result<&'a Value, SchemaError> {
    let Some(r) = reference.as_str() else {
        return Err(SchemaError::new(at, "`$ref` must be a string"));
    };
    let Some(pointer) = r.strip_prefix('#') else {
        return Err(SchemaError::new(
            at,
            format!("`$ref` {r:?} is not local: only references into the same schema (`#/…`) can be enforced"),
        ));
    };
    let decoded = percent_decode(pointer);
    root.pointer(&decoded)
        .ok_or_else(|| SchemaError::new(at, format!("`$ref` {r:?} points at nothing")))
}

/// `%25` and friends in a URI fragment, as JSON pointers in `$ref` may carry them.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The greatest of two bounds, or the least (`greatest == false`).
fn bound(a: &Value, b: &Value, greatest: bool, key: &str, at: &str) -> Result<Value, SchemaError> {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => Ok(if (x >= y) == greatest {
            a.clone()
        } else {
            b.clone()
        }),
        _ => Err(SchemaError::new(at, format!("`{key}` must be a number"))),
    }
}

fn types_of(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .filter_map(|t| t.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    }
}

/// Types both lists allow (`integer` is within `number`).
fn intersect_types(a: &Value, b: &Value) -> Value {
    let (a, b) = (types_of(a), types_of(b));
    let mut out: Vec<Value> = Vec::new();
    for t in &a {
        let kept = if b.contains(t) {
            Some(t.as_str())
        } else if (t == "integer" && b.iter().any(|u| u == "number"))
            || (t == "number" && b.iter().any(|u| u == "integer"))
        {
            Some("integer")
        } else {
            None
        };
        if let Some(k) = kept {
            if !out.iter().any(|o| o == k) {
                out.push(k.into());
            }
        }
    }
    Value::Array(out)
}

/// The items of a list keyword (none when it is not a list).
fn list(v: &Value) -> Vec<Value> {
    v.as_array().cloned().unwrap_or_default()
}

fn all_of(a: &Value, b: &Value) -> Value {
    serde_json::json!({ "allOf": [a, b] })
}

/// One schema that accepts exactly what both `a` and `b` accept. `$ref`s are
/// expected resolved at this level (nested ones stay, merged later as `allOf`).
pub fn merge(a: &Value, b: &Value, at: &str) -> Result<Value, SchemaError> {
    let (a, b) = match (a, b) {
        (Value::Bool(true), other) | (other, Value::Bool(true)) => return Ok(other.clone()),
        (Value::Bool(false), _) | (_, Value::Bool(false)) => return Ok(Value::Bool(false)),
        (Value::Object(a), Value::Object(b)) => (a, b),
        _ => {
            return Err(SchemaError::new(
                at,
                "a schema must be an object or a boolean",
            ))
        }
    };
    // One part's `additionalProperties` holds keys the other's patterns
    // match; the merged schema would let the patterns decide them.
    let keyed = |o: &Map<String, Value>| o.get("patternProperties").cloned();
    let open = |o: &Map<String, Value>| o.contains_key("additionalProperties");
    let unheld = |x: &Map<String, Value>, y: &Map<String, Value>| {
        open(x) && keyed(y).is_some() && keyed(x) != keyed(y)
    };
    if unheld(a, b) || unheld(b, a) {
        return Err(SchemaError::new(
            at,
            "`patternProperties` in one `allOf` part beside `additionalProperties` in \
             another cannot be enforced",
        ));
    }
    let mut out = a.clone();
    for (key, theirs) in b {
        let Some(ours) = a.get(key) else {
            out.insert(key.clone(), theirs.clone());
            continue;
        };
        let merged = match key.as_str() {
            "type" => intersect_types(ours, theirs),
            "minimum" | "exclusiveMinimum" | "minLength" | "minItems" | "minProperties" => {
                bound(ours, theirs, true, key, at)?
            }
            "maximum" | "exclusiveMaximum" | "maxLength" | "maxItems" | "maxProperties" => {
                bound(ours, theirs, false, key, at)?
            }
            "required" => {
                let mut names = list(ours);
                for n in theirs.as_array().into_iter().flatten() {
                    if !names.contains(n) {
                        names.push(n.clone());
                    }
                }
                Value::Array(names)
            }
            "enum" => Value::Array(
                ours.as_array()
                    .into_iter()
                    .flatten()
                    .filter(|v| theirs.as_array().is_some_and(|t| t.contains(v)))
                    .cloned()
                    .collect(),
            ),
            "const" if ours == theirs => ours.clone(),
            "const" => return Ok(Value::Bool(false)),
            "pattern" => {
                let mut all: Vec<Value> = patterns(ours).into_iter().map(Value::from).collect();
                all.extend(patterns(theirs).into_iter().map(Value::from));
                Value::Array(all)
            }
            "properties" | "patternProperties" => {
                let mut props = ours.as_object().cloned().unwrap_or_default();
                for (name, schema) in theirs.as_object().into_iter().flatten() {
                    let both = match props.get(name) {
                        Some(mine) => all_of(mine, schema),
                        None => schema.clone(),
                    };
                    props.insert(name.clone(), both);
                }
                Value::Object(props)
            }
            // Closed by either part is closed (an `allOf` with `false` would
            // read as an object no value meets).
            "items" | "additionalItems" | "additionalProperties"
                if ours == &Value::Bool(false) || theirs == &Value::Bool(false) =>
            {
                Value::Bool(false)
            }
            "items" | "additionalItems" | "additionalProperties" => all_of(ours, theirs),
            "prefixItems" => merge_prefix(ours, theirs),
            "anyOf" | "oneOf" => cross(ours, theirs, at)?,
            "allOf" => {
                let mut parts = list(ours);
                parts.extend(list(theirs));
                Value::Array(parts)
            }
            "nullable" => Value::Bool(ours == &Value::Bool(true) && theirs == &Value::Bool(true)),
            "multipleOf" | "format" | "$ref" if ours != theirs => {
                return Err(SchemaError::new(
                    at,
                    format!("two different `{key}`s in one `allOf` cannot be enforced together"),
                ))
            }
            _ => ours.clone(),
        };
        out.insert(key.clone(), merged);
    }
    for (part, other) in [(a, b), (b, a)] {
        if !hold_undeclared(part, other, &mut out) {
            return Ok(Value::Bool(false));
        }
    }
    Ok(Value::Object(out))
}

/// Holds the properties `other` declares and `part` does not to what
/// `part`'s own `additionalProperties` allows them: dropped where it is
/// `false` (and no value can be had when one of them is required), held to
/// its schema otherwise. Without `additionalProperties`, `part` says nothing
/// of them. Returns whether the merged schema can still be met.
fn hold_undeclared(
    part: &Map<String, Value>,
    other: &Map<String, Value>,
    out: &mut Map<String, Value>,
) -> bool {
    let Some(extra) = part.get("additionalProperties") else {
        return true;
    };
    let declared = part.get("properties").and_then(Value::as_object);
    let undeclared: Vec<String> = other
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .map(|(name, _)| name.clone())
        .filter(|name| !declared.is_some_and(|d| d.contains_key(name)))
        .collect();
    let required = list(out.get("required").unwrap_or(&Value::Null));
    let Some(Value::Object(props)) = out.get_mut("properties") else {
        return true;
    };
    for name in undeclared {
        if extra == &Value::Bool(false) {
            if required.iter().any(|r| r == name.as_str()) {
                return false;
            }
            props.remove(&name);
        } else if let Some(schema) = props.get(&name) {
            let both = all_of(schema, extra);
            props.insert(name, both);
        }
    }
    true
}

/// The patterns of a `pattern` keyword: one, or several after a merge.
pub fn patterns(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .filter_map(|p| p.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    }
}

fn merge_prefix(a: &Value, b: &Value) -> Value {
    let (a, b) = (list(a), list(b));
    let n = a.len().max(b.len());
    Value::Array(
        (0..n)
            .map(|i| match (a.get(i), b.get(i)) {
                (Some(x), Some(y)) => all_of(x, y),
                (Some(x), None) | (None, Some(x)) => x.clone(),
                (None, None) => Value::Bool(true),
            })
            .collect(),
    )
}

/// Two `anyOf` lists in one `allOf`: every pair of alternatives.
fn cross(a: &Value, b: &Value, at: &str) -> Result<Value, SchemaError> {
    let (a, b) = (list(a), list(b));
    if a.len() * b.len() > 256 {
        return Err(SchemaError::new(
            at,
            "an `allOf` of `anyOf`s with more than 256 combinations cannot be enforced",
        ));
    }
    Ok(Value::Array(
        a.iter()
            .flat_map(|x| b.iter().map(move |y| all_of(x, y)))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bounds_tighten_and_lists_combine() {
        let m = merge(
            &json!({"type": ["integer", "string"], "minimum": 1, "maximum": 9, "required": ["a"]}),
            &json!({"type": "number", "minimum": 3, "maximum": 20, "required": ["b", "a"]}),
            "",
        )
        .expect("merges");
        assert_eq!(m["type"], json!(["integer"]));
        assert_eq!(m["minimum"], 3);
        assert_eq!(m["maximum"], 9);
        assert_eq!(m["required"], json!(["a", "b"]));
        let p = merge(&json!({"pattern": "a"}), &json!({"pattern": "b"}), "").expect("merges");
        assert_eq!(patterns(&p["pattern"]), vec!["a", "b"]);
        assert_eq!(
            merge(&json!({"const": 1}), &json!({"const": 2}), "").expect("merges"),
            Value::Bool(false)
        );
        let e = merge(&json!({"format": "date"}), &json!({"format": "uuid"}), "/x")
            .expect_err("two formats");
        assert!(e.message.contains("format"), "{e:?}");
    }

    #[test]
    fn a_closed_part_keeps_the_others_properties_out() {
        let closed =
            json!({"properties": {"a": {"type": "integer"}}, "additionalProperties": false});
        let open = json!({"properties": {"b": {"type": "boolean"}}});
        for (x, y) in [(&closed, &open), (&open, &closed)] {
            let m = merge(x, y, "").expect("merges");
            assert_eq!(m["properties"], json!({"a": {"type": "integer"}}), "{m}");
            assert_eq!(m["additionalProperties"], false);
        }
        let required = json!({"properties": {"b": {"type": "boolean"}}, "required": ["b"]});
        assert_eq!(
            merge(&closed, &required, "").expect("merges"),
            Value::Bool(false)
        );
        let typed = json!({"properties": {"a": {}}, "additionalProperties": {"type": "string"}});
        let m = merge(&typed, &open, "").expect("merges");
        assert_eq!(
            m["properties"]["b"],
            json!({"allOf": [{"type": "boolean"}, {"type": "string"}]})
        );
    }

    #[test]
    fn references_resolve_locally_only() {
        let root = json!({"$defs": {"a b": {"type": "integer"}}});
        assert_eq!(
            resolve(&root, &json!("#/$defs/a%20b"), "").expect("found"),
            &json!({"type": "integer"})
        );
        assert!(resolve(&root, &json!("other.json#/x"), "").is_err());
        assert!(resolve(&root, &json!("#/$defs/none"), "").is_err());
    }
}

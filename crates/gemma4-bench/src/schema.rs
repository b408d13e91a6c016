//! A JSON Schema (draft 2020-12) validator for the subset of keywords the report
//! schema uses, and that schema itself.
//!
//! Supported: `type`, `enum`, `const`, `properties`, `required`,
//! `additionalProperties`, `items`, `minItems`, `minLength`, `minimum`,
//! `maximum`, `exclusiveMinimum`, `anyOf`, `oneOf`, `allOf`, and local `$ref`s
//! into `$defs`. Annotations (`title`, `description`, ...) are accepted. Any
//! other keyword makes the schema unusable rather than silently unchecked.

use serde_json::{Map, Value};

use crate::error::{BenchError, Result};

/// The report schema, version 1.0, as committed in `schema/`.
pub const REPORT_SCHEMA: &str = include_str!("../schema/report-1.0.schema.json");

const ANNOTATIONS: &[&str] = &[
    "$schema",
    "$id",
    "$comment",
    "title",
    "description",
    "examples",
    "default",
    "deprecated",
];
const ASSERTIONS: &[&str] = &[
    "type",
    "enum",
    "const",
    "required",
    "minItems",
    "minLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "$ref",
];
const MAX_DEPTH: usize = 128;

/// A checked schema, ready to validate instances.
#[derive(Debug, Clone)]
pub struct Validator {
    root: Value,
}

impl Validator {
    /// Checks that `schema` only uses supported keywords and that its `$ref`s
    /// resolve.
    pub fn new(schema: Value) -> Result<Self> {
        let validator = Validator { root: schema };
        validator.check_schema(&validator.root, "#", 0)?;
        Ok(validator)
    }

    /// The committed report schema.
    pub fn report() -> Result<Self> {
        let schema: Value = serde_json::from_str(REPORT_SCHEMA)
            .map_err(|e| BenchError::Schema(format!("not JSON: {e}")))?;
        Self::new(schema)
    }

    /// Every way `instance` breaks the schema, each with its JSON pointer; empty
    /// when it conforms.
    pub fn validate(&self, instance: &Value) -> Vec<String> {
        let mut errors = Vec::new();
        self.check(&self.root, instance, "", 0, &mut errors);
        errors
    }

    fn check_schema(&self, schema: &Value, at: &str, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(BenchError::Schema(format!("{at}: nested too deeply")));
        }
        let map = match schema {
            Value::Bool(_) => return Ok(()),
            Value::Object(map) => map,
            _ => {
                return Err(BenchError::Schema(format!(
                    "{at}: a schema must be an object or a boolean"
                )))
            }
        };
        for (key, value) in map {
            let here = format!("{at}/{key}");
            match key.as_str() {
                k if ANNOTATIONS.contains(&k) => {}
                "$ref" => {
                    let target = value
                        .as_str()
                        .ok_or_else(|| BenchError::Schema(format!("{here}: must be a string")))?;
                    self.resolve(target).ok_or_else(|| {
                        BenchError::Schema(format!("{here}: cannot resolve '{target}'"))
                    })?;
                }
                k if ASSERTIONS.contains(&k) => {}
                "properties" | "$defs" => {
                    let members = value
                        .as_object()
                        .ok_or_else(|| BenchError::Schema(format!("{here}: must be an object")))?;
                    for (name, sub) in members {
                        self.check_schema(sub, &format!("{here}/{name}"), depth + 1)?;
                    }
                }
                "additionalProperties" | "items" => self.check_schema(value, &here, depth + 1)?,
                "anyOf" | "oneOf" | "allOf" => {
                    let list = value.as_array().filter(|l| !l.is_empty()).ok_or_else(|| {
                        BenchError::Schema(format!("{here}: must be a non-empty array"))
                    })?;
                    for (i, sub) in list.iter().enumerate() {
                        self.check_schema(sub, &format!("{here}/{i}"), depth + 1)?;
                    }
                }
                other => {
                    return Err(BenchError::Schema(format!(
                        "{at}: keyword '{other}' is not supported by this validator"
                    )))
                }
            }
        }
        Ok(())
    }

    fn resolve(&self, reference: &str) -> Option<&Value> {
        let name = reference.strip_prefix("#/$defs/")?;
        self.root.get("$defs")?.get(name)
    }

    fn check(
        &self,
        schema: &Value,
        inst: &Value,
        path: &str,
        depth: usize,
        errors: &mut Vec<String>,
    ) {
        let at = if path.is_empty() { "/" } else { path };
        if depth > MAX_DEPTH {
            errors.push(format!("{at}: schema nested too deeply"));
            return;
        }
        let map: &Map<String, Value> = match schema {
            Value::Bool(true) => return,
            Value::Bool(false) => {
                errors.push(format!("{at}: not allowed here"));
                return;
            }
            Value::Object(map) => map,
            _ => return,
        };
        if let Some(target) = map.get("$ref").and_then(Value::as_str) {
            match self.resolve(target) {
                Some(sub) => self.check(sub, inst, path, depth + 1, errors),
                None => errors.push(format!("{at}: unresolved $ref '{target}'")),
            }
        }
        if let Some(types) = map.get("type") {
            let allowed: Vec<&str> = match types {
                Value::String(t) => vec![t.as_str()],
                Value::Array(list) => list.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            if !allowed.iter().any(|t| has_type(inst, t)) {
                errors.push(format!(
                    "{at}: expected {}, found {}",
                    allowed.join(" or "),
                    type_name(inst)
                ));
                return;
            }
        }
        if let Some(options) = map.get("enum").and_then(Value::as_array) {
            if !options.contains(inst) {
                errors.push(format!(
                    "{at}: {inst} is not one of {}",
                    Value::Array(options.clone())
                ));
            }
        }
        if let Some(expected) = map.get("const") {
            if expected != inst {
                errors.push(format!("{at}: expected {expected}, found {inst}"));
            }
        }
        if let Some(x) = inst.as_f64() {
            if let Some(min) = map.get("minimum").and_then(Value::as_f64) {
                if x < min {
                    errors.push(format!("{at}: {x} is below the minimum {min}"));
                }
            }
            if let Some(min) = map.get("exclusiveMinimum").and_then(Value::as_f64) {
                if x <= min {
                    errors.push(format!("{at}: {x} must be greater than {min}"));
                }
            }
            if let Some(max) = map.get("maximum").and_then(Value::as_f64) {
                if x > max {
                    errors.push(format!("{at}: {x} is above the maximum {max}"));
                }
            }
        }
        if let (Some(s), Some(min)) = (inst.as_str(), map.get("minLength").and_then(Value::as_u64))
        {
            if (s.chars().count() as u64) < min {
                errors.push(format!("{at}: string shorter than {min}"));
            }
        }
        if let Some(items) = inst.as_array() {
            if let Some(min) = map.get("minItems").and_then(Value::as_u64) {
                if (items.len() as u64) < min {
                    errors.push(format!("{at}: fewer than {min} items"));
                }
            }
            if let Some(item_schema) = map.get("items") {
                for (i, item) in items.iter().enumerate() {
                    self.check(item_schema, item, &format!("{path}/{i}"), depth + 1, errors);
                }
            }
        }
        if let Some(object) = inst.as_object() {
            self.check_object(map, object, path, depth, errors);
        }
        for keyword in ["anyOf", "oneOf", "allOf"] {
            let Some(list) = map.get(keyword).and_then(Value::as_array) else {
                continue;
            };
            let outcomes: Vec<Vec<String>> = list
                .iter()
                .map(|sub| {
                    let mut sub_errors = Vec::new();
                    self.check(sub, inst, path, depth + 1, &mut sub_errors);
                    sub_errors
                })
                .collect();
            let passing = outcomes.iter().filter(|e| e.is_empty()).count();
            match keyword {
                "anyOf" if passing == 0 => errors.push(format!(
                    "{at}: matches none of anyOf ({})",
                    outcomes
                        .iter()
                        .flatten()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("; ")
                )),
                "oneOf" if passing != 1 => errors.push(format!(
                    "{at}: matches {passing} of oneOf, expected exactly one"
                )),
                "allOf" => errors.extend(outcomes.into_iter().flatten()),
                _ => {}
            }
        }
    }

    fn check_object(
        &self,
        schema: &Map<String, Value>,
        object: &Map<String, Value>,
        path: &str,
        depth: usize,
        errors: &mut Vec<String>,
    ) {
        let at = if path.is_empty() { "/" } else { path };
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for name in required.iter().filter_map(Value::as_str) {
                if !object.contains_key(name) {
                    errors.push(format!("{at}: missing required property '{name}'"));
                }
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        for (name, value) in object {
            let child = format!("{path}/{}", escape_pointer(name));
            match properties.and_then(|p| p.get(name)) {
                Some(sub) => self.check(sub, value, &child, depth + 1, errors),
                None => {
                    if let Some(extra) = schema.get("additionalProperties") {
                        if extra == &Value::Bool(false) {
                            errors.push(format!("{at}: unexpected property '{name}'"));
                        } else {
                            self.check(extra, value, &child, depth + 1, errors);
                        }
                    }
                }
            }
        }
    }
}

/// Validates a report value against the committed schema.
pub fn validate_report(report: &Value) -> Result<()> {
    let errors = Validator::report()?.validate(report);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(BenchError::Invalid(errors))
    }
}

fn has_type(value: &Value, name: &str) -> bool {
    match name {
        "null" => value.is_null(),
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64()
                || value.is_u64()
                || value
                    .as_f64()
                    .is_some_and(|f| f.is_finite() && f.fract() == 0.0)
        }
        _ => false,
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn escape_pointer(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn example() -> Value {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/bench/report-example.json");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    fn errors_of(v: &Value) -> Vec<String> {
        match Validator::report() {
            Ok(validator) => validator.validate(v),
            Err(e) => vec![e.to_string()],
        }
    }

    #[test]
    fn the_study_example_validates() {
        let v = example();
        assert!(v.is_object(), "fixture missing");
        assert_eq!(errors_of(&v), Vec::<String>::new());
    }

    #[test]
    fn broken_reports_are_rejected() {
        let mut v = example();
        if let Some(o) = v.as_object_mut() {
            o.remove("run");
        }
        let e = errors_of(&v);
        assert!(e.iter().any(|m| m.contains("'run'")), "{e:?}");

        let mut v = example();
        v["capabilities"][0]["probes"][0]["verdict"] = json!("maybe");
        let e = errors_of(&v);
        assert!(
            e.iter()
                .any(|m| m.starts_with("/capabilities/0/probes/0/verdict")),
            "{e:?}"
        );

        let mut v = example();
        v["throughput"]["sweep"][1]["concurrency"] = json!(0);
        assert!(!errors_of(&v).is_empty());

        let mut v = example();
        v["throughput"]["sweep"][1]["ttft_ms"]["median"] = json!("fast");
        assert!(!errors_of(&v).is_empty());

        let mut v = example();
        v["schema_version"] = json!("2.0");
        assert!(!errors_of(&v).is_empty());

        let mut v = example();
        v["surprise"] = json!(1);
        assert!(!errors_of(&v).is_empty());
    }

    #[test]
    fn keywords_behave() {
        let schema = json!({
            "$defs": {"n": {"type": "integer", "minimum": 1}},
            "type": "object",
            "required": ["a"],
            "properties": {
                "a": {"$ref": "#/$defs/n"},
                "b": {"type": ["string", "null"], "minLength": 2},
                "c": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1},
                "d": {"anyOf": [{"type": "string"}, {"type": "number", "exclusiveMinimum": 0}]},
                "e": {"oneOf": [{"type": "number"}, {"type": "integer"}]}
            },
            "additionalProperties": false
        });
        let v = match Validator::new(schema) {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        };
        assert!(v
            .validate(&json!({"a": 3, "b": null, "c": ["x"], "d": "s"}))
            .is_empty());
        assert!(v.validate(&json!({"a": 3.0})).is_empty());
        assert_eq!(v.validate(&json!({"a": 0})).len(), 1);
        assert_eq!(v.validate(&json!({"a": 1.5})).len(), 1);
        assert_eq!(v.validate(&json!({})).len(), 1);
        assert_eq!(v.validate(&json!({"a": 1, "b": "x"})).len(), 1);
        assert_eq!(v.validate(&json!({"a": 1, "c": []})).len(), 1);
        assert_eq!(v.validate(&json!({"a": 1, "c": ["z"]})).len(), 1);
        assert_eq!(v.validate(&json!({"a": 1, "d": -1})).len(), 1);
        assert_eq!(
            v.validate(&json!({"a": 1, "e": 2})).len(),
            1,
            "2 matches both oneOf branches"
        );
        assert!(v.validate(&json!({"a": 1, "e": 2.5})).is_empty());
        assert_eq!(v.validate(&json!({"a": 1, "zz": 1})).len(), 1);
    }

    #[test]
    fn unsupported_keywords_and_bad_refs_are_refused() {
        assert!(Validator::new(json!({"type": "string", "pattern": "^a"})).is_err());
        assert!(Validator::new(json!({"$ref": "#/$defs/missing"})).is_err());
        assert!(Validator::new(json!({"properties": {"a": 3}})).is_err());
        assert!(Validator::new(json!(true)).is_ok());
    }
}

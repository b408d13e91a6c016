//! Reading typed fields out of a JSON request body. Unknown fields are
//! ignored (OpenAI clients send extras); a field of the wrong type or out of
//! range is a 400 that names the field. `null` counts as absent.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// A parsed JSON object body.
#[derive(Debug)]
pub struct Fields {
    obj: Map<String, Value>,
}

/// The JSON type of a value, as a client would call it.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(name: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::bad_request(format!(
        "`{name}` must be {expected}, not {}",
        type_name(got)
    ))
    .with_param(name)
}

/// An integer from a JSON number (an integral float such as `16.0` counts).
fn as_integer(v: &Value) -> Option<i128> {
    if let Some(i) = v.as_i64() {
        return Some(i128::from(i));
    }
    if let Some(u) = v.as_u64() {
        return Some(i128::from(u));
    }
    let f = v.as_f64()?;
    (f.is_finite() && f.fract() == 0.0 && f.abs() < 1e18).then_some(f as i128)
}

impl Fields {
    /// Parses a request body; it must be a JSON object.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!(
                "the request body is not valid JSON ({e}); send a JSON object with Content-Type: application/json"
            ))
        })?;
        match value {
            Value::Object(obj) => Ok(Self { obj }),
            other => Err(ApiError::bad_request(format!(
                "the request body must be a JSON object, not {}",
                type_name(&other)
            ))),
        }
    }

    /// Fields already read as an object (a request restated as another).
    pub fn from_object(obj: Map<String, Value>) -> Self {
        Self { obj }
    }

    /// Whether the body names the field, even as `null`.
    pub fn names(&self, name: &str) -> bool {
        self.obj.contains_key(name)
    }

    /// The field, or `None` when absent or `null`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(name, "true or false", v)),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(name, "a string", v)),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => Err(wrong_type(name, "an object", v)),
        }
    }

    pub fn array(&self, name: &str) -> Result<Option<&Vec<Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(wrong_type(name, "an array", v)),
        }
    }

    /// A finite number within `[min, max]`.
    pub fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| wrong_type(name, "a number", v))?;
        if !x.is_finite() || x < min || x > max {
            return Err(ApiError::bad_request(format!(
                "`{name}` must be between {min} and {max}; got {x}"
            ))
            .with_param(name));
        }
        Ok(Some(x as f32))
    }

    /// An integer within `[min, max]`.
    pub fn integer(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let i = as_integer(v).ok_or_else(|| wrong_type(name, "an integer", v))?;
        if i < i128::from(min) {
            return Err(
                ApiError::bad_request(format!("`{name}` must be at least {min}; got {i}"))
                    .with_param(name),
            );
        }
        if i > i128::from(max) {
            return Err(
                ApiError::bad_request(format!("`{name}` must be at most {max}; got {i}"))
                    .with_param(name),
            );
        }
        Ok(Some(i as i64))
    }

    /// Any integer, reduced to 64 bits (for seeds).
    pub fn seed(&self, name: &str) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let i = as_integer(v).ok_or_else(|| wrong_type(name, "an integer", v))?;
        Ok(Some(i as u64))
    }

    /// A string or an array of strings (OpenAI's `stop`).
    pub fn strings(&self, name: &str) -> Result<Vec<String>, ApiError> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong_type(name, "a string or an array of strings", other)),
                })
                .collect(),
            Some(v) => Err(wrong_type(name, "a string or an array of strings", v)),
        }
    }

    /// Refuses fields this server does not implement, naming the first one
    /// present, so that no request is silently served differently than asked.
    pub fn refuse(&self, names: &[&str], route: &str) -> Result<(), ApiError> {
        match names.iter().find(|n| self.get(n).is_some()) {
            Some(name) => Err(ApiError::bad_request(format!(
                "`{name}` is not supported by {route} on this server; remove it (see docs/serving.md for the supported fields)"
            ))
            .with_param(*name)),
            None => Ok(()),
        }
    }

    /// Refuses `name` unless its value is `neutral`: one that asks for nothing
    /// this server lacks (`best_of: 1`, `include: []`) is served as without it.
    pub fn refuse_unless(
        &self,
        name: &str,
        route: &str,
        neutral: impl Fn(&Value) -> bool,
    ) -> Result<(), ApiError> {
        match self.get(name) {
            Some(v) if !neutral(v) => self.refuse(&[name], route),
            _ => Ok(()),
        }
    }

    /// `logit_bias`: an object mapping token ids (as strings) to a bias in [-100, 100].
    pub fn logit_bias(&self, name: &str) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = self.object(name)? else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(key, value)| {
                let id = key.parse::<u32>().map_err(|_| {
                    ApiError::bad_request(format!(
                        "`{name}` keys must be token ids; {key:?} is not one"
                    ))
                    .with_param(name)
                })?;
                let bias = value
                    .as_f64()
                    .filter(|b| (-100.0..=100.0).contains(b))
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "`{name}[{key:?}]` must be a number between -100 and 100"
                        ))
                        .with_param(name)
                    })?;
                Ok((id, bias as f32))
            })
            .collect()
    }

    /// An array of non-negative integers that fit in `u32` (token ids).
    pub fn token_ids(&self, name: &str) -> Result<Option<Vec<u32>>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        token_id_list(v)
            .map(Some)
            .ok_or_else(|| wrong_type(name, "an array of token ids (non-negative integers)", v))
    }
}

/// The value as a list of token ids, if it is one.
pub fn token_id_list(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|u| u32::try_from(u).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(text: &str) -> Fields {
        Fields::parse(text.as_bytes()).expect("valid JSON object")
    }

    #[test]
    fn malformed_and_non_object_bodies_are_rejected() {
        let e = Fields::parse(b"{\"a\":").expect_err("must fail");
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let e = Fields::parse(b"[1,2]").expect_err("must fail");
        assert!(e.message.contains("JSON object"), "{}", e.message);
    }

    #[test]
    fn wrong_type_names_the_field() {
        let f = fields(r#"{"temperature": "hot", "max_tokens": 1.5, "stream": 1}"#);
        let e = f.number("temperature", 0.0, 2.0).expect_err("must fail");
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(
            e.message
                .contains("`temperature` must be a number, not a string"),
            "{}",
            e.message
        );
        let e = f.integer("max_tokens", 1, i64::MAX).expect_err("must fail");
        assert!(
            e.message.contains("`max_tokens` must be an integer"),
            "{}",
            e.message
        );
        assert!(f.bool("stream").is_err());
    }

    #[test]
    fn ranges_are_checked() {
        let f = fields(r#"{"top_p": 1.5, "max_tokens": 0, "n": 16.0}"#);
        assert!(f.number("top_p", 0.0, 1.0).is_err());
        let e = f.integer("max_tokens", 1, i64::MAX).expect_err("must fail");
        assert!(e.message.contains("at least 1"), "{}", e.message);
        assert_eq!(f.integer("n", 1, 16).ok().flatten(), Some(16));
    }

    #[test]
    fn null_is_absent_and_unknown_fields_are_ignored() {
        let f = fields(r#"{"temperature": null, "some_extension": {"x": 1}}"#);
        assert_eq!(f.number("temperature", 0.0, 2.0).ok().flatten(), None);
    }

    #[test]
    fn stop_accepts_string_or_list() {
        assert_eq!(
            fields(r#"{"stop": "x"}"#).strings("stop").ok(),
            Some(vec!["x".to_string()])
        );
        assert_eq!(
            fields(r#"{"stop": ["a", "b"]}"#)
                .strings("stop")
                .ok()
                .map(|v| v.len()),
            Some(2)
        );
        assert!(fields(r#"{"stop": [1]}"#).strings("stop").is_err());
    }
}

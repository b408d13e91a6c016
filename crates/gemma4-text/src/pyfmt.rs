//! Python-compatible text for template values.
//!
//! Chat templates are written for Python's Jinja2, where `{{ x }}` prints
//! `str(x)` (`None`, `True`, `1.0`, `['a', 1]`) and the `tojson` filter that
//! transformers installs is `json.dumps`. MiniJinja's own formatting differs
//! (`none`, `true`, `["a", 1]`), so these functions reproduce Python's.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python's `repr(float)` (also `str(float)`): the shortest text that reads back
/// as the same double, positional for exponents in [-4, 16), scientific outside.
pub fn float_repr(v: f64) -> String {
    if v.is_nan() {
        return "nan".to_owned();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    // `{:e}` gives the shortest round-trip digits: "1.2345e-7", "5e0".
    let sci = format!("{v:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', point.unsigned_abs() as usize));
            out.push_str(&digits);
        } else {
            let point = point as usize;
            if digits.len() <= point {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', point - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// Whether Python's `str.isprintable()` is false for `c` (approximately: control
/// and format characters, separators other than the ASCII space, surrogates,
/// private use and non-characters).
fn is_unprintable(c: char) -> bool {
    let cp = c as u32;
    matches!(cp,
        0x00..=0x1F | 0x7F..=0xA0 | 0xAD
        | 0x600..=0x605 | 0x61C | 0x6DD | 0x70F | 0x890..=0x891 | 0x8E2
        | 0x1680 | 0x180E | 0x2000..=0x200F | 0x2028..=0x202F
        | 0x205F..=0x2064 | 0x2066..=0x206F | 0x3000
        | 0xE000..=0xF8FF | 0xFEFF | 0xFFF9..=0xFFFB | 0xFFFE..=0xFFFF
        | 0x110BD | 0x110CD | 0x13430..=0x1343F | 0x1BCA0..=0x1BCA3
        | 0x1D173..=0x1D17A | 0xE0001 | 0xE0020..=0xE007F
        | 0xF0000..=0x10FFFF)
}

/// Python's `repr(str)`.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_unprintable(c) => {
                let cp = c as u32;
                let _ = if cp <= 0xFF {
                    write!(out, "\\x{cp:02x}")
                } else if cp <= 0xFFFF {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `str(value)` for template values: what `{{ value }}` prints.
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)` for template values (strings are quoted).
pub fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value, 0);
    out
}

const MAX_DEPTH: usize = 128;

fn write_repr(out: &mut String, value: &Value, depth: usize) {
    if depth > MAX_DEPTH {
        out.push_str("...");
        return;
    }
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if let Some(f) = as_float(value) {
                out.push_str(&float_repr(f));
            } else {
                out.push_str(&value.to_string());
            }
        }
        ValueKind::String => out.push_str(&str_repr(value.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item, depth + 1);
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key, depth + 1);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    write_repr(out, &item, depth + 1);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// The value as an `f64` if it is a floating-point number (not an integer).
fn as_float(value: &Value) -> Option<f64> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        f64::try_from(value.clone()).ok()
    } else {
        None
    }
}

/// Options of Python's `json.dumps` as transformers' `tojson` filter exposes them.
#[derive(Debug, Clone, Default)]
pub struct JsonOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: one item per line, indented by `s` per level.
    pub indent: Option<String>,
    /// Item and key separators; defaults depend on `indent` as in Python.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
}

/// Python's `json.dumps(value, ...)`.
pub fn json_dumps(value: &Value, options: &JsonOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &options.separators {
        Some((item, key)) => (item.clone(), key.clone()),
        None if options.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut writer = JsonWriter {
        out: String::new(),
        options,
        item_sep,
        key_sep,
    };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct JsonWriter<'a> {
    out: String,
    options: &'a JsonOptions,
    item_sep: String,
    key_sep: String,
}

impl JsonWriter<'_> {
    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.options.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0C}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(self.out, "\\u{:04x}", c as u32);
                }
                c if self.options.ensure_ascii && (c as u32) > 0x7E => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }

    fn key_text(key: &Value) -> Result<String, Error> {
        match key.kind() {
            ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
            ValueKind::None => Ok("null".to_owned()),
            ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
            ValueKind::Number => Ok(match as_float(key) {
                Some(f) => json_float(f),
                None => key.to_string(),
            }),
            _ => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            )),
        }
    }

    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        if depth > MAX_DEPTH {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value nested too deeply",
            ));
        }
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => match as_float(value) {
                Some(f) => self.out.push_str(&json_float(f)),
                None => self.out.push_str(&value.to_string()),
            },
            ValueKind::String => self.string(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    self.out.push_str("[]");
                    return Ok(());
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        let sep = self.item_sep.clone();
                        self.out.push_str(&sep);
                    }
                    self.newline(depth + 1);
                    self.value(item, depth + 1)?;
                }
                self.newline(depth);
                self.out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((Self::key_text(&key)?, item));
                }
                if self.options.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    self.out.push_str("{}");
                    return Ok(());
                }
                self.out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        let sep = self.item_sep.clone();
                        self.out.push_str(&sep);
                    }
                    self.newline(depth + 1);
                    self.string(key);
                    let sep = self.key_sep.clone();
                    self.out.push_str(&sep);
                    self.value(item, depth + 1)?;
                }
                self.newline(depth);
                self.out.push('}');
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }
}

/// A float as `json.dumps` writes it (`NaN`/`Infinity` for the non-finite ones).
fn json_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".to_owned()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned()
    } else {
        float_repr(f)
    }
}

/// Python's `str.isspace()` for one character: Unicode white space plus the
/// information separators U+001C..U+001F.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.rsplit(sep, maxsplit)`; `None` separator splits on runs of
/// white space, `maxsplit < 0` means no limit.
pub fn py_rsplit(s: &str, sep: Option<&str>, maxsplit: i64) -> Vec<String> {
    let limit = usize::try_from(maxsplit).unwrap_or(usize::MAX);
    let mut parts: Vec<String> = Vec::new();
    match sep {
        Some(sep) => {
            let mut rest = s;
            while parts.len() < limit {
                match rest.rfind(sep) {
                    Some(at) => {
                        parts.push(rest[at + sep.len()..].to_owned());
                        rest = &rest[..at];
                    }
                    None => break,
                }
            }
            parts.push(rest.to_owned());
        }
        None => {
            let mut rest = s.trim_end_matches(is_py_space);
            while !rest.is_empty() {
                if parts.len() >= limit {
                    parts.push(rest.to_owned());
                    break;
                }
                match rest.rfind(is_py_space) {
                    Some(at) => {
                        let space_len = rest[at..].chars().next().map_or(1, char::len_utf8);
                        parts.push(rest[at + space_len..].to_owned());
                        rest = rest[..at].trim_end_matches(is_py_space);
                    }
                    None => {
                        parts.push(rest.to_owned());
                        break;
                    }
                }
            }
        }
    }
    parts.reverse();
    parts
}

/// Python's `str.strip(chars)` family: `left`/`right` select the ends.
pub fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let matches = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(matches);
    }
    if right {
        out = out.trim_end_matches(matches);
    }
    out.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1.2345678901234567e17, "1.2345678901234566e+17"),
            (2.71, "2.71"),
            (100.0, "100.0"),
            (-0.0, "-0.0"),
            (2.5e-300, "2.5e-300"),
        ];
        for (value, expected) in cases {
            assert_eq!(float_repr(value), expected, "{value}");
        }
    }

    #[test]
    fn strings_repr_like_python() {
        assert_eq!(str_repr("a"), "'a'");
        assert_eq!(str_repr("it's"), "\"it's\"");
        assert_eq!(str_repr("'\""), "'\\'\"'");
        assert_eq!(str_repr("a\nb\\"), "'a\\nb\\\\'");
        assert_eq!(str_repr("\u{1}é\u{a0}"), "'\\x01é\\xa0'");
    }

    #[test]
    fn values_print_like_python() {
        let v = Value::from_pairs([
            ("a", Value::from(vec![Value::from(1), Value::from(true)])),
            ("b", Value::from(())),
            ("c", Value::from(1.5)),
        ]);
        assert_eq!(py_str(&v), "{'a': [1, True], 'b': None, 'c': 1.5}");
        let pair = Value::from_object(minijinja::value::Tuple::from([
            Value::from("k"),
            Value::from(1),
        ]));
        assert_eq!(py_str(&pair), "('k', 1)");
        let single = Value::from_object(minijinja::value::Tuple::from([Value::from(1)]));
        assert_eq!(py_str(&single), "(1,)");
    }

    #[test]
    fn json_like_python() -> Result<(), Error> {
        let v = Value::from_pairs([
            ("z", Value::from("é\"\n")),
            ("a", Value::from(vec![Value::from(1), Value::from(2.0)])),
            ("e", Value::from(Vec::<Value>::new())),
        ]);
        let plain = json_dumps(&v, &JsonOptions::default())?;
        assert_eq!(plain, r#"{"z": "é\"\n", "a": [1, 2.0], "e": []}"#);
        let ascii = json_dumps(
            &v,
            &JsonOptions {
                ensure_ascii: true,
                sort_keys: true,
                ..JsonOptions::default()
            },
        )?;
        assert_eq!(ascii, r#"{"a": [1, 2.0], "e": [], "z": "\u00e9\"\n"}"#);
        let pretty = json_dumps(
            &v,
            &JsonOptions {
                indent: Some("  ".to_owned()),
                ..JsonOptions::default()
            },
        )?;
        assert_eq!(
            pretty,
            "{\n  \"z\": \"é\\\"\\n\",\n  \"a\": [\n    1,\n    2.0\n  ],\n  \"e\": []\n}"
        );
        Ok(())
    }

    #[test]
    fn rsplit_like_python() {
        assert_eq!(py_rsplit("a.b.c", Some("."), 1), ["a.b", "c"]);
        assert_eq!(py_rsplit("a.b.c", Some("."), -1), ["a", "b", "c"]);
        assert_eq!(py_rsplit(".a.", Some("."), -1), ["", "a", ""]);
        assert_eq!(py_rsplit("  a b  c ", None, -1), ["a", "b", "c"]);
        assert_eq!(py_rsplit("  a b  c ", None, 1), ["  a b", "c"]);
        assert_eq!(py_rsplit("   ", None, -1), Vec::<String>::new());
    }

    #[test]
    fn strip_like_python() {
        assert_eq!(py_strip("\u{1c} a \n", None, true, true), "a");
        assert_eq!(py_strip("xxaxx", Some("x"), true, false), "axx");
    }
}

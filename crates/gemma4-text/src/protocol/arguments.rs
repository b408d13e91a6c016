//! Gemma 4's tool-call argument syntax turned into JSON text as it arrives.
//!
//! The model writes arguments as `{city:<|"|>Paris<|"|>,days:3,tags:[<|"|>a<|"|>]}`:
//! bare keys, strings between `<|"|>` delimiters taken verbatim, nested objects and
//! arrays, bare numbers, booleans and null. [`ArgumentWriter`] reads that one
//! character (or delimiter) at a time and writes the JSON that `json.dumps`
//! would give for the same value (`{"city": "Paris", "days": 3, "tags": ["a"]}`),
//! emitting each piece as soon as it can never change. So the pieces a stream
//! sends concatenate to exactly the text of a whole parse, however the input
//! was split. Bare values are held until their end is seen (`1` may become `12`);
//! a comma is written only when the next element starts, so a trailing comma
//! cannot make the JSON invalid.

/// Where in the argument object the writer is.
#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    /// Between elements: waiting for a key, a value, a comma or a closing bracket.
    None,
    /// Reading a bare key (up to `:`).
    BareKey(String),
    /// Reading a `<|"|>`-delimited key.
    QuotedKey(String),
    /// A quoted key has ended; waiting for its `:`.
    KeyDone(String),
    /// Inside a delimited string value (its text is written as it comes).
    Text,
    /// Reading a bare value (a number, `true`, `null`, or a bare word).
    Bare(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Object,
    Array,
}

/// What the current container expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// An object key (or `}`).
    Key,
    /// A value (or `]` in an array).
    Value,
    /// A `,` or the closing bracket.
    Separator,
}

/// Converts one call's argument text to JSON text incrementally.
#[derive(Debug, Clone)]
pub struct ArgumentWriter {
    stack: Vec<Container>,
    expect: Expect,
    scalar: Scalar,
    /// A `,` was read; `", "` is written when the next element starts.
    comma_pending: bool,
    /// The outermost `}` has been read: anything after it is ignored.
    complete: bool,
    started: bool,
}

impl Default for ArgumentWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl ArgumentWriter {
    /// A writer that has not yet seen the opening `{`.
    pub fn new() -> Self {
        Self {
            stack: Vec::new(),
            expect: Expect::Value,
            scalar: Scalar::None,
            comma_pending: false,
            complete: false,
            started: false,
        }
    }

    /// The outermost object has been closed.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Reads argument text (no delimiters in it); appends the JSON it completes to `out`.
    pub fn text(&mut self, text: &str, out: &mut String) {
        for c in text.chars() {
            if self.complete {
                return;
            }
            self.char(c, out);
        }
    }

    /// Reads one `<|"|>` string delimiter.
    pub fn delimiter(&mut self, out: &mut String) {
        if self.complete || !self.started {
            return;
        }
        match std::mem::replace(&mut self.scalar, Scalar::None) {
            Scalar::None => match self.expect {
                Expect::Key => self.scalar = Scalar::QuotedKey(String::new()),
                Expect::Value => {
                    self.begin_element(out);
                    out.push('"');
                    self.scalar = Scalar::Text;
                }
                // A string where a comma belongs: treat as a new element.
                Expect::Separator => {
                    self.comma_pending = true;
                    self.expect = self.element_expect();
                    self.delimiter(out);
                }
            },
            Scalar::QuotedKey(key) => self.scalar = Scalar::KeyDone(key),
            Scalar::Text => {
                out.push('"');
                self.expect = Expect::Separator;
            }
            // A delimiter inside a bare key or value: end it there.
            Scalar::BareKey(key) | Scalar::KeyDone(key) => self.scalar = Scalar::KeyDone(key),
            Scalar::Bare(word) => {
                out.push_str(&bare_value(&word));
                self.expect = Expect::Separator;
            }
        }
    }

    /// The call ended (`<tool_call|>`): closes whatever is open so that the
    /// arguments are a complete JSON object.
    pub fn close(&mut self, out: &mut String) {
        if self.complete {
            return;
        }
        if !self.started {
            out.push_str("{}");
            self.complete = true;
            return;
        }
        match std::mem::replace(&mut self.scalar, Scalar::None) {
            Scalar::Text => out.push('"'),
            Scalar::Bare(word) => out.push_str(&bare_value(&word)),
            Scalar::None | Scalar::BareKey(_) | Scalar::QuotedKey(_) | Scalar::KeyDone(_) => {
                // A key was written without its value.
                if self.expect == Expect::Value && self.stack.last() == Some(&Container::Object) {
                    out.push_str("null");
                }
            }
        }
        while let Some(container) = self.stack.pop() {
            out.push(closing(container));
        }
        self.complete = true;
    }

    fn element_expect(&self) -> Expect {
        match self.stack.last() {
            Some(Container::Object) => Expect::Key,
            _ => Expect::Value,
        }
    }

    /// Writes the separator owed before a new element.
    fn begin_element(&mut self, out: &mut String) {
        if std::mem::take(&mut self.comma_pending) {
            out.push_str(", ");
        }
    }

    fn open(&mut self, container: Container, out: &mut String) {
        out.push(match container {
            Container::Object => '{',
            Container::Array => '[',
        });
        self.stack.push(container);
        self.expect = self.element_expect();
    }

    fn close_container(&mut self, out: &mut String) {
        self.comma_pending = false;
        if let Some(container) = self.stack.pop() {
            out.push(closing(container));
        }
        if self.stack.is_empty() {
            self.complete = true;
        }
        self.expect = Expect::Separator;
    }

    fn char(&mut self, c: char, out: &mut String) {
        if !self.started {
            if c == '{' {
                self.started = true;
                self.open(Container::Object, out);
            }
            return;
        }
        match &mut self.scalar {
            Scalar::Text => {
                push_escaped(c, out);
                return;
            }
            Scalar::BareKey(key) => {
                if c == ':' {
                    let key = std::mem::take(key);
                    self.scalar = Scalar::None;
                    self.write_key(key.trim(), out);
                } else if c == '}' && key.trim().is_empty() {
                    self.scalar = Scalar::None;
                    self.close_container(out);
                } else {
                    key.push(c);
                }
                return;
            }
            Scalar::QuotedKey(key) => {
                key.push(c);
                return;
            }
            Scalar::KeyDone(key) => {
                if c == ':' {
                    let key = std::mem::take(key);
                    self.scalar = Scalar::None;
                    self.write_key(&key, out);
                }
                return;
            }
            Scalar::Bare(word) => {
                if !matches!(c, ',' | '}' | ']') {
                    word.push(c);
                    return;
                }
                let word = std::mem::take(word);
                self.scalar = Scalar::None;
                out.push_str(&bare_value(&word));
                self.expect = Expect::Separator;
                // The terminator is read below.
            }
            Scalar::None => {}
        }
        if c.is_whitespace() {
            return;
        }
        let in_object = self.stack.last() == Some(&Container::Object);
        match (self.expect, c) {
            (Expect::Separator, ',') => {
                self.comma_pending = true;
                self.expect = self.element_expect();
            }
            (_, '}') if in_object => self.close_container(out),
            (_, ']') if !in_object => self.close_container(out),
            (Expect::Key, ',') => {}
            (Expect::Key, _) => self.scalar = Scalar::BareKey(c.to_string()),
            (Expect::Value, '{') => {
                self.begin_element(out);
                self.open(Container::Object, out);
            }
            (Expect::Value, '[') => {
                self.begin_element(out);
                self.open(Container::Array, out);
            }
            (Expect::Value, ',') => {}
            (Expect::Value, _) => {
                self.begin_element(out);
                self.scalar = Scalar::Bare(c.to_string());
            }
            // Stray characters after a complete value.
            (Expect::Separator, _) => {}
        }
    }

    fn write_key(&mut self, key: &str, out: &mut String) {
        self.begin_element(out);
        push_json_string(key, out);
        out.push_str(": ");
        self.expect = Expect::Value;
    }
}

fn closing(container: Container) -> char {
    match container {
        Container::Object => '}',
        Container::Array => ']',
    }
}

/// The JSON for a bare value: a number, boolean or null when it reads as one
/// (Python spellings `True`, `None` included), otherwise a string.
fn bare_value(word: &str) -> String {
    let word = word.trim();
    match word {
        "true" | "True" => return "true".into(),
        "false" | "False" => return "false".into(),
        "null" | "none" | "None" | "nil" => return "null".into(),
        _ => {}
    }
    let numeric = word.bytes().any(|b| b.is_ascii_digit())
        && word
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'));
    if numeric {
        if let Ok(i) = word.parse::<i64>() {
            return i.to_string();
        }
        if let Some(n) = word
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
        {
            return n.to_string();
        }
    }
    let mut out = String::new();
    push_json_string(word, &mut out);
    out
}

fn push_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        push_escaped(c, out);
    }
    out.push('"');
}

/// One character of a JSON string body, escaped as `json.dumps(ensure_ascii=False)` does.
fn push_escaped(c: char, out: &mut String) {
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        '\u{8}' => out.push_str("\\b"),
        '\u{c}' => out.push_str("\\f"),
        c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
        c => out.push(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `parts` (text, with `None` for a delimiter) through a writer, closed at the end.
    fn convert(parts: &[Option<&str>]) -> String {
        let mut w = ArgumentWriter::new();
        let mut out = String::new();
        for part in parts {
            match part {
                Some(t) => w.text(t, &mut out),
                None => w.delimiter(&mut out),
            }
        }
        w.close(&mut out);
        out
    }

    const Q: Option<&str> = None;

    #[test]
    fn scalars_follow_python_json() {
        assert_eq!(
            convert(&[Some("{a:1,b:2.50,c:true,d:None,e:-3e2,f:word}")]),
            r#"{"a": 1, "b": 2.5, "c": true, "d": null, "e": -300.0, "f": "word"}"#
        );
    }

    #[test]
    fn strings_are_verbatim_and_escaped() {
        let out = convert(&[Some("{s:"), Q, Some("a \"q\" {x}, y: \\ \n"), Q, Some("}")]);
        assert_eq!(out, r#"{"s": "a \"q\" {x}, y: \\ \n"}"#);
        let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
        assert_eq!(v["s"], "a \"q\" {x}, y: \\ \n");
    }

    #[test]
    fn nesting_and_trailing_commas() {
        let out = convert(&[
            Some("{o:{k:["),
            Q,
            Some("x"),
            Q,
            Some(",1,{},[],],},e:{},}"),
        ]);
        assert_eq!(out, r#"{"o": {"k": ["x", 1, {}, []]}, "e": {}}"#);
    }

    #[test]
    fn unfinished_arguments_are_closed() {
        assert_eq!(convert(&[Some("{a:["), Q, Some("x")]), r#"{"a": ["x"]}"#);
        assert_eq!(convert(&[Some("{a:")]), r#"{"a": null}"#);
        assert_eq!(convert(&[Some("{a:12")]), r#"{"a": 12}"#);
        assert_eq!(convert(&[]), "{}");
    }

    #[test]
    fn quoted_keys() {
        assert_eq!(
            convert(&[Some("{"), Q, Some("a b"), Q, Some(":1}")]),
            r#"{"a b": 1}"#
        );
    }
}

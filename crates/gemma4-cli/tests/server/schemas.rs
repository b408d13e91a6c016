//! Enforced output over random schemas, written by random weights with the
//! real vocabulary: every forced tool call and every `response_format` reply
//! validates against its schema (checked by the `jsonschema` crate, formats
//! included) and finishes, and the stream concatenates to the whole reply.

use serde_json::{json, Value};

use crate::harness::{EventStream, ServerProc};

/// A small deterministic generator (xorshift), so every run sees the same schemas.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

/// A schema whose values are short: bounded strings, arrays and numbers.
fn leaf(r: &mut Rng) -> Value {
    match r.below(9) {
        0 => {
            let lo = r.below(3);
            json!({"type": "string", "minLength": lo, "maxLength": lo + 1 + r.below(6)})
        }
        1 => json!({"type": "string", "maxLength": 8,
                    "pattern": r.pick(&["^[a-z]{1,4}$", "^[0-9]{2}-[A-F]$", "^(red|green|blue)$"])}),
        // Bounded too: an address's local part has no length limit of its own.
        2 => json!({"type": "string", "maxLength": 40,
                    "format": r.pick(&["date", "time", "date-time", "uuid", "ipv4", "email", "uri", "duration", "ipv6"])}),
        3 => {
            let lo = r.below(2_000_000) as i64 - 1_000_000;
            json!({"type": "integer", "minimum": lo, "maximum": lo + r.below(1_000_000_000) as i64})
        }
        4 => {
            let lo = r.below(100) as i64 - 50;
            json!({"type": "number", "minimum": lo, "maximum": lo + 1 + r.below(20) as i64, "multipleOf": 0.25})
        }
        5 => json!({"type": "boolean"}),
        6 => json!({"type": ["string", "null"], "maxLength": 3}),
        7 => json!({"enum": ["x", 2, true, null]}),
        _ => json!({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}),
    }
}

fn schema(r: &mut Rng, depth: u32) -> Value {
    if depth == 0 || r.below(3) == 0 {
        return leaf(r);
    }
    match r.below(4) {
        0 => {
            let lo = r.below(2);
            json!({"type": "array", "items": schema(r, depth - 1), "minItems": lo, "maxItems": lo + r.below(3)})
        }
        1 => json!({"type": "array", "prefixItems": [schema(r, depth - 1), schema(r, depth - 1)],
                    "items": false, "minItems": 1}),
        2 => json!({"anyOf": [schema(r, depth - 1), schema(r, depth - 1)]}),
        _ => object(r, depth - 1),
    }
}

/// A closed object of one to four properties, some required.
fn object(r: &mut Rng, depth: u32) -> Value {
    let mut properties = serde_json::Map::new();
    let mut required = Vec::new();
    for _ in 0..1 + r.below(4) {
        let key = r.pick(&["a", "b", "city", "x y", "n:1", "_id"]);
        properties.insert(key.into(), schema(r, depth));
        if r.below(2) == 0 && !required.contains(&key) {
            required.push(key);
        }
    }
    json!({"type": "object", "properties": properties, "required": required,
           "additionalProperties": false})
}

fn check(schema: &Value, value: &Value, what: &str) {
    let validator = jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .unwrap_or_else(|e| panic!("the test's schema {schema}: {e}"));
    let errors: Vec<String> = validator
        .iter_errors(value)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{what}: {value} breaks {schema}: {errors:?}"
    );
}

/// The calls (name, arguments), content and finish reason of a whole reply.
fn whole(server: &ServerProc, body: &Value) -> (Vec<(String, String)>, String, String) {
    let r = server.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let f = &c["function"];
            (
                f["name"].as_str().unwrap_or_default().to_string(),
                f["arguments"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let content = choice["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (
        calls,
        content,
        choice["finish_reason"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

/// The same, folded from the stream's chunks.
fn streamed(server: &ServerProc, body: &Value) -> (Vec<(String, String)>, String, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let mut stream = EventStream::open(server.port, "/v1/chat/completions", &body);
    let (mut calls, mut content, mut finish) =
        (Vec::<(String, String)>::new(), String::new(), String::new());
    for data in stream.rest() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{data}: {e}"));
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = f.to_string();
            }
            content.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
            for call in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let i = call["index"].as_u64().expect("index") as usize;
                if calls.len() <= i {
                    calls.resize(i + 1, Default::default());
                }
                calls[i]
                    .0
                    .push_str(call["function"]["name"].as_str().unwrap_or_default());
                calls[i]
                    .1
                    .push_str(call["function"]["arguments"].as_str().unwrap_or_default());
            }
        }
    }
    (calls, content, finish)
}

#[test]
fn forced_calls_and_response_formats_over_random_schemas_validate_and_finish() {
    let server = ServerProc::start(crate::real_vocab::dir(), &[], &[]);
    let mut r = Rng(0x5eed_3939);
    let other = json!({"type": "function", "function": {"name": "other",
        "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}});
    for case in 0..10 {
        let params = object(&mut r, 2);
        let tools =
            json!([{"type": "function", "function": {"name": "f", "parameters": params}}, other]);
        let messages = json!([{"role": "user", "content": "Call the tool."}]);
        for choice in [
            json!({"type": "function", "function": {"name": "f"}}),
            json!("required"),
        ] {
            let body = json!({"messages": messages, "tools": tools, "tool_choice": choice,
                              "parallel_tool_calls": false, "max_tokens": 600, "temperature": 0});
            let whole = whole(&server, &body);
            let (calls, _, finish) = &whole;
            assert_eq!(finish, "tool_calls", "case {case}, {choice}: {whole:?}");
            assert_eq!(calls.len(), 1, "one call without parallel calls: {whole:?}");
            let (name, arguments) = &calls[0];
            let args: Value = serde_json::from_str(arguments)
                .unwrap_or_else(|e| panic!("case {case}: {arguments:?} is not JSON ({e})"));
            let schema = if name == "f" {
                &params
            } else {
                &other["function"]["parameters"]
            };
            check(schema, &args, &format!("case {case}, {choice}, {name}"));
            assert_eq!(
                streamed(&server, &body),
                whole,
                "case {case}, {choice}: streamed == whole"
            );
        }
        let body = json!({"messages": messages, "max_tokens": 600, "temperature": 0,
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "out", "strict": true, "schema": params}}});
        let whole = whole(&server, &body);
        let (_, content, finish) = &whole;
        assert_eq!(finish, "stop", "case {case}: {params} {whole:?}");
        let value: Value = serde_json::from_str(content)
            .unwrap_or_else(|e| panic!("case {case}: {content:?} is not JSON ({e})"));
        check(&params, &value, &format!("case {case}, response_format"));
        assert_eq!(
            streamed(&server, &body),
            whole,
            "case {case}: streamed == whole"
        );
    }
}

/// A schema keyword the call grammar cannot enforce is a 400 naming it and
/// the tool; values that ask for nothing are accepted.
#[test]
fn unenforceable_tool_schemas_are_refused_and_neutral_fields_accepted() {
    let server = ServerProc::start(&crate::harness::fixture("e-style"), &[], &[]);
    let tools = json!([{"type": "function", "function": {"name": "pick",
        "parameters": {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": true}}}}}]);
    let r = server.post("/v1/chat/completions", &json!({
        "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}));
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "tools[0].function.parameters", "{e}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("uniqueItems") && message.contains("\"pick\""),
        "{message}"
    );

    let r = server.post(
        "/v1/responses",
        &json!({"input": "hi", "max_output_tokens": 4,
        "include": [], "background": false, "parallel_tool_calls": false}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = server.post(
        "/v1/responses",
        &json!({"input": "hi", "max_output_tokens": 4, "background": true}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "background");
    // Fields a Response repeats are checked before they are repeated, and
    // the Responses route names its own fields.
    for (body, param) in [
        (
            json!({"input": "hi", "max_output_tokens": 4, "metadata": [1]}),
            "metadata",
        ),
        (json!({"input": [], "max_output_tokens": 4}), "input"),
        (
            json!({"input": "hi", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
    ] {
        let r = server.post("/v1/responses", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
}

/// `$defs` where each level offers four alternatives of the one below, with
/// `beside` added at every level.
fn chain(depth: usize, beside: Value) -> Value {
    let mut defs = serde_json::Map::new();
    defs.insert("d0".into(), json!({"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}));
    for i in 1..=depth {
        let mut level = beside.as_object().cloned().unwrap_or_default();
        let option = json!({"$ref": format!("#/$defs/d{}", i - 1)});
        level.insert("anyOf".into(), Value::Array(vec![option; 4]));
        defs.insert(format!("d{i}"), Value::Object(level));
    }
    json!({"$defs": defs, "type": "object",
        "properties": {"v": {"$ref": format!("#/$defs/d{depth}")}}, "required": ["v"]})
}

fn forced(params: &Value) -> Value {
    json!({"messages": [{"role": "user", "content": "Call the tool."}],
           "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
           "tool_choice": "required", "max_tokens": 60, "temperature": 0})
}

/// Clients that send the costliest schemas (alternatives of alternatives,
/// each merged with the keyword beside it) get a 400 naming the budget in
/// bounded time, while the probes keep answering within a second and the
/// server's memory stays bounded; the same chain with nothing beside its
/// alternatives is cheap, and its call holds.
#[test]
fn the_worst_schemas_are_refused_in_bounded_time_while_probes_answer() {
    let server = ServerProc::start(crate::real_vocab::dir(), &[], &[]);
    let cheap = chain(10, json!({"description": "a level"}));
    let (calls, _, finish) = whole(&server, &forced(&cheap));
    assert_eq!(finish, "tool_calls");
    let args: Value = serde_json::from_str(&calls[0].1).expect("JSON arguments");
    check(&cheap, &args, "the ten-level chain");

    let before = server.rss_kib();
    let worst = forced(&chain(10, json!({"type": "object"})));
    let port = server.port;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooders: Vec<_> = (0..6)
        .map(|_| {
            let worst = worst.clone();
            std::thread::spawn(move || {
                let body = serde_json::to_vec(&worst).expect("body");
                (0..3)
                    .map(|_| {
                        let started = std::time::Instant::now();
                        let r = crate::harness::request(
                            port,
                            "POST",
                            "/v1/chat/completions",
                            &[("Content-Type", "application/json")],
                            Some(&body),
                        );
                        (r, started.elapsed())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let prober = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut slowest = std::time::Duration::ZERO;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let started = std::time::Instant::now();
                let r = crate::harness::request(port, "GET", "/health", &[], None);
                assert_eq!(r.status, 200, "{}", r.body);
                slowest = slowest.max(started.elapsed());
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            slowest
        })
    };
    for flooder in flooders {
        for (r, took) in flooder.join().expect("flooder") {
            assert_eq!(r.status, 400, "{}", r.body);
            assert!(r.body.contains("more than 10000 subschemas"), "{}", r.body);
            assert!(
                took < std::time::Duration::from_secs(20),
                "refused after {took:?}"
            );
        }
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let slowest = prober.join().expect("prober");
    assert!(
        slowest < std::time::Duration::from_secs(1),
        "/health took {slowest:?}"
    );
    let grown = server.rss_kib().saturating_sub(before);
    assert!(grown < 512 * 1024, "resident memory grew by {grown} KiB");
}

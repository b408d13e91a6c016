//! Prometheus text exposition: just enough parsing to read gauges.

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// All samples of a Prometheus text page. Comment lines and lines that do not
/// parse are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(inner)?;
        labels = parsed;
        rest = after;
    }
    let value_text = rest.split_whitespace().next()?;
    let value = match value_text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` and returns the labels and the text after `}`.
fn parse_labels(text: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    let mut chars = text.char_indices().peekable();
    loop {
        while chars
            .peek()
            .is_some_and(|(_, c)| c.is_whitespace() || *c == ',')
        {
            chars.next();
        }
        let (start, c) = *chars.peek()?;
        if c == '}' {
            return Some((labels, &text[start + 1..]));
        }
        let eq = text[start..].find('=')? + start;
        let key = text[start..eq].trim().to_owned();
        while chars.peek().is_some_and(|(i, _)| *i <= eq) {
            chars.next();
        }
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            let (_, c) = chars.next()?;
            match c {
                '"' => break,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                other => value.push(other),
            }
        }
        labels.push((key, value));
    }
}

/// The value of the first sample named `name`, whatever its labels.
pub fn value(samples: &[Sample], name: &str) -> Option<f64> {
    samples.iter().find(|s| s.name == name).map(|s| s.value)
}

/// The first of `names` that has a sample.
pub fn first_of(samples: &[Sample], names: &[&str]) -> Option<f64> {
    names.iter().find_map(|n| value(samples, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_gauges_counters_and_labels() {
        let page = "# HELP gemma4_kv_blocks_total KV blocks\n# TYPE gemma4_kv_blocks_total gauge\n\
            gemma4_kv_blocks_total 512\n\
            http_requests_total{route=\"/v1/completions\",status=\"200\"} 7 1700000000\n\
            vllm:cache_config_info{block_size=\"16\", num_gpu_blocks=\"100\",note=\"a \\\"q\\\"\"} 1.0\n\
            bucket{le=\"+Inf\"} +Inf\n\
            garbage line here\n";
        let s = parse(page);
        assert_eq!(value(&s, "gemma4_kv_blocks_total"), Some(512.0));
        let http = s.iter().find(|x| x.name == "http_requests_total");
        assert_eq!(http.and_then(|h| h.label("status")), Some("200"));
        assert_eq!(http.map(|h| h.value), Some(7.0));
        let info = s.iter().find(|x| x.name == "vllm:cache_config_info");
        assert_eq!(info.and_then(|i| i.label("num_gpu_blocks")), Some("100"));
        assert_eq!(info.and_then(|i| i.label("note")), Some("a \"q\""));
        assert_eq!(value(&s, "bucket"), Some(f64::INFINITY));
        assert_eq!(value(&s, "garbage"), None);
        assert_eq!(
            first_of(&s, &["missing", "gemma4_kv_blocks_total"]),
            Some(512.0)
        );
    }
}

//! A Responses request is served as a chat request; an error the chat path
//! finds names the chat request's fields. These are the Responses request's
//! own names for them: `messages[i]` becomes the `input` item (or the
//! `instructions`) that message came from, an assistant message's
//! `tool_calls[j]` the `function_call` item of that call, and the settings
//! their Responses spelling.

use crate::error::{rename_field, ApiError};

/// Where a chat message came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Origin {
    Instructions,
    /// `input` given as a string.
    Input,
    /// The `input` item at this index.
    Item(usize),
    /// Consecutive `function_call` items, one per call of the message.
    Calls(Vec<usize>),
}

/// Chat settings and their Responses names (the first that prefixes wins).
const SETTINGS: &[(&str, &str)] = &[
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("tool_choice.allowed_tools", "tool_choice"),
];

/// `e` with every chat field it names given its Responses name.
pub(super) fn restate(e: ApiError, origins: &[Origin]) -> ApiError {
    e.renamed(|name| responses_name(name, origins))
}

/// The Responses name of a chat field (unchanged when it has none).
fn responses_name(name: &str, origins: &[Origin]) -> String {
    if name == "messages" {
        return "input".into();
    }
    if let Some(rest) = name.strip_prefix("messages[") {
        if let Some(renamed) = message_name(rest, origins) {
            return renamed;
        }
    }
    if let Some(rest) = name.strip_prefix("tools[") {
        // A Responses tool is the chat tool's `function`, flattened.
        if let Some((i, rest)) = rest.split_once(']') {
            let rest = rest.strip_prefix(".function").unwrap_or(rest);
            return format!("tools[{i}]{rest}");
        }
    }
    rename_field(name, SETTINGS).unwrap_or_else(|| name.to_string())
}

/// `messages[` `rest`: the input item the message came from.
fn message_name(rest: &str, origins: &[Origin]) -> Option<String> {
    let (index, rest) = rest.split_once(']')?;
    let origin = origins.get(index.parse::<usize>().ok()?)?;
    Some(match origin {
        Origin::Instructions => "instructions".into(),
        Origin::Input => "input".into(),
        // An `input_image` part holds its URL as a string.
        Origin::Item(k) => format!("input[{k}]{}", rest.replace(".image_url.url", ".image_url")),
        Origin::Calls(items) => {
            let call = rest
                .strip_prefix(".tool_calls[")
                .and_then(|r| r.split_once(']'));
            match call {
                Some((j, field)) => {
                    let k = items.get(j.parse::<usize>().ok()?)?;
                    format!(
                        "input[{k}]{}",
                        field.strip_prefix(".function").unwrap_or(field)
                    )
                }
                None => format!("input[{}]", items.first()?),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_names_become_the_requests_own() {
        let origins = [
            Origin::Instructions,
            Origin::Item(0),
            Origin::Calls(vec![2, 3]),
            Origin::Item(4),
        ];
        let name = |n: &str| responses_name(n, &origins);
        assert_eq!(name("messages"), "input");
        assert_eq!(name("messages[0].content"), "instructions");
        assert_eq!(
            name("messages[1].content[2].image_url.url"),
            "input[0].content[2].image_url"
        );
        assert_eq!(
            name("messages[2].tool_calls[1].function.arguments"),
            "input[3].arguments"
        );
        assert_eq!(name("messages[3].content"), "input[4].content");
        assert_eq!(name("max_tokens"), "max_output_tokens");
        assert_eq!(name("response_format"), "text.format");
        assert_eq!(name("tools[1].function.parameters"), "tools[1].parameters");
        assert_eq!(
            name("tool_choice.allowed_tools.tools[0]"),
            "tool_choice.tools[0]"
        );
        assert_eq!(name("temperature"), "temperature");
        assert_eq!(name("max_tokensx"), "max_tokensx");

        let e = ApiError::bad_request(
            "`messages[2].tool_calls[0].function.arguments` is not valid JSON (expected `,`)",
        )
        .with_param("messages[2].tool_calls[0].function.arguments");
        let e = restate(e, &origins);
        assert_eq!(e.param.as_deref(), Some("input[2].arguments"));
        assert_eq!(
            e.message,
            "`input[2].arguments` is not valid JSON (expected `,`)"
        );
    }
}

//! Text handling for Gemma 4 (and Gemma 3) models: everything between a chat
//! request and token ids, and back.
//!
//! * [`Tokenizer`] loads a checkpoint's `tokenizer.json` (with
//!   `tokenizer_config.json` and `chat_template.jinja`) or rebuilds the tokenizer
//!   from a GGUF file's `tokenizer.ggml.*` metadata, and knows the stop tokens.
//! * [`ChatTemplate`] renders the checkpoint's Jinja chat template so that the
//!   output is byte-identical to Hugging Face transformers' `apply_chat_template`.
//! * [`IncrementalDecoder`] turns generated ids into text one id at a time without
//!   splitting characters, keeping Gemma 4's tool-call and thinking markers visible.
//! * [`RequestOutput`] is one request's output: each id detokenized once, stop
//!   strings applied ([`TextOutput`]), and a Gemma 4 chat turn read by the
//!   [`TurnParser`] into typed events: answer, reasoning and tool calls (with
//!   arguments as JSON). [`ChannelState`] says where a turn stands, id by id.
//! * [`GgufMetadata`] reads the metadata section of GGUF files.
//!
//! Templates run in MiniJinja with Python semantics layered on top (Python's
//! printing of `None`/`True`/floats/lists/tuples, `json.dumps`-style `tojson`,
//! Python string and dict methods, `raise_exception`, `strftime_now`). One Jinja2
//! feature has no equivalent: printf-style string formatting with `%`.

mod chat_template;
mod detok;
mod error;
mod gguf;
mod gguf_tokenizer;
mod output;
mod protocol;
mod pyfmt;
mod special;
mod strftime;
mod tokenizer;

pub use chat_template::ChatTemplate;
pub use detok::IncrementalDecoder;
pub use error::{Result, TextError};
pub use gguf::{GgufMetadata, GgufValue};
pub use output::{OutputStep, Piece, Reading, Released, RequestOutput, TextOutput};
pub use protocol::{
    ArgumentWriter, AssistantMessage, Channel, ChannelState, Marker, OutputEvent, ProtocolTokens,
    ToolCall, TurnParser,
};
pub use special::{MARKUP_TOKENS, STOP_TOKENS};
pub use tokenizer::{gguf_add_bos_token, gguf_chat_template, Tokenizer};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shareable_between_threads() {
        assert_send_sync::<crate::Tokenizer>();
        assert_send_sync::<crate::ChatTemplate>();
        assert_send_sync::<crate::IncrementalDecoder<Arc<crate::Tokenizer>>>();
    }
}

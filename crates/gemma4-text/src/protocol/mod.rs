//! Gemma 4's output protocol: generated token ids in, typed events out.
//!
//! A model turn mixes three kinds of text, told apart by special tokens:
//! reasoning (`<|channel>thought\n…<channel|>`), tool calls
//! (`<|tool_call>call:NAME{…}<tool_call|>`, strings inside between `<|"|>`) and
//! the answer (everything else). [`OutputProcessor`] reads one request's ids and
//! yields [`OutputEvent`]s: content and reasoning deltas, and for each tool call
//! a start (id and name, once), argument deltas (JSON text) and an end. The
//! markers are recognised by token id, never by searching text, so a string
//! that merely looks like a marker stays text. [`AssistantMessage`] folds the
//! events into a whole message; a stream that sends every event as it comes
//! therefore shows exactly what the collected response holds.
//!
//! Generation may end early through a stop string that the engine matched on
//! text; the engine then releases less text than the ids decode to. The
//! processor is told how much text was released with each id and only
//! interprets that much, so a stop string cuts the answer here too.

mod arguments;

use std::sync::Arc;

use crate::detok::IncrementalDecoder;
use crate::error::Result;
use crate::tokenizer::Tokenizer;

pub use arguments::ArgumentWriter;

/// The spelling of each protocol marker.
const TOOL_CALL_OPEN: &str = "<|tool_call>";
const TOOL_CALL_CLOSE: &str = "<tool_call|>";
const STRING_DELIMITER: &str = "<|\"|>";
const CHANNEL_OPEN: &str = "<|channel>";
const CHANNEL_CLOSE: &str = "<channel|>";
const TOOL_RESPONSE_OPEN: &str = "<|tool_response>";
const TOOL_RESPONSE_CLOSE: &str = "<tool_response|>";
const TOOL_DECLARATION_OPEN: &str = "<|tool>";
const TOOL_DECLARATION_CLOSE: &str = "<tool|>";
const TURN_OPEN: &str = "<|turn>";
/// The label that opens a thought channel; it is not part of the reasoning.
const THOUGHT_LABEL: &str = "thought\n";

/// A protocol marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    ToolCallOpen,
    ToolCallClose,
    StringDelimiter,
    ChannelOpen,
    ChannelClose,
    ToolResponseOpen,
    ToolResponseClose,
    /// Tool declarations belong to the system turn; in output they are stray.
    DeclarationOpen,
    DeclarationClose,
}

impl Marker {
    const ALL: [Marker; 9] = [
        Marker::ToolCallOpen,
        Marker::ToolCallClose,
        Marker::StringDelimiter,
        Marker::ChannelOpen,
        Marker::ChannelClose,
        Marker::ToolResponseOpen,
        Marker::ToolResponseClose,
        Marker::DeclarationOpen,
        Marker::DeclarationClose,
    ];

    /// The token's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Marker::ToolCallOpen => TOOL_CALL_OPEN,
            Marker::ToolCallClose => TOOL_CALL_CLOSE,
            Marker::StringDelimiter => STRING_DELIMITER,
            Marker::ChannelOpen => CHANNEL_OPEN,
            Marker::ChannelClose => CHANNEL_CLOSE,
            Marker::ToolResponseOpen => TOOL_RESPONSE_OPEN,
            Marker::ToolResponseClose => TOOL_RESPONSE_CLOSE,
            Marker::DeclarationOpen => TOOL_DECLARATION_OPEN,
            Marker::DeclarationClose => TOOL_DECLARATION_CLOSE,
        }
    }
}

/// The ids of the protocol markers in one vocabulary (looked up by spelling;
/// a vocabulary without them, such as Gemma 3's, has none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProtocolTokens {
    markers: Vec<(u32, Marker)>,
    turn_open: Option<u32>,
}

impl ProtocolTokens {
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let markers = Marker::ALL
            .iter()
            .filter_map(|&m| tokenizer.token_to_id(m.as_str()).map(|id| (id, m)))
            .collect();
        Self {
            markers,
            turn_open: tokenizer.token_to_id(TURN_OPEN),
        }
    }

    /// The marker an id stands for.
    pub fn marker(&self, id: u32) -> Option<Marker> {
        self.markers
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, marker)| *marker)
    }

    /// The id of a marker, if the vocabulary has it.
    pub fn id(&self, marker: Marker) -> Option<u32> {
        self.markers
            .iter()
            .find(|(_, m)| *m == marker)
            .map(|(id, _)| *id)
    }

    /// Whether the vocabulary speaks the Gemma 4 tool and thinking protocol.
    pub fn has_protocol(&self) -> bool {
        self.id(Marker::ToolCallOpen).is_some() && self.id(Marker::ChannelOpen).is_some()
    }

    /// Whether a prompt ends inside an open thought channel (the template opened
    /// one for the model to continue, e.g. after a tool response with thinking on);
    /// the completion then starts as reasoning. The second value says whether the
    /// channel's `thought\n` label is still to come.
    pub fn prompt_state(&self, prompt: &[u32]) -> Option<bool> {
        for (pos, &id) in prompt.iter().enumerate().rev() {
            if Some(id) == self.turn_open {
                return None;
            }
            match self.marker(id) {
                Some(Marker::ChannelOpen) => return Some(pos + 1 == prompt.len()),
                Some(Marker::ChannelClose | Marker::ToolCallOpen | Marker::ToolCallClose) => {
                    return None
                }
                _ => {}
            }
        }
        None
    }
}

/// One piece of a parsed model turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// Answer text.
    Content(String),
    /// Thinking text (`reasoning_content`).
    Reasoning(String),
    /// A tool call begins: its position among the turn's calls, its id, its name.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of a call's `arguments` JSON text.
    ToolCallArguments { index: usize, delta: String },
    /// A call is complete (its arguments are a whole JSON object).
    ToolCallEnd { index: usize },
}

/// How the turn ended, as OpenAI's `finish_reason` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnEnd {
    /// The model stopped (stop token or stop string).
    Stop,
    /// Out of tokens.
    Length,
}

/// A tool call of a collected message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON text; a complete object unless the output was cut off mid-call.
    pub arguments: String,
    pub complete: bool,
}

/// A whole assistant message, folded from [`OutputEvent`]s.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AssistantMessage {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

impl AssistantMessage {
    /// Adds one event.
    pub fn apply(&mut self, event: &OutputEvent) {
        match event {
            OutputEvent::Content(t) => self.content.push_str(t),
            OutputEvent::Reasoning(t) => self.reasoning.push_str(t),
            OutputEvent::ToolCallStart { id, name, .. } => self.tool_calls.push(ToolCall {
                id: id.clone(),
                name: name.clone(),
                ..ToolCall::default()
            }),
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some(call) = self.tool_calls.get_mut(*index) {
                    call.arguments.push_str(delta);
                }
            }
            OutputEvent::ToolCallEnd { index } => {
                if let Some(call) = self.tool_calls.get_mut(*index) {
                    call.complete = true;
                }
            }
        }
    }

    /// Folds a sequence of events.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a OutputEvent>) -> Self {
        let mut message = Self::default();
        for e in events {
            message.apply(e);
        }
        message
    }
}

/// The stretch of the turn being read.
#[derive(Debug)]
enum Mode {
    Content,
    /// Thinking; `label` holds what may still be the `thought\n` label.
    Reasoning {
        label: Option<String>,
    },
    /// Between `<|tool_call>` and the `{` after the name.
    CallHeader {
        header: String,
    },
    /// Reading a call's arguments.
    CallArguments {
        index: usize,
        writer: ArgumentWriter,
    },
    /// After a tool response marker: nothing of it is the model's answer.
    ToolResponse,
}

/// A decoded stretch of output: text, or a marker.
#[derive(Debug)]
enum Piece {
    Text(String),
    Marker(Marker),
}

/// Reads one request's generated ids and yields its [`OutputEvent`]s.
#[derive(Debug)]
pub struct OutputProcessor {
    tokens: ProtocolTokens,
    tokenizer: Arc<Tokenizer>,
    /// Decodes the text since the last marker.
    decoder: IncrementalDecoder<Arc<Tokenizer>>,
    /// Decoded but not yet interpreted (waiting for the engine to release it).
    pieces: std::collections::VecDeque<Piece>,
    /// Bytes the engine has released and the processor has not yet interpreted.
    released: usize,
    mode: Mode,
    call_id_prefix: String,
    calls: usize,
    completed_calls: usize,
    reasoning_tokens: usize,
    /// Token-level view of whether the model is thinking (for counting and budgets).
    thinking_now: bool,
}

impl OutputProcessor {
    /// A processor for a completion of `prompt`; tool-call ids are
    /// `{call_id_prefix}{n}` for the turn's n-th call.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt: &[u32], call_id_prefix: String) -> Self {
        let tokens = ProtocolTokens::new(&tokenizer);
        let (mode, thinking_now) = match tokens.prompt_state(prompt) {
            Some(label_pending) => (
                Mode::Reasoning {
                    label: label_pending.then(String::new),
                },
                true,
            ),
            None => (Mode::Content, false),
        };
        Self {
            decoder: IncrementalDecoder::new(tokenizer.clone()),
            tokenizer,
            tokens,
            pieces: Default::default(),
            released: 0,
            mode,
            call_id_prefix,
            calls: 0,
            completed_calls: 0,
            reasoning_tokens: 0,
            thinking_now,
        }
    }

    /// Tokens generated inside thought channels so far.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// OpenAI's `finish_reason`: `tool_calls` when the model stopped after
    /// completing at least one call.
    pub fn finish_reason(&self, end: TurnEnd) -> &'static str {
        match end {
            TurnEnd::Length => "length",
            TurnEnd::Stop if self.completed_calls > 0 => "tool_calls",
            TurnEnd::Stop => "stop",
        }
    }

    /// Whether the last id left the model inside a thought channel.
    pub fn is_thinking(&self) -> bool {
        self.thinking_now
    }

    /// Adds one generated id and the text the engine released with it
    /// (the engine's text is the ids' text, possibly held back or cut by a stop
    /// string); returns the events that are now certain.
    pub fn push(&mut self, id: u32, released_text: &str) -> Result<Vec<OutputEvent>> {
        match self.tokens.marker(id) {
            Some(marker) => {
                self.end_text_piece()?;
                self.pieces.push_back(Piece::Marker(marker));
                self.thinking_now = match marker {
                    Marker::ChannelOpen => true,
                    Marker::ChannelClose | Marker::ToolCallOpen => false,
                    _ => self.thinking_now,
                };
            }
            None => {
                if self.thinking_now {
                    self.reasoning_tokens += 1;
                }
                if let Some(text) = self.decoder.push(id)? {
                    self.push_text(text);
                }
            }
        }
        self.released += released_text.len();
        let mut events = Vec::new();
        self.interpret(&mut events);
        Ok(events)
    }

    /// The request ended; `released_text` is the last text the engine released.
    /// Returns the remaining events.
    pub fn finish(&mut self, released_text: &str) -> Result<Vec<OutputEvent>> {
        self.end_text_piece()?;
        self.released += released_text.len();
        let mut events = Vec::new();
        self.interpret(&mut events);
        self.pieces.clear();
        match std::mem::replace(&mut self.mode, Mode::Content) {
            Mode::Reasoning { label: Some(label) } if !label.is_empty() => {
                events.push(OutputEvent::Reasoning(label))
            }
            // A call cut off mid-arguments keeps what was streamed (finish_reason
            // says `length`); a call whose name never finished is dropped.
            _ => {}
        }
        Ok(events)
    }

    fn push_text(&mut self, text: String) {
        match self.pieces.back_mut() {
            Some(Piece::Text(t)) => t.push_str(&text),
            _ => self.pieces.push_back(Piece::Text(text)),
        }
    }

    /// Flushes the decoder before a marker, so text and markers stay in order.
    fn end_text_piece(&mut self) -> Result<()> {
        if let Some(text) = self.decoder.finish()? {
            self.push_text(text);
        }
        self.decoder = IncrementalDecoder::new(self.tokenizer.clone());
        Ok(())
    }

    /// Interprets decoded pieces as far as the engine has released their text.
    fn interpret(&mut self, events: &mut Vec<OutputEvent>) {
        while let Some(piece) = self.pieces.front_mut() {
            match piece {
                Piece::Marker(marker) => {
                    let len = marker.as_str().len();
                    if self.released < len {
                        return;
                    }
                    self.released -= len;
                    let marker = *marker;
                    self.pieces.pop_front();
                    self.marker(marker, events);
                }
                Piece::Text(text) => {
                    let mut take = self.released.min(text.len());
                    while !text.is_char_boundary(take) {
                        take -= 1;
                    }
                    if take == 0 {
                        return;
                    }
                    let chunk: String = text.drain(..take).collect();
                    self.released -= take;
                    if text.is_empty() {
                        self.pieces.pop_front();
                    }
                    self.text(&chunk, events);
                }
            }
        }
    }

    fn text(&mut self, text: &str, events: &mut Vec<OutputEvent>) {
        match &mut self.mode {
            Mode::Content => push_content(events, OutputEvent::Content(text.to_owned())),
            Mode::Reasoning { label } => match label {
                None => push_content(events, OutputEvent::Reasoning(text.to_owned())),
                Some(held) => {
                    held.push_str(text);
                    if held.len() >= THOUGHT_LABEL.len() || !THOUGHT_LABEL.starts_with(&**held) {
                        let rest = held
                            .strip_prefix(THOUGHT_LABEL)
                            .map(str::to_owned)
                            .unwrap_or_else(|| held.clone());
                        *label = None;
                        if !rest.is_empty() {
                            push_content(events, OutputEvent::Reasoning(rest));
                        }
                    }
                }
            },
            Mode::CallHeader { header } => {
                header.push_str(text);
                if let Some(brace) = header.find('{') {
                    let name = call_name(&header[..brace]);
                    let rest = header[brace..].to_owned();
                    let index = self.start_call(name, events);
                    self.arguments(index, |w, out| w.text(&rest, out), events);
                }
            }
            Mode::CallArguments { index, .. } => {
                let index = *index;
                self.arguments(index, |w, out| w.text(text, out), events);
            }
            Mode::ToolResponse => {}
        }
    }

    fn marker(&mut self, marker: Marker, events: &mut Vec<OutputEvent>) {
        match marker {
            Marker::StringDelimiter => {
                // Outside arguments a delimiter has no meaning; it is not text either.
                if let Mode::CallArguments { index, .. } = &self.mode {
                    let index = *index;
                    self.arguments(index, |w, out| w.delimiter(out), events);
                }
            }
            Marker::ToolCallOpen => {
                self.end_mode(events);
                self.mode = Mode::CallHeader {
                    header: String::new(),
                };
            }
            Marker::ToolCallClose => {
                if matches!(
                    self.mode,
                    Mode::CallHeader { .. } | Mode::CallArguments { .. }
                ) {
                    self.end_mode(events);
                    self.mode = Mode::Content;
                }
            }
            Marker::ChannelOpen => {
                self.end_mode(events);
                self.mode = Mode::Reasoning {
                    label: Some(String::new()),
                };
            }
            Marker::ChannelClose => {
                if matches!(self.mode, Mode::Reasoning { .. }) {
                    self.end_mode(events);
                    self.mode = Mode::Content;
                }
            }
            Marker::ToolResponseOpen => {
                self.end_mode(events);
                self.mode = Mode::ToolResponse;
            }
            Marker::ToolResponseClose => {
                if matches!(self.mode, Mode::ToolResponse) {
                    self.mode = Mode::Content;
                }
            }
            Marker::DeclarationOpen | Marker::DeclarationClose => {}
        }
    }

    /// Closes the current stretch: a pending label becomes reasoning, an open
    /// call is completed (a name without arguments gets `{}`).
    fn end_mode(&mut self, events: &mut Vec<OutputEvent>) {
        match std::mem::replace(&mut self.mode, Mode::Content) {
            Mode::Reasoning { label: Some(label) } if !label.is_empty() => {
                push_content(events, OutputEvent::Reasoning(label));
            }
            Mode::CallHeader { header } => {
                let name = call_name(&header);
                if !name.is_empty() {
                    let index = self.start_call(name, events);
                    self.arguments(index, |w, out| w.close(out), events);
                    self.mode = Mode::Content;
                    self.completed_calls += 1;
                    events.push(OutputEvent::ToolCallEnd { index });
                }
            }
            Mode::CallArguments { index, mut writer } => {
                let mut out = String::new();
                writer.close(&mut out);
                if !out.is_empty() {
                    events.push(OutputEvent::ToolCallArguments { index, delta: out });
                }
                self.completed_calls += 1;
                events.push(OutputEvent::ToolCallEnd { index });
            }
            _ => {}
        }
    }

    fn start_call(&mut self, name: String, events: &mut Vec<OutputEvent>) -> usize {
        let index = self.calls;
        self.calls += 1;
        events.push(OutputEvent::ToolCallStart {
            index,
            id: format!("{}{index}", self.call_id_prefix),
            name,
        });
        self.mode = Mode::CallArguments {
            index,
            writer: ArgumentWriter::new(),
        };
        index
    }

    /// Feeds the open call's writer and emits what it wrote.
    fn arguments(
        &mut self,
        index: usize,
        feed: impl FnOnce(&mut ArgumentWriter, &mut String),
        events: &mut Vec<OutputEvent>,
    ) {
        if let Mode::CallArguments { writer, .. } = &mut self.mode {
            let mut out = String::new();
            feed(writer, &mut out);
            if !out.is_empty() {
                events.push(OutputEvent::ToolCallArguments { index, delta: out });
            }
        }
    }
}

/// The function name in a call header (`call:NAME`).
fn call_name(header: &str) -> String {
    let header = header.trim();
    header
        .strip_prefix("call:")
        .unwrap_or(header)
        .trim()
        .to_owned()
}

/// Appends a text event, merging it with a previous one of the same kind.
fn push_content(events: &mut Vec<OutputEvent>, event: OutputEvent) {
    match (events.last_mut(), &event) {
        (Some(OutputEvent::Content(a)), OutputEvent::Content(b))
        | (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(b),
        _ => events.push(event),
    }
}

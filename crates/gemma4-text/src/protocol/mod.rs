//! Gemma 4's output protocol: a turn's released output in, typed events out.
//!
//! A model turn mixes three kinds of text, told apart by special tokens:
//! reasoning (`<|channel>thought\n…<channel|>`), tool calls
//! (`<|tool_call>call:NAME{…}<tool_call|>`, strings inside between `<|"|>`) and
//! the answer (everything else). [`TurnParser`] reads one request's released
//! output and yields [`OutputEvent`]s: content and reasoning deltas, and for
//! each tool call a start (id and name, once), argument deltas (JSON text) and
//! an end. The markers are recognised by token id (the request's
//! [`TextOutput`](crate::TextOutput) hands them over as [`Piece::Marker`]), never
//! by searching text, so a string that merely looks like a marker stays text.
//! [`AssistantMessage`] folds the events into a whole message; a stream that
//! sends every event as it comes therefore shows exactly what the collected
//! response holds. [`ChannelState`] is the same reading, id by id, for those
//! who only need to know where the turn stands.
//!
//! The parser only sees released text: a stop string that cut the output
//! cuts the parsed turn at the same place.

mod arguments;
mod channel;

use crate::output::Piece;
use crate::tokenizer::Tokenizer;

pub use arguments::ArgumentWriter;
pub use channel::{Channel, ChannelState};

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

    /// A vocabulary whose markers sit at the given ids (one built by hand).
    pub fn from_ids(markers: impl IntoIterator<Item = (u32, Marker)>) -> Self {
        Self {
            markers: markers.into_iter().collect(),
            turn_open: None,
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

impl Mode {
    fn channel(&self) -> Channel {
        match self {
            Mode::Content => Channel::Answer,
            Mode::Reasoning { .. } => Channel::Thought,
            Mode::CallHeader { .. } | Mode::CallArguments { .. } => Channel::ToolCall,
            Mode::ToolResponse => Channel::ToolResponse,
        }
    }

    /// The mode that opens `channel`.
    fn entering(channel: Channel) -> Mode {
        match channel {
            Channel::Answer => Mode::Content,
            Channel::Thought => Mode::Reasoning {
                label: Some(String::new()),
            },
            Channel::ToolCall => Mode::CallHeader {
                header: String::new(),
            },
            Channel::ToolResponse => Mode::ToolResponse,
        }
    }
}

/// Reads one chat turn's released output ([`Piece`]s: text and markers, in
/// order) and yields its [`OutputEvent`]s.
#[derive(Debug)]
pub struct TurnParser {
    mode: Mode,
    call_id_prefix: String,
    calls: usize,
    completed_calls: usize,
}

impl TurnParser {
    /// A parser for a completion of `prompt`; tool-call ids are
    /// `{call_id_prefix}{n}` for the turn's n-th call.
    pub fn new(tokens: &ProtocolTokens, prompt: &[u32], call_id_prefix: String) -> Self {
        let mode = match tokens.prompt_state(prompt) {
            Some(label_pending) => Mode::Reasoning {
                label: label_pending.then(String::new),
            },
            None => Mode::Content,
        };
        Self {
            mode,
            call_id_prefix,
            calls: 0,
            completed_calls: 0,
        }
    }

    /// Tool calls completed so far.
    pub fn completed_calls(&self) -> usize {
        self.completed_calls
    }

    /// Reads one released piece, adding the events that are now certain.
    pub fn push(&mut self, piece: &Piece, events: &mut Vec<OutputEvent>) {
        match piece {
            Piece::Text(text) => self.text(text, events),
            Piece::Marker(marker) => self.marker(*marker, events),
        }
    }

    /// The output ended: adds the remaining events. Calling it again adds none.
    pub fn finish(&mut self, events: &mut Vec<OutputEvent>) {
        match std::mem::replace(&mut self.mode, Mode::Content) {
            Mode::Reasoning { label: Some(label) } if !label.is_empty() => {
                events.push(OutputEvent::Reasoning(label))
            }
            // A call cut off mid-arguments keeps what was streamed (finish_reason
            // says `length`); a call whose name never finished is dropped.
            _ => {}
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

    /// A marker moves the turn as [`Channel::after`] says; an opening marker
    /// always starts its stretch afresh.
    fn marker(&mut self, marker: Marker, events: &mut Vec<OutputEvent>) {
        if marker == Marker::StringDelimiter {
            // Outside arguments a delimiter has no meaning; it is not text either.
            if let Mode::CallArguments { index, .. } = &self.mode {
                let index = *index;
                self.arguments(index, |w, out| w.delimiter(out), events);
            }
            return;
        }
        let now = self.mode.channel();
        let next = now.after(marker);
        let opens = matches!(
            marker,
            Marker::ChannelOpen | Marker::ToolCallOpen | Marker::ToolResponseOpen
        );
        if next == now && !opens {
            return;
        }
        self.end_mode(events);
        self.mode = Mode::entering(next);
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

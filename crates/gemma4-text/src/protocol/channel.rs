//! Where a Gemma 4 turn stands, read one id at a time: in the answer, in a
//! thought channel, in a tool call or in a tool response. The one rule that
//! the turn parser, the reasoning count, the thinking budget and the
//! grammar's thinking gate all follow.

use super::{Marker, ProtocolTokens};

/// The stretch of a turn an id falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    Answer,
    Thought,
    ToolCall,
    /// After a tool-response marker: nothing of it is the model's answer.
    ToolResponse,
}

impl Channel {
    /// The stretch after `marker`: an opening marker enters its stretch
    /// (leaving any other), a closing one leaves only its own.
    pub fn after(self, marker: Marker) -> Channel {
        match (marker, self) {
            (Marker::ChannelOpen, _) => Channel::Thought,
            (Marker::ToolCallOpen, _) => Channel::ToolCall,
            (Marker::ToolResponseOpen, _) => Channel::ToolResponse,
            (Marker::ChannelClose, Channel::Thought)
            | (Marker::ToolCallClose, Channel::ToolCall)
            | (Marker::ToolResponseClose, Channel::ToolResponse) => Channel::Answer,
            _ => self,
        }
    }
}

/// A turn's [`Channel`], followed id by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelState {
    tokens: ProtocolTokens,
    channel: Channel,
}

impl ChannelState {
    /// The state a completion of `prompt` starts in: inside a thought when
    /// the template left a channel open for the model to continue.
    pub fn after_prompt(tokens: ProtocolTokens, prompt: &[u32]) -> Self {
        let channel = match tokens.prompt_state(prompt) {
            Some(_) => Channel::Thought,
            None => Channel::Answer,
        };
        Self { tokens, channel }
    }

    /// Follows one generated id; returns the marker it is, if any.
    pub fn accept(&mut self, id: u32) -> Option<Marker> {
        let marker = self.tokens.marker(id)?;
        self.channel = self.channel.after(marker);
        Some(marker)
    }

    pub fn channel(&self) -> Channel {
        self.channel
    }

    pub fn in_thought(&self) -> bool {
        self.channel == Channel::Thought
    }

    /// The vocabulary's markers.
    pub fn tokens(&self) -> &ProtocolTokens {
        &self.tokens
    }
}

//! What a request may hold, written once: the server checks a request
//! against these before it submits it (and names the request's field from
//! the [`RequestPart`] an error blames), and the engine checks the same in
//! its own defence.

use crate::api::GenerationRequest;
use crate::media::{EncoderInput, MediaFacts};

/// Most stop strings a request may give; each is matched on every token.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string in bytes; up to this much text is held back per token.
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// The part of a request a limit applies to, for the API to name its field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestPart {
    Prompt,
    MaxTokens,
    StopTokenIds,
    StopStrings,
    LogitBias,
    /// The prompt's images, clips and videos.
    Media,
}

/// A request over a limit: which part, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LimitError {
    pub part: RequestPart,
    pub message: String,
    /// The prompt and output do not fit the context length.
    pub context_length: bool,
}

impl LimitError {
    fn new(part: RequestPart, message: String) -> Self {
        Self {
            part,
            message,
            context_length: false,
        }
    }

    fn context(part: RequestPart, message: String) -> Self {
        Self {
            context_length: true,
            ..Self::new(part, message)
        }
    }
}

/// The limits of one engine and its model.
#[derive(Debug, Clone)]
pub struct RequestLimits {
    /// The context length: prompt and output together stay within it.
    pub max_model_len: usize,
    /// One past the largest valid token id: the smaller of the tokenizer's
    /// vocabulary (added tokens included) and the model's embedding rows.
    pub token_id_limit: usize,
    /// Most tokens one step computes: a bidirectional image must fit one.
    pub max_batch_tokens: usize,
    /// The model's width: the length of each encoder row a request brings.
    pub hidden_size: usize,
    /// Images attend within themselves, so each must run in one step.
    pub bidirectional_vision: bool,
    pub media: MediaFacts,
}

impl RequestLimits {
    /// The most tokens a request may generate after a prompt of
    /// `prompt_len`: `requested`, or `default` within the room left.
    pub fn max_tokens(
        &self,
        requested: Option<usize>,
        prompt_len: usize,
        default: usize,
    ) -> Result<usize, LimitError> {
        let limit = self.max_model_len;
        if prompt_len == 0 {
            return Err(LimitError::new(
                RequestPart::Prompt,
                "the prompt is empty".into(),
            ));
        }
        if prompt_len >= limit {
            return Err(LimitError::context(
                RequestPart::Prompt,
                format!(
                    "the prompt has {prompt_len} tokens but the context length (max_model_len) is {limit}, \
                     which leaves no room for output; shorten the prompt or start the server with a larger --max-model-len"
                ),
            ));
        }
        let room = limit - prompt_len;
        match requested {
            Some(m) if m > room => Err(LimitError::context(
                RequestPart::MaxTokens,
                format!(
                    "`max_tokens` is {m} but the prompt has {prompt_len} tokens and the context length (max_model_len) is \
                     {limit}; set `max_tokens` to at most {room} or shorten the prompt"
                ),
            )),
            Some(m) => Ok(m),
            None => Ok(default.clamp(1, room)),
        }
    }

    /// Checks every limit a request is held to.
    pub fn check(&self, r: &GenerationRequest) -> Result<(), LimitError> {
        self.max_tokens(Some(r.params.max_tokens), r.prompt_ids.len(), 0)?;
        self.check_ids(RequestPart::Prompt, &r.prompt_ids)?;
        self.check_ids(RequestPart::StopTokenIds, &r.params.stop_token_ids)?;
        let biased: Vec<u32> = r.params.logit_bias.iter().map(|(id, _)| *id).collect();
        self.check_ids(RequestPart::LogitBias, &biased)?;
        check_stop_strings(&r.params.stop_strings)
            .map_err(|e| LimitError::new(RequestPart::StopStrings, e))?;
        self.check_media(r)
    }

    /// Token ids at or past [`token_id_limit`](Self::token_id_limit) are
    /// refused, naming the first.
    fn check_ids(&self, part: RequestPart, ids: &[u32]) -> Result<(), LimitError> {
        let limit = self.token_id_limit;
        match ids.iter().find(|&&t| t as usize >= limit) {
            Some(bad) => Err(LimitError::new(
                part,
                format!("token id {bad} is outside the vocabulary (valid ids are below {limit})"),
            )),
            None => Ok(()),
        }
    }

    /// The prompt's media fit its positions, the model's width, its
    /// encoders and (for bidirectional images) one step.
    fn check_media(&self, r: &GenerationRequest) -> Result<(), LimitError> {
        let Some(soft) = &r.soft_prompt else {
            return Ok(());
        };
        let bad = |message: String| LimitError::new(RequestPart::Media, message);
        let step = self.max_batch_tokens;
        let too_long = soft.blocks.iter().copied().find(|(s, e)| e - s > step);
        if let Some((s, e)) = too_long.filter(|_| self.bidirectional_vision) {
            return Err(bad(format!(
                "an image of {} soft tokens does not fit one step of {step} tokens; raise --max-batch-tokens or send fewer soft tokens per image",
                e - s
            )));
        }
        soft.check(r.prompt_ids.len(), self.hidden_size)
            .map_err(bad)?;
        for item in &soft.items {
            let missing = match item.input {
                EncoderInput::Image { .. } if self.media.image.is_none() => "vision",
                EncoderInput::Audio { .. } if self.media.audio.is_none() => "audio",
                _ => continue,
            };
            return Err(bad(format!("this model has no {missing} encoder")));
        }
        Ok(())
    }
}

/// Refuses stop strings past the limits, naming the limit.
fn check_stop_strings(stops: &[String]) -> Result<(), String> {
    if stops.len() > MAX_STOP_STRINGS {
        return Err(format!(
            "{} stop strings given; at most {MAX_STOP_STRINGS} are allowed",
            stops.len()
        ));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(format!(
            "a stop string is {} bytes long; at most {MAX_STOP_STRING_BYTES} bytes are allowed",
            long.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::SamplingParams;

    fn limits() -> RequestLimits {
        RequestLimits {
            max_model_len: 100,
            token_id_limit: 50,
            max_batch_tokens: 64,
            hidden_size: 8,
            bidirectional_vision: false,
            media: MediaFacts::default(),
        }
    }

    fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
        GenerationRequest::new(
            prompt,
            SamplingParams {
                max_tokens,
                ..SamplingParams::default()
            },
        )
    }

    #[test]
    fn the_context_length_bounds_prompt_and_output() {
        let l = limits();
        let e = l.max_tokens(None, 100, 16).expect_err("no room");
        assert_eq!(e.part, RequestPart::Prompt);
        assert!(
            e.context_length && e.message.contains("max_model_len"),
            "{e}"
        );
        let e = l.max_tokens(Some(50), 60, 16).expect_err("over");
        assert_eq!(e.part, RequestPart::MaxTokens);
        assert!(e.message.contains("at most 40"), "{e}");
        assert_eq!(l.max_tokens(Some(40), 60, 16), Ok(40));
        // The default is bounded by the room left, and is at least one.
        assert_eq!(l.max_tokens(None, 10, 256), Ok(90));
        assert_eq!(l.max_tokens(None, 10, 0), Ok(1));
        let e = l.max_tokens(None, 0, 16).expect_err("empty");
        assert_eq!(e.part, RequestPart::Prompt);
        assert!(l.check(&request(vec![1; 60], 41)).is_err());
        assert!(l.check(&request(vec![1; 60], 40)).is_ok());
    }

    #[test]
    fn token_ids_are_held_to_the_vocabulary_wherever_they_are() {
        let l = limits();
        let e = l.check(&request(vec![1, 50], 4)).expect_err("prompt");
        assert_eq!(e.part, RequestPart::Prompt);
        assert!(e.message.contains("token id 50"), "{e}");
        let mut r = request(vec![1], 4);
        r.params.stop_token_ids = vec![49, 77];
        assert_eq!(
            l.check(&r).map_err(|e| e.part),
            Err(RequestPart::StopTokenIds)
        );
        let mut r = request(vec![1], 4);
        r.params.logit_bias = vec![(3, 1.0), (50, -1.0)];
        assert_eq!(l.check(&r).map_err(|e| e.part), Err(RequestPart::LogitBias));
    }

    #[test]
    fn stop_strings_past_the_limits_are_refused() {
        let ok: Vec<String> = vec!["x".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS];
        assert!(check_stop_strings(&ok).is_ok());
        let many = vec!["x".to_string(); MAX_STOP_STRINGS + 1];
        assert!(check_stop_strings(&many).is_err_and(|e| e.contains("at most 16")));
        let long = vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)];
        assert!(check_stop_strings(&long).is_err_and(|e| e.contains("256 bytes")));
        let mut r = request(vec![1], 4);
        r.params.stop_strings = many;
        assert_eq!(
            limits().check(&r).map_err(|e| e.part),
            Err(RequestPart::StopStrings)
        );
    }
}

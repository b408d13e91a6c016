//! Media in a prompt, in front of the executor seam: what the server hands
//! over (pixels as patches, audio as features, or rows already encoded) and
//! where their soft tokens go; what the model's encoders take and give
//! ([`MediaFacts`]), so the server can lay a prompt out without them. The
//! executor runs the encoders, within the per-step encoder budget the
//! scheduler keeps.

use std::ops::Range;
use std::sync::Arc;

pub use gemma4_model::{AudioFeatures, MediaTokens};

use crate::block_hash::MediaSpan;

/// One run of soft tokens as the server prepared it.
#[derive(Debug, Clone, PartialEq)]
pub enum EncoderInput {
    /// An image or a video frame as the vision encoder reads it:
    /// `[patches, patch · patch · 3]` values and each patch's `(x, y)`.
    Image {
        patches: Vec<f32>,
        positions: Vec<(u32, u32)>,
    },
    /// An audio clip's features, as [`AudioFacts::features`] names them.
    Audio { features: Vec<f32> },
    /// Rows already encoded, `[soft_tokens, hidden]`.
    Embeds(Vec<f32>),
}

/// One item of a [`SoftPrompt`]: its input and how many rows it fills.
#[derive(Debug, Clone, PartialEq)]
pub struct SoftItem {
    pub input: EncoderInput,
    pub soft_tokens: usize,
}

/// Prompt positions the model reads from encoder outputs instead of the
/// token table.
#[derive(Debug, Clone, PartialEq)]
pub struct SoftPrompt {
    /// Prompt positions, ascending.
    pub rows: Vec<usize>,
    /// What fills the rows, in order: each item the next `soft_tokens` of them.
    pub items: Vec<SoftItem>,
    /// `[start, end)` spans of rows that attend to each other (images, on
    /// models with bidirectional image attention), ascending; audio rows
    /// belong to none.
    pub blocks: Vec<(usize, usize)>,
    /// The media items and where they sit: the cached blocks they overlap
    /// are keyed on them, so two prompts with the same placeholders but
    /// different media never share those KV blocks.
    pub media: Arc<[MediaSpan]>,
}

/// An item's place in the prompt, for the scheduler: the positions its
/// rows span and what encoding it costs (soft tokens; nothing for rows
/// already encoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderSpan {
    pub start: usize,
    pub end: usize,
    pub cost: usize,
}

/// A prefill chunk's share of a [`SoftPrompt`], relative to the chunk.
pub struct SoftWindow<'a> {
    pub rows: Vec<usize>,
    pub embeds: &'a [f32],
    pub blocks: Vec<(usize, usize)>,
}

impl SoftPrompt {
    /// Rows already encoded (`rows.len() × hidden` values) as one item.
    pub fn from_embeds(
        rows: Vec<usize>,
        embeds: Vec<f32>,
        blocks: Vec<(usize, usize)>,
        media: Arc<[MediaSpan]>,
    ) -> Self {
        let soft_tokens = rows.len();
        Self {
            rows,
            items: vec![SoftItem {
                input: EncoderInput::Embeds(embeds),
                soft_tokens,
            }],
            blocks,
            media,
        }
    }

    /// The indices into [`Self::rows`] each item fills.
    pub fn item_rows(&self) -> Vec<Range<usize>> {
        let mut start = 0;
        self.items
            .iter()
            .map(|item| {
                let range = start..start + item.soft_tokens;
                start = range.end;
                range
            })
            .collect()
    }

    /// Each item's span of positions and encoding cost, in order.
    pub fn encoder_spans(&self) -> Vec<EncoderSpan> {
        self.item_rows()
            .into_iter()
            .zip(&self.items)
            .filter_map(|(range, item)| {
                let first = *self.rows.get(range.start)?;
                let last = *self.rows.get(range.end.checked_sub(1)?)?;
                let cost = match item.input {
                    EncoderInput::Embeds(_) => 0,
                    _ => item.soft_tokens,
                };
                Some(EncoderSpan {
                    start: first,
                    end: last + 1,
                    cost,
                })
            })
            .collect()
    }

    /// Whether it fits a prompt of `prompt_len` ids on a model `hidden`
    /// wide: rows ascending inside the prompt, items that fill them all,
    /// encoded rows of the model's width.
    pub fn check(&self, prompt_len: usize, hidden: usize) -> Result<(), String> {
        let in_prompt = self.rows.windows(2).all(|w| w[0] < w[1])
            && self.rows.last().is_none_or(|&last| last < prompt_len);
        if !in_prompt {
            return Err(format!(
                "the encoder rows do not fit the prompt: {} rows must be ascending positions below {prompt_len}",
                self.rows.len()
            ));
        }
        let filled: usize = self.items.iter().map(|i| i.soft_tokens).sum();
        if filled != self.rows.len() || self.items.iter().any(|i| i.soft_tokens == 0) {
            return Err(format!(
                "the media items fill {filled} rows (none may be empty); the prompt has {} encoder rows",
                self.rows.len()
            ));
        }
        for item in &self.items {
            if let EncoderInput::Embeds(embeds) = &item.input {
                if embeds.len() != item.soft_tokens * hidden {
                    return Err(format!(
                        "encoded rows hold {} values; {} rows of a width of {hidden} need {}",
                        embeds.len(),
                        item.soft_tokens,
                        item.soft_tokens * hidden
                    ));
                }
            }
        }
        Ok(())
    }

    /// The rows, values and blocks that fall in `start..start + len`, with
    /// `embeds` the values of every row (blocks wholly inside the window;
    /// the scheduler never cuts one).
    pub fn window<'a>(&self, embeds: &'a [f32], start: usize, len: usize) -> SoftWindow<'a> {
        let lo = self.rows.partition_point(|&r| r < start);
        let hi = self.rows.partition_point(|&r| r < start + len);
        let hidden = embeds.len().checked_div(self.rows.len()).unwrap_or(0);
        SoftWindow {
            rows: self.rows[lo..hi].iter().map(|r| r - start).collect(),
            embeds: &embeds[lo * hidden..hi * hidden],
            blocks: self
                .blocks
                .iter()
                .filter(|&&(s, e)| s >= start && e <= start + len)
                .map(|&(s, e)| (s - start, e - start))
                .collect(),
        }
    }
}

/// What the model's encoders take and give.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MediaFacts {
    /// The vision encoder's, where the model reads images and video.
    pub image: Option<ImageFacts>,
    /// The audio encoder's, where the model hears.
    pub audio: Option<AudioFacts>,
}

/// What the vision encoder takes and gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageFacts {
    /// The ids around and in place of an image's soft tokens.
    pub tokens: MediaTokens,
    /// The same for a video frame.
    pub video_tokens: MediaTokens,
    /// Pixels per patch side, and patches per pooled soft token side.
    pub patch_size: usize,
    pub pooling: usize,
    /// The encoder reads each soft token's patches merged into one row.
    pub merged_patches: bool,
    /// Entries of its position table: every patch position (as the
    /// encoder reads them) must be below it on both axes.
    pub position_table: usize,
}

impl ImageFacts {
    /// Refuses patches the encoder has no position for, naming the grid.
    pub fn check_positions(&self, positions: &[(u32, u32)]) -> Result<(), String> {
        let (w, h) = positions.iter().fold((0, 0), |(w, h), &(x, y)| {
            (w.max(x as usize + 1), h.max(y as usize + 1))
        });
        if w.max(h) > self.position_table {
            return Err(format!(
                "the image is {w}×{h} patches; the position table holds {}",
                self.position_table
            ));
        }
        Ok(())
    }
}

/// What the audio encoder takes and gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AudioFacts {
    pub tokens: MediaTokens,
    pub features: AudioFeatures,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(soft_tokens: usize) -> SoftItem {
        SoftItem {
            input: EncoderInput::Image {
                patches: Vec::new(),
                positions: Vec::new(),
            },
            soft_tokens,
        }
    }

    /// Items fill the rows in order; the scheduler sees each one's span and cost.
    #[test]
    fn items_are_laid_over_the_rows_in_order() {
        let soft = SoftPrompt {
            rows: vec![3, 4, 5, 9, 10],
            items: vec![image(3), image(2)],
            blocks: vec![(3, 6), (9, 11)],
            media: Arc::new([]),
        };
        assert_eq!(soft.item_rows(), vec![0..3, 3..5]);
        let spans = soft.encoder_spans();
        assert_eq!((spans[0].start, spans[0].end, spans[0].cost), (3, 6, 3));
        assert_eq!((spans[1].start, spans[1].end, spans[1].cost), (9, 11, 2));
        assert!(soft.check(11, 8).is_ok());
        assert!(soft.check(10, 8).is_err(), "a row past the prompt");
        let short = SoftPrompt {
            items: vec![image(3)],
            ..soft.clone()
        };
        assert!(short.check(11, 8).is_err(), "rows no item fills");
        let encoded = SoftPrompt::from_embeds(vec![1, 2], vec![0.0; 16], vec![], Arc::new([]));
        assert_eq!(encoded.encoder_spans()[0].cost, 0);
        assert!(encoded.check(3, 8).is_ok());
        assert!(encoded.check(3, 4).is_err(), "rows of another width");
    }
}

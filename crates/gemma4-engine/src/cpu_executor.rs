//! The CPU executor: runs the steps the engine plans with this machine's
//! kernels, and samples. It owns the model, the KV pools, each request's
//! sampler and block tables; it knows nothing of queues, deadlines or text.
//!
//! A failed batch is run again sequence by sequence, so only the sequences
//! that fail alone get the error; grammar masks are prepared on another
//! thread while the model computes the logits they will mask. A request
//! that scores its prompt has logits computed at every prompt position it
//! runs, and each next prompt token's log-probability returned.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use gemma4_model::paged::{kv_groups, GroupBlocks, PagedKvPool, SeqBlocks};
use gemma4_model::storage::with_f32_values;
use gemma4_model::{
    Assistant, AudioEncoder, BatchSeq, Gemma4, ImageEncoder, KvRows, KvStore, LogitsFor,
    LoraAdapter, OutputRows, SoftTokens, StoreLayers, TargetKv,
};

use gemma4_text::Tokenizer;

use crate::api::TokenConstraint;
use crate::encoders::EncoderThread;
use crate::engine::{start_with, EngineConfig, EngineHandle};
use crate::executor::{
    AdapterFacts, AdapterReader, DraftOutcome, EncodeRequest, EncodedItem, Executor, ExecutorError,
    ExecutorStats, KvLayout, ModelFacts, ReadAdapter, ScheduledChunk, SeqOutput, StepOutput,
    StepPlan,
};
use crate::media::{EncoderInput, MediaFacts, SoftPrompt, SoftWindow};
use crate::panic_message;
use crate::sampler::{score, Sampled, Sampler, Scored};
use crate::speculative::{Drafter, Proposal, MAX_SPECULATIVE_TOKENS};

/// A request's prompt scoring: which prompt tokens have their
/// log-probability yet to come.
pub struct PromptScoring {
    prompt: Vec<u32>,
    /// Alternatives per token.
    top: usize,
    /// The next prompt position to score (a rerun after preemption never
    /// scores a token twice).
    next: usize,
}

impl PromptScoring {
    pub fn new(prompt: Vec<u32>, top: usize) -> Self {
        Self {
            prompt,
            top,
            next: 1,
        }
    }

    /// Whether a chunk at `start` of `len` tokens predicts a prompt token still to score.
    fn wants(&self, start: usize, len: usize) -> bool {
        start + len >= self.next && self.next < self.prompt.len()
    }

    /// Scores the prompt tokens that `logits` (`rows` rows for positions
    /// `start..`) predict, each at most once.
    fn score_rows(&mut self, logits: &[f32], rows: usize, start: usize) -> Vec<(u32, Scored)> {
        let vocab = logits.len() / rows.max(1);
        let mut out = Vec::new();
        for (r, row) in logits.chunks(vocab.max(1)).enumerate().take(rows) {
            let target = start + r + 1;
            if target != self.next || target >= self.prompt.len() {
                continue;
            }
            let token = self.prompt[target];
            out.push((token, score(row, token, self.top)));
            self.next += 1;
        }
        out
    }
}

// A drafted chunk (the last token and its drafts) stays within the
// attention that computes each position as a one-token step does.
const _: () = assert!(MAX_SPECULATIVE_TOKENS < gemma4_model::IN_PLACE_MAX_QUERIES);

/// What the engine learns of a LoRA adapter the executor holds.
fn adapter_facts(id: u32, a: &LoraAdapter) -> AdapterFacts {
    AdapterFacts {
        id,
        name: a.name().to_string(),
        max_rank: a.max_rank(),
        bytes: a.bytes(),
    }
}

/// How long a step with nothing to run waits for an encoding to end.
const ENCODER_WAIT: Duration = Duration::from_millis(10);

/// Starts the engine thread, running `model` on this machine's CPU.
pub fn start(
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
) -> gemma4_model::Result<EngineHandle> {
    start_with(Box::new(CpuExecutor::new(model)), tokenizer, config)
}

/// Starts the engine thread with a fault to inject (tests of the supervision only).
#[cfg(feature = "fault-injection")]
pub fn start_with_fault(
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    fault: crate::fault::FaultPlan,
) -> gemma4_model::Result<EngineHandle> {
    let executor = CpuExecutor::new(model).with_fault(fault);
    crate::engine::start_worker(Box::new(executor), tokenizer, config, Some(fault))
}

struct RequestState {
    sampler: Sampler,
    soft_prompt: Option<Arc<SoftPrompt>>,
    /// The values of every encoder row of the prompt, filled as its items
    /// are encoded.
    soft_rows: Vec<f32>,
    scoring: Option<PromptScoring>,
    /// The block tables, as the plans' updates built them.
    tables: Vec<GroupBlocks>,
    /// Drafts tokens for speculative decoding, when the request does.
    drafter: Option<Drafter>,
    /// For the assistant: how many tokens to draft after this step, from
    /// the target's final-norm row that predicted the last sampled token.
    assistant_turn: Option<(usize, Tensor)>,
    /// Id of its LoRA adapter.
    adapter: Option<u32>,
}

/// The model's assistant and the target layers whose K/V it reads.
struct AssistantDrafter {
    model: Assistant,
    store: StoreLayers,
    /// Rows back from the drafting position its sliding layers see.
    reach: usize,
}

/// Runs Gemma 4 on this machine's CPU.
pub struct CpuExecutor {
    model: Gemma4,
    /// The media encoders' thread, where the model reads media.
    encoders: Option<EncoderThread>,
    facts: ModelFacts,
    /// Allocated by [`Executor::allocate_kv`].
    pool: Option<PagedKvPool>,
    requests: HashMap<u64, RequestState>,
    assistant: Option<AssistantDrafter>,
    /// LoRA adapters by id.
    adapters: Vec<(u32, LoraAdapter)>,
    /// Time the assistant has spent drafting.
    drafting: Duration,
    /// Steps whose batch failed and were run again sequence by sequence.
    step_retries: u64,
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault::FaultPlan>,
}

/// Constraints back from [`prepare_constraints`], each with its panic, if any.
type PreparedConstraints =
    std::thread::Result<Vec<(u64, Box<dyn TokenConstraint>, Option<String>)>>;

impl CpuExecutor {
    /// An executor for `model`; its KV pools come with
    /// [`Executor::allocate_kv`].
    pub fn new(model: Gemma4) -> Self {
        let cfg = model.config();
        let facts = ModelFacts {
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
            max_positions: cfg.max_position_embeddings,
            sliding_window: cfg.sliding_window,
            bidirectional_vision: cfg.image_attention.is_bidirectional(),
            kv_groups: kv_groups(cfg),
            media: MediaFacts::default(),
            assistant: false,
            adapters: Vec::new(),
        };
        Self {
            model,
            encoders: None,
            facts,
            pool: None,
            requests: HashMap::new(),
            assistant: None,
            adapters: Vec::new(),
            drafting: Duration::ZERO,
            step_retries: 0,
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }

    /// The executor with the checkpoint's media encoders, which run on a
    /// thread of their own as the plans ask.
    pub fn with_encoders(
        mut self,
        images: Option<ImageEncoder>,
        audio: Option<AudioEncoder>,
    ) -> Result<Self, ExecutorError> {
        if images.is_none() && audio.is_none() {
            return Ok(self);
        }
        let encoders = EncoderThread::spawn(images, audio)?;
        self.facts.media = encoders.facts().clone();
        self.encoders = Some(encoders);
        Ok(self)
    }

    /// The executor with the model's assistant, which drafts for the
    /// requests that speculate with it. The sliding groups then keep the
    /// rows the assistant reads as well as those the model does.
    pub fn with_assistant(mut self, assistant: Assistant) -> Result<Self, ExecutorError> {
        let store = assistant
            .check_target(self.model.config())
            .map_err(|e| ExecutorError(e.to_string()))?;
        let reach = assistant.sliding_reach();
        self.facts.sliding_window = self.facts.sliding_window.max(reach);
        self.facts.assistant = true;
        self.assistant = Some(AssistantDrafter {
            model: assistant,
            store,
            reach,
        });
        Ok(self)
    }

    /// The executor with LoRA adapters requests may run with (each read
    /// for this model by [`LoraAdapter::load`]); names must differ.
    pub fn with_adapters(mut self, adapters: Vec<LoraAdapter>) -> Result<Self, ExecutorError> {
        for (i, a) in adapters.iter().enumerate() {
            if adapters[..i].iter().any(|b| b.name() == a.name()) {
                return Err(ExecutorError(format!(
                    "two LoRA adapters are named `{}`",
                    a.name()
                )));
            }
        }
        let held: Vec<(u32, LoraAdapter)> = (1..).zip(adapters).collect();
        self.facts.adapters = held.iter().map(|(id, a)| adapter_facts(*id, a)).collect();
        self.adapters = held;
        Ok(self)
    }

    /// The executor with a fault to inject (tests of the supervision only).
    #[cfg(feature = "fault-injection")]
    pub fn with_fault(mut self, fault: crate::fault::FaultPlan) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Takes requests in and out and brings the chunks' block tables up to
    /// date; returns each chunk's tables for the step, moved out of its
    /// request's state (an unknown request gets none, and its step fails).
    fn follow(&mut self, plan: &mut StepPlan) -> Vec<SeqBlocks> {
        // New requests first: one submitted and ended between two steps is
        // in both lists, and must not stay behind.
        for r in plan.new_requests.drain(..) {
            let scoring = r
                .prompt_logprobs
                .map(|top| PromptScoring::new(r.prompt.clone(), top));
            let state = RequestState {
                sampler: r.sampler,
                soft_prompt: r.soft_prompt,
                soft_rows: Vec::new(),
                scoring,
                tables: Vec::new(),
                drafter: r.speculative.map(|c| Drafter::new(c, r.prompt)),
                assistant_turn: None,
                adapter: r.adapter,
            };
            self.requests.insert(r.seq_id, state);
        }
        for id in &plan.finished {
            self.requests.remove(id);
        }
        plan.chunks
            .iter()
            .map(|c| {
                let groups = match self.requests.get_mut(&c.seq_id) {
                    Some(state) => {
                        c.blocks.apply(&mut state.tables);
                        std::mem::take(&mut state.tables)
                    }
                    None => Vec::new(),
                };
                SeqBlocks {
                    groups,
                    len_after_step: c.start + c.tokens.len(),
                }
            })
            .collect()
    }

    /// Starts the plan's encodings: rows sent encoded are copied at once,
    /// the rest go to the encoder thread. Returns those already settled.
    fn start_encodes(&mut self, requests: &[EncodeRequest]) -> Vec<EncodedItem> {
        let mut settled = Vec::new();
        for r in requests {
            let outcome = self.start_encode(r.seq_id, r.item);
            if outcome.as_ref().map_or(true, |queued| !queued) {
                settled.push(EncodedItem {
                    seq_id: r.seq_id,
                    item: r.item,
                    result: outcome.map(|_| ()),
                });
            }
        }
        settled
    }

    /// `Ok(true)` when the item went to the encoder thread, `Ok(false)`
    /// when its rows were copied.
    fn start_encode(&mut self, id: u64, item: usize) -> Result<bool, String> {
        let prompt = self
            .requests
            .get(&id)
            .and_then(|s| s.soft_prompt.clone())
            .ok_or_else(|| format!("request {id} holds no media to encode"))?;
        let input = &prompt
            .items
            .get(item)
            .ok_or_else(|| format!("request {id} has no media item {item}"))?
            .input;
        if let EncoderInput::Embeds(rows) = input {
            self.store_rows(id, item, rows)?;
            return Ok(false);
        }
        let encoders = self
            .encoders
            .as_mut()
            .ok_or("this model has no encoder for the media sent")?;
        encoders.start(id, item, prompt)?;
        Ok(true)
    }

    /// The encodings finished since the last step, their rows stored.
    fn collect_encodes(&mut self, wait: Option<Duration>) -> Vec<EncodedItem> {
        let Some(encoders) = self.encoders.as_mut() else {
            return Vec::new();
        };
        let mut settled = Vec::new();
        for e in encoders.finished(wait) {
            // A request that ended meanwhile has no use for its rows.
            if !self.requests.contains_key(&e.seq_id) {
                continue;
            }
            let result = e
                .rows
                .and_then(|rows| self.store_rows(e.seq_id, e.item, &rows));
            settled.push(EncodedItem {
                seq_id: e.seq_id,
                item: e.item,
                result,
            });
        }
        settled
    }

    /// Writes an item's rows among its request's encoder rows.
    fn store_rows(&mut self, id: u64, item: usize, rows: &[f32]) -> Result<(), String> {
        let hidden = self.facts.hidden_size;
        let state = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| format!("the executor has no state for request {id}"))?;
        let prompt = state
            .soft_prompt
            .as_ref()
            .ok_or_else(|| format!("request {id} holds no media"))?;
        let range = prompt
            .item_rows()
            .get(item)
            .cloned()
            .ok_or_else(|| format!("request {id} has no media item {item}"))?;
        if rows.len() != range.len() * hidden {
            return Err(format!(
                "media item {item} was encoded into {} values; its {} soft tokens need {}",
                rows.len(),
                range.len(),
                range.len() * hidden
            ));
        }
        if state.soft_rows.is_empty() {
            state.soft_rows = vec![0.0; prompt.rows.len() * hidden];
        }
        state.soft_rows[range.start * hidden..range.end * hidden].copy_from_slice(rows);
        Ok(())
    }

    /// Gives the step's tables back to their requests.
    fn put_back(&mut self, chunks: &[ScheduledChunk], tables: Vec<SeqBlocks>) {
        for (c, t) in chunks.iter().zip(tables) {
            if let Some(state) = self.requests.get_mut(&c.seq_id) {
                state.tables = t.groups;
            }
        }
    }

    /// Lets the assistant draft for the chunks whose requests asked it to,
    /// from the K/V the step left (the accepted positions only).
    fn draft_with_assistant(
        &mut self,
        chunks: &[ScheduledChunk],
        tables: &[SeqBlocks],
        outputs: &mut [SeqOutput],
    ) {
        let Some(assistant) = &self.assistant else {
            return;
        };
        let mut turns = Vec::new();
        let mut views = Vec::new();
        for ((c, t), out) in chunks.iter().zip(tables).zip(outputs.iter_mut()) {
            let Some(state) = self.requests.get_mut(&c.seq_id) else {
                continue;
            };
            let Some((k, hidden)) = state.assistant_turn.take() else {
                continue;
            };
            let Some(token) = out
                .result
                .as_ref()
                .ok()
                .and_then(|s| s.last())
                .map(|s| s.token)
            else {
                continue;
            };
            views.push(SeqBlocks {
                groups: t.groups.clone(),
                len_after_step: out.computed,
            });
            turns.push((views.len() - 1, out, token, k, hidden));
        }
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        let began = std::time::Instant::now();
        let view = pool.view(&views);
        for (i, out, token, k, hidden) in turns {
            let position = out.computed;
            let drafted = store_rows(&view, assistant, i, position).and_then(|kv| {
                assistant
                    .model
                    .draft(&self.model, token, &hidden, position, &kv, k)
            });
            match drafted {
                Ok(tokens) => out.drafting.proposed = tokens,
                // A request whose drafting fails decodes plainly this step.
                Err(e) => {
                    tracing::warn!(request = out.seq_id, "the assistant failed to draft: {e}")
                }
            }
        }
        self.drafting += began.elapsed();
    }

    fn run_step(&mut self, chunks: &[ScheduledChunk], tables: &[SeqBlocks]) -> Vec<SeqOutput> {
        let lent = self.lend_constraints(chunks);
        let lent_ids: Vec<u64> = lent.iter().map(|(id, _)| *id).collect();
        let (rows, prepared) = std::thread::scope(|s| {
            let preparing = (!lent.is_empty()).then(|| s.spawn(|| prepare_constraints(lent)));
            let rows = self.forward(chunks, tables);
            (rows, preparing.map(|h| h.join()))
        });
        let failed = self.restore_constraints(&lent_ids, prepared);
        chunks
            .iter()
            .zip(rows)
            .map(|(c, row)| {
                let failure = failed.iter().find(|(id, _)| *id == c.seq_id);
                self.finish_chunk(c, row, failure.map(|(_, e)| e.clone()))
            })
            .collect()
    }

    /// A chunk's output from its logits: prompt tokens scored, tokens
    /// sampled (drafts verified), and the next drafts proposed.
    fn finish_chunk(
        &mut self,
        c: &ScheduledChunk,
        rows: Result<Option<OutputRows>, String>,
        failed: Option<String>,
    ) -> SeqOutput {
        let mut prompt_logprobs = Vec::new();
        let drafts = &c.tokens[c.tokens.len().saturating_sub(c.drafts)..];
        let (logits, hidden) = match rows {
            Ok(Some(r)) => (Ok(Some(r.logits)), Some(r.hidden)),
            Ok(None) => (Ok(None), None),
            Err(e) => (Err(e), None),
        };
        let result = match failed {
            Some(e) => Err(e),
            None => logits
                .and_then(|row| self.score_prompt(c, row, &mut prompt_logprobs))
                .and_then(|row| self.sample(c.seq_id, row, drafts)),
        };
        let mut drafting = DraftOutcome {
            verified: c.drafts,
            ..Default::default()
        };
        if let Ok(sampled) = &result {
            drafting.accepted = sampled.len().saturating_sub(1).min(c.drafts);
            let state = self.requests.get_mut(&c.seq_id);
            if let (Some(state), false) = (state, sampled.is_empty()) {
                if let Some(drafter) = state.drafter.as_mut() {
                    let ids: Vec<u32> = sampled.iter().map(|s| s.token).collect();
                    drafter.advance(c.drafts, &ids);
                    match drafter.propose() {
                        Proposal::Tokens(tokens) => drafting.proposed = tokens,
                        Proposal::FromAssistant(k) => {
                            // The row that predicted the last token sampled.
                            let row = if c.drafts > 0 {
                                sampled.len() - 1
                            } else {
                                usize::MAX
                            };
                            state.assistant_turn = hidden
                                .and_then(|h| sampled_row(&h, row))
                                .filter(|_| k > 0)
                                .map(|h| (k, h));
                        }
                    }
                }
            }
        }
        SeqOutput {
            seq_id: c.seq_id,
            computed: c.start + c.tokens.len() - (c.drafts - drafting.accepted),
            result,
            prompt_logprobs,
            drafting,
        }
    }

    /// Whether a chunk needs logits at every position (its request scores prompt tokens there).
    fn scores(&self, c: &ScheduledChunk) -> bool {
        self.requests
            .get(&c.seq_id)
            .and_then(|r| r.scoring.as_ref())
            .is_some_and(|s| s.wants(c.start, c.tokens.len()))
    }

    /// Scores the prompt tokens a chunk's logits predict (when it asked for
    /// every row) and returns the row to sample from, if it samples.
    fn score_prompt(
        &mut self,
        c: &ScheduledChunk,
        logits: Option<Tensor>,
        scored: &mut Vec<(u32, Scored)>,
    ) -> Result<Option<Tensor>, String> {
        let Some(logits) = logits else {
            return Ok(None);
        };
        if !self.scores(c) {
            return Ok(Some(logits));
        }
        let rows = c.tokens.len();
        let failed = |e: candle_core::Error| format!("reading logits failed: {e}");
        if let Some(scoring) = self
            .requests
            .get_mut(&c.seq_id)
            .and_then(|r| r.scoring.as_mut())
        {
            *scored = with_f32_values(&logits, |values| scoring.score_rows(values, rows, c.start))
                .map_err(|e| format!("reading logits failed: {e}"))?;
        }
        if !c.samples {
            return Ok(None);
        }
        logits.narrow(0, rows - 1, 1).map(Some).map_err(failed)
    }

    /// Samples a chunk's logits: one row, or one per position of a decode
    /// chunk with drafts, which are verified. A panic here ends that request only.
    fn sample(
        &mut self,
        id: u64,
        rows: Option<Tensor>,
        drafts: &[u32],
    ) -> Result<Vec<Sampled>, String> {
        let Some(rows) = rows else {
            return Ok(Vec::new());
        };
        let state = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| format!("the executor has no state for request {id}"))?;
        if rows.elem_count() != (drafts.len() + 1) * self.facts.vocab_size {
            return Err(format!(
                "the step gave {} logits for {} positions of a {}-token vocabulary",
                rows.elem_count(),
                drafts.len() + 1,
                self.facts.vocab_size
            ));
        }
        // The logits are read where they lie: copying a vocabulary's worth
        // per sequence was a step's largest serial copy.
        with_f32_values(&rows, |values| {
            panic::catch_unwind(AssertUnwindSafe(|| state.sampler.verify(values, drafts)))
        })
        .map_err(|e| format!("reading logits failed: {e}"))?
        .map_err(|payload| {
            let msg = panic_message(payload.as_ref());
            tracing::error!(request = id, "sampling panicked: {msg}");
            format!("sampling failed: {msg}")
        })
    }

    /// The constraints of the sequences that sample this step, taken out of
    /// their samplers.
    fn lend_constraints(
        &mut self,
        chunks: &[ScheduledChunk],
    ) -> Vec<(u64, Box<dyn TokenConstraint>)> {
        chunks
            .iter()
            .filter(|c| c.samples)
            .filter_map(|c| {
                let constraint = self
                    .requests
                    .get_mut(&c.seq_id)?
                    .sampler
                    .take_constraint()?;
                Some((c.seq_id, constraint))
            })
            .collect()
    }

    /// Gives prepared constraints back. A sequence whose constraint panicked
    /// (or was lost with its thread) must not sample unconstrained: it fails.
    fn restore_constraints(
        &mut self,
        lent: &[u64],
        prepared: Option<PreparedConstraints>,
    ) -> Vec<(u64, String)> {
        let returned = match prepared {
            None => return Vec::new(),
            Some(Ok(returned)) => returned,
            Some(Err(payload)) => {
                let msg = panic_message(payload.as_ref());
                tracing::error!(requests = ?lent, "preparing grammar masks failed: {msg}");
                return lent
                    .iter()
                    .map(|&id| (id, format!("the grammar failed: {msg}")))
                    .collect();
            }
        };
        let mut failed = Vec::new();
        for (id, constraint, panicked) in returned {
            match panicked {
                Some(msg) => {
                    tracing::error!(request = id, "the grammar mask panicked: {msg}");
                    failed.push((id, format!("the grammar failed: {msg}")));
                }
                None => {
                    if let Some(state) = self.requests.get_mut(&id) {
                        state.sampler.restore_constraint(constraint);
                    }
                }
            }
        }
        failed
    }

    /// Runs the step's chunks as one batch. If the batch fails (an error or a
    /// panic in the model), each chunk is run again alone, so only the chunks
    /// that fail by themselves get the error and the rest go on.
    fn forward(
        &mut self,
        chunks: &[ScheduledChunk],
        tables: &[SeqBlocks],
    ) -> Vec<Result<Option<OutputRows>, String>> {
        match self.forward_chunks(chunks, tables) {
            Ok(rows) => rows.into_iter().map(Ok).collect(),
            Err(e) if chunks.len() == 1 => vec![Err(e)],
            Err(e) => {
                self.step_retries += 1;
                tracing::warn!(
                    sequences = chunks.len(),
                    "a batched model step failed ({e}); running each sequence alone"
                );
                chunks
                    .iter()
                    .zip(tables)
                    .map(|(c, t)| {
                        self.forward_chunks(std::slice::from_ref(c), std::slice::from_ref(t))
                            .map(|mut rows| rows.pop().flatten())
                    })
                    .collect()
            }
        }
    }

    /// `tables[i]`: the block tables of `chunks[i]`.
    fn forward_chunks(
        &mut self,
        chunks: &[ScheduledChunk],
        tables: &[SeqBlocks],
    ) -> Result<Vec<Option<OutputRows>>, String> {
        // Each chunk's share of its prompt's encoder rows.
        let soft: Vec<Option<SoftWindow<'_>>> = chunks
            .iter()
            .map(|c| {
                let state = self.requests.get(&c.seq_id)?;
                let prompt = state.soft_prompt.as_ref()?;
                let window = prompt.window(&state.soft_rows, c.start, c.tokens.len());
                (!window.rows.is_empty()).then_some(window)
            })
            .collect();
        let logits: Vec<Option<LogitsFor>> = chunks
            .iter()
            .map(|c| {
                if self.scores(c) || c.drafts > 0 {
                    Some(LogitsFor::All)
                } else {
                    c.samples.then_some(LogitsFor::Last)
                }
            })
            .collect();
        let (requests, adapters) = (&self.requests, &self.adapters);
        let batch: Vec<BatchSeq<'_>> = chunks
            .iter()
            .zip(&soft)
            .zip(logits)
            .map(|((c, soft), logits)| BatchSeq {
                ids: &c.tokens,
                start: c.start,
                logits,
                soft: soft.as_ref().map(|w| SoftTokens {
                    rows: &w.rows,
                    embeds: w.embeds,
                    blocks: &w.blocks,
                }),
                lora: requests
                    .get(&c.seq_id)
                    .and_then(|r| r.adapter)
                    .and_then(|id| adapters.iter().find(|(held, _)| *held == id))
                    .map(|(_, a)| a),
            })
            .collect();
        let model = &self.model;
        let pool = self
            .pool
            .as_mut()
            .ok_or("the executor has no KV pools (allocate_kv was not called)")?;
        #[cfg(feature = "fault-injection")]
        let fault = self.fault.as_ref();
        // The model only writes the chunks' own KV positions, which a retry writes again.
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            #[cfg(feature = "fault-injection")]
            if let Some(fault) = fault {
                fault.in_model_step(&batch)?;
            }
            let mut view = pool.view(tables);
            model.forward_batch_rows(&batch, &mut view, None)
        }));
        match result {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => Err(format!("model step failed: {e}")),
            Err(payload) => {
                let msg = panic_message(payload.as_ref());
                let ids: Vec<u64> = chunks.iter().map(|c| c.seq_id).collect();
                let tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
                tracing::error!(requests = ?ids, tokens, "the model step panicked: {msg}");
                Err(format!("model step panicked: {msg}"))
            }
        }
    }
}

impl Executor for CpuExecutor {
    fn adapter_reader(&self) -> Option<AdapterReader> {
        let config = Arc::new(self.model.config().clone());
        Some(Arc::new(move |name: &str, path: &std::path::Path| {
            LoraAdapter::load(name, path, &config)
                .map(|adapter| ReadAdapter(Box::new(adapter)))
                .map_err(|e| ExecutorError(e.to_string()))
        }))
    }

    fn load_adapter(
        &mut self,
        id: u32,
        name: &str,
        adapter: ReadAdapter,
    ) -> Result<AdapterFacts, ExecutorError> {
        if self
            .adapters
            .iter()
            .any(|(held, a)| *held == id || a.name() == name)
        {
            return Err(ExecutorError(format!(
                "a LoRA adapter named `{name}` (or numbered {id}) is held already"
            )));
        }
        let adapter = adapter.0.downcast::<LoraAdapter>().map_err(|_| {
            ExecutorError(format!(
                "`{name}` was not read by this executor's adapter reader"
            ))
        })?;
        if adapter.name() != name {
            return Err(ExecutorError(format!(
                "the adapter read as `{}` cannot be held as `{name}`",
                adapter.name()
            )));
        }
        let facts = adapter_facts(id, &adapter);
        self.adapters.push((id, *adapter));
        Ok(facts)
    }

    fn unload_adapter(&mut self, id: u32) -> Result<(), ExecutorError> {
        let at = self
            .adapters
            .iter()
            .position(|(held, _)| *held == id)
            .ok_or_else(|| ExecutorError(format!("no LoRA adapter {id} is held")))?;
        self.adapters.remove(at);
        Ok(())
    }

    fn model_facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<usize, ExecutorError> {
        let pool = PagedKvPool::new(
            self.model.config(),
            layout.block_size,
            &layout.blocks_per_group,
            layout.dtype,
            &Device::Cpu,
        )
        .map_err(|e| ExecutorError(format!("cannot allocate the KV pools: {e}")))?;
        let bytes = pool.bytes();
        self.pool = Some(pool);
        Ok(bytes)
    }

    fn execute(&mut self, mut plan: StepPlan) -> StepOutput {
        let tables = self.follow(&mut plan);
        let mut encoded = self.start_encodes(&plan.encode);
        // With nothing to run but encodings under way, wait a moment for one
        // rather than have the engine spin.
        let busy = self.encoders.as_ref().is_some_and(EncoderThread::busy);
        let wait = (plan.chunks.is_empty() && busy).then_some(ENCODER_WAIT);
        encoded.extend(self.collect_encodes(wait));
        if plan.chunks.is_empty() {
            return StepOutput {
                seqs: Vec::new(),
                encoded,
            };
        }
        let mut seqs = self.run_step(&plan.chunks, &tables);
        self.draft_with_assistant(&plan.chunks, &tables, &mut seqs);
        self.put_back(&plan.chunks, tables);
        StepOutput { seqs, encoded }
    }

    fn stats(&self) -> ExecutorStats {
        ExecutorStats {
            step_retries: self.step_retries,
            requests: self.requests.len(),
            contended_kernel_jobs: gemma4_kernels::pool::contended_jobs(),
            drafting_ns: u64::try_from(self.drafting.as_nanos()).unwrap_or(u64::MAX),
        }
    }
}

/// Prepares each lent constraint's next mask; a panic is kept with its sequence.
fn prepare_constraints(
    lent: Vec<(u64, Box<dyn TokenConstraint>)>,
) -> Vec<(u64, Box<dyn TokenConstraint>, Option<String>)> {
    lent.into_iter()
        .map(|(id, mut c)| {
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| c.prepare()));
            let panicked = outcome.err().map(|p| panic_message(p.as_ref()));
            (id, c, panicked)
        })
        .collect()
}

/// Row `row` of a step's `[rows, hidden]` final-norm output (the last row
/// for `usize::MAX`), copied out of the step's batch.
fn sampled_row(hidden: &Tensor, row: usize) -> Option<Tensor> {
    let rows = hidden.dim(0).ok()?;
    let row = if row == usize::MAX {
        rows.checked_sub(1)?
    } else {
        row
    };
    hidden.narrow(0, row, 1).ok()?.copy().ok()
}

/// The store layers' K/V rows the assistant sees from `position`: every
/// earlier row of the full layer, the last `reach` of the sliding one.
fn store_rows(
    view: &gemma4_model::paged::PagedView<'_>,
    assistant: &AssistantDrafter,
    seq: usize,
    position: usize,
) -> gemma4_model::Result<TargetKv> {
    let rows = |layer: usize, reach: usize| -> gemma4_model::Result<KvRows> {
        let (k, v, first) = view.read(layer, seq)?;
        let want = position.min(reach);
        let have = k.dim(1)?;
        if first + have != position || have < want {
            return Err(gemma4_model::ModelError::Input(format!(
                "layer {layer} holds positions {first}..{} where the assistant reads {}..{position}",
                first + have,
                position - want
            )));
        }
        Ok(KvRows {
            k: k.narrow(1, have - want, want)?.contiguous()?,
            v: v.narrow(1, have - want, want)?.contiguous()?,
        })
    };
    Ok(TargetKv {
        sliding: rows(assistant.store.sliding, assistant.reach)?,
        full: rows(assistant.store.full, usize::MAX)?,
    })
}

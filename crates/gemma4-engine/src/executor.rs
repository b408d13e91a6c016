//! The executor seam: the one interface between the engine and whatever
//! runs the model. The engine (scheduler, KV manager, output processor)
//! describes each step in plain ids and block numbers ([`StepPlan`]); an
//! executor runs it on its hardware and answers with what each sequence
//! sampled ([`StepOutput`]). Nothing here names a tensor or a model type.
//!
//! A plan carries what changed since the step before, as vLLM v1's
//! `SchedulerOutput` does: a request's sampler, prompt and media inputs
//! arrive once ([`NewRequest`]), a running sequence's chunk brings only its
//! new tokens and the blocks added to its tables ([`BlockUpdate`]), and
//! ended requests are named so their state is dropped. An executor that
//! follows the plans over a channel (another thread, another process, a
//! tensor-parallel rank) holds the same state as one called directly.
//!
//! [`CpuExecutor`](crate::cpu_executor::CpuExecutor) runs the model on this
//! machine's kernels; [`ThreadedExecutor`](crate::threaded_executor::ThreadedExecutor)
//! follows the plans on a thread of its own.

use std::sync::Arc;

use gemma4_model::paged::{GroupBlocks, KvDtype, KvGroup};

use crate::media::{MediaFacts, SoftPrompt};
use crate::sampler::{Sampled, Sampler, Scored};
use crate::speculative::SpeculativeConfig;

/// What the engine needs to know of the model an executor runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    /// Rows of the token embedding (ids at or past it are refused).
    pub vocab_size: usize,
    /// Width of an encoder row a request brings.
    pub hidden_size: usize,
    /// The most positions the model was trained for.
    pub max_positions: usize,
    /// Tokens back a sliding-window group's K/V is read: the layers'
    /// window, or more where a drafter reads further.
    pub sliding_window: usize,
    /// Images attend within themselves, so each must run in one step.
    pub bidirectional_vision: bool,
    /// The KV-cache groups the model needs (sliding first, then full).
    pub kv_groups: Vec<KvGroup>,
    /// What its media encoders take and give.
    pub media: MediaFacts,
    /// Whether it runs the model's assistant, which drafts for requests
    /// that speculate with [`DraftMethod::Assistant`](crate::DraftMethod::Assistant).
    pub assistant: bool,
    /// The LoRA adapters it holds from the start; a request names one by
    /// its id.
    pub adapters: Vec<AdapterFacts>,
}

/// A LoRA adapter an executor holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterFacts {
    /// Never reused while the executor runs (vLLM's `lora_int_id`, from 1).
    pub id: u32,
    pub name: String,
    /// The largest rank of its modules.
    pub max_rank: usize,
    /// Bytes its factors hold.
    pub bytes: usize,
}

/// The KV pools the engine asks an executor to allocate.
#[derive(Debug, Clone, PartialEq)]
pub struct KvLayout {
    pub block_size: usize,
    /// Blocks per group, in [`ModelFacts::kv_groups`] order.
    pub blocks_per_group: Vec<usize>,
    pub dtype: KvDtype,
}

/// A request the executor has not seen before.
pub struct NewRequest {
    pub seq_id: u64,
    pub sampler: Sampler,
    /// The prompt's media (images, audio, video frames), if any.
    pub soft_prompt: Option<Arc<SoftPrompt>>,
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// Alternatives per token, when the request scores its prompt.
    pub prompt_logprobs: Option<usize>,
    /// How the sequence drafts tokens for speculative decoding, if it does.
    pub speculative: Option<SpeculativeConfig>,
    /// The id of the LoRA adapter it runs with.
    pub adapter: Option<u32>,
}

/// How one group's block table changed since the executor last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupUpdate {
    /// The table's first logical block now: blocks before it were released
    /// as the sliding window moved.
    pub first_block: usize,
    /// Blocks appended at the table's end.
    pub added: Vec<u32>,
}

/// How a sequence's block tables changed since the executor last saw them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockUpdate {
    /// The tables start over (a new or resumed sequence): `added` is the
    /// whole table.
    pub reset: bool,
    pub groups: Vec<GroupUpdate>,
}

impl BlockUpdate {
    /// Applies the update to the tables an executor keeps for a sequence.
    pub fn apply(&self, tables: &mut Vec<GroupBlocks>) {
        if self.reset || tables.len() != self.groups.len() {
            tables.clear();
            tables.resize(self.groups.len(), GroupBlocks::default());
        }
        for (t, u) in tables.iter_mut().zip(&self.groups) {
            let released = u
                .first_block
                .saturating_sub(t.first_block)
                .min(t.blocks.len());
            t.blocks.drain(..released);
            t.first_block = u.first_block;
            t.blocks.extend_from_slice(&u.added);
        }
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone)]
pub struct ScheduledChunk {
    pub seq_id: u64,
    /// Position of the first token.
    pub start: usize,
    /// The tokens to run, at positions `start..start + tokens.len()`.
    pub tokens: Vec<u32>,
    /// The blocks allocated for this step, as a change to the tables.
    pub blocks: BlockUpdate,
    /// The chunk ends at the last known token, so the step yields a next-token distribution.
    pub samples: bool,
    /// The last `drafts` tokens are drafted, not known: the step verifies
    /// them (a decode chunk only).
    pub drafts: usize,
}

/// A media item to encode: an index into its request's [`SoftPrompt`]
/// items. The executor keeps the rows until the request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeRequest {
    pub seq_id: u64,
    pub item: usize,
}

/// An encoding that ended: the rows are the executor's, or the item failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedItem {
    pub seq_id: u64,
    pub item: usize,
    pub result: Result<(), String>,
}

/// One step: requests in and out, and the chunks to run (without chunks
/// the executor only takes requests in and out).
#[derive(Default)]
pub struct StepPlan {
    pub new_requests: Vec<NewRequest>,
    /// Requests that ended since the last step: their state is dropped.
    pub finished: Vec<u64>,
    /// Media items to start encoding. An encoder may run beside the steps;
    /// no chunk reaches an item's rows before its encoding was reported.
    /// Rows sent already encoded are copied before this step's chunks run.
    pub encode: Vec<EncodeRequest>,
    pub chunks: Vec<ScheduledChunk>,
}

/// One chunk's result.
pub struct SeqOutput {
    pub seq_id: u64,
    /// The sequence's tokens in the cache after this step.
    pub computed: usize,
    /// The tokens sampled, in order: none for a prompt chunk before the
    /// last, one for a plain step (more where drafted tokens were accepted).
    pub result: Result<Vec<Sampled>, String>,
    /// Prompt tokens scored in this step `(token, log-probability)`, in order.
    pub prompt_logprobs: Vec<(u32, Scored)>,
    pub drafting: DraftOutcome,
}

/// Speculative decoding in one chunk's result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftOutcome {
    /// Drafted tokens the step verified.
    pub verified: usize,
    /// Those accepted: they lead the sampled tokens, and their K/V are in
    /// the cache (`computed` counts them); the rest's positions are
    /// written again later.
    pub accepted: usize,
    /// Tokens proposed to follow the sampled ones, for a later step to verify.
    pub proposed: Vec<u32>,
}

/// What a step produced: one output per chunk, in the plan's order, and
/// the encodings that ended since the last step.
#[derive(Default)]
pub struct StepOutput {
    pub seqs: Vec<SeqOutput>,
    pub encoded: Vec<EncodedItem>,
}

/// Counters an executor keeps, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Steps whose batch failed and were run again sequence by sequence.
    pub step_retries: u64,
    /// Requests whose state the executor holds.
    pub requests: usize,
    /// Kernel jobs that found the thread pool busy (an encoder beside a
    /// step) and ran on their caller's thread alone.
    pub contended_kernel_jobs: u64,
    /// Time spent drafting with the model's assistant, in nanoseconds.
    pub drafting_ns: u64,
}

/// Why an executor could not start.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ExecutorError(pub String);

/// A LoRA adapter read from its file by an executor's
/// [`AdapterReader`], not yet held: opaque to the engine, which hands it
/// back to the executor that read it.
pub struct ReadAdapter(pub Box<dyn std::any::Any + Send>);

impl std::fmt::Debug for ReadAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReadAdapter")
    }
}

/// Reads the LoRA adapter `name` at a path (a PEFT folder or a GGUF LoRA
/// file on this machine) for an executor's model.
pub type AdapterReader =
    Arc<dyn Fn(&str, &std::path::Path) -> Result<ReadAdapter, ExecutorError> + Send + Sync>;

/// Runs the steps the engine plans. One executor serves one engine; the
/// engine calls it from its own thread, one step at a time.
pub trait Executor: Send {
    /// The model it runs.
    fn model_facts(&self) -> &ModelFacts;
    /// Allocates the KV pools; returns the bytes they hold.
    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<usize, ExecutorError>;
    /// Runs one step. A failure of some sequences is reported in their
    /// outputs; the others go on. A plan without chunks while encodings
    /// are under way waits a moment for one to end.
    fn execute(&mut self, plan: StepPlan) -> StepOutput;
    fn stats(&self) -> ExecutorStats;
    /// What reads LoRA adapters from their files for this executor's
    /// model, on any thread (the engine calls it on the caller's, so a
    /// large file never pauses the steps); `None`: it loads none.
    fn adapter_reader(&self) -> Option<AdapterReader> {
        None
    }
    /// Holds `adapter` (what [`Executor::adapter_reader`] read) under `id`
    /// and `name`, between two steps.
    fn load_adapter(
        &mut self,
        id: u32,
        name: &str,
        adapter: ReadAdapter,
    ) -> Result<AdapterFacts, ExecutorError> {
        let _ = (id, adapter);
        Err(ExecutorError(format!(
            "this executor cannot load LoRA adapters (`{name}`)"
        )))
    }
    /// Drops adapter `id`; no request that runs with it remains.
    fn unload_adapter(&mut self, id: u32) -> Result<(), ExecutorError> {
        Err(ExecutorError(format!(
            "this executor holds no LoRA adapter {id}"
        )))
    }
}

impl<E: Executor + ?Sized> Executor for Box<E> {
    fn model_facts(&self) -> &ModelFacts {
        (**self).model_facts()
    }
    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<usize, ExecutorError> {
        (**self).allocate_kv(layout)
    }
    fn execute(&mut self, plan: StepPlan) -> StepOutput {
        (**self).execute(plan)
    }
    fn stats(&self) -> ExecutorStats {
        (**self).stats()
    }
    fn adapter_reader(&self) -> Option<AdapterReader> {
        (**self).adapter_reader()
    }
    fn load_adapter(
        &mut self,
        id: u32,
        name: &str,
        adapter: ReadAdapter,
    ) -> Result<AdapterFacts, ExecutorError> {
        (**self).load_adapter(id, name, adapter)
    }
    fn unload_adapter(&mut self, id: u32) -> Result<(), ExecutorError> {
        (**self).unload_adapter(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(reset: bool, first_block: usize, added: &[u32]) -> BlockUpdate {
        BlockUpdate {
            reset,
            groups: vec![GroupUpdate {
                first_block,
                added: added.to_vec(),
            }],
        }
    }

    /// Tables follow appends, a window that moves past blocks (or past all
    /// of them) and a reset, as the scheduler's own tables do.
    #[test]
    fn updates_rebuild_the_tables() {
        let mut t = Vec::new();
        update(true, 0, &[4, 5]).apply(&mut t);
        update(false, 0, &[6]).apply(&mut t);
        assert_eq!(t[0].blocks, vec![4, 5, 6]);
        update(false, 2, &[7]).apply(&mut t);
        assert_eq!((t[0].first_block, t[0].blocks.clone()), (2, vec![6, 7]));
        update(false, 9, &[8]).apply(&mut t);
        assert_eq!((t[0].first_block, t[0].blocks.clone()), (9, vec![8]));
        update(true, 0, &[1]).apply(&mut t);
        assert_eq!((t[0].first_block, t[0].blocks.clone()), (0, vec![1]));
    }
}

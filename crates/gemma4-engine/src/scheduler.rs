//! Continuous batching: which sequences run in the next step and how many
//! of their tokens, under a per-step token budget.
//!
//! First come, first served. Running sequences go first (decode tokens and
//! the rest of chunked prompts), then waiting ones are admitted while there
//! is budget, a free sequence slot and KV memory. When memory runs out, the
//! most recently admitted sequence is preempted: its blocks are freed and it
//! goes back to the front of the queue, to be recomputed later. The
//! scheduler never sees tensors.

use std::collections::VecDeque;

use crate::kv_manager::{KvManager, SeqKv};

/// Limits the scheduler works within.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens processed per step (prefill chunks plus decode tokens).
    pub max_batch_tokens: usize,
}

/// The scheduler's view of a sequence.
#[derive(Debug)]
pub struct SeqState {
    pub id: u64,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    pub kv: SeqKv,
    /// Tokens taken from the prefix cache at the last admission.
    pub prefix_hit: usize,
    /// `[start, end)` spans of the prompt that must run in one step (an
    /// image whose tokens attend to each other), ascending.
    pub whole_spans: Vec<(usize, usize)>,
}

impl SeqState {
    /// Tokens still to run through the model.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// How many of the next tokens one step may run within `budget`, never
    /// ending inside a whole span (0 when the span ahead needs more budget).
    pub fn chunk_len(&self, budget: usize) -> usize {
        let start = self.computed;
        let mut len = self.pending().min(budget);
        for &(s, e) in &self.whole_spans {
            if s < start + len && start + len < e {
                len = if s > start {
                    s - start
                } else if e - start <= budget {
                    e - start
                } else {
                    0
                };
                break;
            }
        }
        len
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Index into [`Scheduler::running`].
    pub index: usize,
    pub start: usize,
    pub len: usize,
    /// The chunk ends at the last known token, so the step yields a next-token distribution.
    pub samples: bool,
}

/// Waiting and running sequences.
#[derive(Debug)]
pub struct Scheduler {
    pub limits: SchedulerLimits,
    pub waiting: VecDeque<SeqState>,
    pub running: Vec<SeqState>,
    pub preemptions: u64,
    pub prefix_hits: u64,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            prefix_hits: 0,
        }
    }

    /// Chooses the next step's work and allocates its KV blocks.
    pub fn schedule(&mut self, kv: &mut KvManager) -> Vec<Chunk> {
        let mut budget = self.limits.max_batch_tokens.max(1);
        let mut chunks = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let len = self.running[i].chunk_len(budget);
            if len == 0 {
                i += 1;
                continue;
            }
            let start = self.running[i].computed;
            if kv.allocate(&mut self.running[i].kv, start + len, start) {
                let samples = start + len == self.running[i].tokens.len();
                chunks.push(Chunk {
                    index: i,
                    start,
                    len,
                    samples,
                });
                budget -= len;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest sequence (possibly this one) and retry.
            let victim = self.running.len() - 1;
            self.preempt(victim, kv);
            chunks.retain(|c| c.index != victim);
            if victim == i {
                break;
            }
        }
        // Admit waiting sequences in arrival order.
        while budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.computed == 0 {
                // A cached prefix may not end inside an image that attends to itself.
                let spans = &seq.whole_spans;
                let resumable = |pos: usize| !spans.iter().any(|&(s, e)| s < pos && pos < e);
                let hit = kv.adopt_prefix(&mut seq.kv, &seq.tokens, resumable);
                seq.computed = hit;
                seq.prefix_hit = hit;
                if hit > 0 {
                    self.prefix_hits += 1;
                }
            }
            let start = seq.computed;
            let len = seq.chunk_len(budget);
            if len == 0 || !kv.allocate(&mut seq.kv, start + len, start) {
                kv.release(&mut seq.kv);
                seq.computed = 0;
                self.waiting.push_front(seq);
                break;
            }
            let samples = start + len == seq.tokens.len();
            chunks.push(Chunk {
                index: self.running.len(),
                start,
                len,
                samples,
            });
            budget -= len;
            self.running.push(seq);
        }
        chunks
    }

    /// Frees a running sequence's blocks and requeues it at the front.
    fn preempt(&mut self, index: usize, kv: &mut KvManager) {
        let mut seq = self.running.remove(index);
        kv.release(&mut seq.kv);
        seq.computed = 0;
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Removes a running sequence (finished or cancelled) and frees its blocks.
    pub fn finish(&mut self, index: usize, kv: &mut KvManager) -> SeqState {
        let mut seq = self.running.remove(index);
        kv.release(&mut seq.kv);
        seq
    }

    /// Removes a waiting sequence by id.
    pub fn remove_waiting(&mut self, id: u64, kv: &mut KvManager) -> Option<SeqState> {
        let pos = self.waiting.iter().position(|s| s.id == id)?;
        let mut seq = self.waiting.remove(pos)?;
        kv.release(&mut seq.kv);
        Some(seq)
    }
}

//! Continuous batching: which sequences run in the next step and how many
//! of their tokens, under a per-step token budget.
//!
//! First come, first served. Running sequences go first (decode tokens and
//! the rest of chunked prompts), then waiting ones are admitted while there
//! is budget, a free sequence slot and KV memory, and until the step holds
//! [`SchedulerLimits::admit_prompt_tokens`] prompt tokens: prompts that
//! arrive together are prefilled one step after another, so the first
//! answers after its own prefill rather than after all of them, while short
//! prompts still share a step. When memory runs out, the
//! most recently admitted sequence is preempted: its blocks are freed and it
//! goes back to the front of the queue, to be recomputed later. The
//! scheduler never sees tensors: [`Scheduler::schedule`] describes the step
//! by sequence id ([`ScheduledChunk`]), the executor runs it, and
//! [`Scheduler::commit`] takes each result back.

use std::collections::VecDeque;

use crate::executor::{BlockUpdate, EncodeRequest, GroupUpdate, ScheduledChunk};
use crate::kv_manager::{KvManager, SeqKv};
use crate::media::EncoderSpan;

/// Limits the scheduler works within.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens processed per step (prefill chunks plus decode tokens).
    pub max_batch_tokens: usize,
    /// Waiting sequences are admitted only while the step holds fewer prompt
    /// tokens than this (the first admitted may still take the whole
    /// budget). At `max_batch_tokens` or more, admission fills the budget.
    pub admit_prompt_tokens: usize,
    /// Soft tokens the media encoders may be encoding at once. An item
    /// larger than the budget starts when nothing else is encoding.
    pub encoder_tokens: usize,
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
    /// The prompt may start from cached KV (not when every position must run).
    pub reuse_prefix: bool,
    /// `[start, end)` spans of the prompt that must run in one step (an
    /// image whose tokens attend to each other), ascending.
    pub whole_spans: Vec<(usize, usize)>,
    /// Per cache group, the end (in logical blocks) of the table the
    /// executor holds; `None` until it holds one (new or preempted).
    pub executor_tables: Option<Vec<usize>>,
    /// The prompt's media items, in order, and where each one's encoding
    /// stands (the executor keeps the rows until the request ends).
    pub encoder_spans: Vec<EncoderSpan>,
    pub encoded: Vec<Encoding>,
    /// Tokens drafted to follow the last one, for the next step to verify.
    pub drafts: Vec<u32>,
}

/// Where a media item's encoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Pending,
    /// The executor is encoding it.
    Running,
    /// The executor holds its rows.
    Done,
}

impl SeqState {
    /// A new sequence over `tokens`, its blocks still to allocate.
    pub fn new(id: u64, tokens: Vec<u32>, kv: SeqKv) -> Self {
        Self {
            id,
            tokens,
            computed: 0,
            kv,
            prefix_hit: 0,
            reuse_prefix: true,
            whole_spans: Vec::new(),
            executor_tables: None,
            encoder_spans: Vec::new(),
            encoded: Vec::new(),
            drafts: Vec::new(),
        }
    }

    /// Cuts a chunk of `len` tokens from `start` before the first media
    /// item whose rows the executor does not hold yet, and has the items
    /// the chunk reaches encoded while the budget allows (`in_flight` soft
    /// tokens already encoding; an item larger than `budget` starts when
    /// nothing else is encoding). Rows already encoded are copied in the
    /// step itself, so they never cut a chunk. Returns the chunk's length
    /// and the items to start encoding.
    fn fit_encoder(
        &mut self,
        start: usize,
        len: usize,
        budget: usize,
        in_flight: &mut usize,
    ) -> (usize, Vec<usize>) {
        let mut started = Vec::new();
        let mut cut = None;
        for (k, span) in self.encoder_spans.iter().enumerate() {
            if span.end <= start {
                continue;
            }
            if span.start >= start + len {
                break;
            }
            let state = &mut self.encoded[k];
            if *state == Encoding::Pending && span.cost == 0 {
                *state = Encoding::Done;
                started.push(k);
            }
            if *state == Encoding::Pending && (*in_flight == 0 || *in_flight + span.cost <= budget)
            {
                *state = Encoding::Running;
                *in_flight += span.cost;
                started.push(k);
            }
            if *state != Encoding::Done && cut.is_none() {
                cut = Some(span.start.saturating_sub(start));
            }
        }
        (cut.unwrap_or(len), started)
    }

    /// How the tables changed since the executor last saw them; from now
    /// on it holds them as they are.
    fn block_update(&mut self) -> BlockUpdate {
        let known = self.executor_tables.take();
        let groups = self
            .kv
            .tables
            .iter()
            .enumerate()
            .map(|(g, t)| {
                let end = known.as_ref().map_or(0, |k| k[g]);
                let seen = end.saturating_sub(t.first_block).min(t.blocks.len());
                GroupUpdate {
                    first_block: t.first_block,
                    added: t.blocks[seen..].to_vec(),
                }
            })
            .collect();
        self.executor_tables = Some(
            self.kv
                .tables
                .iter()
                .map(|t| t.first_block + t.blocks.len())
                .collect(),
        );
        BlockUpdate {
            reset: known.is_none(),
            groups,
        }
    }

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

/// One sequence's part of a step, by index into the running list (internal).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chunk {
    index: usize,
    start: usize,
    len: usize,
    samples: bool,
    /// Drafted tokens after the `len` known ones.
    drafts: usize,
}

/// Waiting and running sequences.
#[derive(Debug)]
pub struct Scheduler {
    limits: SchedulerLimits,
    waiting: VecDeque<SeqState>,
    running: Vec<SeqState>,
    preemptions: u64,
    prefix_hits: u64,
    prefix_hit_tokens: u64,
    /// Soft tokens the executor is encoding, and the encodings to start.
    encoding: usize,
    encode_requests: Vec<EncodeRequest>,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            prefix_hits: 0,
            prefix_hit_tokens: 0,
            encoding: 0,
            encode_requests: Vec::new(),
        }
    }

    /// The encodings the last steps started, for the executor.
    pub fn take_encode_requests(&mut self) -> Vec<EncodeRequest> {
        std::mem::take(&mut self.encode_requests)
    }

    /// Whether the executor is encoding media for a sequence here.
    pub fn is_encoding(&self) -> bool {
        self.encoding > 0
    }

    /// A media item's rows are the executor's now.
    pub fn encoded(&mut self, seq_id: u64, item: usize) {
        let seq = self
            .running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == seq_id);
        let Some(seq) = seq else {
            return;
        };
        if let Some(state @ Encoding::Running) = seq.encoded.get_mut(item) {
            *state = Encoding::Done;
            self.encoding -= seq.encoder_spans[item].cost;
        }
    }

    /// Queues a new sequence.
    pub fn add(&mut self, seq: SeqState) {
        self.waiting.push_back(seq);
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn running_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.running.iter().map(|s| s.id)
    }

    /// The sequence at the head of the queue.
    pub fn first_waiting(&self) -> Option<u64> {
        self.waiting.front().map(|s| s.id)
    }

    /// A running sequence's tokens (prompt and generated).
    pub fn tokens(&self, id: u64) -> Option<&[u32]> {
        let seq = self.running.iter().find(|s| s.id == id)?;
        Some(&seq.tokens)
    }

    /// Sequences preempted so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Admissions that reused a cached prefix.
    pub fn prefix_hits(&self) -> u64 {
        self.prefix_hits
    }

    /// Prompt tokens whose KV came from the prefix cache, over all admissions.
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.prefix_hit_tokens
    }

    /// The most blocks any running sequence holds in cache group `group`.
    pub fn peak_blocks(&self, group: usize) -> usize {
        self.running
            .iter()
            .map(|r| r.kv.tables[group].blocks.len())
            .max()
            .unwrap_or(0)
    }

    /// Chooses the next step's work, allocates its KV blocks and describes
    /// it by sequence id.
    pub fn schedule(&mut self, kv: &mut KvManager) -> Vec<ScheduledChunk> {
        let chunks = self.pick(kv);
        chunks
            .into_iter()
            .map(|c| {
                let seq = &mut self.running[c.index];
                let mut tokens = seq.tokens[c.start..c.start + c.len].to_vec();
                tokens.extend(seq.drafts.drain(..).take(c.drafts));
                ScheduledChunk {
                    seq_id: seq.id,
                    start: c.start,
                    tokens,
                    blocks: seq.block_update(),
                    samples: c.samples,
                    drafts: c.drafts,
                }
            })
            .collect()
    }

    /// Takes a step's result back: the tokens it sampled (accepted drafts
    /// first) join the sequence, and the first `computed` tokens are in the
    /// cache (their full blocks become reusable prefixes; positions of
    /// rejected drafts past them are written again by later steps). Returns
    /// the sequence's length.
    pub fn commit(
        &mut self,
        seq_id: u64,
        computed: usize,
        sampled: &[u32],
        kv: &mut KvManager,
    ) -> Option<usize> {
        let seq = self.running.iter_mut().find(|s| s.id == seq_id)?;
        seq.tokens.extend_from_slice(sampled);
        seq.computed = computed.min(seq.tokens.len());
        seq.drafts.clear();
        kv.register_full_blocks(&mut seq.kv, &seq.tokens, seq.computed);
        Some(seq.tokens.len())
    }

    /// Tokens drafted to follow a running sequence's last one; the next
    /// step runs them with it, as far as its budget allows.
    pub fn set_drafts(&mut self, seq_id: u64, drafts: Vec<u32>) {
        if let Some(seq) = self.running.iter_mut().find(|s| s.id == seq_id) {
            seq.drafts = drafts;
        }
    }

    fn pick(&mut self, kv: &mut KvManager) -> Vec<Chunk> {
        let mut budget = self.limits.max_batch_tokens.max(1);
        let mut chunks = Vec::new();
        // Tokens of prompts (not decode tokens) in the step so far.
        let mut prompt_tokens = 0;
        let encoder_budget = self.limits.encoder_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let start = self.running[i].computed;
            let len = self.running[i].chunk_len(budget);
            let seq = &mut self.running[i];
            let (len, started) = seq.fit_encoder(start, len, encoder_budget, &mut self.encoding);
            let id = seq.id;
            self.encode_requests.extend(
                started
                    .into_iter()
                    .map(|item| EncodeRequest { seq_id: id, item }),
            );
            if len == 0 {
                i += 1;
                continue;
            }
            let samples = start + len == self.running[i].tokens.len();
            let drafts = if samples {
                self.running[i].drafts.len().min(budget - len)
            } else {
                0
            };
            if kv.allocate(&mut self.running[i].kv, start + len + drafts, start) {
                chunks.push(Chunk {
                    index: i,
                    start,
                    len,
                    samples,
                    drafts,
                });
                budget -= len + drafts;
                if !samples || len > 1 {
                    prompt_tokens += len;
                }
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
        while budget > 0
            && self.running.len() < self.limits.max_num_seqs
            && prompt_tokens < self.limits.admit_prompt_tokens
        {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.computed == 0 && seq.reuse_prefix {
                // A cached prefix may not end inside an image that attends to itself.
                let spans = &seq.whole_spans;
                let resumable = |pos: usize| !spans.iter().any(|&(s, e)| s < pos && pos < e);
                let hit = kv.adopt_prefix(&mut seq.kv, &seq.tokens, resumable);
                seq.computed = hit;
                seq.prefix_hit = hit;
                if hit > 0 {
                    self.prefix_hits += 1;
                    self.prefix_hit_tokens += hit as u64;
                }
            }
            let start = seq.computed;
            let len = seq.chunk_len(budget);
            let (len, started) = seq.fit_encoder(start, len, encoder_budget, &mut self.encoding);
            self.encode_requests
                .extend(started.into_iter().map(|item| EncodeRequest {
                    seq_id: seq.id,
                    item,
                }));
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
                drafts: 0,
            });
            budget -= len;
            prompt_tokens += len;
            self.running.push(seq);
        }
        chunks
    }

    /// Frees a running sequence's blocks and requeues it at the front.
    fn preempt(&mut self, index: usize, kv: &mut KvManager) {
        let mut seq = self.running.remove(index);
        kv.release(&mut seq.kv);
        seq.computed = 0;
        seq.executor_tables = None;
        seq.drafts.clear();
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Removes a sequence, running or waiting (finished or cancelled), and
    /// frees its blocks.
    pub fn remove(&mut self, id: u64, kv: &mut KvManager) -> Option<SeqState> {
        let mut seq = match self.running.iter().position(|s| s.id == id) {
            Some(i) => self.running.remove(i),
            None => {
                let pos = self.waiting.iter().position(|s| s.id == id)?;
                self.waiting.remove(pos)?
            }
        };
        kv.release(&mut seq.kv);
        for (state, span) in seq.encoded.iter().zip(&seq.encoder_spans) {
            if *state == Encoding::Running {
                self.encoding -= span.cost;
            }
        }
        Some(seq)
    }
}

#[cfg(test)]
mod tests {
    use gemma4_model::config::AttentionKind;
    use gemma4_model::paged::KvGroup;

    use super::*;
    use crate::media::EncoderSpan;

    fn kv() -> KvManager {
        let groups = vec![KvGroup {
            kind: AttentionKind::Full,
            layers: vec![0],
            heads: vec![(1, 2)],
        }];
        KvManager::new(&groups, &[64], 4, 8, false)
    }

    fn seq(kv: &KvManager, id: u64, len: u32) -> SeqState {
        SeqState::new(id, (0..len).collect(), kv.empty())
    }

    /// A step is described by sequence id with its tokens, positions and
    /// blocks; committing the results moves each sequence on.
    #[test]
    fn steps_are_described_by_id_and_committed_back() {
        let mut kv = kv();
        let mut s = Scheduler::new(SchedulerLimits {
            max_num_seqs: 4,
            max_batch_tokens: 8,
            admit_prompt_tokens: 8,
            encoder_tokens: 8,
        });
        s.add(seq(&kv, 7, 6));
        s.add(seq(&kv, 9, 5));
        let step = s.schedule(&mut kv);
        // Sequence 7 fits whole and samples; 9 gets the 2 tokens left of the budget.
        assert_eq!(step.len(), 2);
        assert_eq!(
            (step[0].seq_id, step[0].start, step[0].samples),
            (7, 0, true)
        );
        assert_eq!(step[0].tokens, vec![0, 1, 2, 3, 4, 5]);
        assert!(step[0].blocks.reset);
        assert_eq!(step[0].blocks.groups[0].added.len(), 2);
        assert_eq!(
            (step[1].seq_id, step[1].tokens.len(), step[1].samples),
            (9, 2, false)
        );
        assert_eq!(s.commit(7, 6, &[42], &mut kv), Some(7));
        assert_eq!(s.commit(9, 2, &[], &mut kv), Some(5));
        assert_eq!(s.tokens(7).and_then(|t| t.last()), Some(&42));
        let step = s.schedule(&mut kv);
        // 7 decodes its new token at position 6, in the blocks it has;
        // 9 finishes its prompt in one more block.
        assert_eq!(
            (step[0].seq_id, step[0].start, step[0].tokens.clone()),
            (7, 6, vec![42])
        );
        assert!(!step[0].blocks.reset && step[0].blocks.groups[0].added.is_empty());
        assert_eq!(step[1].blocks.groups[0].added.len(), 1);
        assert_eq!(
            (step[1].seq_id, step[1].start, step[1].samples),
            (9, 2, true)
        );
        assert!(s.remove(7, &mut kv).is_some());
        assert!(s.remove(9, &mut kv).is_some());
        assert!(s.is_idle());
        assert_eq!(kv.usage()[0].used, 0);
    }

    /// A chunk stops before media whose rows are not encoded yet; items
    /// start encoding as chunks reach them, within the encoder budget (one
    /// larger than the budget when nothing else encodes); nothing is
    /// encoded twice, not even after a preemption; rows already encoded
    /// never cut a chunk.
    #[test]
    fn chunks_wait_for_their_media_and_encodings_keep_to_the_budget() {
        let mut kv = kv();
        let mut s = Scheduler::new(SchedulerLimits {
            max_num_seqs: 4,
            max_batch_tokens: 16,
            admit_prompt_tokens: 16,
            encoder_tokens: 4,
        });
        let span = |start, end| EncoderSpan {
            start,
            end,
            cost: end - start,
        };
        let mut a = seq(&kv, 1, 14);
        // Two items of 3 soft tokens at 1..4 and 5..8, one of 5 at 9..14.
        a.encoder_spans = vec![span(1, 4), span(5, 8), span(9, 14)];
        a.encoded = vec![Encoding::Pending; 3];
        s.add(a);
        let step = |s: &mut Scheduler, kv: &mut KvManager| {
            let chunks = s.schedule(kv);
            let started: Vec<usize> = s.take_encode_requests().iter().map(|r| r.item).collect();
            (chunks.first().map(|c| (c.start, c.tokens.len())), started)
        };
        // The first item starts; the second would pass the budget.
        assert_eq!(step(&mut s, &mut kv), (Some((0, 1)), vec![0]));
        s.commit(1, 1, &[], &mut kv);
        assert_eq!(step(&mut s, &mut kv), (None, vec![]), "waits for its rows");
        s.encoded(1, 0);
        assert!(!s.is_encoding());
        assert_eq!(step(&mut s, &mut kv), (Some((1, 4)), vec![1]));
        s.commit(1, 5, &[], &mut kv);
        s.encoded(1, 1);
        // Past the budget: it starts once nothing else encodes.
        assert_eq!(step(&mut s, &mut kv), (Some((5, 4)), vec![2]));
        s.commit(1, 9, &[], &mut kv);
        assert!(s.is_encoding());
        s.encoded(1, 2);
        assert_eq!(step(&mut s, &mut kv), (Some((9, 5)), vec![]));
        s.commit(1, 14, &[7], &mut kv);
        // Recomputed after a preemption: the rows are the executor's already.
        s.preempt(0, &mut kv);
        assert_eq!(step(&mut s, &mut kv), (Some((0, 15)), vec![]));
        s.commit(1, 15, &[8], &mut kv);
        // Rows sent encoded are copied in the step that reaches them.
        let mut b = seq(&kv, 2, 6);
        b.encoder_spans = vec![EncoderSpan {
            start: 2,
            end: 4,
            cost: 0,
        }];
        b.encoded = vec![Encoding::Pending];
        s.add(b);
        let chunks = s.schedule(&mut kv);
        assert_eq!(
            chunks.last().map(|c| (c.seq_id, c.tokens.len())),
            Some((2, 6))
        );
        assert_eq!(s.take_encode_requests().len(), 1);
    }

    /// Prompts that arrive together run one step after another once a step
    /// holds `admit_prompt_tokens` prompt tokens, each joining the decode of
    /// those before it; short prompts still share a step.
    #[test]
    fn prompts_are_admitted_until_the_step_holds_enough_prompt_tokens() {
        let mut kv = kv();
        let mut s = Scheduler::new(SchedulerLimits {
            max_num_seqs: 4,
            max_batch_tokens: 16,
            admit_prompt_tokens: 4,
            encoder_tokens: 16,
        });
        for id in 1..=3 {
            s.add(seq(&kv, id, 5));
        }
        let ids = |step: &[ScheduledChunk]| -> Vec<(u64, usize)> {
            step.iter().map(|c| (c.seq_id, c.tokens.len())).collect()
        };
        let step = s.schedule(&mut kv);
        assert_eq!(ids(&step), vec![(1, 5)]);
        s.commit(1, 5, &[9], &mut kv);
        let step = s.schedule(&mut kv);
        // 1 decodes beside 2's prompt; 3 waits, as 2's prompt fills the step.
        assert_eq!(ids(&step), vec![(1, 1), (2, 5)]);
        s.commit(1, 6, &[9], &mut kv);
        s.commit(2, 5, &[9], &mut kv);
        let step = s.schedule(&mut kv);
        assert_eq!(ids(&step), vec![(1, 1), (2, 1), (3, 5)]);
        for id in 1..=3 {
            assert!(s.remove(id, &mut kv).is_some());
        }
        // Prompts shorter than the threshold share a step until they reach it.
        for id in 4..=7 {
            s.add(seq(&kv, id, 2));
        }
        let step = s.schedule(&mut kv);
        assert_eq!(ids(&step), vec![(4, 2), (5, 2)]);
    }
}

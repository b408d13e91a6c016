//! The engine loop: one thread owns the model and the KV cache; callers
//! talk to it through channels ([`EngineHandle`]) and receive their tokens
//! as a stream ([`RequestStream`]). Each iteration: take new requests and
//! cancellations, let the scheduler pick the step, run one batched model
//! step, sample, detokenize, check stops, and send events.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use candle_core::Device;
use gemma4_model::config::AttentionKind;
use gemma4_model::paged::{kv_groups, KvDtype, PagedKvPool, SeqBlocks};
use gemma4_model::plan::kv_pool_blocks;
use gemma4_model::{BatchSeq, Gemma4, LogitsFor};
use gemma4_text::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::api::{
    EngineEvent, EngineStats, FinishReason, GenerationRequest, SubmitError, TokenLogprob, Usage,
};
use crate::kv_manager::KvManager;
use crate::output::OutputState;
use crate::sampler::Sampler;
use crate::scheduler::{Scheduler, SchedulerLimits, SeqState};

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Requests waiting beyond those; more are refused.
    pub max_queue: usize,
    /// Prompt plus generated tokens per sequence.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Tokens per step (prefill chunk size limit).
    pub max_batch_tokens: usize,
    /// KV memory (f32) for all groups; `None` sizes the cache for
    /// `max_num_seqs` sequences of `max_model_len` tokens.
    pub kv_memory_bytes: Option<usize>,
    /// Element type of the KV pools (f32 keeps the reference's arithmetic).
    pub kv_dtype: KvDtype,
    pub prefix_caching: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 16,
            max_queue: 64,
            max_model_len: 4096,
            block_size: 16,
            max_batch_tokens: 512,
            kv_memory_bytes: None,
            kv_dtype: KvDtype::F32,
            prefix_caching: true,
        }
    }
}

/// The KV layout the engine allocated, for logs and `/metrics`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvPlanReport {
    /// Per group: kind, producer layers, bytes per token (f32), blocks.
    pub groups: Vec<(String, usize, usize, usize)>,
    pub block_size: usize,
    pub total_bytes: usize,
}

enum Command {
    Submit(Box<Pending>),
    Cancel(u64),
}

struct Pending {
    id: u64,
    request: GenerationRequest,
    events: UnboundedSender<EngineEvent>,
}

struct Shared {
    stats: Mutex<EngineStats>,
    waiting: AtomicUsize,
    draining: AtomicBool,
    stopped: AtomicBool,
    next_id: AtomicU64,
}

/// A cheap, cloneable way to reach the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    config: Arc<EngineConfig>,
    tokenizer: Arc<Tokenizer>,
    kv_plan: Arc<KvPlanReport>,
}

/// Events of one request. Dropping it cancels the request.
pub struct RequestStream {
    pub id: u64,
    rx: UnboundedReceiver<EngineEvent>,
    cancel: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event; `None` after `Finished`.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        let e = self.rx.recv().await;
        self.note(&e);
        e
    }

    /// Blocking variant for non-async callers.
    pub fn blocking_next(&mut self) -> Option<EngineEvent> {
        let e = self.rx.blocking_recv();
        self.note(&e);
        e
    }

    fn note(&mut self, e: &Option<EngineEvent>) {
        if matches!(e, None | Some(EngineEvent::Finished { .. })) {
            self.done = true;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cancel.send(Command::Cancel(self.id));
        }
    }
}

impl EngineHandle {
    /// Queues a request. Refused when the queue is full, the engine drains,
    /// or the request cannot fit the context.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestStream, SubmitError> {
        if self.shared.stopped.load(Ordering::SeqCst) {
            return Err(SubmitError::Stopped);
        }
        if self.shared.draining.load(Ordering::SeqCst) {
            return Err(SubmitError::Draining);
        }
        self.validate(&request)?;
        let waiting = self.shared.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.config.max_queue {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(waiting));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (events, rx) = unbounded_channel();
        if self
            .tx
            .send(Command::Submit(Box::new(Pending {
                id,
                request,
                events,
            })))
            .is_err()
        {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(RequestStream {
            id,
            rx,
            cancel: self.tx.clone(),
            done: false,
        })
    }

    fn validate(&self, r: &GenerationRequest) -> Result<(), SubmitError> {
        let limit = self.config.max_model_len;
        if r.prompt_ids.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if r.prompt_ids.len() >= limit {
            return Err(SubmitError::Invalid(format!(
                "the prompt has {} tokens; the context length (max_model_len) is {limit}",
                r.prompt_ids.len()
            )));
        }
        if r.params.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        if r.prompt_ids.len() + r.params.max_tokens > limit {
            return Err(SubmitError::Invalid(format!(
                "prompt ({} tokens) plus max_tokens ({}) exceeds the context length (max_model_len) of {limit}",
                r.prompt_ids.len(),
                r.params.max_tokens
            )));
        }
        let vocab = self.tokenizer.vocab_size();
        if let Some(bad) = r.prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        Ok(())
    }

    pub fn stats(&self) -> EngineStats {
        let mut s = self.shared.stats.lock().map(|s| *s).unwrap_or_default();
        s.waiting = self.shared.waiting.load(Ordering::SeqCst);
        s
    }

    /// Stop accepting requests; running and queued ones continue.
    pub fn start_draining(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::SeqCst)
    }

    /// No request is running or waiting.
    pub fn is_idle(&self) -> bool {
        let s = self.stats();
        s.running == 0 && s.waiting == 0
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn kv_plan(&self) -> &KvPlanReport {
        &self.kv_plan
    }
}

/// Starts the engine thread.
pub fn start(
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
) -> gemma4_model::Result<EngineHandle> {
    let cfg = model.config().clone();
    let groups = kv_groups(&cfg);
    let bs = config.block_size.max(1);
    let window = cfg.sliding_window;
    // Blocks per group: sized for max_num_seqs full-length sequences, or the memory budget.
    // A step's chunk of c tokens sees keys back to its first query's window.
    let per_seq: Vec<usize> =
        kv_pool_blocks(&cfg, config.max_model_len, bs, config.max_batch_tokens, 1)
            .into_iter()
            .map(|(_, n)| n)
            .collect();
    let seq_bytes: usize = groups
        .iter()
        .zip(&per_seq)
        .map(|(g, &n)| g.bytes_per_token(config.kv_dtype.bytes()) * n * bs)
        .sum();
    let seqs = match config.kv_memory_bytes {
        Some(budget) => (budget / seq_bytes.max(1)).max(1),
        None => config.max_num_seqs.max(1),
    };
    let blocks: Vec<usize> = per_seq.iter().map(|&n| n * seqs).collect();
    let pool = PagedKvPool::new(&cfg, bs, &blocks, config.kv_dtype, &Device::Cpu)?;
    let kv_plan = KvPlanReport {
        groups: groups
            .iter()
            .zip(&blocks)
            .map(|(g, &n)| {
                (
                    format!("{:?}", g.kind).to_lowercase(),
                    g.layers.len(),
                    g.bytes_per_token(config.kv_dtype.bytes()),
                    n,
                )
            })
            .collect(),
        block_size: bs,
        total_bytes: pool.bytes(),
    };
    let kv = KvManager::new(&groups, &blocks, bs, window, config.prefix_caching);
    let shared = Arc::new(Shared {
        stats: Mutex::new(EngineStats {
            kv_blocks_total: blocks.iter().sum(),
            kv_block_size: bs,
            ..Default::default()
        }),
        waiting: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
        stopped: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
    });
    let (tx, rx) = mpsc::channel();
    let limits = SchedulerLimits {
        max_num_seqs: config.max_num_seqs.max(1),
        max_batch_tokens: config.max_batch_tokens.max(1),
    };
    let mut worker = Worker {
        model,
        tokenizer: tokenizer.clone(),
        pool,
        kv,
        scheduler: Scheduler::new(limits),
        live: HashMap::new(),
        shared: shared.clone(),
        max_model_len: config.max_model_len,
    };
    std::thread::Builder::new()
        .name("gemma4-engine".into())
        .spawn(move || worker.run(rx))
        .map_err(|e| {
            gemma4_model::ModelError::Input(format!("cannot start the engine thread: {e}"))
        })?;
    Ok(EngineHandle {
        tx,
        shared,
        config: Arc::new(config),
        tokenizer,
        kv_plan: Arc::new(kv_plan),
    })
}

/// Per-request state the scheduler does not need.
struct Live {
    sampler: Sampler,
    output: OutputState,
    events: UnboundedSender<EngineEvent>,
    deadline: Option<Instant>,
    prompt_len: usize,
    generated: usize,
    /// Left the wait queue for the first time (later re-queues are preemptions).
    admitted: bool,
}

struct Worker {
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    pool: PagedKvPool,
    kv: KvManager,
    scheduler: Scheduler,
    live: HashMap<u64, Live>,
    shared: Arc<Shared>,
    max_model_len: usize,
}

impl Worker {
    fn run(&mut self, rx: mpsc::Receiver<Command>) {
        loop {
            let idle = self.scheduler.running.is_empty() && self.scheduler.waiting.is_empty();
            // Block only when there is nothing to do.
            if idle {
                match rx.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.command(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if self.scheduler.running.is_empty() && self.scheduler.waiting.is_empty() {
                            self.shared.stopped.store(true, Ordering::SeqCst);
                            return;
                        }
                        break;
                    }
                }
            }
            self.expire();
            self.step();
            self.publish_stats();
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(p) => {
                let Pending {
                    id,
                    request,
                    events,
                } = *p;
                let prompt_len = request.prompt_ids.len();
                self.live.insert(
                    id,
                    Live {
                        sampler: Sampler::new(request.params.clone(), &request.prompt_ids),
                        output: OutputState::new(self.tokenizer.clone(), &request.params),
                        events,
                        deadline: request.deadline,
                        prompt_len,
                        generated: 0,
                        admitted: false,
                    },
                );
                self.scheduler.waiting.push_back(SeqState {
                    id,
                    tokens: request.prompt_ids,
                    computed: 0,
                    kv: self.kv.empty(),
                    prefix_hit: 0,
                });
            }
            Command::Cancel(id) => self.end(id, FinishReason::Cancelled),
        }
    }

    /// Ends requests whose deadline passed or whose caller went away.
    fn expire(&mut self) {
        let now = Instant::now();
        let ended: Vec<(u64, FinishReason)> = self
            .live
            .iter()
            .filter_map(|(&id, l)| {
                if l.events.is_closed() {
                    Some((id, FinishReason::Cancelled))
                } else if l.deadline.is_some_and(|d| now >= d) {
                    Some((id, FinishReason::Timeout))
                } else {
                    None
                }
            })
            .collect();
        for (id, reason) in ended {
            self.end(id, reason);
        }
    }

    /// Removes a request wherever it is, frees its blocks and sends `Finished`.
    fn end(&mut self, id: u64, reason: FinishReason) {
        if let Some(i) = self.scheduler.running.iter().position(|s| s.id == id) {
            self.scheduler.finish(i, &mut self.kv);
        } else {
            self.scheduler.remove_waiting(id, &mut self.kv);
        }
        if let Some(mut l) = self.live.remove(&id) {
            if !l.admitted {
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            }
            // Callers that read the stats after `Finished` see the blocks freed.
            self.publish_stats();
            let text = l.output.flush();
            let usage = Usage {
                prompt_tokens: l.prompt_len,
                completion_tokens: l.generated,
            };
            let _ = l.events.send(EngineEvent::Finished {
                reason,
                text,
                usage,
            });
        }
    }

    fn step(&mut self) {
        let chunks = self.scheduler.schedule(&mut self.kv);
        // Requests admitted from the queue for the first time no longer count as waiting.
        for seq in &self.scheduler.running {
            if let Some(l) = self.live.get_mut(&seq.id) {
                if !l.admitted {
                    l.admitted = true;
                    self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        if chunks.is_empty() {
            if self.scheduler.running.is_empty() {
                // Nothing runs, yet the head of the queue cannot be placed: it can never fit.
                if let Some(id) = self.scheduler.waiting.front().map(|s| s.id) {
                    self.end(
                        id,
                        FinishReason::Error(
                            "the request needs more KV-cache memory than the engine has".into(),
                        ),
                    );
                }
            }
            return;
        }
        let tables: Vec<SeqBlocks> = chunks
            .iter()
            .map(|c| SeqBlocks {
                groups: self.scheduler.running[c.index].kv.tables.clone(),
                len_after_step: c.start + c.len,
            })
            .collect();
        let batch: Vec<BatchSeq<'_>> = chunks
            .iter()
            .map(|c| BatchSeq {
                ids: &self.scheduler.running[c.index].tokens[c.start..c.start + c.len],
                start: c.start,
                logits: c.samples.then_some(LogitsFor::Last),
            })
            .collect();
        let result = {
            let mut view = self.pool.view(&tables);
            self.model.forward_batch(&batch, &mut view, None)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let ids: Vec<u64> = chunks
                    .iter()
                    .map(|c| self.scheduler.running[c.index].id)
                    .collect();
                for id in ids {
                    self.end(id, FinishReason::Error(format!("model step failed: {e}")));
                }
                return;
            }
        };
        let mut finished = Vec::new();
        for (c, row) in chunks.iter().zip(logits) {
            let seq = &mut self.scheduler.running[c.index];
            seq.computed = c.start + c.len;
            self.kv
                .register_full_blocks(&mut seq.kv, &seq.tokens, seq.computed);
            let Some(row) = row else { continue };
            let id = seq.id;
            let Some(live) = self.live.get_mut(&id) else {
                continue;
            };
            let values = match row.squeeze(0).and_then(|r| r.to_vec1::<f32>()) {
                Ok(v) => v,
                Err(e) => {
                    finished.push((
                        id,
                        FinishReason::Error(format!("reading logits failed: {e}")),
                    ));
                    continue;
                }
            };
            let sampled = live.sampler.sample(&values);
            let token = sampled.token;
            if live.sampler.params().stop_token_ids.contains(&token) {
                finished.push((id, FinishReason::Stop));
                continue;
            }
            live.generated += 1;
            seq.tokens.push(token);
            let logprob = sampled.logprobs.map(|(lp, top)| TokenLogprob {
                token_id: token,
                text: self.tokenizer.decode(&[token], false).unwrap_or_default(),
                logprob: lp,
                top: top
                    .into_iter()
                    .map(|(t, l)| (t, self.tokenizer.decode(&[t], false).unwrap_or_default(), l))
                    .collect(),
            });
            let (text, stopped) = live.output.push(token);
            let _ = live.events.send(EngineEvent::Token {
                id: token,
                text,
                logprob,
            });
            if stopped {
                finished.push((id, FinishReason::Stop));
            } else if live.generated >= live.sampler.params().max_tokens
                || seq.tokens.len() >= self.max_model_len
            {
                finished.push((id, FinishReason::Length));
            }
        }
        for (id, reason) in finished {
            self.end(id, reason);
        }
    }

    fn publish_stats(&self) {
        if let Ok(mut s) = self.shared.stats.lock() {
            let usage = self.kv.usage();
            for (g, u) in self.pool.groups().iter().zip(&usage) {
                match g.kind {
                    AttentionKind::Sliding => s.kv_sliding_blocks_used = u.used,
                    AttentionKind::Full => s.kv_full_blocks_used = u.used,
                }
            }
            if let Some(g) = self
                .pool
                .groups()
                .iter()
                .position(|g| g.kind == AttentionKind::Sliding)
            {
                let peak = self
                    .scheduler
                    .running
                    .iter()
                    .map(|r| r.kv.tables[g].blocks.len())
                    .max()
                    .unwrap_or(0);
                s.kv_sliding_blocks_per_seq_peak = s.kv_sliding_blocks_per_seq_peak.max(peak);
            }
            s.running = self.scheduler.running.len();
            s.kv_blocks_total = usage.iter().map(|u| u.total).sum();
            s.kv_blocks_used = usage.iter().map(|u| u.used).sum();
            s.prefix_cache_hits = self.scheduler.prefix_hits;
            s.preemptions = self.scheduler.preemptions;
        }
    }
}

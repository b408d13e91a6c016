//! The engine loop: one thread owns the model and the KV cache; callers
//! talk to it through channels ([`EngineHandle`]) and receive their tokens
//! as a stream ([`RequestStream`]). Each iteration: take new requests and
//! cancellations, let the scheduler pick the step, run one batched model
//! step, sample, detokenize, check stops, and send events.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use candle_core::{Device, Tensor};
use gemma4_model::config::AttentionKind;
use gemma4_model::paged::{kv_groups, KvDtype, PagedKvPool, SeqBlocks};
use gemma4_model::plan::kv_pool_blocks;
use gemma4_model::{BatchSeq, Gemma4, LogitsFor, SoftTokens};
use gemma4_text::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::api::{
    EngineEvent, EngineStats, FinishReason, GenerationRequest, SoftPrompt, SubmitError,
    TokenConstraint, TokenLogprob, Usage,
};
use crate::kv_manager::KvManager;
use crate::output::OutputState;
use crate::sampler::Sampler;
use crate::scheduler::{Chunk, Scheduler, SchedulerLimits, SeqState};

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
    CancelAll,
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
    /// Why the engine thread gave up, once it has.
    failure: Mutex<Option<String>>,
    next_id: AtomicU64,
}

/// A cheap, cloneable way to reach the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    config: Arc<EngineConfig>,
    tokenizer: Arc<Tokenizer>,
    token_id_limit: usize,
    /// The model's width: the length of each encoder row a request brings.
    hidden_size: usize,
    /// Images attend within themselves, so each must run in one step.
    bidirectional_vision: bool,
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

    /// The remaining token ids and the finish reason, blocking; `None` if
    /// the engine dropped the stream without a `Finished` event.
    pub fn blocking_finish(mut self) -> Option<(Vec<u32>, FinishReason)> {
        let mut ids = Vec::new();
        while let Some(e) = self.blocking_next() {
            match e {
                EngineEvent::Token { id, .. } => ids.push(id),
                EngineEvent::Finished { reason, .. } => return Some((ids, reason)),
            }
        }
        None
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
        if self.health().is_err() {
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

    /// The engine's own defence; the server checks the same limits first to name the field.
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
        if let Some(soft) = &r.soft_prompt {
            let step = self.config.max_batch_tokens;
            let too_long = soft.blocks.iter().copied().find(|(s, e)| e - s > step);
            if let Some((s, e)) = too_long.filter(|_| self.bidirectional_vision) {
                return Err(SubmitError::Invalid(format!(
                    "an image of {} soft tokens does not fit one step of {step} tokens; raise --max-batch-tokens or send fewer soft tokens per image",
                    e - s
                )));
            }
            let in_prompt = soft.rows.windows(2).all(|w| w[0] < w[1])
                && soft
                    .rows
                    .last()
                    .is_none_or(|&last| last < r.prompt_ids.len());
            if !in_prompt || soft.embeds.len() != soft.rows.len() * self.hidden_size {
                return Err(SubmitError::Invalid(format!(
                    "the encoder rows do not fit the prompt: {} rows (ascending, below {}), {} values for a width of {}",
                    soft.rows.len(),
                    r.prompt_ids.len(),
                    soft.embeds.len(),
                    self.hidden_size
                )));
            }
        }
        self.check_token_ids(&r.prompt_ids)?;
        self.check_token_ids(&r.params.stop_token_ids)?;
        crate::api::check_stop_strings(&r.params.stop_strings).map_err(SubmitError::Invalid)
    }

    /// Token ids at or past [`EngineHandle::token_id_limit`] are refused, naming the first.
    pub fn check_token_ids(&self, ids: &[u32]) -> Result<(), SubmitError> {
        let limit = self.token_id_limit;
        match ids.iter().find(|&&t| t as usize >= limit) {
            Some(bad) => Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary (valid ids are below {limit})"
            ))),
            None => Ok(()),
        }
    }

    /// One past the largest valid token id: the smaller of the tokenizer's
    /// vocabulary (added tokens included) and the model's embedding rows.
    pub fn token_id_limit(&self) -> usize {
        self.token_id_limit
    }

    /// `Err` with the reason once the engine thread has failed or stopped.
    pub fn health(&self) -> Result<(), String> {
        if let Some(why) = self.shared.failure.lock().ok().and_then(|f| f.clone()) {
            return Err(why);
        }
        if self.shared.stopped.load(Ordering::SeqCst) {
            return Err("the engine thread has stopped".into());
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

    /// Ends every running and waiting request with [`FinishReason::Cancelled`]
    /// (each stream still gets its `Finished` event).
    pub fn cancel_all(&self) {
        let _ = self.tx.send(Command::CancelAll);
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
    start_worker(
        model,
        tokenizer,
        config,
        #[cfg(feature = "fault-injection")]
        None,
    )
}

/// Starts the engine thread with a fault to inject (tests of the supervision only).
#[cfg(feature = "fault-injection")]
pub fn start_with_fault(
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    fault: crate::fault::FaultPlan,
) -> gemma4_model::Result<EngineHandle> {
    start_worker(model, tokenizer, config, Some(fault))
}

fn start_worker(
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    #[cfg(feature = "fault-injection")] fault: Option<crate::fault::FaultPlan>,
) -> gemma4_model::Result<EngineHandle> {
    let cfg = model.config().clone();
    // A token id must be known to both the tokenizer (added tokens included) and the embedding.
    let token_id_limit = tokenizer.vocab_size().min(cfg.vocab_size);
    if tokenizer.vocab_size() != cfg.vocab_size {
        tracing::warn!(
            tokenizer = tokenizer.vocab_size(),
            model = cfg.vocab_size,
            "the tokenizer and the model disagree on the vocabulary size; token ids from {token_id_limit} on are refused"
        );
    }
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
        .map(|(g, &n)| g.bytes_per_token(config.kv_dtype) * n * bs)
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
                    g.bytes_per_token(config.kv_dtype),
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
        failure: Mutex::new(None),
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
        step_retries: 0,
        token_texts: HashMap::new(),
        #[cfg(feature = "fault-injection")]
        fault,
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
        token_id_limit,
        hidden_size: cfg.hidden_size,
        bidirectional_vision: cfg.image_attention.is_bidirectional(),
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
    /// Encoder rows of the prompt (images), if any.
    soft_prompt: Option<Arc<SoftPrompt>>,
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
    /// Steps whose batch failed and were run again sequence by sequence.
    step_retries: u64,
    /// Each token's own text, decoded the first time a log-prob needs it.
    token_texts: HashMap<u32, String>,
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault::FaultPlan>,
}

/// A token's text on its own (for log-probs), decoded once per engine.
fn token_text(cache: &mut HashMap<u32, String>, tokenizer: &Tokenizer, id: u32) -> String {
    cache
        .entry(id)
        .or_insert_with(|| tokenizer.decode(&[id], false).unwrap_or_default())
        .clone()
}

/// Constraints back from [`prepare_constraints`], each with its panic, if any.
type PreparedConstraints =
    std::thread::Result<Vec<(u64, Box<dyn TokenConstraint>, Option<String>)>>;

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

/// The text of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

impl Worker {
    /// Runs iterations until every handle is gone. A panic outside the model
    /// step (in the bookkeeping) leaves no state to trust: every request gets
    /// the error, the reason is kept for [`EngineHandle::health`], and the thread ends.
    fn run(&mut self, rx: mpsc::Receiver<Command>) {
        loop {
            match panic::catch_unwind(AssertUnwindSafe(|| self.iterate(&rx))) {
                Ok(true) => {}
                Ok(false) => break,
                Err(payload) => {
                    self.fail(&panic_message(payload.as_ref()));
                    break;
                }
            }
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
    }

    /// One iteration; false when the engine should stop.
    fn iterate(&mut self, rx: &mpsc::Receiver<Command>) -> bool {
        let idle = self.scheduler.running.is_empty() && self.scheduler.waiting.is_empty();
        // Block only when there is nothing to do.
        if idle {
            match rx.recv() {
                Ok(c) => self.command(c),
                Err(_) => return false,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => self.command(c),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if self.scheduler.running.is_empty() && self.scheduler.waiting.is_empty() {
                        return false;
                    }
                    break;
                }
            }
        }
        self.expire();
        self.step();
        self.publish_stats();
        true
    }

    /// Gives up after a panic in the bookkeeping: records why and ends every request.
    fn fail(&mut self, panic: &str) {
        let reason = format!("the engine failed and must be restarted: {panic}");
        tracing::error!(
            running = self.scheduler.running.len(),
            waiting = self.scheduler.waiting.len(),
            "{reason}"
        );
        if let Ok(mut failure) = self.shared.failure.lock() {
            *failure = Some(reason.clone());
        }
        for (_, live) in self.live.drain() {
            let _ = live.events.send(EngineEvent::Finished {
                reason: FinishReason::Error(reason.clone()),
                text: String::new(),
                usage: Usage {
                    prompt_tokens: live.prompt_len,
                    completion_tokens: live.generated,
                },
            });
        }
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
                        soft_prompt: request.soft_prompt.clone(),
                    },
                );
                let content_key = request.soft_prompt.as_ref().map_or(0, |s| s.content_key);
                let whole_spans = match &request.soft_prompt {
                    Some(soft) if self.model.config().image_attention.is_bidirectional() => {
                        soft.blocks.clone()
                    }
                    _ => Vec::new(),
                };
                self.scheduler.waiting.push_back(SeqState {
                    id,
                    tokens: request.prompt_ids,
                    computed: 0,
                    kv: self.kv.empty_keyed(content_key),
                    prefix_hit: 0,
                    whole_spans,
                });
            }
            Command::Cancel(id) => self.end(id, FinishReason::Cancelled),
            Command::CancelAll => {
                let ids: Vec<u64> = self.live.keys().copied().collect();
                for id in ids {
                    self.end(id, FinishReason::Cancelled);
                }
            }
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
        #[cfg(feature = "fault-injection")]
        self.inject_engine_fault(&chunks);
        // Grammar masks for this step's samples are worked out on another
        // thread while the model computes the logits they will mask.
        let lent = self.lend_constraints(&chunks);
        let lent_ids: Vec<u64> = lent.iter().map(|(id, _)| *id).collect();
        let (rows, prepared) = std::thread::scope(|s| {
            let preparing = (!lent.is_empty()).then(|| s.spawn(|| prepare_constraints(lent)));
            let rows = self.forward(&chunks);
            (rows, preparing.map(|h| h.join()))
        });
        let mut finished = self.restore_constraints(&lent_ids, prepared);
        for (c, row) in chunks.iter().zip(rows) {
            let id = self.scheduler.running[c.index].id;
            if finished.iter().any(|(failed, _)| *failed == id) {
                continue;
            }
            let row = match row {
                Ok(row) => row,
                Err(e) => {
                    finished.push((id, FinishReason::Error(e)));
                    continue;
                }
            };
            // One sequence's sampling and detokenizing: a panic there ends that request only.
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| self.advance(*c, row)));
            match outcome {
                Ok(Some(reason)) => finished.push((id, reason)),
                Ok(None) => {}
                Err(payload) => {
                    let msg = panic_message(payload.as_ref());
                    tracing::error!(request = id, "sampling panicked: {msg}");
                    finished.push((id, FinishReason::Error(format!("sampling failed: {msg}"))));
                }
            }
        }
        for (id, reason) in finished {
            self.end(id, reason);
        }
    }

    /// The constraints of the sequences that sample this step, taken out of
    /// their samplers.
    fn lend_constraints(&mut self, chunks: &[Chunk]) -> Vec<(u64, Box<dyn TokenConstraint>)> {
        chunks
            .iter()
            .filter(|c| c.samples)
            .filter_map(|c| {
                let id = self.scheduler.running[c.index].id;
                let constraint = self.live.get_mut(&id)?.sampler.take_constraint()?;
                Some((id, constraint))
            })
            .collect()
    }

    /// Gives prepared constraints back. A sequence whose constraint panicked
    /// (or was lost with its thread) must not sample unconstrained: it ends.
    fn restore_constraints(
        &mut self,
        lent: &[u64],
        prepared: Option<PreparedConstraints>,
    ) -> Vec<(u64, FinishReason)> {
        let returned = match prepared {
            None => return Vec::new(),
            Some(Ok(returned)) => returned,
            Some(Err(payload)) => {
                let msg = panic_message(payload.as_ref());
                tracing::error!(requests = ?lent, "preparing grammar masks failed: {msg}");
                let reason = || FinishReason::Error(format!("the grammar failed: {msg}"));
                return lent.iter().map(|&id| (id, reason())).collect();
            }
        };
        let mut failed = Vec::new();
        for (id, constraint, panicked) in returned {
            match panicked {
                Some(msg) => {
                    tracing::error!(request = id, "the grammar mask panicked: {msg}");
                    failed.push((
                        id,
                        FinishReason::Error(format!("the grammar failed: {msg}")),
                    ));
                }
                None => {
                    if let Some(live) = self.live.get_mut(&id) {
                        live.sampler.restore_constraint(constraint);
                    }
                }
            }
        }
        failed
    }

    /// A fault planned for a batch that holds the trigger token, outside the model.
    #[cfg(feature = "fault-injection")]
    fn inject_engine_fault(&self, chunks: &[Chunk]) {
        if let Some(fault) = &self.fault {
            let seqs: Vec<&[u32]> = chunks
                .iter()
                .map(|c| self.scheduler.running[c.index].tokens.as_slice())
                .collect();
            fault.in_bookkeeping(&seqs);
        }
    }

    /// Runs the step's chunks as one batch. If the batch fails (an error or a
    /// panic in the model), each chunk is run again alone, so only the chunks
    /// that fail by themselves get the error and the rest go on.
    fn forward(&mut self, chunks: &[Chunk]) -> Vec<Result<Option<Tensor>, String>> {
        match self.forward_chunks(chunks) {
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
                    .map(|c| {
                        self.forward_chunks(std::slice::from_ref(c))
                            .map(|mut rows| rows.pop().flatten())
                    })
                    .collect()
            }
        }
    }

    fn forward_chunks(&mut self, chunks: &[Chunk]) -> Result<Vec<Option<Tensor>>, String> {
        let running = &self.scheduler.running;
        let tables: Vec<SeqBlocks> = chunks
            .iter()
            .map(|c| SeqBlocks {
                groups: running[c.index].kv.tables.clone(),
                len_after_step: c.start + c.len,
            })
            .collect();
        // Each chunk's share of its prompt's encoder rows.
        let soft: Vec<Option<crate::api::SoftWindow<'_>>> = chunks
            .iter()
            .map(|c| {
                let live = self.live.get(&running[c.index].id)?;
                let window = live.soft_prompt.as_ref()?.window(c.start, c.len);
                (!window.rows.is_empty()).then_some(window)
            })
            .collect();
        let batch: Vec<BatchSeq<'_>> = chunks
            .iter()
            .zip(&soft)
            .map(|(c, soft)| BatchSeq {
                ids: &running[c.index].tokens[c.start..c.start + c.len],
                start: c.start,
                logits: c.samples.then_some(LogitsFor::Last),
                soft: soft.as_ref().map(|w| SoftTokens {
                    rows: &w.rows,
                    embeds: w.embeds,
                    blocks: &w.blocks,
                }),
            })
            .collect();
        let (model, pool) = (&self.model, &mut self.pool);
        #[cfg(feature = "fault-injection")]
        let fault = self.fault.as_ref();
        // The model only writes the chunks' own KV positions, which a retry writes again.
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            #[cfg(feature = "fault-injection")]
            if let Some(fault) = fault {
                fault.in_model_step(&batch)?;
            }
            let mut view = pool.view(&tables);
            model.forward_batch(&batch, &mut view, None)
        }));
        match result {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => Err(format!("model step failed: {e}")),
            Err(payload) => {
                let msg = panic_message(payload.as_ref());
                let ids: Vec<u64> = chunks.iter().map(|c| running[c.index].id).collect();
                let tokens: usize = chunks.iter().map(|c| c.len).sum();
                tracing::error!(requests = ?ids, tokens, "the model step panicked: {msg}");
                Err(format!("model step panicked: {msg}"))
            }
        }
    }

    /// Takes a chunk's computed tokens into account and, when it has logits,
    /// samples the next token and sends it; `Some` when the request ends.
    fn advance(&mut self, c: Chunk, row: Option<Tensor>) -> Option<FinishReason> {
        let seq = &mut self.scheduler.running[c.index];
        seq.computed = c.start + c.len;
        self.kv
            .register_full_blocks(&mut seq.kv, &seq.tokens, seq.computed);
        let row = row?;
        let live = self.live.get_mut(&seq.id)?;
        let values = match row.squeeze(0).and_then(|r| r.to_vec1::<f32>()) {
            Ok(v) => v,
            Err(e) => return Some(FinishReason::Error(format!("reading logits failed: {e}"))),
        };
        let sampled = live.sampler.sample(&values);
        let token = sampled.token;
        if live.sampler.params().stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        live.generated += 1;
        seq.tokens.push(token);
        let texts = &mut self.token_texts;
        let tokenizer = &self.tokenizer;
        let logprob = sampled.logprobs.map(|(lp, top)| TokenLogprob {
            token_id: token,
            text: token_text(texts, tokenizer, token),
            logprob: lp,
            top: top
                .into_iter()
                .map(|(t, l)| (t, token_text(texts, tokenizer, t), l))
                .collect(),
        });
        let (text, stopped) = live.output.push(token);
        let _ = live.events.send(EngineEvent::Token {
            id: token,
            text,
            logprob,
        });
        if stopped {
            Some(FinishReason::Stop)
        } else if live.generated >= live.sampler.params().max_tokens
            || seq.tokens.len() >= self.max_model_len
        {
            Some(FinishReason::Length)
        } else {
            None
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
            s.step_retries = self.step_retries;
        }
    }
}

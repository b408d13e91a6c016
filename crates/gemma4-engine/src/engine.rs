//! The engine loop: one thread owns the scheduler, the KV-cache manager and
//! the executor; callers talk to it through channels ([`EngineHandle`])
//! and receive their tokens as a stream ([`RequestStream`]). Each iteration:
//! take new requests and cancellations, let the scheduler describe the step
//! ([`ScheduledChunk`](crate::executor::ScheduledChunk)s keyed by sequence
//! id), have the executor run it (one batched model step and the
//! sampling), give the results back to the scheduler, and pass the sampled
//! ids to the output processor, whose own thread detokenizes, checks stop
//! strings and sends the events.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use gemma4_model::config::AttentionKind;
use gemma4_model::paged::KvDtype;
use gemma4_model::plan::group_pool_blocks;
use gemma4_text::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::adapters::Adapters;
use crate::api::{
    AdapterError, AdapterLoad, EngineEvent, EngineStats, FinishReason, GenerationRequest,
    SubmitError, Usage,
};
#[cfg(feature = "fault-injection")]
use crate::executor::ScheduledChunk;
use crate::executor::{
    AdapterReader, Executor, KvLayout, NewRequest, ReadAdapter, SeqOutput, StepPlan,
};
use crate::kv_manager::{KvEvent, KvManager};
use crate::limits::RequestLimits;
use crate::media::MediaFacts;
use crate::output_processor::{self, OutputMsg, StopNotice};
use crate::panic_message;
use crate::sampler::Sampler;
use crate::scheduler::{Encoding, Scheduler, SchedulerLimits, SeqState};
use crate::speculative::{DraftCounts, SpeculativeConfig};

/// [`EngineConfig::admit_prompt_tokens`] by default: about where a step's
/// prompt tokens stop getting cheaper per token on the CPU kernels.
pub const DEFAULT_ADMIT_PROMPT_TOKENS: usize = 128;

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
    /// A step admits new prompts while it holds fewer prompt tokens than
    /// this, so prompts arriving together are prefilled one after another
    /// (see [`SchedulerLimits::admit_prompt_tokens`]).
    pub admit_prompt_tokens: usize,
    /// KV memory (f32) for all groups; `None` sizes the cache for
    /// `max_num_seqs` sequences of `max_model_len` tokens.
    pub kv_memory_bytes: Option<usize>,
    /// Element type of the KV pools (f32 keeps the reference's arithmetic).
    pub kv_dtype: KvDtype,
    pub prefix_caching: bool,
    /// Where the prefix cache's [`KvEvent`]s go, if anywhere.
    pub kv_events: Option<KvEventSink>,
    /// Soft tokens the media encoders may be encoding at once (one larger
    /// item when nothing else encodes); `None` allows `max_batch_tokens`.
    pub encoder_budget: Option<usize>,
    /// Speculative decoding, for every request that does not ask to decode
    /// plainly.
    pub speculative: Option<SpeculativeConfig>,
    /// LoRA adapters held at once, at most (those the executor starts
    /// with and those loaded later); `None`: no limit.
    pub max_loras: Option<usize>,
    /// The largest rank a LoRA adapter may have; `None`: no limit.
    pub max_lora_rank: Option<usize>,
}

/// Takes the [`KvEvent`]s of each engine step, in order. It runs on the
/// engine thread, so it must hand them on without waiting.
#[derive(Clone)]
pub struct KvEventSink(pub Arc<dyn Fn(Vec<KvEvent>) + Send + Sync>);

impl std::fmt::Debug for KvEventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvEventSink")
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 16,
            max_queue: 64,
            max_model_len: 4096,
            block_size: 16,
            max_batch_tokens: 512,
            admit_prompt_tokens: DEFAULT_ADMIT_PROMPT_TOKENS,
            kv_memory_bytes: None,
            kv_dtype: KvDtype::F32,
            prefix_caching: true,
            kv_events: None,
            encoder_budget: None,
            speculative: None,
            max_loras: None,
            max_lora_rank: None,
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
    LoadAdapter {
        name: String,
        adapter: ReadAdapter,
        reply: mpsc::Sender<Result<(), AdapterError>>,
    },
    UnloadAdapter {
        name: String,
        reply: mpsc::Sender<Result<(), AdapterError>>,
    },
}

struct Pending {
    id: u64,
    request: GenerationRequest,
    events: UnboundedSender<EngineEvent>,
}

struct Shared {
    stats: Mutex<EngineStats>,
    /// Per LoRA adapter held, as the engine thread last published them.
    adapters: Mutex<Vec<AdapterLoad>>,
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
    limits: Arc<RequestLimits>,
    kv_plan: Arc<KvPlanReport>,
    /// The executor's, which reads adapters on the caller's thread.
    adapter_reader: Option<AdapterReader>,
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
                EngineEvent::PromptLogprobs(_) => {}
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
        if let Some(name) = &r.adapter {
            if !self.adapter_names().contains(name) {
                return Err(SubmitError::Invalid(format!(
                    "no LoRA adapter named `{name}` is loaded"
                )));
            }
        }
        self.limits
            .check(r)
            .map_err(|e| SubmitError::Invalid(e.message))
    }

    /// What a request may hold.
    pub fn limits(&self) -> &RequestLimits {
        &self.limits
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

    /// The names of the LoRA adapters requests may choose now.
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapter_load().into_iter().map(|a| a.name).collect()
    }

    /// Reads the LoRA adapter at `path` (a PEFT folder or a GGUF LoRA file
    /// on this machine) on the calling thread, then serves it as `name`
    /// from the next step on. Blocks until it is held.
    pub fn load_adapter(&self, name: &str, path: &std::path::Path) -> Result<(), AdapterError> {
        let Some(read) = &self.adapter_reader else {
            return Err(AdapterError::Load(format!(
                "this executor cannot load LoRA adapters (`{name}`)"
            )));
        };
        // Known names fail before the file is read; the engine thread
        // checks again, and checks the limits, when it takes the adapter.
        if self.adapter_names().iter().any(|n| n == name) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        let adapter = read(name, path).map_err(|e| AdapterError::Load(e.0))?;
        let (reply, answer) = mpsc::channel();
        let command = Command::LoadAdapter {
            name: name.to_string(),
            adapter,
            reply,
        };
        self.tx.send(command).map_err(|_| AdapterError::Stopped)?;
        answer.recv().unwrap_or(Err(AdapterError::Stopped))
    }

    /// Drops the LoRA adapter `name`; refused while requests run or wait
    /// with it.
    pub fn unload_adapter(&self, name: &str) -> Result<(), AdapterError> {
        let (reply, answer) = mpsc::channel();
        let command = Command::UnloadAdapter {
            name: name.to_string(),
            reply,
        };
        self.tx.send(command).map_err(|_| AdapterError::Stopped)?;
        answer.recv().unwrap_or(Err(AdapterError::Stopped))
    }

    /// Requests per LoRA adapter held.
    pub fn adapter_load(&self) -> Vec<AdapterLoad> {
        self.shared
            .adapters
            .lock()
            .map(|a| a.clone())
            .unwrap_or_default()
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

    /// What the model's media encoders take and give.
    pub fn media_facts(&self) -> &MediaFacts {
        &self.limits.media
    }
}

/// Starts the engine thread over any executor.
pub fn start_with(
    executor: Box<dyn Executor>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
) -> gemma4_model::Result<EngineHandle> {
    start_worker(
        executor,
        tokenizer,
        config,
        #[cfg(feature = "fault-injection")]
        None,
    )
}

pub(crate) fn start_worker(
    mut executor: Box<dyn Executor>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    #[cfg(feature = "fault-injection")] fault: Option<crate::fault::FaultPlan>,
) -> gemma4_model::Result<EngineHandle> {
    let facts = executor.model_facts().clone();
    // Positions past the model's are never reached: a sequence ends at
    // `max_model_len` tokens.
    if config.max_model_len > facts.max_positions {
        return Err(gemma4_model::ModelError::Input(format!(
            "the context length (max_model_len) {} is larger than the model's {} positions",
            config.max_model_len, facts.max_positions
        )));
    }
    let assistant = crate::speculative::DraftMethod::Assistant;
    if config.speculative.is_some_and(|s| s.method == assistant) && !facts.assistant {
        return Err(gemma4_model::ModelError::Input(
            "speculative decoding with an assistant needs the assistant model (a draft model) loaded beside the model".into(),
        ));
    }
    // A token id must be known to both the tokenizer (added tokens included) and the embedding.
    let token_id_limit = tokenizer.vocab_size().min(facts.vocab_size);
    if tokenizer.vocab_size() != facts.vocab_size {
        tracing::warn!(
            tokenizer = tokenizer.vocab_size(),
            model = facts.vocab_size,
            "the tokenizer and the model disagree on the vocabulary size; token ids from {token_id_limit} on are refused"
        );
    }
    let request_limits = RequestLimits {
        max_model_len: config.max_model_len,
        token_id_limit,
        max_batch_tokens: config.max_batch_tokens,
        hidden_size: facts.hidden_size,
        bidirectional_vision: facts.bidirectional_vision,
        media: facts.media.clone(),
    };
    let adapters = Adapters::new(&facts.adapters, config.max_loras, config.max_lora_rank)
        .map_err(|e| gemma4_model::ModelError::Input(e.to_string()))?;
    let groups = facts.kv_groups.clone();
    let bs = config.block_size.max(1);
    // Blocks per group: sized for max_num_seqs full-length sequences, or the memory budget.
    // A step's chunk of c tokens sees keys back to its first query's window.
    let per_seq: Vec<usize> = groups
        .iter()
        .map(|g| {
            group_pool_blocks(
                g.kind,
                facts.sliding_window,
                config.max_model_len,
                bs,
                config.max_batch_tokens,
            )
        })
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
    let total_bytes = executor
        .allocate_kv(&KvLayout {
            block_size: bs,
            blocks_per_group: blocks.clone(),
            dtype: config.kv_dtype,
        })
        .map_err(|e| gemma4_model::ModelError::Input(e.to_string()))?;
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
        total_bytes,
    };
    let mut kv = KvManager::new(
        &groups,
        &blocks,
        bs,
        facts.sliding_window,
        config.prefix_caching,
    );
    if config.kv_events.is_some() {
        kv.record_events();
    }
    let shared = Arc::new(Shared {
        stats: Mutex::new(EngineStats {
            kv_blocks_total: blocks.iter().sum(),
            kv_block_size: bs,
            ..Default::default()
        }),
        adapters: Mutex::new(adapters.loads(std::iter::empty())),
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
        admit_prompt_tokens: config.admit_prompt_tokens.max(1),
        encoder_tokens: config
            .encoder_budget
            .unwrap_or(config.max_batch_tokens)
            .max(1),
    };
    let (stops_tx, output_stops) = mpsc::channel();
    let output = output_processor::spawn(tokenizer.clone(), stops_tx).map_err(|e| {
        gemma4_model::ModelError::Input(format!("cannot start the output thread: {e}"))
    })?;
    let adapter_reader = executor.adapter_reader();
    let mut worker = Worker {
        executor,
        kv,
        kinds: groups.iter().map(|g| g.kind).collect(),
        scheduler: Scheduler::new(limits),
        live: HashMap::new(),
        shared: shared.clone(),
        max_model_len: config.max_model_len,
        bidirectional_vision: facts.bidirectional_vision,
        new_requests: Vec::new(),
        ended: Vec::new(),
        output,
        output_stops,
        kv_events: config.kv_events.clone(),
        speculative: config.speculative,
        speculation: DraftCounts::default(),
        adapters,
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
        limits: Arc::new(request_limits),
        kv_plan: Arc::new(kv_plan),
        adapter_reader,
    })
}

/// Per-request state the scheduler and the executor do not need.
struct Live {
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    /// The caller's end of the stream (only to see whether it went away:
    /// events go through the output processor).
    events: UnboundedSender<EngineEvent>,
    deadline: Option<Instant>,
    prompt_len: usize,
    generated: usize,
    /// Left the wait queue for the first time (later re-queues are preemptions).
    admitted: bool,
    speculation: DraftCounts,
    /// Id of its LoRA adapter.
    adapter: Option<u32>,
}

struct Worker {
    executor: Box<dyn Executor>,
    kv: KvManager,
    /// Each cache group's attention kind.
    kinds: Vec<AttentionKind>,
    scheduler: Scheduler,
    live: HashMap<u64, Live>,
    shared: Arc<Shared>,
    max_model_len: usize,
    bidirectional_vision: bool,
    /// Requests submitted, and ended, since the last step the executor ran.
    new_requests: Vec<NewRequest>,
    ended: Vec<u64>,
    output: mpsc::Sender<OutputMsg>,
    /// Requests the output processor ended (stop strings).
    output_stops: mpsc::Receiver<StopNotice>,
    kv_events: Option<KvEventSink>,
    speculative: Option<SpeculativeConfig>,
    /// Drafted and accepted tokens over all requests.
    speculation: DraftCounts,
    /// The LoRA adapters the executor holds.
    adapters: Adapters,
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault::FaultPlan>,
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
        // Block only when there is nothing to do, and the executor holds
        // no state of requests that have ended.
        if self.scheduler.is_idle() {
            self.flush_requests();
            self.publish_stats();
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
                    if self.scheduler.is_idle() {
                        return false;
                    }
                    break;
                }
            }
        }
        while let Ok((id, reason)) = self.output_stops.try_recv() {
            self.end(id, reason);
        }
        self.expire();
        self.step();
        self.publish_stats();
        if let Some(sink) = &self.kv_events {
            let events = self.kv.take_events();
            if !events.is_empty() {
                (sink.0)(events);
            }
        }
        true
    }

    /// Gives up after a panic in the bookkeeping: records why and ends every request.
    fn fail(&mut self, panic: &str) {
        let reason = format!("the engine failed and must be restarted: {panic}");
        tracing::error!(
            running = self.scheduler.running_len(),
            waiting = self.scheduler.waiting_len(),
            "{reason}"
        );
        if let Ok(mut failure) = self.shared.failure.lock() {
            *failure = Some(reason.clone());
        }
        for (id, live) in self.live.drain() {
            let usage = Usage {
                prompt_tokens: live.prompt_len,
                completion_tokens: live.generated,
                ..Usage::default()
            };
            let finished = OutputMsg::Finished {
                id,
                reason: FinishReason::Error(reason.clone()),
                usage,
            };
            if self.output.send(finished).is_err() {
                let _ = live.events.send(EngineEvent::Finished {
                    reason: FinishReason::Error(reason.clone()),
                    text: String::new(),
                    events: Vec::new(),
                    usage,
                });
            }
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
                let params = &request.params;
                self.live.insert(
                    id,
                    Live {
                        max_tokens: params.max_tokens,
                        stop_token_ids: params.stop_token_ids.clone(),
                        events: events.clone(),
                        deadline: request.deadline,
                        prompt_len: request.prompt_ids.len(),
                        generated: 0,
                        admitted: false,
                        speculation: DraftCounts::default(),
                        adapter: None,
                    },
                );
                let _ = self.output.send(OutputMsg::Start {
                    id,
                    prompt: request.prompt_ids.clone(),
                    stop_strings: params.stop_strings.clone(),
                    reading: request.reading.clone(),
                    events,
                });
                let soft = request.soft_prompt.as_deref();
                let media = soft.map_or_else(|| [].into(), |s| s.media.clone());
                let whole_spans = match soft {
                    Some(soft) if self.bidirectional_vision => soft.blocks.clone(),
                    _ => Vec::new(),
                };
                let speculative = self.speculative.filter(|_| !params.plain_decoding);
                // Checked on submission; unloaded since, the request fails.
                let adapter = match request.adapter.as_deref() {
                    Some(name) => match self.adapters.find(name) {
                        Some(held) => Some(held.key.clone()),
                        None => {
                            let why = format!("the LoRA adapter `{name}` was unloaded");
                            self.end(id, FinishReason::Error(why));
                            return;
                        }
                    },
                    None => None,
                };
                self.new_requests.push(NewRequest {
                    seq_id: id,
                    sampler: Sampler::new(request.params.clone(), &request.prompt_ids),
                    soft_prompt: request.soft_prompt.clone(),
                    prompt: request.prompt_ids.clone(),
                    prompt_logprobs: params.prompt_logprobs,
                    speculative,
                    adapter: adapter.as_ref().map(|k| k.id),
                });
                if let (Some(l), Some(key)) = (self.live.get_mut(&id), &adapter) {
                    l.adapter = Some(key.id);
                    self.adapters.count_request(key.id);
                }
                let mut seq =
                    SeqState::new(id, request.prompt_ids, self.kv.empty_keyed(media, adapter));
                seq.reuse_prefix = params.prompt_logprobs.is_none();
                seq.whole_spans = whole_spans;
                if let Some(soft) = soft {
                    seq.encoder_spans = soft.encoder_spans();
                    seq.encoded = vec![Encoding::Pending; seq.encoder_spans.len()];
                }
                self.scheduler.add(seq);
            }
            Command::Cancel(id) => self.end(id, FinishReason::Cancelled),
            Command::LoadAdapter {
                name,
                adapter,
                reply,
            } => {
                let result = self.adapters.load(self.executor.as_mut(), &name, adapter);
                self.publish_adapters();
                let _ = reply.send(result);
            }
            Command::UnloadAdapter { name, reply } => {
                let live = &self.live;
                let in_use = |id| live.values().filter(|l| l.adapter == Some(id)).count();
                let result = self.adapters.unload(self.executor.as_mut(), &name, in_use);
                self.publish_adapters();
                let _ = reply.send(result);
            }
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

    /// Removes a request wherever it is, frees its blocks and has `Finished` sent.
    fn end(&mut self, id: u64, reason: FinishReason) {
        let cached = self
            .scheduler
            .remove(id, &mut self.kv)
            .map_or(0, |seq| seq.prefix_hit);
        if let Some(l) = self.live.remove(&id) {
            self.ended.push(id);
            if !l.admitted {
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            }
            // Callers that read the stats after `Finished` see the blocks freed.
            self.publish_stats();
            let usage = Usage {
                prompt_tokens: l.prompt_len,
                completion_tokens: l.generated,
                cached_prompt_tokens: cached.min(l.prompt_len),
                cache_written_prompt_tokens: self.cache_written(l.prompt_len, cached),
                speculation: l.speculation,
                ..Usage::default()
            };
            let _ = self.output.send(OutputMsg::Finished { id, reason, usage });
        }
    }

    /// Prompt tokens of the whole blocks a request computed itself (the
    /// prefix cache registers every full block).
    fn cache_written(&self, prompt_len: usize, cached: usize) -> usize {
        if !self.kv.prefix_caching() {
            return 0;
        }
        let bs = self.kv.block_size();
        (prompt_len / bs * bs).saturating_sub(cached)
    }

    fn step(&mut self) {
        let chunks = self.scheduler.schedule(&mut self.kv);
        // Requests admitted from the queue for the first time no longer count as waiting.
        for id in self.scheduler.running_ids() {
            if let Some(l) = self.live.get_mut(&id) {
                if !l.admitted {
                    l.admitted = true;
                    self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        let encode = self.scheduler.take_encode_requests();
        if chunks.is_empty() && encode.is_empty() && !self.scheduler.is_encoding() {
            self.flush_requests();
            if self.scheduler.running_len() == 0 {
                // Nothing runs, yet the head of the queue cannot be placed: it can never fit.
                if let Some(id) = self.scheduler.first_waiting() {
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
        let plan = StepPlan {
            new_requests: std::mem::take(&mut self.new_requests),
            finished: std::mem::take(&mut self.ended),
            encode,
            chunks,
        };
        let outputs = self.executor.execute(plan);
        let mut finished = Vec::new();
        for item in outputs.encoded {
            match item.result {
                Ok(()) => self.scheduler.encoded(item.seq_id, item.item),
                Err(why) => finished.push((item.seq_id, FinishReason::Error(why))),
            }
        }
        for out in outputs.seqs {
            if let Some(reason) = self.take_back(out) {
                finished.push(reason);
            }
        }
        for (id, reason) in finished {
            self.end(id, reason);
        }
    }

    /// Requests that ended with no step since: their state leaves the
    /// executor now, not at some later step.
    fn flush_requests(&mut self) {
        if !self.ended.is_empty() {
            self.executor.execute(StepPlan {
                new_requests: std::mem::take(&mut self.new_requests),
                finished: std::mem::take(&mut self.ended),
                encode: Vec::new(),
                chunks: Vec::new(),
            });
        }
    }

    /// Takes one chunk's result back into the scheduler and sends its
    /// sampled tokens on, up to a stop token, `max_tokens` or the context's
    /// end; `Some` when the request ends.
    fn take_back(&mut self, out: SeqOutput) -> Option<(u64, FinishReason)> {
        let id = out.seq_id;
        let sampled = match out.result {
            Ok(sampled) => sampled,
            Err(e) => return Some((id, FinishReason::Error(e))),
        };
        let live = self.live.get_mut(&id)?;
        let drafting = out.drafting;
        live.speculation
            .record(drafting.verified, drafting.accepted);
        self.speculation
            .record(drafting.verified, drafting.accepted);
        if !out.prompt_logprobs.is_empty() {
            let _ = self.output.send(OutputMsg::PromptLogprobs {
                id,
                scored: out.prompt_logprobs,
            });
        }
        if live.max_tokens == 0 && !sampled.is_empty() {
            // The prompt has run (for its log-probabilities); nothing is generated.
            self.scheduler.commit(id, out.computed, &[], &mut self.kv)?;
            return Some((id, FinishReason::Length));
        }
        let mut len = self.scheduler.tokens(id)?.len();
        let mut kept = 0;
        let mut end = None;
        for s in &sampled {
            if live.stop_token_ids.contains(&s.token) {
                end = Some(FinishReason::Stop);
                break;
            }
            kept += 1;
            len += 1;
            live.generated += 1;
            if live.generated >= live.max_tokens || len >= self.max_model_len {
                end = Some(FinishReason::Length);
                break;
            }
        }
        let ids: Vec<u32> = sampled[..kept].iter().map(|s| s.token).collect();
        self.scheduler
            .commit(id, out.computed, &ids, &mut self.kv)?;
        if end.is_none() && !drafting.proposed.is_empty() {
            // Every draft accepted brings one more token: none may pass
            // `max_tokens` or the context.
            let room = (live.max_tokens - live.generated).min(self.max_model_len - len);
            let mut drafts = drafting.proposed;
            drafts.truncate(room.saturating_sub(1));
            self.scheduler.set_drafts(id, drafts);
        }
        for s in sampled.into_iter().take(kept) {
            let _ = self.output.send(OutputMsg::Token {
                id,
                token: s.token,
                logprobs: s.logprobs,
            });
        }
        end.map(|reason| (id, reason))
    }

    /// A fault planned for a batch that holds the trigger token, outside the model.
    #[cfg(feature = "fault-injection")]
    fn inject_engine_fault(&self, chunks: &[ScheduledChunk]) {
        if let Some(fault) = &self.fault {
            let seqs: Vec<&[u32]> = chunks
                .iter()
                .filter_map(|c| self.scheduler.tokens(c.seq_id))
                .collect();
            fault.in_bookkeeping(&seqs);
        }
    }

    fn publish_stats(&self) {
        if let Ok(mut s) = self.shared.stats.lock() {
            let usage = self.kv.usage();
            for (kind, u) in self.kinds.iter().zip(&usage) {
                match kind {
                    AttentionKind::Sliding => s.kv_sliding_blocks_used = u.used,
                    AttentionKind::Full => s.kv_full_blocks_used = u.used,
                }
            }
            if let Some(g) = self.kinds.iter().position(|&k| k == AttentionKind::Sliding) {
                let peak = self.scheduler.peak_blocks(g);
                s.kv_sliding_blocks_per_seq_peak = s.kv_sliding_blocks_per_seq_peak.max(peak);
            }
            s.running = self.scheduler.running_len();
            s.kv_blocks_total = usage.iter().map(|u| u.total).sum();
            s.kv_blocks_used = usage.iter().map(|u| u.used).sum();
            s.prefix_cache_hits = self.scheduler.prefix_hits();
            s.prefix_cache_hit_tokens = self.scheduler.prefix_hit_tokens();
            s.preemptions = self.scheduler.preemptions();
            let executor = self.executor.stats();
            s.step_retries = executor.step_retries;
            s.contended_kernel_jobs = executor.contended_kernel_jobs;
            s.executor_requests = executor.requests;
            s.speculation = self.speculation;
            s.drafting_ns = executor.drafting_ns;
        }
        self.publish_adapters();
    }

    /// The held adapters and their requests, for the handle.
    fn publish_adapters(&self) {
        let live = self
            .live
            .values()
            .filter_map(|l| l.adapter.map(|id| (id, l.admitted)));
        let loads = self.adapters.loads(live);
        if let Ok(mut shared) = self.shared.adapters.lock() {
            *shared = loads;
        }
    }
}

//! An executor that follows the engine's plans on a thread of its own,
//! over a channel: the shape a tensor-parallel rank or a device backend
//! takes. It holds an inner executor that sees nothing but the
//! [`StepPlan`]s sent to it (each one what changed since the last), so a
//! run through it equal to a direct run shows that the plans carry all an
//! executor needs.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::executor::{
    AdapterFacts, AdapterReader, EncodeRequest, EncodedItem, Executor, ExecutorError,
    ExecutorStats, KvLayout, ModelFacts, ReadAdapter, SeqOutput, StepOutput, StepPlan,
};

enum Request {
    Allocate(KvLayout),
    Step(StepPlan),
    LoadAdapter(u32, String, ReadAdapter),
    UnloadAdapter(u32),
}

enum Reply {
    Allocated(Result<usize, ExecutorError>),
    Stepped(StepOutput, ExecutorStats),
    AdapterLoaded(Result<AdapterFacts, ExecutorError>),
    AdapterUnloaded(Result<(), ExecutorError>),
}

/// Runs an inner executor on its own thread.
pub struct ThreadedExecutor {
    facts: ModelFacts,
    /// The inner executor's, which reads on any thread.
    adapter_reader: Option<AdapterReader>,
    requests: Option<mpsc::Sender<Request>>,
    replies: mpsc::Receiver<Reply>,
    stats: ExecutorStats,
    /// Encodings asked for and not yet reported, to fail if the thread is lost.
    encoding: Vec<EncodeRequest>,
    thread: Option<JoinHandle<()>>,
}

impl ThreadedExecutor {
    /// Moves `inner` to a new thread and talks to it by messages only.
    pub fn spawn<E: Executor + 'static>(mut inner: E) -> Result<Self, ExecutorError> {
        let facts = inner.model_facts().clone();
        let adapter_reader = inner.adapter_reader();
        let (requests, inbox) = mpsc::channel::<Request>();
        let (outbox, replies) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("gemma4-executor".into())
            .spawn(move || {
                for request in inbox {
                    let reply = match request {
                        Request::Allocate(layout) => Reply::Allocated(inner.allocate_kv(&layout)),
                        Request::Step(plan) => {
                            let out = inner.execute(plan);
                            Reply::Stepped(out, inner.stats())
                        }
                        Request::LoadAdapter(id, name, adapter) => {
                            Reply::AdapterLoaded(inner.load_adapter(id, &name, adapter))
                        }
                        Request::UnloadAdapter(id) => {
                            Reply::AdapterUnloaded(inner.unload_adapter(id))
                        }
                    };
                    if outbox.send(reply).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| ExecutorError(format!("cannot start the executor thread: {e}")))?;
        Ok(Self {
            facts,
            adapter_reader,
            requests: Some(requests),
            replies,
            stats: ExecutorStats::default(),
            encoding: Vec::new(),
            thread: Some(thread),
        })
    }

    fn call(&self, request: Request) -> Option<Reply> {
        self.requests.as_ref()?.send(request).ok()?;
        self.replies.recv().ok()
    }
}

impl Executor for ThreadedExecutor {
    fn model_facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<usize, ExecutorError> {
        match self.call(Request::Allocate(layout.clone())) {
            Some(Reply::Allocated(result)) => result,
            _ => Err(ExecutorError("the executor thread has stopped".into())),
        }
    }

    fn execute(&mut self, plan: StepPlan) -> StepOutput {
        let chunks: Vec<(u64, usize)> = plan
            .chunks
            .iter()
            .map(|c| (c.seq_id, c.start + c.tokens.len()))
            .collect();
        self.encoding.retain(|r| !plan.finished.contains(&r.seq_id));
        self.encoding.extend_from_slice(&plan.encode);
        match self.call(Request::Step(plan)) {
            Some(Reply::Stepped(out, stats)) => {
                self.stats = stats;
                for e in &out.encoded {
                    self.encoding
                        .retain(|r| (r.seq_id, r.item) != (e.seq_id, e.item));
                }
                out
            }
            // Each sequence of the step, and each still waiting for its
            // media, learns that its executor is gone.
            _ => StepOutput {
                seqs: chunks
                    .into_iter()
                    .map(|(seq_id, computed)| SeqOutput {
                        seq_id,
                        computed,
                        result: Err("the executor thread has stopped".into()),
                        prompt_logprobs: Vec::new(),
                        drafting: Default::default(),
                    })
                    .collect(),
                encoded: self
                    .encoding
                    .drain(..)
                    .map(|r| EncodedItem {
                        seq_id: r.seq_id,
                        item: r.item,
                        result: Err("the executor thread has stopped".into()),
                    })
                    .collect(),
            },
        }
    }

    fn stats(&self) -> ExecutorStats {
        self.stats
    }

    fn adapter_reader(&self) -> Option<AdapterReader> {
        self.adapter_reader.clone()
    }

    fn load_adapter(
        &mut self,
        id: u32,
        name: &str,
        adapter: ReadAdapter,
    ) -> Result<AdapterFacts, ExecutorError> {
        match self.call(Request::LoadAdapter(id, name.to_string(), adapter)) {
            Some(Reply::AdapterLoaded(result)) => result,
            _ => Err(ExecutorError("the executor thread has stopped".into())),
        }
    }

    fn unload_adapter(&mut self, id: u32) -> Result<(), ExecutorError> {
        match self.call(Request::UnloadAdapter(id)) {
            Some(Reply::AdapterUnloaded(result)) => result,
            _ => Err(ExecutorError("the executor thread has stopped".into())),
        }
    }
}

impl Drop for ThreadedExecutor {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

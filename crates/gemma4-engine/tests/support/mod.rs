//! Both sides of the executor seam: the engine calling the CPU executor
//! directly, and through [`ThreadedExecutor`], which follows the step plans
//! on a thread of its own and sees nothing else.

use std::path::PathBuf;
use std::sync::Arc;

use gemma4_engine::{
    start_with, CpuExecutor, EngineConfig, EngineHandle, FinishReason, GenerationRequest,
    SamplingParams, ThreadedExecutor,
};
use gemma4_model::{load_hf_dir, Gemma4};
use gemma4_text::Tokenizer;

/// How the engine reaches the CPU executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seam {
    Direct,
    Threaded,
}

pub const SEAMS: [Seam; 2] = [Seam::Direct, Seam::Threaded];

/// Starts an engine over `model` through `seam`.
#[allow(dead_code)] // not every test binary starts a plain engine
pub fn start_on(
    seam: Seam,
    model: Gemma4,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
) -> EngineHandle {
    start_executor_on(seam, CpuExecutor::new(model), tokenizer, config)
}

/// Starts an engine over a CPU executor (with its encoders, say) through `seam`.
pub fn start_executor_on(
    seam: Seam,
    cpu: CpuExecutor,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
) -> EngineHandle {
    let executor: Box<dyn gemma4_engine::Executor> = match seam {
        Seam::Direct => Box::new(cpu),
        Seam::Threaded => Box::new(ThreadedExecutor::spawn(cpu).expect("executor thread")),
    };
    start_with(executor, tokenizer, config).expect("engine")
}

/// An oracle checkpoint (`tests/fixtures/oracle/<variant>`).
#[allow(dead_code)] // not every test binary reads the oracle
pub fn oracle_fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(variant)
}

#[allow(dead_code)]
pub fn oracle_model(variant: &str) -> Gemma4 {
    load_hf_dir(&oracle_fixture(variant)).expect("model")
}

#[allow(dead_code)]
pub fn oracle_tokenizer(variant: &str) -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_dir(&oracle_fixture(variant)).expect("tokenizer"))
}

/// One text request run to its end: the tokens and why it stopped.
#[allow(dead_code)] // not every test binary submits plain requests
pub fn run_request(
    engine: &EngineHandle,
    ids: &[u32],
    params: SamplingParams,
) -> (Vec<u32>, FinishReason) {
    engine
        .submit(GenerationRequest {
            prompt_ids: ids.to_vec(),
            params,
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })
        .expect("submit")
        .blocking_finish()
        .expect("stream ended without Finished")
}

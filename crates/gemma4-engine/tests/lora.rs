//! LoRA adapters through the engine: requests with two adapters and none
//! batched together, prompts chunked, the prefix cache keyed by adapter,
//! each request's tokens PEFT's reference greedy ids (`tests/fixtures/lora`).

use std::path::PathBuf;
use std::sync::Arc;

use gemma4_engine::executor::{
    ExecutorError, ExecutorStats, KvLayout, ModelFacts, StepOutput, StepPlan,
};
use gemma4_engine::{
    start_with, AdapterError, AdapterFacts, AdapterReader, CpuExecutor, EngineConfig, EngineEvent,
    EngineHandle, Executor, GenerationRequest, ReadAdapter, SamplingParams, SubmitError,
    ThreadedExecutor,
};
use gemma4_model::lora_golden::LoraGolden;
use gemma4_model::{load_hf_dir, LoraAdapter};
use gemma4_text::Tokenizer;

mod support;
use support::{start_executor_on, Seam, SEAMS};

fn fixture(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/lora")
        .join(target)
}

fn request(ids: &[u32], steps: usize, adapter: Option<&str>) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: ids.to_vec(),
        params: SamplingParams {
            max_tokens: steps,
            ..Default::default()
        },
        deadline: None,
        soft_prompt: None,
        reading: Default::default(),
        adapter: adapter.map(str::to_string),
    }
}

/// Every (run, prompt) of the golden: the adapter's name (none for the
/// base run), the prompt and the reference's greedy ids.
fn cases(golden: &LoraGolden) -> Vec<(Option<String>, Vec<u32>, Vec<u32>)> {
    let mut out: Vec<_> = golden
        .base
        .prompts
        .iter()
        .map(|p| (None, p.input_ids.clone(), p.greedy_ids.clone()))
        .collect();
    for a in &golden.adapters {
        out.extend(a.prompts.iter().map(|p| {
            (
                Some(a.name.clone()),
                p.input_ids.clone(),
                p.greedy_ids.clone(),
            )
        }));
    }
    out
}

/// Submits every case at once and checks each against its reference.
fn run_wave(engine: &EngineHandle, cases: &[(Option<String>, Vec<u32>, Vec<u32>)], what: &str) {
    let streams: Vec<_> = cases
        .iter()
        .map(|(adapter, ids, want)| {
            engine
                .submit(request(ids, want.len(), adapter.as_deref()))
                .expect("submit")
        })
        .collect();
    for (stream, (adapter, _, want)) in streams.into_iter().zip(cases) {
        let (ids, _) = stream.blocking_finish().expect("finished");
        assert_eq!(&ids, want, "{what}: adapter {adapter:?}");
    }
}

#[test]
fn adapters_and_base_batched_chunked_and_cached_match_peft() {
    for target in ["e-style", "dense-k-eq-v"] {
        let dir = fixture(target);
        let golden = LoraGolden::read(&dir.join("golden.json")).expect("golden");
        let cases = cases(&golden);
        for seam in SEAMS {
            let model = load_hf_dir(&dir.join("target")).expect("target");
            let adapters: Vec<LoraAdapter> = golden
                .adapters
                .iter()
                .map(|a| LoraAdapter::load(&a.name, &dir.join(&a.folder), model.config()).unwrap())
                .collect();
            let executor = CpuExecutor::new(model)
                .with_adapters(adapters)
                .expect("adapters");
            let tokenizer = Arc::new(Tokenizer::from_dir(&dir.join("target")).expect("tokenizer"));
            let engine = start_executor_on(
                seam,
                executor,
                tokenizer,
                EngineConfig {
                    max_model_len: 128,
                    block_size: 4,
                    // Prompts run in chunks, several sequences per step.
                    max_batch_tokens: 24,
                    ..EngineConfig::default()
                },
            );
            run_wave(&engine, &cases, &format!("{target} {seam:?} first"));
            // Every prompt's blocks are now cached under each run's key:
            // a request adopting another adapter's blocks would depart.
            run_wave(&engine, &cases, &format!("{target} {seam:?} cached"));
            let unknown = engine.submit(request(&cases[0].1, 4, Some("no-such-adapter")));
            match unknown {
                Err(SubmitError::Invalid(why)) => assert!(why.contains("no-such-adapter"), "{why}"),
                Err(other) => panic!("{other}"),
                Ok(_) => panic!("an unknown adapter was accepted"),
            }
        }
    }
}

#[test]
fn two_adapters_with_one_name_are_refused() {
    let dir = fixture("e-style");
    let model = load_hf_dir(&dir.join("target")).expect("target");
    let load = || LoraAdapter::load("same", &dir.join("adapter-a"), model.config()).unwrap();
    let (a, b) = (load(), load());
    let refused = CpuExecutor::new(model).with_adapters(vec![a, b]);
    let why = refused.err().expect("refused").to_string();
    assert!(why.contains("same"), "{why}");
}

/// Adapters loaded and unloaded while the engine runs: within
/// `max_loras`, never under a live request, and a name loaded again
/// with other weights never adopts the blocks of the earlier ones.
#[test]
fn adapters_load_and_unload_at_run_time() {
    let dir = fixture("e-style");
    let golden = LoraGolden::read(&dir.join("golden.json")).expect("golden");
    let model = load_hf_dir(&dir.join("target")).expect("target");
    let first = LoraAdapter::load("a", &dir.join("adapter-a"), model.config()).unwrap();
    let executor = CpuExecutor::new(model).with_adapters(vec![first]).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir.join("target")).expect("tokenizer"));
    let engine = start_executor_on(
        SEAMS[1],
        executor,
        tokenizer,
        EngineConfig {
            max_model_len: 128,
            block_size: 4,
            max_loras: Some(2),
            ..EngineConfig::default()
        },
    );
    let (a, b) = (&golden.adapters[0], &golden.adapters[1]);
    let long = &b.prompts[2];
    let run = |adapter: &str, ids: &[u32], n: usize| {
        engine
            .submit(request(ids, n, Some(adapter)))
            .expect("submit")
            .blocking_finish()
            .expect("finished")
            .0
    };
    let bad = engine.load_adapter("d", &dir.join("target"));
    assert!(
        matches!(&bad, Err(AdapterError::Load(why)) if why.contains("adapter_config.json")),
        "{bad:?}"
    );
    engine
        .load_adapter("b", &dir.join("adapter-b"))
        .expect("load b");
    assert_eq!(engine.adapter_names(), ["a", "b"]);
    assert_eq!(run("b", &long.input_ids, 16), long.greedy_ids);
    assert!(matches!(
        engine.load_adapter("c", &dir.join("adapter-a")),
        Err(AdapterError::Full { held: 2 })
    ));
    assert!(matches!(
        engine.load_adapter("b", &dir.join("adapter-a")),
        Err(AdapterError::Exists(_))
    ));
    // Live: a request that has produced its first token of many.
    let mut live = engine
        .submit(request(&long.input_ids, 30, Some("b")))
        .expect("submit");
    assert!(matches!(
        live.blocking_next(),
        Some(EngineEvent::Token { .. })
    ));
    match engine.unload_adapter("b") {
        Err(AdapterError::InUse { requests: 1, .. }) => {}
        other => panic!("unloaded under a live request: {other:?}"),
    }
    drop(live); // cancels it, before the next command
    engine.unload_adapter("b").expect("unload b");
    assert!(matches!(
        engine.submit(request(&long.input_ids, 4, Some("b"))),
        Err(SubmitError::Invalid(_))
    ));
    // The name again, with adapter-a's weights: adapter-a's tokens, though
    // the prompt's blocks under the first `b` are still cached.
    engine
        .load_adapter("b", &dir.join("adapter-a"))
        .expect("load b again");
    assert_eq!(run("b", &long.input_ids, 16), a.prompts[2].greedy_ids);
}

#[test]
fn an_adapter_above_the_rank_limit_is_refused_at_start() {
    let dir = fixture("e-style");
    let model = load_hf_dir(&dir.join("target")).expect("target");
    let a = LoraAdapter::load("a", &dir.join("adapter-a"), model.config()).unwrap();
    let executor = CpuExecutor::new(model).with_adapters(vec![a]).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir.join("target")).expect("tokenizer"));
    let config = EngineConfig {
        max_model_len: 128,
        max_lora_rank: Some(4),
        ..EngineConfig::default()
    };
    let refused = gemma4_engine::start_with(Box::new(executor), tokenizer, config);
    let why = refused.err().expect("refused").to_string();
    assert!(
        why.contains("rank 8") && why.contains("--max-lora-rank 4"),
        "{why}"
    );
}

/// A CPU executor whose adapter reader notes the thread each read runs on.
struct ReadsNoted {
    inner: CpuExecutor,
    threads: Arc<std::sync::Mutex<Vec<Option<String>>>>,
}

impl Executor for ReadsNoted {
    fn model_facts(&self) -> &ModelFacts {
        self.inner.model_facts()
    }
    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<usize, ExecutorError> {
        self.inner.allocate_kv(layout)
    }
    fn execute(&mut self, plan: StepPlan) -> StepOutput {
        self.inner.execute(plan)
    }
    fn stats(&self) -> ExecutorStats {
        self.inner.stats()
    }
    fn adapter_reader(&self) -> Option<AdapterReader> {
        let read = self.inner.adapter_reader()?;
        let threads = self.threads.clone();
        Some(Arc::new(move |name: &str, path: &std::path::Path| {
            let thread = std::thread::current().name().map(str::to_string);
            threads.lock().unwrap().push(thread);
            read(name, path)
        }))
    }
    fn load_adapter(
        &mut self,
        id: u32,
        name: &str,
        adapter: ReadAdapter,
    ) -> Result<AdapterFacts, ExecutorError> {
        self.inner.load_adapter(id, name, adapter)
    }
    fn unload_adapter(&mut self, id: u32) -> Result<(), ExecutorError> {
        self.inner.unload_adapter(id)
    }
}

/// A runtime load reads the adapter's file on the thread that asks for
/// it, not on the engine's or the executor's, so the steps of running
/// requests never wait on the file.
#[test]
fn an_adapter_file_is_read_on_the_callers_thread() {
    let dir = fixture("e-style");
    let golden = LoraGolden::read(&dir.join("golden.json")).expect("golden");
    let threads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir.join("target")).expect("tokenizer"));
    for seam in SEAMS {
        let executor = ReadsNoted {
            inner: CpuExecutor::new(load_hf_dir(&dir.join("target")).expect("target")),
            threads: threads.clone(),
        };
        let executor: Box<dyn Executor> = match seam {
            Seam::Direct => Box::new(executor),
            Seam::Threaded => Box::new(ThreadedExecutor::spawn(executor).expect("thread")),
        };
        let config = EngineConfig {
            max_model_len: 128,
            block_size: 4,
            ..EngineConfig::default()
        };
        let engine = start_with(executor, tokenizer.clone(), config).expect("engine");
        let loader = std::thread::Builder::new()
            .name("the-caller".into())
            .spawn({
                let engine = engine.clone();
                let path = dir.join("gguf/adapter-a.gguf");
                move || engine.load_adapter("a", &path)
            })
            .unwrap();
        loader.join().unwrap().expect("load a");
        let a = &golden.adapters[0].prompts[0];
        let (out, _) = engine
            .submit(request(&a.input_ids, 16, Some("a")))
            .expect("submit")
            .blocking_finish()
            .expect("finished");
        assert_eq!(out, a.greedy_ids, "{seam:?}");
    }
    assert_eq!(
        *threads.lock().unwrap(),
        vec![Some("the-caller".to_string()); 2]
    );
}

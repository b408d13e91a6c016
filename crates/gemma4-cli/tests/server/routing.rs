//! What a router in front of several replicas reads: the vLLM-named gauges
//! under a queue, and the prefix cache's events over ZeroMQ, decoded by a
//! pyzmq subscriber as llm-d's adapter decodes them.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::{fixture, python_script, EventStream, ServerProc};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn vllm_gauges_follow_the_queue_and_the_cache() {
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--max-num-seqs", "1", "--served-model-name", "tiny"],
        &[],
    );
    let waiting = "vllm:num_requests_waiting{model_name=\"tiny\"}";
    let running = "vllm:num_requests_running{model_name=\"tiny\"}";
    let usage = "vllm:kv_cache_usage_perc{model_name=\"tiny\"}";
    let text = server.get("/metrics").body;
    let blocks = server.metric("gemma4_kv_blocks_free");
    let info = format!(
        "vllm:cache_config_info{{block_size=\"16\",model_name=\"tiny\",num_gpu_blocks=\"{blocks}\"}} 1"
    );
    assert!(text.contains(&info), "no {info} in\n{text}");
    assert_eq!(server.metric(usage), 0.0);

    let body = json!({
        "prompt": "Hello world", "max_tokens": 400, "temperature": 0, "ignore_eos": true,
        "stream": true
    });
    let mut streams: Vec<EventStream> = (0..3)
        .map(|_| EventStream::open(server.port, "/v1/completions", &body))
        .collect();
    // One runs, two wait for the one sequence slot.
    server.wait_metric(running, 1.0, Duration::from_secs(10));
    server.wait_metric(waiting, 2.0, Duration::from_secs(10));
    let first = server.metric(usage);
    assert!(first > 0.0 && first < 1.0, "{usage} {first}");
    // The running sequence's context grows, and its blocks with it.
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while server.metric(usage) <= first {
        assert!(std::time::Instant::now() < until, "{usage} stayed {first}");
        std::thread::sleep(Duration::from_millis(20));
    }
    for s in &mut streams {
        assert!(s.rest().last().is_some_and(|d| d == "[DONE]"));
    }
    server.wait_metric(waiting, 0.0, Duration::from_secs(10));
    server.wait_metric(running, 0.0, Duration::from_secs(10));
    server.wait_metric(usage, 0.0, Duration::from_secs(10));
}

#[test]
fn kv_events_show_a_router_where_a_prefix_lives() {
    let ports = [free_port(), free_port()];
    let replicas: Vec<ServerProc> = ports
        .iter()
        .map(|port| {
            let endpoint = format!("tcp://127.0.0.1:{port}");
            ServerProc::start(
                &fixture("e-style"),
                &[
                    "--block-size",
                    "4",
                    // Prefill in chunks of two blocks: the sliding-window
                    // group then needs few blocks and keeps few, so it
                    // loses prefixes the full-attention group still holds.
                    "--max-batch-tokens",
                    "8",
                    "--max-num-seqs",
                    "1",
                    "--max-model-len",
                    "256",
                    "--served-model-name",
                    "tiny",
                    "--kv-events-endpoint",
                    &endpoint,
                    "--kv-events-topic",
                    &format!("kv@127.0.0.1:{port}@tiny"),
                ],
                &[],
            )
        })
        .collect();
    let specs: Vec<String> = replicas
        .iter()
        .zip(ports)
        .map(|(r, port)| format!("{},tcp://127.0.0.1:{port}", r.url()))
        .collect();
    let mut args = vec!["--block-size", "4"];
    for spec in &specs {
        args.extend(["--replica", spec.as_str()]);
    }
    let Some(out) = python_script("kv_events.py", &["zmq", "msgpack"], &args) else {
        return;
    };
    for (replica, port) in out["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .zip(ports)
    {
        assert_eq!(replica["problems"], json!([]), "{out}");
        assert_eq!(
            replica["topics"],
            json!([format!("kv@127.0.0.1:{port}@tiny")])
        );
        // Sequence numbers count every message from 0, none missing.
        let seqs: Vec<u64> = replica["sequences"]
            .as_array()
            .expect("sequences")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert!(!seqs.is_empty(), "{out}");
        assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "{out}");
    }
    // Both replicas report a sliding-window group (the fixture's window is
    // 8 tokens) and a full-attention group.
    for replica in out["replicas"].as_array().expect("replicas") {
        let kinds: Vec<(&str, Option<u64>)> = replica["groups"]
            .as_object()
            .expect("groups")
            .values()
            .map(|g| (g["kind"].as_str().unwrap_or_default(), g["window"].as_u64()))
            .collect();
        assert!(kinds.contains(&("sliding_window", Some(8))), "{out}");
        assert!(kinds.contains(&("full_attention", None)), "{out}");
    }
    // The long prompt went to r0 only: its index claims the longer prompt's
    // shared blocks, r1's none, so the router picks r0, and r0 reuses
    // exactly what its index claimed.
    let full_blocks = out["shared_tokens"].as_u64().expect("tokens") / 4;
    assert!(full_blocks >= 3, "{out}");
    let claimed = out["matched_tokens"]["r0"].as_u64().expect("claim");
    assert!(claimed >= 8, "{out}");
    assert_eq!(out["matched_tokens"]["r1"], json!(0), "{out}");
    assert_eq!(out["predicted"], "r0");
    assert_eq!(out["predicted_hit"].as_u64(), Some(claimed), "{out}");
    // Prompts sharing prefixes, unrelated ones between: the index never
    // claims what the engine then misses, nor misses what it reuses; and
    // it has to read the sliding-window group to get there (the
    // full-attention group alone claims more than the engine can reuse).
    assert_eq!(out["mispredicted"], json!([]), "{out}");
    assert!(out["claims_of_full_alone"].as_u64() > Some(0), "{out}");
    // Other prompts push the shared prefix out, and the events say so.
    assert_eq!(out["first_block_evicted"], true, "{out}");
    assert_eq!(out["evicted_prefix_seen"], true, "{out}");
    assert!(out["replicas"][0]["removed"].as_u64() > Some(0), "{out}");
}

/// Two chats with the same words and different images, through the events:
/// the blocks over each image are keyed on its own identifier, so the
/// router's index never takes one image's blocks for the other's; the
/// second chat reuses exactly the blocks before the image, and its new
/// blocks continue that chain.
#[test]
fn kv_events_tell_images_apart() {
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let vision = crate::harness::root().join("tests/fixtures/vision");
    let server = ServerProc::start(
        &vision.join("e-style"),
        &["--block-size", "4", "--kv-events-endpoint", &endpoint],
        &[],
    );
    let spec = format!("{},{endpoint}", server.url());
    let images = format!(
        "{},{}",
        vision.join("images/0.png").display(),
        vision.join("images/1.png").display()
    );
    let args = ["--block-size", "4", "--replica", &spec, "--images", &images];
    let Some(out) = python_script("kv_events.py", &["zmq", "msgpack"], &args) else {
        return;
    };
    assert_eq!(out["problems"], json!([]), "{out}");
    let ids = |key: &str| out[key].as_array().cloned().unwrap_or_default();
    let (first, second) = (ids("first_ids"), ids("second_ids"));
    assert_eq!(first.len(), 1, "{out}");
    assert_eq!(second.len(), 1, "{out}");
    assert_ne!(first, second, "{out}");
    let before = out["blocks_before_image"].as_u64().expect("blocks");
    assert!(before >= 2, "{out}");
    assert_eq!(out["reused"].as_u64(), Some(before * 4), "{out}");
    assert_eq!(out["second_follows_shared"], true, "{out}");
}

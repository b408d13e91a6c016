"""Runs lm-evaluation-harness's `local-completions` model on the committed
task in tests/lm_eval against a running server, and prints what it scored
as JSON: the task's accuracy and, per document, the target and each
choice's log-likelihood. The harness tokenizes through the server
(`tokenizer_backend=remote`: GET /tokenizer_info, POST /tokenize), so it
needs no tokenizer of its own.

With `--hf GGUF` it runs the same harness's `hf` model instead, on
transformers in float32 over the GGUF's dequantized weights (the reference;
needs torch, transformers, gguf and accelerate), and prints the same JSON:
that is how tests/lm_eval/capitals_reference.json was made."""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url")
    p.add_argument("--model")
    p.add_argument("--hf", help="a GGUF: score with the harness's `hf` model instead")
    p.add_argument("--root", required=True)
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="gemma4-lm-eval-")
    if args.hf:
        gguf = os.path.abspath(args.hf)
        harness_model = "hf"
        model_args = ",".join([
            f"pretrained={os.path.dirname(gguf)}",
            f"gguf_file={os.path.basename(gguf)}",
            "dtype=float32",
            "attn_implementation=eager",
            # The task's prompt writes <bos> itself.
            "add_bos_token=False",
        ])
    else:
        harness_model = "local-completions"
        model_args = ",".join([
            f"base_url={args.base_url}/v1/completions",
            f"model={args.model}",
            "tokenizer_backend=remote",
            "num_concurrent=2",
            "max_retries=1",
        ])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", harness_model,
         "--model_args", model_args, "--tasks", "gemma4_capitals",
         "--include_path", "tests/lm_eval", "--output_path", out, "--log_samples"],
        cwd=args.root, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"lm_eval failed ({run.returncode}):\n{run.stderr[-4000:]}\n{run.stdout[-2000:]}")
    [results] = glob.glob(os.path.join(out, "*", "results_*.json"))
    [samples] = glob.glob(os.path.join(out, "*", "samples_gemma4_capitals_*.jsonl"))
    with open(results) as f:
        acc = json.load(f)["results"]["gemma4_capitals"]["acc,none"]
    docs = []
    with open(samples) as f:
        for line in f:
            s = json.loads(line)
            docs.append({
                "question": s["doc"]["question"],
                "target": int(s["doc"]["answer"]),
                "loglikelihoods": [float(r[0][0]) for r in s["resps"]],
                "acc": s["acc"],
            })
    print(json.dumps({"acc": acc, "docs": docs}))


if __name__ == "__main__":
    main()

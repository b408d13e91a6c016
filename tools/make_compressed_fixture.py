#!/usr/bin/env python3
"""Writes a compressed-tensors int4 copy of an oracle fixture, with its float32 goldens.

The copy is what Google's `-qat-w4a16-ct` exports are: every linear layer of the text
model (attention, MLP, per-layer-embedding gate and projections, and
`per_layer_model_projection`) quantized to symmetric int4 in groups of 32 input columns
and saved by the compressed-tensors library in its `pack-quantized` format
(`weight_packed`, `weight_scale`, `weight_shape`); embeddings and norms stay bf16, and the
tied head is left out, as those exports leave it; so are layers narrower than a group
(the tiny fixture's 16-wide per-layer projection), which makes the copy a mixed checkpoint. The scales are each group's largest
magnitude / 7.5, the library's own min-max choice for symmetric int4.

The goldens come from transformers loading the saved checkpoint (its compressed-tensors
integration unpacks the weights) in float32 with eager attention: for each prompt of the
source fixture, the logits at the last prompt position, the top 5 at every position, and
24 greedy steps with end-of-sequence stopping disabled, as in the source's golden.json.

Needs torch, transformers 5.23 and compressed-tensors (CPU):
  pip install torch transformers==5.23.0 compressed-tensors
  python tools/make_compressed_fixture.py tests/fixtures/oracle/e-style tests/fixtures/oracle/e-style-int4-ct
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from transformers import AutoModelForImageTextToText

GROUP = 32
STEPS = 24
COPIED = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


def quantize(src: Path, out: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.bfloat16)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP),
    )
    # Layers narrower than a group (the tiny fixtures' 16-wide per-layer
    # projection) stay bf16, as the library advises.
    narrow = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m.in_features % GROUP != 0]
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", *narrow]))
    quantized = 0
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.detach().float()
        groups = w.reshape(w.shape[0], w.shape[1] // GROUP, GROUP)
        scale = (groups.abs().amax(dim=-1) / 7.5).clamp(min=torch.finfo(torch.bfloat16).tiny)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.zero_()
        quantized += 1
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in COPIED:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    print(f"{out}: {quantized} linear layers packed as int4")


def goldens(src: Path, out: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    source = json.loads((src / "golden.json").read_text())
    prompts = []
    with torch.no_grad():
        for p in source["prompts"]:
            ids = torch.tensor([p["input_ids"]])
            logits = model(input_ids=ids).logits[0].float()
            top = logits.topk(5, dim=-1)
            sorted_logits = logits.sort(dim=-1, descending=True).values
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            steps = torch.stack([s[0].float() for s in generated.logits])
            prompts.append({
                "name": p["name"],
                "input_ids": p["input_ids"],
                "last_logits": logits[-1].tolist(),
                "top5_ids": top.indices.tolist(),
                "top5_logits": top.values.tolist(),
                "min_top1_top2_margin_over_positions": float((sorted_logits[:, 0] - sorted_logits[:, 1]).min()),
                "greedy": {
                    "generated_ids": generated.sequences[0, ids.shape[1]:].tolist(),
                    "step_argmax": steps.argmax(dim=-1).tolist(),
                    "step_max_logit": steps.max(dim=-1).values.tolist(),
                },
            })
    import compressed_tensors
    import transformers
    golden = {
        "source": f"{src.name} quantized to compressed-tensors int4 (pack-quantized, groups of {GROUP})",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__,
        },
        "prompts": prompts,
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    for p in prompts:
        print(f"{p['name']}: greedy {p['greedy']['generated_ids'][:8]}..., "
              f"smallest top-1/top-2 margin {p['min_top1_top2_margin_over_positions']:.4f}")


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    quantize(src, out)
    goldens(src, out)


if __name__ == "__main__":
    main()

"""GPU check of packing: a packed row gives the losses of its samples run one by one, per attention kernel.

    python bench/gpu_packing_check.py [--hidden 1024] [--layers 2] [--docs 8]

The CPU test (tests/test_packing.py) shows it in fp32 at rel 1e-5 with sdpa and eager (flex: forward); this runs
the same comparison on the GPU in bf16, with a Mixtral shape of ``--hidden`` width (random weights, the embedded
tokenizer, data.json's records) for every kernel ``attn_implementation="auto"`` can pick on a GPU and the explicit
ones: sdpa and flex_attention (transformers' kernels that take the document mask built from position_ids) and
varlen (torch's flash varlen kernel over the documents' cumulative lengths, megablocks_utils/model/attention.py). The
packed row is padded to a fixed length as the scripts pad it (a padding document at its end). Prints one JSON line
per kernel (attention and norms compiled as the scripts' compile_dense does): the relative difference of the summed loss, the largest per-token difference, and the same for the
fp32 model (the reference for what bf16 rounding alone does; varlen has no fp32 kernel, so it has bf16 only).
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megablocks_utils.data.batches import collate
from megablocks_utils.data.packing import pack_dataset  # noqa: E402
from megablocks_utils.data.records import build_dataset
from megablocks_utils.model.attention import register_varlen  # noqa: E402
from megablocks_utils.model.tiny import make_tiny_mixtral  # noqa: E402
from megablocks_utils.parallel.compile_dense import compile_dense_parts  # noqa: E402
from megablocks_utils.train.loss import IGNORE_INDEX  # noqa: E402


def token_losses(model, batch):
    out = model(**batch["model_inputs"])
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="none").view_as(labels)
    return loss[labels != IGNORE_INDEX]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--dir", default="/tmp/packing_check_model")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(args.dir):
        make_tiny_mixtral(args.dir, os.path.join(ROOT, "data.json"), hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                          num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    samples = build_dataset(os.path.join(ROOT, "data.json"), tokenizer, 4096)[0].select(range(args.docs))
    row = pack_dataset(samples, 8192, seed=0)
    assert len(row) == 1
    order = row[0]["samples"]
    length = len(row[0]["input_ids"]) + 100  # a padding document at the row's end, as every script row has
    register_varlen()
    for attn in ("sdpa", "flex_attention", "varlen"):
        result = {"attn": attn, "docs": args.docs, "row_tokens": len(row[0]["input_ids"]), "row_length": length}
        for dtype in (torch.float32, torch.bfloat16) if attn != "varlen" else (torch.bfloat16,):
            name = "fp32" if dtype == torch.float32 else "bf16"
            try:
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=dtype, attn_implementation=attn).cuda().eval()
                compile_dense_parts(model)  # attention compiled as the scripts compile it (flex inside it, in default mode)
                with torch.no_grad():
                    # each document alone in a row padded to a fixed 256 tokens, as the scripts pad every row (a row
                    # of a few dozen tokens would send flex down its decoding path, which training never takes)
                    alone = torch.cat([token_losses(model, collate([samples[i]], tokenizer.pad_token_id, "cuda", 256, attn))
                                       for i in order])
                    packed = token_losses(model, collate([row[0]], tokenizer.pad_token_id, "cuda", length, attn))
                result[f"{name}_sum_rel"] = float((packed.sum() - alone.sum()).abs() / alone.sum())
                result[f"{name}_max_token_abs"] = float((packed - alone).abs().max())
                result[f"{name}_mean_token_abs"] = float((packed - alone).abs().mean())
                del model
            except Exception as e:  # noqa: BLE001 - report the kernel and dtype that fail, go on with the next
                result[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        result["status"] = "error" if any(k.endswith("_error") for k in result) else "ok"
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

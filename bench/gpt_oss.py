"""gpt-oss-20b's shape, cut to a few layers: a random checkpoint (bench/run.py gpt_oss trains it).

    python bench/gpt_oss.py write --dir /tmp/gpt-oss-L4 --layers 4

``write`` saves a ``GptOssForCausalLM`` with gpt-oss-20b's dimensions (hidden 2880, 32 experts of width 2880, top-4,
64 query and 8 key/value heads of 64, vocabulary 201,088, alternating sliding (128) and full attention, YaRN rope)
and ``--layers`` decoder layers, random weights in bf16, in the layout ``save_pretrained`` writes: what
``openai/gpt-oss-20b`` becomes once dequantized from MXFP4 (our loader refuses MXFP4 itself, with the way out). The
tokenizer is the embedded tiny model's (its ids are a subset of the 201,088 rows), so the training scripts and
bench_fsdp1.py's synthetic data run on it. Options shrink the shape for a CPU smoke test.
Our layer's parity with transformers' at this shape on a GPU: tests/gpu/test_gpt_oss_layer.py.
"""

import argparse
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

# gpt-oss-20b's config.json, less its quantization_config and its 24 layers.
GPT_OSS_20B = dict(
    hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128, max_position_embeddings=131072,
    router_aux_loss_coef=0.9, swiglu_limit=7.0, tie_word_embeddings=False, attention_bias=True,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
)


def write(args) -> None:
    import torch
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    from megablocks_utils.model.tiny import DEFAULT_NAME, make_tiny_mixtral

    tiny = os.path.join(ROOT, DEFAULT_NAME)
    if not os.path.isdir(tiny):
        make_tiny_mixtral(tiny, os.path.join(ROOT, "data.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    shape = dict(GPT_OSS_20B)
    for key in ("hidden_size", "intermediate_size", "num_local_experts", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        if getattr(args, key):
            shape[key] = getattr(args, key)
    if shape["hidden_size"] != GPT_OSS_20B["hidden_size"] and not args.intermediate_size:
        shape["intermediate_size"] = shape["hidden_size"]
    config = GptOssConfig(
        **shape, num_hidden_layers=args.layers, layer_types=["sliding_attention", "full_attention"] * (args.layers // 2) + ["sliding_attention"] * (args.layers % 2),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        output_router_logits=False,
    )
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"error: the tokenizer has {len(tokenizer)} ids, more than the model's {config.vocab_size} rows")
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with device:  # transformers' own initialisation, on the GPU where there is one (4.4 B parameters at 4 layers)
        model = GptOssForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(args.dir, max_shard_size="4GB")
    tokenizer.save_pretrained(args.dir)  # last: bench_fsdp1.checkpoint_complete reads it as "complete"
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.dir}: gpt-oss, {args.layers} layers, {n / 1e9:.2f} B parameters, bf16, in {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["write"])
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    for key in ("hidden_size", "intermediate_size", "num_local_experts", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        p.add_argument(f"--{key}", type=int, default=0, help="instead of gpt-oss-20b's, for a smoke test")
    write(p.parse_args())


if __name__ == "__main__":
    main()

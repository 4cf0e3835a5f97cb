"""gpt-oss-20b's shape, cut to a few layers: a random checkpoint, and our layer's parity with transformers on a GPU.

    python bench/gpt_oss.py write --dir /tmp/gpt-oss-L4 --layers 4
    torchrun --nproc_per_node=1 bench/gpt_oss.py parity --dir /tmp/gpt-oss-L4 [--layers 2]

``write`` saves a ``GptOssForCausalLM`` with gpt-oss-20b's dimensions (hidden 2880, 32 experts of width 2880, top-4,
64 query and 8 key/value heads of 64, vocabulary 201,088, alternating sliding (128) and full attention, YaRN rope)
and ``--layers`` decoder layers, random weights in bf16, in the layout ``save_pretrained`` writes: what
``openai/gpt-oss-20b`` becomes once dequantized from MXFP4 (our loader refuses MXFP4 itself, with the way out). The
tokenizer is the embedded tiny model's (its ids are a subset of the 201,088 rows), so the training scripts and
bench_fsdp1.py's synthetic data run on it. Options shrink the shape for a CPU smoke test.

``parity`` (one GPU) loads the checkpoint three ways, computes one batch's summed cross-entropy and its gradients,
and compares:
  (1) ours in fp32 (our expert-parallel layer swapped in by ``shard_moe``, ep = 1) against transformers in fp32;
  (2) the bf16 error against that fp32 truth, of ours in bf16 and of transformers' own bf16 model. Two bf16 runs
      never agree bit for bit (routing near-ties flip), so the bound is that ours is no further from the fp32 truth
      than transformers' bf16 is (within 1.5x), for the logits and for the whole gradient.
Prints one JSON record (and appends it to ``--out``); exits non-zero past a bound.
"""

import argparse
import copy
import json
import os
import sys
import time
from datetime import date

import torch
import torch.distributed as dist

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


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def forward_backward(model, ids: torch.Tensor) -> tuple[float, torch.Tensor, dict]:
    """Summed next-token cross-entropy of ``ids``; the loss, the logits (fp32) and every gradient (fp32, whole)."""
    from megablocks_utils import causal_lm_loss_sum

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = causal_lm_loss_sum(logits, ids)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.float()
    model.zero_grad(set_to_none=True)
    return float(loss), logits.detach().float(), grads


def gradient_error(grads: dict, truth: dict) -> float:
    """|g - g_truth| / |g_truth| over the whole gradient (every parameter in one vector)."""
    diff = sum(float((grads[n] - truth[n]).square().sum()) for n in truth)
    norm = sum(float(truth[n].square().sum()) for n in truth)
    return (diff / norm) ** 0.5


def parity(args) -> int:
    from transformers import AutoModelForCausalLM

    from megablocks_utils import shard_moe

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    from transformers import AutoConfig

    overrides = {}
    if args.layers:  # the first N layers: the config cut, the other layers' weights left unread
        layer_types = AutoConfig.from_pretrained(args.dir).layer_types
        overrides = dict(num_hidden_layers=args.layers, layer_types=layer_types[: args.layers])
    load = lambda dtype: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        args.dir, dtype=dtype, attn_implementation="eager", **overrides).to(device)
    reference = load(torch.float32)
    config = reference.config
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device, generator=generator)
    record = {"config": "gpt_oss_parity", "device": torch.cuda.get_device_name() if cuda else "cpu", "date": date.today().isoformat(),
              "torch": torch.__version__, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
              "experts": config.num_local_experts, "top_k": config.num_experts_per_tok, "batch": args.batch, "seq": args.seq}
    failures = []

    truth_loss, truth_logits, truth_grads = forward_backward(reference, ids)
    ours = copy.deepcopy(reference)
    shard_moe(ours, 1, device=device)
    loss, logits, grads = forward_backward(ours, ids)
    fp32 = {"loss_rel": abs(loss - truth_loss) / abs(truth_loss), "logits_rel_max": rel_max(logits, truth_logits),
            "grad_rel": gradient_error(grads, truth_grads),
            "worst_param_grad_rel_max": max(rel_max(grads[n], truth_grads[n]) for n in truth_grads)}
    record["fp32_ours_vs_transformers"] = fp32
    print(f"fp32, ours vs transformers: loss rel {fp32['loss_rel']:.2e}, logits rel {fp32['logits_rel_max']:.2e}, "
          f"gradient rel {fp32['grad_rel']:.2e}, worst parameter {fp32['worst_param_grad_rel_max']:.2e} (bound 1e-4)", flush=True)
    if max(fp32.values()) > 1e-4:
        failures.append("fp32")
    del ours, reference, grads, logits

    theirs = load(torch.bfloat16)
    ours = copy.deepcopy(theirs)
    shard_moe(ours, 1, device=device)
    bf16 = {}
    for name, model in (("transformers", theirs), ("ours", ours)):
        loss, logits, grads = forward_backward(model, ids)
        bf16[name] = {"loss": loss, "loss_rel": abs(loss - truth_loss) / abs(truth_loss),
                      "logits_mean_rel": float((logits - truth_logits).abs().mean() / truth_logits.abs().mean()),
                      "grad_rel": gradient_error(grads, truth_grads)}
        del logits, grads
    record.update(truth_loss=truth_loss, bf16_vs_fp32_truth=bf16)
    for key in ("logits_mean_rel", "grad_rel"):
        print(f"bf16 vs the fp32 truth, {key}: ours {bf16['ours'][key]:.3e}, transformers {bf16['transformers'][key]:.3e} "
              f"(bound: ours <= 1.5x transformers)", flush=True)
        if bf16["ours"][key] > 1.5 * bf16["transformers"][key]:
            failures.append(f"bf16 {key}")
    print(f"loss: fp32 {truth_loss:.2f}, bf16 ours {bf16['ours']['loss']:.2f}, bf16 transformers {bf16['transformers']['loss']:.2f}", flush=True)
    record["status"] = "failed: " + ", ".join(failures) if failures else "ok"
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["write", "parity"])
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=int, default=0, help="write: decoder layers (default 4); parity: use only the first N (0 = all)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default="bench/results.jsonl")
    for key in ("hidden_size", "intermediate_size", "num_local_experts", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        p.add_argument(f"--{key}", type=int, default=0, help="(write) instead of gpt-oss-20b's, for a smoke test")
    args = p.parse_args()
    if args.mode == "write":
        args.layers = args.layers or 4
        write(args)
    else:
        sys.exit(parity(args))


if __name__ == "__main__":
    main()

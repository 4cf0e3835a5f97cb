"""The embedded default model: a tiny Mixtral created locally and deterministically.

No model hub is reachable here or in CI, so the default run makes its own model: a byte-level BPE
tokenizer trained on the shipped data.json, a small Mixtral config, seeded random weights, written as a
real sharded hub-layout checkpoint, which the trainer then loads through the same code path as a
real Mixtral.
"""

import os
import shutil

import torch

from megablocks_utils.data.records import format_prompt, read_alpaca

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    router_aux_loss_coef=0.02,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
VOCAB_SIZE = 512
# A plain ChatML-like template, so chat records (messages) run on the embedded model too. Its markers are
# ordinary text, not added tokens (the vocabulary, and so every earlier checkpoint, stays as it was);
# {% generation %} marks what the loss trains on: each assistant turn through its end-of-turn marker.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{{ eos_token }}\n{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(data_path: str, vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [format_prompt(r) + r["output"] for r in read_alpaca(data_path)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)


def make_tiny_mixtral(out_dir: str, data_path: str, seed: int = 0, num_files: int = 3, **config_overrides) -> None:
    """Write the tiny model to ``out_dir`` (atomically: a half-written directory never appears).

    ``config_overrides`` change TINY_CONFIG's sizes (bench/run.py optim_quality makes a mid-size model this way).
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    from megablocks_utils.model.export import hub_state_dict, write_shards

    tokenizer = train_tokenizer(data_path)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{**TINY_CONFIG, **config_overrides},
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    tensors = hub_state_dict(model)
    names = sorted(tensors)
    # Interleave names over the files so one expert's w1, w2 and w3 land in different files,
    # exercising the loader's per-file handling the way real multi-file checkpoints do.
    shards = [{n: tensors[n] for n in names[i::num_files]} for i in range(num_files)]
    tmp = out_dir.rstrip("/") + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_shards(tmp, shards)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(out_dir):  # another process finished first; theirs is identical
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out_dir)


DEFAULT_NAME = "tiny-mixtral"


def default_model_pending(model_name_or_path: str) -> bool:
    """Whether this is the embedded default, not created yet (``ensure_default_model`` will make it)."""
    return model_name_or_path == DEFAULT_NAME and not os.path.isdir(model_name_or_path)


# The shipped alpaca records the embedded tokenizer is trained on, whatever data a run trains on (a chat or text
# data_path must not change, or break, the default model).
SHIPPED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data.json")


def ensure_default_model(model_name_or_path: str) -> None:
    """Collective: create the embedded default on first use (rank 0 writes it, the others wait), from SHIPPED_DATA."""
    import torch.distributed as dist

    if not default_model_pending(model_name_or_path):
        return
    if dist.get_rank() == 0:
        print(f"creating the embedded tiny Mixtral in ./{DEFAULT_NAME}", flush=True)
        make_tiny_mixtral(model_name_or_path, SHIPPED_DATA)
    dist.barrier()

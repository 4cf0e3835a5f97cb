"""Bad input: check a run's inputs before anything heavy runs, and stop every rank with one message.

The checks (data file, model directory, output directory; ep_size against the world size is
``mesh.py``'s) read only small files, so they run on every rank before the process group,
the model or transformers' heavy modules: each rank reaches the same verdict from the same files,
rank 0 prints it, all exit.
What can only fail later, possibly on some ranks only (a rank reads only its own experts), runs
inside ``stop_together``, where the ranks compare notes before anyone moves on.
"""

import glob
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager

import torch.distributed as dist

from megablocks_utils.errors import InputError

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(value) -> bool | None:
    """A true/false setting's value (a bool, or a word of TRUE_WORDS / FALSE_WORDS in any case) as a bool; None
    for any other text, which each caller reads its own way (a mode name, "auto") or refuses. The one parser of
    true/false words: settings, activation_checkpointing, shard_experts and the fit check all use it."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in TRUE_WORDS else False if text in FALSE_WORDS else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def fail(message) -> None:
    """Stop this rank with exit code 2; rank 0 prints ``error: <message>`` (every rank calls it alike).

    It leaves with ``os._exit`` once stdout and stderr are flushed, without the interpreter's teardown, as a SIGTERM stop
    does (``train/stop_signal.exit_stopped``): that teardown raced a C++ background thread and aborted a rank with -6
    ("terminate called without an active exception") after a clean bad-input stop (tests/test_bad_input.py, an expert
    only rank 1 reads broken, 2026-11-27): an input error reported as a crash."""
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        # The launcher stops every rank once one exits: give rank 0 the moment it needs to print first.
        time.sleep(_OTHER_RANKS_EXIT_DELAY_S)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


_OTHER_RANKS_EXIT_DELAY_S = 5.0  # covers a rank 0 that reached the same check a little later

EXPECTED = (InputError, ValueError, OSError, ImportError, NotImplementedError)


@contextmanager
def stop_together(expected: tuple = EXPECTED):
    """Run a block on every rank; if it raises on any rank, every rank stops, with one message from rank 0.

    Collective: all ranks must enter it, and the block must not start a collective after a point
    where it can fail on some ranks only (those would not join it). ``expected`` errors are bad
    input and give their message alone; any other error is a bug: its rank prints the traceback.
    """
    error = None
    try:
        yield
    except expected as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 (still agree with the other ranks, so none is left waiting)
        traceback.print_exc()
        error = f"{type(e).__name__}: {e} (traceback above)"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        fail(message if rank == 0 else f"on rank {rank}: {message}")


def fsdp_requested() -> bool:
    """Whether this process was started by ``accelerate launch`` with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


# shard_experts="auto" inside one node. Measured on 4 x H200 at 8 Mixtral layers
# (bench/reports/peers_memory_models_h100-h200_2026-11-22-23.md): ep = 2, dp = 2 with experts sharded over dp took 0.927 s per step at 68 GiB, replicated 1.041 s at 119 GiB
# (the replicas' all-reduce of every expert gradient costs more than the per-layer all-gathers).
SHARD_EXPERTS_IN_ONE_NODE = True


def resolve_shard_experts(setting, world_size: int, nproc_per_node: int) -> bool:
    """``shard_experts`` ("auto", "true", "false" or a bool) as a decision.

    "auto": always when the job spans more than one node (``world_size > nproc_per_node``: replicated
    experts would not shrink as nodes are added); inside one node, ``SHARD_EXPERTS_IN_ONE_NODE``.
    """
    flag = parse_bool(setting)
    if flag is not None:
        return flag
    if str(setting).lower() == "auto":
        return world_size > nproc_per_node > 0 or SHARD_EXPERTS_IN_ONE_NODE
    raise InputError(f"shard_experts={setting!r} is unknown; choose auto, true or false")


def check_output_dir(output_dir: str, results: tuple[str, ...], overwrite: bool, resuming: bool, resume_flag: str) -> list[str]:
    """Refuse an output directory that holds another run's ``results`` (glob patterns) unless told to
    overwrite them or to resume that run; returns what was found. A path that is (or lies under) a
    file is refused too: the run could write nothing there."""
    path = os.path.abspath(output_dir)
    while not os.path.exists(path) and os.path.dirname(path) != path:  # the nearest part that exists
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        what = "is a file" if path == os.path.abspath(output_dir) else f"lies inside {path}, which is a file"
        raise InputError(f"output_dir {output_dir} {what}, not a directory; set output_dir to a directory path")
    found = sorted(
        os.path.basename(path) + ("/" if os.path.isdir(path) else "")
        for pattern in results
        for path in glob.glob(os.path.join(glob.escape(output_dir), pattern))
    )
    if found and not (overwrite or resuming):
        raise InputError(
            f"{output_dir} already holds a run's results ({', '.join(found)}); choose another output_dir, "
            f"pass {resume_flag} to continue that run, or --overwrite_output_dir true to replace it"
        )
    return found


def finished_same_run(output_dir: str, settings: dict) -> bool:
    """Whether ``output_dir`` holds a finished run (summary.json and final/) made with these very settings (its
    settings.json): running the same command again has nothing to do."""
    path = os.path.join(output_dir, "settings.json")
    if not (os.path.isfile(path) and os.path.isfile(os.path.join(output_dir, "summary.json"))
            and os.path.isdir(os.path.join(output_dir, "final"))):
        return False
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return earlier == json.loads(json.dumps(settings, default=str))


def nothing_to_do(message: str) -> None:
    """Leave with exit code 0, rank 0 saying why in one line (every rank calls it alike, before the process group)."""
    if _rank() == 0:
        print(message, flush=True)
    sys.stdout.flush()
    sys.exit(0)


def check_data_and_model(data_path: str, eval_data_path: str, eval_split: float, model_name_or_path: str,
                         attn_implementation: str, device_type: str, quantized_ok: bool = False):
    """Both scripts' checks of the data files and the model directory, from small files only (the records,
    config.json, the safetensors index, the tokenizer files), before the process group. ``quantized_ok``: a checkpoint
    released quantized is taken (LoRA's ``quantize_base``).

    Returns ``(num_experts, experts_name, model_config)``: the model's expert count and the name of its config field
    (``None, ""`` for the embedded default, made later from known settings) and its config.
    """
    # Imported here, not at the top: the modules that import this one for its small helpers (parse_bool, fail) need none.
    from megablocks_utils.data.records import read_records
    from megablocks_utils.model.attention import choose_attention
    from megablocks_utils.model.loading import check_model_dir, check_tokenizer_files, load_config
    from megablocks_utils.model.tiny import TINY_CONFIG, default_model_pending

    read_records(data_path)
    if eval_data_path and eval_split > 0:
        raise InputError("give eval_data_path or eval_split, not both")
    if eval_data_path:
        read_records(eval_data_path)
    if default_model_pending(model_name_or_path):
        num_experts, experts_name, model_config = None, "", load_config({"model_type": "mixtral", **TINY_CONFIG})
    else:
        num_experts, experts_name = check_model_dir(model_name_or_path, quantized_ok)
        check_tokenizer_files(model_name_or_path)
        model_config = load_config(model_name_or_path)
    choose_attention(attn_implementation, model_config, device_type)  # an impossible kernel stops here
    return num_experts, experts_name, model_config

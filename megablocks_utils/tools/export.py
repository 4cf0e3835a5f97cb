"""``python -m megablocks_utils.tools.export CHECKPOINT OUT``: a training checkpoint as a Hugging Face model in hub
layout. The command line only; the writing is ``train/checkpoint_export.export_from_checkpoint``."""

import torch

from megablocks_utils.errors import CheckpointError
from megablocks_utils.train.checkpoint_export import export_from_checkpoint


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m megablocks_utils.tools.export",
        description="Export a training checkpoint (train_fsdp2: output_dir/checkpoints/step_XXXXXXXX; "
        "train_fsdp1: output_dir/checkpoint-N) as a Hugging Face model in hub layout.",
    )
    parser.add_argument("checkpoint", help="a step_XXXXXXXX or checkpoint-N directory")
    parser.add_argument("out", help="where to write the HF model")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: as trained)")
    args = parser.parse_args(argv)
    try:
        export_from_checkpoint(args.checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", flush=True)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m megablocks_utils.tools.place_experts``: a model directory with its experts placed on the ep ranks by
load (``model/placement.py`` says why and how), or renumbered back. The command line only.

    python -m megablocks_utils.tools.place_experts MODEL_DIR PLACED_DIR --loads output/fsdp2/metrics.jsonl --ep 4
    python -m megablocks_utils.tools.place_experts output/fsdp2/final ORIGINAL_ORDER --undo PLACED_DIR/expert_order.json
"""

from megablocks_utils.errors import InputError
from megablocks_utils.model.placement import expert_loads, place, undo


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megablocks_utils.tools.place_experts",
                                     description="Renumber a model's experts so that each ep rank's block carries "
                                     "an even load (the same model), or back with --undo.")
    parser.add_argument("src", help="a Hugging Face model directory (safetensors)")
    parser.add_argument("dst", help="where to write the renumbered model")
    parser.add_argument("--loads", help="a run's metrics.jsonl on this model: the rows per expert to balance")
    parser.add_argument("--ep", type=int, help="the expert-parallel degree the placement is for")
    parser.add_argument("--undo", metavar="ORDER_FILE", help="renumber back with a placed directory's expert_order.json")
    args = parser.parse_args(argv)
    try:
        if args.undo:
            undo(args.src, args.dst, args.undo)
        elif args.loads and args.ep:
            place(args.src, args.dst, expert_loads(args.loads), args.ep)
        else:
            parser.error("give --loads and --ep, or --undo")
    except (InputError, OSError, ValueError) as e:
        print(f"error: {e}", flush=True)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

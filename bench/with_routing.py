"""Run a training script with the benchmarks' routing on its model, so ours routes as transformers' model does.

    torchrun --nproc_per_node=1 bench/with_routing.py balanced train_fsdp2.py --model_name_or_path ... [its settings]

The first argument is bench/routing_skew.py's routing (``own``, ``balanced``, ``skew:R``). Each rank wraps the
library's ``load_model`` so that ``routing_skew.control_routing`` puts its hooks on the model it returns, then runs
the script as ``python SCRIPT ARGS`` would (``runpy``, as ``__main__``): the script and the library are unchanged.
The hooks are on the routers before ``parallelize``; compile and FSDP2 leave module hooks in place, and inside a
forward FSDP2 has gathered the router's weight, which is all the hooks read.
"""

import os
import runpy
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)


def route_loaded_models(routing: str) -> None:
    """Wrap the library's ``load_model`` so that every model it returns routes by ``routing`` (call before the script runs)."""
    from routing_skew import control_routing

    from megablocks_utils.model import build

    load_model = build.load_model

    def load_model_routed(*a, **kw):
        model, mesh = load_model(*a, **kw)
        control_routing(model, routing)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"with_routing: {routing} routing on every router", flush=True)
        return model, mesh

    build.load_model = load_model_routed  # train_fsdp2.py takes it from megablocks_utils, which reads build's on first use


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: with_routing.py ROUTING SCRIPT [ARGS...]   (ROUTING: own, balanced or skew:R)")
    routing, script, args = argv[0], argv[1], argv[2:]
    sys.path[:0] = [ROOT, BENCH]
    from routing_skew import parse_routing

    try:
        parse_routing(routing)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    route_loaded_models(routing)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

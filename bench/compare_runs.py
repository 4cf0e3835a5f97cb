"""Per-step relative difference of loss and grad norm between two runs' metrics.jsonl files."""

import json
import sys


def main(a_path: str, b_path: str) -> None:
    a = [json.loads(line) for line in open(a_path)]
    b = [json.loads(line) for line in open(b_path)]
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for x, y in zip(a, b):
        for key in worst:
            worst[key] = max(worst[key], abs(x[key] - y[key]) / abs(y[key]))
    print(f"{a_path} vs {b_path}: {len(a)} steps, max rel diff loss {worst['loss']:.2e}, grad_norm {worst['grad_norm']:.2e}")
    print("  loss per step: " + " ".join(f"{x['loss']:.5f}/{y['loss']:.5f}" for x, y in zip(a, b)))


if __name__ == "__main__":
    main(*sys.argv[1:3])

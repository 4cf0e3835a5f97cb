"""GPU checks as tests: each module is skipped without CUDA, each multi-GPU test without enough GPUs
(tests/README.md lists them; `python -m pytest -q tests/gpu` on a GPU machine runs them all)."""

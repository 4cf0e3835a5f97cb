# Every Python process started with this directory on PYTHONPATH (the GPU tests and the scripts they launch): tensors
# allocated without values start as NaN (torch's fill_uninitialized_memory, under deterministic algorithms; warn_only
# so that CUDA ops without a deterministic kernel still run), so a value leaking from an unwritten row shows.
import os

if os.environ.get("NAN_FILL") == "1":
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True

"""normlab: normalization and regularization studies of encoder-decoder Transformers."""
import os as _os

# OpenMP threads that spin while waiting turn a busy 2-core machine (a sweep, tests beside a
# training run) into a 20-30x slowdown of small matmuls (measured: 0.3 ms vs 31 ms for a
# 273x128 @ 128x128 linear with 2 threads under load). Only effective if set before torch is
# first imported; set OMP_WAIT_POLICY yourself to override it.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Large CPU tensors (the (tokens, vocab) logits and their gradient: ~130 MB per step at the reference
# config) come from fresh mmap'd pages, and touching them page by page cost as much as the softmax
# computed into them (measured: 74 ms to allocate and fill 4096 x 8000 floats, 27-40 ms with this
# set). torch's CPU allocator then asks for transparent huge pages (2 MB) for allocations of 2 MB
# and more. Read once, at torch's first allocation, so it too must be set before torch is imported.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

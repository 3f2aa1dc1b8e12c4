"""Sparse attention with an attention sink: the reference semantics of the official kernel
(docs/numerics.md §9)."""
# The kernels live in inference/kernels/ (reference.py: this exact online softmax; fast.py: loop-free;
# tilelang_ops.py: GPU); model code calls inference.kernels.sparse_attn, which picks one per call.
from .kernels.reference import CHUNK, sparse_attn  # noqa: F401  (reference semantics, for tests and tools)

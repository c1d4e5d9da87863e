"""Numba CPU kernels computing directly on quantized GGUF blocks, and their NumPy twins.

Importing this package is free: nothing here imports Numba.  `reference` is the NumPy oracle;
`matmul`, `attention`, `layers` hold the Numba kernels (compiled on first use, or loaded from
NUMBA_CACHE_DIR), and `localllm.backends.numba_cpu.NumbaBackend` puts them behind the Backend
protocol.
"""

"""Benchmarks: offline (llama-bench style), serving (vLLM bench style) and batching comparisons."""

"""Evaluation task generators for hf_offload benchmarks (no model code)."""

"""Glue for model libraries (HF transformers)."""

"""Corpora, TFDS builders, tokenizer, a run's data assembly and the input pipeline."""

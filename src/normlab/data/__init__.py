"""Parallel corpora: reading (corpus), preprocessing into memory-mapped token arrays (preprocess,
arrays, folder), the subword tokenizer, token-budget batching and the Lightning data module.

Nothing is imported here: preprocessing's worker processes import normlab.data.preprocess and
must not pay for torch and Lightning."""

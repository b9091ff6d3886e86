"""Parallel corpora, subword tokenizer, token-budget batching and the Lightning data module."""
from normlab.data.batching import TokenBatchSampler, TranslationDataset, collate
from normlab.data.corpus import CorpusError, filter_by_length, read_parallel
from normlab.data.datamodule import TranslationDataModule, project_root, resolve_path
from normlab.data.tokenizer import Tokenizer

__all__ = ["CorpusError", "read_parallel", "filter_by_length", "Tokenizer", "TokenBatchSampler",
           "TranslationDataset", "collate", "TranslationDataModule", "project_root", "resolve_path"]

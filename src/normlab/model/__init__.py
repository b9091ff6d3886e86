"""The Transformer model: built from a ModelConfig alone; imports neither Lightning nor Hydra."""
from normlab.model.attention import IncrementalCache, MultiheadAttention
from normlab.model.norms import NORMS, build_norm
from normlab.model.residual import ResidualBlock
from normlab.model.transformer import Seq2SeqTransformer

__all__ = ["IncrementalCache", "MultiheadAttention", "NORMS", "build_norm", "ResidualBlock",
           "Seq2SeqTransformer"]

"""sq: distributed, resumable post-training quantization of huge Hugging Face checkpoints."""

from sq.errors import LoadRefused, SqError

__version__ = "0.1.0"

__all__ = ["LoadRefused", "SqError", "__version__"]

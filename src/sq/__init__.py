"""sq: distributed, resumable post-training quantization of huge Hugging Face checkpoints."""

from sq.errors import LoadRefused, SqError
from sq.version import __version__

__all__ = ["LoadRefused", "SqError", "__version__", "load_sharded", "quantize"]


def __getattr__(name):
    # The loader pulls in torch.distributed and transformers: import it on first use only.
    if name == "load_sharded":
        from sq.load.loader import load_sharded

        return load_sharded
    if name == "quantize":
        from sq.api import quantize

        return quantize
    raise AttributeError(f"module 'sq' has no attribute {name!r}")

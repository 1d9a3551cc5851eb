"""sq's version: a leaf module, so code inside sq reports it without importing the package ``sq``
(whose lazy ``quantize`` / ``load_sharded`` lead back to the whole pipeline)."""

__version__ = "0.1.0"

"""What a quantized weight is, below every algorithm and writer: schemes (``schemes``), their
numeric formats and cross-row reductions (``specs``), the quantize / dequantize maths
(``primitives``) and the compressed-tensors tensors and config they are stored as (``compressed``).
Imports nothing of sq but ``sq.errors`` and ``sq.dictconfig``."""

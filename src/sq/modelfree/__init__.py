"""Model-free quantization: data-free schemes straight from the safetensors shards, no model built.

``python -m sq.ptq --model-free`` (or automatically, when transformers cannot build the
architecture and the job needs no calibration data) reads the index and the headers, decides
from names and shapes which tensors are Linear weights, and quantizes each with round-to-nearest
-- the very functions the model path's ``rtn_rows`` calls (``rtn.qparams``, ``rtn.quantize``), then
``compress_weight`` -- so the output equals ``sq.ptq --algo rtn``'s tensor for tensor.

Classification (docs/model-free.md), inside decoder layers ``<prefix>.layers.<i>.`` with
``i < num_hidden_layers`` (later layers -- DeepSeek's MTP -- are carried over as they are):

- where transformers knows the ``model_type``, from the model it builds on meta (``sq.load.layout``):
  the whole ``.weight`` of a non-router ``nn.Linear`` in a decoder block is quantized, per-expert
  tensors the conversion mapping stacks are quantized per expert, a fused 3-D tensor only where its
  per-expert names load back; everything else (norms, conv, SSM parameters, routers, 3-D tensors
  with no per-expert layout transformers loads) is carried as it is; a tensor the Hub stores transposed
  against its parameter (the conversion mapping's ``Transpose``, Qwen3-VL-MoE's experts) is carried as
  stored where its parameter would be carried, and refused by name where it would be quantized;
- otherwise from names and shapes: 2-D projections (``*_proj``, ``w1/w2/w3``, ``fc1/fc2``...) and
  per-expert ``experts.<e>.<proj>.weight`` quantized, 1-D tensors and routers kept, anything else
  (every 3-D tensor: its orientation cannot be proven) refused by name (``--ignore`` keeps it).

Outside the layers everything is kept; ``lm_head`` is listed in ``ignore``.  FP8 block-scaled
sources are dequantized per tile (``sq.load.fp8.dequantize``) into the config's dtype, their scales
dropped.  MXFP4 sources (gpt-oss) are refused: the model path reads them (``sq.load.mxfp4``).
NVFP4-style global scales are shared by fused partners (``sq.anatomy.partner_groups``;
an expert's gate and up), which always land on one unit: one rank, or all of them row-split together.

Work: units (a partner group of Linears, one expert of a group, a layer's other tensors) go to
ranks by bytes, greedily; when a few dense Linears leave ranks unbalanced, their rows are split
over every rank (``split_by_bytes``, ``_split_pass``: statistics that span rows all-reduced once,
rows gathered to one writer).  Each rank reads its units a few ahead in a thread, quantizes, and
hands each layer to a writer thread that writes ``model-rank{r}-block{b}`` and records the layer in
its manifest (``sq.resume``), so reading, quantizing and writing overlap; rank 0 writes the root and
carried tensors, config, report and, last, the index.  The only collectives between the refusals
and the final stage are the row-split pass's, before the first layer.
"""

from sq.modelfree.plan import Plan, TensorSlot, Unit, classify, split_by_bytes  # noqa: F401
from sq.modelfree.quantize import data_free_problems, quantize_checkpoint, wanted  # noqa: F401

__all__ = ["wanted", "quantize_checkpoint", "data_free_problems", "classify", "split_by_bytes", "Plan", "Unit", "TensorSlot"]

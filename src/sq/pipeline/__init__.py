"""The block pipeline, one of the two drivers of ``sq.run`` (the other: ``sq.modelfree``): a checkpoint
(or a model in memory) built on meta, filled block by block, each block quantized by the job's
algorithm (``sq.quant``).

    job       PTQConfig -> resolve the model -> skeleton on meta -> load plan -> calibration windows
    weights   where the block's tensors come from (a checkpoint through DCP, or a model in memory)
    targets   what each block quantizes (Linears, experts, schemes) and every refusal about it
    blocks    the stages of one block, and the run from claim to final stage
"""

"""Paper projection (issue 7): DeepSeek-V3 W4A16 GPTQ with sq on 1 x 8 and 2 x 8 H200.

    python bench/project_deepseek.py            # prints the tables of docs/scale-projection.md

Every number this prints is a PROJECTION from counts (parameters, FLOPs, bytes) and the constants
below, not a measurement.  The counts follow sq's algorithm as implemented (sq.pipeline.job,
sq.quant.experts, sq.quant.gptq) at the commit of this file; the constants name their sources.
"""

from __future__ import annotations

# ---- model: DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3)
H = 7168            # hidden_size
I_DENSE = 18432     # intermediate_size (first 3 layers)
I_MOE = 2048        # moe_intermediate_size
L, L_DENSE = 61, 3  # num_hidden_layers, first_k_dense_replace
E, TOPK, SHARED = 256, 8, 1
HEADS, Q_LORA, KV_LORA, D_NOPE, D_ROPE, D_V = 128, 1536, 512, 128, 64, 128
VOCAB = 129280

# ---- job: the calibration set
NSAMPLES, SEQLEN = 512, 2048
TOKENS = NSAMPLES * SEQLEN
CALIB_BATCH = 8     # samples per forward (sq.pipeline.job.CALIB_BATCH)
GROUP = 128         # W4A16 group size

# ---- hardware constants (vendor datasheets; "effective" = an assumed 50 % of peak)
BF16_PEAK = 989e12      # H200 SXM dense BF16 tensor-core FLOP/s (NVIDIA H200 datasheet)
FP32_PEAK = 67e12       # H200 SXM FP32 (non-tensor) FLOP/s (datasheet)
FP64_PEAK = 67e12       # H200 SXM FP64 tensor-core FLOP/s (datasheet)
EFF = 0.5
NVLINK = 450e9          # NVLink 4 per GPU, one direction (900 GB/s bidirectional, datasheet)
IB = 50e9               # 400 Gb/s InfiniBand NDR per GPU (8 per node), one direction
NVME = 6e9              # per-node read bandwidth of a local NVMe RAID (assumed; shared by 8 ranks)

B = 2  # bf16 bytes


def hbytes(n: int) -> int:
    """A dense Hessian's bytes per element (sq.quant.gptq.hessian_dtype): float64 up to 4096 wide, float32 beyond."""
    return 8 if 8 * n * n <= 128 << 20 else 4


def attn_linears():
    """(in, out) of MLA's projections."""
    return {"q_a_proj": (H, Q_LORA), "q_b_proj": (Q_LORA, HEADS * (D_NOPE + D_ROPE)),
            "kv_a_proj_with_mqa": (H, KV_LORA + D_ROPE), "kv_b_proj": (KV_LORA, HEADS * (D_NOPE + D_V)),
            "o_proj": (HEADS * D_V, H)}


def params():
    attn = sum(i * o for i, o in attn_linears().values())
    expert = 3 * H * I_MOE
    moe_block = attn + (E + SHARED) * expert + E * H  # + router
    dense_block = attn + 3 * H * I_DENSE
    total = (L - L_DENSE) * moe_block + L_DENSE * dense_block + 2 * VOCAB * H
    return attn, expert, moe_block, dense_block, total


def project(world: int, nodes: int) -> dict:
    attn, expert, moe_block, dense_block, total = params()
    ep = world
    tok_rank = TOKENS // world
    steps = -(-(NSAMPLES // world) // CALIB_BATCH)
    r = {}
    # memory per rank (GPU), one MoE block in flight
    dense_part = attn + SHARED * expert
    r["block shard (bf16)"] = moe_block * B / world
    r["dense part gathered in a forward (bf16)"] = dense_part * B
    r["chain: inputs + outputs of the rank's samples (bf16)"] = 2 * tok_rank * H * B
    widths = [H, Q_LORA, KV_LORA, HEADS * D_V, H, I_MOE]  # q_a/kv_a, q_b, kv_b, o, shared gate/up, shared down
    hess_dense = sum(hbytes(n) * n * n for n in widths)
    r["dense Hessians during the forward (every one on every rank; float32 past 4096 wide, else fp64)"] = hess_dense
    r["dense Hessians during the solve (the largest owned: o_proj, float32, on one rank)"] = 4 * (HEADS * D_V) ** 2
    r["expert Hessians: one shared h_in + h_mid per owned expert (float32)"] = 4 * H * H + (E // ep) * 4 * I_MOE ** 2
    step_tokens = world * CALIB_BATCH * SEQLEN
    r["routed tokens of one step at an owner (calibrate-all: every token, bf16)"] = step_tokens * H * B
    # bytes
    quantized = total - 2 * VOCAB * H - (L - L_DENSE) * E * H
    out_bytes = quantized * (0.5 + B / GROUP) + (total - quantized) * B
    r["read per rank, bf16 source"] = total * B / world
    r["read per rank, FP8 source (+1/16384 scales)"] = total * 1.0 / world
    r["written per rank (W4A16 g128 + bf16 rest)"] = out_bytes / world
    # collectives per MoE block per rank (received bytes)
    r["FSDP all-gathers (2 passes x steps x dense part)"] = 2 * steps * dense_part * B * (world - 1) / world
    r["dense Hessians reduced to their solvers (each once)"] = hess_dense * (world - 1) / world
    r["tokens to expert owners, calibrate-all (2 passes)"] = 2 * steps * (world - 1) * CALIB_BATCH * SEQLEN * H * B
    # FLOPs per MoE block, all ranks together
    f = {}
    f["forward, attention linears (2 passes)"] = 2 * 2 * attn * TOKENS
    f["forward, attention scores (causal, 2 passes)"] = 2 * 2 * (SEQLEN / 2) * HEADS * (D_NOPE + D_ROPE + D_V) * TOKENS
    f["forward, routed top-8 + shared experts (2 passes)"] = 2 * (TOPK + SHARED) * 2 * expert * TOKENS
    f["calibrate-all: gate/up of every expert on every token"] = E * 2 * 2 * H * I_MOE * TOKENS
    f["dense Hessians x^T x (fp32 products)"] = 2 * TOKENS * (H * H + Q_LORA ** 2 + KV_LORA ** 2 + (HEADS * D_V) ** 2
                                                            + H * H + I_MOE ** 2)
    f["expert h_in once, shared (float32)"] = 2 * H * H * TOKENS
    f["expert h_mid per expert (float32)"] = E * 2 * I_MOE * I_MOE * TOKENS
    f["GPTQ solves (Cholesky + sweep ~ 2 cols^3 + rows cols^2 per Linear)"] = sum(
        2 * i ** 3 + o * i * i for i, o in attn_linears().values()) + (E + SHARED) * (
        2 * (2 * H ** 3) + 2 * I_MOE * H * H + 2 * I_MOE ** 3 + H * I_MOE ** 2)
    r["flops"] = f
    bf16 = world * BF16_PEAK * EFF
    fp32 = world * FP32_PEAK * EFF
    t = {}
    t["forwards (bf16)"] = (f["forward, attention linears (2 passes)"] + f["forward, attention scores (causal, 2 passes)"]
                            + f["forward, routed top-8 + shared experts (2 passes)"]) / bf16
    t["calibrate-all gate/up (bf16)"] = f["calibrate-all: gate/up of every expert on every token"] / bf16
    t["dense Hessians (fp32)"] = f["dense Hessians x^T x (fp32 products)"] / fp32
    t["expert Hessians (float32)"] = (f["expert h_in once, shared (float32)"]
                                      + f["expert h_mid per expert (float32)"]) / fp32
    t["GPTQ solves (float32)"] = f["GPTQ solves (Cholesky + sweep ~ 2 cols^3 + rows cols^2 per Linear)"] / fp32
    link = NVLINK if nodes == 1 else IB
    t["collectives (at the slowest link)"] = (r["FSDP all-gathers (2 passes x steps x dense part)"]
                                              + r["dense Hessians reduced to their solvers (each once)"]
                                              + r["tokens to expert owners, calibrate-all (2 passes)"]) / link
    t["read the block (bf16 source, local NVMe per node)"] = moe_block * B / nodes / NVME
    r["time"] = t
    return r


def gb(x):
    return f"{x / 1e9:,.2f}"


def main():
    attn, expert, moe_block, dense_block, total = params()
    print(f"parameters: total {total / 1e9:.1f} B; MoE block {moe_block / 1e9:.2f} B "
          f"(attention {attn / 1e6:.0f} M, one expert {expert / 1e6:.1f} M); dense block {dense_block / 1e9:.2f} B")
    print(f"calibration: {NSAMPLES} x {SEQLEN} = {TOKENS:,} tokens\n")
    runs = {"1 x 8 H200": project(8, 1), "2 x 8 H200": project(16, 2)}
    keys = [k for k in runs["1 x 8 H200"] if k not in ("flops", "time")]
    print("| per rank, per MoE block (projection) | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k in keys:
        print(f"| {k} | " + " | ".join(gb(r[k]) + " GB" for r in runs.values()) + " |")
    print("\n| FLOPs per MoE block, all ranks (projection) | PFLOP |")
    print("|---|---|")
    for k, v in runs["1 x 8 H200"]["flops"].items():
        print(f"| {k} | {v / 1e15:,.1f} |")
    print("\n| seconds per MoE block (projection) | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k in runs["1 x 8 H200"]["time"]:
        print(f"| {k} | " + " | ".join(f"{r['time'][k]:,.1f}" for r in runs.values()) + " |")
    for name, r in runs.items():
        t = r["time"]
        now = (t["forwards (bf16)"] + t["calibrate-all gate/up (bf16)"] + t["dense Hessians (fp32)"]
               + t["expert Hessians (float32)"] + t["GPTQ solves (float32)"])
        io = max(t["collectives (at the slowest link)"], t["read the block (bf16 source, local NVMe per node)"])
        n = L - L_DENSE
        print(f"\n{name}: compute per MoE block as implemented {now:,.0f} s -> {n} blocks {n * now / 3600:,.2f} h; "
              f"+ collectives/reads {io:,.0f} s per block if not overlapped")


if __name__ == "__main__":
    main()

"""Python API on MoE models: a 2-rank FSDP2 + expert-parallel training loop quantizes its model in place.

- A tiny Qwen3-MoE is parallelized as a training framework would (torchtitan style): routed experts
  are DTensors split by index (``Shard(0)``) over a 1-D ``"ep"`` mesh of its own, run by a
  differentiable all-gather / all-reduce expert forward, and ignored by FSDP2, which shards every
  decoder layer and the root.  It trains for a few steps (the loss falls), ``sq.quantize`` runs GPTQ
  on it, transformers loads the output with no missing / unexpected keys, and its logits equal
  those of the live, in-place quantized training model (relative error <= 1e-5: float32 both sides);
  the caller's expert parameters, forward, training mode and FSDP2 reshard settings come back, and
  the model trains on afterwards.
- RTN through the API on the untrained model, held as ``sq.load_sharded(..., ep=2)`` returns it, as
  FSDP2 alone holds it (``ep=1``: whole experts per rank), and as transformers' own distributed
  loading holds it (``DistributedConfig(fsdp_size=2)``), is bit-identical to ``sq.ptq`` on the checkpoint.
- Layouts sq cannot quantize are refused on every rank, naming the parameter and its placement:
  experts replicated over one mesh dimension and sharded over another, a mesh not covering the
  world, SignRound under expert parallelism, and transformers' own expert parallelism
  (``DistributedConfig(fsdp_size=2, ep_size=2)``: its experts FSDP-sharded inside the ep group, run by its
  own dispatch), with what to do instead.
"""

from __future__ import annotations

import json

import torch

from harness import run_ranks
from quant_ref import read_tensors

GS = 16


def _ep_forward_trainable(self, hidden_states, top_k_index, top_k_weights):
    """A training framework's expert-parallel forward (autograd through the collectives): gather every
    rank's tokens, run this rank's experts on them, sum the partial outputs, keep this rank's rows."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn
    import torch.nn as nn

    group = self.gate_up_proj.device_mesh.get_group("ep")
    rank = dist.get_rank(group)
    h_all = torch.cat(dnn.all_gather(hidden_states, group=group))  # equal token counts on every rank
    idx_all = torch.cat([t for t in dnn.all_gather(top_k_index, group=group)])
    w_all = torch.cat(dnn.all_gather(top_k_weights, group=group))
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    first = rank * gate_up.shape[0]
    out = torch.zeros_like(h_all)
    for i in range(gate_up.shape[0]):
        tok, pos = torch.where(idx_all == first + i)
        if tok.numel() == 0:
            continue
        gate, up = nn.functional.linear(h_all[tok], gate_up[i]).chunk(2, dim=-1)
        y = nn.functional.linear(self.act_fn(gate) * up, down[i]) * w_all[tok, pos, None]
        out = out.index_add(0, tok, y.to(out.dtype))
    out = dnn.all_reduce(out, group=group)
    n = hidden_states.shape[0]
    return out[rank * n:(rank + 1) * n]


def _parallelize_framework_style(model, ep_mesh):
    """EP on the routed experts (a 1-D "ep" mesh), FSDP2 on every decoder layer (experts ignored) and the root."""
    import types

    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    for layer in model.model.layers:
        ex = layer.mlp.experts
        for k in ("gate_up_proj", "down_proj"):
            ex._parameters[k] = nn.Parameter(distribute_tensor(ex._parameters[k].data, ep_mesh, [Shard(0)]))
        ex.forward = types.MethodType(_ep_forward_trainable, ex)
        fully_shard(layer, reshard_after_forward=False, ignored_params=set(ex.parameters(recurse=False)))
    fully_shard(model)
    return model


def _full(sd):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def _train_then_quantize(rank, world, ckpt, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sq

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = _parallelize_framework_style(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(2, 400, (4, 32), generator=torch.Generator().manual_seed(100 + rank))  # data parallel
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    experts = model.model.layers[1].mlp.experts
    before = {"params": [experts._parameters[k] for k in ("gate_up_proj", "down_proj")],
              "forward": experts.__dict__["forward"]}
    trained = _full(model.state_dict())
    calib = torch.randint(2, 400, (8, 32), generator=torch.Generator().manual_seed(7))  # the same on every rank
    report = sq.quantize(model, out, algo="gptq", group_size=GS, calibration=calib,
                         tokenizer=AutoTokenizer.from_pretrained(ckpt))
    after = {"training": model.training,
             "same_params": all(a is b for a, b in zip(before["params"], (experts._parameters[k] for k in
                                                                             ("gate_up_proj", "down_proj")))),
             "same_forward": experts.__dict__["forward"] is before["forward"],
             "reshard_after_forward": [l._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                                       for l in model.model.layers]}
    quantized = _full(model.state_dict())
    model.eval()
    probe = torch.randint(2, 400, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        live_logits = model(input_ids=probe).logits.clone()
    model.train()
    loss = model(input_ids=ids, labels=ids).loss  # still trains: forward, backward, step
    loss.backward()
    opt.step()
    if rank == 0:  # tensors go through files: the harness's queue carries plain objects
        from safetensors.torch import save_file

        save_file(trained, f"{out}.trained.safetensors")
        save_file(quantized, f"{out}.quantized.safetensors")
        save_file({"ids": probe, "logits": live_logits}, f"{out}.logits.safetensors")
    dist.barrier()
    return {"losses": losses, "report": report, "after": after, "loss_after": loss.item()}


def test_train_fsdp2_ep_quantize_gptq_export_2_ranks(checkpoints, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    res = run_ranks(_train_then_quantize, 2, str(checkpoints["qwen3_moe"]), str(out), timeout=240)
    r0 = res[0]
    assert r0["losses"][-1] < r0["losses"][0], r0["losses"]  # it did train
    assert res[1]["report"] == {} and r0["report"]["world_size"] == 2
    assert r0["report"]["args"]["ep"] == 2  # discovered from the experts' DTensors
    assert r0["report"]["experts_rtn_fallback"] == 0
    for r in res:
        assert r["after"] == {"training": True, "same_params": True, "same_forward": True,
                              "reshard_after_forward": [False, False]}, r["after"]
        assert r["loss_after"] == r["loss_after"]  # finite: it trains on
    trained, quantized = (load_file(f"{out}.{k}.safetensors") for k in ("trained", "quantized"))
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
              "model.layers.1.mlp.experts.down_proj"):
        assert not torch.equal(trained[k], quantized[k]), k  # quantized in place

    names = set(read_tensors(out))
    assert "model.layers.0.mlp.experts.5.gate_proj.weight_packed" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale" in names
    assert not any("gate_up_proj" in n for n in names)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.gate" in qc["ignore"]

    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    live = load_file(f"{out}.logits.safetensors")
    with torch.no_grad():
        got = loaded.eval()(input_ids=live["ids"]).logits
    want = live["logits"]
    assert (got - want).norm() / want.norm() <= 1e-5  # measured 1.2e-7: the same float32 weights both sides


def _rtn_api_and_ptq(rank, world, ckpt, root):
    from pathlib import Path

    import torch.distributed as dist

    import sq
    from sq.config import PTQConfig
    from sq.pipeline.job import quantize_model

    from transformers import AutoModelForCausalLM, DistributedConfig

    for ep in (2, 1):
        model = sq.load_sharded(ckpt, ep=ep, dtype=torch.float32)
        sq.quantize(model, f"{root}/api-ep{ep}", algo="rtn", group_size=GS)
    # transformers' own FSDP2 loading: experts sharded on dim 0 with their layer over the whole world
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(fsdp_size=world))
    sq.quantize(model, f"{root}/api-transformers-fsdp", algo="rtn", group_size=GS)
    quantize_model(PTQConfig.build(model=ckpt, output=f"{root}/ptq", scheme="W4A16", algo="rtn", group_size=GS))
    # a recipe: experts at 8 bits, attention at 4 bits (group 16), layer 1's attention left out
    recipe = f"{root}/recipe.json"
    if rank == 0:
        Path(recipe).write_text(json.dumps({"default": {"preset": "W4A16", "group_size": GS}, "rules": [
            {"match": r"mlp\.experts", "scheme": {"preset": "W8A16", "group_size": GS}},
            {"match": r"layers\.1\.self_attn", "scheme": None}]}))
    dist.barrier()
    sq.quantize(sq.load_sharded(ckpt, ep=2, dtype=torch.float32), f"{root}/api-recipe", algo="rtn", recipe=recipe)
    quantize_model(PTQConfig.build(model=ckpt, output=f"{root}/ptq-recipe", algo="rtn", recipe=recipe))
    return True


def test_rtn_api_equals_ptq_bit_identical(checkpoints, tmp_path):
    run_ranks(_rtn_api_and_ptq, 2, str(checkpoints["qwen3_moe"]), str(tmp_path), timeout=240)
    for name in ("api-ep1", "api-transformers-fsdp"):
        assert _same_bits(tmp_path / name, tmp_path / "ptq") == [], name
    for api, ptq in (("api-ep2", "ptq"), ("api-recipe", "ptq-recipe")):
        assert _same_bits(tmp_path / api, tmp_path / ptq) == [], api
        qc = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in (api, ptq)]
        assert qc[0] == qc[1], api
    names = read_tensors(tmp_path / "api-recipe")
    assert names["model.layers.0.mlp.experts.3.up_proj.weight_packed"].shape[1] == 64 // 4  # 8 bits: 4 per int32
    assert "model.layers.1.self_attn.q_proj.weight" in names  # left out by the recipe


def _same_bits(a, b) -> list[str]:
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:5]
    return [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
            or not torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))]


def _refusals(rank, world, ckpt, root):
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers import AutoModelForCausalLM, DistributedConfig

    import sq
    from sq.errors import SqError

    def attempt(model, **kw):
        try:
            sq.quantize(model, f"{root}/never", group_size=GS, **{"algo": "rtn", **kw})
        except SqError as e:
            return str(e)
        return None

    def framework(placements_of, mesh_of):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for k in ("gate_up_proj", "down_proj"):
                ex._parameters[k] = nn.Parameter(distribute_tensor(ex._parameters[k].data, mesh_of(i),
                                                                   placements_of(i)), requires_grad=False)
            fully_shard(layer, ignored_params=set(ex.parameters(recurse=False)))
        fully_shard(model)
        return model

    msgs = {}
    # layer 0's experts split over ranks, layer 1's replicated over a mesh dimension of 2 ranks
    dp_ep = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))
    msgs["replicated"] = attempt(framework(lambda i: [Shard(1), Shard(0)] if i == 0 else [Replicate(), Shard(0)],
                                           lambda i: dp_ep))
    # a mesh of one rank each: every rank holds every expert, the mesh covers 1 of 2 ranks
    own = DeviceMesh("cpu", [rank], mesh_dim_names=("ep",))
    msgs["mesh"] = attempt(framework(lambda i: [Shard(0)], lambda i: own))
    msgs["signround"] = attempt(sq.load_sharded(ckpt, ep=2, dtype=torch.float32), algo="signround",
                               calibration=torch.randint(2, 400, (4, 16), generator=torch.Generator().manual_seed(0)))
    try:
        tf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                  distributed_config=DistributedConfig(fsdp_size=world, ep_size=world))
    except Exception as e:  # noqa: BLE001 - this transformers cannot load so on CPU: nothing to refuse
        msgs["transformers"] = f"unloadable: {type(e).__name__}: {e}"
    else:
        msgs["transformers"] = attempt(tf)
    return msgs


def test_unquantizable_layouts_refused_on_every_rank(checkpoints, tmp_path):
    msgs = run_ranks(_refusals, 2, str(checkpoints["qwen3_moe"]), str(tmp_path), timeout=240)
    for key in ("replicated", "mesh", "signround"):
        assert msgs[0][key] is not None and msgs[1][key] is not None, key
    m = msgs[0]["replicated"]
    assert "model.layers.1.mlp.experts.gate_up_proj" in m and "Replicate() over mesh dimension 'dp'" in m, m
    assert msgs[0]["replicated"] == msgs[1]["replicated"]
    m = msgs[0]["mesh"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in m and "covers 1 of the 2 ranks" in m, m
    assert "signround" in msgs[0]["signround"] and "--ep 1" in msgs[0]["signround"]
    t = msgs[0]["transformers"]
    assert t is not None and not t.startswith("unloadable"), t
    assert "Qwen3MoeForCausalLM was loaded by transformers' distributed loading with expert parallelism" in t, t
    assert "sq.ptq" in t and "sq.load_sharded" in t, t
    assert not (tmp_path / "never").exists()

"""AWQ in the pipeline: per block, activation-aware scales searched on every rank's tokens, folded
into this rank's shards, then the folded weights quantized (RTN, or GPTQ with ``--awq-gptq on``).
The maths and the mappings: ``sq.quant.awq``.

``observe`` does the whole AWQ step, before the pipeline's solve writes dequantized rows back:

1. one calibration forward with hooks on each mapping's parent module: ``sum |x|`` and the token
   count per input channel (all-reduced: every rank's tokens), and the parent's inputs (this
   rank's tokens) kept for the search;
2. with the block's FSDP2 units gathered (``sq.parallel.fsdp.unsharded``), per mapping and grid
   point: the balance weights replaced by ``Q(W * s) / s`` (whole weights, identical on every
   rank), the parent run on the kept inputs, the squared error against its full-precision
   output summed over every rank's tokens (all-reduced), so every rank picks the same scales;
   the weights are put back after each candidate;
3. back on the shards: each rank folds the chosen scales into its *local* rows only -- a norm's
   ``weight[rows] /= s[rows]``, a smoothing Linear's output rows ``/= s[rows]``, a balance
   Linear's (or fused experts', or router's) local rows ``*= s`` along the input dim.  Nothing is
   written to the gathered copies (FSDP2 would not copy it back);
4. the clip search (``--awq-clip``, on after RTN): each covered Linear's local rows clamped per
   quantization group to the range with the least output error, from the group Gram matrices the
   capture forward summed (all-reduced; ``sq.quant.awq.clip_search``).

The pipeline then solves the folded weights and writes every block tensor, the folded norms
included.  The next block is calibrated on this block's full-precision outputs (the capture
forward's, before any fold: AutoAWQ's and llm-compressor's chain with round-to-nearest) or, with
``--awq-gptq on`` or ``--awq-chain quantized``, on its quantized outputs (the pipeline's propagate
forward).  Folding is block-local and deterministic from the block inputs (the chain cache holds
whichever chain is propagated), so a resumed run is bit-identical.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sq.anatomy import EXPERT_PARAMS, decoder_blocks, experts_modules, partner_groups
from sq.errors import SqError
from sq.load.fill import local_box
from sq.parallel.fsdp import unsharded
from sq.formats import specs
from sq.quant import rtn
from sq.quant.activations import observes_activations
from sq.quant.algorithms.base import RTN_PASSES, Algorithm, register, rtn_cost
from sq.quant.rtn import rtn_rows
from sq.quant.work import BlockWork, Cost, Solved
from sq.quant.algorithms.gptq import GPTQAlgorithm
from sq.quant.experts import SlotStats
from sq.quant.awq import AWQConfig, Mapping, block_mappings, candidate_scales, clip_search, grid, weight_means
from sq.quant.forward import block_forward
from sq.quant.gptq import GPTQConfig
from sq.quant.recipe import scheme_tag

MAX_CLIP_GROUP = 256
AWQ_PARENT_FORWARDS = 1.7  # a grid point replays every mapping's parent: this many block forwards (fitted)



def _qdq(names: list[str], schemes: list, ws: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Round-to-nearest of whole weights (a candidate): fused partners (q/k/v, gate/up) share one
    global scale as the pipeline gives them; each expert of a fused ``[E, rows, in]`` its own."""
    out: list[torch.Tensor | None] = [None] * len(ws)
    idx = {n: i for i, n in enumerate(names)}
    for group in partner_groups([n for n, w in zip(names, ws) if w is not None]):
        ids = [idx[n] for n in group]
        sc = schemes[ids[0]]
        if not specs.required_reductions(sc):
            for i in ids:
                out[i] = rtn_rows(ws[i].reshape(-1, ws[i].shape[-1]), schemes[i]).deq.view(ws[i].shape)
            continue
        dense = [i for i in ids if ws[i].dim() == 2]
        stats = rtn.combine_stats([rtn.local_stats(ws[i], sc) for i in dense], sc) if dense else None
        for i in ids:
            if ws[i].dim() == 2:
                out[i] = rtn_rows(ws[i], schemes[i], stats if schemes[i] == sc else rtn.local_stats(ws[i], schemes[i])).deq
            else:
                out[i] = torch.stack([rtn_rows(e, schemes[i], rtn.local_stats(e, schemes[i])).deq for e in ws[i]])
    return out


def _restat(work: BlockWork) -> None:
    """The cross-row statistics of the folded weights (NVFP4's global absmax), as the pipeline's
    reduce stage computes them before any fold: dense ones all-reduced and shared by partners,
    experts' per local expert (``--ep 1``: a rank holds whole experts)."""
    rtn.reduce_linear_stats(work)
    for eprefix, ex, scheme in work.experts:
        for pname in EXPERT_PARAMS if specs.required_reductions(scheme) else ():
            p = ex._parameters[pname]
            local, _ = local_box(p)
            work.expert_stats[(eprefix, pname)] = [
                [SlotStats(0, p.shape[1], rtn.local_stats(local[i], scheme, rows=p.shape[1]))]
                for i in range(local.shape[0])]


class _Capture:
    """Pre-hooks on the mappings' parents: ``sum |x|`` per channel, token counts, the inputs; and on
    the Linears the clip search covers (``clip``: relative name -> pipeline Linear): each
    quantization group's input Gram matrix ``sum x_g x_g^T``."""

    def __init__(self, block: nn.Module, mappings: list[Mapping], device, clip: dict | None = None):
        self.on = True
        self.xsum, self.count, self.cache, self.handles = {}, {}, defaultdict(list), []
        self.grams: dict[str, torch.Tensor] = {}
        for name, lin in (clip or {}).items():
            gs = lin.scheme.group_size
            self.grams[name] = torch.zeros(lin.module.in_features // gs, gs, gs, dtype=torch.float64, device=device)
            self.handles.append(lin.module.register_forward_pre_hook(self._gram_hook(name)))
        for m in mappings:
            if not m.per_expert:  # the experts' intermediate activations are computed in the search
                width = balance_param(block, m.balance[0]).shape[-1]
                self.xsum[m.parent] = torch.zeros(width, dtype=torch.float64, device=device)
                self.count[m.parent] = torch.zeros(1, dtype=torch.float64, device=device)
            mod = block.get_submodule(m.parent)
            self.handles.append(mod.register_forward_pre_hook(self._hook(m.parent), with_kwargs=True))

    def _hook(self, name):
        def hook(module, args, kwargs):
            if not self.on:
                return
            self.cache[name].append((args, dict(kwargs)))
            if name not in self.xsum:
                return
            x = args[0] if args else kwargs["hidden_states"]
            a = x.detach().abs().reshape(-1, x.shape[-1])
            self.xsum[name] += a.sum(0, dtype=torch.float64)
            self.count[name] += a.shape[0]
        return hook

    def _gram_hook(self, name):
        def hook(module, args):
            if not self.on:
                return
            g = self.grams[name]
            x = args[0].detach().reshape(-1, g.shape[0], g.shape[1]).float().transpose(0, 1)  # [groups, tokens, G]
            g += torch.bmm(x.transpose(1, 2), x).double()
        return hook

    def reduce_grams(self) -> dict[str, torch.Tensor]:
        """The Gram matrices summed over every rank's tokens (one collective)."""
        if self.grams:
            names = list(self.grams)
            flat = torch.cat([self.grams[n].reshape(-1) for n in names])
            dist.all_reduce(flat)
            i = 0
            for n in names:
                k = self.grams[n].numel()
                self.grams[n] = flat[i:i + k].view_as(self.grams[n])
                i += k
        return self.grams

    def reduce(self) -> dict[str, torch.Tensor]:
        """x_mean per parent over every rank's tokens (one collective)."""
        names = list(self.xsum)
        flat = torch.cat([t for n in names for t in (self.xsum[n], self.count[n])])
        dist.all_reduce(flat)
        out, i = {}, 0
        for n in names:
            w = self.xsum[n].numel()
            out[n] = (flat[i:i + w] / flat[i + w]).float() if flat[i + w] > 0 else None
            i += w + 1
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def balance_param(block: nn.Module, name: str) -> torch.Tensor:
    """A balance target's weight: a Linear's ``weight`` or ``"<experts>:gate_up_proj"``."""
    mod_name, _, pname = name.partition(":")
    mod = block.get_submodule(mod_name)
    return mod._parameters[pname] if pname else mod.weight


def _run(parent: nn.Module, args, kwargs) -> torch.Tensor:
    y = parent(*args, **kwargs)
    return y[0] if isinstance(y, tuple) else y


def _scale_dim0(p: torch.Tensor, r: torch.Tensor, divide: bool) -> None:
    """This rank's local dim-0 rows of ``p`` divided (or multiplied) by ``r[rows]``."""
    local, off = local_box(p)
    f = r[off[0]:off[0] + local.shape[0]].view(-1, *([1] * (local.dim() - 1)))
    local.copy_((local.float() / f if divide else local.float() * f).to(local.dtype))


def _scale_cols(p: torch.Tensor, s: torch.Tensor) -> None:
    """This rank's local rows of ``p`` times ``s`` along the last (input) dim."""
    local, _ = local_box(p)
    local.copy_((local.float() * s).to(local.dtype))


def fold(block: nn.Module, m: Mapping, s: torch.Tensor) -> None:
    """Fold scales ``s`` into the local shards: exact in real arithmetic (fp outputs unchanged).
    A per-expert mapping's ``s [E, I]``: each local expert's up rows ``/= s[e]``, down ``*= s[e]``."""
    if m.per_expert:
        ex = block.get_submodule(m.parent)
        gu, off = local_box(ex._parameters["gate_up_proj"])
        down, _ = local_box(ex._parameters["down_proj"])
        se = s[off[0]:off[0] + gu.shape[0]].float()
        up = gu[:, gu.shape[1] // 2:]
        up.copy_((up.float() / se[:, :, None]).to(up.dtype))
        down.copy_((down.float() * se[:, None, :]).to(down.dtype))
        return
    smooth = block.get_submodule(m.smooth)
    _scale_dim0(smooth.weight, s, divide=True)
    if getattr(smooth, "bias", None) is not None:
        _scale_dim0(smooth.bias, s, divide=True)
    for b in [*m.balance, *m.extra]:
        _scale_cols(balance_param(block, b), s)


def _full(p: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):  # not expected under unsharded(): FSDP2 registers the gathered tensor
        raise SqError("--algo awq: a block parameter is still sharded during the scale search")
    return p


@register
class AWQAlgorithm(Algorithm):
    memory_knob = "AWQ holds every mapping's inputs for this rank's samples: fewer --nsamples, or more ranks"
    config_type = AWQConfig
    calibrated = True
    expert_parallel = False

    def __init__(self, config: AWQConfig):
        super().__init__(config)
        self.gptq = GPTQAlgorithm(GPTQConfig()) if config.awq_gptq else None
        self.sweeps = self.gptq is not None
        if self.gptq is not None:
            self.error_metric = self.gptq.error_metric

    def refusals(self, model, assigner, world: int, ep: int) -> list[str]:
        problems = self.ep_refusals(ep)
        if observes_activations(assigner):
            problems.append("--algo awq changes the activations static activation scales are calibrated on; "
                            "use a weight-only scheme (W4A16, NVFP4A16, ...) or --algo rtn/gptq")
        shared = defaultdict(list)
        for n, p in model.named_parameters(remove_duplicate=False):
            shared[id(p)].append(n)
        bad = set()
        for prefix, block in decoder_blocks(model):
            maps, refused = block_mappings(block)
            if refused:
                problems += [f"{prefix}: {r}" for r in refused]
                break
            ex_names = {n for n, _ in experts_modules(block)}
            for m in maps:
                folded = [balance_param(block, b) for b in m.balance + m.extra]
                if m.per_expert:
                    folded.append(block.get_submodule(m.parent)._parameters["gate_up_proj"])
                else:
                    folded.append(block.get_submodule(m.smooth).weight)
                for p in folded:
                    if len(shared[id(p)]) > 1:
                        problems.append(f"--algo awq would fold scales into {', '.join(shared[id(p)])}, one tensor "
                                        "tied to several modules (tied embeddings?); refusing a wrong fold")
                for b in m.balance:
                    mod = b.partition(":")[0]
                    s = assigner.assign(f"{prefix}.{mod}") if (mod in ex_names or ":" not in b) else None
                    if s is not None and not s.row_local:  # scales of a row from that row (NVFP4: global scale recomputed after the fold)
                        bad.add(f"{s.name} ({scheme_tag(s)})")
        problems += [f"--algo awq searches per-channel and per-group schemes (integer, FP8 per channel, NVFP4, "
                     f"MXFP4); scheme {b} has per-tensor or 2-D block scales, which it does not support (use "
                     "--algo rtn/gptq for it)"
                     for b in sorted(bad)]
        if self.gptq is not None:
            problems += self.gptq.refusals(model, assigner, world, ep)
        return sorted(set(problems), key=problems.index)

    def observe(self, work: BlockWork) -> None:
        if work.acts.kv:
            raise SqError("--algo awq changes the values the KV cache scales are calibrated on (v_proj is "
                          "smoothed); run it with --kv-cache none")
        maps, refused = block_mappings(work.block)
        if refused:
            raise SqError(refused)
        schemes = {l.name: l.scheme for l in work.linears}
        schemes.update({e: s for e, _, s in work.experts})
        clip = self._clip_targets(work) if self.config.clip else {}
        cap = _Capture(work.block, maps, work.device, clip)
        try:
            outs = block_forward(work.block, work.inputs, work.steps, work.dummy, counters=[cap])
        finally:
            cap.remove()
        if self.config.fp_chain:  # the unscaled full-precision block's outputs, as AutoAWQ propagates
            work.state["next_inputs"] = outs
        x_mean = cap.reduce()
        chosen, report = [], {}
        with unsharded(work.block):
            for m in maps:
                if m.per_expert:
                    res = self._search_experts(work, m, cap.cache[m.parent], schemes)
                else:
                    res = self._search(work, m, cap.cache[m.parent], x_mean[m.parent], schemes)
                if res is not None:
                    chosen.append((m, res[0]))
                    report[m.smooth] = res[1]
        cap.cache.clear()
        for m, s in chosen:
            fold(work.block, m, s)
        if clip:
            report["clip"] = self._clip(work, clip, cap.reduce_grams(), chosen)
        _restat(work)
        work.state["report"] = report
        if self.gptq is not None:
            self.gptq.observe(work)

    @staticmethod
    def _clip_targets(work: BlockWork) -> dict:
        """Dense Linears the clip search covers (relative name -> pipeline Linear): integer per-group
        schemes (groups up to ``MAX_CLIP_GROUP``: a group's Gram matrix is ``G x G``; per-channel
        scales would need ``in x in``) whose scales come from their rows alone; not attention's query / key
        producers (their error passes through the softmax, which a group's output error does not
        see; AutoAWQ skips them too), so of the attention only v_proj and o_proj."""
        out = {}
        for lin in work.linears:
            sc, rel = lin.scheme, lin.name[len(work.prefix) + 1:]
            if sc.type != "int" or sc.strategy != "group" or specs.required_reductions(sc):
                continue
            if ".self_attn." in f".{rel}" and not rel.endswith(("v_proj", "o_proj")):
                continue
            if sc.group_size <= MAX_CLIP_GROUP and lin.module.in_features % sc.group_size == 0:
                out[rel] = lin
        return out

    @staticmethod
    def _clip(work: BlockWork, targets: dict, grams: dict[str, torch.Tensor], chosen) -> dict:
        """Clip this rank's local rows of each target in place (after the fold: the Gram matrices of
        the inputs it scaled are divided by ``s_i s_j``); returns the report's summary."""
        col_scales = {}
        for m, s in chosen:
            if not m.per_expert:
                for b in m.balance:
                    if ":" not in b:
                        col_scales[b] = s
        clipped = total = 0
        for rel, lin in targets.items():
            g = grams[rel]
            if rel in col_scales:
                s = col_scales[rel].double().view(g.shape[0], g.shape[1])
                g = g / (s[:, :, None] * s[:, None, :])
            local, _ = local_box(lin.module.weight)
            if not local.numel():
                continue
            new, shrink = clip_search(local.detach(), g, lambda w, sc=lin.scheme: rtn_rows(w, sc).deq)
            local.copy_(new)
            clipped += int((shrink > 0).sum())
            total += shrink.numel()
        counts = torch.tensor([clipped, total], dtype=torch.float64, device=work.device)
        dist.all_reduce(counts)  # the fraction over every rank's rows
        return {"groups_clipped": float(counts[0] / counts[1]) if counts[1] else 0.0}

    def _search(self, work: BlockWork, m: Mapping, cache, x_mean, schemes):
        """The best scales of one mapping (the same on every rank), or None if it has nothing to search."""
        block = work.block
        targets = []
        for b in m.balance:
            mod = b.partition(":")[0]
            targets.append((_full(balance_param(block, b)), schemes.get(f"{work.prefix}.{mod}")))
        names = [b.partition(":")[0] for b in m.balance]
        if x_mean is None or all(sc is None for _, sc in targets):
            return None
        parent = block.get_submodule(m.parent)
        origs = [p.detach().clone() for p, _ in targets]
        wd = work.weight_dtype or origs[0].dtype
        fp_out = [_run(parent, a, k) for a, k in cache]
        w_mean = weight_means([(o.reshape(-1, o.shape[-1]), sc) for o, (_, sc) in zip(origs, targets)])
        best = None
        try:
            for ratio, duo in grid(self.config.n_grid, self.config.duo_scaling):
                s = candidate_scales(x_mean, w_mean, ratio, duo)
                # the candidate as the checkpoint would hold it (its dtype), quantized, then seen by the
                # forward in the dtype it computes in
                scaled = [(o.float() * s).to(wd) if sc is not None else None for (_, sc), o in zip(targets, origs)]
                for (p, _), deq in zip(targets, _qdq(names, [sc for _, sc in targets], scaled)):
                    if deq is not None:
                        p.data.copy_((deq.float() / s).to(p.dtype))
                err = torch.zeros(2, dtype=torch.float64, device=work.device)
                for (a, k), y in zip(cache, fp_out):
                    err[0] += (_run(parent, a, k).double() - y.double()).pow(2).sum()
                    err[1] += y.numel()
                dist.all_reduce(err)
                loss = float(err[0] / err[1]) if err[1] > 0 else 0.0
                if best is None:
                    first = loss
                if best is None or loss < best[0]:
                    best = (loss, ratio, duo, s)
        finally:
            for (p, _), o in zip(targets, origs):
                p.data.copy_(o)
        loss, ratio, duo, s = best
        return s, {"ratio": ratio, "duo": duo, "loss_rtn": first, "loss_best": loss}

    def _search_experts(self, work: BlockWork, m: Mapping, cache, schemes):
        """Every expert's up -> down scales: ``x_mean`` of its intermediate activations and its down
        projection's output error, each summed over every rank's tokens routed to it (one
        all-reduce of ``[E]`` losses per grid point); each expert takes its own best exponent."""
        ex = work.block.get_submodule(m.parent)
        scheme = schemes.get(f"{work.prefix}.{m.parent}")
        if scheme is None:
            return None
        gu, down = _full(ex._parameters["gate_up_proj"]).detach(), _full(ex._parameters["down_proj"])
        n_exp, _, inter = down.shape
        hs: list[list[torch.Tensor]] = [[] for _ in range(n_exp)]
        for args, kw in cache:  # the tokens this rank routed to each expert, through gate/up
            x = args[0] if args else kw["hidden_states"]
            idx = args[1] if len(args) > 1 else kw["top_k_index"]
            x = x.reshape(-1, x.shape[-1])
            for e in range(n_exp):
                tok = (idx == e).any(-1)
                if tok.any():
                    g, u = nn.functional.linear(x[tok], gu[e]).chunk(2, dim=-1)
                    hs[e].append(ex.act_fn(g) * u)
        stat = torch.zeros(n_exp, inter + 1, dtype=torch.float64, device=work.device)
        for e, h_e in enumerate(hs):
            for h in h_e:
                stat[e, :inter] += h.abs().sum(0, dtype=torch.float64)
                stat[e, inter] += h.shape[0]
        dist.all_reduce(stat)
        live = stat[:, inter] > 0
        x_mean = (stat[:, :inter] / stat[:, inter:].clamp(min=1)).float()
        orig = down.detach().clone()
        w_mean = [weight_means([(orig[e], scheme)]) for e in range(n_exp)]
        fp = [[h @ orig[e].T for h in h_e] for e, h_e in enumerate(hs)]
        best_loss = torch.full((n_exp,), float("inf"), dtype=torch.float64, device=work.device)
        best_s = torch.ones(n_exp, inter, device=work.device)
        ratios, first = [0.0] * n_exp, None
        for ratio, duo in grid(self.config.n_grid, self.config.duo_scaling):
            s = torch.stack([candidate_scales(x_mean[e], w_mean[e], ratio, duo) for e in range(n_exp)])
            w = (orig.float() * s[:, None, :]).to(work.weight_dtype or orig.dtype)
            wq = (_qdq(["experts"], [scheme], [w])[0].float() / s[:, None, :]).to(orig.dtype)
            err = torch.zeros(n_exp, 2, dtype=torch.float64, device=work.device)
            for e in range(n_exp):
                for h, y in zip(hs[e], fp[e]):
                    err[e, 0] += ((h @ wq[e].T).double() - y.double()).pow(2).sum()
                    err[e, 1] += y.numel()
            dist.all_reduce(err)
            loss = err[:, 0] / err[:, 1].clamp(min=1)
            first = loss.clone() if first is None else first
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best_s[better] = s[better]
            ratios = [ratio if b else r for r, b in zip(ratios, better.tolist())]
        n_live = max(int(live.sum()), 1)
        return best_s, {"experts_searched": int(live.sum()), "ratios": ratios,
                        "loss_rtn": float(first[live].sum()) / n_live,
                        "loss_best": float(best_loss[live].sum()) / n_live}

    def solve(self, work: BlockWork, linear, w: torch.Tensor) -> Solved:
        if self.gptq is not None:
            return self.gptq.solve(work, linear, w)
        return super().solve(work, linear, w)

    def solve_linears(self, work: BlockWork, items) -> list[Solved]:
        if self.gptq is not None:
            return self.gptq.solve_linears(work, items)
        return super().solve_linears(work, items)

    def solve_experts(self, work, eprefix, ex, pname, local, first, scheme) -> Iterable[Solved]:
        if self.gptq is not None:
            return self.gptq.solve_experts(work, eprefix, ex, pname, local, first, scheme)
        return super().solve_experts(work, eprefix, ex, pname, local, first, scheme)

    def memory(self, facts) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Held: the inputs of every mapping's parent for all of this rank's tokens (the search replays them
        through the parent, one buffer per calibration forward, as a forward would), the parent's
        full-precision outputs, and the search's copies of the widest mapping's balanced weights (whole,
        float32: the originals, the scaled candidate, its quantized values); GPTQ's own parts under
        --awq-gptq."""
        per = facts.step_tokens * facts.compute_bytes
        cache = [(per * n, facts.steps) for n, _ in facts.block.accumulators] + [(per * facts.hidden, facts.steps)]
        cache.append((4 * max((n * rows for n, rows in facts.block.accumulators), default=0), 3))
        held, solve = self.gptq.memory(facts) if self.gptq is not None else ([], [])
        return cache + held, solve

    def forward_memory(self, facts) -> list[tuple[int, int]]:
        """The search's error terms, one calibration step's parent output at a time: the replayed output, it and
        the full-precision one in float64, their difference (``_search``); GPTQ's own under --awq-gptq."""
        err = [(facts.step_tokens * facts.hidden * facts.compute_bytes, 1), (8 * facts.step_tokens * facts.hidden, 3)]
        return err + (self.gptq.forward_memory(facts) if self.gptq is not None else [])

    def cost(self, facts) -> dict[str, Cost]:
        """Calibrate: the capture forward, then per grid point every mapping's balanced weights quantized whole
        (every rank) and its parent replayed on this rank's tokens (about 1.7 forwards of the block, measured:
        attention, o_proj, the MLP, down_proj), its error in float64; solve: RTN's or GPTQ's; no propagate
        forward where the full-precision chain is carried (the capture forward's outputs are the next inputs)."""
        b, f = facts.block, facts.fwd
        out = self.gptq.cost(facts) if self.gptq is not None else {"solve": rtn_cost(facts)}
        if f is None:
            return out
        whole = sum(i * o for i, o in b.linears) + sum(n * 3 * h * i for n, h, i in b.experts_modules)
        per_point = f.routed * AWQ_PARENT_FORWARDS + Cost(mem=4 * RTN_PASSES * whole + 24 * facts.tokens * facts.hidden
                                                          * len(b.accumulators))
        out["calibrate"] = out.get("calibrate", f.calibrating) + per_point * self.config.n_grid
        if self.config.fp_chain:
            out["forward"] = Cost()
        return out

    def release(self, work: BlockWork) -> None:
        if self.gptq is not None:
            self.gptq.release(work)

    def next_inputs(self, work: BlockWork) -> list | None:
        return work.state.get("next_inputs")

    def fallback_experts(self, work: BlockWork) -> list[str]:
        return self.gptq.fallback_experts(work) if self.gptq is not None else []

    def block_report(self, work: BlockWork) -> dict | None:
        return work.state.get("report")

#!/usr/bin/env python3
"""Makes nextlm's golden checkpoints and reference logits with transformers' glm5_next (run on the H200 machine).

For each case: build a tiny random Glm5NextForConditionalGeneration, randomize every parameter and buffer (the
library's init leaves several at zero or one, which hides bugs), save it with save_pretrained in hub layout, edit
config.json where the case exercises a config form (flat fields, derived lists left out, index_topk_pattern,
linear_attn_config), reload it with from_pretrained, and record fp32 logits (CPU, eager attention) of every
sequence run alone. A case is rejected and re-seeded when any MoE router or DSA indexer choice sits within a
tolerance of a tie, because the reference breaks ties arbitrarily and a test must not depend on them.

Usage: python3 tests/golden/make_goldens.py OUT_DIR [CASE...]   (writes OUT_DIR/<case>/...)
The cases live in tests/golden/<case>, except tiny-glm5-next, the bundled example model, in examples/.
"""
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

SEQ_LENS = [1, 63, 64, 65, 150]
TIE_TOL = 1e-5  # choices closer than this (absolute, on O(1) scores) count as ties; fp32 paths differ by ~1e-7 there

BASE_TEXT = dict(
    vocab_size=256, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=40, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=24, qk_rope_head_dim=0,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
    swiglu_limit=1.0, rms_norm_eps=1e-5,
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
    index_n_heads=16, index_head_dim=16, index_topk=32, index_kpool=4, index_kpool_always_select_tail=True,
    pad_token_id=0, tie_word_embeddings=False,
)
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=48,
                   projection_intermediate_size=16)

# name -> (text overrides, storage dtype, max shard size or None, config.json edit)
CASES = {
    # bf16 with fp32 keep-tensors, sharded, nested config with the derived lists left out, safe gate, kpool 4 with
    # tail, grouped routing, a clamp that clips.
    "bf16_sharded": (dict(n_group=2, topk_group=1, norm_topk_prob=True), torch.bfloat16, "150KB", "derive"),
    # fp32, flat config with linear_attn_config (softplus gate), kpool 1, a shared-indexer layer, no top-k
    # normalisation, 7 Sinkhorn iterations, 3 streams.
    "fp32_flat_softplus": (dict(
        num_hidden_layers=5, linear_lower_bound=None, index_kpool=1, index_topk=32,
        layer_types=["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                     "linear_attention", "deepseek_sparse_attention"],
        indexer_types=["full", "full", "shared", "full", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
        norm_topk_prob=False, hc_sinkhorn_iters=7, hc_mult=3, n_group=1, topk_group=1), torch.float32, None,
        "flat"),
    # The bundled example model (examples/tiny-glm5-next): the real layer pattern (KKKD KKKD, only layer 0 dense),
    # kpool 4 with the tail, the real clamp and scaling, byte-level vocabulary, bf16 in one file.
    "tiny-glm5-next": (dict(
        num_hidden_layers=8, n_routed_experts=8, num_experts_per_tok=2, index_topk=64, swiglu_limit=10.0,
        mlp_layer_types=["dense"] + ["sparse"] * 7, n_group=1, topk_group=1), torch.bfloat16, None, "derive"),
    # fp32, kpool 4 without the tail (the first kpool-1 queries select nothing), index_topk_pattern, 4 groups.
    "fp32_tail_off": (dict(
        index_kpool=4, index_kpool_always_select_tail=False, index_topk=16,
        layer_types=["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                     "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["sparse", "sparse", "dense", "sparse"],
        n_group=4, topk_group=2, norm_topk_prob=True), torch.float32, None, "pattern"),
    # For the bf16 parity bound of the CUDA path: every discrete choice far from a tie, so that bf16 rounding cannot
    # flip one. The correction biases are spread 1.5 apart (sigmoid scores differ by less than 1, so the chosen
    # experts are fixed while their weights still come from the scores), and index_topk covers every pool of the
    # longest sequence, so the indexer selects all keys. Safe gate with head dim 16: the tensor-core KDA path.
    "bf16_stable": (dict(
        n_group=1, topk_group=1, index_topk=256, swiglu_limit=10.0,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]), torch.bfloat16, None, "derive"),
}
# Per-case tie tolerance where it differs from TIE_TOL, and the correction-bias spread of bias-dominated routing.
CASE_TIE_TOL = {"bf16_stable": 2e-2}
BIAS_SPREAD = {"bf16_stable": 1.5}

KEEP_FP32 = ("e_score_correction_bias", "conv1d", "dt_bias", "A_log")
# Cases that also get gradient goldens (kept to two so that the committed goldens stay small).
GRAD_CASES = ("bf16_sharded", "fp32_tail_off")
# Tensors the LM loss does not train: the indexer runs under no_grad in transformers, the correction bias is a buffer.
NOT_TRAINED = (".indexer.", "e_score_correction_bias", "model.visual.")


def gradient_golden(case_dir, ref, seqs, meta):
    """Writes golden_grads.safetensors: d/dθ of L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) (each sequence run alone)
    under the checkpoint's own tensor names, plus `loss` (F64 [1])."""
    ref.zero_grad(set_to_none=True)
    total = 0.0
    for ids in seqs:
        logits = ref(input_ids=ids[None]).logits[0].float()
        loss = -torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None]).sum()
        loss.backward()
        total += loss.item()
    # save_pretrained applies transformers' own reverse weight conversion (fused experts and convs back to the hub
    # layout), so the gradients are written in place of the parameters and saved through it.
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    tmp = os.path.join(case_dir, ".grads_tmp")
    ref.save_pretrained(tmp)
    grads = {}
    for f in os.listdir(tmp):
        if f.endswith(".safetensors"):
            grads.update({k: v.float().contiguous() for k, v in load_file(os.path.join(tmp, f)).items()
                          if not any(x in k for x in NOT_TRAINED)})
    shutil.rmtree(tmp)
    grads["loss"] = torch.tensor([total], dtype=torch.float64)
    save_file(grads, os.path.join(case_dir, "golden_grads.safetensors"), metadata=dict(meta, loss=repr(total)))


def randomize(model, gen):
    """Every parameter and buffer of the text model gets random values at scales that keep activations O(1)."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point():
            continue
        shape = p.shape
        if name.endswith(("layernorm.weight", "norm.weight", "o_norm.weight", "k_norm.weight")):
            v = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("k_norm.bias"):
            v = 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith(("A_log", "dt_bias")):
            v = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith(".base"):
            v = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith(".scale"):
            v = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            v = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("index_kpool_compress_ape"):
            v = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            v = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=gen)
        elif len(shape) >= 2:
            v = torch.randn(shape, generator=gen) / (shape[-1] ** 0.5)
        else:
            v = 0.5 * torch.randn(shape, generator=gen)
        with torch.no_grad():
            p.copy_(v.to(p.dtype))


def tie_margins(model):
    """Registers hooks that record, for every router and indexer call, the smallest gap at a selection boundary."""
    gaps = []
    text = model.model.language_model

    def router_hook(mod, args, out):
        x = args[0].reshape(-1, mod.hidden_dim).float()
        scores = torch.sigmoid(x @ mod.weight.float().t())
        c = scores + mod.e_score_correction_bias.float()
        E, G = mod.num_experts, mod.num_group
        if G > mod.topk_group:
            gs = c.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True)[0]
            gaps.append(("router-group", (gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]).min().item()))
            keep = torch.zeros_like(c, dtype=torch.bool).view(-1, G, E // G)
            top = c.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1).topk(mod.topk_group, dim=-1)[1]
            keep.scatter_(1, top[..., None].expand(-1, -1, E // G), True)
            c = c.masked_fill(~keep.view(-1, E), float("-inf"))
        s = c.sort(dim=-1, descending=True)[0]
        gaps.append(("router", (s[:, mod.top_k - 1] - s[:, mod.top_k]).min().item()))

    def indexer_hook(mod, args, kwargs, out):
        x = kwargs["hidden_states"][0].float()
        qr = kwargs["q_resid"][0].float()
        T = x.shape[0]
        P = mod.index_kpool
        q = (qr @ mod.wq_b.weight.float().t()).view(T, mod.n_heads, mod.head_dim)
        k = torch.nn.functional.layer_norm(x @ mod.wk.weight.float().t(), (mod.head_dim,),
                                           mod.k_norm.weight.float(), mod.k_norm.bias.float(), 1e-6)
        g = x @ mod.index_kpool_compress_gate.float().t()
        npool = T // P
        if npool == 0:
            return
        kk = k[: npool * P].view(npool, P, -1)
        gg = g[: npool * P].view(npool, P, -1) + mod.index_kpool_compress_ape.float()[None]
        pk = (gg.softmax(dim=1) * kk).sum(1)
        sc = torch.relu(torch.einsum("thd,jd->thj", q, pk) * mod.softmax_scale)
        w = (x @ mod.weights_proj.weight.float().t()) * mod.n_heads ** -0.5
        idx = torch.einsum("th,thj->tj", w, sc)
        kk_sel = mod.index_topk // P
        for t in range(T):
            nvalid = (t + 1) // P
            if nvalid > kk_sel:
                s = idx[t, :nvalid].sort(descending=True)[0]
                gaps.append(("indexer", (s[kk_sel - 1] - s[kk_sel]).item()))
        # The hook's own selection must agree with the reference's (checks this script's reading of the spec).
        ref = out[0]
        for t in range(T):
            nvalid = (t + 1) // P
            chosen = sorted({int(i) // P for i in ref[t].tolist() if i >= 0 and int(i) < ((t + 1) // P) * P})
            mine = sorted(idx[t, :nvalid].topk(min(kk_sel, nvalid)).indices.tolist()) if nvalid else []
            if chosen != mine:
                gaps.append(("indexer-mismatch", -1.0))
                break

    hooks = []
    for layer in text.layers:
        mlp = layer.mlp
        if hasattr(mlp, "gate"):
            hooks.append(mlp.gate.register_forward_hook(router_hook))
        attn = layer.self_attn
        if getattr(attn, "indexer", None) is not None:
            hooks.append(attn.indexer.register_forward_hook(indexer_hook, with_kwargs=True))
    return gaps, hooks


def edit_config(name, path, how, text_kwargs):
    cfg = json.load(open(path))
    text = cfg["text_config"]
    if how == "derive":
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            if key not in CASES[name][0]:
                text.pop(key, None)
    elif how == "flat":
        for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound"):
            text.pop(key, None)
        text["linear_attn_config"] = {"head_dim": text_kwargs["linear_head_dim"],
                                      "num_heads": text_kwargs["linear_num_heads"],
                                      "short_conv_kernel_size": text_kwargs["linear_conv_kernel_dim"],
                                      "gate_lower_bound": None, "safe_gate": False}
        del cfg["text_config"]
        text.pop("model_type", None)
        for key, value in text.items():
            cfg.setdefault(key, value)
    elif how == "pattern":
        text.pop("indexer_types", None)
        text["index_topk_pattern"] = "FFSF"
    json.dump(cfg, open(path, "w"), indent=2, sort_keys=True)


def make_case(name, out_dir):
    overrides, dtype, shard, how = CASES[name]
    text_kwargs = dict(BASE_TEXT, **overrides)
    for seed in range(1, 120):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        vision = dict(TINY_VISION, out_hidden_size=text_kwargs["hidden_size"])
        config = Glm5NextConfig(text_config=text_kwargs, vision_config=vision)
        model = Glm5NextForConditionalGeneration(config).float().eval()
        randomize(model, gen)
        if name in BIAS_SPREAD:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n.endswith("e_score_correction_bias"):
                        order = torch.randperm(b.numel(), generator=gen)
                        b.copy_((-BIAS_SPREAD[name] * order.float()).to(b.dtype))
        case_dir = os.path.join(out_dir, name)
        shutil.rmtree(case_dir, ignore_errors=True)
        if dtype == torch.bfloat16:
            keep = {n: p.detach().clone() for n, p in model.named_parameters() if any(k in n for k in KEEP_FP32)}
            keep.update({n: b.detach().clone() for n, b in model.named_buffers() if any(k in n for k in KEEP_FP32)})
            model = model.to(torch.bfloat16)
            for n, v in keep.items():
                mod = model.get_submodule(n.rsplit(".", 1)[0])
                leaf = n.rsplit(".", 1)[1]
                if isinstance(getattr(mod, leaf), torch.nn.Parameter):
                    setattr(mod, leaf, torch.nn.Parameter(v))
                else:
                    mod.register_buffer(leaf, v)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(case_dir, **kwargs)
        edit_config(name, os.path.join(case_dir, "config.json"), how, text_kwargs)

        ref, info = Glm5NextForConditionalGeneration.from_pretrained(
            case_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        ref.eval()
        assert not info["missing_keys"], info
        gaps, hooks = tie_margins(ref)
        gen_tok = torch.Generator().manual_seed(1000 + seed)
        tensors = {}
        with torch.no_grad():
            for i, T in enumerate(SEQ_LENS):
                ids = torch.randint(0, text_kwargs["vocab_size"], (T,), generator=gen_tok)
                logits = ref(input_ids=ids[None]).logits[0].float()
                assert torch.isfinite(logits).all()
                tensors[f"tokens.{i}"] = ids.to(torch.int64)
                tensors[f"logits.{i}"] = logits.contiguous()
        for h in hooks:
            h.remove()
        worst = min((g for _, g in gaps), default=1.0)
        kinds = sorted({k for k, g in gaps if g < CASE_TIE_TOL.get(name, TIE_TOL)})
        if worst < CASE_TIE_TOL.get(name, TIE_TOL):
            print(f"{name}: seed {seed} rejected, near-ties in {kinds} (smallest gap {worst:.2e})", flush=True)
            continue
        meta = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": str(seed),
                "case": name, "smallest_choice_gap": f"{worst:.3e}", "seq_lens": json.dumps(SEQ_LENS)}
        save_file(tensors, os.path.join(case_dir, "golden.safetensors"), metadata=meta)
        if name in GRAD_CASES:
            gradient_golden(case_dir, ref, [tensors[f"tokens.{i}"] for i in range(len(SEQ_LENS))], meta)
        names = sorted(k for f in os.listdir(case_dir) if f.endswith(".safetensors") and not f.startswith("golden")
                       for k in load_file(os.path.join(case_dir, f)).keys())
        with open(os.path.join(case_dir, "tensor_names.txt"), "w") as fh:
            fh.write("\n".join(names) + "\n")
        print(f"{name}: seed {seed}, smallest choice gap {worst:.3e}, {len(names)} tensors", flush=True)
        return
    raise SystemExit(f"{name}: no seed without near-ties")


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for name in sys.argv[2:] or CASES:
        make_case(name, out_dir)
    with open(os.path.join(out_dir, "VERSIONS"), "w") as fh:
        fh.write(f"transformers {transformers.__version__}\ntorch {torch.__version__}\n")


if __name__ == "__main__":
    main()

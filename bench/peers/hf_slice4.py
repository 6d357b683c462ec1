#!/usr/bin/env python3
"""The 4-layer full-width slice (bench/slice4/config.json) in transformers 5.17.0 on the H200: the peer timing of
slice4_prefill_T4096 and the reference side of the parity check (issue 3, item 4). bench/run_slice4_parity.sh runs it.

  hf_slice4.py prepare WORK [--config bench/slice4/config.json]
      1. builds Glm5NextForConditionalGeneration from the config on the GPU in bf16 (a tiny vision tower, as the
         goldens), with random weights at realistic scales: transformers' own _init_weights (normal(0, 0.02)
         linears, embedding and experts, norms 1, mHC fn normal(0, 0.02) / base 0 / scale 1, FLA's A_log and
         dt_bias), with the fp32 keep-tensors (conv, dt_bias, A_log, correction bias) drawn in fp32, the convs with
         nn.Conv1d's U(±1/√W), a small random correction bias (so that its fp32 handling matters) and the indexer's
         compress gate normal(0, 0.02) instead of the library's all-ones (which makes every pool an argmax);
      2. saves it with save_pretrained to WORK/model (bf16 + fp32 keep-tensors, sharded hub layout, ~44 GB);
      3. times transformers' bf16 prefill of one 4096-token sequence including the lm_head (sdpa, the library's
         default experts backend, fla's chunk_kda when fla is importable), CUDA events, median after warm-up;
      4. computes the next-token log-softmax of every position of the parity sequences (one of 4096 tokens; a packed
         batch of 5 sequences, 4096 tokens, each run alone as the reference defines a packed batch) in bf16, then
         upcasts the same model in place to fp32 (exact) and computes them again in fp32 with the reference PyTorch
         paths (the torch chunked KDA and the eager experts loop; TF32 off);
      5. writes WORK/ref_logp.safetensors (tokens.i I64 [T_i], logp.i F32 [T_i, V]: the fp32 log-softmax, ~5 GB;
         metadata "batches") for `nextlm_bench parity`, and WORK/hf_results.json (peer time, KL(HF fp32 ‖ HF bf16)
         and HF bf16's argmax agreement per batch).
  hf_slice4.py report WORK NEXTLM_PARITY.json [SLICE4_BENCH.jsonl]
      prints the four numbers of the issue per batch and overall and whether nextlm passes:
      KL(HF fp32 ‖ nextlm bf16) ≤ 1.2 · KL(HF fp32 ‖ HF bf16) and argmax agreement(nextlm) ≥ agreement(HF
      bf16).
      Exit status 0 on a pass, 1 on a fail. With the bench output it also prints the h200.json entry of
      slice4_prefill_T4096 beside the peer.
"""
import gc
import json
import math
import os
import sys
import time

SEQ_LENS = {"T4096": [4096], "packed": [1300, 547, 1024, 963, 262]}
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, projection_intermediate_size=16)
KL_FACTOR = 1.2


def log(msg):
    print(f"[hf_slice4 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_ms(fn, warmup, iters):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2], ts


def closure_var(fn, name):
    """A free variable of a decorator's wrapper (transformers' hub-kernel fallback keeps `is_new_implementation`
    there; the wrapper's own attributes are copied from the torch function and say nothing)."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return None
    for var, cell in zip(code.co_freevars, fn.__closure__):
        if var == name:
            return cell.cell_contents
    return None


def build_model(cfg_path):
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    cfg = json.load(open(cfg_path))
    text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    config = Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=cfg.get("tie_word_embeddings",
                                                                                               False))
    torch.manual_seed(1234)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Glm5NextForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    tc = config.text_config
    check_init(model, tc.initializer_range)

    gen = torch.Generator(device="cuda").manual_seed(4321)
    W = tc.linear_conv_kernel_dim
    n_keep = 0
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith("model.language_model."):
                continue
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            leaf = name.rsplit(".", 1)[1]
            v = None
            if "conv1d" in name:
                bound = 1.0 / math.sqrt(W)
                v = (torch.rand(p.shape, generator=gen, device="cuda", dtype=torch.float32) * 2 - 1) * bound
            elif name.endswith("dt_bias"):
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = (lo + (hi - lo) * torch.rand(p.shape, generator=gen, device="cuda", dtype=torch.float32)).exp()
                dt = dt.clamp_min(1e-4)
                v = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("A_log"):
                if tc.linear_lower_bound is not None:
                    v = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
                else:
                    v = (1 + 15 * torch.rand(p.shape, generator=gen, device="cuda", dtype=torch.float32)).log()
            elif name.endswith("e_score_correction_bias"):
                v = 0.01 * torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32)
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(tc.initializer_range * torch.randn(p.shape, generator=gen, device="cuda",
                                                           dtype=torch.float32))
                continue
            if v is None:
                continue
            n_keep += 1
            # The keep-tensors live in fp32, as from_pretrained keeps them (_keep_in_fp32_modules_strict).
            if isinstance(getattr(mod, leaf), torch.nn.Parameter):
                setattr(mod, leaf, torch.nn.Parameter(v, requires_grad=False))
            else:
                mod.register_buffer(leaf, v)
    n = sum(p.numel() for p in model.parameters())
    log(f"built on the GPU: {n / 1e9:.2f}B parameters, {n_keep} fp32 keep-tensors, "
        f"{torch.cuda.memory_allocated() / 1e9:.1f} GB allocated")
    return model, config


def check_init(model, std):
    """transformers' _init_weights ran (weights at normal(0, initializer_range), norms 1); if this version left the
    parameters uninitialised, initialise them here with the same distributions."""
    import torch
    bad = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (conv weights and the indexer's compress gate / ape have other inits, and are drawn below anyway)
            if name.startswith("model.language_model.") and p.dim() >= 2 and "conv1d" not in name \
                    and "index_kpool_compress" not in name:
                sample = p.reshape(-1)[:1 << 20].float()  # the first 1M values are enough for a std
                got = sample.std().item()
                if not (0.5 * std < got < 2 * std and torch.isfinite(sample).all().item()):
                    bad.append(f"{name} std {got:.3g}")
    if not bad:
        log(f"transformers init: every text matrix has std within 2x of initializer_range {std}")
        return
    log(f"{len(bad)} matrices not at init scale after construction (e.g. {bad[:3]}): initialising every "
        "parameter here")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif name.endswith((".bias", "_base", ".base", "index_kpool_compress_ape")):
                p.zero_()
            else:  # norm weights, mHC scales
                p.fill_(1.0)


def set_backends(model):
    """sdpa attention and the library's grouped_mm experts for the bf16 peer, where this version offers them."""
    info = {}
    for what, impl in (("attn", "sdpa"), ("experts", "grouped_mm")):
        setter = getattr(model, f"set_{what}_implementation", None)
        tcfg = model.config.text_config
        try:
            if setter is not None:
                setter(impl)
            else:
                setattr(tcfg, f"_{what}_implementation", impl)
        except Exception as e:  # noqa: BLE001 - report and go on with the library default
            log(f"setting the {what} implementation to {impl!r} failed: {e}")
        info[what] = getattr(tcfg, f"_{what}_implementation", None) or getattr(model.config,
                                                                                 f"_{what}_implementation", None)
    import transformers.models.glm5_next.modeling_glm5_next as m
    info["kda"] = "fla" if closure_var(m.chunk_kimi_delta_attention, "is_new_implementation") else "torch"
    return info


def use_reference_paths(model):
    """The fp32 reference: the torch chunked KDA and conv (not fla's Triton kernels, which may round through tf32 or
    bf16) and transformers' eager experts loop, whatever backends are installed."""
    import torch
    import torch.nn.functional as F
    import transformers.models.glm5_next.modeling_glm5_next as m

    for fname in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                  "causal_conv1d_update"):
        f = getattr(m, fname)
        setattr(m, fname, getattr(f, "__wrapped__", f))
    chunk_ref = m.chunk_kimi_delta_attention

    # The torch chunked form holds a [H, T/64, 64, 64, K] fp32 decay tensor and two temporaries of its size (~26 GB
    # at T=4096, H=64, K=128) beside the 88 GB of fp32 weights; heads are independent, so run them 16 at a time.
    def chunk_by_heads(query, key, value, g, beta, initial_state=None, output_final_state=False, **kw):
        if initial_state is not None or output_final_state:
            return chunk_ref(query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, **kw)
        step = 16
        outs = [chunk_ref(query[:, :, h:h + step], key[:, :, h:h + step], value[:, :, h:h + step],
                          g=g[:, :, h:h + step], beta=beta[:, :, h:h + step], **kw)[0]
                for h in range(0, query.shape[2], step)]
        return torch.cat(outs, dim=2), None

    m.chunk_kimi_delta_attention = chunk_by_heads

    def eager_experts(self, hidden_states, top_k_index, top_k_weights):  # Glm5NextTextExperts' own loop
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
            current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final

    m.Glm5NextTextExperts.forward = eager_experts
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def log_softmax_rows(model, ids):
    import torch
    with torch.inference_mode():
        logits = model(input_ids=ids[None].cuda(), use_cache=False).logits[0]
        out = torch.log_softmax(logits.float(), dim=-1)
        assert torch.isfinite(out).all(), "non-finite log-softmax"
        return out


def kl_rows(p, q, chunk=512):
    """KL(p ‖ q) per row of two log-softmax matrices (GPU, in float64)."""
    import torch
    out = []
    for r in range(0, p.shape[0], chunk):
        a = p[r:r + chunk].double()
        b = q[r:r + chunk].to(a.device).double()
        out.append((a.exp() * (a - b)).sum(-1))
    return torch.cat(out)


def prepare(work, cfg_path):
    import torch
    from safetensors.torch import save_file

    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "model")
    t_start = time.time()
    model, config = build_model(cfg_path)
    V = config.text_config.vocab_size

    t0 = time.time()
    model.save_pretrained(model_dir, max_shard_size="5GB")
    shards = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in shards)
    log(f"saved {model_dir}: {len(shards)} shards, {size / 1e9:.1f} GB in {time.time() - t0:.0f} s")

    backends = set_backends(model)
    log(f"bf16 backends: {backends}")
    gen = torch.Generator().manual_seed(2026)
    bench_ids = torch.randint(0, V, (1, 4096), generator=gen).cuda()

    def prefill():
        with torch.inference_mode():
            return model(input_ids=bench_ids, use_cache=False).logits

    t0 = time.time()
    peer_ms, peer_all = median_ms(prefill, warmup=3, iters=10)
    log(f"peer: transformers bf16 prefill T=4096 incl. lm_head: median {peer_ms:.2f} ms "
        f"(min {peer_all[0]:.2f}, max {peer_all[-1]:.2f}; {time.time() - t0:.0f} s with warm-up)")

    seqs, batches = [], []
    for name, lens in SEQ_LENS.items():
        idx = []
        for L in lens:
            idx.append(len(seqs))
            seqs.append(torch.randint(0, V, (L,), generator=gen))
        batches.append({"name": name, "seqs": idx})

    bf16_logp = [log_softmax_rows(model, s).cpu() for s in seqs]
    log("bf16 log-softmax done")

    # The same weights in fp32: bf16 → fp32 is exact, and the keep-tensors are fp32 already.
    gc.collect()
    torch.cuda.empty_cache()
    model.float()
    gc.collect()
    torch.cuda.empty_cache()
    use_reference_paths(model)
    log(f"upcast to fp32: {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated")

    ref = {}
    results = {"peer_ms": round(peer_ms, 3), "peer_ms_all": [round(x, 3) for x in peer_all],
               "peer": "transformers 5.17.0 bf16 (" + ", ".join(f"{k} {v}" for k, v in backends.items()) + ")",
               "torch": torch.__version__, "batches": []}
    import transformers
    results["transformers"] = transformers.__version__
    per_seq = []
    for i, s in enumerate(seqs):
        p32 = log_softmax_rows(model, s)
        p16 = bf16_logp[i]
        kl = kl_rows(p32, p16)
        agree = (p32.argmax(-1).cpu() == p16.argmax(-1)).double()
        tgt = s[1:, None]
        dlp = (p32[:-1].gather(1, tgt.cuda()).cpu() - p16[:-1].gather(1, tgt)).abs().double()
        per_seq.append((kl.cpu(), agree, dlp))
        ref[f"tokens.{i}"] = s.to(torch.int64).contiguous()
        ref[f"logp.{i}"] = p32.cpu().contiguous()
        del p32
        torch.cuda.empty_cache()
        log(f"seq {i} (T={len(s)}): KL(HF fp32 || HF bf16) mean {kl.mean().item():.4e}, "
            f"argmax agreement {agree.mean().item():.4f}")
    for b in batches:
        kl = torch.cat([per_seq[i][0] for i in b["seqs"]])
        agree = torch.cat([per_seq[i][1] for i in b["seqs"]])
        dlp = torch.cat([per_seq[i][2].flatten() for i in b["seqs"]])
        results["batches"].append({"name": b["name"], "tokens": int(kl.numel()), "kl_mean": kl.mean().item(),
                                   "kl_max": kl.max().item(), "argmax_agree": agree.mean().item(),
                                   "mean_abs_dlogprob": dlp.mean().item()})
    kl = torch.cat([x[0] for x in per_seq])
    agree = torch.cat([x[1] for x in per_seq])
    results["all"] = {"tokens": int(kl.numel()), "kl_mean": kl.mean().item(), "argmax_agree": agree.mean().item()}
    model = None  # (the prefill closure shares this variable: the weights go now)
    gc.collect()
    torch.cuda.empty_cache()

    t0 = time.time()
    save_file(ref, os.path.join(work, "ref_logp.safetensors"), metadata={"batches": json.dumps(batches)})
    log(f"wrote the fp32 reference ({sum(v.numel() * v.element_size() for v in ref.values()) / 1e9:.1f} GB) "
        f"in {time.time() - t0:.0f} s")
    with open(os.path.join(work, "hf_results.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    print(json.dumps({"case": "slice4_prefill_T4096", "peer": results["peer"], "peer_ms": results["peer_ms"]}),
          flush=True)
    log(f"prepare done in {time.time() - t_start:.0f} s")


def report(work, nextlm_json, bench_jsonl=None):
    hf = json.load(open(os.path.join(work, "hf_results.json")))
    ours = json.load(open(nextlm_json))
    ours_b = {b["name"]: b for b in ours["batches"]}
    rows, ok = [], True
    for b in hf["batches"] + [dict(hf["all"], name="all")]:
        o = ours["all"] if b["name"] == "all" else ours_b[b["name"]]
        kl_ours, kl_hf = o["kl_mean"], b["kl_mean"]
        ag_ours, ag_hf = o["argmax_agree"], b["argmax_agree"]
        passed = kl_ours <= KL_FACTOR * kl_hf and ag_ours >= ag_hf and math.isfinite(kl_ours)
        ok = ok and passed
        rows.append({"batch": b["name"], "tokens": b["tokens"], "kl_hf32_nextlm_bf16": kl_ours,
                     "kl_hf32_hf_bf16": kl_hf, "kl_ratio": kl_ours / kl_hf if kl_hf > 0 else float("inf"),
                     "argmax_agree_nextlm_bf16": ag_ours, "argmax_agree_hf_bf16": ag_hf,
                     "pass": passed})
    for r in rows:
        print(f"{r['batch']:>7} ({r['tokens']} tokens): KL(HF fp32 || nextlm bf16) = {r['kl_hf32_nextlm_bf16']:.4e}  "
              f"KL(HF fp32 || HF bf16) = {r['kl_hf32_hf_bf16']:.4e}  ratio {r['kl_ratio']:.3f} (<= {KL_FACTOR})  "
              f"argmax agreement nextlm {r['argmax_agree_nextlm_bf16']:.4f} vs HF bf16 "
              f"{r['argmax_agree_hf_bf16']:.4f}  {'PASS' if r['pass'] else 'FAIL'}")
    summary = {"parity": rows, "pass": ok, "peer": hf["peer"], "peer_ms": hf["peer_ms"],
               "nextlm_load_s": ours.get("load_s")}
    print(json.dumps(summary), flush=True)
    if bench_jsonl and os.path.exists(bench_jsonl):
        # The results entry (bench/results/h200.json) of the case, with the peer measured in the same run.
        for line in open(bench_jsonl):
            try:
                c = json.loads(line)
            except json.JSONDecodeError:
                continue
            if c.get("case") == "slice4_prefill_T4096":
                entry = {"case": c["case"], "ours_ms": c["ours_ms"], "peer": hf["peer"], "peer_ms": hf["peer_ms"],
                         "floor_ms": c["floor_ms"], "target_ms": c.get("target_ms"),
                         "date": time.strftime("%Y-%m-%d"), "note": c.get("note", "")}
                print("h200.json entry:", json.dumps(entry), flush=True)
    return 0 if ok else 1


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "prepare":
        cfg = sys.argv[sys.argv.index("--config") + 1] if "--config" in sys.argv else \
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "slice4", "config.json")
        prepare(sys.argv[2], cfg)
        return 0
    if len(sys.argv) in (4, 5) and sys.argv[1] == "report":
        return report(*sys.argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

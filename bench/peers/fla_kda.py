#!/usr/bin/env python3
"""Peer timing: fla's chunk_kda (Triton) forward on the same shapes as nextlm's kda_fwd cases, with the safe gate
computed in the kernel (use_gate_in_kernel, lower_bound -5) and the q/k L2 norm in the kernel, bf16 inputs; and its
backward on the shape of kda_bwd_T4096_H64 (the delta rule alone, as nextlm's case times it: the log-decay g given,
no gate or L2 norm in the kernel). Needs fla's source on PYTHONPATH (a folder git ignores). Prints one JSON line per
case."""
import json
import sys

import torch
from fla.ops.kda import chunk_kda


def median_ms(fn, iters):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def case(name, lens, iters):
    H, K = 64, 128
    T = sum(lens)
    dev = "cuda"
    q = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
    g = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
    beta = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16).sigmoid()
    A_log = torch.randn(H, device=dev, dtype=torch.float32) * 0.5
    dt_bias = torch.randn(H * K, device=dev, dtype=torch.float32) * 0.5
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=dev, dtype=torch.long) \
        if len(lens) > 1 else None

    def run():
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

    with torch.no_grad():
        ms = median_ms(run, iters)
    print(json.dumps({"case": name, "peer": "fla chunk_kda", "peer_ms": round(ms, 4)}), flush=True)


def backward_case(name, T, iters):
    """fla's chunk_kda backward alone: the forward runs once, then out.backward(dO) is timed (retain_graph)."""
    H, K = 64, 128
    dev = "cuda"
    torch.manual_seed(0)
    mk = lambda: torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16).requires_grad_()
    q, k, v = mk(), mk(), mk()
    # log-decays in (-5, 0), as the lower-bounded gate gives them; unit-norm q and k as the L2 norm gives them
    g = (-5 * torch.rand(1, T, H, K, device=dev)).to(torch.bfloat16).requires_grad_()
    with torch.no_grad():
        q.copy_(torch.nn.functional.normalize(q.float(), dim=-1))
        k.copy_(torch.nn.functional.normalize(k.float(), dim=-1))
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16).requires_grad_()
    o = chunk_kda(q, k, v, g, beta)
    o = o[0] if isinstance(o, tuple) else o
    do = torch.randn_like(o)

    def run():
        o.backward(do, retain_graph=True)

    ms = median_ms(run, iters)
    print(json.dumps({"case": name, "peer": "fla chunk_kda backward", "peer_ms": round(ms, 4)}), flush=True)


if __name__ == "__main__":
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, lens, iters in [("kda_fwd_T8192_H64", [8192], 20),
                              ("kda_fwd_varlen", [1300, 547, 2048, 963, 271, 3063], 20),
                              ("kda_fwd_T32768_H64", [32768], 5)]:
        if not only or only == name:
            case(name, lens, iters)
    if not only or only == "kda_bwd_T4096_H64":
        backward_case("kda_bwd_T4096_H64", 4096, 20)

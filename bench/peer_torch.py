#!/usr/bin/env python3
"""peer_torch.py - the PyTorch peer of `kiln bench --device cuda`.

Runs the workloads of docs' ANCHORS memory-bound table and the SwiGLU
FeedForward in PyTorch eager and torch.compile, timing each with CUDA events
(median over repetitions of a timed loop, after warm-up), and prints one JSON
object per line, in the field names `kiln bench --json` uses:

  {"peer": "torch", "workload": "relu_fma", "size": "4096x4096", "dtype": "f16",
   "device": "cuda", "mode": "eager", "ms": 0.072, "gbps": 2796.2, ...}

Memory-bound rows carry gbps (each input read once, each output written
once); compute-bound rows carry tflops. Compiled rows also carry
first_call_s: the wall time of the first call in this process (compile
included). --quick shrinks every size (a smoke test, not a measurement).
"""
import argparse
import json
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    p.add_argument("--modes", default="eager,default",
                   help="comma list of eager, default, reduce-overhead, max-autotune, "
                        "max-autotune-no-cudagraphs (default: eager,default)")
    p.add_argument("--workload", action="append", default=[],
                   help="run only these workloads (repeatable)")
    p.add_argument("--reps", type=int, default=0, help="timed repetitions (median taken)")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    return p.parse_args()


def workloads(torch, quick):
    """(name, size string, dtype name, make_inputs, fn, cost) per workload.

    cost(inputs) -> (bytes, flops, memory_bound)."""
    F = torch.nn.functional
    f16, bf16 = torch.float16, torch.bfloat16
    dev = "cuda"

    def randn(shape, dt, scale=1.0):
        return torch.randn(shape, device=dev, dtype=dt) * scale

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    pw = [1024] if quick else [4096, 8192]
    rows, cols = (2048, 1024) if quick else (16384, 4096)
    ffn = (1, 256, 512, 1408) if quick else (4, 1024, 2048, 8192)
    eps = 1e-5
    out = []

    for n in pw:
        def make(n=n):
            return [randn((n, n), f16) for _ in range(3)]

        def relu_fma(a, b, c):
            return torch.relu(a * b + c)
        out.append(("relu_fma", f"{n}x{n}", "f16", make, relu_fma,
                    lambda ins: (nbytes(*ins) + nbytes(ins[0]), 3.0 * ins[0].numel(), True)))

    n = pw[0]

    def make_pw8(n=n):
        return [randn((n, n), f16) for _ in range(3)]

    def pointwise8(x, a, b):
        # the same chain as kiln's pointwise8 workload
        t = torch.relu(x * 1.1 + 0.5)
        t = torch.tanh(t * a - b)
        return t * 0.5 + x
    out.append(("pointwise8", f"{n}x{n}", "f16", make_pw8, pointwise8,
                lambda ins: (nbytes(*ins) + nbytes(ins[0]), 8.0 * ins[0].numel(), True)))

    def make_rows():
        return [randn((rows, cols), bf16)]

    def softmax(x):
        return torch.softmax(x, dim=-1)
    out.append(("softmax", f"{rows}x{cols}", "bf16", make_rows, softmax,
                lambda ins: (2 * nbytes(ins[0]), 5.0 * ins[0].numel(), True)))

    def make_ln():
        return [randn((rows, cols), bf16), randn((cols,), bf16), randn((cols,), bf16)]

    def layer_norm(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    out.append(("layer_norm", f"{rows}x{cols}", "bf16", make_ln, layer_norm,
                lambda ins: (2 * nbytes(ins[0]) + nbytes(*ins[1:]), 8.0 * ins[0].numel(), True)))

    def make_rms():
        return [randn((rows, cols), bf16), randn((cols,), bf16)]

    def rms_norm(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def rms_norm_prims(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w
    rms_cost = lambda ins: (2 * nbytes(ins[0]) + nbytes(ins[1]), 4.0 * ins[0].numel(), True)
    out.append(("rms_norm", f"{rows}x{cols}", "bf16", make_rms, rms_norm, rms_cost))
    out.append(("rms_norm_prims", f"{rows}x{cols}", "bf16", make_rms, rms_norm_prims, rms_cost))

    b, s, d, h = ffn

    def make_ffn():
        return [randn((b, s, d), bf16), randn((h, d), bf16, d ** -0.5),
                randn((h, d), bf16, d ** -0.5), randn((d, h), bf16, h ** -0.5)]

    def swiglu_ffn(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def ffn_cost(ins):
        tok = ins[0].shape[0] * ins[0].shape[1]
        return (2 * nbytes(ins[0]) + nbytes(*ins[1:]), 6.0 * tok * d * h + 5.0 * tok * h, False)
    out.append(("swiglu_ffn", f"{b}x{s}x{d}->{h}", "bf16", make_ffn, swiglu_ffn, ffn_cost))
    return out


def time_ms(torch, fn, ins, reps, iters):
    """Median over reps of (event-timed loop of iters calls) / iters."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(iters):
            fn(*ins)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def calibrate(torch, fn, ins):
    """Calls per timed loop: about 20 ms of work, at least 3 calls."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        fn(*ins)
    torch.cuda.synchronize()
    per = max((time.perf_counter() - t) / 3, 1e-6)
    return max(3, min(1000, int(0.02 / per)))


def main():
    args = parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"peer": "torch", "error": f"PyTorch is not importable: {e}"}),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"peer": "torch", "error": "torch.cuda.is_available() is False"}),
              file=sys.stderr)
        return 2
    table = workloads(torch, args.quick)
    if args.list:
        for w in table:
            print(f"{w[0]:16s} {w[1]:24s} {w[2]}")
        return 0
    modes = [m for m in args.modes.split(",") if m]
    known = {"eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"}
    for m in modes:
        if m not in known:
            print(f"peer_torch.py: unknown mode {m!r} ({', '.join(sorted(known))})",
                  file=sys.stderr)
            return 2
    reps = args.reps or (3 if args.quick else 15)
    gpu = torch.cuda.get_device_name(0)
    failures = 0
    for name, size, dtype, make, fn, cost in table:
        if args.workload and name not in args.workload:
            continue
        torch.manual_seed(0)
        ins = make()
        nbytes, flops, memory_bound = cost(ins)
        eager_ms = None
        for mode in modes:
            row = {"peer": "torch", "torch": torch.__version__, "gpu": gpu,
                   "workload": name, "size": size, "dtype": dtype, "device": "cuda",
                   "mode": mode}
            try:
                torch._dynamo.reset()
                f = fn if mode == "eager" else torch.compile(fn, mode=mode)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    f(*ins)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t0, 4)
                    for _ in range(3):
                        f(*ins)
                    iters = calibrate(torch, f, ins)
                    ms = time_ms(torch, f, ins, reps, iters)
            except Exception as e:  # one failing row must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                print(json.dumps(row), flush=True)
                failures += 1
                continue
            if mode == "eager":
                eager_ms = ms
            row["ms"] = round(ms, 5)
            row["iters"] = iters
            row["reps"] = reps
            row["bytes"] = nbytes
            row["flops"] = flops
            if memory_bound:
                row["gbps"] = round(nbytes / (ms * 1e-3) * 1e-9, 1)
            else:
                row["tflops"] = round(flops / (ms * 1e-3) * 1e-12, 2)
            if eager_ms:
                row["speedup"] = round(eager_ms / ms, 3)
            print(json.dumps(row), flush=True)
        del ins
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""peer_common.py - what the peers of `kiln bench --device cuda` share: the
workloads (the sizes, dtypes and cost formulas of src/tools/bench_workloads.c's
CUDA rows), the timing loop, and the JSON row.

Every row carries the keys `kiln bench --json` prints and bench/compare.py
reads: workload, device, dtype, shape, mode, median_us, first_call_s,
kernels, bytes, flops, bw_tbs, peak_bytes (null where not measured).
"""
import json
import math
import statistics
import sys
import time

# Timing, as kiln bench does it on CUDA: warm-up calls, then SAMPLES samples,
# each a batch of calls (>= MIN_BATCH, about BATCH_MS of work) timed as a
# whole and divided by its size.
WARMUP = 20
SAMPLES = 10
MIN_BATCH = 5
MAX_BATCH = 1000
BATCH_MS = 2.0

MEMORY_BOUND = ("memory_bandwidth", "relu_fma", "pointwise8", "softmax", "layer_norm",
                "rms_norm", "rms_norm_prims", "decoder_token", "adamw", "decode_step")
DECODE_STACK = 4  # decode_step's layers (KT_STACK in src/tools/tools.h)
# issue 21's rows: a training step, the optimizer alone, attention's backward
TRAIN = ("train_decoder", "adamw", "attention_bwd", "attention_bwd_causal", "train_gpt")
GPT_VOCAB = 256  # examples/train_gpt.c: byte-level
TRAIN_LR = 1e-4  # the training step's AdamW learning rate (torch's other defaults)


def decoder_params(d, f):
    """The DecoderLayer's parameter count: in-projection and out-projection
    with biases, two RMSNorm weights, the SwiGLU FeedForward."""
    return 4 * d * d + 3 * d * f + 6 * d
EPS = 1e-5


class Spec:
    """One workload at one size: name, dtype ("f16", "bf16", "f32"), dims,
    shape string, bytes and flops of one call (each input read once, each
    output written once; multiply-adds count two)."""

    def __init__(self, name, dtype, dims):
        self.name, self.dtype, self.dims = name, dtype, tuple(dims)
        es = 4 if dtype == "f32" else 2
        d = self.dims
        if name in ("memory_bandwidth", "relu_fma", "pointwise8", "softmax", "layer_norm",
                    "rms_norm", "rms_norm_prims"):
            r, c = d
            self.shape = f"{r}x{c}"
            m, n = r * c * es, r * c
            self.bytes, self.flops = {
                "memory_bandwidth": (2 * m, None),
                "relu_fma": (4 * m, 3.0 * n),
                "pointwise8": (4 * m, 8.0 * n),
                "softmax": (2 * m, 5.0 * n),
                "layer_norm": (2 * m + 2 * c * es, 8.0 * n),
                "rms_norm": (2 * m + c * es, 4.0 * n),
                "rms_norm_prims": (2 * m + c * es, 4.0 * n),
            }[name]
        elif name in ("gemm", "sgemm"):
            m, k, n = d
            self.shape = f"{m}x{k}x{n}"
            self.bytes, self.flops = (m * k + k * n + m * n) * es, 2.0 * m * n * k
        elif name == "swiglu_ffn":
            b, s, dim, h = d
            tok = b * s
            self.shape = f"{b}x{s}x{dim}->{h}"
            self.bytes = (2 * tok * dim + 3 * dim * h) * es
            self.flops = 6.0 * tok * dim * h + 5.0 * tok * h
        elif name in ("attention", "attention_causal"):
            # q, k, v [b, h, t, hd]; the two products, causal counted as half
            b, h, t, hd = d
            self.shape = f"{b}x{h}x{t}x{hd}"
            qkv = b * h * t * hd
            self.bytes = 4 * qkv * es
            self.flops = (0.5 if name == "attention_causal" else 1.0) * 4.0 * qkv * t
        elif name in ("decoder_layer", "decoder_token"):
            # the seed's DecoderLayer: x [b, t, dim], heads, ffn width f; the
            # products only (in-projection, attention, out-projection, FFN);
            # every parameter read once
            b, t, dim, h, f = d
            n = b * t
            self.shape = f"{b}x{t}x{dim},h{h},ffn{f}"
            self.bytes = (2 * n * dim + 4 * dim * dim + 3 * dim * f + 6 * dim) * es
            self.flops = 8.0 * n * dim * dim + 4.0 * n * t * dim + 6.0 * n * dim * f
        elif name == "decode_step":
            # DECODE_STACK DecoderLayers on one token a row over a KV cache of
            # t positions (of 2t): every weight read once and the keys and
            # values attended, x read and the output written
            b, t, dim, h, f = d
            self.shape = f"{DECODE_STACK}x({b}x1x{dim},h{h},ffn{f},kv{t})"
            self.bytes = (DECODE_STACK * (decoder_params(dim, f) + 2 * b * t * dim) +
                          2 * b * dim) * es
            self.flops = DECODE_STACK * (8.0 * b * dim * dim + 4.0 * b * t * dim +
                                         6.0 * b * dim * f)
        elif name == "train_decoder":
            # the seed's step on decoder_layer's problem: three times the
            # forward's products; x and the label read, and per parameter
            # the forward's read, the gradient written, AdamW's 7 elements
            b, t, dim, h, f = d
            n = b * t
            self.shape = f"{b}x{t}x{dim},h{h},ffn{f}"
            self.bytes = (2 * n * dim + 9 * decoder_params(dim, f)) * es
            self.flops = 3.0 * (8.0 * n * dim * dim + 4.0 * n * t * dim + 6.0 * n * dim * f)
        elif name == "adamw":
            # AdamW alone over the DecoderLayer's parameters: parameter and two
            # moments read and written, the gradient read
            b, t, dim, h, f = d
            p = decoder_params(dim, f)
            self.shape = f"{p} params,d{dim},ffn{f}"
            self.bytes, self.flops = 7 * p * es, 12.0 * p
        elif name in ("attention_bwd", "attention_bwd_causal"):
            # forward + backward: 3.5 times the forward's FLOPs; q, k, v, the
            # output and its cotangent read, the output and three gradients
            # written
            b, h, t, hd = d
            self.shape = f"{b}x{h}x{t}x{hd}"
            qkv = b * h * t * hd
            self.bytes = 9 * qkv * es
            self.flops = (3.5 * (0.5 if name == "attention_bwd_causal" else 1.0) *
                          4.0 * qkv * t)
        elif name == "train_gpt":
            # examples/train_gpt.c's model (--json prints the same shape and
            # FLOPs): layers, d_model, heads, seq, batch; a step's products
            # (six FLOPs per block or head parameter a token) and causal
            # attention's (6 B T^2 d a layer with the backward)
            layers, dim, h, t, b = d
            self.shape = f"L{layers},d{dim},h{h},seq{t},b{b}"
            tok = b * t
            self.bytes = None
            self.flops = (6.0 * tok * (12 * layers * dim * dim + GPT_VOCAB * dim) +
                          6.0 * layers * b * t * t * dim)
        elif name == "mlp24":
            b, dim, layers = d
            self.shape = f"{layers}x({b}x{dim})"
            self.bytes = (2 * b * dim + layers * (dim * dim + dim)) * es
            self.flops = layers * (2.0 * b * dim * dim + 2.0 * b * dim)
        else:
            raise ValueError(f"unknown workload {name}")
        self.memory_bound = name in MEMORY_BOUND


def specs(quick):
    """The CUDA rows of kiln bench (ANCHORS.md), or tiny ones (--quick)."""
    if quick:
        pw, rows, gemm, ffn, mlp, copy = ([256], (512, 256), (128, 128, 128),
                                          (1, 32, 64, 128), (8, 32, 24), (256, 256))
        attn, layer, token = (1, 2, 64, 32), (1, 16, 64, 4, 256), (1, 1, 64, 4, 256)
        decode = (1, 16, 64, 4, 256)
    else:
        decode = (1, 512, 2048, 16, 8192)
        pw, rows, gemm, ffn, mlp, copy = ([4096, 8192], (16384, 4096), (8192, 8192, 8192),
                                          (4, 1024, 2048, 8192), (8, 256, 24), (32768, 16384))
        attn = (4, 16, 1024, 128)
        layer, token = (4, 1024, 2048, 16, 8192), (1, 1, 2048, 16, 8192)
    out = [Spec("memory_bandwidth", "f16", copy)]
    out += [Spec("relu_fma", "f16", (n, n)) for n in pw]
    out.append(Spec("pointwise8", "f16", (pw[0], pw[0])))
    out += [Spec(n, "bf16", rows) for n in ("softmax", "layer_norm", "rms_norm", "rms_norm_prims")]
    out.append(Spec("gemm", "bf16", gemm))
    out.append(Spec("swiglu_ffn", "bf16", ffn))
    out.append(Spec("mlp24", "f16", mlp))
    out += [Spec(n, "bf16", attn) for n in ("attention", "attention_causal")]
    out.append(Spec("decoder_layer", "bf16", layer))
    out.append(Spec("decoder_token", "bf16", token))
    out.append(Spec("decode_step", "bf16", decode))
    out += [Spec(n, "bf16", layer) for n in ("train_decoder", "adamw")]
    out += [Spec(n, "bf16", attn) for n in ("attention_bwd", "attention_bwd_causal")]
    # GPT-2 small's shape, byte-level (examples/train_gpt.c)
    out.append(Spec("train_gpt", "bf16", (2, 64, 4, 64, 4) if quick else (12, 768, 12, 1024, 8)))
    return out


def cpu_specs(quick):
    """The CPU rows of kiln bench (src/tools/bench_workloads.c: f32, sizes a
    two-core box holds), or tiny ones (--quick)."""
    if quick:
        n, gemm, ffn, mlp = 256, (128, 128, 128), (1, 32, 64, 128), (8, 32, 24)
        attn, layer, token = (1, 2, 64, 32), (1, 16, 64, 4, 256), (1, 1, 64, 4, 256)
    else:
        n, gemm, ffn, mlp = 4096, (2048, 2048, 2048), (4, 128, 512, 1408), (8, 256, 24)
        attn, layer, token = (2, 4, 256, 64), (2, 64, 256, 4, 1024), (1, 1, 256, 4, 1024)
    out = [Spec("relu_fma", "f32", (n, n)), Spec("pointwise8", "f32", (n, n))]
    out += [Spec(w, "f32", (n, n)) for w in ("softmax", "layer_norm", "rms_norm", "rms_norm_prims")]
    out += [Spec("sgemm", "f32", gemm), Spec("swiglu_ffn", "f32", ffn), Spec("mlp24", "f32", mlp)]
    out += [Spec(w, "f32", attn) for w in ("attention", "attention_causal")]
    out += [Spec("decoder_layer", "f32", layer), Spec("decoder_token", "f32", token)]
    return out


def parse_list(text, known, what):
    items = [x for x in (text or "").split(",") if x]
    for x in items:
        if x not in known:
            raise SystemExit(f"unknown {what} {x!r} ({', '.join(sorted(known))})")
    return items


def batch_size(est_ms):
    if est_ms <= 0:
        return MAX_BATCH
    return max(MIN_BATCH, min(MAX_BATCH, math.ceil(BATCH_MS / est_ms)))


def time_calls(timer, warmup=WARMUP, samples=SAMPLES):
    """Median ms per call and the number of timed calls. timer(n) runs n calls
    and returns their total ms once they have finished on the device."""
    est = timer(warmup) / warmup if warmup else 1.0
    b = batch_size(est)
    times = [timer(b) / b for _ in range(samples)]
    return statistics.median(times), b * samples


def wall_timer(call, sync):
    """A timer from wall clocks: n calls, then sync() (waits for the device)."""
    def run(n):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        return (time.perf_counter() - t0) * 1e3
    return run


def row(peer, spec, device, mode, ms=None, iters=None, first_call_s=None, kernels=None,
        peak_bytes=None, eager_ms=None, extra=None):
    """The JSON object of one measured row."""
    r = {"peer": peer, "workload": spec.name, "device": device, "dtype": spec.dtype,
         "shape": spec.shape, "mode": mode,
         "median_us": None if ms is None else round(ms * 1e3, 3),
         "first_call_s": None if first_call_s is None else round(first_call_s, 4),
         "kernels": kernels, "bytes": spec.bytes, "flops": spec.flops,
         "bw_tbs": None, "peak_bytes": peak_bytes}
    if ms is not None:
        r["ms"] = round(ms, 6)
        r["iters"] = iters
        if spec.bytes:
            r["bw_tbs"] = round(spec.bytes / (ms * 1e-3) * 1e-12, 7)
        if spec.name == "train_gpt":
            r["tokens_per_s"] = round(spec.dims[3] * spec.dims[4] / (ms * 1e-3), 1)
        if spec.memory_bound:
            r["gbps"] = round(spec.bytes / (ms * 1e-3) * 1e-9, 1)
        elif spec.flops:
            r["tflops"] = round(spec.flops / (ms * 1e-3) * 1e-12, 6)
        if eager_ms:
            r["speedup"] = round(eager_ms / ms, 3)
    if extra:
        r.update(extra)
    return r


def emit(r):
    print(json.dumps(r), flush=True)


def skip(peer, why):
    """A peer that cannot run here says why and succeeds: gpu-check goes on."""
    print(f"{peer}: skipped: {why}", file=sys.stderr)
    return 0

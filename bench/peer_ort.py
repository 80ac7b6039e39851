#!/usr/bin/env python3
"""peer_ort.py - the ONNX Runtime peer of `kiln bench --device cpu` (issue 22).

Each CPU workload of kiln bench (src/tools/bench_workloads.c; sizes, dtypes
and cost formulas in bench/peer_common.py's cpu_specs) built as an ONNX graph
with onnx.helper, weights as initializers, and run by ONNX Runtime's CPU
provider with every graph optimization (ORT_ENABLE_ALL) and as many intra-op
threads as kiln uses (--threads, default: the cores this process may run on,
as kiln decides). Rows whose op ONNX has in more than one form are timed in
each, the best counting in bench/compare.py: attention as the opset-23
Attention op ("attention-op") and as MatMul/Softmax/MatMul ("matmul-softmax").
Timing as kiln bench does it on the CPU: warm-up calls, then each call a
sample for at least 0.5 s and 3 calls, the median. One JSON object a line,
with the keys of `kiln bench --json`:

  {"peer": "ort", "workload": "softmax", "device": "cpu", "dtype": "f32",
   "shape": "4096x4096", "mode": "ort", "median_us": 6450.1, ...}

Without onnxruntime or onnx it says so on stderr and exits 0. --quick shrinks
every size (a smoke test).
"""
import argparse
import os
import statistics
import sys
import time

import peer_common as pc

MIN_TIME_S = 0.5
MIN_ITERS = 3


def kiln_threads():
    """The cores this process may run on (kiln's default thread count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class G:
    """A graph under construction: nodes, initializers, fresh names."""

    def __init__(self, onnx, np, seed):
        self.onnx, self.np = onnx, np
        self.h = onnx.helper
        self.nodes, self.inits, self.n = [], [], 0
        self.rng = np.random.default_rng(seed)

    def name(self, base):
        self.n += 1
        return f"{base}{self.n}"

    def op(self, kind, ins, **attrs):
        out = self.name(kind.lower())
        self.nodes.append(self.h.make_node(kind, ins, [out], **attrs))
        return out

    def ops(self, kind, ins, nout, **attrs):
        outs = [self.name(kind.lower()) for _ in range(nout)]
        self.nodes.append(self.h.make_node(kind, ins, outs, **attrs))
        return outs

    def const(self, arr, base="w"):
        name = self.name(base)
        arr = self.np.asarray(arr)
        self.inits.append(self.onnx.numpy_helper.from_array(arr, name))
        return name

    def randn(self, *shape, scale=1.0, shift=0.0):
        return (self.rng.standard_normal(shape) * scale + shift).astype(self.np.float32)

    def scalar(self, v):
        return self.const(self.np.array(v, dtype=self.np.float32), "c")

    def i64(self, v):
        return self.const(self.np.array(v, dtype=self.np.int64), "s")

    def model(self, inputs, out, opset=23):
        h, F = self.h, self.onnx.TensorProto.FLOAT
        ins = [h.make_tensor_value_info(n, F, list(s)) for n, s in inputs]
        outs = [h.make_tensor_value_info(out, F, None)]
        graph = h.make_graph(self.nodes, "kiln_peer", ins, outs, self.inits)
        m = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
        m.ir_version = 10
        return m

    # ---- building blocks shared by the workloads ----
    def rms_norm(self, x, d, fused):
        w = self.const(self.randn(d, scale=0.1, shift=1.0))
        if fused:
            return self.op("RMSNormalization", [x, w], axis=-1, epsilon=pc.EPS)
        ms = self.op("ReduceMean", [self.op("Mul", [x, x]), self.i64([-1])], keepdims=1)
        r = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.scalar(pc.EPS)])])])
        return self.op("Mul", [self.op("Mul", [x, r]), w])

    def linear(self, x, din, dout, bias):
        """x @ W^T (+ b), W [dout, din] scaled by 1/sqrt(din), stored transposed."""
        w = self.const(self.randn(din, dout, scale=din ** -0.5))
        y = self.op("MatMul", [x, w])
        return self.op("Add", [y, self.const(self.randn(dout, scale=0.1))]) if bias else y

    def ffn(self, x, d, f):
        g = self.linear(x, d, f, False)
        silu = self.op("Mul", [g, self.op("Sigmoid", [g])])
        return self.linear(self.op("Mul", [silu, self.linear(x, d, f, False)]), f, d, False)

    def attention(self, q, k, v, t, hd, causal, fused):
        """q, k, v [b, h, t, hd] -> [b, h, t, hd], scale 1/sqrt(hd)."""
        if fused:
            return self.op("Attention", [q, k, v], is_causal=int(causal), scale=hd ** -0.5)
        s = self.op("MatMul", [q, self.op("Transpose", [k], perm=[0, 1, 3, 2])])
        s = self.op("Mul", [s, self.scalar(hd ** -0.5)])
        if causal:
            mask = self.np.triu(self.np.full((t, t), -self.np.inf, self.np.float32), 1)
            s = self.op("Add", [s, self.const(mask, "mask")])
        return self.op("MatMul", [self.op("Softmax", [s], axis=-1), v])


def build(onnx, np, spec, variant):
    """(model, feeds) of spec; variant picks between a fused op and primitives."""
    g = G(onnx, np, 0)
    n, d = spec.name, spec.dims
    fused = variant == "fused"
    if n in ("relu_fma", "pointwise8"):
        ins = [(f"x{i}", d) for i in range(3)]
        x, a, b = (i[0] for i in ins)
        if n == "relu_fma":
            out = g.op("Relu", [g.op("Add", [g.op("Mul", [x, a]), b])])
        else:
            t = g.op("Relu", [g.op("Add", [g.op("Mul", [x, g.scalar(1.1)]), g.scalar(0.5)])])
            t = g.op("Tanh", [g.op("Sub", [g.op("Mul", [t, a]), b])])
            out = g.op("Add", [g.op("Mul", [t, g.scalar(0.5)]), x])
    elif n == "softmax":
        ins = [("x", d)]
        out = g.op("Softmax", ["x"], axis=-1)
    elif n == "layer_norm":
        ins = [("x", d)]
        out = g.op("LayerNormalization", ["x", g.const(g.randn(d[1])), g.const(g.randn(d[1]))],
                   axis=-1, epsilon=pc.EPS)
    elif n in ("rms_norm", "rms_norm_prims"):
        ins = [("x", d)]
        out = g.rms_norm("x", d[1], n == "rms_norm" and fused)
    elif n == "sgemm":
        m, k, nn = d
        ins = [("a", (m, k))]
        out = g.op("MatMul", ["a", g.const(g.randn(k, nn, scale=k ** -0.5))])
    elif n == "swiglu_ffn":
        b, s, dim, h = d
        ins = [("x", (b, s, dim))]
        out = g.ffn("x", dim, h)
    elif n == "mlp24":
        b, dim, layers = d
        ins = [("x", (b, dim))]
        out = "x"
        for _ in range(layers):
            y = g.linear(out, dim, dim, True)
            if fused:
                out = g.op("Gelu", [y])
            else:  # the exact GELU from primitives (ORT fuses it with the bias)
                e = g.op("Erf", [g.op("Mul", [y, g.scalar(0.5 ** 0.5)])])
                out = g.op("Mul", [g.op("Mul", [y, g.scalar(0.5)]),
                                   g.op("Add", [e, g.scalar(1.0)])])
    elif n in ("attention", "attention_causal"):
        b, h, t, hd = d
        ins = [(c, d) for c in "qkv"]
        out = g.attention("q", "k", "v", t, hd, n == "attention_causal", fused)
    elif n in ("decoder_layer", "decoder_token"):
        # the seed's DecoderLayer: pre-norm RMSNorm, MultiheadAttention (fused
        # in-projection with bias, out-projection with bias, not causal),
        # SwiGLU FeedForward, two residuals
        b, t, dim, h, f = d
        hd = dim // h
        ins = [("x", (b, t, dim))]
        hn = g.rms_norm("x", dim, fused)
        qkv = g.linear(hn, dim, 3 * dim, True)
        parts = g.ops("Split", [qkv, g.i64([dim, dim, dim])], 3, axis=-1)
        heads = [g.op("Transpose", [g.op("Reshape", [p, g.i64([b, t, h, hd])])],
                      perm=[0, 2, 1, 3]) for p in parts]
        o = g.attention(*heads, t, hd, False, fused)
        o = g.op("Reshape", [g.op("Transpose", [o], perm=[0, 2, 1, 3]), g.i64([b, t, dim])])
        x1 = g.op("Add", ["x", g.linear(o, dim, dim, True)])
        out = g.op("Add", [x1, g.ffn(g.rms_norm(x1, dim, fused), dim, f)])
    else:
        raise ValueError(n)
    feeds = {name: g.randn(*shape) for name, shape in ins}
    return g.model(ins, out), feeds


# workloads with a fused ONNX op beside the primitives: both are timed
VARIANTS = {"rms_norm": ("fused", "prims"), "mlp24": ("fused", "prims"),
            "attention": ("fused", "prims"), "attention_causal": ("fused", "prims"),
            "decoder_layer": ("fused", "prims"), "decoder_token": ("fused", "prims")}
MODE_NAME = {"fused": "ort-fused-op", "prims": "ort-primitives", "one": "ort"}


def measure(ort, model, feeds, threads):
    """(median ms, timed calls, first call s) of one session."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    t0 = time.perf_counter()
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    first = time.perf_counter() - t0
    w0 = time.perf_counter()
    for _ in range(3):  # warm-up, as kiln's (a few calls, at least 50 ms)
        sess.run(None, feeds)
        if time.perf_counter() - w0 > 0.05:
            break
    times, start = [], time.perf_counter()
    while len(times) < MIN_ITERS or time.perf_counter() - start < MIN_TIME_S:
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), len(times), first


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu",))
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--workload", action="append", default=[], help="only these (repeatable)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads (default: kiln's, the cores this process may use)")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    opts = p.parse_args()
    table = pc.cpu_specs(opts.quick)
    if opts.list:
        for s in table:
            print(f"{s.name:16s} {s.shape:24s} {s.dtype}")
        return 0
    only = pc.parse_list(",".join(opts.workload), {s.name for s in table}, "workload")
    try:
        import numpy as np
        import onnx
        import onnxruntime as ort
    except ImportError as e:
        return pc.skip("peer_ort", f"onnxruntime, onnx or numpy is not importable ({e})")
    threads = opts.threads or kiln_threads()
    extra = {"onnxruntime": ort.__version__, "threads": threads}
    failures = 0
    for spec in table:
        if only and spec.name not in only:
            continue
        for variant in VARIANTS.get(spec.name, ("one",)):
            mode = MODE_NAME[variant]
            try:
                model, feeds = build(onnx, np, spec, variant)
                ms, iters, first = measure(ort, model, feeds, threads)
            except Exception as e:  # one failing row must not hide the others
                pc.emit(pc.row("ort", spec, "cpu", mode,
                               extra=dict(extra, error=f"{type(e).__name__}: {e}"[:500])))
                failures += 1
                continue
            pc.emit(pc.row("ort", spec, "cpu", mode, ms, iters, first, extra=extra))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

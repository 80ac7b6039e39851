#!/usr/bin/env python3
"""peer_jax.py - the JAX peer of `kiln bench --device cuda`: the workloads of
bench/peer_common.py through jax.jit (mode "jit"), timed as batches of calls
ended by block_until_ready, medians after 20 warm-up calls; first_call_s is
the first call's wall time (tracing and XLA compile included). JAX has no
built-in rms_norm, so "rms_norm" is the same primitives as "rms_norm_prims";
layer_norm is written out too. attention and attention_causal are
jax.nn.dot_product_attention (q, k, v in its [batch, seq, heads, head dim]
layout, is_causal; XLA picks the implementation: cuDNN's fused attention
where it can), each row saying so in "impl". decoder_layer and decoder_token
are the seed's DecoderLayer written out (RMSNorm in f32 with bf16's machine
epsilon as torch's eps=None, the fused in-projection with bias, attention
through jax.nn.dot_product_attention, not causal, the out-projection, the
SwiGLU FeedForward, both residuals) with seeded random weights as arguments.
kernels and peak_bytes are not measured (null).

The training rows (issue 21): train_decoder is one jit over
jax.value_and_grad of that layer's MSE loss against a fixed label and
optax.adamw's update (lr 1e-4, weight decay 0.01 as torch's default), the
parameters and optimizer state donated (updated in place); adamw is
optax.adamw's update alone over the layer's parameters with fixed gradients
(jit, donated); attention_bwd and attention_bwd_causal are the vjp of
jax.nn.dot_product_attention (forward and backward in one jit). Without
optax the two optimizer rows are skipped with a message (exit 0).

Without JAX (or without a GPU backend, unless --device cpu) it says so on
stderr and exits 0.
"""
import argparse
import sys
import time

import peer_common as pc


def make(jax, jnp, spec):
    """(fn, args): fn jitted-to-be, args arrays from a fixed key."""
    dt = {"f16": jnp.float16, "bf16": jnp.bfloat16}[spec.dtype]
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))

    def randn(*shape, scale=1.0):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dt)

    n = spec.name
    if n == "memory_bandwidth":
        return (lambda x: jnp.copy(x)), [randn(*spec.dims)]
    if n == "relu_fma":
        return (lambda a, b, c: jax.nn.relu(a * b + c)), [randn(*spec.dims) for _ in range(3)]
    if n == "pointwise8":
        def pointwise8(x, a, b):
            t = jax.nn.relu(x * 1.1 + 0.5)
            return jnp.tanh(t * a - b) * 0.5 + x
        return pointwise8, [randn(*spec.dims) for _ in range(3)]
    if n in ("softmax", "layer_norm", "rms_norm", "rms_norm_prims"):
        cols = spec.dims[1]
        x = randn(*spec.dims)
        if n == "softmax":
            return (lambda x: jax.nn.softmax(x, axis=-1)), [x]
        if n == "layer_norm":
            def layer_norm(x, w, b):
                xf = x.astype(jnp.float32)
                mu = xf.mean(-1, keepdims=True)
                var = ((xf - mu) ** 2).mean(-1, keepdims=True)
                return ((xf - mu) * jax.lax.rsqrt(var + pc.EPS) * w + b).astype(x.dtype)
            return layer_norm, [x, randn(cols), randn(cols)]
        return (lambda x, w: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + pc.EPS) * w), \
            [x, randn(cols)]
    if n == "gemm":
        m, k, nn_ = spec.dims
        return jnp.matmul, [randn(m, k, scale=k ** -0.5), randn(k, nn_, scale=nn_ ** -0.5)]
    if n == "swiglu_ffn":
        b, s, d, h = spec.dims

        def ffn(x, wg, wu, wd):
            return (jax.nn.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
        return ffn, [randn(b, s, d), randn(h, d, scale=d ** -0.5), randn(h, d, scale=d ** -0.5),
                     randn(d, h, scale=h ** -0.5)]
    if n == "mlp24":
        b, d, layers = spec.dims

        def mlp(x, *params):
            for i in range(0, len(params), 2):
                x = jax.nn.gelu(x @ params[i].T + params[i + 1], approximate=False)
            return x
        params = []
        for _ in range(layers):
            params += [randn(d, d, scale=d ** -0.5), randn(d, scale=0.1)]
        return mlp, [randn(b, d)] + params
    if n in ("attention", "attention_causal"):
        b, h, t, hd = spec.dims
        causal = n == "attention_causal"
        return ((lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)),
                [randn(b, t, h, hd) for _ in range(3)])
    if n in ("decoder_layer", "decoder_token"):
        b, t, d, h, f = spec.dims
        eps = float(jnp.finfo(dt).eps)

        def rms_norm(x, w):
            xf = x.astype(jnp.float32)
            y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps)
            return (y * w).astype(x.dtype)

        def decoder(x, n1, n2, w_in, b_in, w_out, b_out, wg, wu, wd):
            hx = rms_norm(x, n1)
            qkv = hx @ w_in.T + b_in
            q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(qkv, 3, axis=-1))
            o = jax.nn.dot_product_attention(q, k, v).reshape(b, t, d)
            x = x + (o @ w_out.T + b_out)
            hx = rms_norm(x, n2)
            return x + (jax.nn.silu(hx @ wg.T) * (hx @ wu.T)) @ wd.T
        ones = jnp.ones((d,), dt)
        return decoder, [randn(b, t, d), ones, ones, randn(3 * d, d, scale=d ** -0.5),
                         randn(3 * d, scale=0.02), randn(d, d, scale=d ** -0.5),
                         randn(d, scale=0.02), randn(f, d, scale=d ** -0.5),
                         randn(f, d, scale=d ** -0.5), randn(d, f, scale=f ** -0.5)]
    raise ValueError(n)


def make_train(jax, jnp, optax, spec):
    """A training row: (call, state), one call being state = call(state): a
    jitted function whose first outputs are its next inputs (the parameters
    and optimizer state donated, so updated in place)."""
    n = spec.name
    if n in ("attention_bwd", "attention_bwd_causal"):
        b, h, t, hd = spec.dims
        _, qkv = make(jax, jnp, pc.Spec("attention", spec.dtype, spec.dims))
        cot = jax.random.normal(jax.random.PRNGKey(1), (b, t, h, hd),
                                jnp.float32).astype(qkv[0].dtype)
        causal = n == "attention_bwd_causal"

        def fwd_bwd(q, k, v, cot):
            o, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal), q, k, v)
            return (q, k, v, cot, o) + tuple(vjp(cot))
        f = jax.jit(fwd_bwd)
        return (lambda st: f(*st[:4])), tuple(qkv) + (cot,)
    layer, args = make(jax, jnp, pc.Spec("decoder_layer", spec.dtype, spec.dims))
    # each parameter its own buffer (make's two norm weights are one array),
    # as donation needs
    x, params = args[0], tuple(jnp.array(p, copy=True) for p in args[1:])
    tx = optax.adamw(pc.TRAIN_LR, weight_decay=0.01)
    opt_state = tx.init(params)
    if n == "adamw":
        keys = iter(jax.random.split(jax.random.PRNGKey(2), len(params)))
        grads = tuple((jax.random.normal(next(keys), p.shape, jnp.float32) *
                       1e-2).astype(p.dtype) for p in params)

        def update(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, grads
        f = jax.jit(update, donate_argnums=(0, 1))
        return (lambda st: f(*st)), (params, opt_state, grads)
    label = jax.random.normal(jax.random.PRNGKey(3), x.shape, jnp.float32).astype(x.dtype)

    def loss_fn(params, x, label):
        y = layer(x, *params)
        return jnp.mean((y.astype(jnp.float32) - label.astype(jnp.float32)) ** 2)

    def train_step(params, opt_state, x, label):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, label)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, x, label, loss
    f = jax.jit(train_step, donate_argnums=(0, 1))
    return (lambda st: f(*st[:4])), (params, opt_state, x, label)


# what each row's implementation is, where the name does not say it
IMPL = {"attention": "jax.nn.dot_product_attention",
        "attention_bwd": "jit of the vjp of jax.nn.dot_product_attention",
        "attention_bwd_causal": "jit of the vjp of jax.nn.dot_product_attention",
        "train_decoder": "jit of value_and_grad of the written-out layer + optax.adamw, donated",
        "adamw": "jit of optax.adamw's update + apply_updates, donated",
        "attention_causal": "jax.nn.dot_product_attention",
        "decoder_layer": "jit of the written-out layer, jax.nn.dot_product_attention",
        "decoder_token": "jit of the written-out layer, jax.nn.dot_product_attention"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--workload", action="append", default=[], help="only these (repeatable)")
    p.add_argument("--warmup", type=int, default=pc.WARMUP)
    p.add_argument("--samples", type=int, default=pc.SAMPLES)
    opts = p.parse_args()
    table = pc.specs(opts.quick)
    only = pc.parse_list(",".join(opts.workload), {s.name for s in table}, "workload")
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        return pc.skip("peer_jax", f"JAX is not importable ({e})")
    platform = "gpu" if opts.device == "cuda" else "cpu"
    try:
        dev = jax.devices(platform)[0]
    except RuntimeError as e:
        return pc.skip("peer_jax", f"no {platform} backend ({e})")
    extra = {"jax": jax.__version__, "gpu": getattr(dev, "device_kind", str(dev))}
    try:
        import optax
    except ImportError as e:
        optax = None
        print(f"peer_jax: the optimizer rows (train_decoder, adamw) skipped: optax is not "
              f"importable ({e})", file=sys.stderr)
    failures = 0
    for spec in table:
        if only and spec.name not in only:
            continue
        if optax is None and spec.name in ("train_decoder", "adamw"):
            continue
        if spec.name == "train_gpt":  # torch only (the issue compares those two)
            continue
        mode = "copy" if spec.name == "memory_bandwidth" else "jit"
        try:
            with jax.default_device(dev):
                if spec.name in pc.TRAIN:
                    step, state = make_train(jax, jnp, optax, spec)
                else:
                    fn, args = make(jax, jnp, spec)
                    f = jax.jit(fn)
                    state = tuple(args)

                    def step(st, f=f):
                        return st[:len(args)] + (f(*st[:len(args)]),)
                last = [state]

                def call():
                    last[0] = step(last[0])

                def sync():
                    jax.block_until_ready(last[0])
                t0 = time.perf_counter()
                call()
                sync()
                first = time.perf_counter() - t0
                timer = pc.wall_timer(call, sync)
                ms, iters = pc.time_calls(timer, warmup=opts.warmup, samples=opts.samples)
        except Exception as e:  # one failing row must not hide the others
            pc.emit(pc.row("jax", spec, opts.device, mode,
                           extra=dict(extra, error=f"{type(e).__name__}: {e}"[:500])))
            failures += 1
            continue
        row_extra = dict(extra, impl=IMPL[spec.name]) if spec.name in IMPL else extra
        pc.emit(pc.row("jax", spec, opts.device, mode, ms, iters, first, extra=row_extra))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""peer_torch.py - the PyTorch peer of `kiln bench --device cuda`.

The same workloads, sizes and dtypes as kiln's CUDA rows (ANCHORS.md; see
bench/peer_common.py), through PyTorch eager, torch.compile default and
reduce-overhead, and max-autotune-no-cudagraphs for the FeedForward (as
ANCHORS.md measured it). attention and attention_causal are
F.scaled_dot_product_attention (eager and default only: one fused call);
decoder_layer and decoder_token are the seed's DecoderLayer module (nn.RMSNorm,
nn.MultiheadAttention batch first, not causal, the SwiGLU FeedForward) with
torch's initialization under torch.manual_seed(0). Times are medians of CUDA-event-timed batches after
20 warm-up calls; first_call_s is the wall time of a mode's first call
(compile included); peak_bytes is torch.cuda.max_memory_allocated over the
mode's calls (inputs included). One JSON object a line, with the keys of
`kiln bench --json`:

  {"peer": "torch", "workload": "relu_fma", "device": "cuda", "dtype": "f16",
   "shape": "4096x4096", "mode": "default", "median_us": 34.4, ...}

The training rows (issue 21) run with gradients on: train_decoder is the
seed's step (the DecoderLayer in training mode, MSE loss against a fixed
label, backward, AdamW lr 1e-4, the gradients set to None) in three modes:
"eager" (fused AdamW), "default" (torch.compile default on the module, fused
AdamW eager) and "compiled-step" (the same, with the optimizer's step
compiled too, torch's recipe: AdamW's default implementation under
torch.compile); adamw is the fused AdamW's step alone over the DecoderLayer's
parameters with fixed gradients ("eager"); attention_bwd and
attention_bwd_causal are F.scaled_dot_product_attention forward and
backward (q, k, v leaves, the output's cotangent given), eager and with
the forward under torch.compile (its backward compiled by AOTAutograd);
train_gpt is examples/train_gpt.c's GPT at GPT-2 small's shape (12 layers,
d 768, 12 heads, seq 1024, batch 8, bytes as tokens), eager and
torch.compile default, its tokens_per_s beside the row's time.

Without PyTorch (or without CUDA, unless --device cpu) it says so on stderr
and exits 0. --quick shrinks every size; --device cpu runs on the CPU with
wall-clock timing (a smoke test of this script, not a measurement).
"""
import argparse
import sys
import time

import peer_common as pc

MODES = ("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
         "compiled-step")


def default_modes(spec):
    if spec.name == "memory_bandwidth":
        return ["copy"]
    if spec.name == "train_decoder":
        return ["eager", "default", "compiled-step"]
    if spec.name == "train_gpt":
        return ["eager", "default"]
    if spec.name == "adamw":
        return ["eager"]
    if spec.name in ("attention_bwd", "attention_bwd_causal"):
        return ["eager", "default"]
    if spec.name in ("attention", "attention_causal"):
        return ["eager", "default"]
    modes = ["eager", "default", "reduce-overhead"]
    if spec.name == "swiglu_ffn":
        modes.append("max-autotune-no-cudagraphs")
    return modes


def mode_applies(spec, mode):
    """Whether --modes' mode makes sense for spec: the optimizer alone runs
    eagerly (torch's fused AdamW); compiled-step is the training step's."""
    if spec.name == "adamw":
        return mode == "eager"
    if spec.name == "train_gpt":
        return mode in ("eager", "default", "reduce-overhead")
    return mode != "compiled-step" or spec.name == "train_decoder"


def seed_modules(torch, d, h, f):
    """The seed's FeedForward and DecoderLayer classes (kernel-fusion chapter),
    for d_model d, h heads and FFN width f."""
    nn, F = torch.nn, torch.nn.functional

    class FeedForward(nn.Module):
        """The seed's FeedForward: SwiGLU, no biases."""

        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
            self.down_proj = nn.Linear(f, d, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        """The seed's pre-norm DecoderLayer."""

        def __init__(self):
            super().__init__()
            self.norm1 = nn.RMSNorm(d)
            self.norm2 = nn.RMSNorm(d)
            self.attn = nn.MultiheadAttention(d, h, batch_first=True)
            self.ffn = FeedForward()

        def forward(self, x):
            h_ = self.norm1(x)
            h_, _ = self.attn(h_, h_, h_, need_weights=False)
            x = x + h_
            return x + self.ffn(self.norm2(x))
    return FeedForward, DecoderLayer


def make(torch, spec, dev):
    """(fn, args) for one call of spec, inputs from a fixed seed."""
    F = torch.nn.functional
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, device=dev, dtype=dt, generator=g) * scale

    n = spec.name
    if n == "memory_bandwidth":
        x = randn(*spec.dims)
        y = torch.empty_like(x)
        return (lambda a, b: b.copy_(a)), [x, y]
    if n == "relu_fma":
        return (lambda a, b, c: torch.relu(a * b + c)), [randn(*spec.dims) for _ in range(3)]
    if n == "pointwise8":
        def pointwise8(x, a, b):
            t = torch.relu(x * 1.1 + 0.5)
            return torch.tanh(t * a - b) * 0.5 + x
        return pointwise8, [randn(*spec.dims) for _ in range(3)]
    if n in ("softmax", "layer_norm", "rms_norm", "rms_norm_prims"):
        cols = spec.dims[1]
        x = randn(*spec.dims)
        if n == "softmax":
            return (lambda x: torch.softmax(x, dim=-1)), [x]
        if n == "layer_norm":
            return (lambda x, w, b: F.layer_norm(x, (cols,), w, b, pc.EPS)), [x, randn(cols),
                                                                             randn(cols)]
        if n == "rms_norm":
            return (lambda x, w: F.rms_norm(x, (cols,), w, pc.EPS)), [x, randn(cols)]
        return (lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + pc.EPS) * w), \
            [x, randn(cols)]
    if n == "gemm":
        m, k, nn_ = spec.dims
        return torch.matmul, [randn(m, k, scale=k ** -0.5), randn(k, nn_, scale=nn_ ** -0.5)]
    if n == "swiglu_ffn":
        b, s, d, h = spec.dims
        FeedForward, _ = seed_modules(torch, d, 1, h)
        torch.manual_seed(0)
        return FeedForward().to(device=dev, dtype=dt).eval(), [randn(b, s, d)]
    if n in ("attention", "attention_causal"):
        causal = n == "attention_causal"
        return ((lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                [randn(*spec.dims) for _ in range(3)])
    if n in ("decoder_layer", "decoder_token"):
        b, t, d, h, f = spec.dims
        _, DecoderLayer = seed_modules(torch, d, h, f)
        torch.manual_seed(0)
        return DecoderLayer().to(device=dev, dtype=dt).eval(), [randn(b, t, d)]
    if n == "decode_step":
        return decode_stack(torch, spec, dev, dt, randn)
    if n == "mlp24":
        b, d, layers = spec.dims
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(d, d), torch.nn.GELU()]
        return torch.nn.Sequential(*mods).to(device=dev, dtype=dt).eval(), [randn(b, d)]
    raise ValueError(n)


def decode_stack(torch, spec, dev, dt, randn):
    """decode_step: the seed's DecoderLayers with a static KV cache, the way
    gpt-fast serves with torch.compile: the caches are buffers of the module
    (so reduce-overhead's CUDA graph keeps their addresses), the new key and
    value written in place at the input position, attention over the cache
    masked to each row's length."""
    F = torch.nn.functional
    b, t, d, h, f = spec.dims
    dh = d // h
    _, DecoderLayer = seed_modules(torch, d, h, f)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(DecoderLayer() for _ in range(pc.DECODE_STACK))
            for i in range(pc.DECODE_STACK):
                self.register_buffer(f"k{i}", torch.zeros(b, h, 2 * t, dh))
                self.register_buffer(f"v{i}", torch.zeros(b, h, 2 * t, dh))

        def forward(self, x, pos, lengths):
            keep = torch.arange(2 * t, device=x.device) < lengths[:, None, None, None]
            for i, layer in enumerate(self.layers):
                a = layer.attn
                qkv = F.linear(layer.norm1(x), a.in_proj_weight, a.in_proj_bias)
                q, k, v = qkv.view(b, 1, 3, h, dh).permute(2, 0, 3, 1, 4)
                kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
                kc[:, :, pos] = k
                vc[:, :, pos] = v
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=keep)
                x = x + a.out_proj(o.transpose(1, 2).reshape(b, 1, d))
                x = x + layer.ffn(layer.norm2(x))
            return x

    torch.manual_seed(0)
    m = Stack().to(device=dev, dtype=dt).eval()
    for name, buf in m.named_buffers():
        buf.copy_(randn(*buf.shape))
    pos = torch.full((1,), t - 1, device=dev, dtype=torch.long)
    return m, [randn(b, 1, d), pos, torch.full((b,), t, device=dev, dtype=torch.long)]


def make_train(torch, spec, dev, mode):
    """A training row: call() runs one step in mode (compiling on its first
    call), with gradients on. The modules and tensors live in its closure."""
    F = torch.nn.functional
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, device=dev, dtype=dt, generator=g) * scale

    n = spec.name
    if n in ("attention_bwd", "attention_bwd_causal"):
        causal = n == "attention_bwd_causal"
        q, k, v = (randn(*spec.dims).requires_grad_() for _ in range(3))
        cot = randn(*spec.dims)

        def attn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fwd = attn if mode == "eager" else torch.compile(
            attn, mode=None if mode == "default" else mode)

        def call():
            q.grad = k.grad = v.grad = None
            o = fwd(q, k, v)
            o.backward(cot)
            return o
        return call
    cuda = dev == "cuda"
    if n == "train_gpt":
        return make_gpt_step(torch, spec, dev, dt, mode, cuda)
    b, t, d, h, f = spec.dims
    _, DecoderLayer = seed_modules(torch, d, h, f)
    torch.manual_seed(0)
    model = DecoderLayer().to(device=dev, dtype=dt).train()
    if n == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=pc.TRAIN_LR, fused=cuda)
        for p in model.parameters():
            p.grad = randn(*p.shape, scale=1e-2)

        def call():
            opt.step()
            return None
        return call
    x, label = randn(b, t, d), randn(b, t, d)
    if mode == "compiled-step":
        # torch's recipe for a compiled optimizer: the default (foreach)
        # implementation, its step under torch.compile
        opt = torch.optim.AdamW(model.parameters(), lr=pc.TRAIN_LR)

        @torch.compile(fullgraph=False)
        def opt_step():
            opt.step()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=pc.TRAIN_LR, fused=cuda)
        opt_step = opt.step
    fwd = model if mode == "eager" else torch.compile(
        model, mode=None if mode in ("default", "compiled-step") else mode)

    def call():
        loss = F.mse_loss(fwd(x), label)
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        return loss
    return call


def make_gpt_step(torch, spec, dev, dt, mode, cuda):
    """examples/train_gpt.c's step in torch: the same GPT (token and position
    embeddings, pre-norm blocks of LayerNorm with bias, causal SDPA over a
    fused qkv product, a tanh-GELU MLP, the head tied to the embedding),
    cross-entropy over bytes, gradients clipped to norm 1, fused AdamW
    (weight decay 0.1, a constant lr: a schedule costs nothing a step)."""
    nn, F = torch.nn, torch.nn.functional
    layers, d, h, t, b = spec.dims

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (a.view(b, t, h, d // h).transpose(1, 2) for a in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(pc.GPT_VOCAB, d)
            self.wpe = nn.Embedding(t, d)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, pc.GPT_VOCAB), targets.view(-1))

    torch.manual_seed(0)
    model = GPT().to(device=dev, dtype=dt).train()
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, pc.GPT_VOCAB, (b, t), device=dev, generator=g)
    tgt = torch.randint(0, pc.GPT_VOCAB, (b, t), device=dev, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda)
    fwd = model if mode == "eager" else torch.compile(
        model, mode=None if mode == "default" else mode)

    def call():
        loss = fwd(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return call


def count_kernels(torch, call):
    """CUDA activities (kernels and copies) of one call, by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(torch, spec, mode, fn, args, opts):
    """(ms, iters, first_call_s, kernels, peak_bytes) of fn in mode; for a
    training row (fn None) of make_train's step in mode."""
    cuda = opts.device == "cuda"
    torch._dynamo.reset()
    if fn is None:
        f, args = make_train(torch, spec, opts.device, mode), []
    else:
        f = fn if mode in ("eager", "copy") else torch.compile(fn, mode=mode)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    f(*args)
    sync()
    first = time.perf_counter() - t0
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

        def timer(n):
            start.record()
            for _ in range(n):
                f(*args)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        timer = pc.wall_timer(lambda: f(*args), sync)
    ms, iters = pc.time_calls(timer, warmup=opts.warmup, samples=opts.samples)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    kernels = count_kernels(torch, lambda: f(*args)) if cuda and opts.count_kernels else None
    return ms, iters, first, kernels, peak


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--modes", help="comma list for every workload, from: " + ", ".join(MODES))
    p.add_argument("--workload", action="append", default=[], help="only these (repeatable)")
    p.add_argument("--warmup", type=int, default=pc.WARMUP)
    p.add_argument("--samples", type=int, default=pc.SAMPLES)
    p.add_argument("--count-kernels", action="store_true",
                   help="count each row's CUDA kernels with torch.profiler (slower)")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    opts = p.parse_args()
    table = pc.specs(opts.quick)
    if opts.list:
        for s in table:
            print(f"{s.name:16s} {s.shape:24s} {s.dtype}")
        return 0
    modes = pc.parse_list(opts.modes, MODES, "mode")
    only = pc.parse_list(",".join(opts.workload), {s.name for s in table}, "workload")
    try:
        import torch
    except ImportError as e:
        return pc.skip("peer_torch", f"PyTorch is not importable ({e})")
    if opts.device == "cuda" and not torch.cuda.is_available():
        return pc.skip("peer_torch", "torch.cuda.is_available() is False")
    gpu = torch.cuda.get_device_name(0) if opts.device == "cuda" else "cpu"
    extra = {"torch": torch.__version__, "gpu": gpu}
    failures = 0
    for spec in table:
        if only and spec.name not in only:
            continue
        eager_ms = None
        train = spec.name in pc.TRAIN
        try:
            # a training row makes its model per mode (measure), with gradients
            fn, args = (None, None) if train else make(torch, spec, opts.device)
        except Exception as e:  # e.g. out of memory: the other rows still run
            pc.emit(pc.row("torch", spec, opts.device, "setup",
                           extra=dict(extra, error=f"{type(e).__name__}: {e}"[:500])))
            failures += 1
            continue
        row_modes = default_modes(spec)
        if modes and spec.name != "memory_bandwidth":
            row_modes = [m for m in modes if mode_applies(spec, m)]
        for mode in row_modes:
            try:
                with torch.set_grad_enabled(train):
                    ms, iters, first, kernels, peak = measure(torch, spec, mode, fn, args, opts)
            except Exception as e:  # one failing row must not hide the others
                pc.emit(pc.row("torch", spec, opts.device, mode,
                               extra=dict(extra, error=f"{type(e).__name__}: {e}"[:500])))
                failures += 1
                continue
            if mode == "eager":
                eager_ms = ms
            pc.emit(pc.row("torch", spec, opts.device, mode, ms, iters, first, kernels, peak,
                           eager_ms, extra))
        del fn, args
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

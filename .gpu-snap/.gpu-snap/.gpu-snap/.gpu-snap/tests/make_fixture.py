#!/usr/bin/env python3
"""make_fixture.py - the PyTorch side of kiln's DecoderLayer test.

Builds the seed chapter's DecoderLayer (RMSNorm, nn.MultiheadAttention with
batch_first, SwiGLU FeedForward) with d_model 64, 4 heads, ffn 256 from a
fixed seed, runs it on a [2, 16, 64] input, and writes
tests/fixtures/decoder_small_{f32,bf16}.safetensors: the weights under
PyTorch's state-dict names, the input "x", the output "y", and "y_causal"
(the same layer with a causal attention mask). Runs where PyTorch is
installed (CPU is enough):

    python3 tests/make_fixture.py [outdir]

To keep the files small, the f32 fixture stores its weights as BF16: the f32
model is built from those bf16-rounded weights (exact in f32), so loading
them into an f32 module (kl_nn_load casts floats) gives the same model.
The bf16 fixture is the same model cast to bfloat16 and run in bfloat16.
The safetensors format is written directly (struct + json).
"""
import json
import os
import struct
import sys

import torch
import torch.nn as nn

D_MODEL, N_HEADS, FFN, BATCH, SEQ, SEED = 64, 4, 256, 2, 16, 1234


class FeedForward(nn.Module):
    """SwiGLU FFN, as in the chapter."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int = 2048, n_heads: int = 16, ffn_dim: int = 8192):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.norm2 = nn.RMSNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ffn = FeedForward(d_model, ffn_dim)

    def forward(self, x, mask=None):
        h = self.norm1(x)
        h, _ = self.attn(h, h, h, need_weights=False, attn_mask=mask)
        x = x + h
        h = self.norm2(x)
        h = self.ffn(h)
        x = x + h
        return x


DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


def tensor_bytes(t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def save_safetensors(path, tensors, metadata):
    header, blobs, off = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        b = tensor_bytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "fixtures")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(SEED)
    model = DecoderLayer(D_MODEL, N_HEADS, FFN).eval()
    with torch.no_grad():
        # RMSNorm weights are ones at init: perturb them so that they matter
        for norm in (model.norm1, model.norm2):
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
        for p in model.parameters():  # bf16-exact weights (see above)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    x = torch.randn(BATCH, SEQ, D_MODEL)
    causal = torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1)
    for dt, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        m = model.to(dt)
        xi = x.to(dt)
        with torch.no_grad():
            y = m(xi)
            yc = m(xi, causal.to(dt))
        tensors = {k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}
        tensors.update({"x": xi, "y": y, "y_causal": yc})
        meta = {"d_model": str(D_MODEL), "n_heads": str(N_HEADS), "ffn_dim": str(FFN),
                "batch": str(BATCH), "seq": str(SEQ), "seed": str(SEED), "dtype": tag,
                "torch": torch.__version__,
                "rms_norm_eps": "torch.finfo(dtype).eps (nn.RMSNorm's default)"}
        path = os.path.join(out, f"decoder_small_{tag}.safetensors")
        save_safetensors(path, tensors, meta)
        print(f"{path}: {os.path.getsize(path)} bytes, |y| = {y.float().norm():.4f}")


if __name__ == "__main__":
    main()

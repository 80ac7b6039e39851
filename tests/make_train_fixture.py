#!/usr/bin/env python3
"""make_train_fixture.py - the PyTorch side of kiln's DecoderLayer training test.

The DecoderLayer of make_fixture.py (d_model 64, 4 heads, ffn 256, the same
seed and bf16-exact weights), on its [2, 16, 64] input "x", with an MSE loss
against a fixed label. Writes tests/fixtures/decoder_train_{f32,bf16}.safetensors:

    <name>          the initial weights (state-dict names, stored as bf16: exact)
    x, label        the input and the label
    loss            the MSE loss (a 1-element tensor)
    grad.<name>     every parameter's gradient of that loss
    adamw3.<name>   every parameter after 3 steps of torch.optim.AdamW
                    (lr 1e-3, weight decay 0.01, betas (0.9, 0.999), eps 1e-8),
                    each step on the same x and label

f32: computed by PyTorch in float64 and stored as float32 (the float64
values are the reference a float32 run is compared with). bf16: the model
cast to bfloat16, run and stepped in bfloat16 by PyTorch (AdamW's state in
the parameters' dtype, as torch keeps it). Runs where PyTorch is installed
(CPU is enough):

    python3 tests/make_train_fixture.py [outdir]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixture import (BATCH, D_MODEL, FFN, N_HEADS, SEED, SEQ,  # noqa: E402
                          DecoderLayer, save_safetensors)

LR, WD, STEPS, LABEL_SEED = 1e-3, 0.01, 3, 4321


def build():
    torch.manual_seed(SEED)
    model = DecoderLayer(D_MODEL, N_HEADS, FFN)
    with torch.no_grad():
        for norm in (model.norm1, model.norm2):
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    x = torch.randn(BATCH, SEQ, D_MODEL)
    g = torch.Generator().manual_seed(LABEL_SEED)
    label = torch.randn(BATCH, SEQ, D_MODEL, generator=g)
    return model, x, label


def run(model, x, label, dt, store_dt):
    m = model.to(dt).train()
    if dt == torch.float64:  # the float32 model's eps (nn.RMSNorm's default is the dtype's)
        for norm in (m.norm1, m.norm2):
            norm.eps = torch.finfo(torch.float32).eps
    x, label = x.to(dt), label.to(dt)
    init = {k: v.detach().clone() for k, v in m.state_dict().items()}
    loss = torch.nn.functional.mse_loss(m(x), label)
    m.zero_grad(set_to_none=True)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.999),
                            eps=1e-8, foreach=False)
    opt.step()
    for _ in range(STEPS - 1):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(m(x), label).backward()
        opt.step()
    out = {k: v.to(torch.bfloat16) for k, v in init.items()}
    out["x"] = x.to(store_dt)
    out["label"] = label.to(store_dt)
    out["loss"] = loss.detach().reshape(1).to(store_dt)
    for k, v in grads.items():
        out["grad." + k] = v.to(store_dt)
    for k, p in m.named_parameters():
        out["adamw3." + k] = p.detach().to(store_dt)
    return out, float(loss)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "fixtures")
    os.makedirs(out, exist_ok=True)
    for dt, store_dt, tag in ((torch.float64, torch.float32, "f32"),
                              (torch.bfloat16, torch.bfloat16, "bf16")):
        model, x, label = build()
        tensors, loss = run(model, x, label, dt, store_dt)
        meta = {"d_model": str(D_MODEL), "n_heads": str(N_HEADS), "ffn_dim": str(FFN),
                "batch": str(BATCH), "seq": str(SEQ), "seed": str(SEED),
                "label_seed": str(LABEL_SEED), "lr": str(LR), "weight_decay": str(WD),
                "steps": str(STEPS), "computed_in": str(dt).replace("torch.", ""),
                "torch": torch.__version__,
                "rms_norm_eps": "torch.finfo(float32 or bfloat16).eps"}
        path = os.path.join(out, f"decoder_train_{tag}.safetensors")
        save_safetensors(path, tensors, meta)
        print(f"{path}: {os.path.getsize(path)} bytes, loss {loss:.6f}")


if __name__ == "__main__":
    main()

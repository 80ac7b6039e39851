#!/usr/bin/env python3
"""compare.py - one table of kiln vs its peers from JSON-lines files.

usage: compare.py [--device cuda|cpu] [--peer NAME] FILE.jsonl...

Reads rows of `kiln bench --json` (and --cold), bench/peer_torch.py,
bench/peer_jax.py and bench/peer_ort.py (a row with a "peer" key is a peer's,
one without is kiln's; unparsable lines and rows with an "error" are skipped
and counted). For each kiln workload and shape: kiln's best mode (the lowest
median), the main peer's best mode (--peer; default torch on cuda, ONNX
Runtime "ort" on cpu, issue 22), peer/kiln (above 1: kiln is faster), JAX's
when present, and the target of ANCHORS.md / issues 4, 5 and 21 with ✔ or ✘
(where none was set: kiln's best at most the peer's). Rows whose sizes are
not the ones a target was set for get no mark. Rows are keyed by workload,
shape and dtype (a peer's row without a dtype serves every dtype); an f16 or
bf16 row beside an f32 row of the same workload and shape (the CPU's, issue
22) is held to at most 1.5x that row's best time instead ("f16/f32 1.23x").
Then the training step's peak
memory against torch.compile's, and the start-up rows (kiln --cold) against
their targets and torch's first call (on cpu only when there are any).
Exit status 0 when a table was printed, 2 when there was nothing to compare.
"""
import argparse
import json
import sys

# (workload, shape) -> (kind, value, text): "bw" kiln's best TB/s at least
# value; "tf" kiln's best TFLOP/s at least value; "us" kiln's best median at
# most value; "ro_us" the reduce-overhead row's median at most value; "torch"
# kiln's best median at most torch's best in the same run (no mark without a
# torch row); "torch_frac" kiln's speed at least value times torch's best
# (torch's median / kiln's at least value; no mark without a torch row);
# "bw_frac" kiln's best row at least value of the device's copy bandwidth
# (the row's bw_frac, else its gbps over the run's memory_bandwidth copy row).
# A row with no target: kiln's best at most the main peer's.
TARGETS = {
    ("relu_fma", "8192x8192"): ("bw", 4.2, ">= 4.2 TB/s"),
    ("softmax", "16384x4096"): ("bw", 3.4, ">= 3.4 TB/s"),
    ("layer_norm", "16384x4096"): ("bw", 3.8, ">= 3.8 TB/s"),
    ("rms_norm", "16384x4096"): ("bw", 3.8, ">= 3.8 TB/s"),
    ("swiglu_ffn", "4x1024x2048->8192"): ("us", 640.0, "<= 640 us"),
    ("mlp24", "24x(8x256)"): ("ro_us", 45.0, "<= 45 us r-o"),
    ("attention", "4x16x1024x128"): ("tf", 400.0, ">= 400 TFLOP/s"),
    ("attention_causal", "4x16x1024x128"): ("torch", None, "<= torch"),
    ("decoder_layer", "4x1024x2048,h16,ffn8192"): ("us", 950.0, "<= 0.95 ms"),
    ("decoder_token", "1x1x2048,h16,ffn8192"): ("us", 50.0, "<= 50 us"),
    # issue 23: a batch-1 decode step within 1.3x of its bytes (553.8 MB) at 4.26 TB/s
    ("decode_step", "4x(1x1x2048,h16,ffn8192,kv512)"): ("us", 169.0, "<= 1.3x 4.26 TB/s floor"),
    # issue 21: training
    ("train_decoder", "4x1024x2048,h16,ffn8192"): ("us", 2900.0, "<= 2.9 ms"),
    ("attention_bwd", "4x16x1024x128"): ("torch_frac", 0.95, ">= 0.95x torch"),
    ("attention_bwd_causal", "4x16x1024x128"): ("torch_frac", 0.95, ">= 0.95x torch"),
    ("adamw", "67121152 params,d2048,ffn8192"): ("bw_frac", 0.85, ">= 85% of copy bw"),
    # examples/train_gpt.c --json at GPT-2 small's shape: tokens/s >= 1.1x torch's
    ("train_gpt", "L12,d768,h12,seq1024,b8"): ("torch_frac", 1.1, ">= 1.1x torch"),
}
# the training step's peak memory: kiln's best mode's at most torch.compile's
# (torch's "default" row) in the same run (issue 21)
PEAK_TARGETS = {("train_decoder", "4x1024x2048,h16,ffn8192"): "default"}
# start-up: kiln --cold rows, first_call_s below (strict) or at most the limit:
# (workload, shape, mode, limit s, strict, text); the torch row beside each is
# the same problem's "default" first call (compile included)
COLD_TARGETS = [
    ("swiglu_ffn", "4x1024x2048->8192", "cold_compile", 0.5, True, "< 0.5 s"),
    ("swiglu_ffn", "4x1024x2048->8192", "warm_process", 0.030, True, "< 30 ms"),
    ("train_decoder", "4x1024x2048,h16,ffn8192", "cold_compile", 1.0, False, "<= 1 s"),
    ("train_decoder", "4x1024x2048,h16,ffn8192", "warm_process", 0.050, False, "<= 50 ms"),
]
TIMED_SKIP = {"copy", "cold_compile", "warm_process"}
# an f16/bf16 row's best at most this times the f32 row's of the same
# workload and shape (issue 22: "f16/bf16 within 1.5x of f32's time")
HALF_VS_F32 = 1.5
HALF_DTYPES = ("f16", "bf16")
OK, NO = "\u2714", "\u2718"


def load(paths):
    rows, bad = [], 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError as e:
            print(f"compare: {path}: {e.strerror}", file=sys.stderr)
            bad += 1
            continue
        for line in lines:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(r, dict) or "error" in r or "workload" not in r:
                bad += 1
                continue
            rows.append(r)
    return rows, bad


def num(r, key):
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def best(rows):
    """The timed row with the lowest median_us, or None."""
    timed = [r for r in rows if r.get("mode") not in TIMED_SKIP and num(r, "median_us")]
    return min(timed, key=lambda r: num(r, "median_us")) if timed else None


def fmt_us(us):
    if us is None:
        return "-"
    return f"{us / 1e3:.3f} ms" if us >= 1000 else f"{us:.1f} us"


# the CPU's rates read in GFLOP/s and GB/s (main sets it for --device cpu)
SMALL_UNITS = [False]


def fmt_rate(r):
    """TFLOP/s for the rows that report it (products), else TB/s."""
    tf = num(r, "tflops")
    bw = num(r, "bw_tbs")
    if SMALL_UNITS[0]:
        return f"{tf * 1e3:.4g} GFLOP/s" if tf else (f"{bw * 1e3:.3g} GB/s" if bw else "")
    if tf:
        return f"{tf:.3g} TFLOP/s"
    return f"{bw:.2f} TB/s" if bw else ""


def cell(r):
    if r is None:
        return "-"
    return f"{fmt_us(num(r, 'median_us'))} {r.get('mode', '')} {fmt_rate(r)}".rstrip()


def bw_frac(r, copy_gbps):
    """r's share of the copy bandwidth: its bw_frac, else gbps / copy_gbps."""
    f = num(r, "bw_frac")
    if f is not None:
        return f
    g = num(r, "gbps")
    return g / copy_gbps if g and copy_gbps else None


def half_check(dtype, k_best, f32_best):
    """(target text, mark) of an f16/bf16 row against the f32 row's best."""
    text = f"<= {HALF_VS_F32:g}x f32"
    if k_best is None:
        return text, NO + " (no row)"
    got = num(k_best, "median_us") / num(f32_best, "median_us")
    return text, (OK if got <= HALF_VS_F32 else NO) + f" ({dtype}/f32 {got:.2f}x)"


def check(key, kiln_rows, k_best, t_best, copy_gbps=None, peer="torch", device="cuda"):
    """(target text, mark) for one workload and shape."""
    tgt = TARGETS.get(key[:2]) if device == "cuda" else None  # the GPU's (ANCHORS.md)
    if tgt is None:
        if k_best is None or t_best is None:
            return "", ""
        ok = num(k_best, "median_us") <= num(t_best, "median_us")
        return f"<= {peer}", OK if ok else NO
    kind, value, text = tgt
    if kind == "ro_us":
        ro = [r for r in kiln_rows if r.get("mode") == "reduce-overhead" and num(r, "median_us")]
        got = num(ro[0], "median_us") if ro else None
        if got is None:
            return text, NO + " (no r-o row)"
        return text, (OK if got <= value else NO) + f" ({got:.1f} us)"
    if k_best is None:
        return text, NO + " (no row)"
    if kind == "torch":
        if t_best is None:
            return text, ""
        return text, OK if num(k_best, "median_us") <= num(t_best, "median_us") else NO
    if kind == "torch_frac":
        if t_best is None:
            return text, ""
        got = num(t_best, "median_us") / num(k_best, "median_us")
        return text, (OK if got >= value else NO) + f" ({got:.2f}x)"
    if kind == "bw_frac":
        got = bw_frac(k_best, copy_gbps)
        if got is None:
            return text, NO + " (no copy bandwidth)"
        return text, (OK if got >= value else NO) + f" ({100 * got:.0f}%)"
    if kind == "tf":
        got = num(k_best, "tflops")
        return text, OK if got is not None and got >= value else NO
    if kind == "bw":
        got = num(k_best, "bw_tbs")
        return text, OK if got is not None and got >= value else NO
    return text, OK if num(k_best, "median_us") <= value else NO


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--peer", help="the peer set against kiln (default: torch; ort on cpu)")
    p.add_argument("files", nargs="+")
    opts = p.parse_args()
    SMALL_UNITS[0] = opts.device == "cpu"
    main_peer = opts.peer or ("ort" if opts.device == "cpu" else "torch")
    rows, bad = load(opts.files)
    rows = [r for r in rows if r.get("device") == opts.device]
    kiln = [r for r in rows if "peer" not in r]
    peers = {}
    for r in rows:
        if "peer" in r:
            peers.setdefault(r["peer"], []).append(r)
    if not kiln and not peers:
        print(f"compare: no {opts.device} rows in {', '.join(opts.files)}", file=sys.stderr)
        return 2
    has_jax = "jax" in peers

    # workloads in kiln's order, then any only a peer measured; a key is
    # (workload, shape, dtype), a peer's row without a dtype joins its
    # workload and shape's first key
    keys = []
    for r in kiln + [r for rs in peers.values() for r in rs]:
        k = (r["workload"], r.get("shape", ""), r.get("dtype") or "")
        if r.get("mode") in ("cold_compile", "warm_process") or k in keys:
            continue
        if not k[2] and any(x[:2] == k[:2] for x in keys):
            continue
        keys.append(k)

    def of(rs, key):
        """rs of key's workload and shape; of its dtype too where key and the
        row both name one (a 2-tuple key: any dtype)"""
        return [r for r in rs if (r["workload"], r.get("shape", "")) == key[:2] and
                (len(key) < 3 or not key[2] or not r.get("dtype") or r["dtype"] == key[2])]

    copy = next((r for r in kiln if r["workload"] == "memory_bandwidth" and
                 r.get("mode") == "copy"), None)
    copy_gbps = num(copy, "gbps") if copy else None
    head = ["workload", "shape", "dtype", "kiln best", f"{main_peer} best", f"{main_peer}/kiln"]
    if has_jax:
        head += ["jax jit", "jax/kiln"]
    head += ["target", ""]
    table, met, total = [], 0, 0
    for key in keys:
        k_rows, t_rows = of(kiln, key), of(peers.get(main_peer, []), key)
        j_rows = of(peers.get("jax", []), key)
        if key[0] == "memory_bandwidth":  # the copy ceiling: its one row each
            k_best = next((r for r in k_rows if r.get("mode") == "copy"), None)
            t_best = next((r for r in t_rows if r.get("mode") == "copy"), None)
            j_best = next((r for r in j_rows if r.get("mode") == "copy"), None)
            text, mark = "(ANCHORS 4.26 TB/s)", ""
        else:
            k_best, t_best, j_best = best(k_rows), best(t_rows), best(j_rows)
            f32_best = (best(of(kiln, key[:2] + ("f32",))) if key[2] in HALF_DTYPES
                        else None)
            if f32_best is not None:
                text, mark = half_check(key[2], k_best, f32_best)
            else:
                text, mark = check(key, k_rows, k_best, t_best, copy_gbps, main_peer,
                                   opts.device)
        dtype = next((r.get("dtype") for r in k_rows + t_rows + j_rows if r.get("dtype")), "")

        def ratio(peer_row):
            if peer_row is None or k_best is None:
                return "-"
            return f"{num(peer_row, 'median_us') / num(k_best, 'median_us'):.2f}x"
        line = [key[0], key[1], dtype or "-", cell(k_best), cell(t_best), ratio(t_best)]
        if has_jax:
            line += [cell(j_best), ratio(j_best)]
        line += [text, mark]
        if mark:
            total += 1
            met += mark.startswith(OK)
        table.append(line)

    def mib(r):
        v = num(r, "peak_bytes")
        return None if v is None else v / 2 ** 20

    # the training step's peak memory beside torch.compile's
    for key, t_mode in PEAK_TARGETS.items():
        k_best = best(of(kiln, key))
        t_row = next((r for r in of(peers.get("torch", []), key) if r.get("mode") == t_mode),
                     None)
        if k_best is None:
            continue
        k, t = mib(k_best), mib(t_row) if t_row else None
        mark = "" if k is None or t is None else (OK if k <= t else NO)
        line = [key[0] + " peak memory", key[1], k_best.get("dtype") or "-",
                "-" if k is None else f"{k:.0f} MiB {k_best.get('mode', '')}",
                "-" if t is None else f"{t:.0f} MiB {t_mode}",
                f"{k / t:.2f}x" if k and t else "-"]
        if has_jax:
            line += ["-", "-"]
        line += ["<= torch " + t_mode, mark]
        if mark:
            total += 1
            met += mark.startswith(OK)
        table.append(line)

    # start-up (kiln bench --cold) beside torch's first call of the same problem
    cold_rows = any(r.get("mode") in {t[2] for t in COLD_TARGETS} for r in kiln)
    for wl, shape, mode, limit, strict, text in COLD_TARGETS:
        if opts.device != "cuda" and not cold_rows:
            break  # the start-up targets are the GPU's (ANCHORS.md)
        key = (wl, shape)
        t_first = [r for r in of(peers.get("torch", []), key)
                   if r.get("mode") == "default" and num(r, "first_call_s") is not None]
        rs = [r for r in kiln if r.get("mode") == mode and
              (r["workload"], r.get("shape", "")) == key]
        got = num(rs[0], "first_call_s") if rs else None
        k = "-" if got is None else (f"{got:.3f} s" if got >= 1 else f"{got * 1e3:.1f} ms")
        t = (f"{num(t_first[0], 'first_call_s'):.2f} s default first call" if t_first and
             mode == "cold_compile" else "-")
        ratio = (f"{num(t_first[0], 'first_call_s') / got:.1f}x" if t_first and got and
                 mode == "cold_compile" else "-")
        ok = got is not None and (got < limit if strict else got <= limit)
        mark = NO + " (no row)" if got is None else (OK if ok else NO)
        dtype = rs[0].get("dtype") if rs and rs[0].get("dtype") else "bf16"
        line = [wl + " " + mode.replace("_", " "), shape, dtype, k + " first call", t, ratio]
        if has_jax:
            line += ["-", "-"]
        line += [text, mark]
        total += 1
        met += mark.startswith(OK)
        table.append(line)

    widths = [max(len(head[i]), *(len(r[i]) for r in table)) for i in range(len(head))]
    name = {"torch": "PyTorch", "ort": "ONNX Runtime", "jax": "JAX"}.get(main_peer, main_peer)
    print(f"kiln vs {name} on {opts.device}: best mode of each (lowest median); "
          f"{main_peer}/kiln above 1 means kiln is faster")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    print("  ".join("-" * w for w in widths[:-1]))
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"targets met: {met}/{total}" + (f"; {bad} rows skipped (errors or unreadable)"
                                           if bad else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

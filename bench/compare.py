#!/usr/bin/env python3
"""compare.py - one table of kiln vs its peers from JSON-lines files.

usage: compare.py [--device cuda|cpu] [--peer NAME] FILE.jsonl...

Reads rows of `kiln bench --json` (and --cold), bench/peer_torch.py,
bench/peer_jax.py and bench/peer_ort.py (a row with a "peer" key is a peer's,
one without is kiln's; unparsable lines and rows with an "error" are skipped
and counted). For each kiln workload and shape: kiln's best mode (the lowest
median), the main peer's best mode (--peer; default torch on cuda, ONNX
Runtime "ort" on cpu, issue 22), peer/kiln (above 1: kiln is faster), JAX's
when present, and the target of ANCHORS.md / issues 4 and 5 with ✔ or ✘ (where
none was set: kiln's best at most the peer's). Rows whose sizes are not the
ones a target was set for get no mark. Then the start-up rows (kiln --cold)
against their targets and torch's first call (on cpu only when there are any).
Exit status 0 when a table was printed, 2 when there was nothing to compare.
"""
import argparse
import json
import sys

# (workload, shape) -> (kind, value, text): "bw" kiln's best TB/s at least
# value; "tf" kiln's best TFLOP/s at least value; "us" kiln's best median at
# most value; "ro_us" the reduce-overhead row's median at most value; "torch"
# kiln's best median at most torch's best in the same run (no mark without a
# torch row). A row with no target: kiln's best at most the main peer's.
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
}
# start-up: kiln --cold rows of the FeedForward, first_call_s at most value
COLD_TARGETS = {
    "cold_compile": (0.5, "< 0.5 s"),
    "warm_process": (0.030, "< 30 ms"),
}
COLD_WORKLOAD = ("swiglu_ffn", "4x1024x2048->8192")
TIMED_SKIP = {"copy", "cold_compile", "warm_process"}
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


def check(key, kiln_rows, k_best, t_best, peer="torch", device="cuda"):
    """(target text, mark) for one workload and shape."""
    tgt = TARGETS.get(key) if device == "cuda" else None  # the GPU's (ANCHORS.md)
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

    # workloads in kiln's order, then any only a peer measured
    keys = []
    for r in kiln + [r for rs in peers.values() for r in rs]:
        k = (r["workload"], r.get("shape", ""))
        if k not in keys and r.get("mode") not in ("cold_compile", "warm_process"):
            keys.append(k)

    def of(rs, key):
        return [r for r in rs if (r["workload"], r.get("shape", "")) == key]

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
            text, mark = check(key, k_rows, k_best, t_best, main_peer, opts.device)
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

    # start-up (kiln bench --cold) beside torch's first call of the same problem
    t_first = [r for r in of(peers.get("torch", []), COLD_WORKLOAD)
               if r.get("mode") == "default" and num(r, "first_call_s") is not None]
    cold_rows = any(r.get("mode") in COLD_TARGETS for r in kiln)
    for mode, (limit, text) in COLD_TARGETS.items():
        if opts.device != "cuda" and not cold_rows:
            break  # the start-up targets are the GPU's (ANCHORS.md)
        rs = [r for r in kiln if r.get("mode") == mode and
              (r["workload"], r.get("shape", "")) == COLD_WORKLOAD]
        got = num(rs[0], "first_call_s") if rs else None
        k = "-" if got is None else (f"{got:.3f} s" if got >= 1 else f"{got * 1e3:.1f} ms")
        t = (f"{num(t_first[0], 'first_call_s'):.2f} s default first call" if t_first and
             mode == "cold_compile" else "-")
        ratio = (f"{num(t_first[0], 'first_call_s') / got:.1f}x" if t_first and got and
                 mode == "cold_compile" else "-")
        mark = NO + " (no row)" if got is None else (OK if got < limit else NO)
        line = [COLD_WORKLOAD[0] + " " + mode.replace("_", " "), COLD_WORKLOAD[1], "bf16",
                k + " first call", t, ratio]
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

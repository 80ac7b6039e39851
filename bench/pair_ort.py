#!/usr/bin/env python3
"""pair_ort.py - kiln against ONNX Runtime on the CPU, batch by batch.

For each workload, `kiln bench --serve default --workload W` (src/tools/
bench_serve.c) holds kiln's compiled call ready in a child process while this
process holds ONNX Runtime's sessions (bench/peer_ort.py's graphs, every
form it times); then, ROUNDS times, a batch of kiln's calls and a batch of
each ORT form's, the order swapped every round. A batch is about BATCH_MS of
calls and its figure the median call. Each round gives one ratio: ORT's
batch over kiln's, in ORT's best form (the lowest median over the rounds, as
bench/compare.py takes the best mode); the report is the median ratio over
the rounds and its quartiles, with each side's median of its batch figures.

Why: on a shared machine the speed drifts from second to second (the 2-core
boxes: 20-50%), so that two whole runs one after the other (bench/
cpu_vs_ort.sh) compare the drift as much as the code; two batches a fraction
of a second apart see the same machine. ONNX Runtime's pool spins for tens of
milliseconds after a run (about 60 ms of CPU on the Zen 3), which would take
a core from kiln's next batch, so a pause of GAP_MS follows every batch (each
side's, so that both start from an idle machine).
Threads: kiln's default (the cores this process may use), ORT the same.

  bench/pair_ort.py [--rounds N] [--workload W]... [--json]

Needs a built build/kiln (--kiln PATH) and onnxruntime, onnx and numpy.
"""
import argparse
import statistics
import subprocess
import sys
import time

import peer_common as pc
import peer_ort as po

BATCH_MS = 40.0
GAP_MS = 100.0  # after every batch: ORT's pool's spinning ends


class Kiln:
    """A `kiln bench --serve` child: batch(n) -> (median ms, min ms)."""

    def __init__(self, exe, workload, threads):
        args = [exe, "bench", "--serve", "default", "--workload", workload]
        if threads:
            args += ["--threads", str(threads)]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline().split()
        if len(line) != 6 or line[0] != "ready":
            self.close()
            raise RuntimeError(f"kiln bench --serve {workload} did not start (see stderr)")
        self.shape, self.first_ms = line[2], float(line[5])

    def batch(self, n):
        self.p.stdin.write(f"{n}\n")
        self.p.stdin.flush()
        f = self.p.stdout.readline().split()
        if len(f) != 3 or int(f[0]) != n:
            raise RuntimeError("kiln bench --serve stopped answering (see stderr)")
        return float(f[1]), float(f[2])

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write("q\n")
                self.p.stdin.close()
            except OSError:
                pass
            self.p.wait(timeout=60)


def ort_session(ort, model, threads):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def ort_batch(sess, feeds, n):
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        t.append((time.perf_counter() - t0) * 1e3)
    t.sort()
    return t[n // 2], t[0]


def calls_for(ms):
    return max(3, min(1000, round(BATCH_MS / max(ms, 1e-3))))


def quartiles(v):
    v = sorted(v)
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return q[0], statistics.median(v), q[2]


def pair(spec, args, ort, onnx, np, threads):
    """One workload: the rounds, then its result dict."""
    forms = []
    for variant in po.VARIANTS.get(spec.name, ("one",)):
        model, feeds = po.build(onnx, np, spec, variant)
        sess = ort_session(ort, model, threads)
        sess.run(None, feeds)
        forms.append((po.MODE_NAME[variant], sess, feeds))
    k = Kiln(args.kiln, spec.name, args.threads)
    try:
        nk = calls_for(k.batch(3)[0])
        no = [calls_for(ort_batch(s, f, 3)[0]) for _, s, f in forms]
        kiln_ms, form_ms = [], [[] for _ in forms]
        for r in range(args.rounds):
            for side in (("kiln", "ort") if r % 2 == 0 else ("ort", "kiln")):
                if side == "kiln":
                    kiln_ms.append(k.batch(nk)[0])
                    time.sleep(GAP_MS / 1e3)
                    continue
                for i, ((_, s, f), n) in enumerate(zip(forms, no)):
                    form_ms[i].append(ort_batch(s, f, n)[0])
                    time.sleep(GAP_MS / 1e3)
    finally:
        k.close()
    # ORT's best form over the rounds (as bench/compare.py takes its best mode)
    fi = min(range(len(forms)), key=lambda i: statistics.median(form_ms[i]))
    ratios = [o / kk for o, kk in zip(form_ms[fi], kiln_ms)]
    lo, med, hi = quartiles(ratios)
    return {"workload": spec.name, "dtype": spec.dtype, "shape": spec.shape,
            "rounds": args.rounds, "kiln_calls": nk, "ort_calls": no,
            "kiln_ms": round(statistics.median(kiln_ms), 6),
            "ort_ms": round(statistics.median(form_ms[fi]), 6),
            "ort_form": forms[fi][0],
            "ratio": round(med, 4), "ratio_q1": round(lo, 4), "ratio_q3": round(hi, 4),
            "kiln_ahead_rounds": sum(x >= 1 for x in ratios), "threads": threads,
            "onnxruntime": ort.__version__}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kiln", default="build/kiln", help="the kiln command (default build/kiln)")
    p.add_argument("--rounds", type=int, default=15, help="kiln/ORT batch pairs (default 15)")
    p.add_argument("--workload", action="append", default=[], help="only these (repeatable)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads for both (default: the cores this process may use)")
    p.add_argument("--json", action="store_true", help="one JSON object a workload")
    args = p.parse_args()
    if args.rounds < 1:
        raise SystemExit("pair_ort.py: --rounds wants at least 1")
    table = pc.cpu_specs(False)
    only = pc.parse_list(",".join(args.workload), {s.name for s in table}, "workload")
    try:
        import numpy as np
        import onnx
        import onnxruntime as ort
    except ImportError as e:
        return pc.skip("pair_ort", f"onnxruntime, onnx or numpy is not importable ({e})")
    threads = args.threads or po.kiln_threads()
    if not args.json:
        print(f"kiln vs ONNX Runtime {ort.__version__} on the CPU, {threads} threads, "
              f"batches of ~{BATCH_MS:.0f} ms interleaved, {args.rounds} rounds; "
              "ratio = ORT's time / kiln's (above 1: kiln is faster)")
        print(f"{'workload':17s} {'shape':20s} {'kiln ms':>9s} {'ORT ms':>9s} {'ORT form':15s} "
              f"{'ratio':>6s} {'q1-q3':>11s} {'kiln ahead':>10s}")
    failures = 0
    for spec in table:
        if only and spec.name not in only:
            continue
        try:
            r = pair(spec, args, ort, onnx, np, threads)
        except Exception as e:  # one failing row must not hide the others
            print(f"pair_ort.py: {spec.name}: {type(e).__name__}: {e}", file=sys.stderr)
            failures += 1
            continue
        if args.json:
            pc.emit(r)
        else:
            print(f"{r['workload']:17s} {r['shape']:20s} {r['kiln_ms']:9.3f} {r['ort_ms']:9.3f} "
                  f"{r['ort_form']:15s} {r['ratio']:6.2f} {r['ratio_q1']:5.2f}-{r['ratio_q3']:<5.2f} "
                  f"{r['kiln_ahead_rounds']:4d}/{r['rounds']}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

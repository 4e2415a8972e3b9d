#!/usr/bin/env python3
"""Puts FlashMLA's BF16 decode times beside ours, shape by shape (issue 15's decode-v2 JSON).

  python3 bench/gpu/merge_anchor.py --ours OURS.json [OURS2.json ...] --flashmla FM.json [...] \
      --out docs/benchmarks/gpu/decode-v2-DATE.json

OURS: bench_gpu_decode --json (one per --s-q); FM: the anchor's bench_flashmla.py --json (one per
--s-q). Every row of ours gets flashmla_bf16_ms (null where FlashMLA did not run that shape) and
speedup_vs_flashmla = flashmla_bf16_ms / ms; both copy bandwidths are kept. Prints the ratio table.
"""
import argparse, json, sys

ap = argparse.ArgumentParser()
ap.add_argument("--ours", nargs="+", required=True)
ap.add_argument("--flashmla", nargs="+", required=True)
ap.add_argument("--out", required=True)
args = ap.parse_args()

anchor, anchor_copy = {}, None
for path in args.flashmla:
    fm = json.load(open(path))
    anchor_copy = fm.get("copy_gbps", anchor_copy)
    for r in fm["rows"]:
        anchor[(r["H"], r["B"], r["ctx"], r.get("s_q", 1))] = r["ms"]

rows, card, copy = [], None, None
for path in args.ours:
    ours = json.load(open(path))
    card, copy = ours.get("card", card), ours.get("copy_gbps", copy)
    for r in ours["rows"]:
        s_q = r.get("s_q", 1)
        fm = anchor.get((r["heads"], r["batch"], r["context"], s_q))
        rows.append({"format": r["format"], "heads": r["heads"], "batch": r["batch"],
                     "context": r["context"], "s_q": s_q, "ms": r["ms"], "flashmla_bf16_ms": fm,
                     "speedup_vs_flashmla": fm / r["ms"] if fm else None,
                     "gbps": r["gbps"], "tflops": r["tflops"], "kernel": r.get("kernel")})
if not rows:
    sys.exit("merge_anchor: no rows in " + " ".join(args.ours))
json.dump({"device": card, "copy_gbps": copy, "flashmla_copy_gbps": anchor_copy,
           "timing": "both: CUDA graph, events, L2 flushed before each repeat, median",
           "rows": rows}, open(args.out, "w"), indent=1)
print("| format | H | B | ctx | s_q | ms | FlashMLA BF16 ms | vs FlashMLA | GB/s | TFLOP/s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    fm = "-" if r["flashmla_bf16_ms"] is None else f"{r['flashmla_bf16_ms']:.3f}"
    ratio = "-" if r["speedup_vs_flashmla"] is None else f"{r['speedup_vs_flashmla']:.2f}x"
    print(f"| {r['format']} | {r['heads']} | {r['batch']} | {r['context']} | {r['s_q']} | "
          f"{r['ms']:.3f} | {fm} | {ratio} | {r['gbps']:.0f} | {r['tflops']:.1f} |")
print(f"wrote {args.out}")

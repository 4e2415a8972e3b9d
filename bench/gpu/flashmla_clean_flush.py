#!/usr/bin/env python3
"""The FlashMLA anchor's benchmark with a clean L2 flush.

Usage (on the GPU machine): python3 bench/gpu/flashmla_clean_flush.py .anchor/bench_flashmla.py ARGS...

Runs the anchor's script (../shared/anchors/flashmla/bench_flashmla.py, carried as .anchor/) with
its arguments, changed in one statement only: its flush before each replay, a 256 MB memset, is
followed by a read of the buffer, as `bench_gpu_decode --clean-flush` flushes. A memset alone
leaves the L2 full of dirty lines, which the timed kernel writes back as its own copies fill the
L2; with the read, both benchmarks time their kernels from clean lines (docs/benchmarks.md,
"Forty-seventh session").
"""
import sys

FLUSH = "flush.zero_()"
CLEAN_FLUSH = "flush.zero_(); flush.sum()"  # the sum reads every byte back into the L2

if len(sys.argv) < 2:
    sys.exit(__doc__)
script = sys.argv[1]
with open(script) as f:
    source = f.read()
if source.count(FLUSH) != 1:
    sys.exit(f"flashmla_clean_flush.py: {script} has {source.count(FLUSH)} '{FLUSH}', expected 1")
sys.argv = sys.argv[1:]
exec(compile(source.replace(FLUSH, CLEAN_FLUSH), script, "exec"),
     {"__name__": "__main__", "__file__": script})

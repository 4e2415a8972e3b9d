"""Checks the CUDA runner's evaluations against the CPU runner's: reads JSON lines written in
pairs (the CPU's, then the CUDA's, for one evaluation each), prints one row per pair and exits 1
when a perplexity differs by more than 0.1% or a pass-key result (which prompts pass) differs.
  python3 compare_devices.py LABEL=FILE.jsonl ...   (each file: cpu, cuda, cpu, cuda, ...)"""
import json
import sys

PPL_TOLERANCE = 1e-3


def main(args):
    failed = False
    for arg in args:
        label, path = arg.split("=", 1)
        rows = [json.loads(line) for line in open(path) if line.strip().startswith("{")]
        if not rows:
            print(f"{label}: no results in {path}")
            failed = True
        if len(rows) % 2:
            print(f"{label}: odd number of results in {path}")
            failed = True
        for cpu, cuda in zip(rows[0::2], rows[1::2]):
            cache = cpu.get("cache", "?")
            if "ppl" in cpu:
                rel = abs(cuda["ppl"] - cpu["ppl"]) / cpu["ppl"]
                ok = rel <= PPL_TOLERANCE and cpu["tokens"] == cuda["tokens"]
                print(f"{label:28s} {cache:40s} ppl cpu {cpu['ppl']:.4f} cuda {cuda['ppl']:.4f} "
                      f"({100 * rel:.3f}%, tokens {cpu['tokens']}) {'ok' if ok else 'FAIL'}")
            else:
                failed_cpu = sorted(f["index"] for f in cpu.get("failures", []))
                failed_cuda = sorted(f["index"] for f in cuda.get("failures", []))
                ok = cpu["correct"] == cuda["correct"] and failed_cpu == failed_cuda
                print(f"{label:28s} {cache:40s} pass-key cpu {cpu['correct']}/{cpu['n']} "
                      f"cuda {cuda['correct']}/{cuda['n']} {'ok' if ok else 'FAIL'}")
            failed = failed or not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

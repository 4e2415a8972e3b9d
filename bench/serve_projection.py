#!/usr/bin/env python3
"""Projects bench-serve throughput on workloads not yet run, from runs that were measured.

For planning a device run, not a result: every figure it prints is labelled a projection.

1. Each measured bench-serve JSON's workload is replayed by `quantmla bench-serve --schedule-only`
   (the scheduler makes the same decisions without the model: the replay gives the same steps,
   preemptions and recomputed tokens as the measured run), whose --step-log gives every step's
   decodes n, the keys they attend over K, and its prefill tokens p.
2. One step-time model is fitted to the measured runs' wall time of decode-only steps and of steps
   with prefill, by least squares on relative errors:
       t = a + b n + tau p + c E(n + p) + d_format K + g G + s S
   E(T) = 1 - (1 - k / N)^T, the expected share of the N routed experts that T tokens choosing k
   each read (their weights are most of a step's bytes); d per cache format (attention reads the
   cache); G = 1 for a decode step that is not a graph replay (the first and second occurrence of
   its batch size for the pool, the CUDA runner's policy with its map of 64 graphs cleared whole
   when full); S the GB the step's swaps copied out and in (the step log's swap_bytes; 0 in logs
   from before that column); a, b, tau, c, g and s shared by every format (the same weights and
   GEMMs; s stays 0 until a measured run has swapped). Each run's
   first format also carries the process's one-time costs, h seconds (kernel loading, GEMM plans),
   in its prefill steps.
   A measured run whose --step-log sits beside its JSON (NAME-steps.csv, as bench/gpu/run-serve.sh
   writes it, or NAME-steps.csv.xz, as docs/benchmarks/serving keeps the large ones) is fitted
   step by step instead (one sum per kind of step and batch bucket of 16), and
   a run after a warm-up (the JSON's warmup) carries no G and no h.
3. It prints each measured run beside the model (the residuals say how far to trust it), where
   each run's time goes by the model (its terms in groups: the experts' weights, the fixed cost,
   the attention, the per-token work, captures, swaps; ms a step), and
   for each run with a step log its output tok/s over the whole job and over its queued part (the
   steps up to the last one that left a request waiting, which the replay tells; the times are
   the run's own), then replays each --project workload and costs its steps with the model twice:
   cold, as the runs it was fitted to (G and h as they fall), and warm (G = 0, h = 0: bench-serve
   --warmup full). A finite job ends in a drain of ~output-len steps at falling batches, a larger
   share of the formats that hold more requests at once; the queued part is the steady state of a
   server whose queue does not empty.

  python3 bench/serve_projection.py --quantmla build/quantmla --model DIR \
      --measured docs/benchmarks/serving/h200-v2-lite-pressure.json ... \
      --project 1024:512:128 --project 512:256:1024:637009920:16384:1024

DIR needs only config.json (`quantmla make-random-model --preset deepseek-v2-lite --config-only`).
A --project workload is REQUESTS:INPUT:OUTPUT[:CACHE_BYTES[:MAX_BATCHED_TOKENS:MAX_SEQS]]; the
default budget is 1/8 of the workload's peak tokens in BF16 (the issue's workload P).
--attention-speedup CACHE=FACTOR (repeatable) asks what if that format's decode attention were
FACTOR times faster: its fitted d is divided by FACTOR in the projections (never in the fit), e.g.
the INT4 kernel at issue 15's 16-head target (3.0x FlashMLA's BF16 speed, ~2x today's). An upper
bound: d K carries whatever grows with the cached keys, which rise with the batch, and on the
H100's 768-request runs it is 2.7-3.1x the decode kernel's own time (the kernel left out of every
layer at the serving batches: 14 us a layer at 25 BF16 sequences, 22 at 81 INT4 ones,
docs/benchmarks.md, "Twenty-sixth session").
--swap-gbps R costs the projected swaps' copies at R GB/s each way instead of the fitted s (e.g.
bench_runner --swap's rate, before a measured run has swapped)."""
import argparse
import csv
import json
import lzma
import os
import subprocess
import sys
import tempfile

SHARED = ["a", "b", "tau", "c", "g", "h", "s"]
TERMS = len(SHARED) + 1  # and K, whose coefficient d is the format's
GRAPH_MAP, GRAPH_TOKENS = 64, 256  # CudaRunner::kMaxGraphs, CudaRunnerOptions::max_graph_tokens


def replay(quantmla, model, requests, input_len, output_len, ratio, seed, cache_bytes, mbt, seqs,
           caches, extra=()):
    """Step logs of a schedule-only replay: {cache: [(n, K, p, S), ...]}, {cache: the output tokens
    of its queued steps (bench-serve's queued_steps: those up to the last that left a request
    waiting) a step}, its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        log, out = os.path.join(tmp, "steps.csv"), os.path.join(tmp, "run.json")
        cmd = [quantmla, "bench-serve", "--schedule-only", "--model", model, "--num-prompts",
               str(requests), "--input-len", str(input_len), "--output-len", str(output_len),
               "--random-range-ratio", str(ratio), "--seed", str(seed), "--cache-memory",
               str(cache_bytes), "--max-batched-tokens", str(mbt), "--max-seqs", str(seqs),
               "--step-log", log, "--json", out]
        for c in caches:
            cmd += ["--cache", c]
        cmd += list(extra)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        steps, generated = {}, {}
        with open(log) as f:
            for row in csv.DictReader(f):
                steps.setdefault(row["cache"], []).append(step_of(row))
                generated.setdefault(row["cache"], []).append(int(row["generated"]))
        with open(out) as f:
            replayed = json.load(f)
        queued = {r["cache"]: generated[r["cache"]][:r["queued_steps"]]
                  for r in replayed["formats"]}
        return steps, queued, replayed


def replay_measured(args, m):
    """replay() of a measured bench-serve JSON's workload, budget, limits and swap space."""
    return replay(args.quantmla, args.model, m["requests"], m["input_len"], m["output_len"],
                  m["random_range_ratio"], m["seed"], m["cache_memory_bytes"],
                  m["max_batched_tokens"], m["max_seqs"], [r["cache"] for r in m["formats"]],
                  ["--swap-space", str(m.get("swap_space_bytes", 0) / 2**30)])


def step_of(row):
    """A step log's row as (n, K, p, S): S the GB its swaps copied (0 in logs from before the
    column)."""
    return (int(row["decodes"]), int(row["decode_context"]), int(row["prefill_tokens"]),
            int(row.get("swap_bytes") or 0) / 1e9)


def step_terms(steps, experts, top_k, first, warm=False):
    """Each step's kind ("decode" or "prefill"), its batch bucket (16 decodes wide) and the model's
    terms [1, n, p, E, G, h, S, K]; `first`: the run's first format (h on its first step); warm: a
    run after a warm-up pass (no graph captures, no one-time costs)."""
    graphs = {}  # batch size -> uncaptured runs so far (2: captured)
    for index, (n, keys, p, swap_gb) in enumerate(steps):
        share = 1.0 - (1.0 - top_k / experts) ** (n + p)
        not_replayed = 0.0
        if p == 0 and 0 < n <= GRAPH_TOKENS and not warm:
            if len(graphs) >= GRAPH_MAP and n not in graphs:
                graphs.clear()
            graphs[n] = graphs.get(n, 0) + 1
            not_replayed = 1.0 if graphs[n] <= 2 else 0.0
        one_time = 1.0 if first and index == 0 and not warm else 0.0
        kind = "prefill" if p > 0 else "decode"
        yield kind, (n + 15) // 16, [1.0, n, p, share, not_replayed, one_time, swap_gb,
                                     keys / 1000.0]


def features(steps, experts, top_k, first, warm=False):
    """The terms summed over decode-only steps and over steps with prefill."""
    sums = {"decode": [0.0] * TERMS, "prefill": [0.0] * TERMS}
    for kind, _, term in step_terms(steps, experts, top_k, first, warm):
        sums[kind] = [s + t for s, t in zip(sums[kind], term)]
    return sums


def read_step_log(path):
    """A measured run's --step-log (or its .xz): {cache: ([(n, K, p, S), ...], [seconds, ...])};
    None without one or without times."""
    opener = open
    if not os.path.exists(path):
        if not os.path.exists(path + ".xz"):
            return None
        path, opener = path + ".xz", lzma.open
    logs = {}
    with opener(path, "rt") as f:
        for row in csv.DictReader(f):
            if "step_ms" not in row:
                return None
            steps, seconds = logs.setdefault(row["cache"], ([], []))
            steps.append(step_of(row))
            seconds.append(float(row["step_ms"]) / 1e3)
    return logs


def solve(rows, targets):
    """Least squares by the normal equations (a few unknowns; no numpy here)."""
    m = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(m)] for i in range(m)]
    atb = [sum(r[i] * t for r, t in zip(rows, targets)) for i in range(m)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(ata[r][col]))
        ata[col], ata[pivot] = ata[pivot], ata[col]
        atb[col], atb[pivot] = atb[pivot], atb[col]
        for r in range(m):
            if r != col and ata[col][col] != 0:
                f = ata[r][col] / ata[col][col]
                ata[r] = [x - f * y for x, y in zip(ata[r], ata[col])]
                atb[r] -= f * atb[col]
    # An unknown no row measures (G and h where every fitted run was warm) stays 0.
    return [atb[i] / ata[i][i] if ata[i][i] != 0 else 0.0 for i in range(m)]


def modeled(params, caches, cache, sums):
    d = params[len(SHARED) + caches.index(cache)]
    shared = len(SHARED)
    return sum(p * s for p, s in zip(params[:shared], sums[:shared])) + d * sums[shared]


def design_row(caches, cache, sums):
    shared = len(SHARED)
    row = list(sums[:shared]) + [0.0] * len(caches)
    row[shared + caches.index(cache)] = sums[shared]
    return row


# The model's terms in the groups that the breakdown prints (issue 14: "GEMMs, attention, the
# rest"): the routed experts' weights, the fixed cost of a step, the decode attention, the
# per-token work, graph captures and one-time costs, the swaps' copies.
TERM_GROUPS = [("experts", ["c"]), ("fixed", ["a"]), ("attention", ["d"]),
               ("per token", ["b", "tau"]), ("captures", ["g", "h"]), ("swap", ["s"])]


def print_breakdown(params, caches, runs):
    """Where each measured run's time goes by the fitted model: each group of terms times its
    coefficients, summed over the run's steps, in ms a step and as a share of the model's time."""
    totals = {}  # (run, cache) -> (the terms summed over every step, measured seconds)
    for label, cache, _, sums, seconds in runs:
        acc, measured = totals.get((label, cache), ([0.0] * TERMS, 0.0))
        totals[(label, cache)] = ([a + b for a, b in zip(acc, sums)], measured + seconds)
    print("\nwhere each measured run's time goes by the model, ms a step (share of the model's;"
          " attention: the term in the cached keys, an upper bound on the decode kernel's time)")
    print(f"{'measured run':<44} {'cache':<32} " +
          " ".join(f"{name:>15}" for name, _ in TERM_GROUPS) + f" {'model':>7} {'measured':>8}")
    for (label, cache), (sums, measured) in totals.items():
        steps = sums[SHARED.index("a")]  # the constant term: 1 a step
        parts = []
        for _, names in TERM_GROUPS:
            seconds = 0.0
            for name in names:
                if name == "d":
                    seconds += params[len(SHARED) + caches.index(cache)] * sums[len(SHARED)]
                else:
                    seconds += params[SHARED.index(name)] * sums[SHARED.index(name)]
            parts.append(seconds)
        model = sum(parts)
        print(f"{label:<44} {cache:<32} " +
              " ".join(f"{1e3 * x / steps:7.3f} ({100 * x / model:4.1f}%)" for x in parts) +
              f" {1e3 * model / steps:7.2f} {1e3 * measured / steps:8.2f}")


def print_queued_parts(args):
    """Each measured run with a step log: output tok/s over the whole job and over its queued
    part (the steps up to the last that left a request waiting: the replay, which takes the same
    schedule, says which; the times are the run's own)."""
    printed = False
    for path in args.measured:
        logged = read_step_log(path.removesuffix(".json") + "-steps.csv")
        if logged is None:
            continue
        with open(path) as f:
            m = json.load(f)
        steps, queued, _ = replay_measured(args, m)
        if not printed:
            print(f"\n{'measured run':<44} {'cache':<32} {'steps':>6} {'queued':>6} "
                  f"{'out tok/s':>9} {'queued/s':>9}")
            printed = True
        for r in m["formats"]:
            cache = r["cache"]
            measured_steps, seconds = logged[cache]
            if steps[cache] != measured_steps:
                sys.exit(f"{path} {cache}: the replay's steps differ from the run's step log")
            generated = queued[cache]
            rate = sum(generated) / sum(seconds[:len(generated)]) if generated else 0.0
            print(f"{os.path.basename(path).removesuffix('.json'):<44} {cache:<32} "
                  f"{len(seconds):6d} {len(generated):6d} {r['output_tok_s']:9.0f} {rate:9.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantmla", default="build/quantmla")
    ap.add_argument("--model", required=True, help="directory with the model's config.json")
    ap.add_argument("--measured", nargs="+", required=True, help="bench-serve JSON files")
    ap.add_argument("--project", action="append", default=[], help="REQ:IN:OUT[:BYTES[:MBT:SEQS]]")
    ap.add_argument("--project-args", default="",
                    help="more bench-serve flags for the projected runs' replays")
    ap.add_argument("--attention-speedup", action="append", default=[], metavar="CACHE=FACTOR",
                    help="project with that format's attention term d divided by FACTOR")
    ap.add_argument("--swap-gbps", type=float, default=0.0,
                    help="project with the swaps' copies at this rate (GB/s each way) instead of "
                         "the fitted s")
    args = ap.parse_args()
    if args.swap_gbps < 0:
        sys.exit(f"--swap-gbps {args.swap_gbps}: expected a rate > 0")
    speedups = {}
    for spec in args.attention_speedup:
        cache, _, factor = spec.rpartition("=")
        try:
            value = float(factor)
        except ValueError:
            value = 0.0
        if not cache or not value > 0:
            sys.exit(f"--attention-speedup {spec}: expected CACHE=FACTOR with FACTOR > 0")
        speedups[cache] = value
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]

    runs = []  # (label, cache, kind and batch bucket, the terms summed, measured seconds)
    caches = []
    for path in args.measured:
        with open(path) as f:
            m = json.load(f)
        formats = [r["cache"] for r in m["formats"]]
        warm = m.get("warmup", "none") != "none"
        label = os.path.basename(path).removesuffix(".json")
        logged = read_step_log(path.removesuffix(".json") + "-steps.csv")
        if logged is not None:
            # Measured step by step: one equation per kind of step and batch bucket.
            for index, cache in enumerate(formats):
                if cache not in caches:
                    caches.append(cache)
                steps, seconds = logged[cache]
                buckets = {}
                for (kind, bucket, term), t in zip(
                        step_terms(steps, experts, top_k, index == 0, warm), seconds):
                    sums, total = buckets.get((kind, bucket), ([0.0] * TERMS, 0.0))
                    buckets[(kind, bucket)] = ([a + b for a, b in zip(sums, term)], total + t)
                for (kind, bucket), (sums, total) in sorted(buckets.items()):
                    if total > 0:
                        runs.append((label, cache, f"{kind} n<={16 * bucket}", sums, total))
            continue
        steps, _, replayed = replay_measured(args, m)
        for index, (r, again) in enumerate(zip(m["formats"], replayed["formats"])):
            if (r["steps"], r["preemptions"]) != (again["steps"], again["preemptions"]):
                sys.exit(f"{path} {r['cache']}: the replay took {again['steps']} steps and "
                         f"{again['preemptions']} preemptions, the run {r['steps']} and "
                         f"{r['preemptions']}: not the same schedule")
            if r["cache"] not in caches:
                caches.append(r["cache"])
            sums = features(steps[r["cache"]], experts, top_k, index == 0, warm)
            for kind in ("decode", "prefill"):
                seconds = r[f"{kind}_steps_s"]
                if seconds > 0:
                    runs.append((label, r["cache"], kind, sums[kind], seconds))

    rows = [[x / s for x in design_row(caches, c, sums)] for _, c, _, sums, s in runs]
    params = solve(rows, [1.0] * len(rows))
    print("step-time model (ms): " + ", ".join(
        f"{n} {v * 1e3:.4g}" for n, v in zip(SHARED, params)) + "; d per 1K keys: " + ", ".join(
        f"{c} {v * 1e3:.4g}" for c, v in zip(caches, params[len(SHARED):])))
    worst = max(abs(modeled(params, caches, c, sums) / sec - 1) for _, c, _, sums, sec in runs)
    print(f"largest error over the {len(runs)} measured sums: {100 * worst:.1f}%")
    print(f"{'measured run':<44} {'cache':<32} {'kind':<14} {'measured s':>10} {'model s':>8} "
          f"{'error':>6}")
    for label, cache, kind, sums, seconds in runs:
        t = modeled(params, caches, cache, sums)
        print(f"{label:<44} {cache:<32} {kind:<14} {seconds:10.2f} {t:8.2f} "
              f"{100 * (t / seconds - 1):+5.1f}%")

    print_breakdown(params, caches, runs)
    print_queued_parts(args)

    unknown = sorted(set(speedups) - set(caches))
    if unknown:
        sys.exit(f"--attention-speedup: {', '.join(unknown)} not among the measured formats "
                 f"({', '.join(caches)})")
    projected = list(params)
    for cache, factor in speedups.items():
        projected[len(SHARED) + caches.index(cache)] /= factor
    if speedups:
        print("projected with d per 1K keys: " + ", ".join(
            f"{c} {v * 1e3:.4g}" for c, v in zip(caches, projected[len(SHARED):])) +
              " (--attention-speedup: a what-if, not a fitted value)")
    if args.swap_gbps > 0:
        projected[SHARED.index("s")] = 1.0 / args.swap_gbps
        print(f"projected with the swaps' copies at {args.swap_gbps:g} GB/s each way "
              "(--swap-gbps: a what-if, not a fitted value)")

    for spec in args.project:
        parts = [int(x) for x in spec.split(":")]
        requests, input_len, output_len = parts[:3]
        bf16_bytes = config["num_hidden_layers"] * (config["kv_lora_rank"] +
                                                    config["qk_rope_head_dim"]) * 2
        budget = parts[3] if len(parts) > 3 else requests * (input_len + output_len) * bf16_bytes // 8
        mbt, seqs = (parts[4], parts[5]) if len(parts) > 5 else (2048, 256)
        steps, queued, replayed = replay(args.quantmla, args.model, requests, input_len,
                                         output_len, 0.0, 0, budget, mbt, seqs, caches,
                                         args.project_args.split())
        for warm in (False, True):
            print(f"\nprojection (a model, not a measurement), {'warm' if warm else 'cold'}: "
                  f"{requests} x {input_len}/{output_len}, {budget} bytes, "
                  f"--max-batched-tokens {mbt} --max-seqs {seqs} {args.project_args}")
            # "queued": the steps up to the last that left a request waiting (before the drain).
            print(f"{'cache':<32} {'pages':>6} {'peak':>5} {'batch':>6} {'preem':>6} "
                  f"{'decode s':>9} {'prefill s':>9} {'out tok/s':>9} {'vs bf16':>7} {'vs fp8':>7} "
                  f"{'queued/s':>9} {'vs bf16':>7}")
            tok_s, queued_tok_s = {}, {}
            for index, r in enumerate(replayed["formats"]):
                cache = r["cache"]
                sums = features(steps[cache], experts, top_k, index == 0, warm)
                dec = modeled(projected, caches, cache, sums["decode"])
                pre = modeled(projected, caches, cache, sums["prefill"])
                tok_s[cache] = r["output_tokens"] / (dec + pre)
                generated = queued[cache]
                queued_s = sum(modeled(projected, caches, cache, term) for _, _, term in
                               list(step_terms(steps[cache], experts, top_k, index == 0,
                                               warm))[:len(generated)])
                queued_tok_s[cache] = sum(generated) / queued_s if queued_s > 0 else 0.0
                base, queued_base = tok_s[caches[0]], queued_tok_s[caches[0]]
                fp8 = next((v for k, v in tok_s.items() if "fp8" in k), None)
                print(f"{cache:<32} {r['pages']:6d} {r['peak_seqs']:5d} "
                      f"{r['mean_batch']:6.1f} {r['preemptions']:6d} {dec:9.2f} {pre:9.2f} "
                      f"{tok_s[cache]:9.0f} {tok_s[cache] / base:6.2f}x "
                      + (f"{tok_s[cache] / fp8:6.2f}x " if fp8 else " " * 8)
                      + f"{queued_tok_s[cache]:9.0f} "
                      + (f"{queued_tok_s[cache] / queued_base:6.2f}x" if queued_base > 0 else ""))


if __name__ == "__main__":
    main()

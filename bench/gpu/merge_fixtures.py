#!/usr/bin/env python3
"""Adds the `fixtures` rows of runner-DATE.json from test_cuda_runner's output: per fixture and
device, the largest logit difference against transformers, the argmax agreement and, for the
CUDA runner, how many greedy tokens match before a reference near-tie.
    python3 bench/gpu/merge_fixtures.py RUNNER_JSON TEST_CUDA_RUNNER_OUTPUT
"""
import json
import re
import sys

runner_path, test_path = sys.argv[1], sys.argv[2]
prefill = re.compile(r"^(mla-moe16-v\d) (cuda|cpu) prefill .*?max\|d\| (\S+) .*?argmax (\d+)/(\d+)")
greedy = re.compile(r"^(mla-moe16-v\d) cuda greedy\s+(\d+)/(\d+) tokens identical")
rows, greedy_of = [], {}
for line in open(test_path, encoding="utf-8"):
    if m := prefill.match(line):
        rows.append({"name": m[1], "device": m[2], "max_abs_logit_diff": float(m[3]),
                     "argmax_agree": int(m[4]), "rows": int(m[5])})
    elif m := greedy.match(line):
        greedy_of[m[1]] = f"{m[2]}/{m[3]}"
for row in rows:
    if row["device"] == "cuda":
        row["greedy_match"] = greedy_of.get(row["name"])
if not rows:
    sys.exit(f"no fixture rows in {test_path}")
runner = json.load(open(runner_path, encoding="utf-8"))
runner["fixtures"] = rows
with open(runner_path, "w", encoding="utf-8") as f:
    json.dump(runner, f, indent=2)
    f.write("\n")
print(f"{len(rows)} fixture rows into {runner_path}")

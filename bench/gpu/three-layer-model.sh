# Sourced by the per-kernel profile and the ablation (profile-runner.sh, ablate-runner.sh): sets
# `model` to a 3-layer random V2-Lite (one dense, two MoE layers), made once per machine with
# $build's quantmla; both scripts read the same cached directory, so it is made in one place.
model=/tmp/v2-lite-3
[[ -f $model/config.json ]] || $build/quantmla make-random-model --preset deepseek-v2-lite \
  --layers 3 --out $model --seed 1 >/dev/null 2>&1 || { echo "make-random-model failed"; exit 1; }

# P9 of today's tree against an older revision's, alternating on one TPU chip (issue 62: context=1 costs nothing).
#
# Here, in the repository root (the old tree travels as an ignored, carried folder):
#   echo /.p9_old/ >> .git/info/exclude
#   mkdir -p .p9_old/tree && git archive REV benchmarks spmd trainers configs | tar -x -C .p9_old/tree
# On the chip (the device tool, carry [".whl-tpu", ".p9_old"]):
#   eval "$(benchmarks/tpu_setup.sh)"; bash benchmarks/investigations/p9_side_by_side/run.sh
# Each run is its own process: tpu_check.on_device at 8 rows, 20 steps after 3 warm-up.
set -u
NEW=$PWD; OLD=$PWD/.p9_old/tree; HERE=$NEW/benchmarks/investigations/p9_side_by_side
for round in 1 2 3; do
  for tree in new old; do
    if [ $(( round % 2 )) = 0 ]; then tree=$([ $tree = new ] && echo old || echo new); fi
    dir=$([ $tree = new ] && echo "$NEW" || echo "$OLD")
    (cd "$dir" && timeout 200 python3 "$HERE/p9.py" 8 20 $tree 2>&1 | grep P9JSON | tee -a "$OUT/p9_side_by_side.jsonl")
  done
done

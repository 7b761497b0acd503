# Sourced by the demo-sized run scripts: a local stack serving SmolLM2-135M-Instruct for the script's run.
#   OUT=dir; source scripts/smollm2_stack.sh     -> the stack is up (home $OUT/stack), TREADLE_* exported,
#                                                   and it stops when the script exits
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/treadle/models/SmolLM2-135M-Instruct}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1
mkdir -p "$OUT"
[ -d "$MODEL_DIR" ] || { echo "no model at $MODEL_DIR: run 'treadle demo' once first" >&2; exit 1; }

"$(dirname "$PY")/treadle" up --model "SmolLM2-135M-Instruct=$MODEL_DIR" --runners 0 --home "$OUT/stack" >"$OUT/stack.log" 2>&1 &
STACK=$!
trap 'kill $STACK 2>/dev/null; wait $STACK 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q "treadle is up" "$OUT/stack.log" && break; kill -0 $STACK || { cat "$OUT/stack.log"; exit 1; }; sleep 0.5; done
grep -q "treadle is up" "$OUT/stack.log" || { echo "the stack did not come up in 300 s" >&2; exit 1; }
eval "$(grep -o 'export TREADLE_BROKER_URL=[^ ]* TREADLE_STORAGE_URL=[^ ]*' "$OUT/stack.log")"

#!/usr/bin/env bash
# Train a small GPT-2-BPE model on tinyshakespeare on CPU, then check three promises:
#   1. DP=2 (torchrun, 2 gloo ranks) reaches lm loss < 5.6 by iteration 300;
#   2. DP=1 with the same global batch logs the same loss at every logged iteration (1e-5 relative);
#   3. a run stopped at iteration 100 and resumed prints iterations 101-200 exactly as the uninterrupted run.
# Run from the repository root with ../shared beside it:  bash examples/gpt2_shakespeare.sh [OUT_DIR]
# Takes about 15-30 minutes on a 2-core machine. The sizes and iteration counts below can be overridden from
# the environment; CI's smoke run (tests/test_examples_smoke.py) checks the script's steps with a tiny model:
#   ITERS=4 RESUME_AT=2 LOG_INTERVAL=1 EVAL_INTERVAL=2 EVAL_ITERS=1 WARMUP_ITERS=1 LOSS_BELOW=11 NUM_LAYERS=2 \
#   HIDDEN_SIZE=32 SEQ_LENGTH=32 MICRO_BATCH_SIZE=2 GLOBAL_BATCH_SIZE=4 bash examples/gpt2_shakespeare.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
OUT=${1:-runs/shakespeare}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
ITERS=${ITERS:-300}                   # the DP=2 / DP=1 runs
RESUME_AT=${RESUME_AT:-100}           # the stop/resume check runs 2 x RESUME_AT iterations, stopped at RESUME_AT
LOSS_BELOW=${LOSS_BELOW:-5.6}         # the DP=2 run's lm loss at iteration ITERS must be below this
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-10}
WARMUP_ITERS=${WARMUP_ITERS:-20}
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-128}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}

TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$SHARED/gpt2-vocab.json" --merge-file "$SHARED/gpt2-merges.txt")
python tools/preprocess_data.py --input "$SHARED/tinyshakespeare.jsonl" --output-prefix "$OUT/shakes" \
    --append-eod --workers 2 "${TOKENIZER[@]}"

MODEL=(--num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads 4 --seq-length "$SEQ_LENGTH"
       --max-position-embeddings "$SEQ_LENGTH"
       --hidden-dropout 0 --attention-dropout 0)
OPTIM=(--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1
       --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --global-batch-size "$GLOBAL_BATCH_SIZE" --seed 1234)
DATA=(--data-path "$OUT/shakes_text_document" --split 949,50,1 --num-workers 1 "${TOKENIZER[@]}")
COMMON=("${MODEL[@]}" "${OPTIM[@]}" "${DATA[@]}" --distributed-backend gloo --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS")

torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size "$MICRO_BATCH_SIZE" \
    --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" | tee "$OUT/dp2.log"
torchrun --standalone --nproc_per_node 1 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size "$MICRO_BATCH_SIZE" \
    --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" | tee "$OUT/dp1.log"

rm -rf "$OUT/ckpt"
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size "$MICRO_BATCH_SIZE" \
    --train-iters $((2 * RESUME_AT)) --log-interval 1 | tee "$OUT/full200.log"
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size "$MICRO_BATCH_SIZE" \
    --train-iters $((2 * RESUME_AT)) --log-interval 1 --save "$OUT/ckpt" --save-interval "$RESUME_AT" --exit-interval "$RESUME_AT" | tee "$OUT/first100.log"
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size "$MICRO_BATCH_SIZE" \
    --train-iters $((2 * RESUME_AT)) --log-interval 1 --load "$OUT/ckpt" | tee "$OUT/resumed.log"

python examples/compare_logs.py final-loss "$OUT/dp2.log" --iteration "$ITERS" --below "$LOSS_BELOW"
python examples/compare_logs.py same "$OUT/dp2.log" "$OUT/dp1.log" --rtol 1e-5
python examples/compare_logs.py same "$OUT/full200.log" "$OUT/resumed.log" --from-iteration $((RESUME_AT + 1)) --rtol 0

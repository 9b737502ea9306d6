#!/usr/bin/env bash
# Train a small GPT-2-BPE model on tinyshakespeare on CPU, then check three promises:
#   1. DP=2 (torchrun, 2 gloo ranks) reaches lm loss < 5.6 by iteration 300;
#   2. DP=1 with the same global batch logs the same loss at every logged iteration (1e-5 relative);
#   3. a run stopped at iteration 100 and resumed prints iterations 101-200 exactly as the uninterrupted run.
# Run from the repository root with ../shared beside it:  bash examples/gpt2_shakespeare.sh [OUT_DIR]
# Takes about 15-30 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
OUT=${1:-runs/shakespeare}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1

TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$SHARED/gpt2-vocab.json" --merge-file "$SHARED/gpt2-merges.txt")
python tools/preprocess_data.py --input "$SHARED/tinyshakespeare.jsonl" --output-prefix "$OUT/shakes" \
    --append-eod --workers 2 "${TOKENIZER[@]}"

MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
       --hidden-dropout 0 --attention-dropout 0)
OPTIM=(--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1
       --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --global-batch-size 16 --seed 1234)
DATA=(--data-path "$OUT/shakes_text_document" --split 949,50,1 --num-workers 1 "${TOKENIZER[@]}")
COMMON=("${MODEL[@]}" "${OPTIM[@]}" "${DATA[@]}" --distributed-backend gloo --eval-interval 100 --eval-iters 10)

torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size 8 \
    --train-iters 300 --log-interval 10 | tee "$OUT/dp2.log"
torchrun --standalone --nproc_per_node 1 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size 8 \
    --train-iters 300 --log-interval 10 | tee "$OUT/dp1.log"

rm -rf "$OUT/ckpt"
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size 8 \
    --train-iters 200 --log-interval 1 | tee "$OUT/full200.log"
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size 8 \
    --train-iters 200 --log-interval 1 --save "$OUT/ckpt" --save-interval 100 --exit-interval 100 | tee "$OUT/first100.log"
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --micro-batch-size 8 \
    --train-iters 200 --log-interval 1 --load "$OUT/ckpt" | tee "$OUT/resumed.log"

python examples/compare_logs.py final-loss "$OUT/dp2.log" --iteration 300 --below 5.6
python examples/compare_logs.py same "$OUT/dp2.log" "$OUT/dp1.log" --rtol 1e-5
python examples/compare_logs.py same "$OUT/full200.log" "$OUT/resumed.log" --from-iteration 101 --rtol 0

#!/usr/bin/env bash
# Pipeline parallelism on CPU gives the numbers of one process: train the tinyshakespeare GPT (the
# model of docs/training.md) for 100 iterations at PP=1, PP=2 (1F1B over 2 gloo ranks) and PP=2 x TP=2 (4 ranks),
# same seed, data and global batch, dropout off, and check that every iteration logs the same lm loss
# (1e-5 relative). Each layer's initial weights come from (seed, layer number), so every pipeline
# layout starts from the same model. The vocabulary is padded to 50432 in every run
# (--make-vocab-size-divisible-by 256 without TP, 128 at TP=2), since the padded rows are part of the model.
# Run from the repository root with ../shared beside it:  bash examples/gpt2_shakespeare_pp.sh [OUT_DIR]
# Takes about 10-20 minutes on a 2-core machine. Sizes can be overridden from the environment (CI runs it tiny):
#   ITERS=3 EVAL_INTERVAL=2 EVAL_ITERS=1 WARMUP_ITERS=1 NUM_LAYERS=2 HIDDEN_SIZE=32 SEQ_LENGTH=32 \
#   MICRO_BATCH_SIZE=2 GLOBAL_BATCH_SIZE=4 bash examples/gpt2_shakespeare_pp.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
OUT=${1:-runs/shakespeare_pp}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
ITERS=${ITERS:-100}
EVAL_INTERVAL=${EVAL_INTERVAL:-50}
EVAL_ITERS=${EVAL_ITERS:-5}
WARMUP_ITERS=${WARMUP_ITERS:-20}
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-128}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}

TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$SHARED/gpt2-vocab.json" --merge-file "$SHARED/gpt2-merges.txt")
python tools/preprocess_data.py --input "$SHARED/tinyshakespeare.jsonl" --output-prefix "$OUT/shakes" \
    --append-eod --workers 2 "${TOKENIZER[@]}"

COMMON=(--num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads 4 --seq-length "$SEQ_LENGTH"
        --max-position-embeddings "$SEQ_LENGTH" --hidden-dropout 0 --attention-dropout 0
        --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1
        --clip-grad 1.0 --global-batch-size "$GLOBAL_BATCH_SIZE" --micro-batch-size "$MICRO_BATCH_SIZE" --seed 1234
        --train-iters "$ITERS" --log-interval 1
        --data-path "$OUT/shakes_text_document" --split 949,50,1 --num-workers 1 "${TOKENIZER[@]}"
        --distributed-backend gloo --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS")

torchrun --standalone --nproc_per_node 1 pretrain_gpt.py "${COMMON[@]}" --make-vocab-size-divisible-by 256 \
    | tee "$OUT/pp1.log"
# The log line is printed by the last rank, which holds the last pipeline stage (and the loss).
torchrun --standalone --nproc_per_node 2 pretrain_gpt.py "${COMMON[@]}" --make-vocab-size-divisible-by 256 \
    --pipeline-model-parallel-size 2 | tee "$OUT/pp2.log"
torchrun --standalone --nproc_per_node 4 pretrain_gpt.py "${COMMON[@]}" --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 | tee "$OUT/pp2_tp2.log"

for run in pp2 pp2_tp2; do
    python examples/compare_logs.py same "$OUT/pp1.log" "$OUT/$run.log" --rtol 1e-5
done
echo "PP=2 and PP=2 x TP=2 logged the PP=1 losses at every iteration."

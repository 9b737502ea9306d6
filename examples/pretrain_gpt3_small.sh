#!/usr/bin/env bash
# GPT-3 small (125M: 12 layers, hidden 768, 12 heads, 2048 tokens; Brown et al. 2020, table 2.1) on one node.
# Run from anywhere:  bash examples/pretrain_gpt3_small.sh [EXTRA pretrain_gpt.py FLAGS...]
# Every setting below can be overridden from the environment, e.g. a CPU smoke run (what CI does):
#   GPUS_PER_NODE=1 NUM_LAYERS=2 HIDDEN_SIZE=32 NUM_HEADS=4 SEQ_LENGTH=32 MICRO_BATCH_SIZE=2 GLOBAL_BATCH_SIZE=4 \
#   TRAIN_ITERS=3 WARMUP_ITERS=1 PRECISION= bash examples/pretrain_gpt3_small.sh
# Flags given after the script name are appended and win over the ones here.
set -euo pipefail

# ---- what a user changes --------------------------------------------------------------------------------
GPUS_PER_NODE=${GPUS_PER_NODE:-8}                  # processes on this node (one per GPU)
TP=${TP:-1}                                         # tensor-parallel size (keep it <= GPUS_PER_NODE)
DATA_PATH=${DATA_PATH:-}                            # .bin/.idx prefix from tools/preprocess_data.py; empty: --mock-data
VOCAB_FILE=${VOCAB_FILE:-../shared/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-../shared/data/gpt2-merges.txt}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-runs/gpt3_small/ckpt}   # --save and --load (resumes when it holds a checkpoint)
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/gpt3_small/tensorboard}
NUM_LAYERS=${NUM_LAYERS:-12}
HIDDEN_SIZE=${HIDDEN_SIZE:-768}
NUM_HEADS=${NUM_HEADS:-12}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}        # 256 x 2048 = 0.5M tokens per step, as GPT-3 small
TRAIN_ITERS=${TRAIN_ITERS:-572000}                 # ~300B tokens
WARMUP_ITERS=${WARMUP_ITERS:-715}                  # 375M tokens
LR=${LR:-6.0e-4}
PRECISION=${PRECISION---bf16}                      # --bf16, --fp16, or empty for fp32 (CPU)
# ----------------------------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
if [[ -n "$DATA_PATH" ]]; then DATA=(--data-path "$DATA_PATH" --split 949,50,1); else DATA=(--mock-data); fi

torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS" \
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" \
    --tensor-model-parallel-size "$TP" $PRECISION \
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" \
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 6.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 \
    --clip-grad 1.0 --init-method-std 0.02 \
    "${DATA[@]}" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR" \
    "$@"

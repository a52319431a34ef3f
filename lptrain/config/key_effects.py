"""Keys whose effect comes later than a built model or a first optimizer step can show.

``tests/unit/config/test_key_effects.py`` proves for every schema key and every shipped
recipe that a changed value is either refused (a rule in ``rulesets/inert.py`` names why it
would have no effect there) or changes something observable: the built model, the buffer
layout, the optimizer's groups and hyper-parameters, the resolved settings, or the first
optimizer steps. Some keys act later than that -- at intervals, on signals, through paths and
files, in the data pipeline, at world sizes above one, or on another backend -- so no first
step can show them. They are listed here, each with what it does and the test that proves
it; ``docs/rules.md`` shows this table. (Where such a key would have no effect in a config,
an inert-key rule still refuses it: ``checkpoint.keep_latest`` without ``checkpoint.save``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LaterEffect:
    what: str
    test: str  # pytest node id, relative to the repository root
    # What the test's module must mention (default: the key's last part); "" when the test
    # proves the property the value promises rather than setting the key.
    mentions: Optional[str] = None


_LATER = "tests/e2e/test_key_effects_later.py"

LATER_KEYS: dict[str, LaterEffect] = {
    "run.name": LaterEffect("names the run: the default run folder (`runs/${run.name}`) and the W&B run",
                            "tests/unit/config/test_config_compose.py::test_interpolation"),
    "run.output_dir": LaterEffect("the run folder that pretrain writes",
                                  "tests/e2e/test_cli_config.py::test_pretrain_writes_resolved_config_then_trains"),
    "run.cpu_threads": LaterEffect(
        "the intra-op CPU threads of each rank (null: chosen from the CPUs it can have)",
        "tests/unit/distributed/test_threads.py::test_the_thread_count_follows_the_free_cpus"),
    "run.device": LaterEffect("where the model lives (auto, cpu, cuda)",
                              "tests/unit/precision/test_device_and_backend.py::test_resolve_device"),
    "precision.backend": LaterEffect(
        "which implementation runs the quantized GEMMs (Transformer Engine or the bit-faithful "
        "emulation: the same numbers by design)",
        "tests/unit/precision/test_factory.py::test_te_backend_dispatches_to_te_adapter"),
    "precision.quantized_gemm": LaterEffect(
        "what runs the emulated backend's quantized GEMMs: torch's scaled GEMM on the stored "
        "codes and scales, or fp32 GEMMs of the dequantized operands (on the CPU the per-tensor "
        "recipes give the same bits either way; the kernels differ on a GPU)",
        "tests/unit/precision/test_scaled_gemm.py::test_tiny_cpu_trains_through_scaled_mm_like_dequantized"),
    "precision.fp8_amax_history_len": LaterEffect(
        "delayed scaling: how many steps of amax the scale looks back over (from the third step on)",
        "tests/unit/precision/test_delayed.py::test_history_roll_and_max_vs_most_recent",
        "amax_history_len"),
    "precision.fp8_amax_compute_algo": LaterEffect(
        "delayed scaling: max over the history or the most recent amax (from the third step on)",
        "tests/unit/precision/test_delayed.py::test_history_roll_and_max_vs_most_recent",
        "amax_compute_algo"),
    "dist.distributed_timeout_minutes": LaterEffect(
        "at dp > 1: how long a collective waits for its peers, and a rank may make no progress, "
        "before the job stops naming the rank",
        "tests/e2e/test_faults_hang.py::test_hung_rank_is_named_and_the_job_exits_3"),
    "model.tensor_model_parallel_size": LaterEffect(
        "splits the GEMM layers over that many ranks (a world of one rank cannot build it)",
        "tests/dist/test_tensor_parallel.py::test_tp2_forward_backward_matches_tp1"),
    "model.sequence_parallel": LaterEffect(
        "with TP > 1: norms and residuals on sequence shards, all-gather / reduce-scatter "
        "around the TP GEMMs",
        "tests/dist/test_tensor_parallel.py::test_tp2_forward_backward_matches_tp1"),
    "model.pipeline_model_parallel_size": LaterEffect(
        "cuts the layers into that many pipeline stages on as many ranks (a world of one rank "
        "cannot build it)",
        "tests/dist/test_pipeline_parallel.py::test_pp2_matches_pp1_bitwise"),
    "model.context_parallel_size": LaterEffect(
        "splits every sequence over that many ranks, attention exchanging keys and values (a "
        "world of one rank cannot build it)",
        "tests/dist/test_context_parallel.py::test_cp2_matches_cp1"),
    "model.cp_comm_type": LaterEffect(
        "with CP > 1: how attention exchanges keys and values (ring, all-to-all, all-gather, "
        "hierarchical): the same attention",
        "tests/dist/test_context_parallel.py::test_cp2_matches_cp1"),
    "model.hierarchical_context_parallel_sizes": LaterEffect(
        "with cp_comm_type=a2a+p2p: the all-to-all and ring levels of each CP group",
        "tests/dist/test_context_parallel.py::test_hierarchical_cp4_matches_dp4"),
    "optimizer.muon.tp_mode": LaterEffect(
        "with TP > 1: how Newton-Schulz gets whole matrices (the same update either way)",
        "tests/dist/test_tp_training.py::test_duplicated_and_distributed_modes_give_identical_updates"),
    "ddp.average_in_collective": LaterEffect(
        "at dp > 1: average after the reduction instead of scaling before it",
        f"{_LATER}::test_average_in_collective_moves_the_scaling"),
    "ddp.check_for_nan_in_grad": LaterEffect(
        "on a non-finite gradient: name the rank and parameter before the reduction",
        f"{_LATER}::test_check_for_nan_in_grad_names_the_parameter"),
    "data.source": LaterEffect("the dataset read",
                               "tests/unit/data/test_loader.py::test_batches_shapes_and_shifted_labels"),
    "data.paths": LaterEffect("the datasets of a blend", "tests/unit/data/test_loader.py::test_blend_of_two_datasets"),
    "data.weights": LaterEffect("the blend's weights", "tests/unit/data/test_sampling.py::test_blend_follows_weights"),
    "data.cache_dir": LaterEffect("where a built-in corpus is prepared",
                                  "tests/unit/data/test_builtin_and_cli.py::test_cache_dir_env"),
    "data.builtin_max_mb": LaterEffect("the size of a built-in corpus",
                                       "tests/unit/data/test_builtin_and_cli.py::test_loader_builds_builtin_into_env_cache"),
    "data.tokenizer": LaterEffect("the tokenizer the data must have been prepared with",
                                  "tests/unit/data/test_bad_input.py::test_tokenizer_mismatch"),
    "data.split_valid_fraction": LaterEffect("the held-out documents",
                                             "tests/unit/data/test_loader.py::test_no_validation_split"),
    "data.seed": LaterEffect("the document split and the sample order",
                             "tests/unit/data/test_loader.py::test_same_seed_same_batches_other_seed_differs"),
    "data.num_workers": LaterEffect("DataLoader worker processes reading the batches",
                                    f"{_LATER}::test_num_workers_reads_in_worker_processes"),
    "train.eval_interval": LaterEffect("when validation runs",
                                       "tests/e2e/test_checkpoint_resume.py::test_exit_interval_then_resume_is_bitwise"),
    "train.eval_iters": LaterEffect("batches per validation (0: none)",
                                    "tests/e2e/test_train_loop.py::test_eval_disabled_cleanly"),
    "train.log_interval": LaterEffect("when a console line is printed",
                                      "tests/e2e/test_train_loop.py::test_loss_decreases_and_outputs_written"),
    "train.exit_interval": LaterEffect("stop (and save) after that many steps of this job",
                                       "tests/e2e/test_checkpoint_resume.py::test_exit_interval_then_resume_is_bitwise"),
    "train.exit_duration_mins": LaterEffect("stop (and save) after that many minutes of this job",
                                            f"{_LATER}::test_exit_duration_stops_the_run"),
    "train.compile": LaterEffect(
        "compiles each transformer layer with torch.compile, quantizers included (the same bits "
        "on the CPU; the speed shows on a GPU: bench/gpu_speed.py)",
        "tests/unit/precision/test_compile_bits.py::test_train_compile_compiles_each_layer"),
    "train.on_nonfinite": LaterEffect("stop or skip a step with a NaN/Inf loss or gradient",
                                      "tests/e2e/test_train_loop.py::test_nan_loss_skipped_with_on_nonfinite_skip"),
    "train.on_anomaly": LaterEffect(
        "on a non-finite or spiking step: stop, skip the batch, or roll back to the last "
        "checkpoint and skip the data since it",
        "tests/e2e/test_anomalies.py::test_rollback_resumes_skips_the_window_and_finishes"),
    "train.spike_zscore": LaterEffect(
        "a loss this many standard deviations above the recent mean is an anomaly",
        "tests/e2e/test_anomalies.py::test_loss_spike_is_an_anomaly"),
    "train.spike_window": LaterEffect(
        "how many steps of loss history a spike or a divergence is measured against",
        "tests/unit/train/test_forensics.py::test_spike_detector_window_and_threshold"),
    "train.check_for_spiky_loss": LaterEffect(
        "a loss that diverged (far above ln(vocab) or the running median) stops the run, "
        "or follows train.on_anomaly",
        "tests/e2e/test_anomalies.py::test_a_divergence_stops_the_run_naming_the_operand"),
    "train.spiky_loss_factor": LaterEffect(
        "the multiple of the running median of the loss above which a loss diverged",
        "tests/unit/train/test_forensics.py::test_divergence_needs_a_warm_baseline_or_the_uniform_bound"),
    "train.uniform_loss_factor": LaterEffect(
        "the multiple of ln(vocab) above which a loss diverged, from the first step",
        "tests/unit/train/test_forensics.py::test_divergence_needs_a_warm_baseline_or_the_uniform_bound"),
    "train.max_rollbacks": LaterEffect(
        "how many rollbacks a job may do before an anomaly stops it",
        "tests/e2e/test_anomalies.py::test_rollback_budget_then_stop"),
    "logging.numerics_interval": LaterEffect(
        "every N steps, the quantization statistics of every GEMM operand in metrics.jsonl",
        "tests/e2e/test_numerics_runs.py::test_statistics_never_change_the_run"),
    "debug.nan_sample": LaterEffect(
        "a NaN in debug.nan_module's output or output grad in the step reading that sample",
        "tests/e2e/test_anomalies.py::test_injected_nan_stops_naming_layer_step_and_samples"),
    "debug.nan_module": LaterEffect(
        "the module debug.nan_sample puts its NaN into",
        "tests/e2e/test_anomalies.py::test_injected_nan_stops_naming_layer_step_and_samples"),
    "debug.nan_tensor": LaterEffect(
        "whether the NaN goes into the module's output or its output grad",
        "tests/e2e/test_anomalies.py::test_injected_nan_in_the_output_names_the_forward"),
    "checkpoint.save": LaterEffect("where checkpoints are written",
                                   "tests/e2e/test_checkpoint_resume.py::test_exit_interval_then_resume_is_bitwise"),
    "checkpoint.load": LaterEffect("where a run resumes from",
                                   "tests/e2e/test_checkpoint_resume.py::test_cli_output_dir_policy_and_plot"),
    "checkpoint.init_from_hf": LaterEffect(
        "the Hugging Face folder a fresh run starts its weights from",
        "tests/e2e/test_hf_import.py::test_llama_import_first_step_matches_transformers_then_trains"),
    "checkpoint.load_optimizer": LaterEffect(
        "whether a resume loads the saved optimizer state or starts a fresh one from the saved weights",
        "tests/e2e/test_faults_ckpt_resume.py::test_incompatible_resume_refused_and_fresh_optimizer_override"),
    "optimizer.override_opt_param_scheduler": LaterEffect(
        "on a resume whose lr schedule differs from the checkpoint's: this config's schedule "
        "from the step reached (refused without it or its sibling)",
        "tests/e2e/test_resume_schedule.py::test_override_opt_param_scheduler_follows_the_new_decay_and_says_so"),
    "optimizer.use_checkpoint_opt_param_scheduler": LaterEffect(
        "on a resume whose lr schedule differs from the checkpoint's: the saved schedule goes on",
        "tests/e2e/test_resume_schedule.py::test_use_checkpoint_opt_param_scheduler_goes_on_with_the_saved_decay"),
    "checkpoint.save_interval": LaterEffect("how often checkpoints are written",
                                            "tests/e2e/test_checkpoint_resume.py::test_crash_inside_writer_keeps_previous_checkpoint"),
    "checkpoint.keep_latest": LaterEffect("how many checkpoints are kept",
                                          "tests/unit/checkpoint/test_store.py::test_keep_latest_prunes_old_and_stale_folders"),
    "checkpoint.sharding_type": LaterEffect(
        "dp_reshardable and fully_reshardable both ask for a checkpoint that loads at another DP "
        "size; lptrain's one format is that (fully_sharded_model_space is refused)",
        "tests/dist/test_checkpoint_dist.py::test_resume_at_other_dp_size_reads_every_sample_once",
        ""),
    "checkpoint.save_on_interrupt": LaterEffect("also save on Ctrl-C (SIGINT)",
                                                f"{_LATER}::test_save_on_interrupt_saves_on_sigint"),
    "logging.wandb": LaterEffect("log to a W&B run",
                                 "tests/e2e/test_train_loop.py::test_wandb_offline_run_records_metrics"),
    "logging.wandb_project": LaterEffect("the W&B project", f"{_LATER}::test_wandb_project_and_mode_reach_wandb"),
    "logging.wandb_mode": LaterEffect("W&B online, offline or disabled",
                                      f"{_LATER}::test_wandb_project_and_mode_reach_wandb"),
    "logging.plots": LaterEffect("PNG plots in the run folder", f"{_LATER}::test_plots_switch"),
    "logging.progress": LaterEffect("a progress bar on a terminal", f"{_LATER}::test_progress_bar_on_a_terminal"),
}

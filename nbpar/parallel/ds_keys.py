"""The keys of DeepSpeed's config (ds_config.json) as DeepSpeed documents and reads them:
what `nbpar.parallel.ds_config` accepts before it suggests the nearest key for a typo.

Data, and one check: the precision keys nbpar refuses (`check_half_masters`).
`tests/test_ds_config.py` checks ``ZERO_KEYS`` against the installed
DeepSpeed's ``DeepSpeedZeroConfig`` (every field and alias), so a key DeepSpeed reads
is never refused as a typo.
"""

# Top-level keys of DeepSpeed's documented config (deepspeed.ai/docs/config-json,
# runtime/config.py of deepspeed 0.19).
TOP_LEVEL_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
    "torch_autocast",
    "data_types",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    "sparse_gradients",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "log_level",
    "disable_allgather",
    "dataloader_drop_last",
    "disable_python_gc",
    "managed_gradient_accumulation",
    "activation_checkpointing",
    "flops_profiler",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "aim",
    "monitor_config",
    "sparse_attention",
    "pipeline",
    "data_efficiency",
    "curriculum_learning",
    "elasticity",
    "autotuning",
    "compression_training",
    "checkpoint",
    "aio",
    "nebula",
    "hybrid_engine",
    "quantize_training",
    "eigenvalue",
    "progressive_layer_drop",
    "weight_quantization",
    "expert_parallel",
    "use_data_before_expert_parallelism",
    "vocabulary_size",
    "compile",
    "tensor_parallel",
    "sequence_parallel_size",
    "timers",
    "graph_harvesting",
    "zero_quantized_weights",
)

# Keys of "zero_optimization" (DeepSpeedZeroConfig fields and their aliases).
ZERO_KEYS = (
    "stage",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "compute_grad_norm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "offload_param",
    "offload_optimizer",
    "zenflow",
    "sub_group_size",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "prefetch_bucket_size",
    "stage3_prefetch_bucket_size",
    "param_persistence_threshold",
    "stage3_param_persistence_threshold",
    "model_persistence_threshold",
    "stage3_model_persistence_threshold",
    "max_live_parameters",
    "stage3_max_live_parameters",
    "max_reuse_distance",
    "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "module_granularity_threshold",
    "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "stage3_allgather_sequential",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "parameter_alignment",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
)

#: half-precision master weights / optimizer states: DeepSpeed runs them only with its
#: compiled DeepSpeedCPUAdam under ZeRO offload (and asserts deep inside initialize)
HALF_MASTER_KEYS = (
    "fp16_master_weights_and_grads",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)


def check_half_masters(name: str, section) -> None:
    """Refuse a precision ``section`` (fp16 / bf16) that asks for `HALF_MASTER_KEYS`."""
    asked = [k for k in HALF_MASTER_KEYS if isinstance(section, dict) and section.get(k) is True]
    if asked:
        raise ValueError(
            f"deepspeed_config sets {name}.{asked[0]}, which DeepSpeed runs only with "
            f"its compiled DeepSpeedCPUAdam under ZeRO offload; nbpar runs torch's Adam "
            f"(nothing to compile) with fp32 master weights: remove {asked[0]}"
        )

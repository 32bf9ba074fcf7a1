"""TrainConfig validation: every bad input fails early with one clear sentence."""

import json

import pytest

from nbpar.config import GPTConfig, TrainConfig
from nbpar.dims import ParallelDims
from nbpar.errors import ConfigError
from nbpar.model.data import global_batch_line
from nbpar.strategies import resolve_degrees

BAD = [
    (dict(model="resnet"), 2, "model='resnet'.*simple_cnn, tiny_gpt"),
    (dict(dataset="imagenet"), 2, "dataset='imagenet'"),
    (dict(model="simple_cnn", dataset="pysource"), 2, "does not fit model 'simple_cnn'"),
    (dict(strategy="fsdp"), 2, "strategy='fsdp'"),
    (dict(backend="jax"), 2, "backend='jax'"),
    (dict(strategy="pipeline", schedule="zb"), 2, "schedule='zb'"),
    (dict(precision="fp8"), 2, "precision='fp8'"),
    (dict(optimizer="lamb"), 2, "optimizer='lamb'"),
    (dict(offload="nvme", backend="deepspeed"), 2, "offload='nvme'"),
    (dict(micro_batch=0), 2, "micro_batch must be a positive integer, got 0"),
    (dict(grad_accum=-1), 2, "grad_accum must be a positive integer, got -1"),
    (dict(steps=0), 2, "steps must be a positive integer"),
    (dict(lr=0.0), 2, "lr must be a positive number, got 0.0"),
    (dict(strategy="ddp", schedule="gpipe"), 2, "schedule='gpipe' applies only to strategies"),
    (
        dict(strategy="zero3", offload="optimizer"),
        2,
        "offload='optimizer' needs backend='deepspeed'",
    ),
    (dict(strategy="ddp", backend="deepspeed", offload="params"), 2, "needs strategy zero3"),
    (
        dict(
            strategy="pipeline",
            backend="deepspeed",
            deepspeed_config={"zero_optimization": {"stage": 2}},
        ),
        2,
        "DeepSpeed's PipelineModule supports ZeRO stage 0 or 1 only",
    ),
    (
        dict(strategy="ddp", backend="torch", deepspeed_config={}),
        2,
        "deepspeed_config needs backend='deepspeed'",
    ),
    (dict(strategy="ddp", dp=3), 2, "must equal the number of engines"),
    (dict(strategy="ddp", tp=2), 2, "does not split along tp"),
    (dict(strategy="zero3", tp=3), 4, "tp=3 must be a positive divisor"),
    (dict(strategy="pipeline", dp=2), 4, "strategy 'pipeline' does not split along dp"),
    (
        dict(strategy="hybrid", backend="deepspeed", dp=1, tp=2, pp=2, grad_accum=2),
        4,
        "the DeepSpeed pipeline backend has no tensor parallelism",
    ),
    (
        dict(strategy="pipeline", backend="deepspeed", schedule="gpipe"),
        2,
        "runs only the 1f1b schedule",
    ),
    (dict(strategy="hybrid"), 4, "strategy 'hybrid' needs explicit degrees"),
    (dict(strategy="hybrid", dp=2, pp=2), 8, "must equal the number of engines"),
    (
        dict(strategy="tp", gpt=GPTConfig(n_heads=3, d_model=24)),
        2,
        "tp=2 must divide gpt.n_heads=3",
    ),
    (dict(strategy="pipeline"), 3, "pp=3 pipeline stages need at least 3 layers"),
    (dict(strategy="tp", model="simple_cnn"), 2, "needs model 'tiny_gpt'"),
    (dict(strategy="pipeline", model="simple_cnn"), 2, "needs model 'tiny_gpt'"),
    (dict(strategy="single", dp=2), 1, "requires dp=tp=pp=cp=ep=1"),
    (dict(strategy="single"), 2, "runs on exactly one engine"),
    (dict(precision="fp16"), 2, "precision='fp16' needs backend='deepspeed'"),
    (dict(strategy="tp", backend="deepspeed"), 2, "backend 'deepspeed' supports strategies"),
    (dict(strategy="ddp", fsdp_reshard=True), 2, "fsdp_reshard applies only to"),
    (dict(gpt=GPTConfig(d_model=30, n_heads=4)), 2, "gpt.n_heads=4 must divide gpt.d_model=30"),
    (dict(gpt=GPTConfig(vocab_size=100)), 2, "vocab_size=100 is too small"),
    (dict(checkpoint_every=5), 2, "checkpoint_every > 0 needs checkpoint_dir"),
    (dict(strategy="ddp", attention="ulysses"), 2, "applies to strategy 'cp'"),
    (dict(strategy="cp", model="hf:gpt2"), 2, "runs tiny_gpt and hf:llama, not 'hf:gpt2'"),
    (dict(strategy="cp", backend="deepspeed"), 2, "use attention='ulysses' with backend"),
    (dict(strategy="cp", gpt=GPTConfig(seq_len=20)), 4, "seq_len=20 does not divide by 8"),
    (
        dict(strategy="cp", attention="ulysses", gpt=GPTConfig(n_heads=2, d_model=32)),
        4,
        "2 attention heads of tiny_gpt do not divide by 4",
    ),
    (  # Ulysses splits a tensor-parallel rank's heads: 4 heads / tp 2 over cp 4
        dict(strategy="hybrid", cp=4, tp=2, attention="ulysses", gpt=GPTConfig(seq_len=32)),
        8,
        "do not divide by cp x tp = 8",
    ),
    (
        dict(strategy="cp", gpt=GPTConfig(dropout=0.1)),
        2,
        "context-parallel attention has no dropout",
    ),
]


@pytest.mark.parametrize("kwargs,world,match", BAD)
def test_bad_config_raises_clear_value_error(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs).validate(world)


def test_pipeline_options_checked_without_world_size():
    with pytest.raises(ValueError, match="schedule='interleaved' applies only"):
        TrainConfig(strategy="tp", schedule="interleaved").validate()
    with pytest.raises(ValueError, match="pp=4 pipeline stages"):
        TrainConfig(strategy="hybrid", pp=4, dp=1).validate()


@pytest.mark.parametrize(
    "kwargs,world,expect",
    [  # (pp, dp, cp, tp), ep
        (dict(strategy="ddp"), 4, ((1, 4, 1, 1), 1)),
        (dict(strategy="zero3"), 2, ((1, 2, 1, 1), 1)),
        (dict(strategy="zero3", tp=2), 8, ((1, 4, 1, 2), 1)),  # FSDP over tp shards
        (dict(strategy="pipeline", grad_accum=2), 2, ((2, 1, 1, 1), 1)),
        (dict(strategy="tp"), 4, ((1, 1, 1, 4), 1)),
        (dict(strategy="hybrid", dp=2, pp=2, grad_accum=2), 4, ((2, 2, 1, 1), 1)),
        (dict(strategy="hybrid", dp=2, tp=2, pp=2, grad_accum=2), 8, ((2, 2, 1, 2), 1)),
        (dict(strategy="single"), 1, ((1, 1, 1, 1), 1)),
        (dict(strategy="cp"), 4, ((1, 1, 4, 1), 1)),  # the sequence over every engine
        (dict(strategy="cp", cp=2), 4, ((1, 2, 2, 1), 1)),  # data parallel takes the rest
        (dict(strategy="cp", dp=2), 4, ((1, 2, 2, 1), 1)),
        (dict(strategy="hybrid", dp=2, cp=2, tp=2), 8, ((1, 2, 2, 2), 1)),
        (dict(strategy="cp", cp=2, fsdp_reshard=True), 4, ((1, 2, 2, 1), 1)),  # FSDP on dp x cp
    ],
)
def test_default_degrees(kwargs, world, expect):
    cfg = TrainConfig(**kwargs).validate(world)
    dims = cfg.dims(world)
    assert isinstance(dims, ParallelDims)
    assert (dims.shape, dims.ep) == expect


def test_expert_parallel_degrees_are_carved_out_of_data_parallel():
    """ep does not multiply the world: strategy ep shares the experts over every
    data-parallel rank unless ep says fewer, and ep must divide dp."""
    assert resolve_degrees("ep", 4).ep == 4 and resolve_degrees("ep", 4).dp == 4
    assert resolve_degrees("ep", 4, ep=2).dp == 4
    assert resolve_degrees("hybrid", 8, dp=4, tp=2, ep=2).ep == 2
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        resolve_degrees("ep", 4, ep=3)
    coords = [ParallelDims(dp=4, ep=2, world_size=4).coords(r) for r in range(4)]
    assert [(c["edp"], c["ep"]) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_valid_deepspeed_and_pipeline_configs_pass(tmp_path, half_precision):
    half_precision(fp16=True)
    TrainConfig(strategy="pipeline", schedule="gpipe").validate(2)
    TrainConfig(strategy="zero3", backend="deepspeed", offload="params", precision="fp16").validate(
        2
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="supports ZeRO stage 0 or 1 only"):
        TrainConfig(strategy="pipeline", backend="deepspeed", deepspeed_config=str(path)).validate(
            2
        )
    with pytest.raises(ValueError, match="cannot read DeepSpeed config file.*missing.json"):
        TrainConfig(
            strategy="ddp", backend="deepspeed", deepspeed_config=str(tmp_path / "missing.json")
        ).validate(2)


def test_deepspeed_config_keys_are_checked_by_ds_config():
    with pytest.raises(ValueError, match="zero_optimisation"):
        TrainConfig(
            strategy="zero2",
            backend="deepspeed",
            deepspeed_config={"zero_optimisation": {"stage": 2}},
        ).validate(2)


def test_round_trip_through_dict_and_json():
    cfg = TrainConfig(
        model="tiny_gpt",
        strategy="hybrid",
        dp=2,
        pp=2,
        schedule="gpipe",
        micro_batch=4,
        grad_accum=3,
        lr=3e-4,
        seed=7,
        gpt=GPTConfig(d_model=16, n_heads=2, n_layers=4),
    )
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["gpt"]["n_layers"] == 4
    back = TrainConfig.from_dict(d)
    assert back == cfg
    assert isinstance(back.gpt, GPTConfig)
    with pytest.raises(ValueError, match="unknown TrainConfig field.*batch"):
        TrainConfig.from_dict({"batch": 3})


def test_global_batch_arithmetic():
    cfg = TrainConfig(strategy="ddp", micro_batch=8, grad_accum=32).validate(8)
    assert cfg.global_batch(8) == 2048
    assert global_batch_line(8, 32, 8) == "global batch = 8 x 32 x 8 = 2048 (micro x accum x dp)"
    assert TrainConfig(strategy="pipeline", micro_batch=8, grad_accum=4).global_batch(2) == 32
    assert TrainConfig(strategy="hybrid", dp=2, pp=2, micro_batch=4).global_batch(4) == 8


def test_defaults_resolve():
    assert TrainConfig(model="simple_cnn").dataset_name() == "cifar10"
    assert TrainConfig().dataset_name() == "pysource"
    assert TrainConfig(strategy="zero2").fsdp_reshard_after_forward() is False
    assert TrainConfig(strategy="zero3").fsdp_reshard_after_forward() is True


def test_config_and_estimator_resolve_degrees_alike():
    """One rule (`nbpar.strategies.resolve_degrees`): where the config runs a layout,
    the estimator resolves the same degrees; it also takes layouts on paper."""
    from nbpar.estimate import estimate_memory

    for strategy, world, given in [
        ("ddp", 4, {}),
        ("zero3", 8, {"tp": 2}),
        ("pipeline", 2, {}),
        ("tp", 4, {}),
        ("hybrid", 8, {"dp": 2, "tp": 2, "pp": 2}),
        ("single", 1, {}),
    ]:
        dims = TrainConfig(strategy=strategy, **given).dims(world)
        est = estimate_memory(1e9, world, strategy, **given)
        assert (est.dp, est.tp, est.pp) == (dims.dp, dims.tp, dims.pp), strategy
    # Megatron-DeepSpeed's ZeRO-1 x TP x PP: the estimator takes it, nbpar does not run it
    assert estimate_memory(175e9, 1024, "zero1", tp=8, pp=16).dp == 8
    with pytest.raises(ValueError, match="does not split along pp"):
        TrainConfig(strategy="zero1", tp=8, pp=16).dims(1024)


def test_validate_is_pure_and_returns_the_checked_config():
    """A ds_config's train_batch_size decides the accumulation on 2 engines: validate
    returns a copy that says so and leaves the config it was asked about as it was."""
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    cfg = TrainConfig(strategy="zero1", backend="deepspeed", deepspeed_config=ds)
    before = cfg.to_dict()
    checked = cfg.validate(2)
    assert cfg.to_dict() == before
    assert (checked.micro_batch, checked.grad_accum) == (4, 4)
    assert checked is not cfg
    plain = TrainConfig(strategy="ddp")
    assert plain.validate(2) is plain  # nothing decided: no copy


@pytest.mark.parametrize(
    "kwargs, world, fields",
    [
        (dict(micro_batch=0), 2, ("micro_batch",)),
        (dict(strategy="zero9"), 2, ("strategy",)),
        (dict(precision="fp16"), 2, ("precision", "backend")),
        (dict(strategy="tp", gpt=GPTConfig(n_heads=3, d_model=24)), 2, ("tp", "gpt.n_heads")),
        (dict(strategy="hybrid"), 4, ("dp", "tp", "pp")),
        (dict(strategy="ddp", tp=2), 4, ("tp", "strategy")),
        (dict(strategy="ddp", lr_schedule={"type": "Nope"}), 2, ("lr_schedule",)),
        (dict(strategy="hybrid", dp=3, pp=1), 4, ("dp", "tp", "pp")),
    ],
)
def test_a_refused_config_names_its_fields(kwargs, world, fields):
    from nbpar.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        TrainConfig(**kwargs).validate(world)
    assert err.value.fields[: len(fields)] == fields
    assert err.value.field == fields[0]


def test_hybrid_takes_fsdp_resharding_as_notebook_10_advises():
    cfg = TrainConfig(strategy="hybrid", dp=2, pp=2, grad_accum=2, fsdp_reshard=True)
    assert cfg.validate(4).fsdp_reshard_after_forward() is True
    assert (
        TrainConfig(strategy="hybrid", dp=2, pp=2, grad_accum=2).fsdp_reshard_after_forward()
        is None
    )


def test_moe_sizes_are_checked_and_travel_with_the_config():
    from nbpar.config import MoEConfig
    from nbpar.model.registry import expert_count

    cfg = TrainConfig(model="tiny_moe", strategy="ep", moe=MoEConfig(n_experts=8, top_k=1))
    assert expert_count(cfg.validate(4)) == 8
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and isinstance(back.moe, MoEConfig)
    assert expert_count(TrainConfig(model="hf:mixtral")) == 4  # its small default
    assert expert_count(TrainConfig(model="hf:mixtral", model_config={"num_local_experts": 6})) == 6
    for moe, field in [
        (MoEConfig(n_experts=0), "moe.n_experts"),
        (MoEConfig(top_k=5), "moe.top_k"),
        (MoEConfig(aux_loss_coef=-1.0), "moe.aux_loss_coef"),
    ]:
        with pytest.raises(ConfigError) as err:
            TrainConfig(model="tiny_moe", moe=moe).validate()
        assert field in err.value.fields
    with pytest.raises(ConfigError, match="unknown MoEConfig field.*experts"):
        TrainConfig.from_dict({"moe": {"experts": 4}})


def test_model_config_sizes_tiny_moe_by_field_name():
    from nbpar.config import MoEConfig, model_config_fields

    got = model_config_fields("tiny_moe", '{"d_model": 16, "n_experts": 8, "top_k": 1}')
    assert got == {"gpt": GPTConfig(d_model=16), "moe": MoEConfig(n_experts=8, top_k=1)}
    with pytest.raises(ValueError, match="--model-config.*experts"):
        model_config_fields("tiny_moe", '{"experts": 8}')


STAGE_2 = {"zero_optimization": {"stage": 2}}


@pytest.mark.parametrize(
    "kw, world, words",
    [
        (dict(strategy="ep", ep=3), 3, "ep=3 must divide the 4 experts"),
        (dict(strategy="hybrid", dp=2, ep=2, fsdp_reshard=True), 2, "fsdp_reshard does not"),
        (dict(strategy="ep", checkpoint_every=5, checkpoint_dir="x"), 2, "does not checkpoint"),
        (dict(strategy="ep", backend="deepspeed", model="hf:mixtral"), 2, "DeepSpeed-MoE"),
        (dict(strategy="ep", backend="deepspeed", deepspeed_config=STAGE_2), 2, "ZeRO stage 0"),
        (dict(strategy="hybrid", backend="deepspeed", dp=2, pp=2, ep=2), 4, "no expert parallel"),
    ],
)
def test_expert_parallelism_refuses_in_one_line(kw, world, words):
    with pytest.raises(ConfigError, match=words) as err:
        TrainConfig(**{"model": "tiny_moe", **kw}).validate(world)
    assert "\n" not in str(err.value)

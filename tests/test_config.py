import pytest

from trl_a3po import A3POConfig


def make(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True, report_to="none"
    )
    return A3POConfig(**{**defaults, **kwargs})


def test_defaults(tmp_path):
    args = make(tmp_path)
    assert args.prox_logp_method == "loglinear"
    assert args.use_decoupled_loss is True
    assert args.behav_imp_weight_cap == 5.0
    assert args.dual_clip_c is None
    # the behaviour weight replaces TRL's vLLM IS correction; the coupled baseline keeps TRL's default
    assert args.vllm_importance_sampling_correction is False
    assert make(tmp_path, use_decoupled_loss=False).vllm_importance_sampling_correction is True


def test_every_field_has_help():
    import dataclasses

    for f in dataclasses.fields(A3POConfig):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(prox_logp_method="exact"), r"prox_logp_method='exact'.*loglinear"),
        (dict(behav_imp_weight_cap=1.0), r"behav_imp_weight_cap=1.0.*> 1"),
        (dict(behav_imp_weight_cap=-3.0), r"behav_imp_weight_cap"),
        (dict(dual_clip_c=0.5), r"dual_clip_c=0.5 must be > 1"),
        (dict(loss_type="cispo", dual_clip_c=3.0), r"A3POConfig.dual_clip_c: .*loss_type='cispo' does not have"),
        (dict(vllm_importance_sampling_correction=True), r"A3POConfig.vllm_importance_sampling_correction"),
        (dict(delta=2.0, dual_clip_c=3.0), r"A3POConfig.delta: .*set only one of them"),
        (dict(vllm_structured_outputs_regex=r"\d+"), r"vllm_structured_outputs_regex constrains TRL's own vLLM"),
        (dict(behav_imp_weight_mode="clip"), r"behav_imp_weight_mode='clip' is not supported"),
        (dict(behav_imp_weight_level="batch"), r"behav_imp_weight_level='batch' is not supported"),
        (dict(behav_imp_weight_min=1.0), r"behav_imp_weight_min=1.0 must be in \(0, 1\)"),
        (dict(behav_imp_weight_min=0.0), r"behav_imp_weight_min=0.0 must be in \(0, 1\)"),
        (
            dict(behav_imp_weight_mode="truncate", behav_imp_weight_cap=None),
            r"'truncate' clamps weights at "
            r"behav_imp_weight_cap, which is None",
        ),
        (
            dict(use_decoupled_loss=False, behav_imp_weight_level="sequence", behav_imp_weight_min=0.5),
            r"behav_imp_weight_min, behav_imp_weight_level shape the decoupled loss.*use_decoupled_loss=False",
        ),
        (
            dict(continuous_generation=True, async_generation=False),
            r"continuous_generation=True .* needs async_generation=True. Set continuous_generation=False",
        ),
        (
            dict(inflight_weight_updates=True, async_generation=False),
            r"inflight_weight_updates=True .* needs async_generation=True. Set inflight_weight_updates=False",
        ),
    ],
)
def test_bad_values_name_the_field(tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(tmp_path, **kwargs)


def test_behaviour_weight_options(tmp_path):
    args = make(tmp_path)
    assert (args.behav_imp_weight_mode, args.behav_imp_weight_min, args.behav_imp_weight_level) == (
        "mask",
        None,
        "token",
    )
    args = make(
        tmp_path,
        behav_imp_weight_mode="truncate",
        behav_imp_weight_cap=2.0,
        behav_imp_weight_min=0.5,
        behav_imp_weight_level="sequence",
    )
    assert (args.behav_imp_weight_mode, args.behav_imp_weight_cap, args.behav_imp_weight_min) == ("truncate", 2.0, 0.5)
    assert make(tmp_path, behav_imp_weight_cap=None, behav_imp_weight_min=0.2).behav_imp_weight_min == 0.2


def test_coupled_mode_accepts_trl_only_loss_types(tmp_path):
    # use_decoupled_loss=False is plain GRPO: every TRL loss type stays available
    assert make(tmp_path, use_decoupled_loss=False, loss_type="cispo").loss_type == "cispo"


def test_staleness_bound_defaults_and_limits(tmp_path):
    # max_staleness counts policy versions (training steps), whatever the optimizer steps per generation batch
    for kwargs in (
        dict(),
        dict(steps_per_generation=3),
        dict(gradient_accumulation_steps=4, steps_per_generation=16),
        dict(num_iterations=2, steps_per_generation=2),
    ):
        assert make(tmp_path, **kwargs).max_staleness == 2  # asynchronous: where loglinear's alpha < 1 engages
        assert make(tmp_path, async_generation=False, **kwargs).max_staleness == 0
    assert make(tmp_path, max_staleness=1).max_staleness == 1
    with pytest.warns(UserWarning, match="max_staleness=0 leaves no room to generate ahead"):
        make(tmp_path, max_staleness=0)
    with pytest.raises(ValueError, match=r"max_staleness=-1 must be >= 0"):
        make(tmp_path, max_staleness=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gradient_accumulation_steps=4, steps_per_generation=2),
        dict(gradient_accumulation_steps=2, steps_per_generation=3),
    ],
)
def test_a_generation_batch_must_end_on_an_optimizer_step(tmp_path, kwargs):
    with pytest.raises(
        ValueError,
        match=r"steps_per_generation \(\d\) x num_iterations \(1\) = \d micro-batches per "
        r"generation batch must be a multiple of gradient_accumulation_steps",
    ):
        make(tmp_path, **kwargs)
    # the coupled loss has no versions: TRL's own layouts stay available
    assert make(tmp_path, use_decoupled_loss=False, **kwargs).steps_per_generation == kwargs["steps_per_generation"]
    # num_iterations counts: 3 x 2 = 6 micro-batches end on the third optimizer step of 2 micro-batches each
    assert make(tmp_path, gradient_accumulation_steps=2, steps_per_generation=3, num_iterations=2).max_staleness == 2


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(async_generation=True, use_decoupled_loss=False), r"max_staleness=2 .*coupled GRPO loss"),
        (dict(async_generation=True, use_decoupled_loss=False, max_staleness=1), r"or\s+max_staleness=0"),
        # the producer counts policy versions, with the coupled loss too
        (
            dict(
                async_generation=True,
                use_decoupled_loss=False,
                max_staleness=0,
                steps_per_generation=3,
                gradient_accumulation_steps=2,
            ),
            r"must be a multiple of\s+gradient_accumulation_steps",
        ),
        (
            dict(use_vllm=True, vllm_mode="server", rollout_backend="inprocess"),
            r"rollout_backend='inprocess' asks for another generator",
        ),
        # what the colocated engine (GRPOConfig's default vllm_mode) does not do, generated ahead
        (dict(use_vllm=True, inflight_weight_updates=True), r"inflight_weight_updates with the colocated vLLM"),
        (dict(use_vllm=True, continuous_generation=True), r"continuous_generation with the colocated vLLM"),
        (dict(use_vllm=True, vllm_tensor_parallel_size=2), r"vllm_tensor_parallel_size .*--tensor_parallel_size N"),
        (dict(use_vllm=True, vllm_enable_sleep_mode=True), r"vllm_enable_sleep_mode .*works while the\s+trainer"),
        (dict(async_generation=False, rollout_backend="vllm_server"), r"use TRL's own use_vllm=True"),
        (dict(rollout_backend="sglang"), r"rollout_backend='sglang' is not supported"),
        (dict(weight_sync_transport="rdma"), r"weight_sync_transport='rdma'"),
        (dict(weight_sync_steps=0), r"weight_sync_steps=0 must be >= 1"),
        (dict(async_generation=False, generation_compile=True), r"generation_compile=True compiles the in-process"),
        (dict(use_vllm=True, generation_compile=True), r"rollout_backend='vllm_colocate'. Leave\s+generation_compile"),
    ],
)
def test_generation_settings_are_validated(tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(tmp_path, **kwargs)


def test_async_is_on_by_default_only_for_the_decoupled_loss(tmp_path):
    assert make(tmp_path).async_generation is True
    assert make(tmp_path, use_decoupled_loss=False).async_generation is False
    assert make(tmp_path).rollout_backend == "inprocess"


def test_trls_vllm_server_config_generates_ahead_on_that_server(tmp_path):
    # A TRL user's config, one import changed: asynchronous, on their server; GRPOTrainer's own (synchronous) vLLM
    # client is not built, so TRL's `use_vllm` reads False once the producer owns the server.
    config = make(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_port=8123)
    assert config.async_generation and config.rollout_backend == "vllm_server" and not config.use_vllm
    assert (config.max_staleness, config.vllm_server_port) == (2, 8123)
    assert not config.vllm_importance_sampling_correction  # the behaviour weight corrects for the sampler
    # no generation ahead asked for: TRL's own synchronous vLLM path, as before
    for kwargs in (dict(async_generation=False), dict(max_staleness=0)):
        config = make(tmp_path, use_vllm=True, vllm_mode="server", **kwargs)
        assert not config.async_generation and config.use_vllm and config.rollout_backend == "inprocess"
    # GRPOConfig's default mode, colocate: generated ahead by a vLLM engine in the training process
    config = make(tmp_path, use_vllm=True)
    assert config.async_generation and config.rollout_backend == "vllm_colocate" and not config.use_vllm
    # the coupled loss stays synchronous (TRL's own path)
    config = make(tmp_path, use_vllm=True, vllm_mode="server", use_decoupled_loss=False)
    assert not config.async_generation and config.use_vllm


def test_the_docstring_documents_every_field_a3po_adds_in_trls_format():
    # TRL's configs list their fields under `Parameters:` as "name (`type`, *optional*, defaults to `value`):".
    import dataclasses

    from trl import GRPOConfig

    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    added = [f for f in dataclasses.fields(A3POConfig) if f.name not in base]
    assert len(added) >= 12
    doc = A3POConfig.__doc__
    assert "    Parameters:\n" in doc
    for f in added + [
        f
        for f in dataclasses.fields(A3POConfig)
        if f.name in ("vllm_server_host", "vllm_importance_sampling_correction")
    ]:
        default = f'"{f.default}"' if isinstance(f.default, str) else f"{f.default}"
        assert (
            f"        {f.name} (`" in doc
            and f"defaults to `{default}`):" in doc.split(f"        {f.name} (`")[1].split("\n")[0]
        ), f.name


def test_a_registered_backend_is_a_valid_rollout_backend_and_a_built_in_name_cannot_be_taken(tmp_path):
    from trl_a3po.rollout import backend, register_backend

    with pytest.raises(ValueError, match=r"rollout_backend 'inprocess' is built in"):
        register_backend("inprocess", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"rollout_backend='my_engine' is not supported"):
        make(tmp_path, rollout_backend="my_engine")
    register_backend("my_engine", lambda *a, **k: None)
    try:
        assert make(tmp_path, rollout_backend="my_engine").rollout_backend == "my_engine"
        # What it cannot do is data: no compiled decode step unless its entry says so
        with pytest.raises(ValueError, match=r"generation_compile=True compiles the in-process generator"):
            make(tmp_path, rollout_backend="my_engine", generation_compile=True)
    finally:
        backend._REGISTRY.pop("my_engine")


def test_a_registered_backends_own_config_check_runs_in_the_configs_validation(tmp_path):
    from trl_a3po.rollout import backend, register_backend

    def refuse_top_k(args):
        if args.top_k:
            raise ValueError("A3POConfig.top_k: my_engine samples without top-k. Set top_k=0.")

    register_backend("my_engine", lambda *a, **k: None, check_config=refuse_top_k)
    try:
        assert make(tmp_path, rollout_backend="my_engine").top_k == 0
        with pytest.raises(ValueError, match=r"A3POConfig.top_k: my_engine samples without top-k"):
            make(tmp_path, rollout_backend="my_engine", top_k=5)
    finally:
        backend._REGISTRY.pop("my_engine")

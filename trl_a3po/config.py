"""A3POConfig: GRPOConfig plus the knobs of the decoupled loss and the proximal policy."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .proximal import BEHAV_WEIGHT_LEVELS, BEHAV_WEIGHT_MODES, CLIPPED_LOSS_TYPES
from .rollout.backend import DEFAULT_BACKEND, backend_entry, refuse_fields


PROX_LOGP_METHODS = ("loglinear", "recompute", "metrics")
WEIGHT_SYNC_TRANSPORTS = ("auto", "nccl", "disk")
LORA_WEIGHT_SYNCS = ("auto", "adapter", "merged")


@dataclass
class A3POConfig(GRPOConfig):
    r"""
    Configuration class for the [`A3POTrainer`]: every field of [`~trl.GRPOConfig`] keeps its meaning, and these are
    added or changed for A-3PO (arXiv 2512.06547). Each field's `help` metadata has the full text (`--help`,
    docs/configuration.md).

    Parameters:
        > Parameters that control the decoupled loss

        prox_logp_method (`str`, *optional*, defaults to `"loglinear"`):
            How the proximal log-probs are obtained: `"loglinear"` (A-3PO, an element-wise interpolation with
            alpha = 1/max(staleness, 1)), `"recompute"` (decoupled PPO, a no-grad forward per generation batch) or
            `"metrics"` (recompute, and log the error of each approximation against it).
        use_decoupled_loss (`bool`, *optional*, defaults to `True`):
            The decoupled PPO loss; `False` trains with GRPOTrainer's own loss, unchanged (the synchronous baseline).
        behav_imp_weight_cap (`float` or `None`, *optional*, defaults to `5.0`):
            Upper bound (> 1) on the behaviour weight pi_prox / pi_behav; `None` disables it.
        behav_imp_weight_mode (`str`, *optional*, defaults to `"mask"`):
            A weight outside the bounds becomes 0 (`"mask"`, the paper's) or is clamped into them (`"truncate"`).
        behav_imp_weight_min (`float` or `None`, *optional*, defaults to `None`):
            Optional lower bound on the behaviour weight, in (0, 1).
        behav_imp_weight_level (`str`, *optional*, defaults to `"token"`):
            `"token"` bounds each token's weight; `"sequence"` gives every token its sequence's geometric mean.
        dual_clip_c (`float` or `None`, *optional*, defaults to `None`):
            Dual-clip constant c > 1 for negative advantages; `None` disables it.
        sampling_temperature (`float` or `None`, *optional*, defaults to `None`):
            The generator's temperature, apart from the learner's `temperature`; `None` = `temperature`.
        vllm_importance_sampling_correction (`bool` or `None`, *optional*, defaults to `None`):
            TRL's own correction; `None` = off with the decoupled loss (its behaviour weight corrects already).

        > Parameters that control asynchronous generation

        async_generation (`bool` or `None`, *optional*, defaults to `None`):
            Generate ahead in a background producer; `None` = on with the decoupled loss (also with TRL's
            `use_vllm=True`, unless `max_staleness=0`).
        max_staleness (`int` or `None`, *optional*, defaults to `None`):
            Largest staleness, in policy versions, any sample is trained with; `None` = 2 asynchronous (where the
            A-3PO approximation engages), 0 synchronous.
        rollout_backend (`str` or `None`, *optional*, defaults to `None`):
            `"inprocess"` (a snapshot in a background thread), `"vllm_server"` (a running `trl vllm-serve`) or
            `"vllm_colocate"` (vLLM in the training process); `None` = what TRL's `use_vllm` and `vllm_mode` say.
        vllm_server_host (`str`, *optional*, defaults to `"127.0.0.1"`):
            Host of the vLLM server (GRPOConfig's field; loopback by default here).
        weight_sync_transport (`str`, *optional*, defaults to `"auto"`):
            How weights reach a vLLM server: `"disk"`, `"nccl"` (one packed broadcast per version) or `"auto"`.
        lora_weight_sync (`str`, *optional*, defaults to `"auto"`):
            With a LoRA policy on a vLLM server: send the `"adapter"` alone, the `"merged"` weights, or `"auto"`.
        weight_sync_dir (`str` or `None`, *optional*, defaults to `None`):
            Folder the server reads (disk transport, adapters); `None` = `<output_dir>/weight_sync`.
        weight_sync_steps (`int`, *optional*, defaults to `1`):
            Load a newer version into the generator only when the one it holds is this many versions old.
        continuous_generation (`bool`, *optional*, defaults to `False`):
            Generate every batch the staleness bound lets in at once (on a vLLM server as concurrent requests,
            in-process merged into one `generate`), instead of one batch after another.
        inflight_weight_updates (`bool`, *optional*, defaults to `False`):
            Load a newer version in the middle of a generation, between two tokens, continuing each unfinished
            sequence under the new weights (per-token versions); on a vLLM server: abort, push, resubmit.
        turn_weight_updates (`bool`, *optional*, defaults to `True`):
            Tools and environments: load a newer version between two turns of an episode (each turn is a new request).
        tool_timeout_s (`float`, *optional*, defaults to `60.0`):
            Tools and environments, generated ahead: a tool call that has not returned after this many seconds fails.
        max_concurrent_episodes (`int`, *optional*, defaults to `64`):
            Tools and environments, generated ahead: episodes played at once (their tool calls run concurrently).
        generation_compile (`bool` or `None`, *optional*, defaults to `None`):
            In-process generation ahead: a static KV cache and compiled, CUDA-graph-captured decoding steps
            (transformers' own), compiled once per run. None: on CUDA only.
        record_generation_batches (`str` or `None`, *optional*, defaults to `None`):
            Folder to write every generation batch trained on, as trained, for `trl_a3po.replay`; `None` = none.
    """

    prox_logp_method: str = field(
        default="loglinear",
        metadata={
            "help": "How the proximal log-probs are obtained. `loglinear` (A-3PO): per token, "
            "alpha*log pi_behav + (1-alpha)*log pi_theta with alpha = 1/max(staleness, 1); no forward pass. "
            "`recompute` (decoupled PPO): one no-grad forward of the current policy per generation batch. "
            "`metrics`: recompute and train on it, and also log the error of the loglinear, linear and rollout "
            "approximations against it.",
            "choices": list(PROX_LOGP_METHODS),
        },
    )
    use_decoupled_loss: bool = field(
        default=True,
        metadata={
            "help": "Use the decoupled PPO loss (behaviour weight x clipped ratio to the proximal policy). False "
            "trains with GRPOTrainer's own coupled loss, unchanged: the paper's synchronous baseline."
        },
    )
    behav_imp_weight_cap: float | None = field(
        default=5.0,
        metadata={
            "help": "Upper bound on the behaviour importance weight pi_prox/pi_behav: above it a token's weight "
            "becomes 0 (behav_imp_weight_mode `mask`, the paper's; the token still counts in the "
            "loss denominator) or is "
            "clamped to the cap (`truncate`). None disables the cap. Must be > 1."
        },
    )
    behav_imp_weight_mode: str = field(
        default="mask",
        metadata={
            "help": "What happens to a behaviour weight outside [behav_imp_weight_min, behav_imp_weight_cap]. `mask` "
            "(the paper's): the weight becomes 0 (the token still counts in the loss denominator). `truncate` "
            "(truncated importance sampling): the weight is clamped into the bounds; needs behav_imp_weight_cap.",
            "choices": list(BEHAV_WEIGHT_MODES),
        },
    )
    behav_imp_weight_min: float | None = field(
        default=None,
        metadata={
            "help": "Optional lower bound on the behaviour weight, in (0, 1): with `mask`, tokens (or sequences) "
            "below it are dropped too, a two-sided mask as in IcePop; with `truncate`, weights are "
            "raised to it. None = no "
            "lower bound."
        },
    )
    behav_imp_weight_level: str = field(
        default="token",
        metadata={
            "help": "`token`: each token's weight is bounded. `sequence`: every token of a sequence gets the "
            "sequence's weight, the geometric mean of its token weights, and whole sequences are masked or truncated "
            "(as DeepSeek-V3.2's off-policy sequence masking and TRL's sequence-level importance sampling do).",
            "choices": list(BEHAV_WEIGHT_LEVELS),
        },
    )
    dual_clip_c: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip constant c > 1: bounds the loss of negative-advantage tokens at c*|A| before the "
            "behaviour weight. None disables dual clipping."
        },
    )
    sampling_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Temperature the generator samples with, apart from the learner's `temperature`: the behaviour "
            "log-probs are those of the distribution sampled from (this temperature), while the training forward, "
            "the proximal policy, the reference model and the importance weights use `temperature` (a cooled "
            "sampler, arXiv 2609.36953). None (default) = `temperature` for both, GRPO's behaviour. Needs the "
            "decoupled loss (its behaviour weight corrects for the sampler) and A-3PO's generators (in-process or "
            "rollout_backend='vllm_server').",
        },
    )
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's own vLLM importance-sampling correction. None (default) = off with the decoupled loss, "
            "whose behaviour weight already corrects for the behaviour policy (applying both would correct twice), "
            "and TRL's default (on) with `use_decoupled_loss=False`."
        },
    )

    async_generation: bool | None = field(
        default=None,
        metadata={
            "help": "Generate the next generation batches in a background producer while the trainer updates the "
            "policy (asynchronous RL, the point of A-3PO). The staleness this creates is bounded by "
            "`max_staleness` and corrected by the decoupled loss. False generates each batch when it is needed, "
            "with the current weights (the synchronous baselines; with use_vllm=True, TRL's own vLLM path). None "
            "(default) = on with the decoupled loss, also with TRL's use_vllm=True (the producer then generates on "
            "the vLLM that use_vllm and vllm_mode name, see rollout_backend), unless max_staleness=0 asks for no "
            "generation ahead; off with use_decoupled_loss=False. The coupled loss (use_decoupled_loss=False) may "
            "use the producer only with max_staleness=0: every batch is then generated by the version that trains it "
            "(synchronous GRPO with generation on rollout_backend, e.g. a vLLM server)."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "eta: the largest staleness any sample may be trained with, in policy versions (training steps: "
            "one generation batch consumed by all its optimizer steps). The producer generates batch k only with "
            "weights of version >= k - eta; it waits rather than exceed the bound, and nothing is dropped. None = 2 "
            "with async_generation, 0 without. 2 because at staleness <= 1 loglinear's alpha is 1 (the proximal "
            "policy is the behaviour policy): the A-3PO approximation engages from staleness 2 (alpha 1/2), as in "
            "AReaL's GSM8K A-3PO example. 1 is the lowest-latency choice that still overlaps generation with "
            "training (the next batch is generated while this one trains)."
        },
    )
    rollout_backend: str | None = field(
        default=None,
        metadata={
            "help": "Who generates in asynchronous mode. `inprocess`: a snapshot of the policy in a background "
            "thread (HF generate; on CUDA with a static cache and compiled steps, see generation_compile; CPU, one "
            "GPU). `vllm_server`: a running vLLM server (`trl vllm-serve`, or `vllm serve` "
            "with its flags) at vllm_server_base_url or vllm_server_host:vllm_server_port, with weights pushed by"
            " `weight_sync_transport`; a server that sends nothing for vllm_server_timeout seconds, or reports an"
            " error, stops training with its message. `vllm_colocate`: a vLLM engine inside each training "
            "process, on its device, built from the policy's checkpoint (TRL's vllm_gpu_memory_utilization, "
            "vllm_max_model_length, vllm_model_impl), loaded in memory with each version. None (default): what "
            "TRL's fields say, `vllm_server` with use_vllm=True and vllm_mode='server', `vllm_colocate` with "
            "use_vllm=True and vllm_mode='colocate', else `inprocess`. With asynchronous generation, "
            "use_vllm=True selects the backend and is then set to False: GRPOTrainer's own (synchronous) vLLM is "
            "not built. Or the name of a backend registered with trl_a3po.rollout.register_backend.",
        },
    )
    vllm_server_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Host of the vLLM server (loopback by default). Ignored if vllm_server_base_url is set."},
    )
    weight_sync_transport: str = field(
        default="auto",
        metadata={
            "help": "How new weights reach a vLLM server, which must run with VLLM_SERVER_DEV_MODE=1 and "
            "`--logprobs-mode processed_logprobs` for both (checked at start-up). `disk`: safetensors in "
            "`weight_sync_dir`, then the server reloads them (CPU, or nodes sharing a file system). `nccl`: one "
            "packed NCCL broadcast per version through TRL's VLLMClient (GPU; the server also needs "
            '`--weight-transfer-config \'{"backend": "nccl"}\'`, the trainer the server\'s vLLM release: '
            "`pip install trl-a3po[vllm]`; vllm_group_port is the NCCL group's port). `auto`: nccl where CUDA is "
            "available, else disk.",
            "choices": list(WEIGHT_SYNC_TRANSPORTS),
        },
    )
    lora_weight_sync: str = field(
        default="auto",
        metadata={
            "help": "With a PEFT LoRA policy and rollout_backend='vllm_server': what each version sends to the "
            "server. `adapter`: the adapter alone (MBs instead of the whole model), loaded as a new "
            "LoRA named after the "
            "version (`/v1/load_lora_adapter`, from a folder under weight_sync_dir, also with the "
            "nccl transport: vLLM "
            "loads adapters from files); requests name it, older ones are unloaded. Needs the server started with "
            "--enable-lora, --max-lora-rank >= r and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (checked at start-up). "
            "`merged`: the merged weights W + scale * B @ A. `auto`: adapter where the server and the LoRA config "
            "allow it, else merged, with the reason logged once. In-process generation always merges.",
            "choices": list(LORA_WEIGHT_SYNCS),
        },
    )
    weight_sync_dir: str | None = field(
        default=None,
        metadata={"help": "Folder for the `disk` transport, readable by the server. None = <output_dir>/weight_sync."},
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "Load a newer policy version into the generator only when the one it holds is at least this "
            "many versions (training steps) old, or older than the staleness bound allows. 1 = every version."
        },
    )

    continuous_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate every batch the staleness bound has let in at once instead of one after another: on a "
            "vLLM server each streams as a request of its own (in threads), so the server batches the next batches "
            "together with the current one's tail instead of draining at each batch's end; in-process the batches "
            "waiting are merged into one `generate` (and, with inflight_weight_updates, a stopped generation's tail "
            "joins the next batch's rows). Results still reach the trainer in order. A version is loaded only while "
            "nothing generates (with inflight_weight_updates the generations are stopped between two tokens for it). "
            "Off by default: it raises the token staleness, whose effect on learning is not measured yet (its speed: "
            "benchmarks/RESULTS.md, benchmarks/inflight.py)."
        },
    )
    turn_weight_updates: bool = field(
        default=True,
        metadata={
            "help": "With tools or an environment_factory, generated ahead: let the generator load a newer policy "
            "version between two turns of an episode (the continuation after a tool result is a new request, so no "
            "generation is interrupted). Each token records the version that sampled it; the staleness bound holds "
            "per token. False: an episode's turns are all generated with the version its batch started with (unless "
            "inflight_weight_updates)."
        },
    )
    tool_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "With tools or an environment_factory, generated ahead: a tool call (sync or async) that has not "
            "returned after this many seconds is a failed call, as TRL counts a tool that raises (the model sees "
            "its error message); the episode goes on."
        },
    )
    max_concurrent_episodes: int = field(
        default=64,
        metadata={
            "help": "With tools or an environment_factory, generated ahead: how many episodes of a generation batch "
            "the producer plays at once, each in a thread of its own, so that their tool calls run concurrently; "
            "their turns are generated together."
        },
    )
    inflight_weight_updates: bool = field(
        default=False,
        metadata={
            "help": "Switch the generator to a newer policy version in the middle of a generation, between two "
            "tokens: every unfinished sequence continues from its prompt and the tokens so far, their keys and values "
            "recomputed by the new weights, and each token records the version that sampled it (its own staleness and "
            "alpha in the loss). Fewer stale tokens in long generations, at the cost of one prefill "
            "per switch. Off by "
            "default (one version per sequence): measured, it lowered the token staleness but not the wall time "
            "beyond noise (benchmarks/RESULTS.md, benchmarks/inflight.py). On a vLLM server the request is aborted, "
            "the version pushed, and the unfinished sequences resubmitted with the tokens received so far."
        },
    )

    generation_compile: bool | None = field(
        default=None,
        metadata={
            "help": "In-process generation ahead (rollout_backend='inprocess'): decode with a static KV cache and "
            "compiled, CUDA-graph-captured steps (transformers' `cache_implementation='static'` with `generate`'s "
            "own compilation), compiled once per run: prompt widths are padded to a multiple of 64 tokens and new "
            "versions are loaded into the same weights. None (default): on CUDA only. False: HF generate as TRL "
            "configures it (also where a model cannot compile: the generator then switches, saying why once). Either "
            "way only the sampled token's behaviour log-prob is kept per step, never the scores."
        },
    )

    record_generation_batches: str | None = field(
        default=None,
        metadata={
            "help": "Folder to record every generation batch this run trains on, scored and in the order consumed "
            "(prompt and completion ids, masks, behaviour log-probs, per-token versions, rewards, advantages), with "
            "a manifest of the run's config and initial weights: `trl_a3po.replay.ReplayTrainer` trains on it again "
            "with another proximal anchor. Asynchronous generation only. None: record nothing."
        },
    )

    def __post_init__(self):
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = not self.use_decoupled_loss
        super().__post_init__()

        if self.prox_logp_method not in PROX_LOGP_METHODS:
            raise ValueError(
                f"prox_logp_method={self.prox_logp_method!r} is not supported; set it to one of {PROX_LOGP_METHODS}."
            )
        if self.behav_imp_weight_cap is not None and not self.behav_imp_weight_cap > 1.0:
            raise ValueError(
                f"behav_imp_weight_cap={self.behav_imp_weight_cap} would zero on-policy tokens (their weight is 1); "
                "set it to a value > 1 (the paper uses 5.0) or None to disable the cap."
            )
        self._validate_behaviour_weight()
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c={self.dual_clip_c} must be > 1 (typically 3.0), or None to disable it.")
        self._validate_generation()
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s={self.tool_timeout_s} must be > 0 (seconds a tool call may take).")
        if self.max_concurrent_episodes < 1:
            raise ValueError(
                f"max_concurrent_episodes={self.max_concurrent_episodes} must be >= 1 (episodes played at once)."
            )
        micro_steps = self.steps_per_generation * self.num_iterations
        # The producer counts versions too (it generates batch k with version k - max_staleness or newer).
        if (self.use_decoupled_loss or self.async_generation) and micro_steps % self.gradient_accumulation_steps:
            # A policy version is the weights after a whole generation batch has been trained; a batch that ends
            # inside an optimizer step would have no such weights.
            raise ValueError(
                f"A3POConfig: steps_per_generation ({self.steps_per_generation}) x num_iterations "
                f"({self.num_iterations}) = {micro_steps} micro-batches per generation batch must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}), so that every "
                "generation batch ends "
                "on an optimizer step (the end of a policy version); e.g. set steps_per_generation to a multiple of "
                "gradient_accumulation_steps."
            )
        if self.use_decoupled_loss or self.async_generation:
            self._refuse_non_sampling_generation_kwargs()
        if self.sampling_temperature is not None:
            if not self.sampling_temperature > 0.0:
                raise ValueError(
                    f"sampling_temperature={self.sampling_temperature} must be > 0 (or None: `temperature`)."
                )
            if not self.use_decoupled_loss:
                raise ValueError(
                    "sampling_temperature samples from another distribution than the learner's; GRPOTrainer's "
                    "coupled loss (use_decoupled_loss=False) has no behaviour weight to correct for it. Set "
                    "use_decoupled_loss=True, or unset sampling_temperature."
                )
            if self.use_vllm:
                raise ValueError(
                    "sampling_temperature applies to A-3PO's generators (in-process, rollout_backend='vllm_server'); "
                    "TRL's use_vllm=True path samples at `temperature`. Unset sampling_temperature, or set "
                    "use_vllm=False."
                )
        if not self.use_decoupled_loss:
            return

        unsupported = {
            "vllm_importance_sampling_correction": (
                self.vllm_importance_sampling_correction,
                "the behaviour weight pi_prox/pi_behav is the decoupled loss's correction for the sampler (its "
                "log-probs are the behaviour log-probs); TRL's on top would correct twice. Set "
                "vllm_importance_sampling_correction=False (or leave it unset) and bound the weight with "
                "behav_imp_weight_cap / _min / _mode / _level",
            ),
            "use_transformers_continuous_batching": (
                self.use_transformers_continuous_batching,
                "continuous batching returns no behaviour log-probs; set use_transformers_continuous_batching=False "
                "or use_vllm=True",
            ),
            "dual_clip_c": (
                self.dual_clip_c is not None and self.loss_type not in CLIPPED_LOSS_TYPES,
                f"dual clipping bounds the clipped surrogate, which loss_type={self.loss_type!r} does not have; unset "
                f"dual_clip_c, or use one of {CLIPPED_LOSS_TYPES}",
            ),
            "delta": (
                self.delta is not None and self.dual_clip_c is not None,
                "TRL's `delta` and dual_clip_c both bound the loss of negative-advantage tokens "
                "(delta caps the ratio, "
                "dual_clip_c the loss at c*|A|, the same bound with c = delta); set only one of them",
            ),
        }
        refuse_fields(unsupported)

    def _refuse_non_sampling_generation_kwargs(self):
        """generation_kwargs that make the generator return something else than one sampled completion per prompt
        row, named before any model work (the behaviour log-probs and the producer's batch need exactly that)."""
        kwargs = self.generation_kwargs or {}
        not_sampled = (
            "selects tokens instead of sampling them: no distribution drew them, so their behaviour "
            "log-probs (and the behaviour weight pi_prox/pi_behav) have no meaning"
        )
        more_rows = (
            "returns several completions per prompt row; GRPO repeats each prompt num_generations times "
            "already: set num_generations instead"
        )
        refused = {
            "num_beams": (lambda v: v not in (None, 1), f"beam search {not_sampled}"),
            "num_beam_groups": (lambda v: v not in (None, 1), f"group beam search {not_sampled}"),
            "use_beam_search": (bool, f"beam search {not_sampled}"),
            "penalty_alpha": (lambda v: v not in (None, 0), f"contrastive search {not_sampled}"),
            "do_sample": (lambda v: v is False, f"greedy decoding {not_sampled}"),
            "num_return_sequences": (lambda v: v not in (None, 1), more_rows),
            "n": (lambda v: v not in (None, 1), more_rows),
            "best_of": (lambda v: v not in (None, 1), more_rows),
        }
        for key, (bad, reason) in refused.items():
            if key in kwargs and bad(kwargs[key]):
                raise ValueError(
                    f"A3POConfig.generation_kwargs[{key!r}]={kwargs[key]!r}: {reason}. Remove it from "
                    "generation_kwargs, or set use_decoupled_loss=False and async_generation=False (GRPOTrainer's own "
                    "loss and generation)."
                )

    def _validate_behaviour_weight(self):
        if self.behav_imp_weight_mode not in BEHAV_WEIGHT_MODES:
            raise ValueError(
                f"behav_imp_weight_mode={self.behav_imp_weight_mode!r} is not supported; use one of "
                f"{BEHAV_WEIGHT_MODES}."
            )
        if self.behav_imp_weight_level not in BEHAV_WEIGHT_LEVELS:
            raise ValueError(
                f"behav_imp_weight_level={self.behav_imp_weight_level!r} is not supported; use one of "
                f"{BEHAV_WEIGHT_LEVELS}."
            )
        if self.behav_imp_weight_min is not None and not 0.0 < self.behav_imp_weight_min < 1.0:
            raise ValueError(
                f"behav_imp_weight_min={self.behav_imp_weight_min} must be in (0, 1): on-policy tokens have weight 1 "
                "and must stay inside the bounds. Set e.g. 0.5, or None for no lower bound."
            )
        if self.behav_imp_weight_mode == "truncate" and self.behav_imp_weight_cap is None:
            raise ValueError(
                "behav_imp_weight_mode='truncate' clamps weights at behav_imp_weight_cap, which is None; set "
                "behav_imp_weight_cap (e.g. 2.0, as truncated importance sampling does) or use mode 'mask'."
            )
        custom = {
            "behav_imp_weight_mode": self.behav_imp_weight_mode != "mask",
            "behav_imp_weight_min": self.behav_imp_weight_min is not None,
            "behav_imp_weight_level": self.behav_imp_weight_level != "token",
        }
        if not self.use_decoupled_loss and any(custom.values()):
            names = ", ".join(name for name, set_ in custom.items() if set_)
            raise ValueError(
                f"{names} shape the decoupled loss's behaviour weight, but use_decoupled_loss=False; set "
                "use_decoupled_loss=True, or leave them at their defaults (GRPO's own options: "
                "vllm_importance_sampling_mode)."
            )

    def _validate_generation(self):
        if self.async_generation is None:
            # TRL's use_vllm=True generates ahead too, on that vLLM; max_staleness=0 asks for no generation ahead,
            # which TRL's own synchronous vLLM path is.
            self.async_generation = self.use_decoupled_loss and not (self.use_vllm and self.max_staleness == 0)
        if self.async_generation and self.use_vllm:
            self._generate_ahead_on_trls_vllm()
        if self.rollout_backend is None:
            self.rollout_backend = DEFAULT_BACKEND
        backend = backend_entry(self.rollout_backend)  # (an unknown name: a ValueError listing the registered ones)
        if self.weight_sync_transport not in WEIGHT_SYNC_TRANSPORTS:
            raise ValueError(
                f"weight_sync_transport={self.weight_sync_transport!r} is not supported; use one of "
                f"{WEIGHT_SYNC_TRANSPORTS}."
            )
        if self.lora_weight_sync not in LORA_WEIGHT_SYNCS:
            raise ValueError(
                f"lora_weight_sync={self.lora_weight_sync!r} is not supported; use one of {LORA_WEIGHT_SYNCS}."
            )
        if self.lora_weight_sync == "adapter" and not backend.adapters:
            raise ValueError(
                "lora_weight_sync='adapter' sends LoRA adapters to a vLLM server; with rollout_backend="
                f"{self.rollout_backend!r} the generator always runs the merged weights: set lora_weight_sync='auto' "
                "(or 'merged'), or rollout_backend='vllm_server'."
            )
        if self.continuous_generation and not self.async_generation:
            raise ValueError(
                "continuous_generation=True generates several batches of the background producer at once; it needs "
                "async_generation=True. Set continuous_generation=False."
            )
        if self.inflight_weight_updates and not self.async_generation:
            raise ValueError(
                "inflight_weight_updates=True switches versions inside the producer's generations; it needs "
                "async_generation=True. Set inflight_weight_updates=False."
            )
        if self.generation_compile and not (self.async_generation and backend.compiles_generation):
            raise ValueError(
                "generation_compile=True compiles the in-process generator of asynchronous generation; here "
                f"async_generation={self.async_generation}, rollout_backend={self.rollout_backend!r}. Leave "
                "generation_compile=None (vLLM compiles its own steps; synchronous generation is TRL's HF generate)."
            )
        backend.check_config(self)  # the backend's own refusals (the colocated engine's)
        for name, capable in (
            ("inflight_weight_updates", backend.inflight_updates),
            ("continuous_generation", backend.continuous_generation),
        ):
            if getattr(self, name) and not capable:
                raise ValueError(
                    f"{name}=True: rollout_backend={self.rollout_backend!r} does not support it (its registry entry "
                    f"says so). Set {name}=False."
                )
        if self.weight_sync_steps < 1:
            raise ValueError(f"weight_sync_steps={self.weight_sync_steps} must be >= 1.")
        if self.max_staleness is None:
            self.max_staleness = 2 if self.async_generation else 0
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness} must be >= 0 (policy versions).")
        if self.async_generation and self.max_staleness == 0 and self.use_decoupled_loss:
            # Valid, but the producer can only start a batch once the trainer needs it: asynchronous in form only.
            warnings.warn(
                "max_staleness=0 leaves no room to generate ahead: generation will not overlap training. Set "
                "max_staleness >= 1 for overlap (2+ for the A-3PO approximation to engage).",
                stacklevel=3,
            )
        if self.record_generation_batches is not None and not (self.async_generation and self.use_decoupled_loss):
            raise ValueError(
                "record_generation_batches records what a replay retrains with the decoupled loss: the batches of "
                "asynchronous generation, with their versions (cut into micro-batches by its seeded shuffle). Set "
                "async_generation=True and use_decoupled_loss=True (max_staleness=0 for synchronous data), or "
                "record_generation_batches=None."
            )
        if self.async_generation:
            if not self.use_decoupled_loss and self.max_staleness != 0:
                raise ValueError(
                    f"async_generation=True with max_staleness={self.max_staleness} trains on stale samples, which "
                    "the coupled GRPO loss (use_decoupled_loss=False) does not correct; set "
                    "use_decoupled_loss=True, or "
                    "max_staleness=0 (synchronous: each batch generated by the version that trains it), or "
                    "async_generation=False."
                )
            if self.vllm_structured_outputs_regex is not None:
                raise ValueError(
                    "vllm_structured_outputs_regex constrains TRL's own vLLM generation; the "
                    "asynchronous producer sends "
                    "no structured-output constraint, so it would be ignored. Set async_generation=False with "
                    "use_vllm=True, or unset vllm_structured_outputs_regex."
                )
        elif self.rollout_backend != DEFAULT_BACKEND:
            raise ValueError(
                f"rollout_backend={self.rollout_backend!r} is the asynchronous producer's; with "
                "async_generation=False use TRL's own use_vllm=True, vllm_mode='server'."
            )

    def _generate_ahead_on_trls_vllm(self):
        """TRL's `use_vllm=True` with asynchronous generation: the producer generates on the vLLM that `vllm_mode`
        names (TRL's server and colocation fields keep their meaning), and GRPOTrainer must not build its own
        synchronous vLLM (a second NCCL group to the same server, or a second engine on the device; and TRL's refusal
        of a trainer without vLLM installed, which the disk and adapter transports do not need)."""
        wanted = {"server": "vllm_server", "colocate": "vllm_colocate"}[self.vllm_mode]
        if self.rollout_backend not in (None, wanted):
            raise ValueError(
                f"use_vllm=True, vllm_mode={self.vllm_mode!r} generates with {wanted}, but rollout_backend="
                f"{self.rollout_backend!r} asks for another generator; unset rollout_backend, or set use_vllm=False."
            )
        self.rollout_backend = wanted
        self.use_vllm = False

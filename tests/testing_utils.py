"""Helpers shared by the test modules and tests/scripts (TRL's `testing_utils.py` habit): tiny models and a locally
trained tokenizer (the tests run offline, on CPU, in seconds), the test environments and tools, the trainers' common
config, the version invariant's check, and the two-process launcher. Fixtures live in conftest.py."""

import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, TrainerCallback

from trl_a3po.rollout import GenerationQueue, build_whole_snapshot
from trl_a3po.rollout.policy_weights import policy_tensors


CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Weng earns 12 dollars an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Betty is saving money for a new wallet which costs 100 dollars. #### 5",
    "James writes a 3-page letter to 2 different friends twice a week. \\boxed{624}",
    "0 1 2 3 4 5 6 7 8 9 10 + - * / = . , ? ! $ %",
] * 4


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<eos>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    return tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def make_tool_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with TRL's Qwen2.5 chat template (which renders tools and tool calls; TRL
    parses its responses), trained on that template's text so a tool prompt stays short."""
    import trl

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    from transformers.utils import get_json_schema

    corpus = [
        template,
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
        "<tool_response>\n7\n</tool_response> What is 3 + 4? The answer is 7. system user assistant tool",
        json.dumps(get_json_schema(add)),
        "0 1 2 3 4 5 6 7 8 9 Question",
    ] * 8
    from tokenizers import decoders

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=["<pad>", "<|im_end|>", "<unk>", "<|im_start|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = template
    return tokenizer


OBSERVATION = " Use the tool."  # what `AddingEnvironment.reset` appends to a prompt


def tool_question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: What is 3 + 4?"}]


def make_tool_model(tokenizer, steps: int = 250, hidden_size: int = 64, layers: int = 2):
    """A tiny model taught (supervised, on CPU, in seconds) to answer `tool_question`s by calling `add(3, 4)` one to
    three times before "The answer is 7.": sampled at temperature 1 it makes one to several calls per episode, now
    and then a malformed one."""
    model = make_model(
        tokenizer,
        hidden_size=hidden_size,
        layers=layers,
        heads=hidden_size // 32,  # head size 32: one vLLM's CPU attention supports (the server tests serve it)
        kv_heads=1,
        max_positions=1024,  # the tool prompt (the template's tool block) is about 230 tokens
    )
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}

    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tools=[add], tokenize=True, return_dict=True, **kwargs)[
            "input_ids"
        ]

    examples = []
    for i, calls in enumerate((1, 2, 3, 1, 2, 1)):
        messages = tool_question(i)
        if i % 2:  # as `AddingEnvironment.reset` extends it
            messages[-1]["content"] += OBSERVATION
        for _ in range(calls):
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "add", "content": "7"},
            ]
        messages.append({"role": "assistant", "content": "The answer is 7."})
        ids = render(messages)
        labels = [-100] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":  # learn the assistant turns only, up to their end-of-turn token
                start, end = (
                    len(render(messages[:turn], add_generation_prompt=True)),
                    len(render(messages[: turn + 1])),
                )
                labels[start : end - 1] = ids[start : end - 1]
        examples.append((torch.tensor([ids]), torch.tensor([labels])))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        ids, labels = examples[step % len(examples)]
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def tool_model_saved(folder, tokenizer, weights):
    """The tool model (`make_tool_model`, with `weights`) and its tokenizer, saved in `folder` for a server and the
    launched processes."""
    model = make_tool_model(tokenizer, steps=0)
    model.load_state_dict(weights)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class AddingEnvironment:
    """An environment whose tool is its own `add`, whose reward is its own state, and whose data is its `reset`."""

    resets = collections.Counter()  # thread name -> resets, over every instance
    lock = threading.Lock()

    def __init__(self):
        self.added = 0

    def reset(self, **row):
        with AddingEnvironment.lock:
            AddingEnvironment.resets[threading.current_thread().name] += 1
        self.added = 0
        return OBSERVATION

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        total = a + b  # arguments of a type that cannot be added raise here, uncounted (TRL counts a failed call)
        self.added += 1
        return total

    def get_reward(self) -> float:
        return float(self.added)


class DoublingEnvironment(AddingEnvironment):
    def get_reward(self) -> float:
        return 2.0 * self.added


def make_model(tokenizer, seed: int = 0, hidden_size=32, layers=2, heads=4, kv_heads=2, max_positions=256):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def vllm_python() -> str | None:
    """The Python of the vLLM venv the server tests start servers with (.venv-vllm, or A3PO_VLLM_PYTHON)."""
    candidate = os.environ.get("A3PO_VLLM_PYTHON") or str(
        Path(__file__).resolve().parent.parent / ".venv-vllm/bin/python"
    )
    return candidate if Path(candidate).exists() else None


def need_vllm_python() -> str:
    """`vllm_python()`, or skip the test (fail under A3PO_REQUIRE_VLLM, as CI sets)."""
    python = vllm_python()
    if python is None:
        if os.environ.get("A3PO_REQUIRE_VLLM"):
            pytest.fail("A3PO_REQUIRE_VLLM is set but no vLLM venv was found (.venv-vllm or A3PO_VLLM_PYTHON)")
        pytest.skip("no vLLM venv (.ci/run installs one in .venv-vllm)")
    return python


def free_port() -> int:
    """A TCP port free on loopback now (for a server, a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def producer_threads() -> list:
    """The generation threads alive now: producers ("a3po-producer") and continuous generation's streams."""
    return [
        t
        for t in threading.enumerate()
        if (t.name == "a3po-producer" or t.name.startswith("a3po-stream")) and t.is_alive()
    ]


def generate_two_versions_ahead(trainer):
    """Before each new version is published (the start of each training step after the first), let the producer
    finish every batch already submitted, so batch k + 2 is generated by version k: staleness 2 is reached on every
    step from the third, whatever the threads' timing."""
    take_generated_batch = trainer._take_generated_batch

    def taking():
        queue = trainer._rollout.queue
        if queue is not None and trainer.policy_version > 0:
            done = threading.Event()
            while queue.depth < queue._next_submit - queue._next_get and not done.is_set():
                queue.raise_if_failed()
                done.wait(0.005)  # a condition the producer sets (a result in its FIFO), read again
        return take_generated_batch()

    trainer._take_generated_batch = taking


def digit_reward(completions, **kwargs):
    """A deterministic reward with spread inside each group: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def require_deepspeed():
    """DeepSpeed comes with the test set-up (`scripts/setup.sh --with-vllm`); CI (A3PO_REQUIRE_VLLM) must have it."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        if os.environ.get("A3PO_REQUIRE_VLLM"):
            pytest.fail("A3PO_REQUIRE_VLLM is set but DeepSpeed is not installed (scripts/setup.sh --with-vllm)")
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh --with-vllm installs it)")


COMMON = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    seed=0,
    learning_rate=1e-3,
    bf16=False,  # transformers 5 defaults to bf16 autocast, even on CPU: fp32 keeps the checks tight
)


def make_trainer(
    tmp_path,
    tokenizer,
    dataset,
    trainer_cls=None,
    config_cls=None,
    *,
    model=None,
    reward=None,
    peft_config=None,
    tools=None,
    **config,
):
    """The tests' one trainer factory: `config` over COMMON, the tiny model (`make_model`) unless `model` is given,
    `digit_reward` unless `reward` is; A3POTrainer / A3POConfig unless other classes are given (GRPOTrainer's, for
    side-by-side checks); `tools` as GRPOTrainer takes them. With a KL term TRL loads the reference model by name: the
    tiny model is saved first."""
    from trl_a3po import A3POConfig, A3POTrainer

    args = (config_cls or A3POConfig)(output_dir=str(tmp_path), **{**COMMON, **config})
    if model is None:
        model = make_model(tokenizer)
        if args.beta != 0.0:
            model.save_pretrained(tmp_path / "model")
            model = str(tmp_path / "model")
    return (trainer_cls or A3POTrainer)(
        model=model,
        reward_funcs=reward or digit_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        tools=tools,
    )


def handmade_batch(trainer, seed=0, behav_noise=0.3):
    """A micro-batch as `_prepare_inputs` hands it to the loss; the behaviour (and GRPOTrainer's "old") log-probs are
    the current policy's off by noise, so ratios move away from 1 and the clip bites; with a KL term, the reference's
    too."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(5, vocab, (4, 5), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(5, vocab, (4, 6), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), 6
        )
    behav = logp + behav_noise * torch.randn(logp.shape, generator=g)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25, -1.5]),
        "num_items_in_batch": completion_mask.sum(),
        "sampling_per_token_logps": behav,
        "old_per_token_logps": behav,  # what GRPOTrainer reads
        "behavior_version": torch.zeros_like(completion_ids),  # per completion token
    }
    if trainer.beta != 0.0:
        batch["ref_per_token_logps"] = logp + behav_noise * torch.randn(logp.shape, generator=g)
    return batch


def loss_and_grads(trainer, batch):
    """One micro-batch's training loss (no accumulation) and the gradient it leaves, flattened."""
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


NEWER_VERSION_DUE = GenerationQueue._newer_version_due  # as defined, before any test patches it


def wait_for_the_next_version(queue, *held_version) -> bool:
    """`GenerationQueue._newer_version_due` for in-flight updates, where a race decides whether versions change
    mid-sequence (a slow machine's trainer once lost at 60 ms per token; on a vLLM server every batch streams at once,
    and a loaded machine's trainer published only after all had ended). Instead, a generation of batches the trainer
    does not need yet (every index above the newest published version: the trainer trains that version's batch and
    publishes the next one without them) waits, at each token, until a newer version is due; so every run has
    versions change mid-sequence, on any machine. Who generates what: a stream thread `a3po-stream-<its first batch>`
    (continuous generation), or the producer thread's `generating_batch`."""
    thread = threading.current_thread().name
    if thread.startswith("a3po-stream-"):
        batch = int(thread.removeprefix("a3po-stream-"))
    elif threading.current_thread() is queue._thread:
        batch = queue.generating_batch
    else:
        batch = None
    if batch is not None:
        deadline = time.monotonic() + 120
        while (
            batch > queue.published_version
            and not NEWER_VERSION_DUE(queue, *held_version)
            and not queue._stop.is_set()
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{thread}: no version after {queue.published_version} published in 120 s")
            queue._stop.wait(0.01)  # a condition the trainer sets (a newer version), read again
    return NEWER_VERSION_DUE(queue, *held_version)


class VersionRecorder(TrainerCallback):
    """The weights of every policy version, taken independently of the queue: at the start of each training step
    (global_step a multiple of the optimizer steps per version), the live weights are that version."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.weights = {}

    def on_step_begin(self, args, state, control, **kwargs):
        per_version = args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        if state.global_step % per_version == 0:
            if self.trainer._dist.is_zero3:  # partitioned: gather the whole weights (a collective, every rank is here)
                with policy_tensors(self.trainer.model_wrapped, self.trainer._dist) as tensors:
                    weights = {name: tensor.detach().clone() for name, tensor in tensors}
            else:
                weights = {name: tensor.detach().clone() for name, tensor in self.trainer.model.state_dict().items()}
            self.weights[state.global_step // per_version] = weights


def record_trained_samples(
    trainer,
    keys=(
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "sampling_per_token_logps",
        "behavior_version",
        "tool_mask",
    ),
):
    samples = []
    original = trainer._compute_loss

    def recording(model, inputs):
        samples.append({key: inputs[key].detach().clone() for key in keys if key in inputs})
        return original(model, inputs)

    trainer._compute_loss = recording
    return samples


def record_versions_and_samples(trainer):
    """What `check_behaviour_logprobs_against_versions` reads once `trainer` has trained: every version's weights
    (a `VersionRecorder`, added as a callback) and every trained micro-batch (`record_trained_samples`)."""
    versions = VersionRecorder(trainer)
    trainer.add_callback(versions)
    return versions, record_trained_samples(trainer)


def check_behaviour_logprobs_against_versions(trainer, versions, samples, atol, temperature=None):
    """For every trained sample: its behaviour log-probs equal those the weights of its recorded behaviour version
    give it (a forward of those weights after training, at `temperature`: default the learner's). Returns the number
    of samples checked."""
    replay = trainer.model  # TRL's patched forward; training is over, so it can carry each version's weights
    logps = trainer._get_per_token_logps_and_entropies
    # Partitioned parameters, or another temperature than the one TRL's patched forward bakes in: replay on a whole,
    # plain copy of the architecture instead.
    if trainer._dist.is_zero3 or temperature is not None:
        replay = build_whole_snapshot(trainer.accelerator.unwrap_model(trainer.model), torch.device("cpu"))
        temperature = temperature or trainer.temperature

        def logps(model, input_ids, attention_mask, logits_to_keep):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1 : -1]
            logp = torch.log_softmax(logits.float() / temperature, -1)
            return logp.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1), None, None

    replay.eval()
    checked = 0
    for inputs in samples:
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:  # tool results are not sampled: their log-prob is TRL's 0.0 placeholder
            mask &= inputs["tool_mask"].bool()
        token_versions = inputs["behavior_version"]
        assert token_versions.shape == mask.shape  # one version per completion token
        seen = torch.zeros_like(mask)
        for version in token_versions[mask].unique().tolist():
            tokens = (token_versions == version) & mask
            rows = tokens.any(-1)
            replay.load_state_dict(versions.weights[version])
            with torch.no_grad():
                logp, _, _ = logps(
                    replay,
                    torch.cat([inputs["prompt_ids"][rows], inputs["completion_ids"][rows]], 1),
                    torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], 1),
                    inputs["completion_ids"].size(1),
                )
            diff = (logp - inputs["sampling_per_token_logps"][rows]).abs()[tokens[rows]]
            assert diff.max().item() < atol, (version, diff.max().item())
            seen |= tokens
        assert torch.equal(seen, mask)  # every trained token was checked against its own version
        checked += mask.size(0)
    return checked


SCRIPT = Path(__file__).resolve().parent / "scripts" / "two_process_run.py"


DEEPSPEED_CPU = SCRIPT.parent / "deepspeed_cpu.json"


def launch(out_dir, mode, *extra, expect_failure=False):
    """`mode`s ending in "zero3" run under real DeepSpeed ZeRO-3 (CPU, gloo, `DEEPSPEED_CPU`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    distributed = ["--multi_gpu"]
    if mode.endswith("zero3"):
        distributed = ["--use_deepspeed", "--deepspeed_config_file", str(DEEPSPEED_CPU), "--zero3_init_flag", "true"]
    # `--cpu` alone starts one process unless MPI is set up; `--multi_gpu` uses torchrun, which on a machine without
    # GPUs (and `use_cpu=True` in the config) runs the processes on CPU over gloo.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *distributed,
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(SCRIPT),
        str(out_dir),
        mode,
        *map(str, extra),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if expect_failure:
        return result
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads((out_dir / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def check_ranks_follow_the_synchronous_shards(sync, async_):
    """Each rank trains exactly the prompts the synchronous run gives it, the ranks are disjoint, staleness stays
    within the bound, and every trained sample matched the weights of its recorded behaviour version."""
    assert [r["world"] for r in async_] == [2, 2]
    for rank in range(2):
        assert async_[rank]["prompts"] == sync[rank]["prompts"], f"rank {rank} trained other prompts"
        assert len(async_[rank]["prompts"]) == 4  # 8 steps / 2 steps per generation batch
        staleness = async_[rank]["staleness_max"]
        assert len(staleness) == 8 and max(staleness) <= async_[rank]["eta"] == 2
    prompts = [{p for batch in r["prompts"] for p in batch} for r in async_]
    assert prompts[0].isdisjoint(prompts[1])  # the ranks share the batch, not duplicate it

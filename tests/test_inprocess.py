"""The in-process decoder: each sampled token's behaviour log-prob, kept per step (batch x tokens), equal to what HF
generate's processed scores give; the static-cache (compiled on CUDA) path equal to the plain one."""

import threading

import pytest
import torch
from testing_utils import make_model
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from trl_a3po.rollout import generate_with_behavior_logprobs
from trl_a3po.rollout.inprocess import InProcessBackend, left_pad


PROCESSED = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)


def reference(model, prompt_ids, config, pad_token_id, eos_token_ids, budgets):
    """HF generate with every step's processed scores (output_scores), the sampled tokens' log-softmax gathered."""
    input_ids, attention_mask = left_pad(prompt_ids, pad_token_id)
    config = GenerationConfig(**{**config.to_dict(), "output_scores": True, "return_dict_in_generate": True})
    config.max_new_tokens = max(budgets)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    completion = out.sequences[:, input_ids.size(1) :]
    steps = [torch.log_softmax(s.float(), -1).gather(-1, completion[:, t, None]) for t, s in enumerate(out.scores)]
    logprobs = torch.cat(steps, 1)
    ids, lps = [], []
    for row, budget in enumerate(budgets):
        tokens = completion[row].tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos_token_ids]
        length = min(ends[0] + 1 if ends else len(tokens), budget)
        ids.append(tokens[:length])
        lps.append(logprobs[row, :length].tolist())
    return ids, lps


def generation_config(tokenizer, do_sample, **kwargs):
    fields = dict(max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return GenerationConfig(do_sample=do_sample, **{**fields, **(PROCESSED if do_sample else {}), **kwargs})


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("do_sample", [True, False])
def test_tokens_and_logprobs_equal_hf_generates_processed_scores(tokenizer, do_sample, compiled):
    model = make_model(tokenizer).eval()
    # ragged prompts; per-row budgets; an end token the model does sample (a random model rarely samples its EOS):
    # the third token of a first greedy completion
    prompts = [tokenizer(text)["input_ids"] for text in ["Natalia sold", "How many clips did", "0 1 2 3 4 5 6 7"]]
    budgets = [12, 5, 9]
    first, _ = generate_with_behavior_logprobs(
        model, prompts[:1], generation_config(tokenizer, False), tokenizer.pad_token_id, [tokenizer.eos_token_id]
    )
    eos = [first[0][2]]
    config = generation_config(tokenizer, do_sample, eos_token_id=eos[0])
    seen_eos = 0
    for seed in range(4):
        torch.manual_seed(seed)
        ids, logprobs = generate_with_behavior_logprobs(
            model, prompts, config, tokenizer.pad_token_id, eos, budgets=budgets, compiled=compiled
        )
        torch.manual_seed(seed)
        want_ids, want_logprobs = reference(model, prompts, config, tokenizer.pad_token_id, eos, budgets)
        assert ids == want_ids
        for row, want in zip(logprobs, want_logprobs):
            assert row == pytest.approx(want, abs=1e-5)
        assert all(len(row) <= budget for row, budget in zip(ids, budgets))
        seen_eos += sum(row[-1] == eos[0] for row in ids if row)
    assert seen_eos > 0  # rows did end at EOS (and the others at their budgets)


def test_the_memory_held_for_logprobs_grows_with_batch_times_tokens_not_vocabulary(tokenizer, monkeypatch):
    """A 100k vocabulary: the old path (every step's scores) would hold batch x tokens x 100k floats. The decoder keeps
    one step's scores (generate's own temporaries) and a batch x tokens log-prob tensor."""
    vocab = 100_000
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[1] = 0  # EOS never wins: every row runs its whole budget
    batch, tokens = 4, 64
    gen = GenerationConfig(max_new_tokens=tokens, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=1)
    held = []  # every tensor the decoder's per-step hooks keep past their step
    from trl_a3po.rollout import inprocess

    record = inprocess._SampledLogprobs.record

    def spy(self, input_ids):
        record(self, input_ids)
        held.append((self.logprobs.numel(), self._scores))

    monkeypatch.setattr(inprocess._SampledLogprobs, "record", spy)
    ids, logprobs = generate_with_behavior_logprobs(model, [[5, 6, 7]] * batch, gen, 0, [1])
    assert [len(row) for row in ids] == [tokens] * batch
    assert len(held) == tokens
    assert {numel for numel, _ in held} == {batch * tokens}  # the log-prob buffer: batch x tokens floats
    assert all(scores is None for _, scores in held)  # no step's batch x vocabulary scores kept past it
    # and the result matches the processed distribution it was sampled from (plain softmax here)
    with torch.no_grad():
        full = torch.tensor([[5, 6, 7] + row for row in ids])
        expected = torch.log_softmax(model(full).logits[:, 2:-1].float(), -1).gather(-1, full[:, 3:, None])
    assert torch.tensor(logprobs) == pytest.approx(expected.squeeze(-1), abs=1e-4)


def test_a_version_loaded_in_place_is_the_one_the_next_generation_samples_with(tokenizer):
    """The compiled decoder's weights are loaded in place (no new model, no recompilation): after a load, the
    behaviour log-probs are the new version's, to 1e-5 in fp32."""
    snapshot = make_model(tokenizer, seed=0)
    config = generation_config(tokenizer, True, max_new_tokens=8)
    backend = InProcessBackend(snapshot, config, tokenizer.pad_token_id, [tokenizer.eos_token_id], compiled=True)
    weights_before = [p.data_ptr() for p in snapshot.parameters()]
    prompts = [tokenizer("Natalia sold")["input_ids"], tokenizer("How many")["input_ids"]]
    stop = threading.Event()
    for seed in (0, 1):
        version = make_model(tokenizer, seed=seed)
        backend.load(backend.stage(version.state_dict()))
        torch.manual_seed(seed)
        ids, logprobs = backend.generate(prompts, stop)
        torch.manual_seed(seed)
        want_ids, want_logprobs = reference(
            version.eval(), prompts, config, tokenizer.pad_token_id, [tokenizer.eos_token_id], [8, 8]
        )
        assert ids == want_ids
        for row, want in zip(logprobs, want_logprobs):
            assert row == pytest.approx(want, abs=1e-5)
    assert [p.data_ptr() for p in snapshot.parameters()] == weights_before
    assert backend.compiled  # static cache kept (no fallback taken)


def test_a_decoder_that_cannot_compile_falls_back_to_hf_generate_once_with_the_reason(tokenizer, monkeypatch, caplog):
    snapshot = make_model(tokenizer)
    config = generation_config(tokenizer, True, max_new_tokens=4)
    backend = InProcessBackend(snapshot, config, tokenizer.pad_token_id, [tokenizer.eos_token_id], compiled=True)
    from trl_a3po.rollout import inprocess

    real = inprocess.generate_with_behavior_logprobs
    calls = []

    def cannot_compile(*args, compiled=False, **kwargs):
        calls.append(compiled)
        if compiled:
            raise RuntimeError("this model's forward cannot be traced")
        return real(*args, compiled=compiled, **kwargs)

    monkeypatch.setattr(inprocess, "generate_with_behavior_logprobs", cannot_compile)
    stop = threading.Event()
    with caplog.at_level("WARNING", logger="trl_a3po.rollout.inprocess"):
        for _ in range(2):
            ids, _ = backend.generate([tokenizer("Natalia")["input_ids"]], stop)
            assert len(ids[0]) >= 1
    assert calls == [True, False, False]  # tried once, then HF generate
    warnings = [r.getMessage() for r in caplog.records if "cannot decode with a static cache" in r.getMessage()]
    assert len(warnings) == 1 and "cannot be traced" in warnings[0]


def test_a_stop_ends_a_generation_within_one_step(tokenizer):
    model = make_model(tokenizer).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0
    config = generation_config(tokenizer, True, max_new_tokens=200)
    stop = threading.Event()
    steps = []
    from transformers import LogitsProcessor

    class StopAfterThree(LogitsProcessor):
        def __call__(self, input_ids, scores):
            steps.append(1)
            if len(steps) == 3:
                stop.set()
            return scores

    from transformers import LogitsProcessorList

    real = model.generate
    model.generate = lambda **kwargs: real(logits_processor=LogitsProcessorList([StopAfterThree()]), **kwargs)
    for compiled in (False, True):
        steps.clear()
        stop.clear()
        ids, _ = generate_with_behavior_logprobs(
            model, [[5, 6]], config, tokenizer.pad_token_id, [tokenizer.eos_token_id], stop=stop, compiled=compiled
        )
        assert len(steps) == 3 and len(ids[0]) == 3  # the step that saw the stop was the last


class OwnLoopModel(Qwen2ForCausalLM):
    """A custom model whose `generate` is a decoding loop of its own (greedy, no KV cache), outside transformers'
    logits processors: the log-probs then come from one forward over the sequences and the config's processors."""

    def generate(self, input_ids, attention_mask, generation_config, stopping_criteria, **kwargs):
        for _ in range(generation_config.max_new_tokens):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = self(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, token], 1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], 1)
            if stopping_criteria(input_ids, None).all():
                break
        return input_ids


def test_a_decoding_loop_outside_the_processor_chain_gets_the_logprobs_of_the_distribution_it_sampled(tokenizer):
    model = make_model(tokenizer)
    own = OwnLoopModel(model.config).eval()
    own.load_state_dict(model.state_dict())
    config = generation_config(tokenizer, False, max_new_tokens=6)
    prompts = [tokenizer("Natalia sold")["input_ids"], tokenizer("How many clips did")["input_ids"]]
    ids, logprobs = generate_with_behavior_logprobs(
        own, prompts, config, tokenizer.pad_token_id, [tokenizer.eos_token_id]
    )
    want_ids, want_logprobs = reference(
        model.eval(), prompts, config, tokenizer.pad_token_id, [tokenizer.eos_token_id], [6, 6]
    )
    assert ids == want_ids and sum(map(len, ids)) > 6
    for row, want in zip(logprobs, want_logprobs):
        assert row == pytest.approx(want, abs=1e-5)


def test_the_compiled_decoder_attends_with_grouped_query_heads_equal_to_transformers_sdpa(tokenizer, monkeypatch):
    """A decoding step of a grouped-query model attends to the key/value heads as they are (no `repeat_kv` copies of
    the cache): equal to transformers' SDPA attention, with a padding mask; the compiled backend's snapshot uses it,
    for its decoding steps, and its tokens and log-probs stay HF generate's (the load test above)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trl_a3po.rollout import inprocess

    class GroupedQuery:
        num_key_value_groups = 3

    torch.manual_seed(0)
    query, key, value = torch.randn(4, 6, 1, 16), torch.randn(4, 2, 10, 16), torch.randn(4, 2, 10, 16)
    mask = torch.ones(4, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = mask[2, ..., :7] = False  # left padding
    grouped, _ = inprocess.grouped_decode_sdpa(GroupedQuery(), query, key, value, mask, scaling=0.25)
    repeated, _ = sdpa_attention_forward(GroupedQuery(), query, key, value, mask, scaling=0.25)
    assert grouped.shape == repeated.shape == (4, 1, 6, 16)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-6)

    snapshot = make_model(tokenizer)  # 4 query heads, 2 key/value heads
    InProcessBackend(snapshot, generation_config(tokenizer, True), tokenizer.pad_token_id, [1], compiled=True)
    assert snapshot.config._attn_implementation == inprocess.GROUPED_DECODE_SDPA
    queries = []
    real = inprocess.grouped_decode_sdpa

    def spy(module, query, *args, **kwargs):
        queries.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setitem(inprocess.AttentionInterface._global_mapping, inprocess.GROUPED_DECODE_SDPA, spy)
    prompts = [tokenizer("Natalia sold")["input_ids"], tokenizer("How many clips did")["input_ids"]]
    ids, _ = generate_with_behavior_logprobs(
        snapshot,
        prompts,
        generation_config(tokenizer, False, max_new_tokens=5),
        tokenizer.pad_token_id,
        [-1],
        compiled=True,
    )
    assert [len(row) for row in ids] == [5, 5]
    layers = snapshot.config.num_hidden_layers
    assert queries[:layers] != [1] * layers and queries[layers:] == [1] * (4 * layers)  # prefill, then 4 decode steps
    plain = make_model(tokenizer)
    InProcessBackend(plain, generation_config(tokenizer, True), tokenizer.pad_token_id, [1], compiled=False)
    assert plain.config._attn_implementation == "sdpa"

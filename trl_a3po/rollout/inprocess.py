"""Generation with HF `generate` that also returns the behaviour policy's log-prob of every sampled token."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, PreTrainedModel


def generate_with_behavior_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    generation_config: GenerationConfig,
    pad_token_id: int,
    eos_token_ids: list[int],
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt; return the completion ids (up to and including the first EOS) and, for
    each sampled token, its log-prob under the distribution it was sampled from.

    That distribution is `generate`'s processed scores (temperature, top-k, top-p and every other processor
    applied), i.e. exactly the behaviour policy. TRL's own HF-generate path returns no log-probs, hence this
    function. The scores of all steps are held until the end of generation (B x T x V floats): fine for the
    in-process backend's batch sizes; large-vocabulary, long-generation runs belong on a vLLM server.
    """
    device = model.device
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):  # left padding: generation continues from the last column
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    generation_config = copy.deepcopy(generation_config)
    generation_config.output_scores = True
    generation_config.return_dict_in_generate = True
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=generation_config
    )
    completion = out.sequences[:, width:]
    num_steps = min(len(out.scores), completion.size(1))
    token_logprobs = torch.stack(
        [
            torch.log_softmax(out.scores[t].float(), dim=-1).gather(-1, completion[:, t : t + 1]).squeeze(-1)
            for t in range(num_steps)
        ],
        dim=1,
    ).cpu()
    completion = completion[:, :num_steps].cpu()

    eos = torch.tensor(eos_token_ids, dtype=torch.long)
    completion_ids, logprobs = [], []
    for row in range(completion.size(0)):
        is_eos = torch.isin(completion[row], eos).nonzero()
        length = int(is_eos[0]) + 1 if len(is_eos) else num_steps
        completion_ids.append(completion[row, :length].tolist())
        logprobs.append(token_logprobs[row, :length].tolist())
    return completion_ids, logprobs

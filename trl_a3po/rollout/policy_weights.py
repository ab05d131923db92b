"""The policy's weights as the generator loads them: (name, tensor) pairs under the plain HF architecture's names,
from whatever wraps or shards them on the trainer (PEFT, DeepSpeed ZeRO-3, FSDP 1 and 2). Trainer side, main thread:
gathering sharded parameters is a collective every process must join."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from accelerate.utils import extract_model_from_parallel, is_peft_model


@contextlib.contextmanager
def policy_tensors(policy, dist) -> Iterator[Iterator[tuple]]:
    """The whole weights of `policy` (the model as Accelerate wraps it; `dist`: TRL's DistributedBackend, which
    sharding and its gathers) as (name, tensor) pairs under plain HF names, sharing the live storage (the queue stages
    a copy of each as it comes); LoRA adapters merged (W + scale * B @ A) without touching the live model. With
    sharded parameters every process must take every pair, in step: gathering is a collective. Under ZeRO-3 one
    parameter is gathered at a time (as TRL does for vLLM), so the whole model is never materialised on top of its
    shards."""
    model = extract_model_from_parallel(policy)
    if dist.is_zero3:  # (a PEFT model on sharded parameters is refused when the trainer is built)
        named_tensors = _gathered_one_by_one(model, dist.gather_params)
        try:
            yield named_tensors
        finally:
            # Every process runs every gather, also one whose consumer stopped early (a failed staging copy): the
            # others would otherwise wait in a gather this one never joins.
            collections.deque(named_tensors, maxlen=0)
    elif dist.fsdp_version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(policy, writeback=False):
            yield iter(_hf_named_tensors(model).items())
    elif dist.fsdp_version == 2:
        yield iter(_hf_named_tensors(model, gather_dtensors=True).items())
    else:
        yield iter(_hf_named_tensors(model).items())


def _hf_named_tensors(model, gather_dtensors: bool = False) -> dict:
    """A model's weights under the names of its plain HF architecture: PEFT's wrappers stripped and LoRA deltas merged
    into copies (W + scale * B @ A); FSDP2's DTensor shards gathered (`full_tensor`, a collective) when asked."""

    def whole(tensor):
        return tensor.full_tensor() if gather_dtensors and hasattr(tensor, "full_tensor") else tensor

    if not is_peft_model(model):
        return {name: whole(tensor) for name, tensor in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    tensors = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue
        tensors[name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = whole(tensor)
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            key = f"{module_name}.weight"
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
            tensors[key] = tensors[key] + delta.to(tensors[key].dtype)
    return tensors


def _gathered_one_by_one(model, gather) -> Iterator[tuple]:
    """ZeRO-3: every entry of the model's state dict, each parameter gathered (`gather`, a collective) only while its
    pair is being consumed. A tied parameter is gathered again under its second name."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in model.state_dict().items():  # names, and whole buffers; parameters are empty placeholders
        parameter = parameters.get(name)
        if parameter is None:
            yield name, tensor
            continue
        with gather([parameter]):
            yield name, parameter.data

"""The merge arithmetic, as PEFT 0.21's ``merge_and_unload()`` does it on the CPU, op by op, in torch.

The reference is ``AutoModel.from_pretrained(base, dtype=<the base's dtype>)``, then
``PeftModel.from_pretrained(model, adapter)`` (``autocast_adapter_dtype=True``, its default), then
``merge_and_unload()`` (``safe_merge=False``, its default). What that computes, per module
(``peft/tuners/lora/layer.py``, ``variants.py``, ``dora.py``):

- The adapter's parameters are created in the base layer's dtype and then upcast to float32 when that is
  float16 or bfloat16 (``cast_adapter_dtype``); the file's values are copied into them. So A, B, DoRA's
  magnitude and ``lora_B``'s bias are float32 for a float16/bfloat16 base, the base's dtype otherwise
  (``adapter_dtype``), and ``get_delta_weight``'s fp16/bf16-on-CPU branch never runs.
- Linear (``Linear.merge``): ``delta = transpose(B @ A, fan_in_fan_out) * scaling``, then
  ``weight += delta``: an in-place add of the float32 delta to the base dtype weight (computed in float32,
  rounded once to the base dtype).
- DoRA (``DoraLinearVariant.merge_unsafe``): ``w = transpose(weight, f) + 1 * transpose(delta, f)``,
  ``norm = torch.linalg.norm(w, dim=1).to(w.dtype)``, ``factor = transpose((magnitude / norm).view(-1, 1), f)``,
  ``weight = (factor * (weight + delta)).to(weight.dtype)``.
- Weighted adapters (``add_weighted_adapter(adapters, weights, name, combination_type="cat")``, then that adapter
  merged): ``A = cat(A_i * weight_i * scaling_i)``, ``B = cat(B_i)`` copied into a new adapter of rank ``sum(r_i)`` in
  the base dtype (zeros beyond), whose ``lora_alpha`` is that rank; its delta as above, through float32 for a half base.
- A convolution (``_ConvNd``, Conv1d and Conv2d of one group): a 1x1 kernel as the linear product,
  ``(B.squeeze(3).squeeze(2) @ A.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3) * scaling``, others
  ``conv(A.transpose(0, 1), B).transpose(0, 1) * scaling``; added in place as for a linear module.
- DoRA on an embedding (``DoraEmbeddingVariant.merge_unsafe``): the same with ``delta = (B @ A).T * scaling``,
  the norm over ``weight.T + 1 * delta.T`` and ``factor.view(1, -1)``.
- Embedding (``Embedding.merge``): ``delta = (B @ A).T * scaling``; ``weight += delta.to(weight.dtype)``
  (rounded to the base dtype first, then added in it).
- ``lora_bias``: ``bias += lora_B.bias * scaling``.
- A parameter (``target_parameters``, ``ParamWrapper``, experts stacked in a 3-D parameter):
  ``delta = einsum("o r e, e r i -> e i o", B.reshape(out, r, E), A.reshape(E, r, in)) * scaling`` (``e o i``
  for an (experts, out, in) parameter), cast to the base dtype, then ``weight += delta``.
- A module to save, or a base layer's weight the adapter holds: the value copied into the base dtype.

``scaling`` is the Python float ``alpha / r`` (``alpha / math.sqrt(r)`` with rsLoRA). The same torch ops on
the same dtypes and layouts give the same bits as PEFT with the same torch build; a matrix product computed
another way (numpy, another BLAS) would not, which is why merging needs torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptconv.adapters.plan import TensorPlan
from ckptconv.dtypes import DType
from ckptconv.runtime import extras

if TYPE_CHECKING:
    import torch

__all__ = ["compute", "require_torch"]


def require_torch(command: str = "merge-lora") -> None:
    """Raise the one-line error that ``command`` needs torch (the extra), when it is not installed."""
    extras.require_torch(f"{command} (LoRA deltas computed exactly as PEFT computes them)")


def _adapter_dtype(base: torch.dtype) -> torch.dtype:
    import torch

    return torch.float32 if base in (torch.float16, torch.bfloat16) else base


def _tensor(array: Any, dtype: DType) -> torch.Tensor:
    """A numpy array in ``dtype``'s storage representation (bfloat16 as uint16 ...) as a torch tensor."""
    import numpy as np
    import torch

    from ckptconv.reading.torch_views import torch_dtype

    array = np.ascontiguousarray(array)
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    target = torch_dtype(dtype)
    return tensor.view(target) if tensor.dtype != target else tensor


def _transpose(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    return weight.T if fan_in_fan_out else weight  # peft.utils.other.transpose


def compute(plan: TensorPlan, arrays: Mapping[str, Any]) -> Any:
    """The merged tensor of ``plan`` from its inputs' arrays, as a flat uint8 numpy array of its bytes."""
    import torch

    base = _tensor_dtype(plan.dtype)
    tensors = {role: _tensor(arrays[role], plan.inputs[role].out_dtype) for role in arrays}
    if "loaded" in tensors:  # load_state_dict copies the adapter's value into the base parameter
        weight = torch.empty_like(tensors["loaded"], dtype=base)
        weight.copy_(tensors["loaded"])
    else:
        weight = tensors["weight"].clone()
    adapter = _adapter_dtype(base)
    # PEFT's parameters hold the file's values in the adapter dtype (copied in: one rounding, if any).
    lora = {role: tensor.to(adapter) for role, tensor in tensors.items() if role not in ("weight", "loaded")}
    scaling, fifo = plan.scaling, plan.fan_in_fan_out
    with torch.no_grad():
        if plan.kind == "linear":
            weight += _transpose(lora["B"] @ lora["A"], fifo) * scaling
        elif plan.kind == "dora":
            delta = _transpose(lora["B"] @ lora["A"], fifo) * scaling
            unmerged = weight.detach().clone()
            w = _transpose(unmerged, fifo)
            w = w + 1 * _transpose(delta, fifo)
            norm = torch.linalg.norm(w, dim=1).to(w.dtype)
            factor = _transpose((lora["magnitude"] / norm).view(-1, 1), fifo)
            weight = (factor * (weight + delta)).to(base)
        elif plan.kind == "experts":  # ParamWrapper.get_delta_weight, then merge: the delta cast, then added
            a = lora["A"].reshape(plan.experts, -1, lora["A"].shape[-1])
            b = lora["B"].reshape(lora["B"].shape[0], -1, plan.experts)
            equation = "o r e, e r i -> e o i" if plan.swapped else "o r e, e r i -> e i o"
            delta = torch.einsum(equation, b, a) * scaling
            if base in (torch.float16, torch.bfloat16, torch.float32):  # peft's ALLOWED_COMPUTE_DTYPES
                delta = delta.to(base)
            weight += delta
        elif plan.kind in ("cat-linear", "cat-embedding"):  # add_weighted_adapter(..., "cat"), then merged
            a = torch.cat([lora[f"A{i}"] * weight_i * scaling_i for i, weight_i, scaling_i in plan.parts], 0)
            b = torch.cat([lora[f"B{i}"] for i, _, _ in plan.parts], 1)
            combined_a = torch.zeros((plan.rank, a.shape[1]), dtype=base)  # the new adapter's, in the base dtype
            combined_b = torch.zeros((b.shape[0], plan.rank), dtype=base)
            combined_a[: a.shape[0], :] = a
            combined_b[:, : b.shape[1]] = b
            half = base in (torch.float16, torch.bfloat16)  # get_delta_weight's cast_to_fp32
            if half:
                combined_a, combined_b = combined_a.float(), combined_b.float()
            embedding = plan.kind == "cat-embedding"
            delta = _transpose(combined_b @ combined_a, fifo or embedding) * scaling
            if half:
                delta = delta.to(base)
            weight += delta.to(base) if embedding else delta
        elif plan.kind == "conv":  # _ConvNd.get_delta_weight (Conv1d, Conv2d of one group), then merge
            a, b = lora["A"], lora["B"]
            if weight.size()[2:4] == (1, 1):
                delta = (b.squeeze(3).squeeze(2) @ a.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3) * scaling
            else:
                conv = torch.nn.functional.conv2d if weight.dim() == 4 else torch.nn.functional.conv1d
                delta = conv(a.transpose(0, 1), b).transpose(0, 1) * scaling
            weight += delta
        elif plan.kind == "dora-embedding":  # DoraEmbeddingVariant.merge_unsafe (its DoRA layer is fan_in_fan_out)
            delta = (lora["B"] @ lora["A"]).T * scaling
            unmerged = weight.detach().clone()
            w = unmerged.T
            w = w + 1 * delta.T
            norm = torch.linalg.norm(w, dim=1).to(w.dtype)
            factor = (lora["magnitude"] / norm).view(1, -1)
            weight = (factor * (weight + delta)).to(base)
        elif plan.kind == "embedding":
            weight += ((lora["B"] @ lora["A"]).T * scaling).to(base)
        elif plan.kind == "bias":
            weight += lora["B"] * scaling
        elif plan.kind != "replace":
            raise ValueError(f"unknown merge {plan.kind!r}")  # a bug
    return weight.contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensor_dtype(dtype: DType) -> torch.dtype:
    from ckptconv.reading.torch_views import torch_dtype

    return torch_dtype(dtype)

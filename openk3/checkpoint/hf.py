"""HF safetensors checkpoints for ``kimi_k3`` and ``kimi_linear`` (K3_SPEC §2).

This module is the only place that knows external tensor names. The mapping, ours -> HF:

* prefix ``model.`` / ``lm_head.`` -> ``language_model.model.`` / ``language_model.lm_head.`` (K3);
  unchanged for Kimi Linear;
* MoE layers ``layers.{i}.mlp.`` -> ``layers.{i}.block_sparse_moe.`` (dense layers stay ``mlp.``;
  transformers writes them under ``block_sparse_moe.`` too, which loading accepts);
* stacked experts ``mlp.experts.w{1,2,3}`` [E, ...] -> ``experts.{e}.w{1,2,3}.weight`` per expert,
  or ``.weight_packed`` (uint8) + ``.weight_scale`` (E8M0) when MXFP4-packed; a model loaded with
  ``experts="packed"`` holds them as ``mlp.experts.w{1,2,3}_packed`` / ``_scale`` [E, ...] buffers
  (``openk3.model.packed_experts``);
* AttnRes ``X_res.norm.weight`` / ``X_res.proj.weight`` -> ``X_res_norm.weight`` / ``X_res_proj.weight``;
* KDA ``A_log`` [H] -> [max(H, 128)] zero-padded (K3) or [1, 1, H, 1] (Kimi Linear);
* vision tower and projector ``vision_tower.*`` / ``mm_projector.*``: the same names, no prefix;
* MTP layer ``mtp.{k}.`` -> ``model.layers.{L + k}.`` with L = ``num_hidden_layers``, then as any
  layer (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the block's MLA and MoE names).
  The MTP head and embedding are the main ``lm_head`` / ``embed_tokens``: no copy is written
  (DeepSeek-V3's ``shared_head.head`` / ``embed_tokens`` under the MTP layer), and a checkpoint
  holding one is refused as an unexpected tensor.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from openk3.checkpoint.atomic import atomic_directory
from openk3.checkpoint.hf_config import from_hf, to_hf
from openk3.config import ModelConfig
from openk3.model.model import KimiForCausalLM, _keep_fp32, build_model
from openk3.model.moe import check_qat_dims
from openk3.model.packed_experts import pack_experts
from openk3.ops.mx import MX_BLOCK_SIZE, mxfp4_dequantize, mxfp4_quantize

MXFP4_FORMAT = "mxfp4-pack-quantized"
K3_ALOG_PAD = 128
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # the vision part of a K3 release

_EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(w[123])$")
_HF_EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\."
                           r"(weight|weight_packed|weight_scale)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: names the file or tensor at fault."""


def _hf_prefix(cfg: ModelConfig) -> str:
    return "language_model." if cfg.is_k3 else ""


def _layer_name(cfg: ModelConfig, name: str) -> str:
    """Our name with the MTP layer numbered as the checkpoint numbers it:
    ``mtp.{k}.`` -> ``model.layers.{num_hidden_layers + k}.``; other names unchanged."""
    L = cfg.num_hidden_layers
    return re.sub(r"^mtp\.(\d+)\.", lambda m: f"model.layers.{L + int(m.group(1))}.", name)


def _our_name(cfg: ModelConfig, name: str) -> str:
    """The inverse of ``_layer_name``: ``model.layers.{i}.`` -> ``mtp.{i - L}.`` for
    i >= L = num_hidden_layers."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return f"mtp.{int(m.group(1)) - cfg.num_hidden_layers}." + name[m.end():]
    return name


def _is_expert_stack(cfg: ModelConfig, name: str) -> bool:
    """Our ``name`` is a stacked routed-expert tensor [E, ...] (main model or MTP layer)."""
    return bool(_EXPERT_RE.match(_layer_name(cfg, name)))


def _expert_stack_of(cfg: ModelConfig, name: str) -> str | None:
    """The stack (``...mlp.experts.w1``) that our ``name`` holds: the stack itself, or one of its
    MXFP4 buffers (``..._packed``, ``..._scale``) in a packed model; None for other tensors."""
    stack = re.sub(r"_(packed|scale)$", "", name)
    return stack if _is_expert_stack(cfg, stack) else None


def _is_moe_name(cfg: ModelConfig, name: str) -> bool:
    # the MTP layers (index >= num_hidden_layers) are MoE: no dense_mlp_layers entry reaches them
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(m) and cfg.is_moe_layer(int(m.group(1)))


def to_hf_name(cfg: ModelConfig, name: str) -> str:
    """Our parameter name -> HF name (not for stacked experts, see ``_hf_tensors``)."""
    if name.startswith(VISION_PREFIXES):
        return name
    name = _layer_name(cfg, name)
    hf = re.sub(r"_res\.(norm|proj)\.weight$", r"_res_\1.weight", name)
    if _is_moe_name(cfg, name):
        hf = hf.replace(".mlp.", ".block_sparse_moe.", 1)
    return _hf_prefix(cfg) + hf


def from_hf_name(cfg: ModelConfig, hf: str) -> str | None:
    """HF name -> our name; ``None`` for a name outside the model's namespace."""
    if hf.startswith(VISION_PREFIXES):
        return hf
    prefix = _hf_prefix(cfg)
    if not hf.startswith(prefix):
        return None
    name = hf[len(prefix):]
    name = re.sub(r"_res_(norm|proj)\.weight$", r"_res.\1.weight", name)
    return _our_name(cfg, name.replace(".block_sparse_moe.", ".mlp.", 1))


# ---- loading ----------------------------------------------------------------------------

def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors.index.json or model.safetensors")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors file (truncated or corrupt?): {e}") from e


def _shape_error(name: str, file: Path, got, want) -> CheckpointError:
    return CheckpointError(f"{file}: tensor {name} has shape {tuple(got)}, the model expects {tuple(want)}")


def _has_vision_tensors(files: list[Path]) -> bool:
    for file in files:
        with _open(file) as f:
            if any(k.startswith(VISION_PREFIXES) for k in f.keys()):
                return True
    return False


EXPERTS_MODES = ("dequantize", "packed")


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None,
                    vision: bool | None = None,
                    experts: str = "dequantize") -> KimiForCausalLM:
    """Load a HF ``kimi_k3`` / ``kimi_linear`` checkpoint directory.

    The model is built on the meta device and materialised once on ``device`` (default CPU);
    tensors are then streamed in one at a time, so peak memory is one model plus one tensor.
    ``dtype`` defaults to the checkpoint's floating dtype; routers and KDA decay parameters
    stay fp32.

    ``experts`` says how routed experts are held:

    * ``"dequantize"`` (default): as ``dtype`` parameters; MXFP4-packed experts
      (``.weight_packed``) are decoded bit-exactly. Trainable.
    * ``"packed"``: as MXFP4 buffers (``openk3.model.packed_experts.PackedRoutedExperts``,
      4.25 bits per weight), run by kernels that dequantise in registers; inference only.
      Packed checkpoint tensors are copied byte for byte; experts stored unpacked
      (``.weight``, e.g. a bf16 export) are quantised on load with ``mxfp4_quantize``, the
      quantiser of ``save_pretrained(experts="mxfp4")`` and of QAT, with a note on stderr.

    ``vision``: True loads the vision tower and projector (``vision_tower.*``,
    ``mm_projector.*``; config.json must have a ``vision_config``), False loads the text model
    only and skips them, saying so; None (default) loads them when config.json describes them
    and the checkpoint holds them, else loads text only.
    """
    if experts not in EXPERTS_MODES:
        raise ValueError(f"load_pretrained: experts={experts!r} must be one of {EXPERTS_MODES}")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg = from_hf(path)
    files = _shard_files(path)
    if vision and cfg.vision_config is None:
        raise CheckpointError(f"{path}: vision=True but config.json has no vision_config")
    if vision is None:
        vision = cfg.vision_config is not None and _has_vision_tensors(files)
    if not vision:
        cfg = cfg.replace(vision_config=None)  # hf_passthrough still writes it back on save
    if dtype is None:
        dtype = _checkpoint_dtype(files)
    model = build_model(cfg, device="meta")
    if experts == "packed":
        pack_experts(model)  # empty meta modules, filled below
    model.to_empty(device=device or "cpu")
    model.to(dtype)
    _keep_fp32(model)
    if cfg.tie_word_embeddings:  # to_empty gave the head a parameter of its own: tie it again
        model.lm_head.weight = model.model.embed_tokens.weight  # (named_parameters then lists it once)
    state = dict(model.named_parameters())
    state.update(model.named_buffers())

    filled: dict[str, Path] = {}  # our name -> the file it came from
    experts_filled: dict[str, set[int]] = defaultdict(set)
    # HF stem of a packed expert matrix -> {"weight_packed" / "weight_scale": (tensor, file)}
    packed: dict[str, dict[str, tuple[torch.Tensor | None, Path]]] = defaultdict(dict)
    quantized: list[str] = []  # unpacked experts quantised into a packed model
    skipped = 0
    for file in files:
        with _open(file) as f:
            for hf in f.keys():
                if not vision and hf.startswith(VISION_PREFIXES):
                    skipped += 1
                    continue
                try:
                    tensor = f.get_tensor(hf)
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(f"{file}: cannot read tensor {hf}: {e}") from e
                _place(cfg, state, hf, tensor, file, filled, experts_filled, packed,
                       model.stored_dtypes, quantized)
    if skipped:
        print(f"openk3: text-only load, skipped {skipped} vision tensor{'s' * (skipped != 1)} "
              f"({', '.join(VISION_PREFIXES)})", file=sys.stderr)
    if quantized:
        print(f"openk3: experts='packed': quantised {len(quantized)} unpacked expert matrices to "
              f"MXFP4 on load (mxfp4_quantize, as save_pretrained(experts='mxfp4')), e.g. "
              f"{quantized[0]}", file=sys.stderr)
    for stem, parts in packed.items():
        if len(parts) < 2:
            (kind, (_, file)), = parts.items()
            other = "weight_scale" if kind == "weight_packed" else "weight_packed"
            raise CheckpointError(f"{file}: tensor {stem}.{kind} has no {stem}.{other} in the "
                                  "checkpoint (MXFP4 experts need both)")
    missing = sorted(n for n in state if n not in filled and _expert_stack_of(cfg, n) is None)
    stacks = {_expert_stack_of(cfg, n): t.shape[0] for n, t in state.items()}
    stacks.pop(None, None)
    for n, num_experts in sorted(stacks.items()):
        if len(experts_filled[n]) != num_experts:
            absent = sorted(set(range(num_experts)) - experts_filled[n])
            missing.append(f"{n} (experts {absent[:8]}{'...' if len(absent) > 8 else ''})")
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks tensors the model needs: "
                              f"{[_describe_missing(cfg, m) for m in missing[:10]]}"
                              f"{' ...' if len(missing) > 10 else ''}")
    model.eval()
    return model


def _describe_missing(cfg: ModelConfig, name: str) -> str:
    base = name.split(" ")[0]
    return name if _is_expert_stack(cfg, base) else f"{to_hf_name(cfg, base)}"


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _checkpoint_dtype(files: list[Path]) -> torch.dtype:
    """The dtype of the embedding table: the checkpoint's working precision."""
    for file in files:
        with _open(file) as f:
            for k in f.keys():
                if k.endswith("embed_tokens.weight"):
                    return _ST_DTYPES.get(f.get_slice(k).get_dtype(), torch.bfloat16)
    return torch.bfloat16


def _check_packed(stem: str, parts: dict, rows: int, cols: int) -> None:
    """The checkpoint's ``stem.weight_packed`` / ``.weight_scale`` (tensor, file) are uint8 of
    ``[rows, cols/2]`` / ``[rows, cols/32]``."""
    for kind, shape in (("weight_packed", (rows, cols // 2)), ("weight_scale", (rows, cols // MX_BLOCK_SIZE))):
        t, file = parts[kind]
        if t.dtype != torch.uint8:
            raise CheckpointError(f"{file}: tensor {stem}.{kind} is {t.dtype}, MXFP4 experts store uint8")
        if tuple(t.shape) != shape:
            raise _shape_error(f"{stem}.{kind}", file, t.shape, shape)


def _place_expert(cfg, state, hf, m, tensor, file, experts_filled, packed, quantized) -> None:
    """Copy one checkpoint tensor of routed expert ``m`` (an ``_HF_EXPERT_RE`` match) into its
    stack: a parameter ``[E, rows, cols]`` or, in a packed model, ``_packed`` / ``_scale`` buffers."""
    stack = _our_name(cfg, f"{m.group(1)}.mlp.experts.{m.group(3)}")
    e, kind, stem = int(m.group(2)), m.group(4), hf.rsplit(".", 1)[0]
    if e in experts_filled[stack] or kind in packed.get(stem, {}):
        raise CheckpointError(f"{file}: tensor {hf} gives expert {e} of {stack} a second time "
                              "(a stale copy in another shard, or both .weight and .weight_packed)")
    to_packed = stack + "_packed" in state
    if stack not in state and not to_packed:
        raise CheckpointError(f"{file}: unexpected tensor {hf} (no routed experts there in this "
                              "config: a dense layer, or a layer past num_hidden_layers + "
                              "num_nextn_predict_layers)")
    if to_packed:
        num_experts, rows, half = state[stack + "_packed"].shape
        cols = 2 * half
    else:
        num_experts, rows, cols = state[stack].shape
    if e >= num_experts:
        raise CheckpointError(f"{file}: unexpected tensor {hf}: expert {e} >= num_experts {num_experts}")
    if kind == "weight":
        if not tensor.is_floating_point():
            raise CheckpointError(f"{file}: tensor {hf} is {tensor.dtype}; expert weights are floating point")
        if tuple(tensor.shape) != (rows, cols):
            raise _shape_error(hf, file, tensor.shape, (rows, cols))
        value = tensor
        if to_packed:
            weight_packed, weight_scale = mxfp4_quantize(tensor.float())
            quantized.append(hf)
    else:
        parts = packed[stem]
        parts[kind] = (tensor, file)
        if len(parts) < 2:
            return
        _check_packed(stem, parts, rows, cols)
        weight_packed, weight_scale = parts["weight_packed"][0], parts["weight_scale"][0]
        if not to_packed:
            value = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)
    with torch.no_grad():
        if to_packed:
            state[stack + "_packed"][e].copy_(weight_packed)
            state[stack + "_scale"][e].copy_(weight_scale)
        else:
            state[stack][e].copy_(value)
    experts_filled[stack].add(e)
    if kind != "weight":  # placed: keep which files held the pair, not its tensors
        packed[stem] = {k: (None, f) for k, (_, f) in parts.items()}


def _place(cfg, state, hf, tensor, file, filled, experts_filled, packed, stored_dtypes,
           quantized) -> None:
    m = _HF_EXPERT_RE.match(hf[len(_hf_prefix(cfg)):]) if hf.startswith(_hf_prefix(cfg)) else None
    if m:
        _place_expert(cfg, state, hf, m, tensor, file, experts_filled, packed, quantized)
        return
    name = from_hf_name(cfg, hf)
    if name is None or name not in state:
        mtp = re.match(r"^mtp\.(\d+)\.", name or "")
        why = (f"a tensor of MTP layer {mtp.group(1)}, but num_nextn_predict_layers="
               f"{cfg.num_nextn_predict_layers}"
               if mtp and int(mtp.group(1)) >= cfg.num_nextn_predict_layers
               else f"no such parameter in a {cfg.arch} model of this config")
        raise CheckpointError(f"{file}: unexpected tensor {hf} ({why})")
    if name in filled:
        raise CheckpointError(f"{file}: tensor {hf} is in {filled[name]} too (a stale copy?); "
                              "a checkpoint holds each tensor once")
    target = state[name]
    if target.is_floating_point() and not tensor.is_floating_point():
        raise CheckpointError(f"{file}: tensor {hf} is {tensor.dtype}; the model's {name} is floating point")
    if name.endswith("self_attn.A_log"):
        tensor = _unpad_a_log(tensor, target.shape[0], hf, file)
    if tuple(tensor.shape) != tuple(target.shape):
        raise _shape_error(hf, file, tensor.shape, target.shape)
    with torch.no_grad():
        target.copy_(tensor)
    if tensor.dtype != target.dtype and target.dtype == torch.float32:
        stored_dtypes[hf] = tensor.dtype  # an fp32-by-design tensor (router, decay) stored lower
    filled[name] = file


def _unpad_a_log(t: torch.Tensor, heads: int, hf: str, file: Path) -> torch.Tensor:
    """K3 stores A_log as [128] zero-padded, Kimi Linear as [1, 1, H, 1]; ours is [H]."""
    flat = t.reshape(-1)
    if flat.numel() < heads or (flat.numel() > heads and torch.any(flat[heads:] != 0)):
        raise CheckpointError(f"{file}: tensor {hf} has shape {tuple(t.shape)}; expected {heads} "
                              "head values (zero-padded entries beyond them)")
    return flat[:heads]


# ---- saving -----------------------------------------------------------------------------

def _hf_tensors(model: KimiForCausalLM, experts: str):
    """Yield (hf_name, tensor) in checkpoint layout."""
    cfg = model.cfg
    tensors = dict(list(model.named_parameters()) + list(model.named_buffers()))
    dtype = model.model.embed_tokens.weight.dtype
    for name, t in tensors.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        stack = _expert_stack_of(cfg, name)
        if stack is not None and stack != name:  # a packed model's buffers: written as they are
            if name.endswith("_packed"):
                yield from _packed_hf_tensors(cfg, stack, t, tensors[stack + "_scale"], experts, dtype)
            continue
        m = _EXPERT_RE.match(_layer_name(cfg, name))
        if m:
            base = _hf_prefix(cfg) + f"{m.group(1)}.block_sparse_moe.experts"
            for e in range(t.shape[0]):
                stem = f"{base}.{e}.{m.group(2)}"
                if experts == "mxfp4":
                    packed, scale = mxfp4_quantize(t[e].float())
                    yield stem + ".weight_packed", packed
                    yield stem + ".weight_scale", scale
                else:
                    yield stem + ".weight", t[e]
            continue
        if name.endswith("self_attn.A_log"):
            t = (torch.nn.functional.pad(t, (0, max(K3_ALOG_PAD - t.shape[0], 0))) if cfg.is_k3
                 else t.view(1, 1, -1, 1))
        hf = to_hf_name(cfg, name)
        yield hf, t.to(model.stored_dtypes.get(hf, t.dtype))


def _packed_hf_tensors(cfg, stack: str, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                       experts: str, dtype: torch.dtype):
    """A packed stack's per-expert tensors: its bytes unchanged (``experts="mxfp4"``), or decoded
    to the model's ``dtype`` (``"bf16"``)."""
    m = _EXPERT_RE.match(_layer_name(cfg, stack))
    stem = _hf_prefix(cfg) + f"{m.group(1)}.block_sparse_moe.experts"
    for e in range(weight_packed.shape[0]):
        name = f"{stem}.{e}.{m.group(2)}"
        if experts == "mxfp4":
            yield name + ".weight_packed", weight_packed[e]
            yield name + ".weight_scale", weight_scale[e]
        else:
            yield name + ".weight", mxfp4_dequantize(weight_packed[e], weight_scale[e], dtype)


def mxfp4_quantization_config() -> dict:
    """The compressed-tensors block of the official K3 release: only routed experts are packed."""
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "format": MXFP4_FORMAT,
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {"num_bits": 4, "type": "float", "group_size": MX_BLOCK_SIZE, "symmetric": True,
                        "strategy": "group", "scale_dtype": "torch.uint8", "dynamic": False},
        }},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                   r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                   "re:.*routed_expert_(up|down)_proj.*", "re:.*_res_proj.*", "re:.*eh_proj.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def save_pretrained(model: KimiForCausalLM, path: str | os.PathLike, experts: str = "bf16",
                    max_shard_bytes: int = 4 << 30, extra_files: dict[str, bytes] | None = None) -> None:
    """Write ``config.json`` + sharded safetensors + index to ``path`` atomically.

    ``experts="mxfp4"`` packs the routed experts (K3 only); ``"bf16"`` keeps the model's dtype.
    ``extra_files`` (name -> bytes, e.g. the tokenizer) are written in the same atomic write.
    The files are written to a temporary directory beside ``path`` and renamed into place
    (``openk3.checkpoint.atomic``); one shard at a time is held in memory.
    """
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"save_pretrained: experts={experts!r} must be 'bf16' or 'mxfp4'")
    cfg = model.cfg
    if experts == "mxfp4":
        check_qat_dims(cfg)
    with atomic_directory(path) as tmp:
        # shards are written as they fill (memory: one shard), named once their count is known
        written: list[tuple[Path, list[str]]] = []
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            part = tmp / f"part-{len(written):05d}.safetensors"
            save_file(shard, str(part), metadata={"format": "pt"})
            written.append((part, list(shard)))
            shard.clear()

        for name, t in _hf_tensors(model, experts):
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
                size = 0
            shard[name] = t.contiguous().cpu()
            size += nbytes
            total += nbytes
        flush()
        weight_map = {}
        for i, (part, names) in enumerate(written):
            fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            part.rename(tmp / fname)
            weight_map.update(dict.fromkeys(names, fname))
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        qc = mxfp4_quantization_config() if experts == "mxfp4" else None
        dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(to_hf(cfg, quantization_config=qc, dtype=dtype),
                                                    indent=2))
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)

"""Weights in and out: published ViT state dicts and the project's own checkpoints.

`load_pretrained` reads timm- or Hugging Face-format files from local disk only
(nothing is fetched), renames them to our parameter names, fuses HF's separate
q/k/v, reshapes conv patch projections into our Linear, and resamples position
embeddings to the model's grid. Project checkpoints are `model.safetensors` plus
`config.json`: no pickle anywhere on our own path.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vit.config import ViTConfig
from vit.model import VisionTransformer
from vit.pos_embed import resample_pos_embed
from vit.resnet import ResNet, ResNetConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Files looked for, in order, when `load_pretrained` is given a directory.
_DIR_CANDIDATES = ("model.safetensors", "pytorch_model.bin", "model.pth", "pytorch_model.pth")


def one_line(err: BaseException, limit: int | None = None) -> str:
    """An error's message on one line (readers' messages span lines), cut at `limit` characters."""
    return " ".join(str(err).split())[:limit]


@dataclass
class LoadResult:
    """Keys left unmatched by a non-strict load."""

    missing: list[str]
    unexpected: list[str]


# --- reading foreign files ---------------------------------------------------------------


def _resolve(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():  # sharded HF checkpoint
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{index} has no weight_map naming the shard files") from None
            return [path / s for s in shards]
        for name in _DIR_CANDIDATES:
            if (path / name).is_file():
                return [path / name]
        raise ValueError(f"no weights file in {path}: looked for {', '.join(_DIR_CANDIDATES)}")
    raise ValueError(f"weights path {path} does not exist (only local files are read; nothing is downloaded)")


def weights_files(path: str | Path) -> list[Path]:
    """The local files `load_pretrained(model, path)` reads: the weights file(s) and any `config.json` beside
    them, so a caller can tell by their bytes whether the weights changed."""
    path = Path(path)
    found = _resolve(path)
    beside = (path if path.is_dir() else path.parent) / CONFIG_FILE
    index = path / "model.safetensors.index.json"
    return [*found, *([index] if path.is_dir() and index.is_file() else []), *([beside] if beside.is_file() else [])]


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors from a `.safetensors` or `.bin`/`.pth`/`.pt` file, or a directory holding one.

    Pickle-based files are read with `torch.load(weights_only=True)`, which refuses code.
    """
    out: dict[str, torch.Tensor] = {}
    for f in _resolve(Path(path)):
        if f.suffix not in (".safetensors", ".bin", ".pth", ".pt"):
            raise ValueError(f"unsupported weights file {f.name}: expected .safetensors, .bin, .pth or .pt")
        try:
            if f.suffix == ".safetensors":
                obj = load_file(f, device="cpu")
            else:
                obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise  # weights_only refused code: callers tell that refusal apart from corruption
        except Exception as e:  # safetensors, pickle and zip readers each raise their own types
            raise ValueError(f"{f} cannot be read as weights: {one_line(e, 200)}") from None
        for key in ("state_dict", "model", "module"):  # common training-checkpoint wrappers
            if isinstance(obj, dict) and isinstance(obj.get(key), dict):
                obj = obj[key]
        if not isinstance(obj, dict):
            raise ValueError(f"{f} holds a {type(obj).__name__}, not a dict of tensors")
        out.update({k: v for k, v in obj.items() if isinstance(v, torch.Tensor)})
    return out


# --- renaming ----------------------------------------------------------------------------

_HF_LAYER = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)$")
_HF_BLOCK_NAMES = {
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
    "attention.output.dense": "attn.proj",  # transformers < 5
    "attention.o_proj": "attn.proj",  # transformers >= 5
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_HF_QKV = {
    "attention.attention.query": "q",
    "attention.attention.key": "k",
    "attention.attention.value": "v",
    "attention.q_proj": "q",
    "attention.k_proj": "k",
    "attention.v_proj": "v",
}
_HF_TOP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection": "patch_embed.proj",
    "layernorm": "norm",
    "pooler.dense": "pre_logits",
    "classifier": "head",
}


def _is_hf(sd: dict[str, torch.Tensor]) -> bool:
    return any("embeddings.patch_embeddings" in k or k.startswith(("vit.", "encoder.layer.")) for k in sd)


def _from_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        k = key.removeprefix("vit.")
        stem, _, leaf = k.rpartition(".")  # leaf: weight / bias (or a bare parameter name)
        if k in _HF_TOP:
            out[_HF_TOP[k]] = value
            continue
        if stem in _HF_TOP:
            out[f"{_HF_TOP[stem]}.{leaf}"] = value
            continue
        m = _HF_LAYER.match(stem)
        if m:
            i, rest = int(m[1]), m[2]
            if rest in _HF_QKV:
                qkv.setdefault((i, leaf), {})[_HF_QKV[rest]] = value
                continue
            if rest in _HF_BLOCK_NAMES:
                out[f"blocks.{i}.{_HF_BLOCK_NAMES[rest]}.{leaf}"] = value
                continue
        out[key] = value  # unknown: reported as unexpected unless the model has it
    for (i, leaf), parts in qkv.items():
        if set(parts) == {"q", "k", "v"}:
            out[f"blocks.{i}.attn.qkv.{leaf}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
        else:
            for name in parts:
                out[f"blocks.{i}.attn.{name}.{leaf}"] = parts[name]  # incomplete: surfaces as unexpected
    return out


def _from_timm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("module.")
        if k.startswith("pre_logits.fc."):  # older timm wraps the representation layer
            k = "pre_logits." + k.removeprefix("pre_logits.fc.")
        out[k] = v
    return out


def _config_grid(path: Path) -> tuple[int, int] | None:
    """The token grid the weights at `path` were trained on, from the `config.json` beside them
    (ours: `{"arch": "vit", "config": ...}`; Hugging Face's: `image_size`, `patch_size`), or None."""
    f = (path if path.is_dir() else path.parent) / CONFIG_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
        if meta.get("arch") == "vit" and isinstance(meta.get("config"), dict):
            return ViTConfig(**meta["config"]).grid
        size, patch = meta.get("image_size"), meta.get("patch_size")
        if size is None or not isinstance(patch, int) or patch <= 0:
            return None
        h, w = (size, size) if isinstance(size, int) else size
        return h // patch, w // patch
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{f} does not describe the weights' image and patch size: {e}") from None


def _source_layout(n: int, sd: dict[str, torch.Tensor], grid: tuple[int, int] | None) -> tuple[int, tuple[int, int]]:
    """(prefix rows, grid) of a checkpoint's `n`-row position table. The prefix tokens are the
    checkpoint's cls/dist tokens, the grid its config's; with no config, a square grid."""
    tokens = int("cls_token" in sd) + int("dist_token" in sd)
    if grid is not None:
        rows = grid[0] * grid[1]
        if n - rows not in (0, tokens):  # 0: tables without prefix rows (timm's no_embed_class)
            raise ValueError(f"pos_embed has {n} rows, but the checkpoint's {CONFIG_FILE} gives a {grid[0]}x{grid[1]} "
                             f"grid ({rows} rows) and it has {tokens} prefix token(s)")
        return n - rows, grid
    for prefix in (tokens, 0):  # 0: a table without prefix rows (timm's no_embed_class, e.g. DeiT III)
        side = math.isqrt(max(n - prefix, 0))
        if side * side == n - prefix:
            return prefix, (side, side)
    raise ValueError(f"cannot tell the grid of the checkpoint's pos_embed: neither {n} rows nor {n} less {tokens} "
                     f"prefix token(s) is a square, and no {CONFIG_FILE} beside the weights gives image_size and "
                     "patch_size")


def _adapt(sd: dict[str, torch.Tensor], model: VisionTransformer,
           grid: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Reshape conv patch projections and resample position embeddings to the model (`grid`: the
    checkpoint's token grid when its config gives it)."""
    w = sd.get("patch_embed.proj.weight")
    if w is not None and w.ndim == 4:  # conv (D, C, P, P) -> Linear over (row, col, channel)
        sd["patch_embed.proj.weight"] = w.permute(0, 2, 3, 1).reshape(w.shape[0], -1)
    pos = sd.get("pos_embed")
    target = getattr(model, "pos_embed", None)
    # A known grid is checked even when the sizes agree: 24x40 and 40x24 hold as many rows.
    if pos is not None and isinstance(target, nn.Parameter) and (pos.shape != target.shape or grid is not None):
        src_prefix, src_grid = _source_layout(pos.shape[1], sd, grid)
        pos = resample_pos_embed(pos, model.config.grid, num_prefix_tokens=src_prefix, old_grid=src_grid)
        prefix = model.num_prefix_tokens
        # Keep the class token's row (first), drop others; a prefix the checkpoint lacks starts at zero.
        missing = pos.new_zeros(1, max(prefix - src_prefix, 0), pos.shape[2])
        sd["pos_embed"] = torch.cat([pos[:, : min(prefix, src_prefix)], missing, pos[:, src_prefix:]], dim=1)
    return sd


def load_pretrained(
    model: nn.Module, path: str | Path, *, strict: bool = True, skip_head: bool = False
) -> LoadResult:
    """Load timm- or Hugging Face-format ViT weights from a local file or directory into `model`.

    `skip_head` leaves the model's head untouched (for transfer to another label
    set; the head is skipped anyway when the model has none). With `strict`, any
    missing or unexpected key raises one ValueError counting them and naming the first
    few; otherwise they are returned. Shape mismatches always raise (the first few
    named), as does a file that holds no tensors.
    """
    sd = read_state_dict(path)
    if not sd:  # e.g. an optimizer's state: a dict, but no weights in it
        raise ValueError(f"{path} holds no tensors")
    sd = _from_hf(sd) if _is_hf(sd) else _from_timm(sd)
    if isinstance(model, VisionTransformer):
        sd = _adapt(sd, model, _config_grid(Path(path)))
    head = "fc." if isinstance(model, ResNet) else "head."
    own = model.state_dict()
    if skip_head or not any(k.startswith(head) for k in own):
        sd = {k: v for k, v in sd.items() if not k.startswith(head)}
        own = {k: v for k, v in own.items() if not k.startswith(head)}
    bad = [
        f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in sd.items()
        if k in own and own[k].shape != v.shape
    ]
    if bad:
        head_bad = any(b.startswith(head) for b in bad)
        hint = " (pass skip_head=True to keep the model's own head)" if head_bad else ""
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""  # another width mismatches every tensor
        raise ValueError(f"shape mismatch loading {path}: {'; '.join(bad[:3])}{more}{hint}")
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if strict and (missing or unexpected):  # counted first: another kind of model misses nearly all of them
        named = [_few([repr(k) for k in keys], 3) for keys in (missing, unexpected)]
        raise ValueError(f"cannot load {path} into {type(model).__name__}: {len(missing)} of its {len(own)} tensors "
                         f"missing, {len(unexpected)} of the file's {len(sd)} unexpected: missing keys {named[0]}, "
                         f"unexpected keys {named[1]}")
    model.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=False)
    return LoadResult(missing, unexpected)


# --- project checkpoints -----------------------------------------------------------------

# arch name -> (config dataclass, model class); other families (e.g. VTN) register here.
ARCHS: dict[str, tuple[type, Callable[[Any], nn.Module]]] = {}


def register_arch(name: str, config_cls: type, model_cls: Callable[[Any], nn.Module]) -> None:
    """Make `save_checkpoint`/`load_checkpoint` handle `model_cls(config_cls(...))` models."""
    ARCHS[name] = (config_cls, model_cls)


register_arch("vit", ViTConfig, VisionTransformer)
register_arch("resnet", ResNetConfig, ResNet)


def _arch_of(model: nn.Module) -> str:
    for name, (_, cls) in ARCHS.items():
        if type(model) is cls:
            return name
    raise ValueError(f"cannot checkpoint a {type(model).__name__}: registered archs are {sorted(ARCHS)}")


def save_checkpoint(model: nn.Module, directory: str | Path) -> Path:
    """Write `model.safetensors` and `config.json` (with its `"arch"`) into `directory`; a `torch.compile`
    wrapper is saved as the model it wraps, so the checkpoint loads into an eager model."""
    model = getattr(model, "_orig_mod", model)  # OptimizedModule: its state dict would prefix every key
    arch = _arch_of(model)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, d / WEIGHTS_FILE, metadata={"arch": arch})
    (d / CONFIG_FILE).write_text(json.dumps({"arch": arch, "config": model.config.to_dict()}, indent=2))
    return d


def checkpoint_config(directory: str | Path) -> Any:
    """The config a checkpoint's `config.json` describes (a `ViTConfig` for a ViT), read without its weights."""
    return _arch_and_config(Path(directory))[1]


def _arch_and_config(d: Path) -> tuple[str, Any]:
    if not (d / CONFIG_FILE).is_file():
        raise ValueError(f"{d} is not a checkpoint: expected {CONFIG_FILE}")
    try:
        meta = json.loads((d / CONFIG_FILE).read_text())
        arch = meta.get("arch")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"checkpoint {d}: {CONFIG_FILE} is not a vit checkpoint config: {e}") from None
    if not isinstance(arch, str) or arch not in ARCHS:
        raise ValueError(f"checkpoint {d} has arch {arch!r}; registered archs are {sorted(ARCHS)}")
    config_cls = ARCHS[arch][0]
    try:
        return arch, config_cls(**meta["config"])
    except (TypeError, KeyError) as e:
        raise ValueError(f"checkpoint {d}: config.json does not fit {config_cls.__name__}: {e}") from None


def _few(items: list[str], shown: int = 5) -> str:
    """The first `shown` items and how many more: a model of another depth misses hundreds of keys."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return f"[{', '.join(items[:shown])}]{more}"


def _read_weights(d: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, checked against `model`: any failure is one ValueError naming the file."""
    f = d / WEIGHTS_FILE
    try:
        state = load_file(f, device="cpu")
    except Exception as e:  # safetensors raises its own error type (a truncated or foreign file)
        raise ValueError(f"checkpoint {f} cannot be read as safetensors: {one_line(e)}") from None
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
              if k in own and v.shape != own[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"checkpoint {f}: weights do not fit its {CONFIG_FILE}: missing keys {_few(missing)}, "
                         f"unexpected keys {_few(unexpected)}, shape mismatches (file vs model) {_few(shapes)}")
    return state


def load_checkpoint(directory: str | Path, *, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a model from `config.json` and load `model.safetensors` (strict), on `map_location`."""
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"map_location must name a device such as 'cpu' or 'cuda:0', got {map_location!r}: "
                         f"{e}") from None
    d = Path(directory)
    if not (d / CONFIG_FILE).is_file() or not (d / WEIGHTS_FILE).is_file():
        raise ValueError(f"{d} is not a checkpoint: expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    arch, config = _arch_and_config(d)
    model = ARCHS[arch][1](config)
    model.load_state_dict(_read_weights(d, model))
    return model.to(device)  # buffers too (a sincos table is not in the file)


__all__ = [
    "ARCHS",
    "LoadResult",
    "checkpoint_config",
    "load_checkpoint",
    "load_pretrained",
    "one_line",
    "read_state_dict",
    "register_arch",
    "save_checkpoint",
    "weights_files",
]

"""What is wrong with a model directory's weight files, read from their headers before any weight
loads: real weights arrive by interrupted downloads and half-copied folders.

Checked: the safetensors files exist (``model.safetensors``, or every shard that
``model.safetensors.index.json`` names, holding the tensors it says), each file is whole (its
header and the byte ranges the header declares: ``safe_open`` reads only those), and the tensors
fit the model ``config.json`` describes: every parameter is present (a tied output embedding is the
input one; a value model's head may be new) with the shape the config implies.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping

from safetensors import SafetensorError, safe_open

from engine.models.loading import meta_model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class DamagedWeights(Exception):
    """A model directory's weights cannot load as its config describes; the message names the file."""


def weight_files(path: str) -> Mapping[str, list[str] | None]:
    """The directory's safetensors files, each with the tensors the index says it holds (None
    without an index)."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DamagedWeights(f"{index}: not a safetensors index with a weight_map ({e})") from None
        if not isinstance(weight_map, dict):
            raise DamagedWeights(f"{index}: its weight_map is not a mapping of tensor names to files")
        files: defaultdict[str, list[str]] = defaultdict(list)
        for name, file in weight_map.items():
            files[str(file)].append(name)
        return files
    if os.path.isfile(os.path.join(path, SINGLE)):
        return {SINGLE: None}
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
    hint = f" (it has {', '.join(others)}: save it with safe_serialization, the default)" if others else ""
    raise DamagedWeights(f"{path}: no {SINGLE} or {INDEX}{hint}")


def tensor_shapes(path: str) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(file, tensor name, shape) of every tensor in the directory's weight files, headers only."""
    for file, listed in weight_files(path).items():
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise DamagedWeights(f"{full}: missing, though {os.path.join(path, INDEX)} names it")
        try:
            with safe_open(full, framework="pt") as f:
                names = set(f.keys())
                absent = sorted(set(listed or []) - names)
                if absent:
                    raise DamagedWeights(
                        f"{full}: lacks {len(absent)} tensor(s) its index puts there, e.g. {absent[0]}"
                    )
                for name in sorted(names):
                    yield file, name, tuple(f.get_slice(name).get_shape())
        except SafetensorError as e:
            size = os.path.getsize(full)
            raise DamagedWeights(f"{full}: not a whole safetensors file ({size:,} bytes: {e}); copy it again") from None


def check_weight_files(path: str, value_head: bool, trust_remote_code: bool = False) -> None:
    """Raise :class:`DamagedWeights` unless the weights at ``path`` load into the model its config
    describes (a causal LM, or with ``value_head`` a value model whose head may be new)."""
    model = meta_model(path, value_head, None, trust_remote_code)
    prefix = model.base_model_prefix + "."
    strip = lambda name: name.removeprefix(prefix)
    expected = {strip(name): tuple(p.shape) for name, p in model.named_parameters()}  # a tied head once
    made_by_loader = {strip(name) for name in expected if not name.startswith(prefix)} if value_head else set()
    found = set()
    for file, name, shape in tensor_shapes(path):
        key = strip(name)
        if key in expected and expected[key] != shape:
            raise DamagedWeights(
                f"{os.path.join(path, file)}: {name} has shape {list(shape)}, but config.json makes it "
                f"{list(expected[key])}: the weights belong to another model or config"
            )
        found.add(key)
    missing = sorted(set(expected) - found - made_by_loader)
    if missing:
        raise DamagedWeights(
            f"{path}: the weight files lack {len(missing)} of the model's {len(expected)} tensors, e.g. "
            f"{missing[0]}: an incomplete copy, or weights of another model"
        )

"""Backbone weights from local files only: locate, verify (SHA-256) and load a state dict.

No function here ever downloads anything (no internet at run time). A weights
argument is either the file itself or a directory in which the backbone's canonical file name
(the basename of its published URL) is looked up. A missing or mismatched file raises an error
that names the expected file, the URL to fetch it from on another machine and how to pass it.

Files are read with ``torch.load(..., weights_only=True)`` (no arbitrary code execution). A file
holding a whole pickled module (TorchXRayVision's DenseNet releases) is unpickled with the same
restricted loader, allowing only the module classes the caller names.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

_HUB_HASH = re.compile(r"-([a-f0-9]{8,})\.")


class WeightsError(Exception):
    """Backbone weights are missing, fail verification or do not fit the architecture."""


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, streamed in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _how_to(filename: str, url: str) -> str:
    return (
        f"expected file {filename!r} (published at {url}). Fetch it on a machine with internet "
        f"access, e.g. `curl -L -o {filename} {url}`, copy it here and pass --weights with the "
        "file or the directory that contains it (optionally pin it with --sha256)"
    )


def resolve_weights(
    weights: str | os.PathLike[str],
    *,
    filename: str,
    url: str,
    sha256: str | None = None,
) -> tuple[Path, str]:
    """Find the weights file and verify it; returns (path, hex SHA-256 of the file).

    ``weights`` is a file, or a directory searched for ``filename``. With ``sha256`` the digest
    must match exactly. Without it, a file carrying its canonical torch-hub name
    (``name-<hash prefix>.pth``) is checked against that prefix, as torch.hub itself does.
    """
    given = Path(weights).expanduser()
    path = given / filename if given.is_dir() else given
    if not path.is_file():
        where = f"directory {given}" if given.is_dir() else f"path {given}"
        raise WeightsError(f"no weights file at {where}: {_how_to(filename, url)}")
    digest = sha256_file(path)
    if sha256 is not None:
        want = sha256.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", want):
            raise WeightsError(f"--sha256 must be 64 hex digits, got {sha256!r}")
        if digest != want:
            raise WeightsError(
                f"SHA-256 mismatch for {path}: file has {digest}, pinned {want}; "
                f"{_how_to(filename, url)}"
            )
    elif path.name == filename:
        match = _HUB_HASH.search(filename)
        if match and not digest.startswith(match.group(1)):
            raise WeightsError(
                f"{path} is corrupt or not the published file: its SHA-256 {digest} does not "
                f"start with {match.group(1)} (encoded in the file name); {_how_to(filename, url)}"
            )
    return path, digest


def _as_state_dict(obj: Any, path: Path) -> dict[str, Any]:
    if isinstance(obj, torch.nn.Module):
        for mod in obj.modules():  # modules pickled by torch < 1.6 lack this attribute
            if not hasattr(mod, "_non_persistent_buffers_set"):
                mod._non_persistent_buffers_set = set()
        return dict(obj.state_dict())
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping | torch.nn.Module):
                return _as_state_dict(inner, path)
        if obj and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
            prefix = "module."
            if all(k.startswith(prefix) for k in obj):  # saved from DataParallel
                return {k[len(prefix) :]: v for k, v in obj.items()}
            return dict(obj)
    raise WeightsError(f"{path} holds {type(obj).__name__}, not a state dict or a module")


def load_state_dict_file(
    path: str | os.PathLike[str], *, module_classes: Iterable[type] = ()
) -> dict[str, Any]:
    """Load a state dict with the restricted (weights-only) unpickler.

    ``module_classes`` are extra classes allowed when the file holds a pickled ``nn.Module``
    (the torch.nn layer classes it is built from are added automatically).
    """
    file = Path(path)
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as first:
        allowed = [*module_classes, *_nn_layer_classes()]
        if not module_classes:
            raise WeightsError(f"cannot read weights from {file}: {first}") from first
        try:
            with torch.serialization.safe_globals(allowed):
                obj = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise WeightsError(
                f"cannot read weights from {file} with the safe loader: {exc}. Provide a plain "
                "state dict instead: on a machine with internet access, build the model with "
                "torchxrayvision's own constructor (it fetches and checks its published weights), "
                "save model.state_dict() with torch.save, copy that file here and pass it (pin "
                "it with --sha256). This loader never unpickles arbitrary objects."
            ) from exc
    return _as_state_dict(obj, file)


def _nn_layer_classes() -> list[Any]:
    import collections

    nn = torch.nn
    return [
        collections.OrderedDict,
        nn.Sequential,
        nn.ModuleList,
        nn.ModuleDict,
        nn.Conv2d,
        nn.BatchNorm2d,
        nn.ReLU,
        nn.MaxPool2d,
        nn.AvgPool2d,
        nn.AdaptiveAvgPool2d,
        nn.Linear,
        nn.Dropout,
        nn.Identity,
        set,
    ]


def load_into(module: Any, state: Mapping[str, Any], *, path: Path) -> None:
    """``module.load_state_dict(state, strict=True)`` with a readable error on mismatch."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        raise WeightsError(
            f"{path} does not fit this backbone: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}, shape mismatches {shapes[:3]}"
        )
    module.load_state_dict(dict(state), strict=True)

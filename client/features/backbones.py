"""Backbone registry: frozen feature extractors with their own preprocessing (docs/method.md §1).

* TorchXRayVision DenseNet-121 (every published weight variant): ``h = model.features2(x)``,
  ReLU + global average pool, d = 1024; one channel, 224 px, pixels scaled to about
  [-1024, 1024] by ``xrv.datasets.normalize(img, maxval)``.
* TorchXRayVision ResNet-50 (``resnet50-res512-all``): the pooled output of ``layer4`` as in its
  ``features(x)``, d = 2048, one channel, 512 px, same pixel scale.
* torchvision ResNet-18/34/50/101/152 (pooled ``avgpool``, d = 512 or 2048), VGG-11/13/16/19
  (the penultimate fully connected layer fc7 after ReLU, d = 4096) and EfficientNet-B0..B7
  (pooled features before the classifier, d = 1280..2560), ImageNet ``IMAGENET1K_V1`` weights with
  their published resize / centre-crop / interpolation; grayscale is repeated to 3 channels and
  normalised with the ImageNet mean and standard deviation.

Weights come only from local files (``afl.client.features.weights``); random initialisation needs
``random_init=True`` and is stamped into the returned source string and flag. torchxrayvision
is imported only here, under ``warnings.catch_warnings()`` because its import silences every
Python warning process-wide.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torchvision
import torchvision.transforms.v2.functional as TF
from numpy.typing import NDArray

from afl.client.features.weights import (
    WeightsError,
    load_into,
    load_state_dict_file,
    resolve_weights,
)

with warnings.catch_warnings():  # torchxrayvision calls warnings.filterwarnings("ignore")
    import torchxrayvision as xrv

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
XRV_DENSENET_VARIANTS = ("all", "nih", "pc", "chex", "rsna", "mimic_nb", "mimic_ch")
_EFFICIENTNET_DIMS = (1280, 1280, 1408, 1536, 1792, 2048, 2304, 2560)


class BackboneError(Exception):
    """Unknown backbone name or inconsistent backbone options."""


@dataclass(frozen=True)
class Preprocessor:
    """Picklable image → tensor transform (runs in DataLoader workers).

    Input: float32 grayscale (H, W) in [0, 1] (``afl.client.features.sitedata`` readers). ``xrv``:
    ``normalize(img, 1)`` = (2 img - 1) 1024, square centre crop on the long side, antialiased
    bilinear resize to ``crop_size`` (as ``xrv.utils.fix_resolution``). ``imagenet``: resize the
    short side to ``resize_size``, centre crop ``crop_size``, 3 channels, (x - mean) / std.
    """

    kind: str
    crop_size: int
    resize_size: int
    interpolation: str = "bilinear"

    @property
    def channels(self) -> int:
        return 1 if self.kind == "xrv" else 3

    def __call__(self, img: NDArray[np.float32]) -> Any:
        arr = np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)
        x = torch.from_numpy(np.ascontiguousarray(arr))[None, None]
        out = preprocess_batch(
            x, self.kind == "xrv", self.crop_size, self.resize_size, self.interpolation
        )
        return out[0].contiguous()


def preprocess_batch(x: torch.Tensor, xrv: bool, crop: int, resize: int, mode: str) -> torch.Tensor:
    """The :class:`Preprocessor` on a (B, 1, H, W) float batch in [0, 1] (one H × W for the batch).

    Written in TorchScript- and ``torch.export``-compatible torch so that the exported classifier
    (:mod:`afl.client.model.export`) runs exactly this code. It reproduces, bit for bit (tested),
    ``xrv.datasets.normalize(img, 1)`` + centre square crop + antialiased bilinear resize for
    ``xrv``, and torchvision's ``resize`` (short side to ``resize``, the long side truncated),
    ``center_crop`` (offsets rounded half to even) and ``normalize`` for ``imagenet``.
    """
    x = x.clamp(0.0, 1.0)
    h = x.shape[2]
    w = x.shape[3]
    side = min(h, w)
    if xrv:
        x = (2.0 * x - 1.0) * 1024.0
        x = x.narrow(2, h // 2 - side // 2, side).narrow(3, w // 2 - side // 2, side)
        return torch.nn.functional.interpolate(
            x, size=[crop, crop], mode="bilinear", antialias=True, align_corners=False
        )
    new_h = resize * h // side
    new_w = resize * w // side
    x = torch.nn.functional.interpolate(
        x, size=[new_h, new_w], mode=mode, antialias=True, align_corners=False
    )
    # torchvision: int(round((size - crop) / 2.0)), i.e. halves rounded to the even integer
    over_h = new_h - crop
    over_w = new_w - crop
    top = over_h // 2 + (over_h % 2) * ((over_h // 2) % 2)
    left = over_w // 2 + (over_w % 2) * ((over_w // 2) % 2)
    x = x.narrow(2, top, crop).narrow(3, left, crop).expand(-1, 3, -1, -1)
    # IMAGENET_MEAN and IMAGENET_STD, spelled out: TorchScript cannot read module globals
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


@dataclass(frozen=True)
class BackboneSpec:
    """A registry entry: architecture, feature dimension, preprocessing, expected weights file."""

    name: str
    family: str
    arch: str
    dim: int
    preprocess: Preprocessor
    weights_filename: str
    weights_url: str
    description: str


def _xrv_specs() -> list[BackboneSpec]:
    specs = []
    for variant in XRV_DENSENET_VARIANTS:
        url = xrv.models.model_urls[f"densenet121-res224-{variant}"]["weights_url"]
        specs.append(
            BackboneSpec(
                f"xrv-densenet121-{variant}",
                "xrv-densenet",
                "densenet121",
                1024,
                Preprocessor("xrv", 224, 224),
                os.path.basename(url),
                url,
                f"TorchXRayVision DenseNet-121 ({variant}), features2, 224 px",
            )
        )
    url = xrv.models.model_urls["resnet50-res512-all"]["weights_url"]
    specs.append(
        BackboneSpec(
            "xrv-resnet50-all",
            "xrv-resnet",
            "resnet50",
            2048,
            Preprocessor("xrv", 512, 512),
            os.path.basename(url),
            url,
            "TorchXRayVision ResNet-50 (all), features, 512 px",
        )
    )
    return specs


def _torchvision_spec(arch: str, family: str, dim: int) -> BackboneSpec:
    enum_name = {"resnet": "ResNet", "vgg": "VGG", "efficientnet": "EfficientNet_B"}[family]
    suffix = (
        arch.removeprefix("efficientnet_b") if family == "efficientnet" else arch[len(family) :]
    )
    weights = getattr(torchvision.models, f"{enum_name}{suffix}_Weights").IMAGENET1K_V1
    kw = weights.transforms.keywords  # functools.partial(ImageClassification, ...)
    interp = kw.get("interpolation", TF.InterpolationMode.BILINEAR)
    pre = Preprocessor(
        "imagenet", int(kw["crop_size"]), int(kw.get("resize_size", 256)), interp.value
    )
    return BackboneSpec(
        arch,
        family,
        arch,
        dim,
        pre,
        os.path.basename(weights.url),
        weights.url,
        f"torchvision {arch} IMAGENET1K_V1, resize {pre.resize_size} crop {pre.crop_size}",
    )


def _registry() -> dict[str, BackboneSpec]:
    specs = _xrv_specs()
    for depth in (18, 34, 50, 101, 152):
        specs.append(_torchvision_spec(f"resnet{depth}", "resnet", 512 if depth < 50 else 2048))
    for depth in (11, 13, 16, 19):
        specs.append(_torchvision_spec(f"vgg{depth}", "vgg", 4096))
    for b, dim in enumerate(_EFFICIENTNET_DIMS):
        specs.append(_torchvision_spec(f"efficientnet_b{b}", "efficientnet", dim))
    return {s.name: s for s in specs}


BACKBONES: dict[str, BackboneSpec] = _registry()


def get_spec(name: str) -> BackboneSpec:
    try:
        return BACKBONES[name]
    except KeyError:
        raise BackboneError(f"unknown backbone {name!r}; known: {', '.join(BACKBONES)}") from None


class _Features(torch.nn.Module):  # type: ignore[misc]
    """Wraps a network so that ``forward`` returns the (B, d) feature matrix."""

    def __init__(self, net: Any, *, xrv_densenet: bool) -> None:
        super().__init__()
        self.net = net
        self.xrv_densenet = xrv_densenet

    def forward(self, x: Any) -> Any:
        return self.net.features2(x) if self.xrv_densenet else self.net(x)


def _build(spec: BackboneSpec) -> Any:
    if spec.family == "xrv-densenet":
        return xrv.models.DenseNet(weights=None)  # weights=None: no download, 18 outputs
    if spec.family == "xrv-resnet":
        net = torchvision.models.resnet50(weights=None, num_classes=18)
        net.conv1 = torch.nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
        return net
    return getattr(torchvision.models, spec.arch)(weights=None)


def _strip_head(spec: BackboneSpec, net: Any) -> Any:
    if spec.family in ("resnet", "xrv-resnet"):
        net.fc = torch.nn.Identity()
    elif spec.family == "vgg":
        net.classifier[-1] = torch.nn.Identity()
    elif spec.family == "efficientnet":
        net.classifier = torch.nn.Identity()
    return _Features(net, xrv_densenet=spec.family == "xrv-densenet")


@dataclass(frozen=True)
class Backbone:
    """A loaded, frozen feature extractor: ``module(preprocess(img)[None])`` is (1, dim)."""

    spec: BackboneSpec
    module: Any
    source: str
    random_init: bool
    weights_sha256: str | None

    @property
    def preprocess(self) -> Preprocessor:
        return self.spec.preprocess

    @property
    def dim(self) -> int:
        return self.spec.dim


def load_backbone(
    name: str,
    *,
    weights: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
    random_init: bool = False,
    seed: int = 0,
) -> Backbone:
    """Build backbone ``name`` with weights from a local file/directory, or random-init on request.

    Never downloads. ``random_init=True`` (tests and benchmarks only) is exclusive with
    ``weights`` and is stamped into ``source`` as ``RANDOM-INIT``.
    """
    spec = get_spec(name)
    if random_init and weights is not None:
        raise BackboneError("pass either weights or random_init=True, not both")
    if random_init:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = _build(spec)
        module = _strip_head(spec, net).eval().requires_grad_(False)
        return Backbone(spec, module, f"{name} RANDOM-INIT(seed={seed})", True, None)
    if weights is None:
        raise WeightsError(
            f"backbone {name} needs weights: pass the file {spec.weights_filename!r} (published "
            f"at {spec.weights_url}) or its directory; random weights only with random_init=True"
        )
    path, digest = resolve_weights(
        weights, filename=spec.weights_filename, url=spec.weights_url, sha256=sha256
    )
    classes: tuple[type, ...] = ()
    if spec.family == "xrv-densenet":
        m = xrv.models
        classes = (m.DenseNet, m._DenseLayer, m._DenseBlock, m._Transition)
    state = load_state_dict_file(path, module_classes=classes)
    net = _build(spec)
    load_into(net, state, path=path)
    module = _strip_head(spec, net).eval().requires_grad_(False)
    return Backbone(spec, module, f"{name} {path.name} sha256:{digest}", False, digest)

"""Backbone registry: shapes, determinism, local-only weights, and the warnings-filter guard."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision

from afl.client.features.backbones import (
    BACKBONES,
    BackboneError,
    Preprocessor,
    load_backbone,
)
from afl.client.features.weights import WeightsError, sha256_file

DEFAULT_SET = ("xrv-densenet121-all", "resnet18", "vgg11", "efficientnet_b0")


def _features(bb, images):
    x = torch.stack([bb.preprocess(im) for im in images])
    with torch.inference_mode():
        return bb.module(x).numpy()


def _images(n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.random((50, 40), dtype=np.float32) for _ in range(n)]


def _check_shape(name):
    bb = load_backbone(name, random_init=True)
    spec = BACKBONES[name]
    x = bb.preprocess(_images(1)[0])
    size = spec.preprocess.crop_size
    assert tuple(x.shape) == (spec.preprocess.channels, size, size)
    assert x.dtype == torch.float32
    feats = _features(bb, _images(2))
    assert feats.shape == (2, spec.dim) and feats.dtype == np.float32
    assert np.isfinite(feats).all()
    assert bb.random_init and "RANDOM-INIT" in bb.source and bb.weights_sha256 is None


@pytest.mark.parametrize("name", DEFAULT_SET)
def test_shapes_and_dtypes(name):
    _check_shape(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in BACKBONES if n not in DEFAULT_SET])
def test_shapes_and_dtypes_full_registry(name):
    _check_shape(name)


def test_registry_matches_the_published_weights():
    assert BACKBONES["xrv-densenet121-all"].weights_filename == (
        "nih-pc-chex-mimic_ch-google-openi-kaggle-densenet121-d121-tw-lr001-rot45-tr15-sc15-"
        "seed0-best.pt"
    )
    assert BACKBONES["xrv-resnet50-all"].preprocess.crop_size == 512
    eff = torchvision.models.EfficientNet_B4_Weights.IMAGENET1K_V1
    assert BACKBONES["efficientnet_b4"].weights_url == eff.url
    assert BACKBONES["efficientnet_b4"].preprocess.crop_size == eff.transforms().crop_size[0]
    # feature dimension = in_features of the classifier that the registry strips off
    assert BACKBONES["vgg16"].dim == torchvision.models.vgg16().classifier[-1].in_features
    assert BACKBONES["resnet50"].dim == torchvision.models.resnet50().fc.in_features
    with pytest.raises(BackboneError, match="unknown backbone"):
        load_backbone("resnet9000", random_init=True)


def test_xrv_preprocess_scale_and_crop():
    pre = Preprocessor("xrv", 32, 32)
    img = np.zeros((40, 64), dtype=np.float32)
    img[:, 32:] = 1.0  # right half white: the centre crop keeps columns 12..51
    x = pre(img)
    assert tuple(x.shape) == (1, 32, 32)
    assert float(x.min()) == pytest.approx(-1024.0) and float(x.max()) == pytest.approx(1024.0)
    flat = pre(np.full((10, 10), 0.5, dtype=np.float32))
    np.testing.assert_allclose(flat.numpy(), 0.0, atol=1e-3)


def _library_preprocess(pre: Preprocessor, img: np.ndarray) -> torch.Tensor:
    """The oracle: torchxrayvision's normalize and torchvision's resize / crop / normalize."""
    import torchvision.transforms.v2.functional as TF
    import torchxrayvision as xrv

    if pre.kind == "xrv":
        arr = xrv.datasets.normalize(img, 1.0)
        h, w = arr.shape
        side = min(h, w)
        top, left = h // 2 - side // 2, w // 2 - side // 2
        x = torch.from_numpy(np.ascontiguousarray(arr[top : top + side, left : left + side]))
        x = torch.nn.functional.interpolate(
            x[None, None], size=(pre.crop_size,) * 2, mode="bilinear", antialias=True
        )
        return x[0]
    x = torch.from_numpy(img)[None]
    mode = TF.InterpolationMode(pre.interpolation)
    x = TF.resize(x, [pre.resize_size], interpolation=mode, antialias=True)
    x = TF.center_crop(x, [pre.crop_size] * 2).expand(3, -1, -1)
    return TF.normalize(x.contiguous(), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


@pytest.mark.parametrize(
    "pre",
    [
        Preprocessor("xrv", 224, 224),
        Preprocessor("imagenet", 224, 256),
        Preprocessor("imagenet", 224, 256, "bicubic"),
    ],
)
def test_preprocess_equals_the_libraries_bit_for_bit(pre):
    """The torch implementation shared with the exported classifier reproduces torchxrayvision's
    and torchvision's preprocessing exactly, for odd and even sizes and both orientations."""
    rng = np.random.default_rng(0)
    for h, w in [(300, 260), (256, 256), (257, 300), (1024, 1000), (225, 999), (259, 256)]:
        img = rng.random((h, w), dtype=np.float32)
        assert torch.equal(pre(img), _library_preprocess(pre, img)), (h, w)


def test_features_are_deterministic_and_seeded():
    a = _features(load_backbone("resnet18", random_init=True, seed=3), _images(3))
    b = _features(load_backbone("resnet18", random_init=True, seed=3), _images(3))
    c = _features(load_backbone("resnet18", random_init=True, seed=4), _images(3))
    assert a.tobytes() == b.tobytes()
    assert not np.allclose(a, c)


def test_weights_missing_file_names_expected_file_and_url(tmp_path):
    spec = BACKBONES["xrv-densenet121-all"]
    with pytest.raises(WeightsError) as err:
        load_backbone("xrv-densenet121-all", weights=tmp_path)
    assert spec.weights_filename in str(err.value) and spec.weights_url in str(err.value)
    assert "--weights" in str(err.value)
    with pytest.raises(WeightsError, match="random_init=True"):
        load_backbone("resnet18")
    with pytest.raises(BackboneError, match="not both"):
        load_backbone("resnet18", weights=tmp_path, random_init=True)


def test_state_dict_roundtrip_directory_lookup_and_sha(tmp_path):
    ref = load_backbone("resnet18", random_init=True, seed=7)
    # a full torchvision state dict (fc included) is what users have: rebuild it
    full = torchvision.models.resnet18()
    state = dict(ref.module.net.state_dict())
    state["fc.weight"], state["fc.bias"] = full.fc.weight.detach(), full.fc.bias.detach()
    path = tmp_path / "mine.pth"
    torch.save(state, path)
    digest = sha256_file(path)
    loaded = load_backbone("resnet18", weights=path, sha256=digest.upper())
    assert not loaded.random_init and loaded.weights_sha256 == digest and digest in loaded.source
    imgs = _images(2)
    assert _features(loaded, imgs).tobytes() == _features(ref, imgs).tobytes()
    with pytest.raises(WeightsError, match="SHA-256 mismatch"):
        load_backbone("resnet18", weights=path, sha256="0" * 64)
    with pytest.raises(WeightsError, match="64 hex"):
        load_backbone("resnet18", weights=path, sha256="abc")
    # directory lookup by the canonical name; the torch-hub hash prefix in the name is checked
    canonical = tmp_path / BACKBONES["resnet18"].weights_filename
    canonical.write_bytes(path.read_bytes())
    with pytest.raises(WeightsError, match="does not start with"):
        load_backbone("resnet18", weights=tmp_path)


def test_weights_for_another_architecture_are_rejected(tmp_path):
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "r34.pth")
    with pytest.raises(WeightsError, match="does not fit"):
        load_backbone("resnet18", weights=tmp_path / "r34.pth")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(WeightsError, match="cannot read"):
        load_backbone("resnet18", weights=tmp_path / "junk.pt")


def test_xrv_pickled_module_loads_with_the_safe_loader(tmp_path):
    """TorchXRayVision publishes DenseNets as whole pickled modules (not state dicts)."""
    ref = load_backbone("xrv-densenet121-nih", random_init=True, seed=5)
    path = tmp_path / BACKBONES["xrv-densenet121-nih"].weights_filename
    torch.save(ref.module.net, path)
    loaded = load_backbone("xrv-densenet121-nih", weights=tmp_path)
    imgs = _images(1)
    assert _features(loaded, imgs).tobytes() == _features(ref, imgs).tobytes()


def test_xrv_resnet_state_dict_roundtrip(tmp_path):
    ref = load_backbone("xrv-resnet50-all", random_init=True, seed=1)
    net = torchvision.models.resnet50(num_classes=18)
    state = ref.module.net.state_dict()
    state["fc.weight"], state["fc.bias"] = net.fc.weight.detach(), net.fc.bias.detach()
    path = tmp_path / "x.pt"
    torch.save(state, path)
    loaded = load_backbone("xrv-resnet50-all", weights=path)
    x = torch.randn(1, 1, 64, 64) * 500
    with torch.inference_mode():
        assert torch.equal(loaded.module(x), ref.module(x))


def test_import_keeps_the_warning_filters():
    code = (
        "import warnings, torch, torchvision\n"
        "before = list(warnings.filters)\n"
        "import afl.client.features.backbones\n"
        "assert list(warnings.filters) == before, 'filters changed'\n"
        "warnings.simplefilter('error')\n"
        "try:\n"
        "    warnings.warn('still visible', UserWarning)\n"
        "except UserWarning:\n"
        "    print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"

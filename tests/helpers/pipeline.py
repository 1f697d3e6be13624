"""Shared by the export tests: images written by the test, a random-init weights file, the
project's own pipeline (extraction into a feature cache, then σ(H W)) and the comparison of an
exported classifier (TorchScript and ONNX) with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from afl.client.features.backbones import BACKBONES, _build
from afl.client.features.extract import extract_features
from afl.client.features.sitedata import manifest_source, read_image
from afl.client.model.export import load_exported
from afl.core.metrics import predict_proba
from tests.client.imagegen import write_dicom, write_png


def weights_file(tmp: Path, name: str) -> Path:
    """A random-init state dict of backbone ``name`` written as a local weights file."""
    torch.manual_seed(7)
    path = tmp / f"{name}-random-init.pt"
    torch.save(_build(BACKBONES[name]).state_dict(), path)
    return path


def write_images(folder: Path) -> Path:
    """PNG (8 and 16 bit) and DICOM (MONOCHROME1/2) images of different sizes, and a manifest
    listing them (column ``path``); returns the manifest."""
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True, exist_ok=True)
    files = [
        write_png(folder / "a.png", rng.integers(0, 256, (300, 260), dtype=np.uint8)),
        write_png(folder / "b.png", rng.integers(0, 65536, (231, 297), dtype=np.uint16)),
        write_dicom(folder / "c.dcm", rng.integers(0, 4096, (256, 320)), photometric="MONOCHROME1"),
        write_dicom(folder / "d.dcm", rng.integers(0, 1024, (280, 280)), bits=10),
    ]
    manifest = folder / "manifest.csv"
    manifest.write_text("path\n" + "".join(f"{p.name}\n" for p in files), encoding="utf-8")
    return manifest


def manifest_names(manifest: Path) -> list[str]:
    return [line.strip() for line in manifest.read_text().splitlines()[1:]]


def pipeline_probabilities(
    tmp: Path, backbone: Any, manifest: Path, w: NDArray[np.float64]
) -> NDArray[np.float64]:
    """The project's own pipeline: `afl-client extract` into a feature cache, then σ(H W)."""
    cache = extract_features(
        manifest_source(manifest, classes=()),
        backbone,
        tmp / f"cache-{backbone.spec.name}",
        batch_size=2,
        workers=0,
        device="cpu",
        progress=False,
    ).cache
    return predict_proba(cache.features, w)


def check_against_pipeline(
    out: Path, manifest: Path, expected: NDArray[np.float64], *, onnx: bool = True
) -> None:
    """The export in ``out`` gives ``expected`` on every manifest image, to 1e-5: TorchScript
    always, the ONNX graph through onnxruntime when ``onnx``."""
    model = load_exported(out)
    session = None
    if onnx:
        import onnxruntime

        session = onnxruntime.InferenceSession(
            str(out / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        assert [o.name for o in session.get_outputs()] == ["probabilities", "logits"]
    for i, name in enumerate(manifest_names(manifest)):
        image = read_image(manifest.parent / name)
        probs, logits = model(image)
        np.testing.assert_allclose(probs, expected[i], rtol=0, atol=1e-5)
        np.testing.assert_allclose(1 / (1 + np.exp(-logits)), probs, rtol=0, atol=1e-12)
        if session is not None:
            onnx_probs, _ = session.run(None, {"image": image[None, None]})
            np.testing.assert_allclose(onnx_probs[0], expected[i], rtol=0, atol=1e-5)

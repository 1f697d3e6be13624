"""A published model as a deployable classifier (docs/operations.md §14, docs/method.md §3.5).

The classifier is the frozen backbone named by the model (weights from a local file, digest
checked, :func:`afl.client.features.backbones.load_backbone`), its preprocessing and the federation's
linear head, in one module::

    image (B, 1, H, W), float32 grayscale in [0, 1]   (afl.client.features.sitedata readers)
      -> preprocess_batch (afl.client.features.backbones: the extraction's own preprocessing)
      -> backbone features h (B, d), float32
      -> logits z = float64(h) · W   (W: the signed model's float64 d × C weights)
      -> probabilities σ(z)           (the paper's scores, eq. 23; decision σ(z) > 0.5)

so its outputs are those of the project's pipeline, ``afl-client extract`` then
:func:`afl.core.metrics.predict_proba` (tested to 1e-5). Two artefacts:

* TorchScript (``model.ts``): the backbone traced at its fixed input size, the preprocessing and
  head scripted (any H × W); the model card rides along as the extra file ``model_card.json``.
  ``torch.jit`` is deprecated upstream but still the format most serving stacks load.
* ONNX (``model.onnx``, opset 18, ``torch.onnx.export(dynamo=True)`` with dynamic batch, height
  and width): inputs ``image``, outputs ``probabilities`` and ``logits``; the model digest and
  classes are in its metadata. onnxruntime runs it (tested).

The model is used only after its signature verified with the coordinator key of the federation's
configuration (:func:`load_published_model`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from afl.client.features.backbones import Backbone, Preprocessor, preprocess_batch
from afl.client.features.weights import sha256_file
from afl.client.model.model_card import TrainingFacts, card_markdown, model_card
from afl.client.model.proof import PROOF_FILE, SIGNED_MODEL_FILE, ModelProof
from afl.client.model.published import ModelFileError, PublishedModel, load_published_model
from afl.core.evaluation.calibration import Calibration, CalibrationError

__all__ = [
    "Classifier",
    "ExportError",
    "ExportedModel",
    "ModelFileError",
    "PublishedModel",
    "build_classifier",
    "export_classifier",
    "load_exported",
    "load_published_model",
    "save_onnx",
    "save_torchscript",
]

CARD_FILE = "model_card.json"
OUTPUTS = ("probabilities", "logits")


class ExportError(ModelFileError):
    """The model, the backbone or the output folder cannot be used for an export."""


class Classifier(torch.nn.Module):  # type: ignore[misc]
    """Preprocessing + backbone features + the linear head (module docstring)."""

    def __init__(self, features: Any, weights: NDArray[np.float64], preprocess: Preprocessor):
        super().__init__()
        self.features = features
        self.register_buffer("weights", torch.from_numpy(np.array(weights, dtype=np.float64)))
        self.xrv = preprocess.kind == "xrv"
        self.crop = preprocess.crop_size
        self.resize = preprocess.resize_size
        self.mode = preprocess.interpolation

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = preprocess_batch(image, self.xrv, self.crop, self.resize, self.mode)
        logits = torch.matmul(self.features(x).to(torch.float64), self.weights)
        return torch.sigmoid(logits), logits


def build_classifier(backbone: Backbone, weights: NDArray[np.float64]) -> Classifier:
    """The eager classifier; ``weights`` is (d, C) with d the backbone's feature dimension."""
    if weights.ndim != 2 or weights.shape[0] != backbone.dim:
        raise ExportError(
            f"the model's W is {weights.shape}: it needs features of d = {weights.shape[0]}, the "
            f"backbone {backbone.spec.name} gives d = {backbone.dim}"
        )
    clf = Classifier(backbone.module, weights, backbone.preprocess)
    clf.eval()
    return clf


@contextlib.contextmanager
def _quiet() -> Any:
    """torch.jit's deprecation and tracer warnings, and torch.onnx's progress lines."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def save_torchscript(
    clf: Classifier, path: str | os.PathLike[str], *, card: Mapping[str, Any]
) -> Path:
    """Trace the backbone at its input size, script the rest, save with the card inside."""
    pre_channels = 1 if clf.xrv else 3
    example = torch.zeros(1, pre_channels, clf.crop, clf.crop)
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(clf.features, example, check_trace=False)
        scripted = torch.jit.script(Classifier(traced, clf.weights.numpy(), _pre_of(clf)))
        out = Path(path)
        torch.jit.save(scripted, str(out), _extra_files={CARD_FILE: json.dumps(card)})
    return out


def _pre_of(clf: Classifier) -> Preprocessor:
    return Preprocessor("xrv" if clf.xrv else "imagenet", clf.crop, clf.resize, clf.mode)


def save_onnx(
    clf: Classifier, path: str | os.PathLike[str], *, metadata: Mapping[str, str]
) -> Path:
    """ONNX graph with dynamic batch, height and width (opset 18); ``metadata`` goes into the
    model's metadata properties."""
    try:
        import onnx
    except ImportError as exc:
        raise ExportError(
            "ONNX export needs the 'export' extra: pip install 'afl[client,export]' "
            "(or pass --no-onnx)"
        ) from exc
    out = Path(path)
    example = torch.rand(1, 1, clf.crop + 37, clf.crop + 53)
    dims = {
        0: torch.export.Dim("batch", min=1, max=1024),
        2: torch.export.Dim("height", min=32, max=16384),
        3: torch.export.Dim("width", min=32, max=16384),
    }
    with _quiet():
        program = torch.onnx.export(
            clf,
            (example,),
            dynamo=True,
            input_names=["image"],
            output_names=list(OUTPUTS),
            dynamic_shapes=(dims,),
            opset_version=18,
        )
        if program is None:  # pragma: no cover - dynamo=True always returns the program
            raise ExportError("torch.onnx.export returned no program")
        program.save(str(out))
    graph = onnx.load(str(out))
    for key, value in metadata.items():
        entry = graph.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(graph, str(out))
    return out


@dataclass(frozen=True)
class ExportedModel:
    """A TorchScript classifier and the card saved with it."""

    module: Any
    card: dict[str, Any]
    path: Path

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.card["classes"])

    @property
    def model_sha256(self) -> str:
        return str(self.card["model"]["model_sha256"])

    @property
    def threshold(self) -> float:
        return float(self.card["model"].get("decision_threshold", 0.5))

    def __call__(
        self, image: NDArray[np.float32]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(probabilities, logits) of one (H, W) image."""
        x = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))[None, None]
        with torch.inference_mode():
            probs, logits = self.module(x)
        return probs[0].numpy(), logits[0].numpy()


def load_exported(path: str | os.PathLike[str]) -> ExportedModel:
    """An ``afl export`` folder (its ``model.ts``) or a TorchScript file written by it."""
    file = Path(path)
    if file.is_dir():
        file = file / "model.ts"
    if not file.is_file():
        raise ExportError(f"no exported model at {path} (expected an `afl export` folder)")
    extra = {CARD_FILE: ""}
    try:
        with _quiet():
            module = torch.jit.load(str(file), map_location="cpu", _extra_files=extra)
    except Exception as exc:  # torch raises RuntimeError/ValueError for foreign files
        raise ExportError(f"{file} is not a TorchScript model: {exc}") from exc
    try:
        card: dict[str, Any] = json.loads(extra[CARD_FILE])
        _ = card["classes"], card["model"]["model_sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{file} carries no afl model card ({CARD_FILE})") from exc
    return ExportedModel(module.eval(), card, file)


def export_classifier(
    published: PublishedModel,
    backbone: Backbone,
    out_dir: str | os.PathLike[str],
    *,
    facts: TrainingFacts,
    trained_on: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    calibration: Calibration | None = None,
    onnx: bool = True,
    software_version: str = "",
    proof: ModelProof | None = None,
) -> dict[str, Any]:
    """Write ``model.ts``, ``model.onnx``, ``model_card.json``/``.md``, the signed model, its
    federation-log proof (``log-proof.json``, when given: :mod:`afl.client.model.proof`), the
    calibration (when given) and ``SHA256SUMS`` into ``out_dir`` (new or empty); the card.
    The files are written into a temporary sibling folder renamed at the end, so a failed
    export leaves nothing behind.

    ``trained_on`` names the feature source the model was trained on when ``backbone`` is not
    it (the demo's surrogate features): the card then says the outputs are for testing only."""
    final = Path(out_dir)
    if final.exists() and any(final.iterdir()):
        raise ExportError(f"{final} is not empty: choose a new folder for the export")
    if calibration is not None:
        try:
            calibration.check_model(published.model_sha256, published.classes)
        except CalibrationError as exc:
            raise ExportError(str(exc)) from exc
    clf = build_classifier(backbone, published.weights)
    files = {"torchscript": "model.ts", "signed_model": SIGNED_MODEL_FILE}
    if proof is not None:
        files["log_proof"] = PROOF_FILE
    if onnx:
        files["onnx"] = "model.onnx"
    if calibration is not None:
        files["calibration"] = "calibration.json"
    files.update(card_json=CARD_FILE, card_markdown="model_card.md", checksums="SHA256SUMS")
    card = model_card(
        model=published.summary(),
        classes=published.classes,
        facts=facts,
        backbone={
            "name": backbone.spec.name,
            "description": backbone.spec.description,
            "feature_dim": backbone.dim,
            "weights": backbone.source,
            "weights_sha256": backbone.weights_sha256,
            "random_init": backbone.random_init,
            "trained_on": trained_on,
            "preprocessing": repr(backbone.preprocess),
        },
        files=files,
        metrics=metrics,
        calibration=None
        if calibration is None
        else {"method": calibration.method, "file": "calibration.json"},
        software_version=software_version,
    )
    if proof is not None:
        c = proof.checkpoint.checkpoint
        card["federation_log"] = {
            "statement_index": proof.index,
            "checkpoint_size": c.size,
            "checkpoint_root": c.root.hex(),
            "cosigned_by": [w for w, _ in proof.cosignatures],
        }
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        (out / SIGNED_MODEL_FILE).write_bytes(published.signed.SerializeToString())
        if proof is not None:
            proof.save(out / PROOF_FILE)
        save_torchscript(clf, out / "model.ts", card=card)
        if onnx:
            save_onnx(
                clf,
                out / "model.onnx",
                metadata={
                    "afl.model_sha256": published.model_sha256,
                    "afl.classes": json.dumps(list(published.classes)),
                    "afl.outputs": "probabilities = sigmoid(logits); logits = features . W",
                },
            )
        if calibration is not None:
            calibration.save(out / "calibration.json")
        (out / CARD_FILE).write_text(json.dumps(card, indent=2), encoding="utf-8")
        (out / "model_card.md").write_text(card_markdown(card), encoding="utf-8")
        sums = [f"{sha256_file(out / f)}  {f}" for f in sorted(files.values()) if f != "SHA256SUMS"]
        (out / "SHA256SUMS").write_text("\n".join(sums) + "\n", encoding="utf-8")
        if final.exists():
            final.rmdir()
        out.rename(final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return card

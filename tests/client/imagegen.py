"""Small synthetic PNG and DICOM files for the client tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.dataset import FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid


def write_png(path: Path, arr: np.ndarray) -> Path:
    Image.fromarray(arr).save(path)
    return path


def write_dicom(
    path: Path,
    stored: np.ndarray,
    *,
    photometric: str = "MONOCHROME2",
    bits: int = 12,
    slope: float | None = None,
    intercept: float | None = None,
) -> Path:
    """A minimal valid DICOM file (uint16 pixels, ``bits`` stored bits)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = "DX"
    ds.PatientID = "TEST"
    ds.Rows, ds.Columns = stored.shape
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated = 16
    ds.BitsStored = bits
    ds.HighBit = bits - 1
    ds.PixelRepresentation = 0
    if slope is not None:
        ds.RescaleSlope = slope
    if intercept is not None:
        ds.RescaleIntercept = intercept
    ds.PixelData = stored.astype(np.uint16).tobytes()
    ds.save_as(path, enforce_file_format=True)
    assert pydicom.dcmread(path).pixel_array.shape == stored.shape
    return path


def make_site(root: Path, n: int, *, size: int = 40, seed: int = 0) -> Path:
    """``n`` random 8-bit PNGs under root/img plus a manifest with classes A, B; returns it."""
    rng = np.random.default_rng(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    lines = ["path,A,B"]
    for i in range(n):
        h = size + int(rng.integers(0, 9))
        write_png(root / "img" / f"{i:03d}.png", rng.integers(0, 256, (h, size), dtype=np.uint8))
        lines.append(f"img/{i:03d}.png,{i % 2},{'' if i % 3 else 1}")
    manifest = root / "manifest.csv"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest

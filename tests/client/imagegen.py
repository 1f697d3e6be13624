"""Small synthetic PNG and DICOM files for the client tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import (
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    RLELossless,
    SecondaryCaptureImageStorage,
    generate_uid,
)

#: Uncompressed and the four compressed transfer syntaxes PACS exports use most.
DICOM_SYNTAXES = (
    ExplicitVRLittleEndian,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEG2000Lossless,
    RLELossless,
)


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
    syntax: str = ExplicitVRLittleEndian,
    window: tuple[float, float] | None = None,
    voi_lut: tuple[list[int], np.ndarray] | None = None,
) -> Path:
    """A minimal valid DICOM file (uint16 pixels, ``bits`` stored bits) in transfer ``syntax``:
    uncompressed, or compressed with pydicom's encoders (RLE Lossless; JPEG-LS Lossless through
    pyjpegls; JPEG 2000 Lossless through pylibjpeg-openjpeg) or :func:`jpeg_lossless_sv1`.
    ``window`` = (WindowCenter, WindowWidth); ``voi_lut`` = (LUTDescriptor, LUTData)."""
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
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    if voi_lut is not None:
        item = Dataset()
        item.LUTDescriptor = list(voi_lut[0])
        item.add_new(0x00283006, "US", [int(v) for v in voi_lut[1]])  # LUTData
        ds.VOILUTSequence = DicomSequence([item])
    ds.PixelData = stored.astype(np.uint16).tobytes()
    if syntax == JPEGLosslessSV1:
        ds.PixelData = encapsulate([jpeg_lossless_sv1(stored, precision=bits)])
        ds["PixelData"].VR = "OB"
        ds.file_meta.TransferSyntaxUID = JPEGLosslessSV1
    elif syntax != ExplicitVRLittleEndian:
        ds.compress(syntax)
    ds.save_as(path, enforce_file_format=True)
    back = pydicom.dcmread(path)
    assert back.file_meta.TransferSyntaxUID == syntax
    assert back.pixel_array.shape == stored.shape
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


def write_hospital(
    folder: Path,
    *,
    kind: str,
    classes: Sequence[str],
    count: int,
    seed: int,
    images: str = "",
    patients: bool = False,
) -> Path:
    """A hospital's images and the manifest that lists only the classes it labels: ``count``
    96x96 chest-X-ray-like ramps with noise in ``kind`` "png", "jpeg" or "dicom" (12-bit, the
    transfer syntax cycling through :data:`DICOM_SYNTAXES`, every third image with a VOI window)
    in the subfolder ``images`` of ``folder``, and ``folder/manifest.csv`` with the columns path,
    patient (when ``patients``: two images per patient) and ``classes``, each with positives and
    negatives (alternating per row). Returns the manifest."""
    rng = np.random.default_rng(seed)
    (folder / images).mkdir(parents=True, exist_ok=True)
    lines = [",".join(["path", *(["patient"] if patients else []), *classes])]
    suffix = {"png": "png", "jpeg": "jpg", "dicom": "dcm"}[kind]
    for i in range(count):
        ramp = np.linspace(0.2, 0.6, 96)[None, :] * (1 + (i * (seed % 5 + 1)) % 3)
        pixels = np.clip(rng.random((96, 96)) * 0.3 + ramp, 0, 1)
        name = str(Path(images) / f"{i:05d}.{suffix}")
        if kind == "dicom":
            window = (1500.0, 2500.0) if i % 3 == 0 else None
            syntax = DICOM_SYNTAXES[i % len(DICOM_SYNTAXES)]
            write_dicom(
                folder / name, (pixels * 4095).astype(np.uint16), syntax=syntax, window=window
            )
        else:
            Image.fromarray((pixels * 255).astype(np.uint8)).save(folder / name, quality=92)
        patient = [f"P{seed}-{i // 2:03d}"] if patients else []
        lines.append(",".join([name, *patient, *(str((i + j) % 2) for j in range(len(classes)))]))
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


def jpeg_lossless_sv1(pixels: np.ndarray, *, precision: int = 16) -> bytes:
    """A JPEG Lossless, process 14, selection value 1 bitstream (ITU-T T.81 Annex H): the most
    common lossless PACS syntax, which no Python encoder writes. One component, predictor Ra
    (left; first column: above; first pixel: 2^(P-1)), one Huffman table with a 5-bit code for
    each difference category 0..16."""
    rows, cols = pixels.shape
    x = pixels.astype(np.int64)
    pred = np.empty_like(x)
    pred[0, 0] = 1 << (precision - 1)
    pred[0, 1:] = x[0, :-1]
    pred[1:, 0] = x[:-1, 0]
    pred[1:, 1:] = x[1:, :-1]
    diff = (x - pred) % 65536
    diff = np.where(diff >= 32768, diff - 65536, diff)
    bits: list[str] = []
    for d in diff.ravel().tolist():
        size = 0 if d == 0 else int(abs(d)).bit_length()
        bits.append(format(size, "05b"))
        if 0 < size < 16:
            bits.append(format(d if d > 0 else d + (1 << size) - 1, f"0{size}b"))
    stream = "".join(bits)
    stream += "1" * (-len(stream) % 8)
    data = bytearray()
    for i in range(0, len(stream), 8):
        byte = int(stream[i : i + 8], 2)
        data.append(byte)
        if byte == 0xFF:
            data.append(0x00)  # byte stuffing
    counts = [0] * 16
    counts[4] = 17  # seventeen codes of length 5
    dht = bytes([0x00, *counts, *range(17)])
    sof = bytes([precision, rows >> 8, rows & 255, cols >> 8, cols & 255, 1, 1, 0x11, 0])
    sos = bytes([1, 1, 0x00, 1, 0, 0])  # Ns, Cs, Td/Ta, Ss = predictor 1, Se, Ah/Al

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    return (
        b"\xff\xd8"
        + segment(0xC4, dht)
        + segment(0xC3, sof)
        + segment(0xDA, sos)
        + bytes(data)
        + b"\xff\xd9"
    )

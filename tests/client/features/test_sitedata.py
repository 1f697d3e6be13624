"""Site data sources and image readers: NIH layout, manifests, PNG/DICOM decoding, bad files."""

from __future__ import annotations

import numpy as np
import pydicom
import pytest
from pydicom.uid import (
    MPEG2MPML,
    JPEG2000Lossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    RLELossless,
)

from afl.client.features.sitedata import (
    SiteDataError,
    UnreadableImageError,
    manifest_source,
    nih_source,
    read_image,
)
from tests.client.imagegen import write_dicom, write_png


def test_png_8bit_and_16bit_scaled_by_nominal_max(tmp_path):
    a8 = np.arange(0, 240, dtype=np.uint8).reshape(12, 20)
    np.testing.assert_allclose(read_image(write_png(tmp_path / "a.png", a8)), a8 / 255.0, atol=1e-7)
    a16 = (np.arange(240, dtype=np.uint16) * 273).reshape(12, 20)
    got = read_image(write_png(tmp_path / "b.png", a16))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, a16 / 65535.0, atol=1e-7)


def test_rgb_png_becomes_gray(tmp_path):
    gray = np.random.default_rng(1).integers(0, 256, (8, 9), dtype=np.uint8)
    got = read_image(write_png(tmp_path / "rgb.png", np.stack([gray] * 3, axis=-1)))
    np.testing.assert_allclose(got, gray / 255.0, atol=1e-7)


def test_dicom_monochrome2_rescale_and_monochrome1_inversion(tmp_path):
    stored = np.random.default_rng(2).integers(0, 4096, (16, 12)).astype(np.uint16)
    plain = read_image(write_dicom(tmp_path / "a.dcm", stored))
    np.testing.assert_allclose(plain, stored / 4095.0, atol=1e-6)
    # slope/intercept map the nominal range linearly: the unit image is unchanged
    rescaled = read_image(write_dicom(tmp_path / "b.dcm", stored, slope=2.0, intercept=-1024.0))
    np.testing.assert_allclose(rescaled, plain, atol=1e-6)
    # a negative slope flips the image: v -> 1 - v
    flipped = read_image(write_dicom(tmp_path / "c.dcm", stored, slope=-1.0, intercept=0.0))
    np.testing.assert_allclose(flipped, 1.0 - plain, atol=1e-6)
    inverted = read_image(write_dicom(tmp_path / "d.dcm", stored, photometric="MONOCHROME1"))
    np.testing.assert_allclose(inverted, 1.0 - plain, atol=1e-6)


def test_truncated_dicom_and_corrupt_png_raise_unreadable(tmp_path):
    dcm = write_dicom(tmp_path / "t.dcm", np.zeros((64, 64), dtype=np.uint16))
    data = dcm.read_bytes()
    dcm.write_bytes(data[: len(data) - 3000])
    with pytest.raises(UnreadableImageError, match=r"t\.dcm"):
        read_image(dcm)
    png = write_png(tmp_path / "p.png", np.zeros((64, 64), dtype=np.uint8) + 7)
    png.write_bytes(png.read_bytes()[:60])
    with pytest.raises(UnreadableImageError, match=r"p\.png"):
        read_image(png)
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(UnreadableImageError, match=r"junk\.png"):
        read_image(tmp_path / "junk.png")
    with pytest.raises(UnreadableImageError, match=r"missing\.png"):
        read_image(tmp_path / "missing.png")


def test_manifest_labels_absent_and_empty_are_minus_one(tmp_path):
    (tmp_path / "m.csv").write_text(
        "path,A,B,note\nx/1.png,1,,a\nx/2.png,0,1,b\n/abs/3.png,true,no,c\n", encoding="utf-8"
    )
    src = manifest_source(tmp_path / "m.csv", classes=["A", "B"])
    assert src.classes == ("A", "B")
    np.testing.assert_array_equal(src.labels, [[1, -1], [0, 1], [1, 0]])
    assert any("columns not extracted" in w and "note" in w for w in src.warnings)
    assert src.records[0].path == tmp_path / "x/1.png"
    assert str(src.records[2].path) == "/abs/3.png"
    assert src.labels.dtype == np.int8
    default = manifest_source(tmp_path / "m.csv", id_column="note")
    assert default.classes == ("A", "B") and [r.id for r in default.records] == ["a", "b", "c"]


def test_manifest_patient_column_is_the_privacy_unit(tmp_path):
    (tmp_path / "m.csv").write_text(
        "path,patient,A\nx/1.png,p7,1\nx/2.png,p7,0\nx/3.png,p9,1\n", encoding="utf-8"
    )
    src = manifest_source(tmp_path / "m.csv")
    assert src.classes == ("A",) and src.patients == ("p7", "p7", "p9")
    other = manifest_source(tmp_path / "m.csv", patient_column="mrn", classes=["A"])
    assert other.patients is None  # no such column: no patient ids
    (tmp_path / "e.csv").write_text("path,patient,A\nx/1.png,,1\n", encoding="utf-8")
    with pytest.raises(SiteDataError, match="empty 'patient'"):
        manifest_source(tmp_path / "e.csv")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("file,A\nx.png,1\n", "no 'path' column"),
        ("path,A\nx.png,maybe\n", "maybe"),
        ("path,A\nx.png,1\nx.png,0\n", "duplicate"),
        ("path,A\n,1\n", "empty"),
        # duplicate columns: csv.DictReader would silently keep the last one (a 1 lost)
        (
            "path,Effusion,Mass,Effusion\nx.png,1,0,0\n",
            r"'Effusion' appears twice \(columns 2 and 4\)",
        ),
        ("path,A,\nx.png,1,0\n", "column 3 has no name"),
        ("path,A,B\nx.png,1,0,1\n", r"m\.csv:2: 4 fields, the header has 3"),
        ("path,A,B\nx.png,1\n", r"m\.csv:2: 2 fields, the header has 3"),
        ("img,A\nx.png,1\n", r"no 'path' column .*--path-column"),
        ("path,Sex\nx.png,M\n", r"'Sex'.*--classes"),
    ],
)
def test_manifest_errors(tmp_path, text, message):
    (tmp_path / "m.csv").write_text(text, encoding="utf-8")
    with pytest.raises(SiteDataError, match=message):
        manifest_source(tmp_path / "m.csv")


def test_manifest_requested_class_without_a_column_is_refused_with_a_suggestion(tmp_path):
    (tmp_path / "m.csv").write_text("path,Effusion,Mass\nx.png,1,0\n", encoding="utf-8")
    with pytest.raises(
        SiteDataError, match=r"without a column: 'Efusion' \(did you mean 'Effusion'\?\)"
    ):
        manifest_source(tmp_path / "m.csv", classes=["Efusion", "Mass"])
    (tmp_path / "n.csv").write_text("path,Efusion,Mass\nx.png,1,0\n", encoding="utf-8")
    with pytest.raises(  # a misspelt column is not silently a new class
        SiteDataError,
        match=r"column 'Efusion' is not a known finding \(did you mean 'Effusion'\?\): rename",
    ):
        manifest_source(tmp_path / "n.csv")
    misspelt = manifest_source(tmp_path / "n.csv", classes=["Efusion", "Mass"])
    assert misspelt.classes == ("Efusion", "Mass")  # a site's own declared class names...
    assert any(
        "'Efusion' is not a known finding (did you mean 'Effusion'?)" in w
        for w in misspelt.warnings
    )


@pytest.mark.parametrize(
    ("uncertain_as", "expected"), [("unlabelled", -1), ("positive", 1), ("negative", 0)]
)
def test_minus_one_is_unlabelled_unless_declared_uncertain(tmp_path, uncertain_as, expected):
    (tmp_path / "m.csv").write_text(
        "path,Edema,Effusion\na.png,-1,1\nb.png,0,\nc.png,1,0\n", encoding="utf-8"
    )
    src = manifest_source(tmp_path / "m.csv", uncertain_as=uncertain_as)
    np.testing.assert_array_equal(src.labels[:, 0], [expected, 0, 1])
    assert src.labels[1, 1] == -1  # an empty cell is "not labelled" in both conventions
    partial = [w for w in src.warnings if "cannot use this class" in w]
    # Effusion stays partly labelled; Edema only while -1 means "not labelled"
    assert any("'Effusion'" in w for w in partial)
    assert any("'Edema'" in w and "--uncertain-as" in w for w in partial) == (expected == -1)
    with pytest.raises(SiteDataError, match="uncertain_as"):
        manifest_source(tmp_path / "m.csv", uncertain_as="maybe")


def _window_oracle(x, center, width):
    """DICOM PS3.3 C.11.2.1.2.1 (LINEAR), as a fraction of the output range."""
    lo, hi = center - 0.5 - (width - 1) / 2, center - 0.5 + (width - 1) / 2
    inside = (x - (center - 0.5)) / (width - 1) + 0.5
    return np.where(x <= lo, 0.0, np.where(x > hi, 1.0, inside))


def test_dicom_window_as_viewers_apply_it(tmp_path):
    stored = np.random.default_rng(5).integers(0, 4096, (64, 64)).astype(np.uint16)
    got = read_image(write_dicom(tmp_path / "w.dcm", stored, window=(1800.0, 900.0)))
    np.testing.assert_allclose(got, _window_oracle(stored.astype(float), 1800.0, 900.0), atol=1e-6)
    # the window is on the modality values (after the rescale), and MONOCHROME1 still inverts
    got = read_image(
        write_dicom(
            tmp_path / "r.dcm",
            stored,
            slope=2.0,
            intercept=-1024.0,
            window=(500.0, 3000.0),
            photometric="MONOCHROME1",
        )
    )
    want = 1.0 - _window_oracle(stored * 2.0 - 1024.0, 500.0, 3000.0)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_dicom_voi_lut_sequence_is_a_table_lookup(tmp_path):
    stored = np.random.default_rng(6).integers(0, 4096, (64, 64)).astype(np.uint16)
    first, entries = 1000, 2048
    table = (np.sqrt(np.arange(entries) / (entries - 1)) * 255).astype(np.uint16)  # 8-bit output
    path = write_dicom(tmp_path / "l.dcm", stored, voi_lut=([entries, first, 8], table))
    want = table[np.clip(stored.astype(int) - first, 0, entries - 1)] / 255.0
    np.testing.assert_allclose(read_image(path), want, atol=1e-6)


@pytest.mark.parametrize(
    "syntax", [JPEGLosslessSV1, JPEGLSLossless, JPEG2000Lossless, RLELossless], ids=lambda u: u.name
)
def test_compressed_dicom_decodes_to_the_same_image(tmp_path, syntax):
    stored = np.random.default_rng(7).integers(0, 4096, (64, 80)).astype(np.uint16)
    plain = read_image(write_dicom(tmp_path / "plain.dcm", stored))
    packed = write_dicom(tmp_path / "packed.dcm", stored, syntax=syntax)
    assert packed.stat().st_size != (tmp_path / "plain.dcm").stat().st_size
    np.testing.assert_array_equal(read_image(packed), plain)


def test_unsupported_dicom_says_what_is_supported(tmp_path):
    stored = np.zeros((64, 64), dtype=np.uint16)
    with pytest.raises(
        UnreadableImageError, match=r"'RGB' is not supported.*MONOCHROME1 or MONOCHROME2"
    ):
        read_image(write_dicom(tmp_path / "c.dcm", stored, photometric="RGB"))
    path = write_dicom(tmp_path / "j.dcm", stored + 5, syntax=JPEG2000Lossless)
    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = MPEG2MPML  # a syntax no installed plugin decodes
    ds.save_as(path)
    with pytest.raises(UnreadableImageError, match=r"MPEG2 .*re-export it from the PACS") as exc:
        read_image(path)
    assert "pip install" not in str(exc.value) and "\n" not in str(exc.value)


def _pydicom_file(name: str) -> str:
    """One of the test files pydicom ships (no download)."""
    from pydicom.data import get_testdata_file

    path = get_testdata_file(name, download=False)
    assert path is not None, f"pydicom no longer ships {name}"
    return str(path)


def test_12_bit_jpeg_extended_reads_and_a_stream_no_decoder_takes_is_named(monkeypatch):
    """12-bit JPEG Extended decodes (pylibjpeg-libjpeg); pydicom's
    ``JPEG-lossy.dcm``, whose stream every installed decoder refuses, is named with the advice
    to re-export it, never to install the decoders that are installed; when one is missing, the
    message says which and how to install it."""
    image = read_image(_pydicom_file("JPGExtended.dcm"))
    assert pydicom.dcmread(_pydicom_file("JPGExtended.dcm")).BitsStored == 12
    assert image.ndim == 2 and 0.0 <= image.min() < image.max() <= 1.0
    lossy = _pydicom_file("JPEG-lossy.dcm")
    with pytest.raises(UnreadableImageError) as exc:
        read_image(lossy)
    message = str(exc.value)
    assert "\n" not in message and "pip install" not in message
    assert "installed decoders cannot decode its 'JPEG Extended (Process 2 and 4)' data" in message
    assert "re-export it from the PACS uncompressed" in message
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libjpeg" else real(name, *a)
    )
    with pytest.raises(UnreadableImageError, match=r"decoders pylibjpeg-libjpeg are not installed"):
        read_image(lossy)


def test_a_dicom_structured_report_has_no_image(tmp_path):
    """an SR is "no image in this file", not a photometric complaint."""
    with pytest.raises(UnreadableImageError) as exc:
        read_image(_pydicom_file("test-SR.dcm"))
    assert "no image in this file" in str(exc.value)
    assert "PhotometricInterpretation" not in str(exc.value)


def test_nih_layout_kaggle_subfolders_views_and_missing_files(tmp_path):
    for folder, name in [("images_001/images", "a.png"), ("images_002/images", "b.png")]:
        (tmp_path / folder).mkdir(parents=True)
        write_png(tmp_path / folder / name, np.zeros((4, 4), dtype=np.uint8))
    (tmp_path / "Data_Entry_2017_v2020.csv").write_text(
        "Image Index,Finding Labels,Follow-up #,Patient ID,View Position\n"
        "a.png,Effusion|Mass,0,1,PA\n"
        "b.png,No Finding,0,2,AP\n"
        "c.png,Pneumonia,0,3,PA\n",
        encoding="utf-8",
    )
    src = nih_source(tmp_path)
    assert [r.id for r in src.records] == ["a.png", "b.png", "c.png"]
    assert src.records[0].path == tmp_path / "images_001/images/a.png"
    assert src.records[2].path == tmp_path / "images/c.png"  # not on disk: kept, fails later
    labels = dict(zip(src.classes, src.labels[0], strict=True))
    assert labels["Effusion"] == 1 and labels["Mass"] == 1 and sum(src.labels[0]) == 2
    assert not src.labels[1].any() and (src.labels >= 0).all()
    assert src.patients == ("1", "2", "3")  # NIH's Patient ID
    pa = nih_source(tmp_path, views=["PA"], classes=["Pneumonia"])
    assert [r.id for r in pa.records] == ["a.png", "c.png"]
    np.testing.assert_array_equal(pa.labels, [[0], [1]])


def test_nih_without_csv_is_a_clear_error(tmp_path):
    with pytest.raises(SiteDataError, match="Data_Entry_2017"):
        nih_source(tmp_path)

"""Did-you-mean hints (afl.core.suggest)."""

from __future__ import annotations

from afl.core.suggest import closest, did_you_mean, unknown_names

FINDINGS = ["Atelectasis", "Effusion", "Pneumothorax", "Mass"]


def test_close_names_are_suggested_case_blind() -> None:
    assert closest("Efusion", FINDINGS) == "Effusion"
    assert closest("pneumothorax", FINDINGS) == "Pneumothorax"
    assert did_you_mean("Efusion", FINDINGS) == " (did you mean 'Effusion'?)"
    assert did_you_mean("mask_feature_nrom", ["mask_feature_norm", "gamma"]) == (
        " (did you mean 'mask_feature_norm'?)"
    )


def test_nothing_close_or_exact_gives_no_hint() -> None:
    assert closest("Hernia", FINDINGS) is None
    assert did_you_mean("Hernia", FINDINGS) == ""
    assert did_you_mean("Mass", FINDINGS) == ""


def test_unknown_names_lists_only_the_unknown() -> None:
    assert unknown_names(["Mass", "Efusion", "Hernia"], FINDINGS) == (
        "'Efusion' (did you mean 'Effusion'?), 'Hernia'"
    )
    assert unknown_names(["Mass"], FINDINGS) == ""

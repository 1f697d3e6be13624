"""Wire protocol v1 (docs/architecture.md §1): the main messages build, serialize and parse back
unchanged, large arrays travel as little-endian bytes with explicit shapes, and the service declares
the RPCs (and streaming kinds) the daemons rely on."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc


def _plan() -> cpb.ReleasePlan:
    return cpb.ReleasePlan(
        version=1,
        federation_id="fed-1",
        round_id="round-abc",
        round_number=1,
        participants=["hospital-a", "hospital-b", "hospital-c"],
        aggregation=cpb.AGGREGATION_MODE_MASK,
        gram_scope=cpb.GRAM_SCOPE_GLOBAL,
        releases=[
            cpb.Release(
                name="gram/global",
                upload_name="gram/global",
                member_site_ids=["hospital-a", "hospital-b", "hospital-c"],
                kind=cpb.STATISTIC_KIND_GRAM,
                shape=[1024, 1024],
                encoding=cpb.Encoding(
                    dtype=cpb.DTYPE_UINT64_LE,
                    packing=cpb.PACKING_UPPER_TRIANGLE,
                    fixed_point=cpb.FixedPointEncoding(bound=1.0e6, frac_bits=24),
                ),
                noise=cpb.DpNoise(
                    mechanism=cpb.NOISE_MECHANISM_SKELLAM,
                    sigma=3.5,
                    sensitivity=1.0,
                    assumed_colluders=1,
                ),
            ),
            cpb.Release(
                name="b/global",
                upload_name="b/global",
                member_site_ids=["hospital-a", "hospital-b", "hospital-c"],
                kind=cpb.STATISTIC_KIND_CLASS_VECTOR,
                class_names=["Atelectasis", "Effusion"],
                shape=[1024, 2],
                encoding=cpb.Encoding(
                    dtype=cpb.DTYPE_UINT64_LE,
                    packing=cpb.PACKING_DENSE,
                    fixed_point=cpb.FixedPointEncoding(bound=10.0, frac_bits=40),
                ),
            ),
        ],
        dp=cpb.DpParams(enabled=True, clip_norm=1.0, delta=1e-5, epsilon=2.0),
        budgets=[cpb.SiteBudget(site_id="hospital-a", epsilon=1.993, delta=1e-5)],
        round_salt=bytes(range(32)),
    )


def test_release_plan_and_round_config_round_trip() -> None:
    plan = _plan()
    signed = cpb.SignedReleasePlan(plan=plan.SerializeToString(), signature=b"\x01" * 64)
    config = pb.RoundConfig(
        federation_id="fed-1",
        round_id="round-abc",
        round_number=2,
        parent_round_id="round-prev",
        participants=list(plan.participants),
        class_names=["Atelectasis", "Effusion"],
        feature_dim=1024,
        backbone="densenet121-res224-all",
        gamma=1.0,
        gram_scope=cpb.GRAM_SCOPE_PER_CLASS,
        aggregation=cpb.AGGREGATION_MODE_CKKS,
        refinement=pb.RefinementParams(tau=0.7, alpha=0.5, delta_pos=5, delta_neg=50),
        masking=pb.MaskingParams(threshold=2, prg="aes-256-ctr"),
        ckks=pb.CkksParams(
            decryptor_site_id="hospital-c",
            poly_modulus_degree=8192,
            coeff_mod_bit_sizes=[60, 40, 40, 60],
            global_scale_bits=40,
            security_bits=128,
        ),
        min_participants=3,
        stage_timeout_s=600,
        release_plan=signed,
        protocol_version=1,
    )
    parsed = pb.RoundConfig.FromString(config.SerializeToString())
    assert parsed == config
    assert parsed.refinement.tau == 0.7 and parsed.refinement.delta_neg == 50
    assert parsed.gram_scope == cpb.GRAM_SCOPE_PER_CLASS
    # The plan travels as the exact signed bytes and parses back to the same plan.
    inner = cpb.ReleasePlan.FromString(parsed.release_plan.plan)
    assert inner == plan
    assert inner.releases[0].encoding.WhichOneof("scheme") == "fixed_point"
    assert inner.releases[0].encoding.fixed_point.frac_bits == 24
    assert list(inner.releases[1].class_names) == ["Atelectasis", "Effusion"]
    assert inner.round_salt == bytes(range(32))


def test_enum_values_named_in_the_design_exist() -> None:
    assert cpb.GramScope.Name(cpb.GRAM_SCOPE_GLOBAL) == "GRAM_SCOPE_GLOBAL"
    assert cpb.GramScope.Name(cpb.GRAM_SCOPE_PER_CLASS) == "GRAM_SCOPE_PER_CLASS"
    modes = {cpb.AggregationMode.Name(v) for v in cpb.AggregationMode.values()}
    assert {"AGGREGATION_MODE_PLAINTEXT", "AGGREGATION_MODE_MASK", "AGGREGATION_MODE_CKKS"} <= modes
    # proto3 defaults: the zero value is always UNSPECIFIED, so an unset field is detectable.
    assert pb.RoundConfig().aggregation == cpb.AGGREGATION_MODE_UNSPECIFIED
    assert pb.RoundConfig().gram_scope == cpb.GRAM_SCOPE_UNSPECIFIED


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(min_value=1, max_value=6),
    cols=st.integers(min_value=1, max_value=6),
    values=st.lists(
        st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=36, max_size=36
    ),
)
def test_signed_model_weights_are_exact_little_endian_float64(
    rows: int, cols: int, values: list[float]
) -> None:
    w = np.asarray(values[: rows * cols], dtype=np.float64).reshape(rows, cols)
    model = pb.Model(
        version=1,
        federation_id="fed-1",
        round_id="round-abc",
        round_number=1,
        class_names=[f"c{i}" for i in range(cols)],
        weights=cpb.Tensor(
            shape=[rows, cols],
            dtype=cpb.DTYPE_FLOAT64_LE,
            packing=cpb.PACKING_DENSE,
            data=w.astype("<f8").tobytes(),
        ),
        gamma=1.0,
        decision_threshold=0.5,
        contributors=["hospital-a"],
        plan_sha256=hashlib.sha256(b"plan").digest(),
    )
    signed = pb.SignedModel(model=model.SerializeToString(), signature=b"\x02" * 64)
    back = pb.Model.FromString(pb.SignedModel.FromString(signed.SerializeToString()).model)
    shape = tuple(int(s) for s in back.weights.shape)
    assert len(back.weights.data) == 8 * shape[0] * shape[1]
    w_back = np.frombuffer(back.weights.data, dtype="<f8").reshape(shape)
    np.testing.assert_array_equal(w_back, w)  # bit-exact, no float32 detour
    assert list(back.class_names) == [f"c{i}" for i in range(cols)]


def test_upload_chunks_reassemble_to_the_digested_payload() -> None:
    payload = np.arange(10_000, dtype="<u8").tobytes()
    digest = hashlib.sha256(payload).digest()
    size = 4096
    pieces = [payload[i : i + size] for i in range(0, len(payload), size)]
    chunks = [
        pb.UploadChunk(
            round_id="round-abc",
            release_name="gram/global",
            chunk_index=i,
            total_chunks=len(pieces),
            data=piece,
            sha256=digest if i == len(pieces) - 1 else b"",
            kind=pb.PAYLOAD_KIND_STATISTIC,
            total_bytes=len(payload),
        )
        for i, piece in enumerate(pieces)
    ]
    wire = [c.SerializeToString() for c in chunks]
    parsed = [pb.UploadChunk.FromString(w) for w in wire]
    assert [c.chunk_index for c in parsed] == list(range(len(pieces)))
    assembled = b"".join(c.data for c in parsed)
    assert hashlib.sha256(assembled).digest() == parsed[-1].sha256
    assert np.array_equal(np.frombuffer(assembled, dtype="<u8"), np.arange(10_000, dtype=np.uint64))


def test_masking_and_ckks_messages_round_trip() -> None:
    share = cpb.ShamirShare(x=3, y=b"\x07" * 66)
    sealed = pb.SealedMessage(recipient_site_id="hospital-b", ciphertext=b"\x00" * 12 + b"ct")
    messages = [
        pb.EnrollRequest(
            identity_public_key=b"\x11" * 32,
            proof=b"\x22" * 64,
            role=pb.SITE_ROLE_DECRYPTOR,
            labelled_classes=["Effusion"],
            feature_dim=1024,
            protocol_version=1,
            challenge=b"\x33" * 32,
        ),
        pb.EnrolChallenge(
            nonce=b"\x44" * 32, expires_unix_ms=1_700_000_000_000, federation_id="f", site_id="s"
        ),
        pb.AdvertiseKeysRequest(
            round_id="r", cipher_public_key=b"\x01" * 32, mask_public_key=b"\x02" * 32
        ),
        pb.ShareKeysRequest(round_id="r", shares=[sealed]),
        pb.ShareBundle(
            round_id="r",
            sender_site_id="hospital-a",
            recipient_site_id="hospital-b",
            mask_key_share=share,
            self_mask_seed_share=share,
        ),
        pb.ConsistencySignature(round_id="r", survivors=["a", "b"], signature=b"\x03" * 64),
        pb.UnmaskResponse(
            round_id="r",
            shares=[
                pb.RevealedShare(
                    owner_site_id="hospital-c", type=pb.SHARE_TYPE_MASK_KEY, share=share
                )
            ],
        ),
        pb.CkksContextAnnouncement(round_id="r", context_sha256=b"\x04" * 32, size_bytes=10),
        pb.AggregateTags(
            round_id="r", site_id="a", tags=[pb.TagValue(upload_name="gram", value=0.25)]
        ),
        pb.DecryptionOutcome(
            round_id="r",
            release_name="gram/S1",
            status=pb.DECRYPTION_STATUS_REFUSED_TAG_MISMATCH,
            reason="tag slot does not match the members' tags",
        ),
        pb.SignedEvaluation(
            evaluation=pb.Evaluation(
                version=1,
                run_id="run-1",
                round_id="e2-x",
                model_round_id="r1-x",
                model_sha256=b"\x07" * 32,
                members=["a", "b", "c"],
                evaluation_json=b'{"format": "afl-federated-evaluation"}',
            ).SerializeToString(),
            signature=b"\x01" * 64,
        ),
        pb.ClientReport(
            round_id="r",
            outcome=pb.CLIENT_OUTCOME_REFUSED_PLAN,
            reason="release b/Effusion has 1 member < min cohort 3",
            timings_s={"extract": 1.5},
            bytes_sent=123,
        ),
        pb.RoundEvent(
            sequence=7,
            status=pb.RoundStatus(round_id="r", stage=pb.ROUND_STAGE_ABORTED, abort_reason="x"),
        ),
    ]
    for message in messages:
        back = type(message).FromString(message.SerializeToString())
        assert back == message, type(message).__name__
    assert pb.ClientReport.FromString(messages[-2].SerializeToString()).timings_s["extract"] == 1.5


def test_service_declares_the_rpcs_with_their_streaming_kinds() -> None:
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    methods = {m.name: m for m in service.methods}
    expected = {
        "GetEnrolChallenge",
        "Enroll",
        "GetStatus",
        "WatchRounds",
        "GetRoundConfig",
        "RespondToPlan",
        "GetGraphCommitments",
        "AdvertiseKeys",
        "GetAdvertisedKeys",
        "ShareKeys",
        "GetSharedKeys",
        "GetSurvivors",
        "ConsistencyCheck",
        "GetConsistencySignatures",
        "GetUnmaskRequest",
        "Unmask",
        "Upload",
        "Download",
        "PublishCkksContext",
        "GetCkksContext",
        "SendAggregateTags",
        "GetAggregateTags",
        "GetDecryptionJobs",
        "ReportDecryption",
        "GetModel",
        "GetEvaluation",
        "SubmitReport",
        "GetCheckpoint",
        "GetConsistencyProof",
        "GetInclusionProof",
        "GetLogEntries",
        "CosignCheckpoint",
        "RecordDpRelease",
        "RecordOpening",
        "RecordDecrypting",
    }
    assert set(methods) == expected
    streaming = {name: (m.client_streaming, m.server_streaming) for name, m in methods.items()}
    assert streaming["Upload"] == (True, False)
    assert streaming["Download"] == (False, True)
    assert streaming["WatchRounds"] == (False, True)
    assert streaming["Enroll"] == (False, False)
    assert streaming["GetEvaluation"] == (False, False)
    assert hasattr(pb_grpc, "CoordinatorStub")
    assert hasattr(pb_grpc, "add_CoordinatorServicer_to_server")

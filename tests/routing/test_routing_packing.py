"""The "rank" payload encoding: exact round trips, dense rows, both decoders, corruption, format integration."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from r3r_test_helpers import make_routes
from typer.testing import CliRunner

from r3operator.cli.routing import app
from r3operator.routing import (
    RankEncodingUnsupported,
    RoutingDataError,
    RoutingFileError,
    RoutingStore,
    decode_ranks,
    encode,
    encode_ranks,
    from_wire,
    packing,
    rank_bits,
    rank_supported,
    read_file,
    to_wire,
    write_file,
)
from r3operator.routing.store import MAGIC, read_stored

BACKENDS = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(not packing.numba_available(), reason="numba"))]


def _random_sets(tokens: int, layers: int, top_k: int, num_experts: int, *, seed: int) -> np.ndarray:
    """Random k-subsets in random order (unlike make_routes' consecutive ids); uniform for E <= 1024."""
    rng = np.random.default_rng(seed)
    if num_experts > 1024:  # sorting E keys per row gets slow: increasing random gaps, then shuffled
        gaps = rng.integers(1, num_experts // top_k + 1, size=(tokens, layers, top_k))
        return rng.permuted(np.cumsum(gaps, axis=-1) - 1, axis=-1)
    keys = rng.random((tokens, layers, num_experts))
    return np.argsort(keys, axis=-1)[..., :top_k].astype(np.int64)


def _encode(arr: np.ndarray, num_experts: int) -> bytearray:
    """Encode with every available backend, check the bytes agree, return them."""
    payload = encode_ranks(arr, num_experts=num_experts, backend="numpy")
    if packing.numba_available():
        assert encode_ranks(arr, num_experts=num_experts, backend="numba") == payload
    return payload


def _both(data: bytes | bytearray, shape: tuple[int, int, int], dtype: str, num_experts: int) -> np.ndarray:
    """Decode with every available backend, check they agree, return the result."""
    results = [decode_ranks(data, shape, dtype, num_experts=num_experts, backend="numpy")]
    if packing.numba_available():
        results.append(decode_ranks(data, shape, dtype, num_experts=num_experts, backend="numba"))
        results.append(decode_ranks(data, shape, dtype, num_experts=num_experts, backend="numba", threads=3))
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
        assert other.dtype == results[0].dtype
    assert results[0].flags.writeable and results[0].shape == shape
    return results[0]


@pytest.mark.parametrize(
    ("num_experts", "top_k", "dtype"),
    [(128, 8, "uint8"), (64, 8, "uint8"), (32, 4, "uint8"), (256, 8, "uint8"), (512, 8, "uint16"),
     (384, 9, "uint16"), (8, 1, "uint8"), (300, 2, "uint16"), (6, 6, "uint8"), (70_000, 3, "int32")],
)  # fmt: skip
def test_round_trip_sorts_rows(num_experts: int, top_k: int, dtype: str) -> None:
    arr = _random_sets(50, 7, top_k, num_experts, seed=top_k)
    payload = _encode(arr, num_experts)
    bits = rank_bits(num_experts, top_k)
    assert len(payload) == math.ceil(50 * 7 * bits / 8)
    out = _both(payload, arr.shape, dtype, num_experts)
    np.testing.assert_array_equal(out, np.sort(arr, axis=-1))


def test_bits_are_the_information_content() -> None:
    assert rank_bits(128, 8) == 41 and math.log2(math.comb(128, 8)) == pytest.approx(40.4, abs=0.05)
    assert rank_bits(64, 8) == 33  # C(64, 8) = 4.4e9 is just above 2**32
    assert rank_bits(32, 4) == 16
    assert rank_bits(8, 1) == 3  # k = 1: [0] is an ordinary set, no dense code needed
    assert rank_bits(4, 4) == 1  # one set plus the dense code


def test_extreme_ranks_round_trip() -> None:
    """The smallest and largest set of every size decode exactly (top ids, carries across words)."""
    num_experts, top_k = 128, 8
    rows = np.array([np.arange(top_k), np.arange(num_experts - top_k, num_experts), [0, 1, 2, 3, 4, 5, 6, 127]])
    arr = np.tile(rows[:, None, :], (1, 67, 1))  # 201 codes: spans several 64-code groups and partial words
    out = _both(_encode(arr, num_experts), arr.shape, "uint8", num_experts)
    np.testing.assert_array_equal(out, arr)


def test_dense_zero_rows_round_trip() -> None:
    arr = _random_sets(40, 6, 8, 128, seed=1)
    arr[:, 0] = 0  # a dense layer, as vLLM reports it
    arr[5:9, 3] = 0  # scattered uncaptured rows
    out = _both(_encode(arr, 128), arr.shape, "uint8", 128)
    np.testing.assert_array_equal(out, np.sort(arr, axis=-1))
    assert not out[:, 0].any() and not out[5:9, 3].any()


def test_unsupported_combination_is_refused_and_store_falls_back_to_raw(tmp_path: Path) -> None:
    assert math.comb(512, 22) >= 2**63
    assert not rank_supported(512, 22)
    arr = make_routes(12, 3, 22, 512, seed=2)
    with pytest.raises(RankEncodingUnsupported, match=r"2\*\*63.*C\(512, 22\).*raw"):
        encode_ranks(arr, num_experts=512)
    path = tmp_path / "big.r3r"
    written = write_file(
        path, encode(arr, num_experts=512), num_experts=512, policy_version=0, step=0, sample_id="b", encoding="rank"
    )
    assert written == "raw"
    record = read_file(path)
    assert (record.header.encoding, record.header.format_version, record.header.dtype) == ("raw", 1, "uint16")
    np.testing.assert_array_equal(record.array(), arr)  # raw keeps the original order


def test_encoder_rejects_invalid_rows() -> None:
    arr = make_routes(5, 2, 4, 16)
    arr[3, 1] = [2, 5, 2, 9]
    for backend in ("numpy", "auto"):
        with pytest.raises(RoutingDataError, match=r"duplicate.*token=3, layer=1"):
            encode_ranks(arr, num_experts=16, backend=backend)  # type: ignore[arg-type]
    with pytest.raises(RoutingDataError, match=r"\[0, 8\)"):
        encode_ranks(make_routes(5, 2, 4, 16), num_experts=8)


@settings(max_examples=60, deadline=None)
@given(
    num_experts=st.integers(1, 300),
    data=st.data(),
)
def test_property_decoders_agree_and_invert_encoding(num_experts: int, data: st.DataObject) -> None:
    top_k = data.draw(st.integers(1, min(num_experts, 12)))
    tokens = data.draw(st.integers(0, 40))
    layers = data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**32 - 1))
    arr = _random_sets(tokens, layers, top_k, num_experts, seed=seed)
    dense = np.random.default_rng(seed).random((tokens, layers)) < 0.2
    arr[dense] = 0
    if not rank_supported(num_experts, top_k):
        with pytest.raises(RankEncodingUnsupported):
            encode_ranks(arr, num_experts=num_experts)
        return
    dtype = "uint8" if num_experts <= 256 else "uint16"
    out = _both(_encode(arr, num_experts), arr.shape, dtype, num_experts)
    np.testing.assert_array_equal(out, np.sort(arr, axis=-1))


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 63), count=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_property_bit_stream_round_trip(bits: int, count: int, seed: int) -> None:
    values = np.random.default_rng(seed).integers(0, 2**bits, size=count, dtype=np.uint64)
    packed = packing.pack_bits(values, bits)
    assert len(packed) == math.ceil(count * bits / 8)
    np.testing.assert_array_equal(packing.unpack_bits(packed, count, bits), values)
    # Little-endian bit stream: code 0 sits in the lowest bits of the first bytes.
    if count:
        assert int.from_bytes(bytes(packed), "little") & ((1 << bits) - 1) == int(values[0])


def _corrupt_row(payload: bytearray, row: int, bits: int) -> None:
    """Set every bit of code ``row`` (2**bits - 1 exceeds C(E, k) + 1 for the shapes used here)."""
    for bit in range(row * bits, (row + 1) * bits):
        payload[bit // 8] |= 1 << (bit % 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_rank_is_reported_with_its_row(backend: str) -> None:
    arr = _random_sets(30, 4, 8, 128, seed=4)
    payload = encode_ranks(arr, num_experts=128)
    _corrupt_row(payload, 4 * 17 + 2, rank_bits(128, 8))  # token 17, layer 2
    with pytest.raises(RoutingDataError, match=r"corrupt rank payload.*token=17, layer=2"):
        decode_ranks(payload, arr.shape, "uint8", num_experts=128, backend=backend)  # type: ignore[arg-type]


def test_payload_length_mismatch_is_reported() -> None:
    payload = encode_ranks(_random_sets(3, 2, 8, 128, seed=0), num_experts=128)
    with pytest.raises(RoutingDataError, match="rank payload is 30 bytes, expected 31"):
        decode_ranks(payload[:-1], (3, 2, 8), "uint8", num_experts=128)


def test_numpy_fallback_without_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    arr = _random_sets(20, 3, 8, 64, seed=5)
    payload = encode_ranks(arr, num_experts=64)
    monkeypatch.setattr(packing, "_numba_kernel", lambda: None)  # as in the operator image: no numba
    assert encode_ranks(arr, num_experts=64) == payload
    out = decode_ranks(payload, arr.shape, "uint8", num_experts=64)
    np.testing.assert_array_equal(out, np.sort(arr, axis=-1))
    with pytest.raises(RoutingDataError, match="numba"):
        decode_ranks(payload, arr.shape, "uint8", num_experts=64, backend="numba")
    with pytest.raises(RoutingDataError, match="numba"):
        encode_ranks(arr, num_experts=64, backend="numba")


def test_store_rank_round_trip_and_header(tmp_path: Path) -> None:
    arr = _random_sets(64, 6, 8, 128, seed=6)
    arr[:, 0] = 0
    store = RoutingStore(tmp_path, durable=False)
    routes = encode(arr, start=3, num_experts=128)
    raw_path = store.put(step=1, sample_id="raw", routes=routes, num_experts=128, policy_version=2)
    path = store.put(step=1, sample_id="r", routes=routes, num_experts=128, policy_version=2, encoding="rank")
    record = store.get(step=1, sample_id="r")
    header = record.header
    assert (header.format_version, header.encoding, header.start, header.dtype) == (2, "rank", 3, "uint8")
    assert header.payload_bytes == math.ceil(64 * 6 * 41 / 8)
    assert (path.stat().st_size - header.payload_bytes) % 64 == 0  # payload still 64-byte aligned
    np.testing.assert_array_equal(record.array(), np.sort(arr, axis=-1))
    assert record.array().flags.writeable
    _, payload = read_stored(path)
    assert header.checksum == f"crc32:{zlib.crc32(payload):08x}"  # over the packed bytes as stored
    assert path.stat().st_size < raw_path.stat().st_size * 0.7


def test_rank_file_corruption_is_detected(tmp_path: Path) -> None:
    arr = _random_sets(20, 4, 8, 128, seed=7)
    path = tmp_path / "c.r3r"
    write_file(path, encode(arr), num_experts=128, policy_version=0, step=0, sample_id="c", encoding="rank")
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x04
    path.write_bytes(data)
    with pytest.raises(RoutingFileError, match=r"c\.r3r: payload checksum mismatch"):
        read_file(path)
    # A forged/unverified payload holding an invalid rank is still refused, naming the file and the row.
    offset = len(data) - read_stored(path)[0].payload_bytes
    payload = data[offset:]
    _corrupt_row(payload, 4 * 9 + 1, 41)
    path.write_bytes(bytes(data[:offset]) + bytes(payload))
    with pytest.raises(RoutingFileError, match=r"c\.r3r: corrupt rank payload.*token=9, layer=1"):
        read_file(path, verify=False)


def _golden_v1_file(path: Path, arr: np.ndarray) -> None:
    """A version-1 file built by hand from docs/routing-format.md, independent of the current writer."""
    payload = arr.astype("<u1").tobytes()
    header = {
        "checksum": f"crc32:{zlib.crc32(payload):08x}",
        "dtype": "uint8",
        "num_experts": 64,
        "policy_version": 1,
        "sample_id": "old",
        "shape": list(arr.shape),
        "start": 0,
        "step": 5,
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<HHII", 1, 0, len(head), zlib.crc32(head))
    padding = b"\0" * (-(len(prefix) + len(head)) % 64)
    path.write_bytes(prefix + head + padding + payload)


def test_old_raw_files_still_read_and_raw_writes_unchanged(tmp_path: Path) -> None:
    arr = make_routes(10, 3, 8, 64, seed=8, dtype="uint8")
    golden = tmp_path / "old.r3r"
    _golden_v1_file(golden, arr)
    record = read_file(golden)
    assert (record.header.format_version, record.header.encoding) == (1, "raw")
    np.testing.assert_array_equal(record.array(), arr)  # raw keeps the original order
    # Raw files written today are byte-identical to the version-1 layout, so older readers keep reading them.
    fresh = tmp_path / "fresh.r3r"
    write_file(fresh, encode(arr, num_experts=64), num_experts=64, policy_version=1, step=5, sample_id="old")
    assert fresh.read_bytes() == golden.read_bytes()


def test_version1_header_claiming_rank_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "v.r3r"
    write_file(path, encode(make_routes(4, 2, 8, 128)), num_experts=128, policy_version=0, step=0, sample_id="v",
               encoding="rank")  # fmt: skip
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, len(MAGIC), 1)
    path.write_bytes(data)
    with pytest.raises(RoutingFileError, match="version 1 holds raw payloads only"):
        read_file(path)


def test_wire_rank_form() -> None:
    arr = _random_sets(16, 5, 8, 64, seed=9)
    routes = encode(arr, start=4, num_experts=64)
    wire = to_wire(routes, encoding="rank", num_experts=64)
    assert (wire["encoding"], wire["num_experts"], wire["shape"], wire["start"]) == ("rank", 64, [16, 5, 8], 4)
    assert len(json.dumps(wire["data"])) < len(json.dumps(to_wire(routes)["data"])) * 0.6
    back = from_wire(json.loads(json.dumps(wire)))
    assert (back.start, back.dtype, back.shape) == (4, "uint8", (16, 5, 8))
    np.testing.assert_array_equal(encode_back := np.asarray(back.data).reshape(back.shape), np.sort(arr, axis=-1))
    assert encode_back.flags.writeable
    assert "encoding" not in to_wire(routes)  # the raw form is unchanged
    with pytest.raises(RoutingDataError, match="num_experts"):
        to_wire(routes, encoding="rank")
    with pytest.raises(RoutingDataError, match="num_experts"):
        from_wire({**wire, "num_experts": None})
    with pytest.raises(RoutingDataError, match="encoding"):
        from_wire({**wire, "encoding": "zstd"})


def test_cli_encode_rank_and_inspect(tmp_path: Path) -> None:
    runner = CliRunner()
    arr = _random_sets(30, 4, 8, 128, seed=10)
    npy = tmp_path / "in.npy"
    np.save(npy, arr)
    out = tmp_path / "s.r3r"
    result = runner.invoke(
        app, ["encode", "--npy", str(npy), "--out", str(out), "--num-experts", "128", "--encoding", "rank"]
    )
    assert result.exit_code == 0, result.output
    assert "encoding=rank" in result.stdout
    shown = json.loads(runner.invoke(app, ["inspect", str(out)]).stdout)
    assert (shown["encoding"], shown["rank_bits"], shown["checksum_ok"]) == ("rank", 41, True)
    assert shown["payload_bytes"] == math.ceil(30 * 4 * 41 / 8)
    back = tmp_path / "back.npy"
    assert runner.invoke(app, ["decode", str(out), "--npy", str(back)]).exit_code == 0
    np.testing.assert_array_equal(np.load(back), np.sort(arr, axis=-1))
    bad = runner.invoke(app, ["encode", "--npy", str(npy), "--out", str(out), "--encoding", "zip"])
    assert bad.exit_code == 1 and "--encoding" in bad.stderr


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(128, 8), (64, 8), (256, 8), (512, 8), (32, 4), (300, 2), (8, 1)]),
    rows=st.integers(1, 70),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_arbitrary_payload_never_yields_invalid_rows(shape: tuple[int, int], rows: int, seed: int) -> None:
    """Any byte string of the right length either decodes to valid sorted sets (or zero rows), identically
    in both decoders, or is refused naming the same row; the kernel never reads or writes out of bounds."""
    num_experts, top_k = shape
    data = np.random.default_rng(seed).integers(0, 256, size=math.ceil(rows * rank_bits(*shape) / 8), dtype=np.uint8)
    outcomes = []
    for backend in ["numpy", "numba"] if packing.numba_available() else ["numpy"]:
        try:
            outcomes.append(decode_ranks(data.tobytes(), (rows, 1, top_k), "uint8", num_experts=num_experts,
                                         backend=backend))  # type: ignore[arg-type]  # fmt: skip
        except RoutingDataError as exc:
            outcomes.append(str(exc))
    assert all(type(o) is type(outcomes[0]) for o in outcomes)
    if isinstance(outcomes[0], str):
        assert len(set(outcomes)) == 1 and "row (token=" in outcomes[0]
        return
    for other in outcomes[1:]:
        np.testing.assert_array_equal(other, outcomes[0])
    ids = outcomes[0].astype(np.int64).reshape(rows, top_k)
    zero = ~ids.any(axis=1)
    assert (np.diff(ids[~zero], axis=1) > 0).all() and (ids < num_experts).all()


def test_ids_that_do_not_fit_the_dtype_are_refused() -> None:
    arr = np.array([[[3, 300]]])
    payload = encode_ranks(arr, num_experts=512)
    with pytest.raises(RoutingDataError, match=r"token=0, layer=0.*do not fit dtype uint8"):
        decode_ranks(payload, (1, 1, 2), "uint8", num_experts=512)
    np.testing.assert_array_equal(decode_ranks(payload, (1, 1, 2), "uint16", num_experts=512), arr)

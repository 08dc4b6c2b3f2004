"""Codec: dtype narrowing, validation, zero-copy decode, wire and vLLM forms."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from r3r_test_helpers import make_routes

from r3operator.routing import (
    RoutedExperts,
    RoutingDataError,
    decode,
    encode,
    from_vllm,
    from_wire,
    narrowest_dtype,
    to_torch,
    to_wire,
    validate_routes,
)


@pytest.mark.parametrize(
    ("num_experts", "expected"),
    [(8, "uint8"), (256, "uint8"), (257, "uint16"), (65536, "uint16"), (70000, "int32")],
)
def test_round_trip_narrows_by_num_experts(num_experts: int, expected: str) -> None:
    arr = make_routes(50, 4, 6, num_experts, seed=num_experts)
    arr[0, 0] = np.arange(num_experts - 6, num_experts)  # the largest id must survive narrowing
    routes = encode(arr, start=3, num_experts=num_experts)
    assert routes.dtype == expected
    assert routes.start == 3 and routes.shape == (50, 4, 6)
    assert routes.nbytes == arr.size * np.dtype(expected).itemsize
    out = decode(routes, num_experts=num_experts)
    assert out.dtype == np.dtype(expected)
    np.testing.assert_array_equal(out, arr)


def test_narrowest_dtype_boundaries() -> None:
    assert narrowest_dtype(255) == np.uint8
    assert narrowest_dtype(256) == np.uint16
    assert narrowest_dtype(65535) == np.uint16
    assert narrowest_dtype(65536) == np.int32
    with pytest.raises(RoutingDataError):
        narrowest_dtype(-1)


def test_encode_copies_so_caller_mutation_does_not_leak() -> None:
    arr = make_routes(4, 2, 2, 16).astype(np.uint8)
    routes = encode(arr, num_experts=16)
    arr[:] = 0
    assert decode(routes).any()


def test_decode_is_zero_copy_and_writable_on_bytearray() -> None:
    routes = encode(make_routes(10, 3, 4, 32), num_experts=32)
    assert isinstance(routes.data, bytearray)
    out = decode(routes)
    assert out.flags.writeable
    out[0, 0, 0] = 31
    assert routes.data[0] == 31  # shares memory with the payload


def test_decode_copies_readonly_bytes_once() -> None:
    arr = make_routes(10, 3, 4, 32).astype(np.int32)
    routes = RoutedExperts(data=arr.tobytes(), shape=arr.shape, dtype="int32")
    out = decode(routes)
    assert out.flags.writeable
    out += 1  # must not touch the immutable source
    np.testing.assert_array_equal(np.frombuffer(routes.data, dtype=np.int32).reshape(arr.shape), arr)


def test_wrong_byte_length_rejected() -> None:
    with pytest.raises(RoutingDataError, match="byte length 47"):
        RoutedExperts(data=bytearray(47), shape=(2, 3, 8), dtype="uint8")
    with pytest.raises(RoutingDataError, match="byte length"):
        from_wire({"data": base64.b64encode(bytes(47)).decode(), "shape": [2, 3, 8], "dtype": "uint8"})


@pytest.mark.parametrize(
    ("mutate", "num_experts", "message"),
    [
        (lambda a: a.__setitem__((3, 1, 0), 64), 64, "out of range"),
        (
            lambda a: a.__setitem__((2, 1, 1), a[2, 1, 0]),
            64,
            r"duplicate expert id in row \(token=2, layer=1\)",
        ),
        (lambda a: a.__setitem__((0, 0, 0), -1), None, "negative"),
    ],
)
def test_validate_rejects_bad_ids(mutate, num_experts: int | None, message: str) -> None:
    arr = make_routes(5, 2, 4, 64, seed=1)
    mutate(arr)
    with pytest.raises(RoutingDataError, match=message):
        validate_routes(arr, num_experts=num_experts)
    with pytest.raises(RoutingDataError, match=message):
        encode(arr, num_experts=num_experts)


def test_duplicate_detected_with_large_top_k_sort_path() -> None:
    arr = make_routes(3, 2, 40, 512)
    validate_routes(arr, num_experts=512)
    arr[1, 1, 39] = arr[1, 1, 0]
    with pytest.raises(RoutingDataError, match=r"token=1, layer=1"):
        validate_routes(arr, num_experts=512)


def test_all_zero_rows_are_dense_layers_not_duplicates() -> None:
    arr = make_routes(6, 4, 8, 128)
    arr[:, 0] = 0  # vLLM reports dense layers as zero rows (absolute layer index)
    validate_routes(arr, num_experts=128)
    arr[2, 1, :2] = 0  # a real row with expert 0 twice is still a duplicate
    with pytest.raises(RoutingDataError, match="duplicate"):
        validate_routes(arr, num_experts=128)


@pytest.mark.parametrize("bad", [np.zeros((4, 8)), np.zeros((1, 2, 3, 4)), np.zeros((2, 2, 2), dtype=np.float32)])
def test_validate_rejects_non_3d_and_non_integer(bad: np.ndarray) -> None:
    with pytest.raises(RoutingDataError, match=r"3-D|integer"):
        encode(bad)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_wire_round_trip_keeps_dtype_and_start(dtype: str) -> None:
    arr = make_routes(20, 3, 4, 200)
    routes = RoutedExperts(data=bytearray(arr.astype(dtype).tobytes()), shape=arr.shape, dtype=dtype, start=9)
    wire = to_wire(routes)
    assert set(wire) == {"data", "shape", "dtype", "start"}
    back = from_wire(wire)
    assert (back.shape, back.dtype, back.start) == ((20, 3, 4), dtype, 9)
    assert isinstance(back.data, bytearray)
    np.testing.assert_array_equal(decode(back), arr)


def test_from_wire_refuses_a_payload_encoding_it_cannot_read() -> None:
    wire = {**to_wire(encode(np.zeros((2, 3, 2), dtype=np.uint8) + np.arange(2, dtype=np.uint8))), "encoding": "rank"}
    with pytest.raises(RoutingDataError, match="encoding 'rank' is not supported"):
        from_wire(wire)


def test_from_wire_rejects_garbage() -> None:
    with pytest.raises(RoutingDataError, match="missing"):
        from_wire({"shape": [1, 1, 1], "dtype": "uint8"})
    with pytest.raises(RoutingDataError, match="base64"):
        from_wire({"data": "not base64!!", "shape": [1, 1, 1], "dtype": "uint8"})
    with pytest.raises(RoutingDataError, match="dtype"):
        from_wire({"data": "AA==", "shape": [1, 1, 1], "dtype": "float32"})


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("source_dtype", ["uint8", "uint16", "int32"])
def test_from_vllm_accepts_array_and_openai_base64_npy(source_dtype: str) -> None:
    arr = make_routes(12, 5, 4, 128, dtype=source_dtype)
    arr[:, :1] = 0  # dense first layer
    for value in (arr, _npy_b64(arr), _npy_b64(arr).encode()):
        routes = from_vllm(value, start=4, num_experts=128)
        assert (routes.dtype, routes.start) == ("uint8", 4)
        np.testing.assert_array_equal(decode(routes), arr)


def test_from_vllm_rejects_non_npy_and_none() -> None:
    with pytest.raises(RoutingDataError, match=r"\.npy"):
        from_vllm(base64.b64encode(b"\x89PNG\r\n\x1a\nrest").decode())
    with pytest.raises(RoutingDataError, match="None"):
        from_vllm(None)  # type: ignore[arg-type]


def test_data_plane_does_not_import_torch() -> None:
    code = "import sys, r3operator.routing, r3operator.cli.routing; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_to_torch_is_writable_even_from_immutable_bytes(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    arr = make_routes(8, 3, 4, 100).astype(dtype)
    routes = RoutedExperts(data=arr.tobytes(), shape=arr.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "buffer is not writable" would fail here
        tensor = to_torch(routes)
        tensor[0, 0, 0] = 7  # in-place op on the compact dtype (int32: the prime-rl no-op .to() case)
    assert tensor.shape == (8, 3, 4)
    np.testing.assert_array_equal(np.frombuffer(routes.data, dtype=dtype).reshape(arr.shape), arr)
    assert to_torch(routes, dtype=torch.int64).dtype == torch.int64


@pytest.mark.slow
def test_to_torch_is_zero_copy_on_bytearray() -> None:
    pytest.importorskip("torch")
    routes = encode(make_routes(8, 3, 4, 100), num_experts=100)
    tensor = to_torch(routes)
    tensor[1, 2, 3] = 99
    assert decode(routes)[1, 2, 3] == 99


@st.composite
def routes_arrays(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    num_experts = draw(st.sampled_from([1, 2, 8, 255, 256, 257, 1000, 65536, 65537, 100_000]))
    top_k = draw(st.integers(1, min(num_experts, 9)))
    shape = (draw(st.integers(0, 17)), draw(st.integers(1, 5)))
    dtype = draw(st.sampled_from(["int32", "int64", "uint32"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_routes(*shape, top_k, num_experts, seed=seed, dtype=dtype), num_experts


@settings(max_examples=60, deadline=None)
@given(case=routes_arrays(), start=st.integers(0, 10_000))
def test_property_encode_decode_round_trip(case: tuple[np.ndarray, int], start: int) -> None:
    arr, num_experts = case
    routes = encode(arr, start=start, num_experts=num_experts)
    assert routes.dtype == narrowest_dtype(num_experts - 1).name
    out = decode(routes, num_experts=num_experts)
    assert out.shape == arr.shape and out.flags.writeable
    np.testing.assert_array_equal(out, arr)


@settings(max_examples=60, deadline=None)
@given(case=routes_arrays(), start=st.integers(0, 10_000))
def test_property_wire_round_trip(case: tuple[np.ndarray, int], start: int) -> None:
    arr, num_experts = case
    routes = encode(arr, start=start)
    back = from_wire(to_wire(routes))
    assert (back.shape, back.dtype, back.start) == (routes.shape, routes.dtype, start)
    np.testing.assert_array_equal(decode(back, num_experts=num_experts), arr)


def test_stdlib_base64_fallback_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.routing import codec

    monkeypatch.setattr(codec, "_pybase64", None)  # as on a host without pybase64
    arr = make_routes(9, 3, 4, 300)
    back = from_wire(to_wire(encode(arr)))
    assert isinstance(back.data, bytearray)
    np.testing.assert_array_equal(decode(back), arr)
    with pytest.raises(RoutingDataError, match="base64"):
        from_wire({"data": "###", "shape": [1, 1, 1], "dtype": "uint8"})


def test_decode_accepts_typed_writable_memoryview_zero_copy() -> None:
    arr = make_routes(6, 2, 4, 1000).astype("<u2")
    out = decode(RoutedExperts(data=memoryview(arr), shape=arr.shape, dtype="uint16"))
    out[0, 0, 0] = 999
    assert arr[0, 0, 0] == 999
